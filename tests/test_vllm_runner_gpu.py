"""The vLLM runner hooks on a real GPU, driven through Model Runner V2's sequence by a
stand-in runner (``vllm_stand_in.py``; vLLM itself cannot be installed on the GPU machine).

The stand-in is a small decoder (torch layers) with two PLE layers whose ids are the
Qwen4Exp n-gram ids (:class:`qwen4exp_ngram.NGramHasher`, checked against vLLM's
own ``compute_ngram_ids`` in ``test_vllm_real.py``), computed in the graph from graph-static
inputs, staged at the top of the forward and joined before each consumer, exactly as the
plugin's Qwen4Exp model does through the same custom ops. The runner follows MRV2: load
(plan), profile run (eager dummy), CUDA graph memory profiling (a throwaway manager that
captures the two largest graphs), warm-up (eager dummies and a real eager step), capture
of several decode sizes (eager warm-up, then capture in runtime mode NONE on a capture
stream), then serving with asynchronous scheduling: decode inputs come from the previous
step's samples on the GPU, the host launches each step without waiting for the previous
one, eager prefill / mixed steps interleave, and dummy replays (DP idle ranks) run armed.

Every executed step records its tokens, ids and consumed rows in a device ring; every
step's rows are checked against the table and its ids against the hash of its tokens.
Faults: a bad id, an exception between arming and the replay, a replay nobody armed, an
exception in an eager step: never a hang (every wait for the GPU is bounded), never
wrong rows (the consumer reads zeros), a typed error at the next call.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import ple_memops as pm

torch = pytest.importorskip("torch")
from vllm_stand_in import (  # noqa: E402
    EOS,
    HIST,
    PLE_AT,
    VOCAB,
    H,
    StandInRunner,
    boot,
    done,
    write_checkpoint,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    return write_checkpoint(tmp_path_factory.mktemp("standin"))


def _serve(r: StandInRunner, tables: dict[str, np.ndarray], rng: np.random.Generator) -> int:
    """The serving schedule; returns how many step rows were checked."""
    checked, first = 0, len(r.kinds)

    def check() -> None:
        nonlocal checked, first
        checked += r.check_ring(first, tables)
        first = len(r.kinds)

    def prompts(k: int) -> list[list[int]]:
        return [list(rng.integers(0, VOCAB, rng.integers(2, 9))) for _ in range(k)]

    r.eager_step(prompts(3))  # prefill 3 requests
    for phase in ((3, 30), (5, 30), (12, 30), (16, 20), (1, 20)):
        want, steps = phase
        if want > r.reqs:
            r.eager_step(prompts(want - r.reqs))  # mixed: decode tokens + new prompts
        else:
            r.reqs = want  # requests finished
        for k in range(steps):
            r.decode_step()
            if k % 10 == 5:
                r.dummy_replay(rng.integers(1, 9))  # armed like a real step
            if len(r.kinds) - first >= HIST - 4:
                check()
        check()
    return checked


def test_mrv2_sequence_every_step_checked(ckpt: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, tables = ckpt
    r = boot(path, "cuda", time_stalls=True)
    try:
        assert r.hooks.deferred, r.hooks.steps.reason
        pool = torch.cuda.graph_pool_handle()
        r.profile_run()
        r.profile_cudagraph_memory()
        r.warm_up()
        r.eager_step([[5, 6, 7, 8], [EOS, 9]])  # a real eager warm-up step (MRV2 warmup_kernels)
        r.reqs = 0
        r.capture_model(pool)
        assert r.manager is not None
        assert r.hooks.wait_descs == set(r.descs())  # every captured size, not one
        assert r.check_ring(0, tables) > 0  # the eager steps so far (dummies: ids only)
        checked = _serve(r, tables, np.random.default_rng(7))
        # 130 decode steps and 13 dummy replays (plus the mixed eager steps), two layers.
        assert checked >= 2 * (130 + 13)
        assert r.hooks.armed_steps >= 130
        # Every mixed eager step went through the workers too (the warm-up one, the
        # prefill and the phases that add requests).
        assert r.hooks.eager_steps >= 4, r.hooks.eager_steps
        stats = r.hooks.steps.stats()
        for _name, (_rows, worker) in stats.items():
            assert worker is not None and worker.failures == 0 and worker.unarmed_replays == 0
        # The stats line over the whole run: every armed step, each layer's fills and
        # their mean READY -> FILLED time, as the workers counted them.
        line = r.hooks.log_stats(force=True)
        assert line is not None
        print(line)
        armed = r.hooks.steps.counters().armed
        eager = r.hooks.eager_steps
        assert f"{armed} deferred steps ({armed - eager} replays, {eager} eager)" in line
        for name, (_rows, worker) in stats.items():
            short = name[name.index("layers.") :].split(".ple")[0]
            mean = worker.ready_to_filled_ns_total / worker.fills / 1e3
            assert f"{short} {worker.fills} fills, {mean:.1f} us (" in line, (short, line)
            # Replays' fills apart from the eager steps' (every eager step filled once).
            assert worker.eager_fills == eager, (worker.eager_fills, eager)
            replay_ns = worker.ready_to_filled_ns_total - worker.eager_fill_ns_total
            replays = worker.fills - eager
            part = f"{replays} replays {replay_ns / replays / 1e3:.1f} us, {eager} eager "
            part += f"{worker.eager_fill_ns_total / eager / 1e3:.1f} us)"
            assert part in line, (part, line)
        # Each layer's GPU stall, one sample a step its consumer ran (replays, eager
        # steps, and the warm-ups' and dummies' inline consumers): at least every armed
        # step's, and the rows were checked right, so the stamps changed nothing.
        stalls = line.split("GPU stall per step: ")[1]
        for name in stats:
            short = name[name.index("layers.") :].split(".ple")[0]
            got = re.search(rf"{re.escape(short)} (\d+) steps, (\d+) stalled", stalls)
            assert got is not None and int(got.group(1)) >= armed, (short, stalls)
        assert r.hooks.log_stats() is None  # no stats_every: only forced lines
    finally:
        r.shutdown()


def test_mrv2_sequence_with_a_sync_plan_keeps_graphs(
    ckpt: tuple[Path, dict[str, np.ndarray]],
) -> None:
    """The same sequence where the plan cannot defer (forced): the FULL graphs stay, each
    replay preceded by its ids graph, one host wait and the parallel gathers; every step
    (replays, dummy replays, the mixed eager steps) checked against the table."""
    path, tables = ckpt
    r = boot(path, "cuda", deferred=False)
    try:
        assert r.hooks.steps.mode == "sync" and not r.hooks.deferred
        pool = torch.cuda.graph_pool_handle()
        r.profile_run()
        r.profile_cudagraph_memory()
        r.warm_up()
        r.eager_step([[5, 6, 7, 8], [EOS, 9]])
        r.reqs = 0
        r.capture_model(pool)
        assert r.hooks.wait_descs == set(r.descs())
        checked = _serve(r, tables, np.random.default_rng(11))
        assert checked >= 2 * (130 + 13)
        assert r.hooks.sync_replays >= 130 and r.hooks.armed_steps == 0
    finally:
        r.shutdown()


def _captured(path: Path) -> StandInRunner:
    r = boot(path, "cuda")
    pool = torch.cuda.graph_pool_handle()
    r.profile_run()
    r.capture_model(pool)
    r.eager_step([[11, 12, 13], [14, 15], [16]])
    return r


def _no_wrong_rows(r: StandInRunner, kinds_from: int) -> None:
    """After a fault: the GPU finished every step (bounded) and each step from
    ``kinds_from`` on consumed all-zero rows, never another step's."""
    for ev in r.ends:
        if ev is not None:
            assert done(ev), "the GPU hung after a fault"
    r.ends.clear()
    assert len(r.kinds) > kinds_from
    for step in range(kinds_from, len(r.kinds)):
        slot = (step + 1) % HIST
        n = int(r.model.h_ntok[slot].item()) * H
        for i in PLE_AT:
            assert not r.model.h_rows[i][slot, :n].any().item(), (step, r.kinds[step])


def test_fault_bad_id_is_typed_and_releases_the_gpu(
    ckpt: tuple[Path, dict[str, np.ndarray]],
) -> None:
    path, tables = ckpt
    r = _captured(path)
    try:
        for _ in range(4):
            r.decode_step()
        r.check_ring(0, tables)
        before = len(r.kinds)
        r.model.fault.fill_(1)  # enqueued: the next step's ids leave the table
        r.decode_step()
        r.model.fault.fill_(0)
        with pytest.raises(pm.PleMemopsError) as err:
            for _ in range(4):  # the error surfaces at a later call, typed
                r.decode_step()
            r.hooks.quiesce()
        assert isinstance(err.value, pm.RowIdError | pm.PoisonedError), err.value
        _no_wrong_rows(r, before)
        with pytest.raises(pm.PoisonedError):
            r.decode_step()
    finally:
        r.shutdown()


def test_fault_exception_between_begin_and_replay(
    ckpt: tuple[Path, dict[str, np.ndarray]],
) -> None:
    path, _ = ckpt
    r = _captured(path)
    try:
        r.decode_step()
        r.decode_step()  # two steps armed
        assert r.manager is not None
        r.manager.fail_next_replay = True
        with pytest.raises(RuntimeError, match="injected"):
            r.decode_step()
        for ev in r.ends:  # the armed steps that did launch still finish
            assert ev is None or done(ev)
        with pytest.raises(pm.PoisonedError):
            r.decode_step()
        with pytest.raises(pm.PoisonedError):
            r.hooks.quiesce()
    finally:
        r.shutdown()


def test_fault_replay_nobody_armed(ckpt: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, tables = ckpt
    r = _captured(path)
    try:
        r.decode_step()
        r.check_ring(0, tables)
        assert r.manager is not None
        before = len(r.kinds)
        desc = r.dispatch(r.reqs)
        r.prepare_decode(r.reqs, desc.num_tokens)
        r.manager.run_fullgraph(desc)  # a runner bug: replayed without begin()
        r.record_end()
        _no_wrong_rows(r, before)
        with pytest.raises(pm.UnarmedReplayError):
            r.decode_step()
        with pytest.raises(pm.PoisonedError):
            r.decode_step()
    finally:
        r.shutdown()


def test_fault_exception_in_an_eager_step(ckpt: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, _ = ckpt
    r = _captured(path)
    try:
        r.decode_step()
        with pytest.raises(ValueError, match="injected"), r.hooks.eager(dummy=False):
            raise ValueError("injected: a kernel failed mid-step")
        for ev in r.ends:
            assert ev is None or done(ev)
        with pytest.raises(pm.PoisonedError):
            r.decode_step()
    finally:
        r.shutdown()
