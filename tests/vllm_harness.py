"""What the vLLM benchmarks and diagnostics share with the vLLM tests (which import it from
here): the tiny Qwen4Exp checkpoints, the test-only vLLM plugin that makes the model take its
unfused path where CuTe DSL is missing, and the engine workload of the real-engine tests
(``tests/test_vllm_engine_gpu.py``) for ``diagnose_vllm_rows.py``.

The tiny checkpoints are written by transformers' own ``Qwen4ExpForCausalLM.save_pretrained``
(safetensors), optionally repacked so each PLE layer's table shards sit in a file of their
own, with FP8 tables and their global scale (what an FP8 Qwen4Exp checkpoint carries).
"""

from __future__ import annotations

import gc
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# PLE on decoder layers 0 and 2 (1-based ids 1 and 3); 4 ids per token (ngram_size 3,
# 2 heads per n-gram), 16-wide rows; tables of 4096 and 4224 rows in 4 shards each.
CONFIG: dict[str, Any] = dict(
    ngram_size=3,
    heads_per_ngram=2,
    ple_embed_dim=64,
    ngram_vocab_size_base=1000,
    split_ngram_parts=4,
    eos_token_id=7,
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=4,
    ple_layer_ids=[1, 3],
    layer_types=["linear_attention"] * 4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    # hc_lowrank + hc_count (4) a multiple of 16: vLLM 0.34.0 pads the merged projection
    # to one otherwise, and its loader then counts the padding as a weight never loaded.
    hc_lowrank=12,
    intermediate_size=64,
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    shared_expert_intermediate_size=32,
    linear_num_value_heads=2,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    max_position_embeddings=512,
    output_gate_type="sigmoid",
)
PLE_LAYERS = (0, 2)
HEADS = 4
HEAD_DIM = 16


def write_checkpoint(
    root: Path, *, fp8: bool, separate_tables: bool = True, **overrides: Any
) -> Path:
    """Write the checkpoint under ``root`` and return its directory (``overrides``: config
    keys that differ from :data:`CONFIG`, e.g. ``max_position_embeddings``)."""
    import torch
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    from ple_memops.vllm.tables import is_table_weight

    hf = root / "hf"
    torch.manual_seed(0)
    model = Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**(CONFIG | overrides))).to(torch.bfloat16)
    with torch.no_grad():  # make the tables' rows distinct and far from zero
        for name, p in model.named_parameters():
            if name.endswith("ngram_embedding.weight"):
                p.copy_(torch.randn_like(p, dtype=torch.float32).to(p.dtype))
    model.save_pretrained(hf, max_shard_size="200KB")
    if not fp8 and not separate_tables:
        return hf
    out = root / ("fp8" if fp8 else "bf16")
    out.mkdir()
    tensors = _read_tensors(hf)
    files: dict[str, dict[str, Any]] = {"model-rest.safetensors": {}}
    for name, t in tensors.items():
        if not is_table_weight(name):
            files["model-rest.safetensors"][name] = t
    for layer in PLE_LAYERS:
        stem = f"model.layers.{layer}.ple.ple_embedding.ngram_embedding"
        shards = {k: v for k, v in tensors.items() if k.startswith(stem + ".shard_")}
        if fp8:
            amax = max(float(v.float().abs().max()) for v in shards.values())
            scale = amax / 448.0
            shards = {k: (v.float() / scale).to(torch.float8_e4m3fn) for k, v in shards.items()}
            files["model-rest.safetensors"][f"{stem}.weight_scale"] = torch.tensor(
                scale, dtype=torch.float32
            )
        files[f"ple-layer-{layer}.safetensors"] = shards
    _write_files(out, files)
    config = json.loads((hf / "config.json").read_text())
    if fp8:
        config["ple_embedding_dtype"] = "float8_e4m3fn"
    (out / "config.json").write_text(json.dumps(config))
    shutil.copy(hf / "generation_config.json", out / "generation_config.json")
    return out


def _read_tensors(folder: Path) -> dict[str, Any]:
    """Every tensor of the ``.safetensors`` files in ``folder``, by name."""
    from safetensors import safe_open

    tensors: dict[str, Any] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                tensors[k] = st.get_tensor(k)
    return tensors


def _write_files(out: Path, files: dict[str, dict[str, Any]]) -> None:
    """One safetensors file per entry of ``files`` (file name -> tensors) and the index."""
    from safetensors.torch import save_file

    weight_map = {}
    for fname, content in files.items():
        save_file(content, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(content, fname))
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )


SUBSTITUTES = """
def register():
    # What the offline GPU bundle (scripts/vllm-h200/) leaves out, CuTe DSL, substituted
    # where it is missing: Qwen4Exp's unfused hyper-connection path, and vLLM 0.34.0's
    # MiniMax M3 kernel warm-up (it imports CuTe DSL at every CUDA engine's warm-up and
    # does nothing for a model without MiniMax M3 attention) as the no-op it is here.
    import importlib.util
    import sys
    import types

    try:
        import cutlass  # noqa: F401
        return
    except ImportError:
        pass
    from vllm.models.qwen4_exp.nvidia import hyperconnection
    from vllm.models.qwen4_exp.nvidia.ops.cute_dsl import hc_down_silu

    hyperconnection.MAX_FUSED_M = 0
    hc_down_silu.MAX_FUSED_M = 0
    name = "vllm.model_executor.warmup.minimax_m3_msa_warmup"
    if name not in sys.modules and importlib.util.find_spec(name) is not None:
        stub = types.ModuleType(name)
        stub.minimax_m3_msa_warmup = lambda worker: None
        sys.modules[name] = stub
"""


def bundle_substitutes() -> None:
    """In this process, what :data:`SUBSTITUTES` does in every vLLM process of a server."""
    namespace: dict[str, Any] = {}
    exec(SUBSTITUTES, namespace)
    namespace["register"]()


def write_vllm_plugin(root: Path, module: str, source: str) -> Path:
    """``source`` as the vLLM general plugin ``module`` under ``root`` (the module and its
    dist-info, for ``PYTHONPATH``; vLLM calls its ``register`` in every process)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{module}.py").write_text(source)
    info = root / f"{module}-0.dist-info"
    info.mkdir(exist_ok=True)
    name = module.replace("_", "-")
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0\n")
    (info / "entry_points.txt").write_text(
        f"[vllm.general_plugins]\n{module} = {module}:register\n"
    )
    return root


def write_test_plugin(root: Path) -> Path:
    """A vLLM general plugin under ``root`` that applies :data:`SUBSTITUTES` where CuTe DSL
    is missing, in every vLLM process."""
    return write_vllm_plugin(root, "h200_substitutes", SUBSTITUTES)


# The engine workload of tests/test_vllm_engine_gpu.py and benchmarks/diagnose_vllm_rows.py:
# the same prompts, engine settings and greedy sampling.
ENGINE_GRAPH_SIZES = [1, 2, 4, 8]
ENGINE_MAX_TOKENS = 24
ENGINE_LONG = 3072


def engine_workload() -> list[list[list[int]]]:
    """Batches of prompts, each a list of token ids (the tiny model's vocabulary is 128;
    7 is its EOS, which greedy sampling may pick: ignore_eos keeps lengths fixed)."""
    import torch

    g = torch.Generator().manual_seed(7)

    def prompt(n: int) -> list[int]:
        return [int(x) for x in torch.randint(8, 128, (n,), generator=g)]

    shared = prompt(600)
    return [
        [prompt(5)],  # decode at size 1
        [prompt(3), prompt(9), prompt(4)],  # 3 requests: padded up to the size-4 graph
        [prompt(2 + i) for i in range(8)],  # size 8
        # Long prompts in chunks while short ones decode; two share a prefix.
        [prompt(ENGINE_LONG), prompt(1500), prompt(6), prompt(11), shared + prompt(40)],
        [shared + prompt(30), prompt(2)],  # a prefix-cache hit
    ]


def engine(ckpt: Path, backend: str, *, settings: dict[str, Any] | None = None, **kw: Any) -> Any:
    """A ``vllm.LLM`` on the tiny checkpoint as the engine tests build it: ``backend`` is
    ``stock`` (pinned/UVA tables), ``gpu`` (tables in GPU memory) or ``mmap``; ``settings``
    adds to the engine's ``ple_memops`` settings (e.g. ``{"copy": "kernel"}``); ``kw``
    overrides ``vllm.LLM``'s arguments (e.g. ``async_scheduling=False``)."""
    from vllm import LLM

    extra: dict[str, Any] = {"gdn_prefill_backend": "triton"}  # FlashInfer is not bundled
    backend_name = "mmap" if backend == "mmap" else "default"
    extra["ple_memops"] = {"table_backend": backend_name, "copy": "auto"} | (settings or {})
    args = _tiny_engine_args(ckpt, ENGINE_GRAPH_SIZES, extra)
    args["engram_config"] = {"cpu_offload": backend != "gpu"}
    return LLM(**(args | kw))


def _tiny_engine_args(ckpt: Path, sizes: list[int], extra: dict[str, Any]) -> dict[str, Any]:
    """``vllm.LLM``'s arguments for a tiny checkpoint in the engine tests: greedy token ids
    only, long prompts in chunks beside decodes, prefix caching, async scheduling, FULL
    decode graphs of ``sizes``; ``extra`` is the additional config."""
    return dict(
        model=str(ckpt),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=4096,
        max_num_seqs=8,
        max_num_batched_tokens=1024,  # long prompts prefill in chunks beside decodes
        enable_prefix_caching=True,
        gpu_memory_utilization=0.15,
        async_scheduling=True,
        additional_config=extra,
        compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": sizes},
    )


def generate(llm: Any, workload: list[list[list[int]]]) -> list[list[list[int]]]:
    """Each batch's greedy output tokens, per request."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(
        max_tokens=ENGINE_MAX_TOKENS, temperature=0, detokenize=False, ignore_eos=True
    )
    out = []
    for batch in workload:
        done = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], sp, use_tqdm=False)
        out.append([list(o.outputs[0].token_ids) for o in done])
    return out


# The top-2 logprob gap below which two correct engines may pick either token. Engines
# compiled apart give logprobs that differ in the last bits: on the H200, two stock engines
# of one configuration in two processes by up to 2e-3 on the tiny Gemma 4 at init, the
# mmap engine and the stock engine by up to 2.4e-2 on the engine tests' checkpoint (its
# logits are larger); a gap moves by at most twice that. Inductor's and the kernels'
# choices are not reproducible bit for bit across compiles, so a closer greedy choice is a
# coin toss, not an oracle.
NEAR_TIE = 0.1


@dataclass
class Greedy:
    """An engine's greedy output: each request's tokens, at each token the gap between the
    two most likely tokens' logprobs (how decisive the choice was) and the chosen token's
    logprob (empty where not recorded)."""

    tokens: list[list[list[int]]]
    gaps: list[list[list[float]]]
    logprobs: list[list[list[float]]] = field(default_factory=list)


def generate_greedy(llm: Any, workload: list[list[list[int]]]) -> Greedy:
    """:func:`generate`, with each choice's top-2 logprob gap (for :func:`assert_same_greedy`)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(
        max_tokens=ENGINE_MAX_TOKENS,
        temperature=0,
        detokenize=False,
        ignore_eos=True,
        logprobs=2,
    )
    out = Greedy([], [], [])
    for batch in workload:
        done = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], sp, use_tqdm=False)
        outs = [o.outputs[0] for o in done]
        out.tokens.append([list(o.token_ids) for o in outs])
        out.gaps.append([[_top2_gap(lp) for lp in o.logprobs] for o in outs])
        out.logprobs.append(
            [[lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs, strict=True)] for o in outs]
        )
    return out


def _top2_gap(logprobs: dict[int, Any]) -> float:
    by_rank = {lp.rank: lp.logprob for lp in logprobs.values()}
    return float(by_rank[1] - by_rank[2])


def assert_same_greedy(reference: Greedy, got: list[Any], *, min_share: float = 0.5) -> None:
    """Every request's tokens equal the reference's up to its first different token, which
    must be a near tie of the reference's (a gap under :data:`NEAR_TIE`: after it the two
    runs continue from different prefixes); and at least ``min_share`` of the reference's
    tokens were compared, so the check cannot pass for a model whose choices are all near
    ties. Else one line a request, from its first different token."""
    wrong, compared, total = [], 0, 0
    for b, (want, gaps, have) in enumerate(zip(reference.tokens, reference.gaps, got, strict=True)):
        for r, (w, g, h) in enumerate(zip(want, gaps, have, strict=True)):
            total += len(w)
            first = next((i for i, (x, y) in enumerate(zip(w, h, strict=True)) if x != y), None)
            compared += len(w) if first is None else first
            if first is not None and g[first] >= NEAR_TIE:
                wrong.append(
                    f"batch {b} request {r}: from token {first} (the reference's top-2 gap "
                    f"there: {g[first]:.3f}): {h[first:]} != {w[first:]}"
                )
    assert not wrong, "differs from the stock engine:\n" + "\n".join(wrong)
    assert compared >= min_share * total, (
        f"only {compared} of {total} tokens compared before near ties: the reference's greedy "
        "choices are too close to tell two engines apart"
    )


def close(llm: Any) -> None:
    """Shut the engine down and free what it holds (another can be built after)."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def assert_same_tokens(reference: list[Any], got: list[Any]) -> None:
    """Every request's tokens of every batch equal the reference's; else one line a request
    that differs, from its first different token."""
    wrong = []
    for b, (want, have) in enumerate(zip(reference, got, strict=True)):
        for r, (w, h) in enumerate(zip(want, have, strict=True)):
            if w != h:
                first = next(i for i, (x, y) in enumerate(zip(w, h, strict=True)) if x != y)
                wrong.append(
                    f"batch {b} request {r}: from token {first}: {h[first:]} != {w[first:]}"
                )
    assert not wrong, "differs from the stock engine:\n" + "\n".join(wrong)


def error_chain(exc: BaseException | None) -> str:
    """An exception and its causes, one ``Type: message`` a line (what an engine raised)."""
    parts = []
    while exc is not None:
        parts.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return "\n".join(parts)


def truncate_under_engine(llm: Any, table: Path, size: int, prompt: list[int]) -> tuple[float, str]:
    """Truncate ``table``, a file ``llm`` serves, to ``size`` bytes (what an in-place copy
    does to a file being served), drop its page cache, then generate until the engine
    raises (at most four batches; an ``AssertionError`` if it never does). Returns the
    seconds until it raised and what it raised (:func:`error_chain`)."""
    import os
    import time

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    with open(table, "r+b") as f:
        f.truncate(size)
    fd = os.open(table, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    sp = SamplingParams(max_tokens=8, temperature=0, detokenize=False, ignore_eos=True)
    start = time.monotonic()
    try:
        for _ in range(4):
            llm.generate([TokensPrompt(prompt_token_ids=prompt)] * 4, sp, use_tqdm=False)
    except Exception as exc:
        return time.monotonic() - start, error_chain(exc)
    raise AssertionError(f"the engine served 4 batches from {table} truncated to {size} bytes")


def assert_gpu_usable() -> None:
    """A matrix product on the GPU gives a finite result (after a fault)."""
    import torch

    x = torch.randn(256, 256, device="cuda")
    assert torch.isfinite((x @ x).sum()).item()
    torch.cuda.synchronize()


# -- Gemma 4 ---------------------------------------------------------------------------------

# A tiny Gemma 4 with per-layer inputs: 4 decoder layers (3 sliding, 1 full; one head size,
# 64, so FlashAttention 3 serves every layer), a 16-wide slice a layer: 64-wide rows of
# 128 bytes in BF16.
GEMMA4_CONFIG: dict[str, Any] = dict(
    vocab_size=128,
    vocab_size_per_layer_input=112,  # ids 112..127 read row 0, as in vLLM
    hidden_size=64,
    hidden_size_per_layer_input=16,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    global_head_dim=64,
    layer_types=["sliding_attention"] * 3 + ["full_attention"],
    sliding_window=64,
    intermediate_size=96,
    max_position_embeddings=8192,
    eos_token_id=1,
    pad_token_id=0,
    bos_token_id=2,
)
GEMMA4_TABLE = "embed_tokens_per_layer.weight"
# The Gemma checkpoints' token embedding scaled up from transformers' random init: at init
# the tiny models' greedy choices are near ties (Gemma 4: 9 of the engine workload's 456
# tokens come before a request's first top-2 logprob gap under 0.05), so engines that
# differ by rounding alone pick other tokens; scaled by 6, Gemma 4 has 189 before a gap
# under NEAR_TIE, a request picks 4-5 different tokens, and a table whose rows are shifted
# by one changes 19 of the 19 requests (check_greedy_oracle, run by the CPU tests with
# transformers' own models).
GEMMA_EMBED_SCALE = 6.0
# Gemma 3n's vocabulary is 9x larger (see GEMMA3N_CONFIG), so more tokens compete: scaled by
# 6 only 95 of 456 tokens came before a near tie; by 10, 209, and shifted rows change 19 of
# 19 requests (by 8: 149; by 12: 272 and 18 of 19).
GEMMA3N_EMBED_SCALE = 10.0


def write_gemma4_checkpoint(
    root: Path,
    *,
    multimodal: bool = False,
    separate_table: bool = True,
    base: dict[str, Any] | None = None,
    device: str = "cpu",
    **overrides: Any,
) -> Path:
    """A tiny Gemma 4 written by transformers' own ``Gemma4ForCausalLM.save_pretrained``
    (``multimodal``: ``Gemma4ForConditionalGeneration``'s, with a tiny vision tower), under
    ``root``; ``separate_table`` moves the per-layer table into a file of its own (what the
    loader can skip). ``base``: the text config's keys (default :data:`GEMMA4_CONFIG`; ``{}``
    is transformers' own defaults), ``overrides`` replace some of them; ``device``: where
    the random weights are initialised (``"cuda"`` for the benchmark's real widths)."""
    import torch
    from transformers import Gemma4TextConfig

    text = Gemma4TextConfig(**((GEMMA4_CONFIG if base is None else base) | overrides))
    torch.manual_seed(0)
    if multimodal:
        from transformers import Gemma4Config, Gemma4ForConditionalGeneration

        config = Gemma4Config(
            text_config=text.to_dict(),
            vision_config=dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=2,
                head_dim=16,
            ),
            audio_config=None,
        )
        with torch.device(device):
            model: Any = Gemma4ForConditionalGeneration(config)
    else:
        from transformers import Gemma4ForCausalLM

        with torch.device(device):
            model = Gemma4ForCausalLM(text)
    return _save_gemma(model, root, "mm" if multimodal else "text", separate_table)


def _save_gemma(
    model: Any, root: Path, name: str, separate_table: bool, embed_scale: float = GEMMA_EMBED_SCALE
) -> Path:
    """``model`` in BF16, its table's rows random normal and its token embedding scaled by
    ``embed_scale``, saved by its ``save_pretrained`` into ``root/hf-<name>``;
    with ``separate_table``, rewritten into ``root/<name>`` with the per-layer table in a
    file of its own (what the loader can skip)."""
    import torch

    model = model.to(torch.bfloat16)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(GEMMA4_TABLE):  # rows far from zero and distinct: a wrong one shows
                p.copy_(torch.randn_like(p, dtype=torch.float32).to(p.dtype))
            elif pname.endswith("embed_tokens.weight"):
                p.mul_(embed_scale)
    hf = root / f"hf-{name}"
    model.save_pretrained(hf)
    if not separate_table:
        return hf
    out = root / name
    out.mkdir()
    tensors = _read_tensors(hf)
    files: dict[str, dict[str, Any]] = {"model-rest.safetensors": {}, "model-ple.safetensors": {}}
    for tname, t in tensors.items():
        ple = tname.endswith(GEMMA4_TABLE)
        files["model-ple.safetensors" if ple else "model-rest.safetensors"][tname] = t
    _write_files(out, files)
    for extra in hf.glob("*.json"):
        if extra.name != "model.safetensors.index.json":
            shutil.copy(extra, out / extra.name)
    return out


def copy_without_table(ckpt: Path, dest: Path) -> Path:
    """A copy of a Gemma checkpoint written with ``separate_table`` (its table alone in
    ``model-ple.safetensors``) at ``dest``, without that file: a checkpoint whose table
    is missing."""
    shutil.copytree(ckpt, dest)
    (dest / "model-ple.safetensors").unlink()
    index_path = dest / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {
        k: v for k, v in index["weight_map"].items() if v != "model-ple.safetensors"
    }
    index_path.write_text(json.dumps(index))
    return dest


# A tiny Gemma 3n with every feature of the real one (AltUp, LAuReL, KV-shared layers,
# activation sparsity, sliding and full attention, ids outside the per-layer table). Its
# vocabulary covers the token ids vLLM's kernel warm-up feeds an engine (0 up to
# max_num_batched_tokens - 1, 1,024 in the engine tests): the runner embeds them eagerly
# for this model, where an id outside the embedding is a device-side assertion.
GEMMA3N_CONFIG: dict[str, Any] = dict(
    vocab_size=1152,
    vocab_size_per_layer_input=112,  # ids 112..127 read row 0, as in vLLM
    hidden_size=64,
    hidden_size_per_layer_input=16,
    num_hidden_layers=4,
    num_kv_shared_layers=2,
    laurel_rank=8,
    intermediate_size=96,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0],
    layer_types=["sliding_attention", "full_attention"] * 2,
    sliding_window=64,
    max_position_embeddings=8192,
    eos_token_id=1,
    pad_token_id=0,
    bos_token_id=2,
)


def write_gemma3n_checkpoint(
    root: Path,
    *,
    separate_table: bool = True,
    text: dict[str, Any] | None = None,
    device: str = "cpu",
) -> Path:
    """A tiny Gemma 3n written by transformers' own
    ``Gemma3nForConditionalGeneration.save_pretrained`` (the class the released checkpoints
    are) under ``root`` (see :func:`_save_gemma`). Its vision tower is timm's ``test_vit``
    instead of the 300M-parameter MobileNet v5 and its audio tower one tiny conformer
    layer: the tests serve text, where vLLM does not build the towers (no image or audio
    per prompt). ``text``: the text config's keys (default :data:`GEMMA3N_CONFIG`; ``{}``
    is transformers' own defaults, E4B's shapes); ``device``: where the random weights are
    initialised (``"cuda"`` at the real widths)."""
    import torch
    from transformers import (
        Gemma3nAudioConfig,
        Gemma3nConfig,
        Gemma3nForConditionalGeneration,
        Gemma3nTextConfig,
        Gemma3nVisionConfig,
    )

    config = Gemma3nConfig(
        text_config=Gemma3nTextConfig(**(GEMMA3N_CONFIG if text is None else text)).to_dict(),
        vision_config=Gemma3nVisionConfig(
            architecture="test_vit", hidden_size=64, do_pooling=False
        ).to_dict(),
        audio_config=Gemma3nAudioConfig(
            hidden_size=32,
            conf_num_hidden_layers=1,
            conf_num_attention_heads=2,
            sscp_conv_channel_size=[8, 8],
        ).to_dict(),
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Gemma3nForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # transformers initialises AltUp's output scale to zero, which zeroes what
            # each layer feeds its per-layer gate: the rows would change nothing.
            if name.endswith("altup.correct_output_scale"):
                p.fill_(1.0)
    return _save_gemma(model, root, "gemma3n", separate_table, GEMMA3N_EMBED_SCALE)


def check_greedy_oracle(model: Any, table: Any, rows: int) -> dict[str, int]:
    """That a tiny Gemma checkpoint can tell engines apart through
    :func:`assert_same_greedy`, run by transformers' ``model`` on the CPU over the Gemma
    engine workload: at least 35% of the tokens come before a request's first near tie,
    the requests are not one repeated token, and shifting the per-layer ``table`` module's
    rows by one (``rows``: ids from there read row 0, vLLM's masking, which transformers'
    models lack) changes at least 80% of the requests. ``AssertionError`` otherwise; else
    what it counted (tokens before a near tie, tokens, requests changed, requests)."""
    import torch

    lookup = table.forward
    table.forward = lambda ids: lookup(torch.where(ids < rows, ids, torch.zeros_like(ids)))

    def greedy() -> tuple[list[list[int]], int]:
        tokens, decisive = [], 0
        for batch in gemma4_engine_workload():
            for prompt in batch:
                out = model.generate(
                    torch.tensor([prompt]),
                    max_new_tokens=ENGINE_MAX_TOKENS,
                    do_sample=False,
                    output_logits=True,
                    return_dict_in_generate=True,
                    pad_token_id=0,
                    eos_token_id=None,
                )
                tokens.append(out.sequences[0, len(prompt) :].tolist())
                top2 = [torch.log_softmax(lg[0].float(), -1).topk(2).values for lg in out.logits]
                gaps = [float(t[0] - t[1]) for t in top2]
                decisive += next((i for i, g in enumerate(gaps) if g < NEAR_TIE), len(gaps))
        return tokens, decisive

    try:
        with torch.no_grad():
            tokens, decisive = greedy()
            total = sum(len(t) for t in tokens)
            assert decisive >= 0.35 * total, f"{decisive} of {total} tokens before a near tie"
            assert sum(len(set(t)) for t in tokens) >= 3 * len(tokens), tokens  # not one token
            saved = table.weight.clone()
            table.weight.copy_(torch.roll(saved, 1, 0))
            shifted, _ = greedy()
            table.weight.copy_(saved)
    finally:
        table.forward = lookup
    changed = sum(a != b for a, b in zip(tokens, shifted, strict=True))
    assert changed >= 0.8 * len(tokens), f"shifted rows changed {changed} of {len(tokens)}"
    return {"decisive": decisive, "tokens": total, "changed": changed, "requests": len(tokens)}


# The Gemma 4 engine workload of tests/test_vllm_gemma4_engine_gpu.py and
# benchmarks/compare_gemma4_engines.py: the same engine settings, prompts and sampling.
GEMMA4_GRAPH_SIZES = [1, 2, 4, 8]


def gemma4_engine_workload() -> list[list[list[int]]]:
    """Batches of prompts (vocabulary 128; ids 112..127 are outside the per-layer table and
    read its row 0): every captured size, a padded batch, chunked long prompts beside
    decodes, a prefix-cache hit."""
    import torch

    g = torch.Generator().manual_seed(7)

    def prompt(n: int) -> list[int]:
        return [int(x) for x in torch.randint(3, 128, (n,), generator=g)]

    shared = prompt(600)
    return [
        [prompt(5)],  # decode at size 1
        [prompt(3), prompt(9), prompt(4)],  # padded up to the size-4 graph
        [prompt(2 + i) for i in range(8)],  # size 8
        [prompt(3072), prompt(1500), prompt(6), prompt(11), shared + prompt(40)],  # chunks
        [shared + prompt(30), prompt(2)],  # a prefix-cache hit
    ]


def gemma4_engine(ckpt: Path, backend: str, **kw: Any) -> Any:
    """A ``vllm.LLM`` on a tiny Gemma 4 checkpoint as the Gemma 4 engine tests build it
    (``backend``: ``default`` or ``mmap``; ``kw`` overrides ``vllm.LLM``'s arguments)."""
    from vllm import LLM

    args = _tiny_engine_args(ckpt, GEMMA4_GRAPH_SIZES, {"ple_memops": {"table_backend": backend}})
    (arch,) = json.loads((ckpt / "config.json").read_text())["architectures"]
    if "ForConditionalGeneration" in arch:
        args["limit_mm_per_prompt"] = {"image": 0, "audio": 0, "video": 0}  # text: no towers
    if arch == "Gemma3nForConditionalGeneration":
        # In vLLM 0.33.0's text-only mode the GPU model runner hands Gemma 3n's forward
        # token ids without embeddings, and it raises ("inputs_embeds is required on the
        # first PP rank"), the stock class as much as ours; with prompt embeddings enabled
        # the runner embeds the ids first (embed_input_ids), as in multimodal mode.
        args["enable_prompt_embeds"] = True
    return LLM(**(args | kw))


def gemma_rows_stats(worker: Any) -> dict[str, Any]:
    """What a Gemma engine's rows hooks did (``llm.collective_rpc(gemma_rows_stats)``):
    ``{"hooks": False}`` for an engine without them."""
    from ple_memops.vllm.token_table import find_mmap_tables

    hooks = getattr(worker.model_runner, "ple_rows", None)  # None: vLLM's own runner
    if hooks is None:
        return {"hooks": False}
    stats = hooks.steps.stats()
    return {
        "hooks": True,
        "mode": hooks.steps.mode,
        "layers": hooks.layer_names,
        # Each table's gather threads of its own (None: the shared pool).
        "threads": [hooks.steps.tables[n].table.gather_threads for n in hooks.layer_names],
        "armed": hooks.armed_steps,
        "eager": hooks.eager_steps,
        "graphs": len(hooks.wait_descs),
        "watchdog_releases": sum(int(r.watchdog_releases) for r, _ in stats.values()),
        "cudagraph_mode": str(worker.vllm_config.compilation_config.cudagraph_mode),
        "async_scheduling": worker.vllm_config.scheduler_config.async_scheduling,
        "joins_late": [t.joins_late for t in find_mmap_tables(worker.model_runner.get_model())],
    }


def gemma_eager(**kw: Any) -> dict[str, Any]:
    """:func:`gemma4_engine`'s arguments for vLLM's ``-O0`` (the model run as written, no
    torch.compile), FULL decode graphs of the Gemma tests' sizes."""
    compilation = {
        "mode": "NONE",
        "cudagraph_mode": "FULL_DECODE_ONLY",
        "cudagraph_capture_sizes": GEMMA4_GRAPH_SIZES,
    }
    return {"compilation_config": compilation} | kw


def serve_gemma(llm: Any) -> tuple[Greedy, dict[str, Any]]:
    """The Gemma engine workload's greedy output and :func:`gemma_rows_stats`, then the
    engine closed."""
    try:
        got = generate_greedy(llm, gemma4_engine_workload())
        (stats,) = llm.collective_rpc(gemma_rows_stats)
    finally:
        close(llm)
    return got, stats


def assert_gemma_deferred(stats: dict[str, Any]) -> None:
    """The engine's rows were deferred: replays armed at every captured size, eager steps
    deferred too, no watchdog release."""
    assert stats["hooks"] and stats["mode"] == "deferred", stats
    assert stats["graphs"] == len(GEMMA4_GRAPH_SIZES), stats
    assert stats["armed"] >= 4 * ENGINE_MAX_TOKENS, stats
    assert stats["eager"] >= len(gemma4_engine_workload()), stats
    assert stats["watchdog_releases"] == 0, stats
