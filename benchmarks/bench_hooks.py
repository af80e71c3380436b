"""Our own host time per engine step in the vLLM integration, without a GPU.

Drives ``PleRunnerHooks`` (what vLLM's model runner calls) the way a serving loop at a
steady decode load does, on steps of gather workers that fill host rows: each step opens
the step's scope, replays a FULL graph (``replay``: completing the oldest armed step,
arming every table, the "launch", which here publishes the step's ids from the host as
the GPU would), hands the output out (``hand_out``, as vLLM's ``get_output`` under
asynchronous scheduling: the failure check), then the host does the engine's own work
until ``--gap-us`` have passed. That work evicts our code and data
from the caches, as vLLM's step does between our hooks: ``--between evict`` (the default)
reads a buffer larger than the last-level cache (its size from sysfs); ``--between
sleep`` only sleeps, which leaves our working set cached and measures several times less
than the engine does (the code of `08132af` on the 2-vCPU VM: 10 us a step asleep, 56
evicted, where the H200 engine's stats line said 45). ``all in`` is each step's wall less
the launch (timed by this loop), p50 and p99 over ``--steps`` steps, for 1 and 4 tables,
repeated ``--repeats`` times in turn; ``--hooks`` picks what drives the steps: ``ours``
(as served by default: no stats line, so no host time counted), ``ours-stats`` (a stats
line's hooks, which count their host time: that count by hook fills the other columns)
and ``flat`` (the floor: :class:`FlatHooks`), each repeat running them in turn, the order
alternating. ``--tokens`` and ``--row-bytes`` set a step's size (an
engine's c64 step gathers for hundreds of microseconds, while our next calls run);
``--publish-at next-step`` hands a step's ids to the worker as the host prepares the next
step instead of at the launch.

``--through runner`` (vLLM 0.33.0 or 0.34.0 installed) makes each step vLLM's calls on our model
runner and graph manager instead (``execute_model``, ``run_fullgraph``, ``sample_tokens``,
the output's ``get_output``), vLLM's own step stubbed out below them and its cost, measured
alone in the same conditions, subtracted (the ``vLLM stubs`` column): ``all in`` is then
everything the plugin adds to a step on the engine's thread, our subclasses' overrides
included.

The cost this measures is Python's (call layers, context managers, locks) and the native
calls', on this CPU, mostly in cache misses once evicted. ``--python-only`` times the
hooks' own Python alone instead: the step's scope, the replay and the output check over a
stub of the steps (no native call, no worker, no engine work between: caches warm),
best of 5 x 20,000 steps, the only measure here steady enough to resolve a fraction of a
microsecond on a shared VM. It prints the table; it asserts nothing.

    python3 benchmarks/bench_hooks.py [--steps 3000] [--repeats 3] [--tokens 64 \
        --row-bytes 15360] [--publish-at next-step] [--between sleep] [--evict-mib 96] \
        [--native-split] [--through runner] [--python-only]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import timeit
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

import ple_memops as pm
from ple_memops.step_costs import HOST_KINDS
from ple_memops.vllm.hooks import PleRunnerHooks


@dataclass(frozen=True)
class Descriptor:
    """Shaped like vLLM 0.33.0's ``BatchExecutionDescriptor`` (hashable, a long repr)."""

    cg_mode: str
    num_tokens: int
    num_reqs: int | None
    uniform_token_count: int | None = None
    max_query_len: int | None = None
    num_active_loras: int = 0
    num_ubatches: int = 1


def build(
    root: Path, tables: int, tokens: int, row_bytes: int = 512, stats_every: float | None = None
) -> tuple[PleRunnerHooks, list[Any]]:
    opened = []
    made = []
    for i in range(tables):
        data = np.random.default_rng(i).integers(0, 256, (4096, row_bytes), dtype=np.uint8)
        path = root / f"t{i}.safetensors"
        save_file({f"layers.{i}.table": data.view(np.float16)}, str(path))
        table = pm.MmapTable.open(path, f"layers.{i}.table")
        rows = pm.DeferredRows(tokens, table.row_bytes, device="cpu", watchdog=None)
        made.append((f"layers.{i}", table, rows, pm.GatherWorker(rows, table, depth=2)))
        opened.append(table)
    # Host rows with workers: the deferred protocol's host side, no GPU.
    try:
        from ple_memops.steps import Steps, StepTable
    except ImportError:  # a build before the one step object (ab_hooks.py across it)
        from ple_memops.plan import PlanLayer, RowsPlan  # type: ignore[import-not-found]

        plan = RowsPlan([PlanLayer(*m) for m in made], "deferred", None, None, 5.0)
        return PleRunnerHooks(plan, rows_per_token=1), opened
    steps = Steps([StepTable(*m) for m in made], "deferred", None, None, 2, 5.0)
    return PleRunnerHooks(steps, rows_per_token=1, stats_every=stats_every), opened


def publisher(hooks: Any) -> tuple[list[str], Callable[[str, Any], None]]:
    """The tables' names and their host publish, on this build or one before ``Steps``."""
    steps = getattr(hooks, "steps", None)
    if steps is None:  # a build before the one step object
        return list(hooks.plan.layers), hooks.driver.publish_host
    return steps.names, steps.publish_host


class _FlatStep:
    """The flat hooks' step scope: one object for every step, doing nothing."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class FlatHooks:
    """The floor for an adapter over the same :class:`~ple_memops.steps.Steps`: the three
    calls of a FULL decode step written flat (a scope that does nothing, a replay that is
    the native arming and the launch, an output check that is one read of the steps'
    failure), with none of ``PleRunnerHooks``' scope objects, host time, stats line or
    abort handling. A reference to measure ours against (``--hooks ours,flat``), not a
    path that serves: no captures, eager steps or failures."""

    def __init__(self, steps: Any, rows_per_token: int, desc: Any) -> None:
        self.steps, self.rows_per_token, self._desc = steps, rows_per_token, desc
        self._arm = steps.arm
        self._scope = _FlatStep()

    def step(self, *, dummy: bool) -> _FlatStep:
        return self._scope

    def replay(self, desc: Any, launch: Callable[[], Any]) -> Any:
        if desc is not self._desc:
            return launch()
        self._arm(int(desc.num_tokens) * self.rows_per_token)
        return launch()

    def step_output(self, out: Any) -> Any:
        get_output = out.get_output
        out.get_output = lambda: self.hand_out(get_output)
        return out

    def hand_out(self, get_output: Callable[[], Any]) -> Any:
        result = get_output()
        if self.steps.poison_cause is not None:
            self.steps.raise_if_failed()
        return result

    @property
    def wait_descs(self) -> frozenset[Any]:
        return frozenset((self._desc,))

    def raise_if_failed(self) -> None:
        self.steps.raise_if_failed()

    def shutdown(self) -> None:
        self.steps.shutdown()


class _StubSteps:
    """Stands for :class:`~ple_memops.steps.Steps` where the hooks' own Python is timed
    alone (``--python-only``): arming and the failure read do nothing."""

    poison_cause = None

    def arm(self, rows: int) -> tuple[int, int, int]:
        return (rows, 0, 0)

    def raise_if_failed(self) -> None:
        pass


def python_only(hooks_kind: str, number: int = 20_000) -> float:
    """us a step of the hooks' own Python (scope, replay, output check), best of 5 runs of
    ``number`` steps over :class:`_StubSteps`: ``ours`` as served (no stats line) or
    ``flat``."""
    desc = Descriptor("FULL", 8, 8, 1)
    steps: Any = _StubSteps()
    hooks: Any
    if hooks_kind == "flat":
        hooks = FlatHooks(steps, 1, desc)
    else:
        hooks = PleRunnerHooks(steps, rows_per_token=1)
        hooks._wait_descs.add(desc)

    def launch() -> None:
        pass

    def one() -> None:
        with hooks.step(dummy=False):
            hooks.replay(desc, launch)
        hooks.hand_out(launch)

    return min(timeit.repeat(one, number=number, repeat=5)) / number * 1e6


def llc_bytes() -> int:
    """The last-level cache's size (sysfs: the highest cache level of cpu0), else 32 MiB."""
    best = (0, 32 << 20)
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        n = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        if level > best[0]:
            best = (level, n)
    return best[1]


class Between:
    """The engine's work between two steps: ``evict`` reads one byte a cache line of a
    buffer (twice the last-level cache unless ``evict_bytes``; numpy, so it takes little
    of the gap), then sleeps out the gap; ``sleep`` only sleeps."""

    def __init__(self, how: str, gap_us: float, evict_bytes: int | None = None) -> None:
        self.gap = gap_us / 1e6
        size = 2 * llc_bytes() if evict_bytes is None else evict_bytes
        self.buf = np.ones(size, dtype=np.uint8) if how == "evict" else None

    def __call__(self) -> None:
        t0 = time.perf_counter()
        if self.buf is not None:
            self.buf[::64].sum()
        left = self.gap - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)


class _Output:
    """Stands for vLLM's ``AsyncOutput``: the runner's ``sample_tokens`` result, whose
    ``get_output`` the engine calls (ours wraps it with the failure check). It returns at
    once: the engine's wait for a step's results is not in the figures."""

    def get_output(self) -> None:
        return None


def _stub_classes(launch: Callable[[], Any]) -> tuple[type, type, type, type]:
    """vLLM 0.33.0's runner and graph manager with their engine work stubbed out (the
    replay is ``launch()``, the step a replay, the sampling an :class:`_Output`), and the
    same two with our subclasses above them, as the plugin installs them: ``(engine
    runner, engine manager, our runner, our manager)``. Only our overrides and vLLM's
    class layout run; nothing of vLLM's own step does."""
    from ple_memops.vllm import runner as ours

    class EngineManager(ours._BaseManager):
        def run_fullgraph(self, desc: Any) -> Any:
            return launch()

    class EngineRunner(ours._BaseRunner):
        def execute_model(self, *args: Any, **kwargs: Any) -> Any:
            return self.cudagraph_manager.run_fullgraph(self.bench_desc)

        def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
            return _Output()

    # Our overrides first in the MRO, vLLM's stubbed step after them.
    class Manager(ours.PleCudaGraphManager, EngineManager):
        pass

    class Runner(ours.PleGPUModelRunner, EngineRunner):
        pass

    return EngineRunner, EngineManager, Runner, Manager


def vllm_descriptor(tokens: int) -> Any:
    """vLLM's own ``BatchExecutionDescriptor`` of a FULL decode graph of ``tokens``."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

    return BatchExecutionDescriptor(CUDAGraphMode.FULL, tokens, tokens, 1, 1)


def _runner(runner_cls: type, manager_cls: type, desc: Any, hooks: Any) -> Any:
    # Neither object is initialised by vLLM: the benchmark sets what the step reads.
    manager = object.__new__(manager_cls)
    runner = object.__new__(runner_cls)
    runner.cudagraph_manager, runner.bench_desc = manager, desc
    if hooks is not None:
        manager.ple_rows, manager.ple_clock, runner.ple_rows = hooks, None, hooks
    return runner


def stub_runner(hooks: Any, launch: Callable[[], Any]) -> Any:
    """Our runner and graph manager over ``hooks``, vLLM's step stubbed
    (:func:`_stub_classes`), replaying the descriptor ``hooks`` waits on."""
    _, _, runner_cls, manager_cls = _stub_classes(launch)
    (desc,) = hooks.wait_descs
    return _runner(runner_cls, manager_cls, desc, hooks)


def stub_engine_walls(
    steps: int, gap_us: float, between: str, evict_bytes: int | None
) -> list[int]:
    """ns a step of vLLM's stubbed runner alone (no plugin), as the runner's path runs it."""
    runner_cls, manager_cls, _, _ = _stub_classes(lambda: None)
    runner = _runner(runner_cls, manager_cls, vllm_descriptor(8), None)
    engine_work = Between(between, gap_us, evict_bytes)
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter_ns()
        runner.execute_model(None)
        runner.sample_tokens(None).get_output()
        walls.append(time.perf_counter_ns() - t0)
        engine_work()
    return walls


def run(
    tables: int,
    steps: int,
    gap_us: float,
    tokens: int = 8,
    row_bytes: int = 512,
    publish_at: str = "launch",
    between: str = "evict",
    evict_bytes: int | None = None,
    native_split: bool = False,
    through: str = "hooks",
    hooks_kind: str = "ours",
) -> dict[str, tuple[float, float]]:
    engine_only, stubs = None, []
    if through == "runner":
        # What vLLM's own step costs here (its stubbed parts, below, without our
        # overrides), measured in the same conditions: subtracted from the runner's path.
        stubs = sorted(stub_engine_walls(steps, gap_us, between, evict_bytes))
        engine_only = statistics.median(stubs)
    with tempfile.TemporaryDirectory() as tmp:
        # ours-stats: a stats interval no run reaches, so every step is counted as under a
        # stats line and no line is logged.
        stats_every = 1e9 if hooks_kind == "ours-stats" else None
        hooks, opened = build(Path(tmp), tables, tokens, row_bytes, stats_every)
        native: list[tuple[int, int, int]] = []
        if native_split:
            # The stepper's one native call, its own phases recorded (one Python frame more
            # in `arm`): what of `arm` and `wait` is the native call's.
            step = hooks._arm

            def recorded(*a: Any, **kw: Any) -> tuple[int, int, int]:
                got = step(*a, **kw)
                native.append(got)
                return got

            hooks._arm = recorded
        desc = (
            vllm_descriptor(tokens)
            if engine_only is not None
            else Descriptor("FULL", tokens, tokens, 1)
        )
        if hooks_kind == "flat":
            hooks = FlatHooks(hooks.steps, 1, desc)
        else:
            hooks._wait_descs.add(desc)  # as a capture of this size would have
        names, publish_host = publisher(hooks)
        ids = np.arange(tokens, dtype=np.int64)
        launched = [0]  # ns in the launch this step: the engine's, timed here

        def publish() -> None:  # the GPU's publish of the step's ids
            for name in names:
                publish_host(name, ids)

        def launch_publishing() -> None:
            t = time.perf_counter_ns()
            publish()
            launched[0] += time.perf_counter_ns() - t

        # "launch": the GPU reaches the step at once (the worker gathers while the host
        # checks the step before); "next-step": the GPU reaches it as the host prepares the
        # next one (the worker gathers while the host arms that one).
        launch = launch_publishing if publish_at == "launch" else (lambda: None)
        engine_work = Between(between, gap_us, evict_bytes)
        walls = []
        runner = None if engine_only is None else stub_runner(hooks, launch)
        counted = getattr(hooks, "host", None)
        try:
            if counted is not None:
                counted.take()
            for k in range(steps):
                if publish_at == "next-step" and k:
                    publish()
                launched[0] = 0
                t0 = time.perf_counter_ns()
                if runner is None:
                    with hooks.step(dummy=False):
                        hooks.replay(desc, launch)
                    hooks.hand_out(lambda: None)  # async scheduling's get_output
                else:
                    # vLLM's calls on our runner and graph manager: the step, its sampling,
                    # the engine's get_output (each step's descriptor the captured one).
                    runner.execute_model(None)
                    runner.sample_tokens(None).get_output()
                walls.append(time.perf_counter_ns() - t0 - launched[0])
                engine_work()
            if publish_at == "next-step":
                publish()
            samples = [] if counted is None else counted.take()
        finally:
            hooks.shutdown()
            for t in opened:
                t.close()
    # All in: the step from outside less the launch (here the host's publish of the ids:
    # the engine's), timed by this loop whatever the hooks count, so the hooks' entries
    # count too: a cold call pays its first misses before its own timer starts. Through
    # the runner, vLLM's own (stubbed) step is subtracted too, as its median.
    engine = engine_only or 0.0
    all_in = sorted((wall - engine) / 1e3 for wall in walls)
    out = {"all in": (statistics.median(all_in), all_in[int(0.99 * (len(all_in) - 1))])}
    if engine_only is not None:
        out["vLLM stubs"] = (engine_only / 1e3, stubs[int(0.99 * (len(stubs) - 1))] / 1e3)
    if samples:  # ours by hook, where the hooks count (ours-stats)
        for kind in ("total", *HOST_KINDS):
            # Ours only, as the stats line's total: the launch (here the host's publish of
            # the ids) and the engine's wait for results are the engine's.
            us = [(sum(s[k] for k in HOST_KINDS) if kind == "total" else s[kind]) / 1e3
                  for s in samples]  # fmt: skip
            us.sort()
            out[kind] = (statistics.median(us), us[min(len(us) - 1, int(0.99 * len(us)))])
    for i, kind in ((1, "native wait"), (2, "native arm")):
        if native:
            us = sorted(n[i] / 1e3 for n in native)
            out[kind] = (statistics.median(us), us[min(len(us) - 1, int(0.99 * len(us)))])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gap-us", type=float, default=500.0, help="the engine's time between steps")
    p.add_argument(
        "--between",
        choices=["evict", "sleep"],
        default="evict",
        help="the engine's work between steps: evict the caches (as vLLM's step does), or "
        "only sleep (our working set stays cached)",
    )
    p.add_argument(
        "--native-split",
        action="store_true",
        help="also the plan's one native call's own phases (completing, arming), as the "
        "native code timed them",
    )
    p.add_argument(
        "--evict-mib",
        type=int,
        default=None,
        help="MiB read between steps with --between evict (default: twice the last-level "
        "cache; with a 300 MiB one that is 600 MiB read a step)",
    )
    p.add_argument(
        "--through",
        choices=["hooks", "runner"],
        default="hooks",
        help="drive the hooks as the runner calls them, or through our vLLM runner and graph "
        "manager (vLLM 0.33.0 installed; vLLM's own step stubbed out, its cost subtracted)",
    )
    p.add_argument(
        "--python-only",
        action="store_true",
        help="time the hooks' own Python alone (a stub of the steps, caches warm) instead",
    )
    p.add_argument("--tables", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    p.add_argument("--tokens", type=int, default=8, help="rows a step (one a token)")
    p.add_argument(
        "--row-bytes",
        type=int,
        default=512,
        help="bytes a row (even; Gemma 3n E2B's per-layer row: 15360)",
    )
    p.add_argument(
        "--publish-at",
        choices=["launch", "next-step"],
        default="launch",
        help="when the step's ids reach the worker: at its launch (the worker gathers while "
        "the host checks the step before), or as the host prepares the next step (while it "
        "arms that one)",
    )
    p.add_argument(
        "--hooks",
        default="ours",
        help="ours (PleRunnerHooks as served by default: no stats line, no host time "
        "counted), ours-stats (with a stats line: every step's host time counted by hook, "
        "the by-hook columns) and/or flat (FlatHooks: the floor over the same steps), "
        "comma-separated: each repeat runs each in turn, the order alternating",
    )
    args = p.parse_args()
    if args.tokens < 1 or args.row_bytes < 2 or args.row_bytes % 2:
        p.error("--tokens must be >= 1 and --row-bytes a positive even number")
    hooks_kinds = args.hooks.split(",")
    if not hooks_kinds or any(h not in ("ours", "ours-stats", "flat") for h in hooks_kinds):
        p.error(f"--hooks takes ours, ours-stats and/or flat, got {args.hooks!r}")
    if "flat" in hooks_kinds and args.native_split:
        p.error("--native-split times our hooks' native call: not with --hooks flat")
    if args.python_only and "ours-stats" in hooks_kinds:
        p.error("--python-only times ours and/or flat (a stats line reads the real steps)")
    if args.python_only:
        print("our hooks' own Python, us a step (best of 5 x 20,000; a stub of the steps)\n")
        print("| repeat | hooks | us a step |")
        print("|---|---|---|")
        for r in range(args.repeats):
            for hk in hooks_kinds if r % 2 == 0 else hooks_kinds[::-1]:
                print(f"| {r + 1} | {hk} | {python_only(hk):.3f} |", flush=True)
        return
    kinds: tuple[str, ...] = ("all in", "total", "step", "arm", "wait", "check")
    if args.native_split:
        kinds += ("native wait", "native arm")
    if args.through == "runner":
        try:
            import ple_memops.vllm.runner  # noqa: F401  (vLLM and torch)
        except ImportError as exc:
            p.error(f"--through runner needs vLLM 0.33.0 and torch installed ({exc})")
        kinds += ("vLLM stubs",)
    evict = None if args.evict_mib is None else args.evict_mib << 20
    read = (2 * llc_bytes() if evict is None else evict) >> 20
    try:
        clock = Path("/sys/devices/system/clocksource/clocksource0/current_clocksource")
        source = clock.read_text().strip()
    except OSError:
        source = "unknown"
    print(
        f"host us per engine step, p50 / p99 over {args.steps} steps of {args.tokens} rows "
        f"of {args.row_bytes} B ({args.gap_us:.0f} us between steps, "
        f"{f'{read} MiB read' if args.between == 'evict' else 'asleep'}; last-level cache "
        f"{llc_bytes() >> 20} MiB, clock source {source})\n"
    )
    print("| tables | repeat | hooks | " + " | ".join(kinds) + " |")
    print("|---|---|---|" + "---|" * len(kinds))
    for r in range(args.repeats):
        for n in args.tables:
            for hk in hooks_kinds if r % 2 == 0 else hooks_kinds[::-1]:
                got = run(
                    n, args.steps, args.gap_us, args.tokens, args.row_bytes, args.publish_at,
                    args.between, evict, args.native_split, args.through, hk,
                )  # fmt: skip
                cells = " | ".join(
                    f"{got[k][0]:.1f} / {got[k][1]:.1f}" if k in got else "-" for k in kinds
                )
                print(f"| {n} | {r + 1} | {hk} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
