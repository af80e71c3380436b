"""Random-weight checkpoints of the supported models, written by transformers' own
``save_pretrained`` (so the files, tensor names and config are what the library writes).

``tiny_gemma3n_config()`` is small enough for CI; ``e2b_gemma3n_config()`` has the shapes
of Gemma 3n E2B (30 layers, a 262,144 x 7,680 bf16 PLE table: 15,360-byte rows, 3.75 GiB).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = [
    "build_checkpoint",
    "default_cache_dir",
    "e2b_gemma3n_config",
    "tiny_gemma3n_config",
    "tiny_qwen4exp_config",
]

_MARKER = "ple_memops_checkpoint.json"


def default_cache_dir() -> Path:
    """``$PLE_MEMOPS_CACHE`` or ``$XDG_CACHE_HOME/ple_memops`` (``~/.cache/ple_memops``)."""
    env = os.environ.get("PLE_MEMOPS_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ple_memops"


# The toy transformer both tiny configs share: 4 layers, 64 wide, 2 heads of 32, 1 KV head.
_TOY_SIZES: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
)


def tiny_gemma3n_config(**overrides: Any) -> Any:
    """A Gemma 3n text config with every feature of the real one (AltUp, LAuReL, KV-shared
    layers, activation sparsity, sliding and full attention, a PLE table smaller than the
    vocabulary) at toy sizes: 4 layers, 64-wide, a 384 x 64 bf16 table (128-byte rows)."""
    from transformers import Gemma3nTextConfig

    kw: dict[str, Any] = dict(
        vocab_size=512,
        vocab_size_per_layer_input=384,
        intermediate_size=128,
        **_TOY_SIZES,
        hidden_size_per_layer_input=16,
        num_kv_shared_layers=2,
        laurel_rank=8,
        sliding_window=512,
        max_position_embeddings=1024,
        activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0],
        layer_types=[
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "full_attention",
        ],
    )
    kw.update(overrides)
    return Gemma3nTextConfig(**kw)


def e2b_gemma3n_config(**overrides: Any) -> Any:
    """Gemma 3n E2B's text shapes (transformers' converter: 30 layers, intermediate 8192,
    10 KV-shared layers; the rest are ``Gemma3nTextConfig`` defaults)."""
    from transformers import Gemma3nTextConfig

    kw: dict[str, Any] = dict(
        num_hidden_layers=30,
        intermediate_size=8192,
        num_kv_shared_layers=10,
    )
    kw.update(overrides)
    return Gemma3nTextConfig(**kw)


def tiny_qwen4exp_config(**overrides: Any) -> Any:
    """A Qwen4Exp text config at toy sizes: 4 layers (3 linear-attention, 1 sparse
    attention with its indexer), MoE, hyper-connections, PLE on layers 1 and 3 with
    2-gram and 3-gram hashed heads (8 rows of 32 bytes per token per PLE layer)."""
    from transformers import Qwen4ExpTextConfig

    kw: dict[str, Any] = dict(
        vocab_size=256,
        **_TOY_SIZES,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        hc_count=2,
        hc_lowrank=8,
        ple_layer_ids=[1, 3],
        ple_embed_dim=64,
        ngram_size=3,
        heads_per_ngram=2,
        ngram_vocab_size_base=100,
        split_ngram_parts=4,
        eos_token_id=1,
        pad_token_id=0,
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=32,
        indexer_budget=8,
        indexer_compress_ratio=4,
        layer_types=[
            "linear_attention",
            "linear_attention",
            "linear_attention",
            "full_attention",
        ],
    )
    kw.update(overrides)
    return Qwen4ExpTextConfig(**kw)


def _model_class(config: Any) -> Any:
    import transformers

    kind = getattr(config, "model_type", "")
    if kind == "gemma3n_text":
        return transformers.Gemma3nForCausalLM
    if kind == "qwen4_exp_text":
        return transformers.Qwen4ExpForCausalLM
    from ..transformers import UnsupportedModelError

    raise UnsupportedModelError(f"no builder for model_type {kind!r}")


def build_checkpoint(
    path: str | os.PathLike[str],
    config: Any,
    *,
    seed: int = 0,
    device: str = "cpu",
    dtype: Any = None,
    force: bool = False,
) -> Path:
    """Write a random-weight bf16 checkpoint of ``config`` to ``path`` with
    ``save_pretrained`` unless one built from the same config and seed is already there.

    ``device="cuda"`` initialises the weights on the GPU (much faster for E2B shapes);
    the files are the same kind either way. ``dtype``: default ``torch.bfloat16`` (what
    the released checkpoints use). Returns the directory."""
    import torch

    dtype = torch.bfloat16 if dtype is None else dtype
    out = Path(path)
    want = {"config": config.to_dict(), "seed": seed, "dtype": str(dtype)}
    marker = out / _MARKER
    if not force and marker.is_file():
        try:
            if json.loads(marker.read_text()) == json.loads(json.dumps(want)):
                return out
        except (OSError, ValueError):
            pass
    cls = _model_class(config)
    torch.manual_seed(seed)
    try:
        with torch.device(device):
            model = cls._from_config(config, dtype=dtype)
    except Exception:
        if device == "cpu":
            raise
        # Initialising on the device is only faster; the CPU gives the same kind of files.
        torch.manual_seed(seed)
        model = cls._from_config(config, dtype=dtype)
    model.eval()
    model.to("cpu")
    if device != "cpu":
        torch.cuda.empty_cache()
    out.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    model.save_pretrained(out)
    del model
    marker.write_text(json.dumps(want))
    return out
