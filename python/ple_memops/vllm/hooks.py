"""The runner side of deferred PLE rows: what a model runner does around captures,
replays and eager steps so every graph that consumes deferred rows is armed exactly once
per replay, and nothing else ever waits for a fill.

Pure Python over the tables' :class:`~ple_memops.steps.Steps` (which own the step
policy: depth, bounded waits, all-or-none aborts, counts), so the same code runs in the
plugin's Model Runner V2 (:mod:`ple_memops.vllm.runner`) and in the stand-in runner of
``tests/vllm_stand_in.py``. What stays here is vLLM's: scopes, graphs, the op. The hooks
keep the set of graphs that wait for rows themselves (nothing is stored on the engine's
graph manager).

The runner calls, in the order Model Runner V2 reaches them::

    hooks = PleRunnerHooks(steps, rows_per_token=H)    # load time, outside any capture
    with hooks.step(dummy=True): model(...)             # profile run, dummy runs
    hooks.quiesce()                                     # before capturing
    for desc in descs:                                  # capture loop
        with hooks.warmup(): forward(desc)              #   eager warm-up, no data
        with torch.cuda.graph(g), hooks.capture(desc): forward(desc)
    out = hooks.replay(desc, graphs[desc].replay)       # FULL replays (real or dummy)
    with hooks.step(dummy=False): model(...)            # eager steps: deferred too
    hooks.release_graphs()                              # graphs dropped (elastic EP)
    hooks.shutdown()

An engine step that may be a FULL replay or an eager forward opens ``step`` around
both. Neither waits for pending steps (beyond ``depth`` in flight): with a deferring steps
an eager forward (a prefill, a mixed batch: this model has FULL graphs for uniform decode
batches only) is one more deferred step, armed at its first PLE op, each layer's ids
published and its rows waited for and copied on a side stream of its own, so every
layer's host gather runs on its worker in parallel with the GPU work before its consumer.
A synchronous tables' steps's eager forward, and a dummy one, first complete pending steps.

The model's PLE op calls :meth:`PleRunnerHooks.stage` and :meth:`PleRunnerHooks.join`
(through the custom ops in :mod:`ple_memops.vllm.ops`); what they do depends on the scope
the runner opened, cross-checked with the stream's capture state (inside a FULL capture
Model Runner V2's forward runs in runtime mode NONE, the same as eager, so the forward
context cannot tell them apart):

====================================  ====================================================
scope, stream                         stage / join
====================================  ====================================================
``capture`` of a deferrable graph,    record publish + wait/copy/reset on a side stream
capturing                             (``steps.stage``) / join it before the consumer
``capture`` of a FULL graph, sync     nothing recorded: the graph-static ids and the
steps with ``sync_graphs``, capturing model's ids source are kept; each replay runs the
                                      ids graph, gathers, copies, then launches
any other capture                     :class:`~ple_memops.StateError`: a host gather
                                      cannot be captured
``step(dummy=True)``, ``warmup``      ``steps.dummy_now``: no data, no host sync
``step(dummy=False)``, deferring steps ``steps.arm`` at the first op, then
                                      ``steps.stage_eager`` / join it before the consumer
``step(dummy=False)`` of sync steps, ``steps.gather_now``: ids to the host, gather, copy
or no scope
====================================  ====================================================
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .._common import capturing as _capturing
from ..errors import ClosedError, InvalidArgumentError, StateError
from ..step_costs import HostTime, NoHostTime, StallSummary
from ..steps import Steps
from .settings import DEFAULT_TIMEOUT, DEPTH

__all__ = ["DEPTH", "PleRunnerHooks", "build_hooks", "deferrable"]

logger = logging.getLogger("ple_memops")

T = TypeVar("T")


def _mode_name(mode: Any) -> str:
    return str(getattr(mode, "name", mode))


def deferrable(desc: Any) -> str | None:
    """``None`` when a graph captured for ``desc`` may defer its rows, else why not.

    A batch descriptor (``cg_mode``, ``num_tokens``, ``num_ubatches``) qualifies when its
    graph is FULL (replayed whole with ``run_fullgraph``, so the runner arms it right
    before) and runs as one batch. Uniform decode graphs of every captured size qualify;
    so do FULL graphs of mixed batches (``cudagraph_mode=FULL``): their ids are computed
    in the graph too, and the rows fit the steps (``max_rows`` covers the largest step).
    """
    mode = _mode_name(desc.cg_mode)
    if mode != "FULL":
        return f"a {mode} graph (only FULL graphs are armed before their replay)"
    if int(getattr(desc, "num_ubatches", 1)) != 1:
        return "a microbatched (DBO) graph"
    return None


@dataclass
class _Capture:
    desc: Any
    rows: int
    staged: dict[str, Any] = field(default_factory=dict)
    joined: set[str] = field(default_factory=set)


@dataclass
class _SyncCapture:
    """A FULL graph of a synchronous tables' steps: its consumers read the staging buffer, which
    the host fills before each replay, from ids an ids graph computes first."""

    desc: Any
    rows: int
    ids: dict[str, Any] = field(default_factory=dict)
    source: Callable[[], None] | None = None


@dataclass
class _IdsGraph:
    """What a synchronous replay runs first: the model's id computation for every PLE
    layer (``source``, into the graph-static ``ids``) and one copy of them all to the
    host, captured once (:meth:`PleRunnerHooks.build_ids_graphs`)."""

    rows: int
    names: list[str]
    source: Callable[[], None]
    ids: dict[str, Any]
    graph: Any = None
    host: Any = None
    done: Any = None


@dataclass
class _NoDefer:
    desc: Any
    why: str


class _Step:
    """An engine step's scope (one a step: a class with slots and literal containers, no
    dataclass's generated ``__init__`` and factory calls)."""

    __slots__ = ("dummy", "forks", "pending", "ready", "rows", "staged")

    def __init__(self, dummy: bool) -> None:
        self.dummy = dummy
        # A synchronous tables' steps's eager forward: the layers staged and not yet gathered (ids,
        # the op's output), all gathered at once, in parallel, when the first consumer
        # needs rows; then the layers gathered and not yet joined (the op's output, rows).
        self.pending: dict[str, tuple[Any, Any]] = {}
        self.ready: dict[str, tuple[Any, int]] = {}
        # An eager forward of a deferring steps: the step's extent once begun, and per
        # layer the side stream its wait/copy runs on (with the ids it publishes, held
        # until join).
        self.rows: int | None = None
        self.staged: set[str] = set()
        self.forks: dict[str, Any] = {}


class PleRunnerHooks:
    """Drives the tables' steps through a model runner's captures, replays and eager steps.

    Args:
        steps: the model's :class:`~ple_memops.steps.Steps` (every PLE layer deferred, or
            every one synchronous; its depth and timeout are the step's).
        rows_per_token: row ids per token (Qwen4Exp: ``(ngram_size - 1) *
            heads_per_ngram``); a graph of ``T`` tokens consumes ``T * rows_per_token``
            rows per layer.
        stats_every: seconds between ``ple-memops stats`` log lines (steps armed,
            replays, eager steps, each layer's fills, mean READY -> FILLED time and share
            of rows read cold over the interval, our host time a step by hook), checked at
            each step; ``None``: none.

    Counting is a strategy chosen once, here: with ``stats_every`` the object made is a
    subclass whose step, replay and output check also count their host time by hook
    (:attr:`host`, a :class:`~ple_memops.step_costs.HostTime`, read by the stats line);
    without, nothing on the engine's thread reads a clock for us (:attr:`host` is a
    :class:`~ple_memops.step_costs.NoHostTime`).
    """

    def __new__(cls, steps: Steps, **kwargs: Any) -> PleRunnerHooks:
        if cls is PleRunnerHooks and kwargs.get("stats_every") is not None:
            cls = _CountedHooks
        return super().__new__(cls)

    def __init__(
        self,
        steps: Steps,
        *,
        rows_per_token: int,
        sync_graphs: bool = False,
        stats_every: float | None = None,
    ) -> None:
        if rows_per_token < 1:
            raise InvalidArgumentError(f"rows_per_token must be >= 1, got {rows_per_token}")
        if stats_every is not None and not stats_every > 0:
            raise InvalidArgumentError(f"stats_every must be > 0 seconds, got {stats_every!r}")
        self.steps = steps
        self._arm = steps.arm  # a replay's arming: the native call itself
        self.rows_per_token = int(rows_per_token)
        self._scope: _Capture | _SyncCapture | _NoDefer | _Step | None = None
        self._step_contexts = (_StepContext(self, False), _StepContext(self, True))
        self._wait_descs: set[Any] = set()
        # The last replayed descriptor found in _wait_descs, held so that `is` is exact:
        # vLLM replays the captured descriptor objects themselves, so a run of one batch
        # size skips the dataclass's Python __hash__ (and its enum's) on every replay.
        self._last_wait_desc: Any = None
        self.sync_graphs = bool(sync_graphs)
        self._ids_graphs: dict[Any, _IdsGraph] = {}
        self._ids_buffers: dict[str, Any] = {}
        self.sync_replays = 0
        self.recorded_graphs = 0
        self.stats_every = stats_every
        # Our host time by hook: counted by _CountedHooks, where a stats line reads it.
        self.host: HostTime | NoHostTime = NoHostTime()
        self._stats_at = time.monotonic()
        self._stats_at_ns = time.perf_counter_ns()  # the same instant, for step()'s check
        self._stats_base: tuple[int, int, int, dict[str, Any]] | None = None
        if stats_every is not None:
            self._stats_base = self._stats_now()

    # -- state ------------------------------------------------------------------------

    @property
    def deferred(self) -> bool:
        """Whether captured graphs defer their rows (the steps' mode is ``deferred``)."""
        return self.steps.deferred

    @property
    def timeout(self) -> float:
        return self.steps.timeout

    @property
    def depth(self) -> int:
        return self.steps.depth

    @property
    def armed_steps(self) -> int:
        """Replays armed (the steps armed less the eager forwards')."""
        armed, eager, _ = self.steps.step_counts
        return armed - eager

    @property
    def eager_steps(self) -> int:
        """Eager forwards armed as deferred steps."""
        return self.steps.step_counts[1]

    @property
    def layer_names(self) -> list[str]:
        return self.steps.names

    @property
    def wait_descs(self) -> frozenset[Any]:
        """The descriptors whose captured graph waits for deferred rows (armed before
        each replay)."""
        return frozenset(self._wait_descs)

    def waits_for_rows(self, desc: Any) -> bool:
        return desc in self._wait_descs

    def output(self, name: str, tokens: int) -> Any:
        """The buffer the consumer of ``name`` reads for a step of ``tokens`` tokens:
        ``uint8 [tokens * rows_per_token, row_bytes]`` (the steps' stable staging)."""
        return self.steps.staging(name, int(tokens) * self.rows_per_token)

    # -- runner hooks -----------------------------------------------------------------

    @contextlib.contextmanager
    def capture(self, desc: Any) -> Iterator[None]:
        """Open around the forward inside ``torch.cuda.graph`` for ``desc``. On success,
        records ``desc`` among :attr:`wait_descs` when the graph consumes deferred rows
        (every PLE layer staged and joined), so its replays get armed."""
        self._check_usable()
        why = deferrable(desc)
        rows = int(desc.num_tokens) * self.rows_per_token
        scope: _Capture | _SyncCapture | _NoDefer
        if why is None and not self.deferred and self.sync_graphs:
            scope = _SyncCapture(desc, rows)
        elif why is None and not self.deferred:
            scope = _NoDefer(desc, f"PLE rows are synchronous here ({self.steps.reason})")
        else:
            scope = _Capture(desc, rows) if why is None else _NoDefer(desc, str(why))
        with self._scoped(scope):
            yield
        if isinstance(scope, _SyncCapture) and scope.ids:
            self._record_sync_graph(scope)
        if isinstance(scope, _Capture) and scope.staged:
            missing = sorted(set(self.steps.names) - set(scope.staged))
            if missing:
                raise StateError(
                    f"ple-memops: the graph for {desc} staged rows for "
                    f"{sorted(scope.staged)} but not for {missing}; every PLE layer of "
                    "the steps must run in each FULL graph"
                )
            unjoined = sorted(set(scope.staged) - scope.joined)
            if unjoined:
                raise StateError(f"ple-memops: staged rows of {unjoined} were never joined")
            self._wait_descs.add(desc)
            self.recorded_graphs += 1

    @contextlib.contextmanager
    def warmup(self) -> Iterator[None]:
        """The eager pass before each capture: no data, after completing pending steps."""
        self.quiesce()
        with self.step(dummy=True):
            yield

    def step(self, *, dummy: bool) -> _StepContext:
        """Around one engine step, a FULL replay or an eager (or PIECEWISE) forward. In an
        eager forward the first PLE op completes every pending step (the synchronous
        gather reuses the rows objects), then each PLE op gathers on the host before its
        consumer (``dummy=False``) or publishes no data (``dummy=True``: profile, warm-up
        and dummy runs). A replay inside it is armed as :meth:`replay` says. Any
        exception aborts every table, so no GPU wait outlives a failed step."""
        # One context per kind of step, made once: a step allocates nothing.
        return self._step_contexts[1 if dummy else 0]

    @contextlib.contextmanager
    def eager(self, *, dummy: bool) -> Iterator[None]:
        """:meth:`step` for a forward known to be eager: pending steps are completed first."""
        self.quiesce()
        with self.step(dummy=dummy):
            yield

    def replay(self, desc: Any, launch: Callable[[], T]) -> T:
        """Launch the FULL graph of ``desc`` (``launch()``), armed first when it consumes
        deferred rows. Completes the oldest pending step only when ``depth`` are armed
        (so under async scheduling the host never waits for a fill here). A failure to arm
        aborts every table (the steps' policy), and so does an exception in the launch
        (the GPU is released, later calls raise :class:`~ple_memops.PoisonedError`)."""
        if desc is not self._last_wait_desc:
            if desc not in self._wait_descs:
                return launch()
            self._last_wait_desc = desc
        # Only synchronous tables record ids graphs: no second hash of vLLM's
        # descriptor (a Python __hash__) on a deferred replay.
        entry = self._ids_graphs.get(desc) if self._ids_graphs else None
        if entry is not None:
            self._check_usable()
            return self._replay_sync(desc, entry, launch)
        # Arm: one native call, no Python frame between (it counts the step; a failure
        # aborts every table in it; closed steps raise ClosedError).
        self._arm(int(desc.num_tokens) * self.rows_per_token)
        # The launch; an exception in it aborts every table (as the steps' guard, without
        # building one).
        try:
            return launch()
        except BaseException as exc:
            self.steps.abort_on(f"the replay of {desc}", exc)
            raise

    def log_stats(self, *, force: bool = False) -> str | None:
        """Log (and return) one ``ple-memops stats`` line about the steps since the last
        one, when :attr:`stats_every` seconds have passed (or ``force``); else ``None``.
        With ``stats_every`` set, :meth:`step` calls it at the end of every engine step
        and :meth:`replay` after a replay launched outside a step."""
        now = time.monotonic()
        if not force and (self.stats_every is None or now - self._stats_at < self.stats_every):
            return None
        if self.steps.closed:
            return None
        current = self._stats_now()
        base = self._stats_base or (0, 0, 0, {})
        armed, eager, sync = (current[0] - base[0], current[1] - base[1], current[2] - base[2])
        layers = []
        for name, (counters, rows) in current[3].items():
            was = base[3].get(name)
            got = counters.since(was[0]) if was else counters
            mean = got.mean_fill_us
            hits, misses = (rows[i] - (was[1][i] if was else 0) for i in range(2))
            cold = f", {100 * misses / (hits + misses):.1f}% rows cold" if hits + misses else ""
            us = "" if mean is None else f", {mean:.1f} us"
            if got.fills:
                # Replays' fills apart from eager forwards' (a 2,048-token chunk's is 10-15x
                # a decode step's): one mean would hide what a decode step waits for.
                split = (
                    f"{n} {kind}" + ("" if m is None else f" {m:.1f} us")
                    for n, kind, m in (
                        (got.replay_fills, "replays", got.mean_replay_fill_us),
                        (got.eager_fills, "eager", got.mean_eager_fill_us),
                    )
                )
                us += f" ({', '.join(split)})"
            late = got.mean_complete_wait_us
            if late is not None:
                # The host's completion of an armed step found it unfilled and waited.
                cold += f", {got.completes_waited} completes waited {late:.1f} us"
            layers.append(f"{_short(name)} {got.fills} fills{us}{cold}")
        stalls = self._stall_text()
        line = (
            f"ple-memops stats, last {now - self._stats_at:.1f} s: {armed} deferred steps "
            f"({armed - eager} replays, {eager} eager), {sync} synchronous replays; "
            "per layer, fills, mean READY -> FILLED (of replays', of eager steps'), rows "
            f"read cold and completes that waited: {'; '.join(layers)}; {self.host.summary()}"
            + (f"; GPU stall per step: {stalls}" if stalls else "")
        )
        self._stats_at, self._stats_base = now, current
        self._stats_at_ns = time.perf_counter_ns()
        logger.info("%s", line)
        return line

    def stall_summaries(self) -> dict[str, StallSummary]:
        """Each layer's consumer stalls since the last call (steps built with
        ``time_stalls``; empty otherwise)."""
        samples = self.steps.stall_samples()
        return {name: StallSummary.of(s.ns, s.dropped) for name, s in samples.items() if s.ns}

    def _stall_text(self) -> str:
        return "; ".join(
            f"{_short(name)} {summary.text()}" for name, summary in self.stall_summaries().items()
        )

    def _stats_now(self) -> tuple[int, int, int, dict[str, Any]]:
        per_layer = {}
        for name, layer in self.steps.tables.items():
            pages = layer.table.page_stats()
            # Rows copied straight from the mapping, and rows read cold (not yet known
            # to be in the page cache: see MmapTable's cold_reads and adopt_resident).
            rows = (int(pages.get("row_hits", 0)), int(pages.get("row_misses", 0)))
            per_layer[name] = (self.steps.counters(name), rows)
        armed, eager, _ = self.steps.step_counts
        return (armed, eager, self.sync_replays, per_layer)

    def note_ids_source(self, source: Callable[[], None]) -> None:
        """The model's glue, inside a capture: ``source()`` recomputes every PLE layer's
        ids into the graph-static tensors its PLE ops stage (the same inputs, the same
        outputs). A synchronous tables' steps's graphs then stay FULL: before each replay an ids
        graph of ``source`` runs, the ids come to the host in one copy, the rows are
        gathered in parallel and copied to staging, then the graph replays. Ignored
        outside a synchronous capture."""
        scope = self._scope
        if isinstance(scope, _SyncCapture):
            scope.source = source

    def build_ids_graphs(self) -> int:
        """Capture the ids graph of every synchronous FULL graph that has none yet
        (after the engine's captures, outside any; a replay builds a missing one itself).
        Returns how many were built."""
        built = 0
        for entry in self._ids_graphs.values():
            if entry.graph is None:
                _capture_ids_graph(entry)
                built += 1
        return built

    def _record_sync_graph(self, scope: _SyncCapture) -> None:
        missing = sorted(set(self.steps.names) - set(scope.ids))
        if missing:
            raise StateError(
                f"ple-memops: the graph for {scope.desc} staged rows for {sorted(scope.ids)} "
                f"but not for {missing}; every PLE layer of the steps must run in each FULL graph"
            )
        if scope.source is None:
            raise StateError(
                f"ple-memops: the graph for {scope.desc} reads synchronous PLE rows, but the "
                "model gave no ids source (note_ids_source) to compute its ids before a replay"
            )
        names = self.steps.names
        self._ids_graphs[scope.desc] = _IdsGraph(scope.rows, names, scope.source, scope.ids)
        self._wait_descs.add(scope.desc)
        self.recorded_graphs += 1

    def _replay_sync(self, desc: Any, entry: _IdsGraph, launch: Callable[[], T]) -> T:
        """A synchronous tables' steps's FULL replay: the ids graph, one wait for its copy of the
        ids to the host, every layer's gather in parallel (their copies to staging on the
        current stream), then the graph."""
        with self.steps.guard(lambda: f"the synchronous replay of {desc}"):
            if entry.graph is None:
                _capture_ids_graph(entry)
            entry.graph.replay()
            entry.done.record()
            entry.done.synchronize()  # the step's one host wait: its ids
            self.steps.gather_many_now(
                {name: entry.host[i] for i, name in enumerate(entry.names)}, entry.rows
            )
            self.sync_replays += 1
            return launch()

    def release_graphs(self) -> None:
        """The engine drops its captured graphs: complete pending steps, forget which
        graphs wait for rows (a later capture records them again), also when completing
        them raises (the graphs are gone either way)."""
        try:
            self.quiesce()
        finally:
            self._wait_descs.clear()
            self._last_wait_desc = None
            self._ids_graphs.clear()

    def quiesce(self) -> None:
        """Complete every pending step (before captures, eager passes that must not
        overlap them, and graph release). A failed fill raises its typed error after
        aborting every table; aborted steps raises :class:`~ple_memops.PoisonedError` even
        with nothing in flight (a worker that saw its step released has dropped it)."""
        self._check_usable()
        if self.steps.in_flight:
            with self.steps.guard("completing pending steps"):
                self.steps.drain()
        self.steps.raise_if_failed()

    def abort(self, reason: str) -> None:
        """Release every GPU wait for good; later calls raise ``PoisonedError``."""
        self.steps.abort(reason)

    def raise_if_failed(self) -> None:
        """Before the engine hands out a step's output (the GPU finished the step): raise
        the typed error if any step's rows failed, so no token computed from the zeros a
        released consumer read is ever returned."""
        self.steps.raise_if_failed()

    def step_output(self, out: Any) -> Any:
        """The model runner's output of a step (vLLM's ``sample_tokens``), before the engine
        has it: under async scheduling (an output with ``get_output``) its rows are
        checked when the engine takes it (:meth:`hand_out`); otherwise the step is done on
        the GPU and they are checked now (:meth:`raise_if_failed`)."""
        get_output = getattr(out, "get_output", None)
        if get_output is None:
            self.raise_if_failed()
            return out
        out.get_output = lambda: self.hand_out(get_output)
        return out

    def hand_out(self, get_output: Callable[[], T]) -> T:
        """A step's output under async scheduling, as the engine takes it: vLLM's
        ``get_output()`` (which waits for the step on the GPU), then
        :meth:`raise_if_failed`. Counted, its time in ``get_output`` is ``results`` (the
        engine's, not ours: see :data:`~ple_memops.step_costs.ENGINE_KINDS`)."""
        result = get_output()
        if self.steps.poison_cause is not None:  # one native read while nothing failed
            self.steps.raise_if_failed()
        return result

    def drain_for_shutdown(self) -> None:
        """Complete pending steps (bounded; a failure is logged and aborts every table, so
        no captured wait can hold the device): before the engine synchronises the device
        at shutdown. Idempotent; the steps stay open until :meth:`shutdown`."""
        self.steps.drain_for_shutdown()

    def shutdown(self) -> None:
        """:meth:`drain_for_shutdown`, then close the steps. Idempotent. A caller that
        synchronises the device drains first, synchronises, then calls this, so nothing
        the GPU may still read is freed. With :attr:`stats_every` set, the last
        interval's stats line is logged first."""
        if self.stats_every is not None:
            with contextlib.suppress(Exception):  # poisoned steps still shuts down
                self.log_stats(force=True)
        self.steps.shutdown()
        self._wait_descs.clear()
        self._last_wait_desc = None
        self._ids_graphs.clear()

    # -- the PLE op -------------------------------------------------------------------

    def stage(self, name: str, ids: Any, output: Any) -> None:
        """The PLE op's first half: ids ``[tokens, rows_per_token]`` (or flat) of layer
        ``name``; ``output`` is :meth:`output` for the step (what the consumer reads)."""
        scope = self._scope
        n = int(ids.numel())
        if _capturing(ids):
            if not isinstance(scope, _Capture | _SyncCapture):
                raise StateError(self._capture_refusal(name, scope))
            if n != scope.rows:
                raise StateError(
                    f"ple-memops: {name} produced {n} row ids under capture of {scope.desc}, "
                    f"which consumes {scope.rows} ({scope.desc.num_tokens} tokens x "
                    f"{self.rows_per_token})"
                )
            done = scope.ids if isinstance(scope, _SyncCapture) else scope.staged
            if name in done:
                raise StateError(f"ple-memops: {name} staged twice in one capture")
            self._check_output(name, output, n)
            if isinstance(scope, _SyncCapture):
                # Nothing captured here: the consumer reads the staging buffer, filled
                # before each replay from these graph-static ids.
                scope.ids[name] = ids.reshape(-1)
                return
            scope.staged[name] = self.steps.stage(name, ids.reshape(-1), rows=n)
            return
        if isinstance(scope, _Capture | _SyncCapture):
            raise StateError(
                f"ple-memops: a capture scope is open for {scope.desc} but the current "
                "stream is not capturing"
            )
        if isinstance(scope, _Step) and not scope.dummy and self.deferred:
            self._stage_eager(scope, name, ids, output, n)
            return
        if isinstance(scope, _Step) and not scope.dummy:
            # A synchronous tables' steps: gathered with every other staged layer at the first
            # consumer (one copy of all their ids to the host, the gathers in parallel).
            if name in scope.pending or name in scope.ready:
                self._end_eager(scope)  # a second forward inside one engine step
            self._check_output_shape(name, output, n)
            scope.pending[name] = (ids.reshape(-1), output)
            return
        # A dummy pass, a synchronous tables' steps, or a forward outside any step (a runner
        # calling the model directly): complete pending steps, then no data or real rows.
        if isinstance(scope, _NoDefer) or (isinstance(scope, _Step) and scope.dummy):
            self.steps.dummy_now(name, n)
            return
        rows = self.steps.gather_now(name, ids.reshape(-1), rows=n)
        if int(rows.data_ptr()) != int(output.data_ptr()):
            output.copy_(rows)

    def ids_buffer(self, name: str) -> Any:
        """Layer ``name``'s own ids buffer (``int64``, as many as its staging has rows),
        allocated on first use, outside any capture (a model that stages through
        :meth:`stage_ids` asks for it when it is bound)."""
        buf = self._ids_buffers.get(name)
        if buf is None:
            import torch

            staging = self.steps.staging(name)
            if staging.is_cuda and torch.cuda.is_current_stream_capturing():
                raise StateError(
                    f"ple-memops: the ids buffer of {name} is first needed inside a capture; "
                    "reserve it when the layer is bound (ids_buffer)"
                )
            buf = torch.zeros(staging.shape[0], dtype=torch.int64, device=staging.device)
            self._ids_buffers[name] = buf
        return buf

    def stage_ids(self, name: str, ids: Any) -> Any:
        """The compiled models' first op: ``ids`` copied into :meth:`ids_buffer` on the
        current stream (their memory may be reused by the graph as soon as this returns,
        while the rows are gathered from them later), then :meth:`stage` into the steps'
        staging view. Returns an empty ``[rows, 0]`` token for :meth:`read_rows`."""
        flat = ids.reshape(-1)
        n = int(flat.numel())
        if n % self.rows_per_token:
            raise StateError(
                f"ple-memops: {name} staged {n} row ids, not a multiple of {self.rows_per_token}"
            )
        owned = self.ids_buffer(name)[:n]
        owned.copy_(flat)
        self.stage(name, owned, self.output(name, n // self.rows_per_token))
        return flat.new_empty((n, 0))

    def read_rows(self, name: str, staged: Any) -> Any:
        """The compiled models' second op: :meth:`join`, then the rows copied out of the
        staging view on the current stream (a new tensor: the op is functional)."""
        n = int(staged.shape[0])
        output = self.output(name, n // self.rows_per_token)
        self.join(name, output)
        return output.clone()

    def join(self, name: str, output: Any) -> None:
        """The PLE op's second half, right before the consumer: under capture the main
        stream waits for the side stream that publishes and copies the rows."""
        scope = self._scope
        if not _capturing(output):
            if isinstance(scope, _Step) and name in scope.forks:
                scope.forks.pop(name).join()
            elif isinstance(scope, _Step) and (name in scope.pending or name in scope.ready):
                if name in scope.pending:
                    self._gather_pending(scope)
                _, n = scope.ready.pop(name)
                # The consumer's own tensor (under torch.compile's functionalization the
                # op's output may be a copy): the rows are in the staging buffer.
                _copy_unless_same(self.steps.staging(name, n), output)
            return  # other eager paths: the rows are already in place
        if isinstance(scope, _SyncCapture):
            return  # the staging buffer is filled before the replay
        if not isinstance(scope, _Capture):
            raise StateError(self._capture_refusal(name, scope))
        staged = scope.staged.get(name)
        if staged is None:
            raise StateError(f"ple-memops: {name} joined rows it never staged in this capture")
        staged.join()
        scope.joined.add(name)

    def _stage_eager(self, scope: _Step, name: str, ids: Any, output: Any, n: int) -> None:
        """An eager forward of a deferring steps (a prefill, a mixed batch) runs the deferred
        protocol too, as one step: its first PLE op arms every layer's worker (completing
        the oldest pending step only when ``depth`` are armed), and each layer's ids are
        published, waited for and copied on a side stream of its own. So no PLE op waits on
        the host: every layer's gather runs on its own worker thread, all in parallel with
        the GPU work queued between the op and its consumer, whose :meth:`join` is the only
        dependency on the rows."""
        if scope.rows is None or name in scope.staged:
            # The forward's first PLE op (or a second forward inside one engine step).
            if scope.rows is not None:
                self._end_eager(scope)
            self.steps.arm(n, True)
            scope.rows = n
            scope.staged = set()
        elif n != scope.rows:
            raise StateError(
                f"ple-memops: {name} produced {n} row ids in an eager step of {scope.rows}"
            )
        self._check_output(name, output, n)
        scope.forks[name] = self.steps.stage_eager(name, ids.reshape(-1), rows=n)
        scope.staged.add(name)

    def _gather_pending(self, scope: _Step) -> None:
        """A synchronous tables' steps's eager forward: every staged layer's ids to the host in one
        copy (one device synchronisation for all of them), then the gathers in parallel,
        each layer's rows copied to its staging buffer."""
        pending, scope.pending = scope.pending, {}
        names = list(pending)
        flat = [pending[n][0] for n in names]
        import torch

        joined = torch.cat([f.to(torch.int64) for f in flat]).cpu().numpy()
        host, at = {}, 0
        for name, f in zip(names, flat, strict=True):
            size = int(f.numel())
            host[name] = joined[at : at + size]
            at += size
        self.steps.gather_many_now(host)
        for name, f in zip(names, flat, strict=True):
            scope.ready[name] = (pending[name][1], int(f.numel()))

    def _end_eager(self, scope: _Step) -> None:
        """The end of an eager forward: a synchronous tables' steps's layers never joined are
        gathered (their errors raised); a forward that staged deferred rows must have
        staged every layer (each worker was armed for the step) and joined."""
        if scope.pending:
            self._gather_pending(scope)
        for name, (output, n) in scope.ready.items():  # never joined: the op's output
            _copy_unless_same(self.steps.staging(name, n), output)
        scope.ready.clear()
        if scope.rows is None:
            return
        if scope.forks:
            unjoined = sorted(scope.forks)
            for staged in scope.forks.values():
                staged.join()  # nothing after the step may race the copy
            scope.forks.clear()
            raise StateError(f"ple-memops: staged rows of {unjoined} were never joined")
        missing = sorted(set(self.steps.names) - scope.staged)
        if missing:
            raise StateError(
                f"ple-memops: an eager forward staged rows for {sorted(scope.staged)} but "
                f"not for {missing}; every PLE layer of the steps must run in each forward"
            )

    # -- helpers ----------------------------------------------------------------------

    def _capture_refusal(self, name: str, scope: object) -> str:
        if isinstance(scope, _NoDefer):
            why = f"{scope.desc} is {scope.why}"
        else:
            why = (
                "the runner opened no ple-memops capture scope for it (a PIECEWISE or "
                "breakable graph, or a runner without the ple-memops hooks)"
            )
        return (
            f"ple-memops: the PLE rows of {name} cannot be gathered inside this CUDA graph "
            f"capture: {why}. A host gather cannot be captured; with the mmap table backend "
            "use FULL graphs (e.g. cudagraph_mode=FULL_DECODE_ONLY) or no graphs"
        )

    def _check_output_shape(self, name: str, output: Any, n: int) -> None:
        staging = self.steps.staging(name, n)
        if tuple(output.shape) != tuple(staging.shape):
            raise StateError(
                f"ple-memops: the output of {name} has shape {tuple(output.shape)}, its rows "
                f"{tuple(staging.shape)}"
            )

    def _check_output(self, name: str, output: Any, n: int) -> None:
        staging = self.steps.staging(name, n)
        if int(output.data_ptr()) != int(staging.data_ptr()) or tuple(output.shape) != tuple(
            staging.shape
        ):
            raise StateError(
                f"ple-memops: the output of {name} must be the steps' staging view "
                f"(hooks.output(name, tokens)); a captured consumer reads that buffer"
            )

    def _check_usable(self) -> None:
        if self.steps.closed:
            raise ClosedError("ple-memops runner hooks are shut down")

    def _scoped(self, scope: _Capture | _SyncCapture | _NoDefer | _Step) -> _Scoped:
        """A context in which ``scope`` is the open one (one at a time)."""
        if self._scope is not None:
            raise StateError(f"ple-memops: a {type(self._scope).__name__} scope is already open")
        return _Scoped(self, scope)


class _StepContext:
    """:meth:`PleRunnerHooks.step`'s context, entered on every engine step, where each call
    and allocation costs cache misses after the engine's own work: the served hooks make
    one a kind of step, and its :class:`_Step` serves every step until an eager forward
    or a failure used it (a fresh one replaces it then)."""

    __slots__ = ("_dummy", "_hooks", "_scope")

    def __init__(self, hooks: PleRunnerHooks, dummy: bool) -> None:
        self._hooks, self._dummy = hooks, dummy
        self._scope = _Step(dummy)

    def __enter__(self) -> None:
        hooks = self._hooks
        if hooks._scope is not None:
            raise StateError(f"ple-memops: a {type(hooks._scope).__name__} scope is already open")
        hooks._scope = self._scope

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        hooks = self._hooks
        scope = self._scope
        # A replay's step has nothing to end and leaves its scope as it found it: no frame
        # and no allocation for it (the common case).
        if exc is None and (scope.pending or scope.ready or scope.rows is not None):
            self._scope = _Step(self._dummy)
            try:
                hooks._end_eager(scope)
            except BaseException as err:
                self._failed(err)
                raise
        hooks._scope = None
        if exc is not None:
            self._failed(exc)  # the exception propagates

    def _failed(self, exc: BaseException) -> None:
        """As the steps' guard: no GPU wait outlives a failed step."""
        hooks = self._hooks
        hooks._scope = None
        self._scope = _Step(self._dummy)
        hooks.steps.abort_on("an engine step", exc)


class _CountedStepContext(_StepContext):
    """:class:`_StepContext` of :class:`_CountedHooks`: its opening and its end counted as
    ``step``, the stats line checked at its end."""

    __slots__ = ("_ns",)

    def __init__(self, hooks: PleRunnerHooks, dummy: bool, t0: int) -> None:
        # t0: read first thing in step(), so the context's making counts too.
        super().__init__(hooks, dummy)
        self._ns = t0

    def __enter__(self) -> None:
        super().__enter__()
        self._ns = time.perf_counter_ns() - self._ns

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        t1 = time.perf_counter_ns()
        super().__exit__(kind, exc, tb)
        if exc is not None:
            return  # the exception propagates
        hooks = self._hooks
        host = hooks.host
        t2 = time.perf_counter_ns()
        # The stats line's interval on the same clock read (perf_counter's ns).
        every = hooks.stats_every
        if every is not None and t2 - hooks._stats_at_ns >= every * 1e9:
            hooks.log_stats()
            host.add("stats", time.perf_counter_ns() - t2)
        host.end_step("step", self._ns + t2 - t1)


class _CountedHooks(PleRunnerHooks):
    """:class:`PleRunnerHooks` with a stats line: the same steps, each hook's host time on
    the engine's thread also counted (:attr:`host`), replays outside a step checking the
    stats line's interval too."""

    def __init__(self, steps: Steps, **kwargs: Any) -> None:
        super().__init__(steps, **kwargs)
        self.host = HostTime()
        self._wait_ns: int | None = None  # the last arming's wait for the oldest fill
        arm = self._arm

        def arm_noting_its_wait(rows: int) -> Any:
            got = arm(rows)
            self._wait_ns = got[1]
            return got

        self._arm = arm_noting_its_wait

    def step(self, *, dummy: bool) -> _StepContext:
        return _CountedStepContext(self, bool(dummy), time.perf_counter_ns())

    def replay(self, desc: Any, launch: Callable[[], T]) -> T:
        # PleRunnerHooks.replay (its policy stays there), the launch timed apart: ours from
        # the replay's first line (its checks, the arming call) less the wait for the
        # oldest step's fill, which the arming reports.
        t0 = time.perf_counter_ns()
        self._wait_ns = None
        launched = [0, 0]

        def timed() -> T:
            launched[0] = time.perf_counter_ns()
            try:
                return launch()
            finally:
                launched[1] = time.perf_counter_ns()

        out = super().replay(desc, timed)
        wait = self._wait_ns
        if wait is not None:  # armed and launched (not a replay nothing waits on)
            self.host.add_replay(wait, launched[0] - t0 - wait, launched[1] - launched[0])
        if self.stats_every is not None and not isinstance(self._scope, _Step):
            self.log_stats()  # a replay outside step(): step() checks its own at its end
        return out

    def step_output(self, out: Any) -> Any:
        t0 = time.perf_counter_ns()  # counted as the output's check
        get_output = getattr(out, "get_output", None)
        if get_output is not None:
            out.get_output = lambda: self.hand_out(get_output)
        self.host.add("check", time.perf_counter_ns() - t0)
        if get_output is None:
            self.raise_if_failed()  # synchronous scheduling: the step is done on the GPU
        return out

    def raise_if_failed(self) -> None:
        t0 = time.perf_counter_ns()
        try:
            self.steps.raise_if_failed()
        finally:
            self.host.add("check", time.perf_counter_ns() - t0)

    def hand_out(self, get_output: Callable[[], T]) -> T:
        t0 = time.perf_counter_ns()
        result = get_output()
        t1 = time.perf_counter_ns()  # the results' end and the check's start: one read
        host = self.host
        host.add("results", t1 - t0)
        try:
            self.steps.raise_if_failed()
        finally:
            host.add("check", time.perf_counter_ns() - t1)
        return result


class _Scoped:
    """:meth:`PleRunnerHooks._scoped`'s context (a class: entered on every engine step)."""

    __slots__ = ("_hooks", "_scope")

    def __init__(self, hooks: PleRunnerHooks, scope: Any) -> None:
        self._hooks, self._scope = hooks, scope

    def __enter__(self) -> None:
        self._hooks._scope = self._scope

    def __exit__(self, *exc: object) -> None:
        self._hooks._scope = None


_LAYER_NAME = re.compile(r"layers\.\d+")


def _short(name: str) -> str:
    """``model.layers.6.ple.ple_embedding.ngram_embedding`` -> ``layers.6``."""
    match = _LAYER_NAME.search(name)
    return match.group(0) if match else name


def _copy_unless_same(rows: Any, output: Any) -> None:
    if int(rows.data_ptr()) != int(output.data_ptr()):
        output.copy_(rows)


def _capture_ids_graph(entry: _IdsGraph) -> None:
    """Capture ``entry``'s ids graph: its source, then one copy of every layer's ids to
    a pinned host buffer (outside any other capture; thread-local capture mode, so other
    threads' CUDA calls meanwhile are not an error)."""
    import torch

    first = next(iter(entry.ids.values()))
    device = first.device
    host = torch.empty((len(entry.names), entry.rows), dtype=torch.int64, pin_memory=True)
    graph = torch.cuda.CUDAGraph()
    new_stream: Any = torch.cuda.Stream
    side = new_stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
        entry.source()
        for i, name in enumerate(entry.names):
            host[i].copy_(entry.ids[name], non_blocking=True)
    torch.cuda.current_stream(device).wait_stream(side)
    entry.graph, entry.host = graph, host
    new_event: Any = torch.cuda.Event
    entry.done = new_event()


def build_hooks(
    tables: Mapping[str, Any],
    *,
    rows_per_token: int,
    max_rows: int,
    device: Any,
    timeout: float = DEFAULT_TIMEOUT,
    deferred: bool = True,
    copy: str = "auto",
    sync_graphs: bool = True,
    spin: float | None = None,
    predict_ready: bool = False,
    stats_every: float | None = None,
    time_stalls: bool = False,
    skip_gather: bool = False,
    read_in_order: bool = False,
) -> PleRunnerHooks:
    """Build the tables' :class:`~ple_memops.steps.Steps` (name ->
    :class:`~ple_memops.MmapTable`, outside any capture) and the runner hooks around them.
    ``timeout`` bounds both the watchdog of a waiting graph and the completion of a
    pending step. ``sync_graphs``: synchronous tables keep FULL graphs (the model gives an
    ids source while captured). ``spin``: the workers' hot window (``None``: the core's
    default), ``predict_ready``: placed where READY is expected
    (:class:`~ple_memops.GatherWorker`); ``stats_every``: see :class:`PleRunnerHooks`;
    ``time_stalls``: time each layer's consumer stall on the GPU (in the stats line);
    ``skip_gather``: diagnostics only (wrong rows), see :class:`~ple_memops.GatherWorker`;
    ``read_in_order``: each step's reads from storage in the order of ``tables``, which
    must be the order their layers consume them (:attr:`Steps.reads_in_order`)."""
    steps = Steps.build(
        dict(tables),
        max_rows=max_rows,
        device=device,
        depth=DEPTH,
        timeout=timeout,
        id_dtype="int64",
        deferred=deferred,
        watchdog=timeout,
        copy=copy,
        spin=spin,
        predict_ready=predict_ready,
        time_stalls=time_stalls,
        skip_gather=skip_gather,
        read_in_order=read_in_order,
        log_fallback=False,  # the engine's integration says it once, with what it changes
    )
    try:
        return PleRunnerHooks(
            steps, rows_per_token=rows_per_token, sync_graphs=sync_graphs, stats_every=stats_every
        )
    except BaseException:
        steps.shutdown()
        raise
