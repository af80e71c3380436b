"""What deferred PLE rows cost in a model-sized decode step under asynchronous scheduling.

A 48-layer stack of bf16 GEMVs (about a 3 ms step on an H200) consumes 16 rows per token of
a memory-mapped table at layer 2. Each step's ids are computed on the GPU from the previous
step's token (as Qwen4Exp's n-gram ids are), so they exist only on the GPU when the step is
launched; the host runs one step ahead (launch step k, then wait for step k-1's output, as
vLLM's batch queue does). Side by side, in one process, interleaved in random order:

  none            the same graph without PLE rows at all
  static          the same graph with the PLE work (ids, the consumer's matmul) reading rows
                  that are already on the GPU and never change: the floor that delivering
                  rows is measured against (`static #2` is an identical copy: the A/A noise)
  gpu             table on the GPU, rows looked up inside the graph (the stock path)
  sync            ids copied to the host (blocking), gathered, copied in before launch
                  (vLLM PR #54129): the GPU idles while the host works
  worker-inline   GatherWorker: publish at the top, wait/copy/reset at the consumer
  worker-staged   GatherWorker.stage(): publish and wait/copy on a side branch joined at
                  the consumer
  staged-depth1   worker-staged, but only one step may be armed: the host completes step
                  k before arming k+1 (shows what the second armed step buys)

Reported per batch size: the GPU's step period in steady state (CUDA events over the run),
its overhead over `static` (and the worker's as a fraction of `sync`'s), the host time of
the work before each launch (for the workers: the complete/begin pair at the start of a
step), and with --track how often the GPU had to wait for the worker. Every variant's
token stream must equal `gpu`'s (same bytes in, same tokens out).

    python benchmarks/bench_step.py [--batches 1,16,64] [--steps 150] [--rounds 4] [--json f]

At a Gemma E2B step's shapes (one 15 KiB row a token, a 30-layer step, rows consumed at the
end of layer 0), on either device path:

    python benchmarks/bench_step.py --heads 1 --row-bytes 15360 --table-rows 262144 \
        --layers 30 --hidden 2048 --inter 8192 --consumer 1 --batches 1,8,64 --copy memop
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import save_file

import ple_memops as pm
from ple_memops.settings import COPIES
from ple_memops.steps import Steps

# Rows a token (n-gram heads) and bytes a row: Qwen4Exp-like by default; --heads 1
# --row-bytes 15360 is a Gemma E2B token's one row of 30 x 256 BF16 values.
HEADS, ROW_BYTES = 16, 160
VOCAB = 32768
COPY = "auto"


def make_table(tmp: Path, rows: int) -> pm.MmapTable:
    rng = np.random.default_rng(0)
    data = np.empty((rows, ROW_BYTES), dtype=np.uint8)
    for i in range(0, rows, 1 << 18):
        j = min(rows, i + (1 << 18))
        # Finite bf16 values (a random exponent byte could make inf/nan rows).
        v = rng.standard_normal((j - i, ROW_BYTES // 2), dtype=np.float32) * 0.05
        data[i:j] = (v.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(j - i, -1)
    path = tmp / "model.safetensors"
    save_file({"ple.weight": data.view(np.float16)}, str(path))
    table = pm.MmapTable.open(path, "ple.weight")
    table.prewarm(table.rows * table.row_bytes)
    return table


class Model:
    """Weights shared by every variant's graph."""

    def __init__(self, layers: int, hidden: int, inter: int, consumer: int, rows: int) -> None:
        g = torch.Generator(device="cuda").manual_seed(0)
        bf = torch.bfloat16
        self.layers, self.consumer = layers, consumer
        self.up = [
            torch.randn(hidden, inter, device="cuda", dtype=bf, generator=g) * hidden**-0.5
            for _ in range(layers)
        ]
        self.down = [
            torch.randn(inter, hidden, device="cuda", dtype=bf, generator=g) * inter**-0.5
            for _ in range(layers)
        ]
        self.ple = torch.randn(HEADS * ROW_BYTES // 2, hidden, device="cuda", dtype=bf, generator=g)
        self.embed = torch.randn(VOCAB, hidden, device="cuda", dtype=bf, generator=g)
        # Per-head n-gram vocabularies (offsets + sizes): global table rows, like Qwen4Exp.
        size = rows // HEADS
        self.offsets = torch.arange(HEADS, device="cuda", dtype=torch.int64) * size
        self.sizes = torch.full((HEADS,), size, device="cuda", dtype=torch.int64)
        self.mult = torch.tensor(
            [[1000003 + 2 * h, 999983 + 6 * h, 1000211 + 10 * h] for h in range(HEADS)],
            device="cuda",
            dtype=torch.int64,
        )


class Variant:
    def __init__(
        self, name: str, model: Model, batch: int, table: pm.MmapTable, track: bool
    ) -> None:
        self.name, self.m, self.b, self.table = name, model, batch, table
        n = batch * HEADS
        self.n = n
        self.tok = torch.zeros(batch, dtype=torch.int64, device="cuda")
        self.ctx = torch.zeros(batch, 2, dtype=torch.int64, device="cuda")
        self.ids = torch.zeros(n, dtype=torch.int64, device="cuda")
        self.hist = torch.zeros(4096, batch, dtype=torch.int64, device="cuda")
        self.step = torch.zeros(1, dtype=torch.int64, device="cuda")
        self.ple_steps: Steps | None = None
        self.rows_sync: pm.DeferredRows | None = None
        self.gpu_table: torch.Tensor | None = None
        self.graph_ids: torch.cuda.CUDAGraph | None = None
        if name.startswith("static"):
            self.static_rows = torch.zeros((n, ROW_BYTES), dtype=torch.uint8, device="cuda")
            self.static_rows.copy_(torch.from_numpy(np.asarray(table.gather(np.arange(n)))))
        if name == "gpu":
            raw = np.asarray(table.gather(np.arange(table.rows)))
            self.gpu_table = torch.from_numpy(raw).cuda()
        elif name == "sync":
            self.rows_sync = pm.DeferredRows(n, ROW_BYTES, device=0, force_sync=True)
            self.ids_host = torch.zeros(n, dtype=torch.int64).pin_memory()
        elif name.startswith(("worker", "staged")):
            # "worker-staged@memop": the variant with that device side (default --copy).
            base, _, copy = name.partition("@")
            depth = 1 if base == "staged-depth1" else 2
            self.ple_steps = Steps.build(
                {"ple": table},
                max_rows=n,
                device=0,
                depth=depth,
                track_arrival=track,
                copy=copy or COPY,
            )
            assert self.ple_steps.mode == "deferred", self.ple_steps.reason
            self.track = self.ple_steps.tables["ple"].rows
        self.track_arrival = track
        self.reset()
        self.graph = self.capture()

    def reset(self) -> None:
        self.tok.fill_(7)
        self.ctx.fill_(3)
        self.step.zero_()

    def compute_ids(self) -> None:
        m = self.m
        t = torch.stack([self.tok, self.ctx[:, 0], self.ctx[:, 1]], dim=1)  # [B, 3]
        h = (t.unsqueeze(1) * m.mult.unsqueeze(0)).sum(-1)  # [B, H]
        self.ids.copy_(((h % m.sizes) + m.offsets).reshape(-1))

    def rows_view(self, staging: torch.Tensor) -> torch.Tensor:
        return staging[: self.n].view(torch.bfloat16).reshape(self.b, -1)

    def forward(self, rows: Callable[[], torch.Tensor] | None, pre: Callable[[], None]) -> None:
        m = self.m
        x = m.embed.index_select(0, self.tok)
        pre()
        for i in range(m.layers):
            if i == m.consumer and rows is not None:
                x = x + (rows() @ m.ple) * 0.01
            h = torch.tanh(x @ m.up[i])
            x = x + h @ m.down[i]
        nxt = x[:, :VOCAB].float().argmax(-1)
        self.ctx[:, 1].copy_(self.ctx[:, 0])
        self.ctx[:, 0].copy_(self.tok)
        self.tok.copy_(nxt)
        self.step.add_(1)
        self.hist.index_copy_(0, self.step % self.hist.shape[0], self.tok.unsqueeze(0))

    def body(self) -> None:
        v = self.name
        if v == "none":
            self.forward(None, lambda: None)
        elif v.startswith("static"):
            self.forward(lambda: self.rows_view(self.static_rows), self.compute_ids)
        elif v == "gpu":
            assert self.gpu_table is not None
            table = self.gpu_table

            def pre() -> None:
                self.compute_ids()

            self.forward(lambda: self.rows_view(table.index_select(0, self.ids)), pre)
        elif v == "sync":
            rows = self.rows_sync
            assert rows is not None
            self.forward(lambda: self.rows_view(rows.staging), lambda: None)
        elif v.partition("@")[0] == "worker-inline":
            ple = self.ple_steps
            assert ple is not None
            worker = ple.tables["ple"].worker
            assert worker is not None

            def pre() -> None:
                self.compute_ids()
                worker.publish(self.ids)

            def consume() -> torch.Tensor:
                ple.tables["ple"].rows.enqueue(rows=self.n)
                return self.rows_view(ple.staging("ple"))

            self.forward(consume, pre)
        else:
            ple = self.ple_steps
            assert ple is not None
            staged: list[Any] = []

            def pre() -> None:
                self.compute_ids()
                staged.append(ple.stage("ple", self.ids, rows=self.n))

            def consume() -> torch.Tensor:
                return self.rows_view(staged.pop().join())

            self.forward(consume, pre)

    def capture(self) -> torch.cuda.CUDAGraph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # eager warm-up, fed like a real step
                self.eager_step()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        if self.name == "sync":
            self.graph_ids = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph_ids):
                self.compute_ids()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self.body()
        self.reset()
        return g

    def eager_step(self) -> None:
        if self.ple_steps is not None:
            self.ple_steps.arm(self.n)
            self.body()
            self.ple_steps.drain()
        elif self.rows_sync is not None:
            self.compute_ids()
            self.sync_fill()
            self.body()
            self.rows_sync.complete()
        else:
            self.body()

    def sync_fill(self) -> None:
        rows = self.rows_sync
        assert rows is not None
        self.ids_host.copy_(self.ids)  # waits for the previous step: the host falls behind
        rows.begin(self.n)
        rows.fill_from(self.table, self.ids_host.numpy())  # the gather, then the H2D copy

    def run(self, steps: int) -> dict[str, Any]:
        """``steps`` steps with the host one step ahead; returns the GPU step period and
        the host time of the pre-launch work."""
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
        host: list[float] = []
        ple = self.ple_steps
        waited0 = self.track.stats().gpu_waited if ple is not None else 0
        for k in range(steps):
            t0 = time.perf_counter()
            if ple is not None:
                ple.arm(self.n)  # completes the oldest step first when `depth` are armed
            elif self.rows_sync is not None:
                assert self.graph_ids is not None
                self.graph_ids.replay()
                self.sync_fill()
            host.append((time.perf_counter() - t0) * 1e6)
            self.graph.replay()
            ends[k].record()
            if self.rows_sync is not None:
                self.rows_sync.complete()
            if k >= 1:
                ends[k - 1].synchronize()  # the previous step's output, as vLLM waits for it
        if ple is not None:
            ple.drain()
        ends[-1].synchronize()
        period = ends[0].elapsed_time(ends[-1]) * 1e3 / (steps - 1)
        waited = self.track.stats().gpu_waited - waited0 if ple is not None else 0
        tracked = ple is not None and self.track_arrival
        return {
            "period_us": period,
            "host_us": host,
            "waited": waited,
            "steps": steps,
            "tracked": tracked,
        }

    def tokens(self, upto: int) -> np.ndarray:
        return self.hist[1 : upto + 1].cpu().numpy()

    def close(self) -> None:
        if self.ple_steps is not None:
            self.ple_steps.shutdown()


VARIANTS = [
    "none",
    "static",
    "static #2",
    "gpu",
    "sync",
    "worker-inline",
    "worker-staged",
    "staged-depth1",
]


def main() -> None:
    global HEADS, ROW_BYTES, COPY
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=14336)
    ap.add_argument("--consumer", type=int, default=2)
    ap.add_argument("--table-rows", type=int, default=1 << 21)
    ap.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma-separated; a worker variant may name its device side after '@' "
        "(worker-staged@kernel)",
    )
    ap.add_argument(
        "--track",
        action="store_true",
        help="count steps where the GPU waited for the worker (one more stream write a step)",
    )
    ap.add_argument("--heads", type=int, default=HEADS, help="rows a token")
    ap.add_argument("--row-bytes", type=int, default=ROW_BYTES, help="bytes a row (even)")
    ap.add_argument(
        "--copy",
        choices=list(COPIES),
        default=COPY,
        help="the deferred step's device side (DeferredRows' copy)",
    )
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.heads < 1 or a.row_bytes < 2 or a.row_bytes % 2:
        ap.error("--heads must be >= 1 and --row-bytes a positive even number")
    HEADS, ROW_BYTES, COPY = a.heads, a.row_bytes, a.copy
    variants = a.variants.split(",")
    torch.cuda.init()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        table = make_table(Path(tmp), a.table_rows)
        model = Model(a.layers, a.hidden, a.inter, a.consumer, table.rows)
        for b in (int(x) for x in a.batches.split(",")):
            vs = {v: Variant(v, model, b, table, a.track) for v in variants}
            per: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
            order = list(variants)
            for r in range(a.rounds):
                random.Random(r).shuffle(order)
                for v in order:
                    vs[v].reset()
                    per[v].append(vs[v].run(a.steps))
            # Same rows in, same tokens out: one more run each from the same start, compared
            # against gpu's token stream.
            toks = {}
            for v in variants:
                vs[v].reset()
                vs[v].run(min(a.steps, 200))
                toks[v] = vs[v].tokens(min(a.steps, 200) - 1)
            for v in variants:
                if v not in ("none", "static", "static #2", "gpu") and "gpu" in toks:
                    same = np.array_equal(toks[v], toks["gpu"])
                    per[v][0]["tokens_equal_gpu"] = same
                    if not same:
                        print(f"!! batch {b} {v}: token stream differs from gpu")
            results[str(b)] = per
            for v in vs.values():
                v.close()
            del vs
            torch.cuda.empty_cache()
    report(results, variants)
    if a.json:
        a.json.write_text(json.dumps(results, default=float))


def report(results: dict[str, Any], variants: list[str]) -> None:
    print()
    print(
        "| batch | variant | step period us (median of rounds) | overhead vs static us "
        "| host pre-launch us median / p99 | GPU waited for worker | tokens == gpu |"
    )
    print("|---|---|---|---|---|---|---|")
    for b, per in results.items():
        base = statistics.median(x["period_us"] for x in per["static"]) if "static" in per else None
        sync_over = None
        if base is not None and "sync" in per:
            sync_over = statistics.median(x["period_us"] for x in per["sync"]) - base
        for v in variants:
            runs = per[v]
            period = statistics.median(x["period_us"] for x in runs)
            host = [h for x in runs for h in x["host_us"][2:]]
            over = "" if base is None else f"{period - base:+.1f}"
            if sync_over and v.startswith(("worker", "staged")) and base is not None:
                over += f" ({(period - base) / sync_over:.2f} of sync)"
            steps = sum(x["steps"] for x in runs)
            waited = sum(x["waited"] for x in runs)
            tracked = v.startswith(("worker", "staged")) and runs[0]["tracked"]
            wt = f"{waited}/{steps}" if tracked else ""
            eq = runs[0].get("tokens_equal_gpu", "")
            print(
                f"| {b} | {v} | {period:.1f} | {over} | {np.median(host):.1f} / "
                f"{np.percentile(host, 99):.1f} | {wt} | {eq} |"
            )


if __name__ == "__main__":
    main()
