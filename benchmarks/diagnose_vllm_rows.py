"""Where do an mmap engine's tokens part from the stock engine's? A diagnostic for the real
vLLM 0.33.0 engine on a GPU (``scripts/gpu/all_gpu_tests.sh`` runs it unless ``DIAG=0``).

Every engine serves the workload of ``tests/test_vllm_engine_gpu.py`` (BF16 tiny Qwen4Exp:
its engine, prompts and sampling as ``tests/vllm_harness.py`` copies them) with a
check inside its PLE embedding, captured into the CUDA graphs with the rest: the rows
the consumer reads are compared, byte for byte, with the checkpoint file's rows at the ids
the model computed, on the device, at every real step (dummy and warm-up passes excluded).
Each layer reports its checked calls, rows that differ, ids out of range and a fingerprint
of the ids, so two engines can be told apart by their ids, their rows, or neither (then by
what consumes the rows). Prints one table; exit status 0 when it ran.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ["PLE_MEMOPS_TABLE_BACKEND"] = "mmap"

import torch

_LAYER = re.compile(r"layers\.(\d+)\.")
_MUL = 0x9E3779B97F4A7C15 - (1 << 64)  # an odd int64 for the id fingerprint


def _file_table(ckpt: Path, layer: int, dtype: torch.dtype) -> torch.Tensor:
    from safetensors import safe_open

    stem = f"model.layers.{layer}.ple.ple_embedding.ngram_embedding.shard_"
    shards: dict[int, torch.Tensor] = {}
    for f in ckpt.glob("*.safetensors"):
        with safe_open(str(f), "pt") as s:
            for k in s.keys():
                if k.startswith(stem):
                    shards[int(k[len(stem) :].split(".")[0])] = s.get_tensor(k)
    table = torch.cat([shards[k] for k in sorted(shards)])
    assert table.dtype == dtype, (table.dtype, dtype)
    return table


class Check:
    """Per-layer device counters, updated by ops recorded into the graphs."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table.cuda()
        self.bad = torch.zeros((), dtype=torch.int64, device="cuda")
        self.seen = torch.zeros((), dtype=torch.int64, device="cuda")
        self.calls = torch.zeros((), dtype=torch.int64, device="cuda")
        self.oob = torch.zeros((), dtype=torch.int64, device="cuda")
        self.idsum = torch.zeros((), dtype=torch.int64, device="cuda")
        self.first_bad_call = torch.full((), -1, dtype=torch.int64, device="cuda")

    def __call__(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        flat = ids.reshape(-1)
        n = self.table.shape[0]
        self.oob.add_(((flat < 0) | (flat >= n)).sum())
        want = self.table.index_select(0, flat.clamp(0, n - 1))
        have = rows.reshape(flat.shape[0], -1)
        bad = (have.view(torch.int16) != want.view(torch.int16)).any(-1).sum()
        self.first_bad_call.copy_(
            torch.where((bad > 0) & (self.first_bad_call < 0), self.calls, self.first_bad_call)
        )
        self.bad.add_(bad)
        self.seen.add_(flat.shape[0])
        self.idsum.add_((flat * _MUL).sum())
        self.calls.add_(1)

    def report(self) -> dict[str, int]:
        return {
            k: int(getattr(self, k).item())
            for k in ("calls", "seen", "bad", "first_bad_call", "oob", "idsum")
        }


def _install(ckpt_box: dict[str, Path], clone: bool) -> None:
    """Wrap both table classes' prefetch pair with the check (and, for the mmap class,
    optionally hand the consumer a copy of the staging rows)."""
    from vllm.models.qwen4_exp.common.ngram_embedding import Qwen4ExpPLEPinnedHostEmbedding

    from ple_memops.vllm import hooks as hooks_mod
    from ple_memops.vllm.qwen4exp import Qwen4ExpPLEMmapEmbedding

    def wrap(cls: Any, is_mmap: bool) -> None:
        start0, fin0 = cls.start_prefetch, cls.finalize_prefetch
        if getattr(cls, "_diag_wrapped", False):
            return
        cls._diag_wrapped = True

        def start(self: Any, ngram_ids: torch.Tensor) -> None:
            self._diag_ids = ngram_ids
            start0(self, ngram_ids)

        def fin(self: Any, total_tokens: int) -> torch.Tensor:
            rows = fin0(self, total_tokens)
            check = getattr(self, "_diag_check", None)
            if check is None:
                if torch.cuda.is_current_stream_capturing():
                    raise RuntimeError("diagnostic: first PLE call under capture")
                m = _LAYER.search(self._diag_prefix)
                assert m, self._diag_prefix
                check = self._diag_check = Check(
                    _file_table(ckpt_box["ckpt"], int(m.group(1)), rows.dtype)
                )
                _CHECKS[self._diag_prefix] = check
            if is_mmap:
                scope = getattr(self.ple_memops_hooks, "_scope", None)
                if isinstance(scope, hooks_mod._NoDefer) or (
                    isinstance(scope, hooks_mod._Step) and scope.dummy
                ):
                    return rows.clone() if clone else rows  # no data in this pass
                if clone:
                    rows = rows.clone()
            check(self._diag_ids, rows)
            return rows

        init0 = cls.__init__

        def init(self: Any, *a: Any, **kw: Any) -> None:
            init0(self, *a, **kw)
            self._diag_prefix = kw["prefix"]

        cls.start_prefetch, cls.finalize_prefetch, cls.__init__ = start, fin, init

    wrap(Qwen4ExpPLEPinnedHostEmbedding, False)
    wrap(Qwen4ExpPLEMmapEmbedding, True)
    Qwen4ExpPLEMmapEmbedding._diag_clone = clone


_CHECKS: dict[str, Check] = {}


def _first_difference(a: list[int], b: list[int]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--variants",
        default="stock,mmap,mmap-clone,stock-eager,mmap-eager,gpu",
        help="comma-separated: stock (vLLM's default: breakable graphs), stock-full (FULL "
        "decode graphs, as mmap), mmap, mmap-clone, mmap-sync, gpu; -eager: no graphs",
    )
    args = ap.parse_args()

    # The engine tests' harness (tests/vllm_harness.py).
    sys.path.append(str(Path(__file__).resolve().parent.parent / "tests"))
    import vllm_harness as harness

    harness.bundle_substitutes()  # the offline bundle leaves CuTe DSL out

    workload = harness.engine_workload()
    root = Path(tempfile.mkdtemp(prefix="ple-diag-"))
    ckpt = harness.write_checkpoint(root / "bf16", fp8=False, max_position_embeddings=8192)
    box = {"ckpt": ckpt}
    results: dict[str, Any] = {}
    for variant in args.variants.split(","):
        eager = variant.endswith("-eager")
        base = variant.removesuffix("-eager")
        clone = base == "mmap-clone"
        _install(box, clone)
        from ple_memops.vllm.qwen4exp import Qwen4ExpPLEMmapEmbedding

        Qwen4ExpPLEMmapEmbedding._diag_clone = clone
        backend = {"stock": "stock", "stock-full": "stock", "gpu": "gpu"}.get(base, "mmap")
        os.environ.pop("PLE_MEMOPS_FORCE_SYNC", None)
        # vLLM's default for Qwen4Exp is breakable graphs (it sets the variable when it is
        # absent); stock-full opts out as the mmap engines do (FULL decode graphs).
        os.environ.pop("VLLM_USE_BREAKABLE_CUDAGRAPH", None)
        if base == "stock-full":
            os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "0"
        if base == "mmap-sync":
            os.environ["PLE_MEMOPS_FORCE_SYNC"] = "1"
        _CHECKS.clear()
        # The engine tests' engine (eagerly: vLLM's enforce_eager turns the graphs off).
        llm = harness.engine(ckpt, backend, **({"enforce_eager": True} if eager else {}))
        try:
            tokens = harness.generate(llm, workload)
            torch.cuda.synchronize()
            checks = {k: c.report() for k, c in sorted(_CHECKS.items())}
        finally:
            harness.close(llm)
            gc.collect()
        results[variant] = (tokens, checks)
        print(f"== {variant}: {checks}", flush=True)
    ref = results.get("stock", (None,))[0]
    print(
        "\n| variant | tokens vs stock | layer | calls | rows checked | rows differ "
        "| first bad call | ids out of range | id fingerprint |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for variant, (tokens, checks) in results.items():
        diff = []
        if ref is not None:
            for b, (want, have) in enumerate(zip(ref, tokens, strict=True)):
                for r, (w, h) in enumerate(zip(want, have, strict=True)):
                    if w != h:
                        first = _first_difference(w, h)
                        diff.append(f"b{b}r{r}@{first}")
        verdict = "same" if not diff else "differs " + " ".join(diff[:6])
        if not checks:
            print(f"| {variant} | {verdict} | (no prefetch path) | | | | | | |")
        for layer, c in checks.items():
            print(
                f"| {variant} | {verdict} | {layer.split('.ple')[0]} | {c['calls']} | {c['seen']} "
                f"| {c['bad']} | {c['first_bad_call']} | {c['oob']} "
                f"| {c['idsum'] & 0xFFFFFFFF:08x} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
