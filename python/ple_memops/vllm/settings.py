"""The vLLM integration's settings, in one place, torch-free (any vLLM process may import
this, the API server's included).

Two sources, the second overriding the first field by field:

* the environment, read by every vLLM process (workers inherit it):
  ``PLE_MEMOPS_TABLE_BACKEND=mmap`` (``default`` or unset: off), ``PLE_MEMOPS_TIMEOUT``
  (seconds, default 30), ``PLE_MEMOPS_COPY``, ``PLE_MEMOPS_SPIN``,
  ``PLE_MEMOPS_STATS_EVERY``, ``PLE_MEMOPS_FIRST_LAYER_THREADS``, ``PLE_MEMOPS_TIME_STALLS``,
  ``PLE_MEMOPS_PREDICT_READY``, ``PLE_MEMOPS_TIME_GRAPHS``, ``PLE_MEMOPS_SPLIT_ROWS``,
  ``PLE_MEMOPS_READ_IN_ORDER`` and the diagnostic ``PLE_MEMOPS_DIAG_SKIP_GATHER`` (see
  :class:`Settings`);
* an engine's ``additional_config={"ple_memops": {"table_backend": "mmap", "timeout": 60}}``
  (``--additional-config`` on the command line), which is part of vLLM's config hash.

vLLM loads its general plugins before any configuration exists, so only the environment
can install the plugin's classes; ``additional_config`` then chooses per engine (an
engine with ``"table_backend": "default"`` runs vLLM's own code paths, in the same
process as one that serves mmap tables) and sets the timeout.

The removed settings of :data:`REMOVED` are refused when switched on, from either source.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..errors import InvalidArgumentError, UnsupportedError
from ..settings import COPIES, DEFAULT_TIMEOUT, DEPTH

__all__ = [
    "BACKENDS",
    "BACKEND_ENV",
    "CONFIG_KEY",
    "COPY_ENV",
    "DEFAULT_TIMEOUT",
    "DEPTH",
    "EARLY_JOIN_ENV",
    "FIRST_LAYER_THREADS_ENV",
    "KEYS",
    "PREDICT_READY_ENV",
    "REMOVED",
    "SKIP_GATHER_ENV",
    "SPIN_ENV",
    "SPLIT_REST_THREADS",
    "SPLIT_ROWS_ENV",
    "STATS_ENV",
    "TIMEOUT_ENV",
    "TIME_GRAPHS_ENV",
    "TIME_STALLS_ENV",
    "Settings",
    "engine_settings",
    "parallel_refusals",
    "raise_refusals",
]

BACKEND_ENV = "PLE_MEMOPS_TABLE_BACKEND"
TIMEOUT_ENV = "PLE_MEMOPS_TIMEOUT"
COPY_ENV = "PLE_MEMOPS_COPY"
SPIN_ENV = "PLE_MEMOPS_SPIN"
STATS_ENV = "PLE_MEMOPS_STATS_EVERY"
FIRST_LAYER_THREADS_ENV = "PLE_MEMOPS_FIRST_LAYER_THREADS"
TIME_STALLS_ENV = "PLE_MEMOPS_TIME_STALLS"
SKIP_GATHER_ENV = "PLE_MEMOPS_DIAG_SKIP_GATHER"
PREDICT_READY_ENV = "PLE_MEMOPS_PREDICT_READY"
TIME_GRAPHS_ENV = "PLE_MEMOPS_TIME_GRAPHS"
EARLY_JOIN_ENV = "PLE_MEMOPS_DIAG_EARLY_JOIN"
SPLIT_ROWS_ENV = "PLE_MEMOPS_SPLIT_ROWS"
READ_IN_ORDER_ENV = "PLE_MEMOPS_READ_IN_ORDER"

REMOVED = {
    "expect_prefill": (
        "PLE_MEMOPS_EXPECT_PREFILL",
        "the host computed prefill chunks' row ids and armed the step with them; it moved "
        "the mixed load's ITL by -0.3%, inside the run-to-run spread",
    ),
    "expect_decode": (
        "PLE_MEMOPS_EXPECT_DECODE",
        "the host computed decode tokens' row ids from the tokens the step before sampled; "
        "it cost +8.2% ITL at c64, its ids 162 us a step on the engine's thread",
    ),
}
"""Settings that no longer exist, by ``additional_config`` key: each one's environment
variable and what it did and measured. Switched on (or given a value that is not off)
they raise :class:`~ple_memops.InvalidArgumentError`; off, they are ignored."""

SPLIT_REST_THREADS = 8
"""Gather threads of its own for a split row's rest (every layer's slices but layer 0's,
1.3 MiB a 64-token step on Gemma 4 E4B) unless ``first_layer_threads`` says otherwise: on
the shared pool its fill took 257-330 us at c64 on an H200, longer than the decoder layer
it hides behind; on 8 threads kept awake, 78-103 us (BENCHMARKS.md)."""

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


def _threads_or_off(value: object, where: str) -> int | None:
    """A thread count from 2 to 64, or ``0``: off; empty (or ``None``) is ``None``: the
    default."""
    if value is None or (isinstance(value, str) and value.strip() == ""):
        return None
    try:
        n = int(value.strip()) if isinstance(value, str) else value
    except ValueError:
        n = None
    if isinstance(n, bool) or not isinstance(n, int) or not (n == 0 or 2 <= n <= 64):
        raise InvalidArgumentError(
            f"{where} must be a number of threads from 2 to 64 (0: off), got {value!r}"
        )
    return n


def _switch(value: object, where: str, default: bool = False) -> bool:
    """``1``/``true``/``on`` or ``0``/``false``/``off``; empty (or ``None``) is
    ``default``, as for every other setting; a bool as is."""
    if isinstance(value, bool):
        return value
    text = "" if value is None else str(value).strip().lower()
    if text == "":
        return default
    if text in ("0", "false", "off", "no"):
        return False
    if text in ("1", "true", "on", "yes"):
        return True
    raise InvalidArgumentError(f"{where} must be 1 or 0 (on or off), got {value!r}")


def _seconds_or_off(value: object, where: str) -> float | None:
    """A number of seconds >= 0; ``0`` (or empty) is ``None``: off, or the default."""
    if value is None or (isinstance(value, str) and value.strip() == ""):
        return None
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        seconds = math.nan
    if isinstance(value, bool) or not (seconds >= 0 and math.isfinite(seconds)):
        raise InvalidArgumentError(f"{where} must be a number of seconds >= 0, got {value!r}")
    return seconds or None


@dataclass(frozen=True)
class Settings:
    """What the integration does for one engine (see the module)."""

    table_backend: str = "default"
    timeout: float = DEFAULT_TIMEOUT
    copy: str = "auto"
    """The device side of a deferred step (:class:`~ple_memops.DeferredRows`'s ``copy``):
    ``"auto"``, ``"kernel"`` (one polling block), ``"memop"`` (stream memory operations
    and a copy-engine H2D) or ``"kernel-fused"`` (the one polling block at every size)."""
    spin: float | None = None
    """Seconds each layer's gather worker stays hot (spinning, then yielding) while it
    waits for a step's ids before it naps (``None``: the core's default, 2 ms). A worker
    armed one step ahead (async scheduling) waits a whole step for the GPU; past ``spin``
    it sees the ids up to a nap (20-70 us on a VM) late."""
    stats_every: float | None = None
    """Seconds between ``ple-memops stats`` log lines (steps, fills and each layer's
    READY -> FILLED time over the interval); ``None``: no stats lines."""
    first_layer_threads: int | None = None
    """Gather threads of its own (2-64) for the table of the first PLE layer, the one
    whose fill every step waits for (Qwen4Exp adds PLE at the start of a decoder layer,
    and its first PLE layer is decoder layer 0). Its parallel gathers (256 KiB and up:
    1,024 BF16 rows, a 64-token decode step) run on them, never queued behind the later
    layers' on the shared pool, and the worker keeps them awake (20 us naps) while a step
    is armed, so the fill after READY does not begin by waking sleeping threads. With
    ``split_rows`` they go to the rest of the split table (layer 0's slices are gathered
    inline). ``None`` (default): the model's default, which is 8 threads for a split Gemma
    row's rest (:data:`SPLIT_REST_THREADS`, measured best in
    BENCHMARKS.md) and the shared pool for every other table; ``0``: every table on the
    shared pool."""
    time_stalls: bool = False
    """Time on the GPU how long each step's first consumer of every PLE layer waited for
    its rows (two one-thread kernels a layer a step, stamping the GPU's clock); the stats
    line then gives each layer's stall percentiles. Off by default, for a diagnosis only:
    the two kernels a layer cost Gemma 3n E2B ~0.4 ms a step (+8%) at c1 in vLLM on an
    H200 (BENCHMARKS.md)."""
    diag_skip_gather: bool = False
    """Diagnostics only, never for serving: the gather workers fill every step without
    reading the tables, so the consumers read stale rows and the tokens are wrong. Times
    the protocol (publish, waits, copies) without the host's gather."""
    predict_ready: bool = False
    """Each gather worker sleeps until shortly before the READY it predicts from the last
    steps (an armed step's wait is a whole step under async scheduling) and is hot only
    then, instead of hot from arming (:class:`~ple_memops.GatherWorker`'s
    ``predict_ready``). Off by default: in the engine it changed no ITL the runs resolved
    (Gemma 3n at E2B's shapes, c1 and c64), and a READY earlier than predicted is seen up
    to 100 us late, which loads of varying steps were not measured for."""
    time_graphs: bool = False
    """Time every FULL graph replay on the GPU with two CUDA events around its launch (no
    kernel, nothing captured): a ``ple-memops graphs`` log line every ``stats_every``
    seconds (10 s without it) gives the graphs' span on the device, the period from one
    launch to the next and the device's time outside the graphs. Applies with
    ``table_backend`` ``default`` too (the plugin installed, its tables off), so an engine
    with its tables in GPU memory is timed alike."""
    diag_early_join: bool = False
    """Diagnostics only: a Gemma model run eagerly joins its rows after the projection
    at the top of the forward, as a compiled one does, instead of at decoder layer 0's
    per-layer gate (the same tokens; measures what the late join saves)."""
    split_rows: bool = True
    """On by default (``0`` turns it off). A Gemma model run eagerly (``-O0``) serves its
    per-layer table as two tables of the same checkpoint tensor (column windows): decoder
    layer 0's slice of each row, joined
    at layer 0's per-layer gate, and every later layer's slices, joined at layer 1's.
    The GPU then waits at layer 0 for 512 B a token instead of the whole 15-21 KiB row,
    and the rest of the gather hides behind a second decoder layer; the host arms, and
    the graph waits for and copies, two tables a step. The same tokens. No effect on a
    compiled model (Inductor places its join) or on Qwen4Exp (a row is one layer's).
    Measured on Gemma 4 E4B at c64 on an H200: +4.1% ITL p50 over the GPU table with
    whole rows, +0.4% split with the rest on threads of its own (BENCHMARKS.md)."""
    read_in_order: bool = True
    """On by default (``0`` turns it off). The tables' reads from storage of a step are
    taken table by table in the order of the layers that consume them
    (:attr:`~ple_memops.steps.Steps.reads_in_order`): a table that misses the page cache
    waits (bounded) for the earlier layers' reads of the same step, so the first PLE
    layer's rows, which the GPU waits for first, are not read behind every later layer's
    and the later reads overlap the layers before their consumers. Batches of more than
    128 cold rows a table read together as before. For models that stage every table at
    the top of the forward (Qwen4Exp, a split Gemma row); no effect while the tables are
    resident."""

    @property
    def mmap(self) -> bool:
        return self.table_backend == "mmap"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The environment's settings; a bad value raises
        :class:`~ple_memops.InvalidArgumentError` naming the variable."""
        env = os.environ if environ is None else environ
        for key, (name, _) in REMOVED.items():
            _refuse_removed(env.get(name), name, key)
        backend = _backend(env.get(BACKEND_ENV), BACKEND_ENV)
        raw = env.get(TIMEOUT_ENV)
        timeout = DEFAULT_TIMEOUT if raw is None else _timeout(raw, TIMEOUT_ENV)
        return cls(
            backend,
            timeout,
            _copy(env.get(COPY_ENV), COPY_ENV),
            _seconds_or_off(env.get(SPIN_ENV), SPIN_ENV),
            _seconds_or_off(env.get(STATS_ENV), STATS_ENV),
            _threads_or_off(env.get(FIRST_LAYER_THREADS_ENV), FIRST_LAYER_THREADS_ENV),
            _switch(env.get(TIME_STALLS_ENV), TIME_STALLS_ENV),
            _switch(env.get(SKIP_GATHER_ENV), SKIP_GATHER_ENV),
            _switch(env.get(PREDICT_READY_ENV), PREDICT_READY_ENV),
            _switch(env.get(TIME_GRAPHS_ENV), TIME_GRAPHS_ENV),
            _switch(env.get(EARLY_JOIN_ENV), EARLY_JOIN_ENV),
            _switch(env.get(SPLIT_ROWS_ENV), SPLIT_ROWS_ENV, default=True),
            _switch(env.get(READ_IN_ORDER_ENV), READ_IN_ORDER_ENV, default=True),
        )

    @classmethod
    def for_engine(
        cls, additional_config: object, environ: Mapping[str, str] | None = None
    ) -> Settings:
        """An engine's settings: the environment's, overridden by
        ``additional_config["ple_memops"]`` (a mapping with the keys of :data:`KEYS`,
        each optional). Unknown keys, bad values and a :data:`REMOVED` setting switched
        on raise."""
        base = cls.from_env(environ)
        section = _section(additional_config)
        if section is None:
            return base
        for key in REMOVED:
            if key in section:
                _refuse_removed(section[key], f"additional_config[{CONFIG_KEY!r}][{key!r}]", key)
        unknown = sorted(set(section) - set(KEYS) - set(REMOVED))
        if unknown:
            raise InvalidArgumentError(
                f"additional_config[{CONFIG_KEY!r}] has unknown keys {unknown}; "
                f"known: {', '.join(repr(k) for k in KEYS)}"
            )
        changes: dict[str, Any] = {}
        for key, value in section.items():
            if key in REMOVED:
                continue  # off (refused above otherwise): nothing to set
            where = f"additional_config[{CONFIG_KEY!r}][{key!r}]"
            if key == "table_backend":
                changes[key] = "default" if value in (None, "") else _backend(value, where)
            elif key == "timeout":
                changes[key] = _timeout(value, where)
            elif key == "copy":
                changes[key] = _copy(value, where)
            elif key == "first_layer_threads":
                changes[key] = _threads_or_off(value, where)
            elif key in (
                "time_stalls",
                "diag_skip_gather",
                "predict_ready",
                "time_graphs",
                "diag_early_join",
                "split_rows",
                "read_in_order",
            ):
                # Empty is the field's default (a class attribute of the dataclass).
                changes[key] = _switch(value, where, default=getattr(cls, key))
            else:
                changes[key] = _seconds_or_off(value, where)
        return replace(base, **changes)


KEYS = (
    "table_backend",
    "timeout",
    "copy",
    "spin",
    "stats_every",
    "first_layer_threads",
    "time_stalls",
    "diag_skip_gather",
    "predict_ready",
    "time_graphs",
    "diag_early_join",
    "split_rows",
    "read_in_order",
)
"""The keys ``additional_config["ple_memops"]`` may hold (:class:`Settings`' fields)."""


def _refuse_removed(value: object, where: str, key: str) -> None:
    """Raise :class:`~ple_memops.InvalidArgumentError` unless ``value`` (of the
    :data:`REMOVED` setting ``key``, read at ``where``) is unset or off."""
    try:
        on = _switch(value, where)
    except InvalidArgumentError:
        on = True
    if on:
        raise InvalidArgumentError(
            f"{where}={value!r}: {key} was removed, measured not better ({REMOVED[key][1]}); "
            "the engine runs as it did with it off: unset it"
        )


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


def engine_settings(vllm_config: object) -> Settings:
    """A vLLM engine's settings (the environment, then its ``additional_config``)."""
    return Settings.for_engine(getattr(vllm_config, "additional_config", None))


def parallel_refusals(vllm_config: object) -> list[str]:
    """What no model's mmap tables serve, in ``vllm_config``'s parallelism: pipeline
    parallelism (a later stage has no ids to stage) and microbatching / DBO (two
    microbatches in one graph)."""
    parallel: Any = getattr(vllm_config, "parallel_config", None)
    refused = []
    if parallel is not None and parallel.pipeline_parallel_size > 1:
        refused.append(
            f"pipeline parallelism (pipeline_parallel_size={parallel.pipeline_parallel_size})"
        )
    if getattr(parallel, "enable_dbo", False) or getattr(parallel, "ubatch_size", 1) > 1:
        refused.append("microbatching / DBO (--enable-dbo)")
    return refused


def raise_refusals(refused: list[str]) -> None:
    """Refuse, when ``refused`` names anything, with one :class:`UnsupportedError` naming
    each and how to serve the model anyway."""
    if refused:
        raise UnsupportedError(
            "ple-memops mmap PLE tables do not support " + "; ".join(refused) + f". Unset "
            f"{BACKEND_ENV}=mmap (or set additional_config "
            f'{{"{CONFIG_KEY}": {{"table_backend": "default"}}}}), or change the configuration'
        )
