"""Gemma 4 in the real vLLM 0.33.0 engine on a GPU, through ``vllm.LLM``, with ple-memops
installed as a plugin and switched on by the environment, as a user would.

Every engine serves the same greedy workload and its tokens must equal the stock engine's
(vLLM's per-layer table in GPU memory, in the same graph mode: FULL decode graphs of
sizes 1, 2, 4, 8, the model compiled by vLLM as usual) token for token, up to a request's
first near tie of the stock engine's (``vllm_harness.assert_same_greedy``: engines
compiled apart differ in rounding, the stock engine from itself too, so a near tie may go
either way; the checkpoint keeps them rare, ``test_vllm_gemma4_real.py`` checks it):
short prompts at every captured size, batches padded up to one, long prompts prefilled in
chunks beside decodes, prefix-cache hits, ids outside the table (row 0). The mmap engines
must really have deferred (armed replays of every captured size, eager steps deferred
too):

* ``Gemma4ForCausalLM`` with async scheduling (two steps in flight) and without; then its
  table file truncated under the engine: a typed error naming the file, no hang, the GPU
  usable after;
* ``Gemma4ForConditionalGeneration`` (what the released checkpoints are), text prompts;
* a plan forced synchronous (as a failed probe would): the tokens stay the stock
  engine's, without CUDA graphs (this model cannot compute its ids before a replay).

Run alone (``scripts/gpu/vllm_gemma4.sh``): the switch is process-wide. Skipped, with the
reason, without vLLM or a GPU.
"""

from __future__ import annotations

import os
import shutil
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
vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/gpu/vllm_gemma4.sh)")

import vllm_checkpoints as ckpts  # noqa: E402
from vllm import LLM  # noqa: E402
from vllm_harness import (  # noqa: E402
    Greedy,
    assert_gemma_deferred,
    assert_gpu_usable,
    assert_same_greedy,
    bundle_substitutes,
    close,
    gemma4_engine,
    gemma4_engine_workload,
    gemma_eager,
    gemma_rows_stats,
    generate_greedy,
    serve_gemma,
    truncate_under_engine,
)

pytestmark = pytest.mark.gpu
bundle_substitutes()  # the offline bundle leaves CuTe DSL out

WORKLOAD = gemma4_engine_workload()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma4")
    return {
        "text": ckpts.write_gemma4_checkpoint(root),
        "mm": ckpts.write_gemma4_checkpoint(root, multimodal=True),
    }


def _engine(ckpt: Path, backend: str, *, async_scheduling: bool = True, **kw: Any) -> LLM:
    return gemma4_engine(ckpt, backend, async_scheduling=async_scheduling, **kw)


def _generate(llm: LLM) -> Greedy:
    return generate_greedy(llm, WORKLOAD)


@pytest.fixture(scope="module")
def reference(checkpoints: dict[str, Path]) -> dict[str, Greedy]:
    """The stock engine's tokens (vLLM's table in GPU memory), for both classes."""
    refs = {}
    for kind, ckpt in checkpoints.items():
        tokens, stats = serve_gemma(_engine(ckpt, "default"))
        assert stats == {"hooks": False}
        refs[kind] = tokens
    return refs


def test_text_model_then_its_table_truncated_under_the_engine(
    checkpoints: dict[str, Path], reference: dict[str, Any], tmp_path: Path
) -> None:
    ckpt = tmp_path / "cut"
    shutil.copytree(checkpoints["text"], ckpt)
    llm = _engine(ckpt, "mmap")
    try:
        got = _generate(llm)
        (stats,) = llm.collective_rpc(gemma_rows_stats)
        print(f"\ntext mmap, async scheduling: {stats}")
        assert_same_greedy(reference["text"], got.tokens)
        assert_gemma_deferred(stats)
        assert stats["async_scheduling"] is True, stats
        assert stats["cudagraph_mode"].endswith("FULL_DECODE_ONLY"), stats
        assert stats["joins_late"] == [False], stats  # compiled: Inductor places the join
        table = ckpt / "model-ple.safetensors"
        elapsed, text = truncate_under_engine(llm, table, 4096, list(range(3, 111)))
        print(f"\nwhat the engine raised after {elapsed:.1f} s:\n{text[:1500]}")
        assert elapsed < 60, "the failure took as long as a hang"
        assert "model-ple.safetensors" in text or "TableIoError" in text, text[:2000]
    finally:
        try:
            close(llm)
        except Exception as exc:  # a dead engine may refuse a clean shutdown
            print(f"shutdown after the fault: {exc!r}")
    assert_gpu_usable()


def test_text_model_without_async_scheduling(
    checkpoints: dict[str, Path], reference: dict[str, Any]
) -> None:
    got, stats = serve_gemma(_engine(checkpoints["text"], "mmap", async_scheduling=False))
    print(f"\ntext mmap sync scheduling: {stats}")
    assert stats["async_scheduling"] is False, stats
    assert_same_greedy(reference["text"], got.tokens)
    assert_gemma_deferred(stats)


def test_multimodal_class(checkpoints: dict[str, Path], reference: dict[str, Any]) -> None:
    got, stats = serve_gemma(_engine(checkpoints["mm"], "mmap"))
    print(f"\nmultimodal mmap, async scheduling: {stats}")
    assert_same_greedy(reference["mm"], got.tokens)
    assert_gemma_deferred(stats)
    assert stats["layers"] == ["language_model.model.embed_tokens_per_layer"], stats


def test_a_sync_plan_serves_without_graphs(
    checkpoints: dict[str, Path], reference: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PLE_MEMOPS_FORCE_SYNC", "1")
    got, stats = serve_gemma(_engine(checkpoints["text"], "mmap"))
    print(f"\ntext mmap, synchronous plan: {stats}")
    assert_same_greedy(reference["text"], got.tokens)
    assert stats["mode"] == "sync" and stats["graphs"] == 0 and stats["armed"] == 0, stats
    assert stats["cudagraph_mode"].endswith("NONE"), stats


def test_text_model_run_eagerly_its_rows_join_at_layer_0s_gate_whole_or_split(
    checkpoints: dict[str, Path],
) -> None:
    # vLLM's -O0: the rows join right before decoder layer 0's per-layer gate, and the
    # tokens are the stock engine's in -O0 (its own reference: the module's is compiled).
    reference, stats = serve_gemma(_engine(checkpoints["text"], "default", **gemma_eager()))
    whole = {"ple_memops": {"table_backend": "mmap", "split_rows": False}}
    got, stats = serve_gemma(
        _engine(checkpoints["text"], "mmap", **gemma_eager(additional_config=whole))
    )
    same = got.tokens == reference.tokens
    print(f"\ntext mmap, -O0, whole rows: {stats}; tokens identical: {same}")
    # Not compiled: both engines run the same kernels in the same order but ours, so
    # the same bits, and every token equal (not only up to a near tie).
    assert got.tokens == reference.tokens
    assert_gemma_deferred(stats)
    assert stats["joins_late"] == [True] and stats["threads"] == [None], stats
    # split_rows (the default): layer 0's slice of each row a table of its own (joined at
    # layer 0's gate), the rest another (at layer 1's) on 8 gather threads of its own:
    # two tables deferred, the same tokens.
    got, stats = serve_gemma(_engine(checkpoints["text"], "mmap", **gemma_eager()))
    print(f"\ntext mmap, -O0, split rows (the default): {stats}")
    assert got.tokens == reference.tokens
    assert_gemma_deferred(stats)
    assert len(stats["layers"]) == 2 and stats["layers"][1].endswith(".rest"), stats
    assert stats["joins_late"] == [True, True] and stats["threads"] == [None, 8], stats
