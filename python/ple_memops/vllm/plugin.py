"""The vLLM general plugin (entry point ``ple_memops`` in the group
``vllm.general_plugins``), loaded by vLLM in each of its processes before a model runner
is built.

Off (``PLE_MEMOPS_TABLE_BACKEND`` unset or ``default``) it does nothing: no class of
vLLM's is rebound and nothing of ours that needs torch is imported. On
(``PLE_MEMOPS_TABLE_BACKEND=mmap``) it first checks every name of vLLM's it relies on
(:mod:`._compat`; any difference refuses to start, naming the version and what differs,
with nothing installed), then installs, all or nothing:

* the Qwen4Exp, Gemma 4 and Gemma 3n (multimodal) architectures
  (``ModelRegistry.register_model`` replaces vLLM's entries): the subclasses of
  :mod:`~ple_memops.vllm.qwen4exp`, :mod:`~ple_memops.vllm.gemma4` and
  :mod:`~ple_memops.vllm.gemma3n`;
* their config hooks, extended with the mmap backend's refusals (Gemma 3n, which has
  none of vLLM's, gets one) and, for an engine the plugin serves on CUDA, its worker
  (``ParallelConfig.worker_cls``: :class:`~ple_memops.vllm.worker.PleWorker`, which
  builds :class:`~ple_memops.vllm.runner.PleGPUModelRunner`). No class of vLLM's is
  rebound: other engines keep vLLM's worker and runner (a CPU engine's among them).

Each engine then chooses with ``additional_config={"ple_memops": {...}}`` (see
:mod:`.settings`); one that says ``"table_backend": "default"`` runs vLLM's code paths.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .settings import BACKEND_ENV, Settings, engine_settings, raise_refusals

__all__ = ["Installed", "install", "installed", "register"]

logger = logging.getLogger("ple_memops")

_LOCK = threading.Lock()
_INSTALLED: Installed | None = None


@dataclass
class Installed:
    """What :func:`install` changed, and how to put it back (tests use :meth:`undo`)."""

    vllm_version: str
    changes: list[str] = field(default_factory=list)
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def undo(self) -> None:
        global _INSTALLED
        with _LOCK:
            while self._undo:
                self._undo.pop()()
            self.changes.clear()
            if _INSTALLED is self:
                _INSTALLED = None


def _set(record: Installed, owner: Any, name: str, value: Any, what: str) -> None:
    had = name in vars(owner) if isinstance(owner, type) else hasattr(owner, name)
    old = getattr(owner, name, None)

    def restore() -> None:
        if had:
            setattr(owner, name, old)
        else:
            delattr(owner, name)

    setattr(owner, name, value)
    record._undo.append(restore)
    record.changes.append(what)


def _set_item(record: Installed, mapping: Any, key: str, value: Any, what: str) -> None:
    had = key in mapping
    old = mapping.get(key)

    def restore() -> None:
        if had:
            mapping[key] = old
        else:
            del mapping[key]

    mapping[key] = value
    record._undo.append(restore)
    record.changes.append(what)


def install() -> Installed:
    """Check the installed vLLM, then install the runner, the models and the config
    hooks (idempotent). Raises :class:`~ple_memops.UnsupportedError` with every
    difference, installing nothing, when vLLM is not one this plugin was tested with."""
    global _INSTALLED
    from . import _compat

    with _LOCK:
        if _INSTALLED is not None:
            return _INSTALLED
        version = _compat.require()
        from vllm.model_executor.models import ModelRegistry
        from vllm.model_executor.models import config as model_configs

        from . import gemma3n, gemma4, qwen4exp

        models = (qwen4exp, gemma4, gemma3n)
        record = Installed(version)
        try:
            _log_through_vllm(record)
            architectures = {a: c for m in models for a, c in m.ARCHITECTURES.items()}
            for arch, cls in architectures.items():
                previous = ModelRegistry.models.get(arch)

                def restore(arch: str = arch, previous: Any = previous) -> None:
                    if previous is None:
                        ModelRegistry.models.pop(arch, None)
                    else:
                        ModelRegistry.models[arch] = previous

                ModelRegistry.register_model(arch, cls)
                record._undo.append(restore)
                record.changes.append(f"model {arch} -> {cls.__qualname__}")
            # An architecture without a hook of vLLM's (Gemma 3n) gets one: the base's no-op.
            base = model_configs.VerifyAndUpdateConfig
            hooks = {
                arch: _extended_config_hook(model_configs.MODELS_CONFIG_MAP.get(arch, base), m)
                for m in models
                for arch in m.ARCHITECTURES
            }
            for arch, hook in hooks.items():
                _set_item(
                    record,
                    model_configs.MODELS_CONFIG_MAP,
                    arch,
                    hook,
                    f"config hook {arch} -> {hook.__qualname__}",
                )
        except BaseException:
            while record._undo:
                record._undo.pop()()
            raise
        _INSTALLED = record
        logger.info(
            "ple-memops: vLLM %s plugin installed (%s=mmap): %s",
            version,
            BACKEND_ENV,
            "; ".join(record.changes),
        )
        return record


def _extended_config_hook(base: Any, model: Any) -> type:
    """vLLM's config hook ``base`` for an architecture, with ``model``'s
    ``verify_and_update_config`` (the mmap backend's refusals) right after its own, then,
    for an engine that serves mmap tables or times its graphs, the plugin's worker."""

    def verify(vllm_config: Any) -> None:
        base.verify_and_update_config(vllm_config)
        model.verify_and_update_config(vllm_config)
        settings = engine_settings(vllm_config)
        if settings.mmap or settings.time_graphs:
            from .worker import place_worker

            refused = place_worker(vllm_config)
            raise_refusals([refused] if refused else [])

    return type(
        f"PleMemops{base.__name__}",
        (base,),
        {"verify_and_update_config": staticmethod(verify), "__module__": model.__name__},
    )


class _ToVllmLogger(logging.Handler):
    """Hands each record to vLLM's ``vllm`` logger, whose handlers (set up by vLLM when
    an engine or a command configures logging, and replaced when it reconfigures) format
    and filter it as vLLM's own (``VLLM_LOGGING_LEVEL``)."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("vllm").handle(record)


def _log_through_vllm(record: Installed) -> None:
    """Our records in vLLM's log. vLLM configures only its ``vllm`` logger (a handler of
    its own, no propagation), so without this the ``ple_memops`` logger's records reached
    Python's last-resort handler alone: warnings unformatted, info lines (what was
    mapped, the stats) lost. A ``ple_memops`` logger that already has handlers (its user
    configured it) is left alone."""
    ours = logging.getLogger("ple_memops")
    if ours.handlers:
        return
    saved = (ours.level, ours.propagate)
    handler = _ToVllmLogger()

    def restore() -> None:
        ours.removeHandler(handler)
        ours.setLevel(saved[0])
        ours.propagate = saved[1]

    ours.addHandler(handler)
    ours.setLevel(logging.DEBUG)  # vLLM's handler filters by its level
    ours.propagate = False  # as vLLM's own loggers: once, through vLLM's handler
    record._undo.append(restore)
    record.changes.append("logger ple_memops -> vLLM's")


def installed() -> Installed | None:
    """What is installed in this process, or ``None``."""
    return _INSTALLED


def register() -> None:
    """The entry point vLLM calls in each of its processes: installs when the
    environment switches the mmap backend on, else does nothing."""
    if not Settings.from_env().mmap:
        return
    install()
