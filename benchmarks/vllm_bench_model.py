"""A random-weight Qwen4Exp checkpoint for ``benchmarks/bench_vllm.py``, written without
building the model's weights: transformers instantiates ``Qwen4ExpForCausalLM`` on the
``meta`` device (names, shapes, the n-gram layout), and each tensor is generated (on the
GPU where there is one) and streamed into safetensors files of our own, in the layout
transformers' ``save_pretrained`` writes (fused experts split per expert, each PLE table
split into ``ngram_embedding.shard_<k>.weight``), with each PLE layer's shards in a file
of its own (``ple-layer-<i>.safetensors``, ``i`` the 0-based decoder layer) and, for FP8,
``float8_e4m3fn`` rows with a global ``weight_scale`` (as ``vllm_harness.py``'s tiny ones).

Full-attention layers (``indexed_attention`` without the QSA indexer fields, which vLLM
serves with its dense ``Qwen3NextAttention``) are a layout transformers cannot build: their
names come from a meta model with QSA, its indexer tensors dropped. A tokenizer (word
level, one token per id, built offline with ``tokenizers``) is saved beside the weights so
that vLLM's own ``vllm bench`` commands work.

``verify_against_save_pretrained`` and ``check_vllm_loads`` are the checks at a tiny size
(``python3 benchmarks/bench_vllm.py --dry-run``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

WRITER_VERSION = 1
EOS_ID = 2
SPECIALS = ("<unk>", "<pad>", "<|endoftext|>")
LINEAR, FULL = "linear_attention", "indexed_attention"
# What the meta build of a full-attention layer needs (QSA on), dropped from the config.
_QSA_DUMMY = dict(
    indexer_n_heads=2,
    indexer_kv_heads=1,
    indexer_head_dim=256,
    indexer_budget=64,
    indexer_compress_ratio=4,
)
_ST_DTYPES = {"bfloat16": "BF16", "float32": "F32", "int64": "I64", "float8_e4m3fn": "F8_E4M3"}


def layer_types(layers: int, attention_every: int) -> list[str]:
    """Every ``attention_every``-th layer (1-based) full attention, the rest linear
    (0: all linear)."""
    return [
        FULL if attention_every and (i + 1) % attention_every == 0 else LINEAR
        for i in range(layers)
    ]


def pick_ple_ids(types: list[str], count: int) -> list[int]:
    """``count`` 1-based layer ids, evenly spaced over the linear layers, the first one
    included (the hardest for a deferred row: the least GPU work before its consumer)."""
    linear = [i + 1 for i, t in enumerate(types) if t == LINEAR]
    if not 0 < count <= len(linear):
        raise ValueError(f"{count} PLE layers asked, {len(linear)} linear layers")
    return sorted({linear[(k * len(linear)) // count] for k in range(count)})


def _next_prime_after(value: int, count: int) -> int:
    prime = value
    for _ in range(count):
        prime += 1
        while not _is_prime(prime):
            prime += 1
    return prime


def _is_prime(value: int) -> bool:
    if value < 2 or value % 2 == 0:
        return value == 2
    return all(value % d for d in range(3, math.isqrt(value) + 1, 2))


def table_rows(config: dict[str, Any], dense_id: int) -> int:
    """Rows of one PLE layer's table (padded), as transformers and vLLM compute them."""
    heads = (config["ngram_size"] - 1) * config["heads_per_ngram"]
    total = sum(
        _next_prime_after(config["ngram_vocab_size_base"] - 1, dense_id * heads + h + 1)
        for h in range(heads)
    )
    div = config.get("make_ngram_vocab_size_divisible_by", 128)
    return int(-(-total // div) * div)


def bench_config(
    *,
    layers: int = 24,
    experts: int = 64,
    topk: int = 10,
    ple_layers: int = 4,
    table_gib: float = 4.0,
    dtype: str = "bf16",
    attention_every: int = 4,
    vocab: int = 248_320,
    split_parts: int = 16,
    max_positions: int = 8192,
    tiny: bool = False,
) -> dict[str, Any]:
    """The benchmark model's config: the real Qwen4Exp's per-layer widths (hidden 2048, 16
    attention heads of 256 with 2 KV heads, GatedDeltaNet 16 key / 32 value heads of 128,
    experts of 512, 4 hyper-connection streams of rank 316 (320 less 4), 16 n-gram heads x
    128-wide PLE rows), ``layers`` deep with ``experts`` experts, the PLE tables
    ``table_gib`` GiB in all. ``tiny``: the same structure at toy widths (CPU checks)."""
    types = layer_types(layers, attention_every)
    if tiny:
        widths: dict[str, Any] = dict(
            vocab_size=vocab if vocab < 5000 else 512,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            intermediate_size=64,
            hc_lowrank=12,  # + hc_count 4: unpadded, which vLLM 0.34.0's loader needs
            ngram_size=3,
            heads_per_ngram=2,
            ple_embed_dim=64,
        )
    else:
        widths = dict(
            vocab_size=vocab,
            hidden_size=2048,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            # The real model's 320 less 4: vLLM 0.34.0 pads hc_lowrank + hc_count to a
            # multiple of 16 with a shard its loader then reports as never loaded.
            hc_lowrank=316,
            ngram_size=3,
            heads_per_ngram=8,
            ple_embed_dim=2048,
        )
    heads = (widths["ngram_size"] - 1) * widths["heads_per_ngram"]
    row_bytes = widths["ple_embed_dim"] // heads * (1 if dtype == "fp8" else 2)
    base = int(table_gib * 2**30) // (ple_layers * heads * row_bytes)
    cfg = dict(
        widths,
        num_hidden_layers=layers,
        layer_types=types,
        num_experts=experts,
        num_experts_per_tok=min(topk, experts),
        hc_count=4,
        ple_layer_ids=pick_ple_ids(types, ple_layers),
        ngram_vocab_size_base=max(base, 130),
        split_ngram_parts=split_parts,
        make_ngram_vocab_size_divisible_by=128,
        eos_token_id=EOS_ID,
        pad_token_id=1,
        max_position_embeddings=max_positions,
        output_gate_type="sigmoid",
        tie_word_embeddings=False,
    )
    cfg["_dtype"] = dtype
    return cfg


def config_hash(config: dict[str, Any]) -> str:
    text = json.dumps({"v": WRITER_VERSION, "config": config}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _hf_config(config: dict[str, Any], *, for_meta: bool) -> Any:
    from transformers import Qwen4ExpTextConfig

    kw = {k: v for k, v in config.items() if not k.startswith("_")}
    if for_meta and FULL in kw["layer_types"]:
        kw |= _QSA_DUMMY | {"indexer_head_dim": max(kw["head_dim"], 16)}
    return Qwen4ExpTextConfig(**kw)


# -- the layout ------------------------------------------------------------------------------


class Spec:
    """One tensor of the checkpoint: its name, shape, dtype and how to fill it."""

    __slots__ = ("dtype", "fill", "name", "shape", "value")

    def __init__(
        self, name: str, shape: tuple[int, ...], dtype: str, fill: str, value: Any = None
    ) -> None:
        self.name, self.shape, self.dtype, self.fill, self.value = name, shape, dtype, fill, value

    @property
    def nbytes(self) -> int:
        size = {"bfloat16": 2, "float32": 4, "int64": 8, "float8_e4m3fn": 1}[self.dtype]
        return math.prod(self.shape) * size

    def __repr__(self) -> str:
        return f"Spec({self.name!r}, {self.shape}, {self.dtype}, {self.fill})"


def _multipliers(vocab: int, ngram_size: int, dense_id: int, seed: int) -> list[int]:
    """The layer's hash multipliers (transformers' ``_build_layer_multipliers``)."""
    mask = (1 << 64) - 1
    gamma = 0x9E3779B97F4A7C15

    def mix(v: int) -> int:
        v = (v + gamma) & mask
        v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & mask
        v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & mask
        return (v ^ (v >> 31)) & mask

    half = max(1, ((1 << 63) - 1) // max(vocab, 1) // 2)
    base = seed + 10007 * dense_id
    return [2 * (mix((base + gamma * (i + 1)) & mask) % half) + 1 for i in range(ngram_size)]


def layout(config: dict[str, Any]) -> list[Spec]:
    """Every tensor ``save_pretrained`` would write for ``config`` (FP8 tables and their
    scales when ``config["_dtype"] == "fp8"``), from a meta-device model."""
    import torch
    from transformers import Qwen4ExpForCausalLM

    hf = _hf_config(config, for_meta=True)
    with torch.device("meta"):
        model: Any = Qwen4ExpForCausalLM(hf)
    model = model.to(torch.bfloat16)
    modules = dict(model.named_modules())
    fp8 = config.get("_dtype") == "fp8"
    parts = int(config["split_ngram_parts"])
    specs: list[Spec] = []
    for name, t in model.state_dict().items():
        if ".self_attn.indexer." in name:
            continue  # QSA off in the written config: vLLM's dense attention
        owner_name, _, leaf = name.rpartition(".")
        owner = modules.get(owner_name)
        cls = type(owner).__name__ if owner is not None else ""
        shape = tuple(int(s) for s in t.shape)
        dtype = str(t.dtype).removeprefix("torch.")
        if name.endswith("mlp.experts.gate_up_proj"):
            e, two_i, h = shape
            for k in range(e):
                for proj in ("gate_proj", "up_proj"):
                    specs.append(
                        Spec(f"{owner_name}.{k}.{proj}.weight", (two_i // 2, h), dtype, "normal")
                    )
            continue
        if name.endswith("mlp.experts.down_proj"):
            e, h, i = shape
            for k in range(e):
                specs.append(Spec(f"{owner_name}.{k}.down_proj.weight", (h, i), dtype, "normal"))
            continue
        if name.endswith("ngram_embedding.weight"):
            rows, cols = shape
            size = -(-rows // parts)
            stem = name.removesuffix(".weight")
            for k in range(parts):
                n = max(0, min(size, rows - k * size))
                specs.append(
                    Spec(
                        f"{stem}.shard_{k}.weight",
                        (n, cols),
                        "float8_e4m3fn" if fp8 else dtype,
                        "table",
                    )
                )
            if fp8:
                specs.append(Spec(f"{stem}.weight_scale", (), "float32", "scale"))
            continue
        if dtype == "int64":
            m: Any = owner
            if leaf == "layer_multipliers":
                value = _multipliers(
                    int(m.unigram_vocab_size),
                    int(m.ngram_size),
                    int(m.ple_layer_index),
                    int(m.seed),
                )
            elif leaf == "ngram_heads_vocab_sizes":
                value = list(m.head_vocab_sizes)
            elif leaf == "ngram_heads_offsets":
                value = list(m.head_offsets)
            else:
                raise ValueError(f"an integer tensor this writer does not know: {name}")
            specs.append(Spec(name, shape, dtype, "exact", value))
            continue
        if leaf == "A_log":
            fill = "a_log"
        elif leaf == "dt_bias":
            fill = "ones"
        elif cls.endswith("TextRMSNorm"):
            fill = "zeros"  # 1-centred: (1 + weight)
        elif "Norm" in cls:
            fill = "ones"
        else:
            fill = "normal"
        specs.append(Spec(name, shape, dtype, fill))
    return specs


# -- writing ---------------------------------------------------------------------------------


def _generate(spec: Spec, device: Any, gen: Any, std: float) -> Any:
    import torch

    if spec.fill == "exact":
        return torch.tensor(spec.value, dtype=torch.int64)
    if spec.fill == "scale":
        return torch.tensor(std / 64.0, dtype=torch.float32)
    if spec.fill == "ones":
        t = torch.ones(spec.shape, device=device, dtype=torch.float32)
    elif spec.fill == "zeros":
        t = torch.zeros(spec.shape, device=device, dtype=torch.float32)
    elif spec.fill == "a_log":
        t = torch.empty(spec.shape, device=device).uniform_(1.0, 16.0, generator=gen).log_()
    else:
        t = torch.randn(spec.shape, device=device, generator=gen)
        if spec.dtype == "float8_e4m3fn":  # scale std/64: values ~N(0, std) once scaled
            return t.mul_(64.0).clamp_(-448, 448).to(torch.float8_e4m3fn).cpu()
        t.mul_(std)
    return t.to(getattr(torch, spec.dtype)).cpu()


def write_safetensors(
    path: Path, specs: list[Spec], make: Callable[[Spec], Any], chunk: int = 1 << 28
) -> None:
    """A safetensors file written tensor by tensor (each made, written and dropped), so no
    more than one tensor is ever in host memory."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for s in specs:
        header[s.name] = {
            "dtype": _ST_DTYPES[s.dtype],
            "shape": list(s.shape),
            "data_offsets": [offset, offset + s.nbytes],
        }
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for s in specs:
            t = make(s)
            if tuple(t.shape) != s.shape or str(t.dtype).removeprefix("torch.") != s.dtype:
                raise AssertionError(f"{s}: made {tuple(t.shape)} {t.dtype}")
            flat = t.contiguous().reshape(-1).view(__import__("torch").uint8).numpy()
            view = memoryview(flat)
            for start in range(0, len(view), chunk):
                f.write(view[start : start + chunk])


def _groups(
    specs: list[Spec], config: dict[str, Any], file_gib: float
) -> Iterator[tuple[str, list[Spec]]]:
    rest = [s for s in specs if s.fill != "table"]
    tables: dict[int, list[Spec]] = {}
    for s in specs:
        if s.fill == "table":
            layer = int(s.name.split(".layers.")[1].split(".")[0])
            tables.setdefault(layer, []).append(s)
    limit = int(file_gib * 2**30)
    chunks: list[list[Spec]] = [[]]
    size = 0
    for s in rest:
        if chunks[-1] and size + s.nbytes > limit:
            chunks.append([])
            size = 0
        chunks[-1].append(s)
        size += s.nbytes
    for i, c in enumerate(chunks):
        yield f"model-rest-{i + 1:05d}-of-{len(chunks):05d}.safetensors", c
    for layer, ss in sorted(tables.items()):
        yield f"ple-layer-{layer}.safetensors", ss


def write_tokenizer(out: Path, vocab_size: int, model_max_length: int) -> None:
    """A word-level tokenizer: one whitespace-separated token per id (``w<i>``), ids 0-2
    special (unk, pad, EOS), written by transformers' ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIALS[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    make: Any = PreTrainedTokenizerFast
    fast = make(
        tokenizer_object=tok,
        unk_token=SPECIALS[0],
        pad_token=SPECIALS[1],
        eos_token=SPECIALS[2],
        model_max_length=model_max_length,
    )
    fast.save_pretrained(str(out))


def _write_configs(out: Path, config: dict[str, Any]) -> None:
    import torch
    from transformers import GenerationConfig

    hf = _hf_config(config, for_meta=False)
    hf.architectures = ["Qwen4ExpForCausalLM"]
    hf.dtype = torch.bfloat16
    hf.save_pretrained(str(out))
    GenerationConfig.from_model_config(hf).save_pretrained(str(out))
    if config.get("_dtype") == "fp8":
        data = json.loads((out / "config.json").read_text())
        data["ple_embedding_dtype"] = "float8_e4m3fn"
        (out / "config.json").write_text(json.dumps(data, indent=2))


def write_checkpoint(
    out: Path,
    config: dict[str, Any],
    *,
    device: str | None = None,
    seed: int = 0,
    file_gib: float = 4.0,
    log: Callable[[str], None] = print,
) -> Path:
    """Write the checkpoint into ``out`` (created; must not exist) and return it."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    out.mkdir(parents=True)
    specs = layout(config)
    gen = torch.Generator(device=device).manual_seed(seed)
    std = 0.02

    def make(s: Spec) -> Any:
        return _generate(s, device, gen, std)

    weight_map: dict[str, str] = {}
    total = 0
    start = time.monotonic()
    for fname, group in _groups(specs, config, file_gib):
        write_safetensors(out / fname, group, make)
        nbytes = sum(s.nbytes for s in group)
        total += nbytes
        weight_map.update(dict.fromkeys((s.name for s in group), fname))
        log(
            f"  wrote {fname}: {len(group)} tensors, {nbytes / 2**30:.2f} GiB "
            f"({time.monotonic() - start:.0f} s)"
        )
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    _write_configs(out, config)
    write_tokenizer(out, int(config["vocab_size"]), int(config["max_position_embeddings"]))
    return out


def ensure_checkpoint(root: Path, config: dict[str, Any], **kw: Any) -> tuple[Path, bool]:
    """The checkpoint for ``config`` under ``root`` (``qwen4exp-<hash>``), written once:
    into a temporary folder renamed when complete. Returns it and whether it was built."""
    final = root / f"qwen4exp-{config_hash(config)}"
    if (final / "model.safetensors.index.json").exists() and (final / "tokenizer.json").exists():
        return final, False
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    write_checkpoint(tmp, config, **kw)
    (tmp / "bench_config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final, True


def table_files(ckpt: Path) -> list[Path]:
    return sorted(ckpt.glob("ple-layer-*.safetensors"))


# -- checks at a tiny size -------------------------------------------------------------------


def read_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        data: dict[str, Any] = json.loads(f.read(n))
    data.pop("__metadata__", None)
    return data


def verify_against_save_pretrained(config: dict[str, Any], work: Path) -> list[str]:
    """Write ``config`` (tiny) both ways, ours and transformers' ``save_pretrained`` of a
    real (CPU, random) model, and return the differences: names, shapes, dtypes, the
    integer buffers' values, config.json. Full-attention layers are compared against a
    QSA model minus its indexer (what transformers can build)."""
    import torch
    from safetensors import safe_open
    from transformers import Qwen4ExpForCausalLM

    problems: list[str] = []
    ours = write_checkpoint(work / "ours", config, device="cpu", log=lambda _: None)
    torch.manual_seed(0)
    model: Any = Qwen4ExpForCausalLM(_hf_config(config, for_meta=True))
    model = model.to(torch.bfloat16)
    theirs = work / "theirs"
    model.save_pretrained(str(theirs))
    fp8 = config.get("_dtype") == "fp8"

    def tensors(root: Path) -> dict[str, tuple[tuple[int, ...], str, Any]]:
        got = {}
        for f in sorted(root.glob("*.safetensors")):
            with safe_open(str(f), "pt") as s:
                for k in s.keys():
                    t = s.get_tensor(k)
                    value = t.tolist() if t.dtype == torch.int64 else None
                    got[k] = (tuple(t.shape), str(t.dtype), value)
        return got

    a = tensors(ours)
    b = {k: v for k, v in tensors(theirs).items() if ".self_attn.indexer." not in k}
    if fp8:  # the FP8 form: the tables' dtype and their scales
        b = {
            k: (v[0], "torch.float8_e4m3fn", v[2]) if ".ngram_embedding.shard_" in k else v
            for k, v in b.items()
        }
        for k in a:
            if k.endswith("ngram_embedding.weight_scale"):
                b[k] = ((), "torch.float32", None)
    for k in sorted(set(a) | set(b)):
        if k not in a:
            problems.append(f"missing from ours: {k} {b[k][:2]}")
        elif k not in b:
            problems.append(f"not in save_pretrained's: {k} {a[k][:2]}")
        elif a[k] != b[k]:
            problems.append(f"{k}: ours {a[k]} != {b[k]}")
    ca = json.loads((ours / "config.json").read_text())
    cb = json.loads((theirs / "config.json").read_text())
    for key in _QSA_DUMMY:
        cb[key] = None
    if fp8:
        cb["ple_embedding_dtype"] = "float8_e4m3fn"
    for k in sorted(set(ca) | set(cb)):
        if k != "transformers_version" and ca.get(k) != cb.get(k):
            problems.append(f"config.json {k}: ours {ca.get(k)!r} != {cb.get(k)!r}")
    ga = json.loads((ours / "generation_config.json").read_text())
    gb = json.loads((theirs / "generation_config.json").read_text())
    ga.pop("transformers_version", None)
    gb.pop("transformers_version", None)
    if ga != gb:
        problems.append(f"generation_config.json: ours {ga} != {gb}")
    return problems


def check_tokenizer(ckpt: Path) -> str:
    """Load the saved tokenizer the way vLLM does (AutoTokenizer) and round-trip ids."""
    import random

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg = cfg.get("text_config", cfg) if "vocab_size" not in cfg else cfg  # composite configs
    assert len(tok) == cfg["vocab_size"], (len(tok), cfg["vocab_size"])
    assert tok.eos_token_id == cfg["eos_token_id"], (tok.eos_token_id, cfg["eos_token_id"])
    rng = random.Random(0)
    ids = [rng.randrange(len(SPECIALS), cfg["vocab_size"]) for _ in range(64)]
    text = tok.decode(ids)
    back = tok(text, add_special_tokens=False)["input_ids"]
    assert back == ids, (ids[:8], back[:8])
    return f"{type(tok).__name__}: {len(tok)} tokens, eos {tok.eos_token_id}, 64 ids round-trip"


def check_vllm_loads(ckpt: Path, *, mmap: bool) -> str:
    """vLLM's default loader (CPU, ``VLLM_TARGET_DEVICE=cpu``) builds the model from the
    checkpoint: the GPU-table model with every table row loaded, or (``mmap``) ple-memops'
    model with the table files skipped. Needs vLLM 0.33.0 (and ple-memops for ``mmap``)."""
    import socket

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    # vLLM turns breakable graphs on for Qwen4Exp by writing this variable (process-wide).
    os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "0"
    import torch
    from vllm.config import LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.config.compilation import CUDAGraphMode
    from vllm.config.engram import EngramConfig
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    record = None
    if mmap:
        from ple_memops.vllm import plugin

        record = plugin.install()
    try:
        with set_current_vllm_config(VllmConfig()):
            init_distributed_environment(
                world_size=1,
                rank=0,
                distributed_init_method=f"tcp://127.0.0.1:{port}",
                local_rank=0,
                backend="gloo",
            )
            initialize_model_parallel(1, 1)
        vc = VllmConfig(
            model_config=ModelConfig(model=str(ckpt), skip_tokenizer_init=True, dtype="bfloat16"),
            engram_config=EngramConfig(cpu_offload=mmap),
            load_config=LoadConfig(load_format="safetensors"),
            additional_config={"ple_memops": {"table_backend": "mmap"}} if mmap else {},
        )
        if mmap:
            vc.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
        with set_current_vllm_config(vc):
            loader = get_model_loader(vc.load_config)
            with torch.device("cpu"):
                model = initialize_model(vllm_config=vc, model_config=vc.model_config)
            loader.load_weights(model, vc.model_config)
        kinds = sorted(
            {type(m).__name__ for m in model.modules() if "Attention" in type(m).__name__}
        )
        tables = [
            m for n, m in model.named_modules() if n.endswith("ple_embedding.ngram_embedding")
        ]
        rows = [tuple(t.weight.shape) for t in tables]
        if mmap and any(math.prod(r) for r in rows):
            raise AssertionError(f"the mmap model allocated its tables: {rows}")
        if not mmap and not all(t.weight.view(torch.uint8).any() for t in tables):
            raise AssertionError("a GPU-table model's table was not loaded")
        return f"{type(model).__name__}: attention modules {kinds}; tables {rows}"
    finally:
        destroy_model_parallel()
        destroy_distributed_environment()
        if record is not None:
            record.undo()
