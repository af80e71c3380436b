"""Small Qwen4Exp checkpoints for the vLLM tests, written by transformers' own
``Qwen4ExpForCausalLM.save_pretrained`` (safetensors), optionally repacked so each PLE
layer's table shards sit in a file of their own, with FP8 tables and their global scale
(what an FP8 Qwen4Exp checkpoint carries)."""

from __future__ import annotations

import json
import shutil
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
    hc_lowrank=8,
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
    from safetensors import safe_open
    from safetensors.torch import save_file
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
    tensors: dict[str, Any] = {}
    for f in sorted(hf.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            for k in s.keys():
                tensors[k] = s.get_tensor(k)
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
    weight_map = {}
    for fname, content in files.items():
        save_file(content, str(out / fname))
        weight_map.update(dict.fromkeys(content, fname))
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    config = json.loads((hf / "config.json").read_text())
    if fp8:
        config["ple_embedding_dtype"] = "float8_e4m3fn"
    (out / "config.json").write_text(json.dumps(config))
    shutil.copy(hf / "generation_config.json", out / "generation_config.json")
    return out
