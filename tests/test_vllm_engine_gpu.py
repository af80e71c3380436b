"""The real vLLM engine (0.33.0 or 0.34.0) on a GPU, through its public API (``vllm.LLM``), with
ple-memops installed as a plugin and switched on by the environment, as a user would.

Every engine serves the same greedy workload, and every engine's tokens must equal the
stock engine's (pinned/UVA tables, vLLM's default, in the same FULL decode graphs) token
for token:

* short prompts at every captured decode size (1, 2, 4, 8) and batches padded up to one
  (3 -> 4); long prompts (1-3k tokens) prefilled in chunks while others decode (mixed
  batches); a shared prefix (prefix-cache hits);
* the GPU table (``cpu_offload=False``), the mmap backend with async scheduling on and
  off, BF16 and FP8 tables; the mmap engines must really have deferred (armed replays);
* a KV cache small enough that running requests are preempted and recomputed;
* the checkpoint evicted from the page cache every 2 ms while an engine serves: steps read
  their rows from storage, the tables in layer order;
* engines shut down and built again in one process, one after the other;
* faults: a table file removed under a running engine (nothing changes: the open file
  holds it), then one truncated (a typed error naming the file comes out of the engine, no
  hang, the GPU usable after), and a checkpoint whose table does not match the model
  (refused at load, naming the tensor).

Run alone (``scripts/gpu/vllm_engine.sh``): the switch is process-wide. Skipped, with the
reason, without vLLM or a GPU.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("GPU test: no CUDA device", allow_module_level=True)
# Set only once the module runs (a skipped module must not switch the plugin on for the
# other test files of the same pytest process), before vLLM is imported.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # FlashInfer is not in the bundle
os.environ["PLE_MEMOPS_TABLE_BACKEND"] = "mmap"  # the plugin installs; engines choose below
# Every engine runs FULL decode graphs, the mode an mmap engine runs in: vLLM 0.33.0 would
# otherwise turn breakable graphs on for the stock Qwen4Exp, whose numerics differ from its
# own FULL graphs in one token of 720 here (benchmarks/diagnose_vllm_rows.py shows it).
os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "0"
vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/gpu/vllm_engine.sh)")

import vllm_checkpoints as ckpts  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm_harness import (  # noqa: E402
    ENGINE_GRAPH_SIZES,
    ENGINE_MAX_TOKENS,
    assert_gpu_usable,
    assert_same_tokens,
    bundle_substitutes,
    close,
    engine,
    engine_workload,
    error_chain,
    generate,
    truncate_under_engine,
)

import ple_memops as pm  # noqa: E402

pytestmark = pytest.mark.gpu
bundle_substitutes()  # the offline bundle leaves CuTe DSL out

SIZES = ENGINE_GRAPH_SIZES
MAX_TOKENS = ENGINE_MAX_TOKENS
WORKLOAD = engine_workload()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine")
    return {
        kind: ckpts.write_checkpoint(root / kind, fp8=kind == "fp8", max_position_embeddings=8192)
        for kind in ("bf16", "fp8")
    }


def _engine(
    ckpt: Path,
    backend: str,
    *,
    copy: str = "auto",
    lead: int | None = None,
    time_stalls: bool = False,
    **kw: Any,
) -> LLM:
    settings: dict[str, Any] = {"copy": copy}
    if lead is not None:
        settings["first_layer_threads"] = lead
    if time_stalls:
        settings["time_stalls"] = True
    return engine(ckpt, backend, settings=settings, **kw)


def _generate(llm: LLM) -> list[list[list[int]]]:
    return generate(llm, WORKLOAD)


def _rows_stats(worker: Any) -> dict[str, Any]:
    hooks = getattr(worker.model_runner, "ple_rows", None)  # None: vLLM's own runner
    if hooks is None:
        return {"hooks": False}
    stats = hooks.steps.stats()
    return {
        "hooks": True,
        "mode": hooks.steps.mode,
        "armed": hooks.armed_steps,
        "eager": hooks.eager_steps,
        "sync_replays": hooks.sync_replays,
        "graphs": len(hooks.wait_descs),
        "steps": sum(int(r.steps) for r, _ in stats.values()),
        "fills": sum(int(r.fills) for r, _ in stats.values()),
        "dummies": sum(int(r.dummies) for r, _ in stats.values()),
        "aborts": sum(int(r.aborts) for r, _ in stats.values()),
        "watchdog_releases": sum(int(r.watchdog_releases) for r, _ in stats.values()),
        # Each layer's worker's fills of eager steps (counted apart from replays').
        "eager_fills": sorted({int(w.eager_fills) for _, w in stats.values() if w is not None}),
        # Steps that kept a table's own gather threads awake while armed (per layer).
        "warmed": {n: int(w.warmed_steps) for n, (_, w) in stats.items() if w is not None},
        "own_threads": {n: layer.table.gather_threads for n, layer in hooks.steps.tables.items()},
        # The tables' reads from storage in layer order, and each worker's waits for them.
        "in_order": hooks.steps.reads_in_order,
        "tables": list(hooks.steps.names),
        "ordered_waits": {n: int(w.ordered_waits) for n, (_, w) in stats.items() if w is not None},
        "copy": sorted({layer.rows.copy for layer in hooks.steps}),
    }


def _serve(
    llm: LLM, *probes: Callable[[Any], Any]
) -> tuple[list[list[list[int]]], dict[str, Any], list[Any]]:
    """The workload's tokens, the rows' statistics and what each of ``probes`` (a
    function of the worker, by RPC) returned after it; the engine is shut down after."""
    try:
        got = _generate(llm)
        (stats,) = llm.collective_rpc(_rows_stats)
        extra = [llm.collective_rpc(probe)[0] for probe in probes]
    finally:
        close(llm)
    return got, stats, extra


@pytest.fixture(scope="module")
def reference(checkpoints: dict[str, Path]) -> dict[str, list[list[list[int]]]]:
    """The stock engine's tokens (vLLM's default pinned/UVA tables), BF16 and FP8."""
    refs = {}
    for kind, ckpt in checkpoints.items():
        llm = _engine(ckpt, "stock")
        assert llm.collective_rpc(_rows_stats) == [{"hooks": False}]
        refs[kind] = _generate(llm)
        close(llm)
    return refs


@pytest.mark.parametrize(
    ("kind", "backend", "async_scheduling", "copy", "lead"),
    [
        ("bf16", "gpu", True, "auto", None),
        ("bf16", "mmap", True, "kernel", None),
        ("bf16", "mmap", True, "memop", None),
        ("bf16", "mmap", False, "auto", None),
        ("fp8", "mmap", True, "auto", None),
        ("bf16", "mmap", True, "auto", 4),  # first_layer_threads: its own threads, kept awake
    ],
)
def test_tokens_equal_the_stock_engine(
    checkpoints: dict[str, Path],
    reference: dict[str, Any],
    kind: str,
    backend: str,
    async_scheduling: bool,
    copy: str,
    lead: int | None,
) -> None:
    got, stats, _ = _serve(
        _engine(checkpoints[kind], backend, async_scheduling=async_scheduling, copy=copy, lead=lead)
    )
    print(f"\n{kind} {backend} async={async_scheduling} copy={copy} lead={lead}: {stats}")
    assert_same_tokens(reference[kind], got)
    if backend == "mmap":
        assert stats["hooks"] and stats["mode"] == "deferred", stats
        # Every captured decode size waits for rows, and decode steps were armed replays;
        # prefills and mixed batches were deferred steps too (no host gather).
        assert stats["graphs"] == len(SIZES) and stats["armed"] >= 4 * MAX_TOKENS, stats
        assert stats["eager"] >= len(WORKLOAD) and stats["watchdog_releases"] == 0, stats
        # Every layer's worker filled every eager step, counted as eager.
        assert stats["eager_fills"] == [stats["eager"]], stats
        # Only the first PLE layer's table has threads of its own. Its worker keeps them
        # awake only after a fill that ran on them (256 KiB and up): the tiny model's
        # largest, a 1,024-token chunk, is 128 KiB, so none here (the warm path at a real
        # size: BENCHMARKS.md, "The first PLE layer on threads of its own"; with a 16 KiB
        # threshold this test ran it), and no other worker has any to warm.
        first = min(stats["own_threads"], key=lambda n: int(n.split("layers.")[1].split(".")[0]))
        assert stats["own_threads"] == {
            n: (lead if n == first else None) for n in stats["own_threads"]
        }, stats
        assert all(v == 0 for v in stats["warmed"].values()), stats
        # Qwen4Exp stages every table at the top: its tables read in layer order.
        layers = [int(n.split("layers.")[1].split(".")[0]) for n in stats["tables"]]
        assert stats["in_order"] and layers == sorted(layers), stats
    else:
        assert stats == {"hooks": False}


def test_tables_evicted_while_serving_read_in_layer_order_with_the_stock_engines_tokens(
    checkpoints: dict[str, Path], stock_bf16: list[list[list[int]]]
) -> None:
    """A thread evicts the checkpoint's files from the page cache every 2 ms while the
    engine serves (``POSIX_FADV_DONTNEED``, behind the tables' back, as memory pressure
    would): steps read their rows from storage, the later tables after the earlier ones,
    and the tokens stay the stock engine's."""
    import threading

    files = sorted(checkpoints["bf16"].glob("*.safetensors"))
    stop = threading.Event()

    def evict() -> None:
        while not stop.wait(0.002):
            for f in files:
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)

    llm = _engine(checkpoints["bf16"], "mmap")
    evictor = threading.Thread(target=evict, daemon=True)
    evictor.start()
    try:
        got, stats, _ = _serve(llm)
    finally:
        stop.set()
        evictor.join()
    print(f"\nevicted while serving: {stats}")
    assert_same_tokens(stock_bf16, got)
    assert stats["mode"] == "deferred" and stats["in_order"], stats
    assert stats["aborts"] == 0 and stats["watchdog_releases"] == 0, stats
    first, *later = stats["tables"]
    assert stats["ordered_waits"][first] == 0, stats
    assert sum(stats["ordered_waits"][n] for n in later) > 0, stats


@pytest.fixture(scope="module")
def stock_bf16(checkpoints: dict[str, Path]) -> list[list[list[int]]]:
    """The stock engine's BF16 tokens alone (a test selected by itself needs no FP8 engine)."""
    llm = _engine(checkpoints["bf16"], "stock")
    try:
        return _generate(llm)
    finally:
        close(llm)


def _stalls(worker: Any) -> dict[str, Any]:
    """Each PLE layer's GPU stall summary over the whole run (drained)."""
    hooks = getattr(worker.model_runner, "ple_rows", None)  # None: vLLM's own runner
    return {n: s.__dict__ for n, s in hooks.stall_summaries().items()}


def test_stall_timing_keeps_the_stock_engines_tokens(
    checkpoints: dict[str, Path], stock_bf16: list[list[list[int]]]
) -> None:
    """The stamps are two more kernels a layer in every graph and eager step: the tokens
    stay the stock engine's, and every layer's stalls were timed, one sample at least per
    armed step, each under the watchdog."""
    got, stats, (stalls,) = _serve(_engine(checkpoints["bf16"], "mmap", time_stalls=True), _stalls)
    print(f"\nstall timing: {stats}\n{stalls}")
    assert_same_tokens(stock_bf16, got)
    assert stats["mode"] == "deferred" and stats["graphs"] == len(SIZES), stats
    assert set(stalls) == set(stats["own_threads"]), stalls
    for name, s in stalls.items():
        assert s["steps"] >= stats["armed"] and s["max_us"] < 30e6, (name, s)


# KV cache blocks: a few of the tiny model's requests at a time (each holds about two
# blocks per KV cache group in vLLM's "align" cache mode; 16 hold at least one, which vLLM
# checks at start-up).
PREEMPT_BLOCKS = 16


def _preemption_workload() -> list[list[int]]:
    """More requests than the blocks hold at once, each decoding across two block
    boundaries (a GatedDeltaNet state takes a new block at each, in vLLM's "align" cache
    mode), so running requests run out of blocks and are preempted (recomputed later)."""
    g = torch.Generator().manual_seed(11)
    return [[int(x) for x in torch.randint(8, 128, (40 + 23 * i,), generator=g)] for i in range(16)]


def test_preempted_requests_get_the_stock_engines_tokens(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KV cache small enough that vLLM's scheduler preempts running requests (counted in
    its own ``Scheduler._preempt_request``) and recomputes them: the mmap engine's greedy
    tokens equal the stock engine's with the same cache, and its steps stayed deferred."""
    from vllm.v1.core.sched.scheduler import Scheduler

    preempted: list[str] = []
    original = Scheduler._preempt_request

    def counting(self: Any, request: Any, *args: Any, **kwargs: Any) -> None:
        preempted.append(request.request_id)
        original(self, request, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "_preempt_request", counting)
    results = {}
    for backend in ("stock", "mmap"):
        preempted.clear()
        llm = _engine(checkpoints["bf16"], backend, num_gpu_blocks_override=PREEMPT_BLOCKS)
        try:
            cache = llm.llm_engine.vllm_config.cache_config
            block = int(cache.mamba_block_size or cache.block_size)
            prompts = _preemption_workload()
            out_len = min(2 * block + 8, 4096 - max(len(p) for p in prompts) - 1)
            sp = SamplingParams(
                max_tokens=out_len, temperature=0, detokenize=False, ignore_eos=True
            )
            done = llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False
            )
            tokens = [list(o.outputs[0].token_ids) for o in done]
            (stats,) = llm.collective_rpc(_rows_stats)
        finally:
            close(llm)
        print(
            f"\n{backend}: {len(preempted)} preemptions, block size {cache.block_size} "
            f"(mamba {cache.mamba_block_size}), {PREEMPT_BLOCKS} blocks (override), "
            f"{out_len} tokens out; {stats}"
        )
        assert all(len(t) == out_len for t in tokens)
        assert preempted, f"{backend}: the KV cache was not small enough to preempt"
        results[backend] = (tokens, stats)
    assert_same_tokens([results["stock"][0]], [results["mmap"][0]])
    stats = results["mmap"][1]
    assert stats["mode"] == "deferred" and stats["armed"] >= out_len, stats
    assert stats["aborts"] == 0 and stats["watchdog_releases"] == 0, stats


def test_a_sync_plan_keeps_full_graphs(
    checkpoints: dict[str, Path], reference: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where deferral is unavailable (forced here, as a failed probe would), the engine
    keeps its FULL decode graphs: each replay is preceded by the ids graph, one host wait
    for the ids, and the parallel gathers; prefills gather with one copy of their ids."""
    monkeypatch.setenv("PLE_MEMOPS_FORCE_SYNC", "1")
    got, stats, _ = _serve(_engine(checkpoints["bf16"], "mmap"))
    print(f"\nbf16 mmap, synchronous plan: {stats}")
    assert_same_tokens(reference["bf16"], got)
    assert stats["hooks"] and stats["mode"] == "sync", stats
    assert stats["graphs"] == len(SIZES) and stats["sync_replays"] >= 4 * MAX_TOKENS, stats
    assert stats["armed"] == 0 and stats["eager"] == 0, stats


def _table_classes(worker: Any) -> list[str]:
    """The class names of the model's Qwen4Exp PLE tables (``collective_rpc``)."""
    from vllm.models.qwen4_exp.common.ngram_embedding import Qwen4ExpPLEEmbedding

    model = worker.model_runner.model
    return sorted(
        {type(m).__name__ for m in model.modules() if isinstance(m, Qwen4ExpPLEEmbedding)}
    )


@pytest.mark.skipif(
    not hasattr(__import__("vllm.config.engram", fromlist=["x"]).EngramConfig(), "disk_offload"),
    reason=f"vLLM {vllm.__version__} has no engram_config.disk_offload (0.34.0 brought it)",
)
def test_vllms_disk_offload_runs_as_released_and_is_not_combined_with_mmap(
    checkpoints: dict[str, Path], reference: dict[str, Any]
) -> None:
    """vLLM 0.34.0's own disk offload, in an engine the plugin does not serve (installed
    in the process, switched off for the engine): vLLM's worker, runner and table class,
    the stock tokens. Asked together with the mmap backend, the engine is refused naming
    both settings."""
    llm = _engine(checkpoints["bf16"], "stock", engram_config={"disk_offload": True})
    got, stats, (classes,) = _serve(llm, _table_classes)
    assert stats == {"hooks": False} and classes == ["Qwen4ExpPLEDiskOffloadEmbedding"], classes
    assert_same_tokens(reference["bf16"], got)
    with pytest.raises(Exception) as info:
        _engine(checkpoints["bf16"], "mmap", engram_config={"disk_offload": True})
    chain = error_chain(info.value)
    assert "engram_config.disk_offload=True" in chain and "PLE_MEMOPS_TABLE_BACKEND" in chain
    assert_gpu_usable()


def test_a_table_removed_then_truncated_under_the_engine(
    checkpoints: dict[str, Path], reference: dict[str, Any], tmp_path: Path
) -> None:
    """A table file removed under a running engine changes nothing (the open file and its
    mapping hold the inode: the same tokens, its page cache dropped first); a table file
    truncated under it is a typed error naming the file, raised by the engine well within
    the time of a hang, and the GPU is usable after."""
    ckpt = tmp_path / "cut"
    shutil.copytree(checkpoints["bf16"], ckpt)
    llm = _engine(ckpt, "mmap")
    table = ckpt / "ple-layer-2.safetensors"
    try:
        assert_same_tokens(reference["bf16"], _generate(llm))
        removed = ckpt / "ple-layer-0.safetensors"
        fd = os.open(removed, os.O_RDONLY)
        os.remove(removed)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        assert llm.reset_prefix_cache()  # the same prefills as the first time
        assert_same_tokens(reference["bf16"], _generate(llm))
        elapsed, text = truncate_under_engine(llm, table, 16384, list(range(8, 120)))
        print(f"\nwhat the engine raised after {elapsed:.1f} s:\n{text[:2000]}")
        assert elapsed < 60, "the failure took as long as a hang"
        assert "ple-layer-2.safetensors" in text or "TableIoError" in text, text[:2000]
    finally:
        try:
            close(llm)
        except Exception as exc:  # a dead engine may refuse a clean shutdown
            print(f"shutdown after the fault: {exc!r}")
    # The GPU is usable after.
    assert_gpu_usable()


def test_a_table_that_does_not_match_the_model_is_refused(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    ckpt = tmp_path / "narrow"
    shutil.copytree(checkpoints["bf16"], ckpt)
    f = ckpt / "ple-layer-2.safetensors"
    tensors = load_file(str(f))
    save_file({k: v[:, : v.shape[1] // 2].contiguous() for k, v in tensors.items()}, str(f))
    with pytest.raises(Exception) as info:
        _engine(ckpt, "mmap")
    text = error_chain(info.value)
    assert "layers.2.ple.ple_embedding" in text and "does not match the model" in text, text
    assert isinstance(info.value, pm.TableError) or "TableError" in text
