"""The benchmarks' per-thread CPU accounting (``proc_cpu.thread_cpu``,
``bench_vllm.cpu_use``), on this process's own threads: a thread named like ours burns a
known amount of CPU time."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import bench_vllm
import proc_cpu
import pytest

BURN_S = 0.3


def _burn(name: bytes, seconds: float, burned: threading.Event, release: threading.Event) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    assert libc.prctl(15, ctypes.c_char_p(name), 0, 0, 0) == 0  # PR_SET_NAME
    t0 = time.thread_time()
    x = 0
    while time.thread_time() - t0 < seconds:
        x += 1
    burned.set()
    release.wait(10)  # alive while it is sampled, as a server's threads are


def test_our_threads_cpu_time_is_counted_apart() -> None:
    burned, release = threading.Event(), threading.Event()
    t = threading.Thread(target=_burn, args=(b"ple-test-burn", BURN_S, burned, release))
    before = proc_cpu.thread_cpu([os.getpid()])
    w0 = time.monotonic()
    t.start()
    try:
        assert burned.wait(30)
        wall = time.monotonic() - w0
        after = proc_cpu.thread_cpu([os.getpid()])
        where = bench_vllm.busy_thread_cpus(before, after, proc_cpu.thread_last_cpu([os.getpid()]))
    finally:
        release.set()
        t.join()
    # The burning thread ran during the sample: where it last ran is one of the CPUs.
    assert where["ple-test-burn"] and set(where["ple-test-burn"]) <= os.sched_getaffinity(0)
    names = {name for name, _ in after.values()}
    assert "ple-test-burn" in names, names
    use = bench_vllm.cpu_use(before, after, wall)
    # Clock ticks are 10 ms: the thread's 0.3 s of CPU time, give or take two ticks.
    ours_s = use["cpu_ours"] * wall
    assert BURN_S - 0.03 <= ours_s <= BURN_S + 0.1, (ours_s, use)
    assert use["cpu_cores"] >= use["cpu_ours"]
    top = use["cpu_top"]
    assert top is None or not top[0].startswith("ple-")


def test_cpu_use_of_a_thread_that_ended_or_began() -> None:
    before = {(1, 10): ("EngineCore", 100), (1, 11): ("ple-memops-gath", 50)}
    after = {(1, 10): ("EngineCore", 300), (1, 12): ("ple-gather-0", 40)}
    use = bench_vllm.cpu_use(before, after, 2.0)
    tick = proc_cpu.CLK_TCK
    assert use["cpu_cores"] == pytest.approx((200 + 40) / tick / 2.0)
    assert use["cpu_ours"] == pytest.approx(40 / tick / 2.0)  # a thread gone adds nothing
    assert use["cpu_top"] == ("EngineCore", pytest.approx(200 / tick / 2.0))
    assert bench_vllm.cpu_use(before, after, 0.0) == {}


def test_thread_places_and_the_machines_topology() -> None:
    before = {(1, 10): ("EngineCore", 100), (1, 11): ("ple-gather-0", 50), (1, 12): ("idle", 5)}
    after = {(1, 10): ("EngineCore", 300), (1, 11): ("ple-gather-0", 60), (1, 12): ("idle", 5),
             (1, 13): ("ple-gather-1", 1)}  # fmt: skip
    last = {(1, 10): 3, (1, 11): 7, (1, 12): 0, (1, 13): 2}
    assert bench_vllm.busy_thread_cpus(before, after, last) == {
        "EngineCore": [3], "ple-gather-0": [7], "ple-gather-1": [2]}  # fmt: skip
    topo = proc_cpu.cpu_topology()
    groups = [str(g) for g in topo["smt_siblings"]]
    cpus = {int(c) for g in groups for part in g.split(",") for c in part.split("-")}
    assert cpus and max(cpus) < (os.cpu_count() or 1)


def test_solo_serves_each_backend_alone_in_turn(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``--solo``: one server at a time on the GPU (started, measured, stopped), the rows of
    all of them kept for the report."""
    from vllm_dry_run import _Fake
    from vllm_servers import Server

    fakes = {"gpu-plugin": _Fake(0.001), "mmap": _Fake(0.001)}
    for f in fakes.values():
        f.start()
    events: list[str] = []

    def start(args, ckpt, backend, plugin_dir):  # type: ignore[no-untyped-def]
        assert not [e for e in events if e.startswith("start")] or events[-1].startswith("stop")
        events.append(f"start {backend}")
        return Server(backend, fakes[backend].port, tmp_path / f"{backend}.log")

    def healthy(servers, limit, grace):  # type: ignore[no-untyped-def]
        for s in servers:
            s.healthy = True

    monkeypatch.setattr(bench_vllm, "start_server", start)
    monkeypatch.setattr(bench_vllm, "wait_healthy", healthy)

    def stop(servers):  # type: ignore[no-untyped-def]
        events.extend(f"stop {s.backend}" for s in servers)

    monkeypatch.setattr(bench_vllm, "stop_servers", stop)
    args = bench_vllm.parse_args(
        ["--solo", "--backends", "gpu-plugin,mmap", "--concurrency", "1", "--requests", "2",
         "--output-len", "8", "--repeats", "2", "--mixed-long", "0", "--no-warmup"]
    )  # fmt: skip
    servers: dict = {}
    rows: list = []
    bench_vllm._solo(args, tmp_path, tmp_path, servers, [], 512, rows)
    assert events == ["start gpu-plugin", "stop gpu-plugin", "start mmap", "stop mmap"]
    assert [(r["backend"], r["repeat"]) for r in rows] == [
        ("gpu-plugin", 1),
        ("gpu-plugin", 2),
        ("mmap", 1),
        ("mmap", 2),
    ]
    assert all(r["ok"] == 2 for r in rows) and set(servers) == {"gpu-plugin", "mmap"}


def test_a_solo_servers_share_ends_between_repeats(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """A server whose share of a ``--solo`` run is used up finishes the repeat it started:
    every load once (a reference whose first start compiled vLLM's kernels had c1 and c8
    measured, not c64 or the mixed load, so those had nothing to pair with); no second
    repeat starts after the share, and the run's deadline still stops a load."""
    import vllm_clock
    from vllm_dry_run import _Fake
    from vllm_servers import Server

    fake = _Fake(0.001)
    fake.start()
    server = Server("gpu-plugin", fake.port, tmp_path / "gpu-plugin.log")
    server.healthy = True
    args = bench_vllm.parse_args(
        ["--backends", "gpu-plugin", "--concurrency", "1,2", "--requests", "2", "--output-len",
         "4", "--repeats", "3", "--mixed-long", "0", "--no-warmup"]
    )  # fmt: skip
    rows: list = []
    # The share is over before the first load: the first repeat still runs whole.
    asyncio.run(bench_vllm.measure(args, {"gpu-plugin": server}, [], 512, rows, time.monotonic()))
    assert [(r["repeat"], r["load"]) for r in rows] == [(1, "c1"), (1, "c2")]
    assert all(r["ok"] == 2 for r in rows)
    # A share that lasts: every repeat.
    rows.clear()
    later = time.monotonic() + 600
    asyncio.run(bench_vllm.measure(args, {"gpu-plugin": server}, [], 512, rows, later))
    assert [r["repeat"] for r in rows] == [1, 1, 2, 2, 3, 3]
    # The deadline cuts inside the first repeat: nothing starts past it.
    rows.clear()
    monkeypatch.setattr(vllm_clock, "DEADLINE", time.monotonic() - 1)
    asyncio.run(bench_vllm.measure(args, {"gpu-plugin": server}, [], 512, rows, time.monotonic()))
    assert rows == []


def test_solo_shares_the_loads_time_and_starts_no_server_it_has_no_time_for(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """On a fake clock: starts take what the H200 took, each backend's loads use all the
    time they are given, a stop takes a second."""
    import vllm_clock
    from vllm_servers import Server

    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    start_took: dict[str, float] = {}
    started: list[str] = []
    budgets: dict[str, float] = {}

    def start(args, ckpt, backend, plugin_dir):  # type: ignore[no-untyped-def]
        started.append(backend)
        return Server(backend, 1, tmp_path / f"{backend}.log")

    def healthy(servers, limit, grace):  # type: ignore[no-untyped-def]
        for s in servers:
            now[0] += start_took[s.backend]
            s.healthy = True

    async def measure(args, servers, tables, vocab, rows, share_end):  # type: ignore[no-untyped-def]
        (b,) = servers
        assert args.backends == [b]
        assert share_end <= vllm_clock.DEADLINE  # the share, inside the whole deadline
        budgets[b] = share_end - now[0]
        now[0] = max(now[0], share_end)

    def stop(servers):  # type: ignore[no-untyped-def]
        now[0] += 1.0

    monkeypatch.setattr(bench_vllm, "start_server", start)
    monkeypatch.setattr(bench_vllm, "wait_healthy", healthy)
    monkeypatch.setattr(bench_vllm, "stop_servers", stop)
    monkeypatch.setattr(bench_vllm, "measure", measure)
    monkeypatch.setattr(bench_vllm, "gpu_used_total", lambda: None)

    def solo(backends: str, seconds: float, starts: list[float]) -> float:
        started.clear()
        budgets.clear()
        start_took.update(zip(backends.split(","), starts, strict=True))
        whole = now[0] + seconds
        monkeypatch.setattr(vllm_clock, "DEADLINE", whole)
        args = bench_vllm.parse_args(["--solo", "--backends", backends])
        bench_vllm._solo(args, tmp_path, tmp_path, {}, [], 512, [])
        assert vllm_clock.DEADLINE == whole  # the whole deadline is back afterwards
        return whole

    # Too little time for a start and the least loads: nothing is started.
    solo("gpu-plugin,mmap", 120, [99, 54])
    assert started == []
    # The H200's Gemma 4 run: 278 s left for two, the first start 99 s on a fresh host.
    # Splitting wall time gave the GPU table -12 s of loads; split by loads, both measure.
    whole = solo("gpu,mmap", 278, [99, 54])
    assert started == ["gpu", "mmap"]
    want_gpu = (278 - 99 - (2 * bench_vllm.SOLO_STOP_GUESS_S + 99)) / 2  # 25 s
    assert budgets["gpu"] == pytest.approx(max(want_gpu, bench_vllm.SOLO_MIN_LOADS_S))
    assert budgets["mmap"] > budgets["gpu"] > 20
    assert now[0] <= whole + bench_vllm.SOLO_STOP_GUESS_S
    # The Gemma 3n run: 430 s for three; every backend gets at least a minimum of loads,
    # and none starts after the deadline.
    whole = solo("gpu-plugin,mmap,mmap-kernel", 430, [76, 56, 49])
    assert started == ["gpu-plugin", "mmap", "mmap-kernel"]
    assert min(budgets.values()) > bench_vllm.SOLO_MIN_LOADS_S
    assert now[0] <= whole + bench_vllm.SOLO_STOP_GUESS_S
    # The Gemma 4 E4B split run: 335 s for three, the first start 104 s (vLLM's kernels
    # compiled), the next ones 65 and 53 s. The reference once got no loads (the slow
    # start taken for every later one); now each started server measures at least the
    # minimum, and a server the rest has no room for is not started.
    whole = solo("gpu-plugin,mmap-split,mmap-split-lead", 335, [104, 65, 53])
    assert started[:2] == ["gpu-plugin", "mmap-split"]
    assert budgets["gpu-plugin"] >= bench_vllm.SOLO_MIN_LOADS_S
    assert all(budgets[b] >= bench_vllm.SOLO_MIN_LOADS_S for b in started)
    assert now[0] <= whole + bench_vllm.SOLO_STOP_GUESS_S
    # A residency share on a fresh H100 host: 446 s left for two, the first start 206 s
    # (kernels compiled), the next 59 s. Taking the first start for the next one left mmap
    # unstarted with 190 s to go; the first start's excess is not expected again.
    whole = solo("disk,mmap", 446, [206, 59])
    assert started == ["disk", "mmap"]
    assert budgets["disk"] >= bench_vllm.SOLO_MIN_LOADS_S
    assert budgets["mmap"] > budgets["disk"]
    assert now[0] <= whole + bench_vllm.SOLO_STOP_GUESS_S


def test_stopping_a_server_ends_its_whole_process_group(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import subprocess

    from vllm_probes import group_members
    from vllm_servers import Server, stop_servers

    # A parent that ignores SIGTERM's default for its child: the child must end too.
    proc = subprocess.Popen(
        ["bash", "-c", "sleep 60 & trap '' TERM; sleep 60 & wait"], start_new_session=True
    )
    time.sleep(0.5)
    assert len(group_members(proc.pid)) >= 2
    stop_servers([Server("mmap", 1, tmp_path / "log", proc=proc)], grace=1.0)
    assert group_members(proc.pid) == []


def test_sync_scheduling_turns_async_scheduling_off_in_every_server() -> None:
    """``--sync-scheduling``: each backend's engine says ``--no-async-scheduling`` (and only
    then); the rest of its arguments are the same."""
    from vllm_servers import engine_argv

    base = ["--model", "gemma3n-e2b", "--backends", "gpu-plugin,mmap"]
    on = bench_vllm.parse_args(base)
    off = bench_vllm.parse_args([*base, "--sync-scheduling"])
    for backend in ("gpu-plugin", "mmap"):
        a, b = engine_argv(on, backend), engine_argv(off, backend)
        assert "--async-scheduling" in a and "--no-async-scheduling" not in a
        assert "--no-async-scheduling" in b and "--async-scheduling" not in b
        assert [x for x in a if x != "--async-scheduling"] == [
            x for x in b if x != "--no-async-scheduling"
        ]


def test_the_gemma_bench_models_have_the_released_checkpoints_widths() -> None:
    """The text configs the bench writes its Gemma checkpoints from (transformers' own
    classes): Gemma 4 E2B and E4B as their released config.json's text_config describe
    them, transformers' Gemma 4 defaults apart (they are not E2B's widths)."""
    pytest.importorskip("transformers")
    from vllm_servers import GEMMA_MODELS, gemma_config

    want = {  # layers, hidden, per-layer table [rows, layers x 256], full-attention layers
        "gemma4-e2b": (35, 1536, [262144, 35 * 256], 7),
        "gemma4-e4b": (42, 2560, [262144, 42 * 256], 7),
        "gemma4-default": (30, 2304, [262144, 30 * 256], 5),
        "gemma3n-e2b": (30, 2048, [262144, 30 * 256], None),
        "gemma3n-e4b": (35, 2048, [262144, 35 * 256], None),
    }
    for model, (layers, hidden, table, full) in want.items():
        cfg = gemma_config(model)
        assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["table"]) == (
            layers, hidden, table), model  # fmt: skip
        if full is not None:
            assert cfg["full_layers"] == full, model
    e2b, e4b = GEMMA_MODELS["gemma4-e2b"]["overrides"], GEMMA_MODELS["gemma4-e4b"]["overrides"]
    assert (e2b["num_kv_shared_layers"], e2b["use_double_wide_mlp"]) == (20, True)
    assert (e4b["num_kv_shared_layers"], e4b["use_double_wide_mlp"]) == (18, False)
    assert e2b["layer_types"][:5] == ["sliding_attention"] * 4 + ["full_attention"]
    assert e4b["layer_types"][:6] == ["sliding_attention"] * 5 + ["full_attention"]


def test_the_report_says_where_a_profiled_graph_loses_time(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """The profile phase keeps each server's replays; the report aligns each against the
    reference's and names the stall."""
    import asyncio

    import vllm_clock
    from vllm_dry_run import _Fake
    from vllm_report import report
    from vllm_servers import Server, profile_dir

    fakes = {"gpu": _Fake(0.002), "mmap": _Fake(0.002)}
    fakes["mmap"].stall_us = 300.0
    args = bench_vllm.parse_args(
        ["--backends", "gpu,mmap", "--profile-steps", "4", "--log-dir", str(tmp_path),
         "--concurrency", "1", "--mixed-long", "0"]
    )  # fmt: skip
    args.ref = "gpu"
    servers = {}
    for b, f in fakes.items():
        f.trace_dir = profile_dir(args, b)
        f.start()
        servers[b] = Server(b, f.port, tmp_path / f"{b}.log", healthy=True, ready_s=0.0)
    vllm_clock.DEADLINE = vllm_clock.time.monotonic() + 60
    try:
        asyncio.run(bench_vllm.profile(args, servers, 512))
    finally:
        vllm_clock.DEADLINE = float("inf")
    assert all(s.replays for s in servers.values())
    report(args, [], servers, {"model": "fake", "setup": "", "command": "test"}, [])
    out = capsys.readouterr().out
    assert "1-token decode steps profiled on each server" in out
    assert "mmap against gpu:" in out
    assert "| +300.0 |" in out  # the norm kernel starts 300 us late in mmap's graphs


def test_delivery_stats_read_the_expected_steps_of_each_layer() -> None:
    """A stats line of a wheel that had ``expect_prefill`` (since removed), with its
    counts, and lines without them: each layer's totals, the fills still read."""
    from vllm_report import delivery_stats

    head = (
        "ple-memops stats, last 2.0 s: 40 deferred steps (30 replays, 10 eager), 0 synchronous "
        "replays; per layer, fills, mean READY -> FILLED (of replays', of eager steps'), rows "
        "read cold and completes that waited: "
    )
    lines = [
        head + "layers.0 9 fills, 1.0 us (9 replays 1.0 us, 0 eager), 0.0% rows cold",  # dropped
        head + "layers.0 40 fills, 30.0 us (30 replays 10.0 us, 10 eager 90.0 us), 0.0% rows "
        "cold, 10 steps expected (20480 rows early, 0 wrong); layers.6 40 fills, 20.0 us (30 "
        "replays 10.0 us, 10 eager 50.0 us), 0.0% rows cold, 2 completes waited 40.0 us, 10 "
        "steps expected (20480 rows early, 3 wrong)",
        head + "layers.0 40 fills, 30.0 us (40 replays 30.0 us, 0 eager), 0.0% rows cold",
    ]
    got = delivery_stats("\n".join(lines))
    assert got["expected"] == {
        "layers.0": {"steps": 10, "early": 20480, "wrong": 0},
        "layers.6": {"steps": 10, "early": 20480, "wrong": 3},
    }
    assert got["fill_us"]["layers.0"] == 30.0 and got["late_completes"] == {"layers.6": 2}


def test_cost_stats_read_the_host_time_with_and_without_expect() -> None:
    """The host-time part of a stats line, of this wheel (the graph launch after
    ``stats``, the results' wait after it), of older ones that had ``expect`` between
    ``stats`` and the launch (its setting since removed), and of older ones still (no
    results' wait; no ``expect``; no launch either)."""
    from vllm_report import cost_stats

    base = (
        "host us per engine step over 400: total p50 41.2 p99 95.0, step p50 6.1 p99 9.0, "
        "arm p50 20.3 p99 40.2, wait p50 0.4 p99 30.1, check p50 3.0 p99 5.2, stats p50 0.2 "
        "p99 0.5"
    )
    launch = "; graph launch p50 12.0 p99 20.1"
    results = ", results wait p50 18.5 p99 4005.0"
    now = cost_stats([base + launch + results])["host_us"]
    assert now["launch"] == 12.0 and now["results"] == 18.5 and now["expect"] != now["expect"]
    new = cost_stats([base + ", expect p50 31.5 p99 50.0" + launch + results])
    assert new["host_us"]["expect"] == 31.5 and new["host_us"]["launch"] == 12.0
    assert new["host_us"]["arm"] == 20.3 and new["host_us"]["total_p50"] == 41.2
    assert new["host_us"]["results"] == 18.5 and new["host_us"]["results_p99"] == 4005.0
    # Step-weighted over the lines, as every field.
    two = cost_stats(
        [
            base + ", expect p50 31.5 p99 50.0" + launch + results,
            base.replace("over 400", "over 100")
            + ", expect p50 31.5 p99 50.0"
            + launch
            + ", results wait p50 8.5 p99 5.0",
        ]
    )["host_us"]
    assert two["results"] == (400 * 18.5 + 100 * 8.5) / 500
    before = cost_stats([base + ", expect p50 31.5 p99 50.0" + launch])["host_us"]
    assert before["expect"] == 31.5 and before["results"] != before["results"]
    old = cost_stats([base + launch])["host_us"]
    assert old["launch"] == 12.0 and old["expect"] != old["expect"]  # NaN: not in the line
    older = cost_stats([base])["host_us"]
    assert older["stats"] == 0.2 and older["launch"] != older["launch"]


def test_the_breakdown_shows_both_parts_of_a_split_gemma_table() -> None:
    """A Gemma table split at decoder layer 0 (``split_rows``) is two tables, neither named
    after a layer: the stall column shows both, layer 0's slice first; a Qwen4Exp server's
    shows its first PLE layer only."""
    from vllm_report import breakdown_markdown

    def stall(p50: float) -> dict[str, float]:
        return {"steps": 100, "stalled_pct": 50.0, "p50_us": p50, "p99_us": 2 * p50,
                "max_us": 3 * p50, "mean_us": p50}  # fmt: skip

    gemma = "model.embed_tokens_per_layer"
    summary = {
        ("c64", "mmap-split"): {
            "n": 1, "itl_p50_ms": 6.6, "gpu_busy_pct": 70.0,
            "stall": {f"{gemma}.rest": stall(20.0), gemma: stall(1.5)},
        },
        ("c64", "mmap"): {
            "n": 1, "itl_p50_ms": 6.8, "gpu_busy_pct": 70.0,
            "stall": {"model.layers.6.ple": stall(9.0), "model.layers.0.ple": stall(150.0)},
        },
    }  # fmt: skip
    out = breakdown_markdown([], summary, "gpu")
    split_row = next(ln for ln in out.splitlines() if "| mmap-split |" in ln)
    assert f"{gemma}: 50%, 1.5 / 3.0 / 1.5; {gemma}.rest: 50%, 20.0 / 40.0 / 20.0" in split_row
    qwen_row = next(ln for ln in out.splitlines() if "| mmap |" in ln)
    assert "model.layers.0.ple: 50%, 150.0" in qwen_row and "layers.6" not in qwen_row


def test_a_solo_run_pairs_each_repeat_with_the_references_median() -> None:
    """Side by side, a repeat is paired with the reference of its own round and a round
    the reference lacks pairs nothing; ``--solo`` has no shared round (and its first server
    often gets fewer rounds), so every repeat is compared with the median of the
    reference's repeats of that load, and the breakdown says which pairing it used."""
    from vllm_report import breakdown_markdown, paired

    def row(load: str, rep: int, b: str, itl: float) -> dict[str, object]:
        return {"load": load, "repeat": rep, "backend": b, "ok": True, "itl_p50_ms": itl}

    rows = [row("c64", 1, "gpu-plugin", 6.64), row("c64", 1, "gpu-b", 6.57),
            row("c64", 2, "gpu-b", 6.58), row("c64", 1, "mmap", 6.57),
            row("c64", 2, "mmap", 6.60), row("c64", 3, "mmap", 6.59),
            row("c64", 2, "gpu-plugin", 6.60),
            {**row("c64", 4, "mmap", 9.9), "ok": False}]  # fmt: skip
    side = paired(rows, "gpu-plugin", "itl_p50_ms")
    assert side[("c64", "mmap")] == pytest.approx([(6.57 / 6.64 - 1) * 100, 0.0])
    solo = paired(rows, "gpu-plugin", "itl_p50_ms", solo=True)
    ref = (6.64 + 6.60) / 2
    assert solo[("c64", "mmap")] == pytest.approx([(x / ref - 1) * 100 for x in (6.57, 6.60, 6.59)])
    assert solo[("c64", "gpu-b")] == pytest.approx([(x / ref - 1) * 100 for x in (6.57, 6.58)])
    assert ("c64", "gpu-plugin") not in solo
    summary = {("c64", "mmap"): {"n": 3, "itl_p50_ms": 6.59, "gpu_busy_pct": 70.0}}
    solo_md = breakdown_markdown(rows, summary, "gpu-plugin", solo=True)
    assert "against the median of `gpu-plugin`'s repeats" in solo_md
    assert f"{(6.59 / ref - 1) * 100:+.2f}%" in solo_md
    side_md = breakdown_markdown(rows, summary, "gpu-plugin")
    assert "in the same round" in side_md and "run with --solo" in side_md
    assert "run with --solo" not in solo_md


def test_gpu_plugin_b_is_the_same_engine_as_gpu_plugin() -> None:
    """``gpu-plugin-b``, the A/A partner of ``gpu-plugin``, gets the same engine arguments
    in every family, graph timing included (``gpu-b`` is the stock engine: untimed)."""
    from vllm_servers import engine_argv, known_backends

    for model in ("bench", "gemma4-e4b", "gemma3n-e2b"):
        argv = ["--model", model, "--backends", "gpu-plugin,gpu-plugin-b,gpu-b", "--time-graphs"]
        args = bench_vllm.parse_args(argv)
        assert "gpu-plugin-b" in known_backends(), model
        a, b = engine_argv(args, "gpu-plugin"), engine_argv(args, "gpu-plugin-b")
        assert a == b and '"time_graphs": true' in " ".join(a), model
        assert '"time_graphs"' not in " ".join(engine_argv(args, "gpu-b")), model


def test_disk_is_vllms_own_disk_offload_and_the_rest_of_the_engine_is_gpus() -> None:
    """``disk`` (Qwen4Exp only) asks vLLM for its disk offload and the plugin stays out;
    every other argument is the GPU table server's. The bench model's hyper-connection
    widths are ones vLLM 0.34.0 loads unquantized (``hc_lowrank + hc_count`` a multiple of
    16; it pads the rest with a shard it never loads)."""
    import vllm_bench_model as vbm
    from vllm_servers import engine_argv, engine_env, known_backends

    args = bench_vllm.parse_args(["--model", "bench", "--backends", "gpu,disk"])
    disk, gpu = engine_argv(args, "disk"), engine_argv(args, "gpu")
    engram = json.loads(disk[disk.index("--engram-config") + 1])
    assert engram == {"cpu_offload": False, "disk_offload": True}
    assert json.loads(gpu[gpu.index("--engram-config") + 1]) == {"cpu_offload": False}
    assert [x for x in disk if "offload" not in x] == [x for x in gpu if "offload" not in x]
    assert "PLE_MEMOPS_TABLE_BACKEND" not in engine_env("disk", Path("/nonexistent"))
    assert '"ple_memops"' not in " ".join(disk)
    assert "disk" in known_backends("qwen4exp") and "disk" not in known_backends("gemma4")
    for tiny in (False, True):
        cfg = vbm.bench_config(layers=4, experts=4, topk=2, ple_layers=1, table_gib=0.01,
                               dtype="bf16", attention_every=0, vocab=512, split_parts=4,
                               tiny=tiny)  # fmt: skip
        assert (cfg["hc_lowrank"] + cfg["hc_count"]) % 16 == 0, cfg["hc_lowrank"]


def test_data_parallel_ranks_reach_every_server_and_the_results() -> None:
    """``--data-parallel-size N``: every server runs N engine ranks (one a GPU); nothing
    else of its command line changes."""
    from vllm_servers import engine_argv

    one = bench_vllm.parse_args(["--backends", "mmap,uva"])
    two = bench_vllm.parse_args(["--backends", "mmap,uva", "--data-parallel-size", "2"])
    for b in ("mmap", "uva"):
        a, o = engine_argv(two, b), engine_argv(one, b)
        at = a.index("--data-parallel-size") + 1
        assert (a[at], o[at]) == ("2", "1")
        assert a[:at] + a[at + 1 :] == o[:at] + o[at + 1 :]  # nothing else differs


def test_a_replica_is_one_more_identical_server_and_host_memory_is_reported() -> None:
    """``NAME.K`` (K >= 2) serves as ``NAME`` does (several servers of one checkpoint); the
    report gives the host's memory before the servers and with all of them."""
    from vllm_probes import host_memory
    from vllm_report import markdown
    from vllm_servers import base_backend, engine_argv, engine_env

    assert [base_backend(b) for b in ("mmap.2", "uva.4", "mmap-b", "mmap.1", "gpu")] == [
        "mmap", "uva", "mmap-b", "mmap.1", "gpu"]  # fmt: skip
    args = bench_vllm.parse_args(["--backends", "mmap,mmap.2,uva,uva.2"])
    plugin = Path("/nonexistent")
    for b in ("mmap", "uva"):
        assert engine_argv(args, f"{b}.2") == engine_argv(args, b)
        assert engine_env(f"{b}.3", plugin) == engine_env(b, plugin)
    mem = host_memory()
    assert 0 < mem["used"] and 0 <= mem["cached"] and 0 <= mem["shmem"]
    meta = {"model": "m", "host_memory_before": {"used": 10.0, "cached": 4.0, "shmem": 0.5},
            "host_memory_all_servers": {"used": 12.5, "cached": 8.0, "shmem": 0.5}}  # fmt: skip
    md = markdown({}, {"mmap": {}, "mmap.2": {}}, meta)
    assert "10.00 GiB before the servers, 12.50 GiB with all 2 healthy (+2.50)" in md
    assert "page cache 4.00 -> 8.00 GiB" in md


def test_the_report_compares_graph_spans_at_equal_batch_sizes(fake_stream: Any) -> None:
    """The graph lines a server logs with each replay keyed by its batch size (what the
    plugin's graph manager writes, ``GraphClock`` over a fake stream) are read per size,
    summed over repeats, and the report compares two servers' spans at the same size: a
    load whose batches vary in different proportions no longer hides a cost per size
    behind a p50 over the mix."""
    from vllm_report import graph_stats, sizes_markdown, summarize

    from ple_memops.step_costs import GraphClock

    def lines(spans: dict[int, tuple[float, int]]) -> str:
        clock, out = GraphClock(event=fake_stream.event), []
        for _ in range(3):  # the first line of a load is dropped
            for size, (span, n) in spans.items():
                for _ in range(n):

                    def graph(span: float = span) -> None:
                        fake_stream.now += span

                    clock.around(graph, key=size)
                    fake_stream.now += 20.0
            times = clock.summary()
            assert times is not None
            out.append(f"INFO x ple-memops graphs, last 2.0 s: {times.text()}")
        return "\n".join(out)

    ref = graph_stats(lines({16: (5000.0, 8), 24: (5200.0, 2)}))["graphs"]
    assert ref["launches"] == 20 and ref["by_size"] == {16: [16, 5000.0], 24: [4, 5200.0]}
    # The other server: the same +10 us at each size, but more of its replays at 24.
    other = graph_stats(lines({16: (5010.0, 2), 24: (5210.0, 8)}))["graphs"]
    assert other["span_p50_us"] > ref["span_p50_us"] + 150  # the mix, not a cost

    def row(b: str, rep: int, g: dict[str, Any]) -> dict[str, Any]:
        return {"load": "mixed", "repeat": rep, "backend": b, "ok": True, "tok_s": 1.0,
                "graphs": g}  # fmt: skip

    summary = summarize([row("gpu-plugin", 1, ref), row("gpu-plugin", 2, ref),
                         row("mmap", 1, other)], ["gpu-plugin", "mmap"])  # fmt: skip
    assert summary[("mixed", "gpu-plugin")]["graphs"]["by_size"] == {
        16: [32, 5000.0], 24: [8, 5200.0]}  # fmt: skip
    # A run's JSON read back (its sizes strings) summarises the same.
    rows = json.loads(json.dumps([row("gpu-plugin", 1, ref), row("gpu-plugin", 2, ref)]))
    again = summarize(rows, ["gpu-plugin"])[("mixed", "gpu-plugin")]
    assert again == summary[("mixed", "gpu-plugin")]
    md = sizes_markdown(summary, "gpu-plugin")
    assert "| mixed | 16 | 5,000.0 (x32) | mmap 5,010.0 (+10.0; x4) |" in md
    assert "| mixed | 24 | 5,200.0 (x8) | mmap 5,210.0 (+10.0; x16) |" in md
    one_size = {("c64", "gpu-plugin"): {"graphs": {"by_size": {64: [10, 6000.0]}}}}
    assert sizes_markdown(one_size, "gpu-plugin") == ""


def test_graph_lines_give_the_host_launch_and_the_wait_for_results(fake_stream: Any) -> None:
    """The host's side of a graph line (the launch call, the engine's wait for a step's
    results) as ``GraphClock`` writes it, launch-weighted over a load's lines (the first
    dropped), and absent in the lines of older wheels."""
    from vllm_report import graph_stats

    from ple_memops.step_costs import GraphClock

    clock = GraphClock(event=fake_stream.event)
    clock.around(lambda: None)
    clock.results(lambda: None)()
    times = clock.summary()
    assert times is not None
    text = f"INFO ple-memops graphs, last 0.5 s: {times.text()}"
    assert "; host launch us p50 " in text and "; results wait us p50 " in text
    head = "INFO ple-memops graphs, last 0.5 s: {} graphs on the GPU: span us p50 5000.0 p99 6000.0"
    lines = [
        head.format(10) + "; host launch us p50 999.0 p99 999.0",  # dropped: the first
        head.format(30) + "; host launch us p50 80.0 p99 100.0; results wait us p50 20.0 p99 900.0",
        head.format(10) + "; host launch us p50 120.0 p99 300.0; results wait us p50 4000.0 "
        "p99 4100.0; span p50 by size: 64 x10 5000.0",
    ]
    g = graph_stats("\n".join(lines))["graphs"]
    assert g["launches"] == 40 and g["launch_host_p50_us"] == (30 * 80 + 10 * 120) / 40
    assert g["launch_host_p99_us"] == (30 * 100 + 10 * 300) / 40
    assert g["results_p50_us"] == (30 * 20 + 10 * 4000) / 40
    assert g["results_p99_us"] == (30 * 900 + 10 * 4100) / 40
    old = graph_stats("\n".join([head.format(1), head.format(5)]))["graphs"]
    assert old["launches"] == 5 and old["results_p50_us"] is None
    assert old["launch_host_p50_us"] is None


def test_the_sm_clock_is_sampled_and_shown_beside_gpu_busy() -> None:
    """nvidia-smi's samples (busy %, SM MHz, watts; ``[N/A]`` where it has no value) give
    each load the busy mean, the clock's median and lowest sample and the power's median,
    the first sample dropped (it may predate the load); the summary keeps the lowest clock
    of any repeat and the tables show the clock beside GPU busy, its lowest only when it
    fell more than 5% under the median."""
    from vllm_probes import Utilization
    from vllm_report import breakdown_markdown, markdown, summarize

    lines = ["0, 345, 79.7", "70, 1980, 281.4", "72, 1980, [N/A]", "68, 1755, 300.0", "junk"]
    samples = [s for s in map(Utilization.parse, lines) if s is not None]
    assert samples[2] == (72.0, 1980.0, None) and len(samples) == 4
    got = Utilization.summary(samples)
    assert got == {"gpu_busy_pct": pytest.approx(70.0), "sm_mhz_p50": 1980.0,
                   "sm_mhz_min": 1755.0, "power_w_p50": pytest.approx(290.7)}  # fmt: skip
    assert Utilization.summary([]) == dict.fromkeys(got)

    def row(rep: int, b: str, mhz: float, low: float) -> dict[str, Any]:
        return {"load": "c8", "repeat": rep, "backend": b, "ok": True, "itl_p50_ms": 5.4,
                "tok_s": 1000.0, "gpu_busy_pct": 70.0, "sm_mhz_p50": mhz,
                "sm_mhz_min": low}  # fmt: skip

    rows = [row(1, "gpu", 1980, 1965), row(2, "gpu", 1980, 1980),
            row(1, "mmap", 1980, 1980), row(2, "mmap", 1800, 1500)]  # fmt: skip
    summary = summarize(rows, ["gpu", "mmap"])
    assert summary[("c8", "mmap")]["sm_mhz_p50"] == 1890.0
    assert summary[("c8", "mmap")]["sm_mhz_min"] == 1500.0
    for md in (breakdown_markdown(rows, summary, "gpu"), markdown(summary, {}, {})):
        gpu_row = next(ln for ln in md.splitlines() if ln.startswith("| c8 | gpu |"))
        assert "70% @ 1980 MHz |" in gpu_row  # 1965 is within 5%
        mmap_row = next(ln for ln in md.splitlines() if ln.startswith("| c8 | mmap |"))
        assert "70% @ 1890 MHz (min 1500) |" in mmap_row


def test_graph_windows_splits_each_load_into_its_first_window_and_the_rest(
    tmp_path: Any,
) -> None:
    """``graph_windows.py`` reads a server's graph lines: a line covering more than the
    idle threshold is the gap before a load, the next one that load's first window; sizes
    with too few replays in a window are left out; the archive the bench writes is read
    as the log files are."""
    import io
    import tarfile

    from graph_windows import markdown, read_logs, windows

    def line(last: float, sizes: str) -> str:
        return (
            f"INFO ple-memops graphs, last {last} s: 80 graphs on the GPU: span us p50 1.0 "
            f"p99 2.0; period p50 3.0; outside the graph p50 4.0; span p50 by size: {sizes}"
        )

    text = "\n".join([
        line(30.0, "8 x15 9000.0"),  # start-up and warm-up: idle before the first load
        line(0.5, "8 x80 4750.0"), line(0.5, "8 x75 5140.0, 4 x3 4000.0"),
        line(0.5, "8 x70 5150.0"),
        line(19.3, "8 x2 5143.0"),  # the gap before the next load
        line(0.5, "8 x78 4760.0"), line(0.5, "8 x72 5130.0"),
        "INFO ple-memops stats, last 0.5 s: 78 deferred steps",
    ])  # fmt: skip
    got = windows(text)
    assert got == {8: [[4750.0, 4760.0], [5140.0, 5150.0, 5130.0]]}
    md = markdown({"mmap": text})
    assert "| mmap | 8 | 2, 4,755 | 3, 5,140 | +385 |" in md
    buf = io.BytesIO(text.encode())
    with tarfile.open(tmp_path / "bench_logs_x.tgz", "w:gz") as tar:
        info = tarfile.TarInfo("server-mmap.log")
        info.size = len(buf.getvalue())
        tar.addfile(info, buf)
    (tmp_path / "server-gpu-plugin.log").write_text(line(30.0, "8 x1 1.0"))
    logs = read_logs([tmp_path / "bench_logs_x.tgz", tmp_path / "server-gpu-plugin.log"])
    assert logs["mmap"] == text and set(logs) == {"mmap", "gpu-plugin"}


def test_the_verdict_judges_paired_itl_against_the_runs_reference() -> None:
    """The verdict judges ``mmap``'s paired ITL p50 against the run's reference (here
    ``gpu-plugin``, as in every Gemma run), gives the A/A partner's own paired ITL beside
    it, and lists what the run did not measure (no offload server) as not measured, never
    as missed; a load over +1% is a miss, named with its A/A."""
    from vllm_report import summarize, verdict

    def row(load: str, rep: int, b: str, itl: float) -> dict[str, object]:
        return {"load": load, "repeat": rep, "backend": b, "ok": True, "itl_p50_ms": itl,
                "tok_s": 1000.0 / itl, "ttft_p50_ms": 150.0}  # fmt: skip

    backends = ["gpu-plugin", "mmap", "gpu-plugin-b"]
    rows = [row(load, rep, b, itl * (1 + 0.001 * rep))
            for load, itl in (("c8", 5.43), ("mixed", 5.87))
            for rep in (1, 2, 3) for b in backends]  # fmt: skip
    v = verdict(rows, summarize(rows, backends), "gpu-plugin", "offload", solo=True)
    assert v.startswith("VERDICT (reported, not asserted): no target missed; not measured: ")
    assert "c8: tok/s vs offload" in v and "mixed: TTFT vs offload" in v
    assert "c8 ITL p50 +0.00% vs gpu-plugin (A/A +0.00%)" in v
    assert "targets missed" not in v

    slow = [dict(r, itl_p50_ms=r["itl_p50_ms"] * 1.02) if r["backend"] == "mmap"
            and r["load"] == "mixed" else r for r in rows]  # fmt: skip
    v = verdict(slow, summarize(slow, backends), "gpu-plugin", "offload", solo=True)
    assert "targets missed: mixed: ITL p50 +2.00% vs gpu-plugin (A/A +0.00%) (target <= +1%)" in v
    assert "c8: ITL" not in v.split("[")[0]

    # With vLLM's offload measured, throughput below it and a later TTFT are misses too.
    off = rows + [dict(row("mixed", rep, "offload", 5.0), ttft_p50_ms=100.0) for rep in (1, 2, 3)]
    v = verdict(off, summarize(off, [*backends, "offload"]), "gpu-plugin", "offload", solo=True)
    assert "mixed: tok/s" in v and "mixed: TTFT p50 150 ms > offload 100 ms" in v
    assert "not measured: c8: tok/s vs offload" in v

    # Where the two identical servers differ by more than the target, a difference is not
    # resolved, neither met nor missed (the H200's solo run of 2026-12-04: A/A +24.75% at
    # c1); tok/s and TTFT against offload likewise when the A/A differs by as much.
    noisy = [dict(r, itl_p50_ms=r["itl_p50_ms"] * {"mmap": 1.05, "gpu-plugin-b": 1.03}.get(
        r["backend"], 1.0), tok_s=r["tok_s"] * (0.8 if r["backend"] == "gpu-plugin-b" else 1.0),
        ttft_p50_ms=r["ttft_p50_ms"] * (1.6 if r["backend"] == "gpu-plugin-b" else 1.0))
        for r in off]  # fmt: skip
    v = verdict(noisy, summarize(noisy, [*backends, "offload"]), "gpu-plugin", "offload", solo=True)
    head = v.split("[")[0]
    assert "targets missed" not in head, v
    assert "not resolved: c8: ITL vs gpu-plugin (A/A +3.00%), mixed: ITL vs gpu-plugin" in head
    assert "mixed: tok/s vs offload (A/A -20.00%)" in head  # mmap's -15%
    assert "mixed: TTFT vs offload (A/A +60.00%)" in head  # mmap's +50%
    # The same A/A cannot hide a difference larger than its own.
    worse = [dict(r, tok_s=r["tok_s"] * 0.5) if r["backend"] == "mmap" else r for r in noisy]
    v = verdict(worse, summarize(worse, [*backends, "offload"]), "gpu-plugin", "offload", solo=True)
    assert "targets missed: mixed: tok/s" in v

    # A second mmap server and the engine's wait for results (the graphs' clock) are
    # given beside the A/A.
    more = [
        *rows,
        *(
            dict(row(load, rep, "mmap-b", itl * (1 + 0.001 * rep) * 1.01), graphs=None)
            for load, itl in (("c8", 5.43), ("mixed", 5.87))
            for rep in (1, 2, 3)
        ),
    ]
    more = [dict(r, graphs={"results_p50_us": 28.0}) if r["backend"] == "mmap" else r
            for r in more]  # fmt: skip
    v = verdict(more, summarize(more, [*backends, "mmap-b"]), "gpu-plugin", "offload", solo=True)
    assert (
        "c8 ITL p50 +0.00% vs gpu-plugin (A/A +0.00%; second mmap +1.00%; engine's wait for "
        "results p50 28 us)" in v
    ), v


def test_the_verdict_against_vllms_own_offload_as_the_reference_asks_for_ahead() -> None:
    """With ``disk`` as the run's reference (the residency runs), mmap must be ahead of it
    (ITL below, tok/s above), not within +1%; a second mmap server (``mmap.2``) resolves
    a difference only when both lie beyond their own distance, on the same side."""
    from vllm_report import summarize, verdict

    def row(load: str, b: str, itl: float) -> dict[str, object]:
        return {"load": load, "repeat": 1, "backend": b, "ok": True, "itl_p50_ms": itl,
                "tok_s": 1000.0 / itl, "ttft_p50_ms": 150.0}  # fmt: skip

    itls = {("c1", "disk"): 5.94, ("c1", "mmap"): 4.74, ("c1", "mmap.2"): 4.75,
            ("c64", "disk"): 53.78, ("c64", "mmap"): 56.32, ("c64", "mmap.2"): 53.62}  # fmt: skip
    rows = [row(load, b, x) for (load, b), x in itls.items()]
    backends = ["disk", "mmap", "mmap.2"]
    v = verdict(rows, summarize(rows, backends), "disk", "disk", solo=True)
    head = v.split("[")[0]
    assert "no target missed" in head and "c1:" not in head, v  # both -20%, 0.2 points apart
    assert "not resolved: c64: ITL vs disk (two mmap servers +4.72% and -0.30%" in head, v
    assert "c64: tok/s vs disk (two mmap servers" in head  # -4.5% and +0.3%: either side
    assert "(target <= +1%)" not in v

    # Without a second server, mmap behind the reference is a miss, whatever its size.
    alone = [r for r in rows if r["backend"] != "mmap.2"]
    v = verdict(alone, summarize(alone, backends[:2]), "disk", "disk", solo=True)
    assert "targets missed: c64: ITL p50 +4.72% vs disk" in v and "(target: below it)" in v
    assert "c64: tok/s -4.51% vs disk (target >= 0)" in v and "c1: ITL" not in v.split("[")[0]


def test_the_plots_title_names_the_gpu_the_runs_recorded() -> None:
    import plot_vllm

    h100 = {"meta": {"gpu": "NVIDIA H100 80GB HBM3", "vllm": "0.34.0"}}
    h200 = {"meta": {"gpu": "NVIDIA H200", "vllm": "0.33.0"}}
    old = {"meta": {}}  # a run from before the GPU and the release were recorded
    assert plot_vllm.default_title([("a", h100), ("b", old)]) == (
        "vLLM 0.34.0 on NVIDIA H100 80GB HBM3: ITL p50 per backend"
    )
    both = plot_vllm.default_title([("a", h200), ("b", h100)])
    assert both.startswith("vLLM 0.33.0 and 0.34.0 on NVIDIA H100 80GB HBM3 and NVIDIA H200"), both
    assert plot_vllm.default_title([("a", old)]) == "vLLM: ITL p50 per backend"


def test_the_gpu_probes_read_nvidia_smis_answers(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm_probes

    smi = tmp_path / "nvidia-smi"  # answers the three queries as the real one does
    smi.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        '  --query-gpu=name) echo "NVIDIA H100 80GB HBM3" ;;\n'
        '  --query-gpu=memory.used) echo "1234" ;;\n'
        '  --query-gpu=uuid) echo "GPU-93b1ebec-c0aa-2539-1673-b7f6ee098134" ;;\n'
        "  *) exit 1 ;;\n"
        "esac\n"
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert vllm_probes.gpu_name() == "NVIDIA H100 80GB HBM3"
    assert vllm_probes.gpu_used_total() == 1234.0
    assert vllm_probes.gpu_uuid() == "GPU-93b1ebec-c0aa-2539-1673-b7f6ee098134"
    smi.write_text("#!/bin/sh\nexit 0\n")  # no answer: nothing recorded, no error
    assert vllm_probes.gpu_name() is None and vllm_probes.gpu_used_total() is None
    assert vllm_probes.gpu_uuid() is None


def test_the_disk_timer_times_vllms_staging_and_its_reads(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bench-only plugin wraps vLLM's ``stage_checkpoint_rows`` and the disk table's
    ``stage_rows`` where ``PLE_BENCH_TIME_DISK=1`` (and only there), prints its lines, and
    the report reads them into a per-load table; it is written as a vLLM plugin."""
    import sys
    import types

    import vllm_disk_timer
    from vllm_report import disk_stats, markdown, summarize

    class Disk:
        def stage_rows(self, n: int) -> None:
            time.sleep(0.002)

    def stage(modules: list[Disk], n: int) -> None:
        time.sleep(0.001)
        for m in modules:
            m.stage_rows(n)

    state = types.ModuleType("model_state")
    state.stage_checkpoint_rows = stage  # type: ignore[attr-defined]
    emb = types.ModuleType("ngram_embedding")
    emb.Qwen4ExpPLEDiskOffloadEmbedding = Disk  # type: ignore[attr-defined]
    nvidia = types.ModuleType("nvidia")
    nvidia.model_state = state  # type: ignore[attr-defined]
    for name, mod in (("vllm", types.ModuleType("vllm")),
                      ("vllm.models", types.ModuleType("models")),
                      ("vllm.models.qwen4_exp", types.ModuleType("qwen4_exp")),
                      ("vllm.models.qwen4_exp.nvidia", nvidia),
                      ("vllm.models.qwen4_exp.nvidia.model_state", state),
                      ("vllm.models.qwen4_exp.nvidia.ngram_embedding", emb)):  # fmt: skip
        monkeypatch.setitem(sys.modules, name, mod)
    original = Disk.stage_rows
    monkeypatch.setattr(Disk, "stage_rows", original)
    monkeypatch.delenv("PLE_BENCH_TIME_DISK", raising=False)
    vllm_disk_timer.register()
    assert state.stage_checkpoint_rows is stage  # off without the variable
    monkeypatch.setenv("PLE_BENCH_TIME_DISK", "1")
    monkeypatch.setenv("PLE_BENCH_TIME_DISK_EVERY", "0")
    vllm_disk_timer.register()
    vllm_disk_timer.register()  # once only
    assert state.stage_checkpoint_rows is not stage
    for _ in range(3):
        state.stage_checkpoint_rows([Disk(), Disk()], 8)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(ln.startswith("ple-bench disk: steps 1, stage p50 ") for ln in err)
    got = disk_stats("\n".join(err))["disk"]
    assert got["steps"] == 2 and got["stage_p50_us"] >= got["reads_p50_us"] >= 4000

    rows = [{"load": "c1", "repeat": 1, "backend": "disk", "ok": True, "tok_s": 10.0,
             "itl_p50_ms": 5.0, "disk": got}]  # fmt: skip
    md = markdown(summarize(rows, ["disk"]), {"disk": {}}, {"model": "m"})
    assert "| load | backend | staging p50 / p99 | reads p50 / p99 |" in md
    assert "| c1 | disk | " in md

    from vllm_harness import write_vllm_plugin

    # As bench_vllm.py installs it in its servers.
    write_vllm_plugin(
        tmp_path / "plugins", "ple_bench_disk_timer", Path(vllm_disk_timer.__file__).read_text()
    )
    entry = tmp_path / "plugins" / "ple_bench_disk_timer-0.dist-info" / "entry_points.txt"
    assert "ple_bench_disk_timer = ple_bench_disk_timer:register" in entry.read_text()
    assert (tmp_path / "plugins" / "ple_bench_disk_timer.py").read_text().startswith('"""')
    from vllm_servers import engine_env

    assert engine_env("disk", tmp_path)["PLE_BENCH_TIME_DISK"] == "1"
    assert "PLE_BENCH_TIME_DISK" not in engine_env("mmap", tmp_path)


def test_a_traceback_counts_while_the_server_runs_not_in_vllms_teardown(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from vllm_servers import log_facts

    running = "(EngineCore pid=1) ERROR [core.py:1] Traceback (most recent call last):\n"
    teardown = (
        "(EngineCore pid=1) INFO [core.py:1698] [shutdown] EngineCore: trigger received "
        "signal=SIGTERM\n"
        "(APIServer pid=2) INFO [launcher.py:256] [shutdown] API server: shutdown triggered\n"
        "(APIServer pid=2) ERROR [async_llm.py:957] Traceback (most recent call last):\n"
        "(APIServer pid=2) ERROR [async_llm.py:957] vllm.v1.engine.exceptions.EngineDeadError\n"
    )
    log = tmp_path / "server.log"
    log.write_text("Model loading took 13.18 GiB memory\n" + teardown)
    assert "log_markers" not in log_facts(log)
    log.write_text("Model loading took 13.18 GiB memory\n" + running + teardown)
    assert log_facts(log)["log_markers"] == ["Traceback"]
    log.write_text(running)
    assert log_facts(log)["log_markers"] == ["Traceback"]
