"""Gemma 3n in the real vLLM 0.33.0 engine on a GPU, through ``vllm.LLM``, with ple-memops
installed as a plugin and switched on by the environment, as a user would:
``Gemma3nForConditionalGeneration`` (what the released checkpoints are) with
``table_backend=mmap`` serves the Gemma engine workload (``vllm_harness``: every captured
size, a padded batch, long prompts in chunks beside decodes, a prefix-cache hit, ids
outside the table) with async scheduling, and its tokens equal the stock engine's (vLLM's
table in GPU memory, the same graph mode) up to the stock engine's first near tie; its
rows were deferred (armed replays of every captured size, eager steps deferred too).

Run alone (``scripts/gpu/vllm_gemma4.sh`` runs it after the Gemma 4 module): the switch is
process-wide. Skipped, with the reason, without vLLM, timm or a GPU.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("GPU test: no CUDA device", allow_module_level=True)
# Set only once the module runs (a skipped module must not switch the plugin on for the
# other test files of the same pytest process), before vLLM is imported.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # FlashInfer is not in the bundle
os.environ["PLE_MEMOPS_TABLE_BACKEND"] = "mmap"  # the plugin installs; engines choose below
pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/gpu/vllm_gemma4.sh)")
pytest.importorskip("timm", reason="timm is not installed (transformers' Gemma 3n needs it)")

import vllm_checkpoints as ckpts  # noqa: E402
from vllm_harness import (  # noqa: E402
    assert_gemma_deferred,
    assert_same_greedy,
    bundle_substitutes,
    gemma4_engine,
    gemma_eager,
    serve_gemma,
)

pytestmark = pytest.mark.gpu
bundle_substitutes()  # the offline bundle leaves CuTe DSL out


def test_gemma3n_multimodal_class(tmp_path: Path) -> None:
    ckpt = ckpts.write_gemma3n_checkpoint(tmp_path)
    reference, stats = serve_gemma(gemma4_engine(ckpt, "default"))
    assert stats == {"hooks": False}
    got, stats = serve_gemma(gemma4_engine(ckpt, "mmap"))
    print(f"\ngemma3n mmap, async scheduling: {stats}")
    assert_same_greedy(reference, got.tokens)
    assert_gemma_deferred(stats)
    assert stats["async_scheduling"] is True, stats
    assert stats["layers"] == ["language_model.model.self_decoder.per_layer_embed_tokens"], stats
    assert stats["joins_late"] == [False], stats  # compiled: Inductor places the join


def test_gemma3n_run_eagerly_its_rows_join_at_layer_0s_gate_whole_or_split(tmp_path: Path) -> None:
    # vLLM's -O0: the rows join right before decoder layer 0's per-layer gate (the host's
    # gather hides behind the layer), and the tokens are the stock engine's in -O0.
    ckpt = ckpts.write_gemma3n_checkpoint(tmp_path)
    reference, stats = serve_gemma(gemma4_engine(ckpt, "default", **gemma_eager()))
    assert stats == {"hooks": False}
    whole = {"ple_memops": {"table_backend": "mmap", "split_rows": False}}
    got, stats = serve_gemma(gemma4_engine(ckpt, "mmap", **gemma_eager(additional_config=whole)))
    same = got.tokens == reference.tokens
    print(f"\ngemma3n mmap, -O0, whole rows: {stats}; tokens identical: {same}")
    # Not compiled: both engines run the same kernels in the same order but ours, so
    # the same bits, and every token equal (not only up to a near tie).
    assert got.tokens == reference.tokens
    assert_gemma_deferred(stats)
    assert stats["joins_late"] == [True] and stats["threads"] == [None], stats
    # split_rows (the default): layer 0's slice of each row and the rest are two tables,
    # joined at layer 0's and layer 1's gates, the rest on 8 threads of its own; the same
    # tokens.
    got, stats = serve_gemma(gemma4_engine(ckpt, "mmap", **gemma_eager()))
    print(f"\ngemma3n mmap, -O0, split rows (the default): {stats}")
    assert got.tokens == reference.tokens
    assert_gemma_deferred(stats)
    assert len(stats["layers"]) == 2 and stats["layers"][1].endswith(".rest"), stats
    assert stats["joins_late"] == [True, True] and stats["threads"] == [None, 8], stats
