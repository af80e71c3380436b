"""The vLLM integration's settings, in one place, torch-free (any vLLM process may import
this, the API server's included).

Two sources, the second overriding the first field by field:

* the environment, read by every vLLM process (workers inherit it):
  ``PLE_MEMOPS_TABLE_BACKEND=mmap`` (``default`` or unset: off) and ``PLE_MEMOPS_TIMEOUT``
  (seconds, default 30);
* an engine's ``additional_config={"ple_memops": {"table_backend": "mmap", "timeout": 60}}``
  (``--additional-config`` on the command line), which is part of vLLM's config hash.

vLLM loads its general plugins before any configuration exists, so only the environment
can install the plugin's classes; ``additional_config`` then chooses per engine (an
engine with ``"table_backend": "default"`` runs vLLM's own code paths, in the same
process as one that serves mmap tables) and sets the timeout.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgumentError
from ..settings import COPIES, DEFAULT_TIMEOUT, DEPTH

__all__ = [
    "BACKENDS",
    "BACKEND_ENV",
    "CONFIG_KEY",
    "DEFAULT_TIMEOUT",
    "DEPTH",
    "TIMEOUT_ENV",
    "Settings",
]

BACKEND_ENV = "PLE_MEMOPS_TABLE_BACKEND"
TIMEOUT_ENV = "PLE_MEMOPS_TIMEOUT"
COPY_ENV = "PLE_MEMOPS_COPY"
CONFIG_KEY = "ple_memops"
"""The key of ``additional_config`` that holds these settings."""
BACKENDS = ("default", "mmap")
# DEFAULT_TIMEOUT (seconds a step may wait for its rows: the watchdog, and completing a
# pending step) and DEPTH (steps armed at once) are the core's: ple_memops.settings.


def _choice(value: object, where: str, choices: tuple[str, ...]) -> str:
    """``value`` as one of ``choices`` (case and spaces ignored; empty: the first)."""
    text = str(value).strip().lower() if value is not None else ""
    if text == "":
        return choices[0]
    if text not in choices:
        raise InvalidArgumentError(
            f"{where} must be {' or '.join(repr(c) for c in choices[::-1])}, got {value!r}"
            if len(choices) == 2
            else f"{where} must be one of {', '.join(choices)}, got {value!r}"
        )
    return text


def _backend(value: object, where: str) -> str:
    return _choice(value, where, BACKENDS)


def _copy(value: object, where: str) -> str:
    return _choice(value, where, COPIES)


def _timeout(value: object, where: str) -> float:
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        seconds = math.nan
    if isinstance(value, bool) or not (seconds > 0 and math.isfinite(seconds)):
        raise InvalidArgumentError(f"{where} must be a positive number of seconds, got {value!r}")
    return seconds


@dataclass(frozen=True)
class Settings:
    """What the integration does for one engine (see the module)."""

    table_backend: str = "default"
    timeout: float = DEFAULT_TIMEOUT
    copy: str = "auto"
    """The device side of a deferred step (:class:`~ple_memops.DeferredRows`'s ``copy``):
    ``"auto"``, ``"kernel"`` (one polling block) or ``"memop"`` (stream memory operations
    and a copy-engine H2D)."""

    @property
    def mmap(self) -> bool:
        return self.table_backend == "mmap"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The environment's settings; a bad value raises
        :class:`~ple_memops.InvalidArgumentError` naming the variable."""
        env = os.environ if environ is None else environ
        backend = _backend(env.get(BACKEND_ENV), BACKEND_ENV)
        raw = env.get(TIMEOUT_ENV)
        timeout = DEFAULT_TIMEOUT if raw is None else _timeout(raw, TIMEOUT_ENV)
        return cls(backend, timeout, _copy(env.get(COPY_ENV), COPY_ENV))

    @classmethod
    def for_engine(
        cls, additional_config: object, environ: Mapping[str, str] | None = None
    ) -> Settings:
        """An engine's settings: the environment's, overridden by
        ``additional_config["ple_memops"]`` (a mapping with the keys ``table_backend`` and
        ``timeout``, each optional). Unknown keys and bad values raise."""
        base = cls.from_env(environ)
        section = _section(additional_config)
        if section is None:
            return base
        unknown = sorted(set(section) - {"table_backend", "timeout", "copy"})
        if unknown:
            raise InvalidArgumentError(
                f"additional_config[{CONFIG_KEY!r}] has unknown keys {unknown}; "
                "known: 'table_backend', 'timeout', 'copy'"
            )
        backend = base.table_backend
        if "table_backend" in section:
            backend = _backend(
                section["table_backend"], f"additional_config[{CONFIG_KEY!r}]['table_backend']"
            )
            if section["table_backend"] in (None, ""):
                backend = "default"
        timeout = base.timeout
        if "timeout" in section:
            timeout = _timeout(section["timeout"], f"additional_config[{CONFIG_KEY!r}]['timeout']")
        copy = base.copy
        if "copy" in section:
            copy = _copy(section["copy"], f"additional_config[{CONFIG_KEY!r}]['copy']")
        return cls(backend, timeout, copy)


def _section(additional_config: object) -> Mapping[str, Any] | None:
    if additional_config is None:
        return None
    if not isinstance(additional_config, Mapping):
        # vLLM also allows a hashable config object; ours lives under a dict key only.
        return None
    section = additional_config.get(CONFIG_KEY)
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise InvalidArgumentError(
            f"additional_config[{CONFIG_KEY!r}] must be a mapping, got {type(section).__name__}"
        )
    return section


def installed_by_env(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment switches the plugin on (what the plugin reads at load)."""
    return Settings.from_env(environ).mmap
