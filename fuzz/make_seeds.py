"""Write valid seed inputs for the open_checkpoint fuzz target (see fuzz/README.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save

SEP = b"#SEP"


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)

    def u8(r: int, c: int) -> np.ndarray:
        return rng.integers(0, 255, (r, c), dtype=np.uint8)

    seeds: dict[str, bytes] = {}
    # Single file, exact name (ctl bits 1-2 = 0 -> "w"), F32/F16 rows.
    seeds["single_w_f32"] = b"\x00" + save({"w": rng.random((5, 3), dtype=np.float32)})
    seeds["single_w_f16"] = b"\x08" + save({"w": rng.random((7, 4)).astype(np.float16), "x": u8(1, 1)})
    # Single file, pattern "s{}" (ctl = 2 << 1), with a scale.
    seeds["single_pattern"] = b"\x04" + save(
        {"s0": u8(3, 8), "s1": u8(2, 8), "s0_scale": np.array(0.5, dtype=np.float32)}
    )
    seeds["single_embed"] = b"\x02" + save({"embed_tokens_per_layer.weight": u8(4, 6)})
    # Indexed directory: index #SEP f1 #SEP f2.
    index = {"weight_map": {"s0": "f1.safetensors", "s1": "f2.safetensors", "s2": "f1.safetensors"}}
    seeds["indexed"] = (
        b"\x05"
        + json.dumps(index).encode()
        + SEP
        + save({"s0": u8(4, 5), "s2": u8(1, 5)})
        + SEP
        + save({"s1": u8(2, 5)})
    )
    qname = "model.layers.2.ple.shard_{}.weight"
    index = {"weight_map": {qname.format(k): f"f{k + 1}.safetensors" for k in range(3)}}
    seeds["indexed_qwen"] = (
        b"\x07"
        + json.dumps(index).encode()
        + b"".join(SEP + save({qname.format(k): u8(2, 16)}) for k in range(3))
    )
    for name, data in seeds.items():
        (out / name).write_bytes(data)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
