"""Diagnose two ways a captured Gemma 3n decode step can go wrong on a GPU (every wait
bounded; each part says what it shows; the findings are in BENCHMARKS.md: a launch that
waits for the GPU, and cuDNN attention that does not repeat). Run from the repo root with
the wheel installed.

``launch``: does ``graph.replay()`` itself block the host when the graph starts with a
deferred consumer whose fill only the launching thread can make? A synthetic graph: one
staged consumer (the E2B batch-8 step: 8 rows of 15,360 bytes), ``--kernels`` small
kernels after its join (or before it), replayed with the fill made right after the
launch on the same thread (``inline``, what the runner's deferred-host does) or by a
thread started before the launch (``thread``). For each copy path it prints the host time
of the launch and of the fill; a launch that lasts the watchdog means the launch waited
for the GPU, which waited for the fill (released by the watchdog, so nothing hangs).

``hang``: the runner's deferred-host at E2B shapes, batch 8 (it hung when the host filled
on the launching thread; the ids now go to the gather worker), both scheduling styles.

``determinism``: the captured reference (gpu-table) replayed again and again with nothing
between, then after the eager check, after the other scheduling style, after a deferred
variant and after the UVA one; every run says its first logits mismatch against the
recording and whether the state after its prefill (KV cache, counters, token, prefill
logits, memoised constants, weights) differs from the recording's. If the first
back-to-back replays already differ, the graph itself does not repeat on this GPU; if
they only differ after some step of the runner, that step changes the state or the GPU.

    python benchmarks/diagnose_hf.py [--parts launch,hang,determinism] [--layers N]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
import traceback
from typing import Any

import numpy as np


def _wait(event: Any, seconds: float) -> bool:
    t0 = time.monotonic()
    while not event.query():
        if time.monotonic() - t0 > seconds:
            return False
        time.sleep(0.0005)
    return True


def _fill_on_thread(rows: Any, block: Any, wait: float, errors: list[BaseException]) -> Any:
    def fill() -> None:
        try:
            rows.fill(block, busy_wait=wait)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=fill, daemon=True)
    t.start()
    return t


def _one_launch_config(
    copy: str, nk: int, where: str, how: str, watchdog: float, reps: int, data: Any, x: Any
) -> str:
    import torch

    import ple_memops as pm

    n, width = 8, data.shape[1]
    rows = pm.DeferredRows(n, width, device=0, watchdog=watchdog, copy=copy, track_arrival=True)
    out = torch.zeros_like(rows.staging)
    launch_ms: list[float] = []
    fill_ms: list[float] = []
    result = "ok"
    graph = None
    try:
        # The runner's eager warm-up: fill, then the consumer inline.
        rows.begin(n)
        rows.fill(data[:n], busy_wait=watchdog)
        rows.stage(rows=n).join()
        out.copy_(rows.staging)
        rows.complete()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            st = rows.stage(rows=n)
            for _ in range(nk if where == "before" else 0):
                x.add_(1)
            st.join()
            out.copy_(rows.staging)
            for _ in range(nk if where == "after" else 0):
                x.add_(1)
        torch.cuda.synchronize()
        end = torch.cuda.Event()
        for i in range(reps):
            k = 1 + i % (len(data) - n)
            block = data[k : k + n]
            rows.begin(n)
            errors: list[BaseException] = []
            filler = _fill_on_thread(rows, block, watchdog, errors) if how == "thread" else None
            t0 = time.perf_counter()
            graph.replay()
            end.record()
            t1 = time.perf_counter()
            launch_ms.append((t1 - t0) * 1e3)
            if filler is None:
                rows.fill(block, busy_wait=watchdog)
            else:
                filler.join(2 * watchdog + 5)
                if filler.is_alive():
                    raise RuntimeError("the filler thread did not return")
                if errors:
                    raise errors[0]
            fill_ms.append((time.perf_counter() - t1) * 1e3)
            rows.complete()
            if not _wait(end, 2 * watchdog):
                raise RuntimeError("the replay did not finish")
            if not np.array_equal(out.cpu().numpy(), block):
                raise RuntimeError(f"replay {i}: wrong rows")
    except Exception as e:
        result = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:90]}"
    finally:
        rows.close()  # releases any wait for good
        torch.cuda.synchronize()
        del graph
    lm = f"{max(launch_ms):.2f}" if launch_ms else "-"
    fm = f"{max(fill_ms):.2f}" if fill_ms else "-"
    return f"{copy:6} {nk:>7} {where:6} {how:6} {lm:>10} {fm:>9}  {result}"


def launch_part(kernels: list[int], watchdog: float, reps: int) -> None:
    import torch

    data = np.random.default_rng(0).integers(0, 256, (64, 15360), dtype=np.uint8)
    x = torch.zeros(256, device="cuda")
    print(f"== launch: 8 rows x 15360 B a step, watchdog {watchdog:.0f} s, {reps} replays each")
    print(
        f"{'copy':6} {'kernels':>7} {'where':6} {'fill':6} {'launch ms':>10} {'fill ms':>9}  result"
    )
    for copy in ("kernel", "memop"):
        for nk in kernels:
            for where in ("after", "before"):
                for how in ("inline", "thread"):
                    print(_one_launch_config(copy, nk, where, how, watchdog, reps, data, x))
                    sys.stdout.flush()


def _load(model: str, layers: int, device: str) -> tuple[Any, Any, Any]:
    import torch
    import transformers

    from ple_memops.demo.checkpoints import (
        build_checkpoint,
        default_cache_dir,
        e2b_gemma3n_config,
        tiny_gemma3n_config,
    )
    from ple_memops.demo.cli import load_gemma, relayer

    tiny = model == "tiny"
    cfg = tiny_gemma3n_config() if tiny else e2b_gemma3n_config()
    if layers:
        cfg = relayer(cfg, layers, tiny=tiny)
    name = f"gemma3n-{'tiny' if tiny else 'e2b-shaped'}{layers or ''}-tf{transformers.__version__}"
    ckpt = default_cache_dir() / name
    t0 = time.perf_counter()
    build_checkpoint(ckpt, cfg, device=device)
    dev = torch.device(device) if device == "cpu" else torch.device("cuda", 0)
    served, stock = load_gemma(ckpt, dev)
    print(f"== {ckpt.name} ready and loaded in {time.perf_counter() - t0:.1f} s")
    return served, stock, dev


def hang_part(served: Any, stock: Any, dev: Any, batch: int, steps: int) -> None:
    from ple_memops.demo import report
    from ple_memops.demo.runner import GemmaBench

    for attention in ("math",):
        print(f"== hang: deferred-host at batch {batch}, {steps} steps ({attention} attention)")
        bench = GemmaBench(
            served, stock, device=dev, watchdog=10.0, track_arrival=True, attention=attention
        )
        t0 = time.perf_counter()
        try:
            res = bench.run_batch(
                batch,
                steps,
                variants=["gpu-table", "deferred-host"],
                styles=["sync", "async"],
                placements=["early", "late"],
            )
            print(report.text_table(res))
        except Exception as e:
            print("".join(traceback.format_exception(e)[-8:]))
        print(f"   ({time.perf_counter() - t0:.1f} s)")
        sys.stdout.flush()


def _first_diff(dec: Any, graph: Any, logits: Any, record: Any) -> str:
    """Replay every step against the recording; describe the first step that differs."""
    import torch

    dec.prefill()
    for k in range(dec.steps):
        if graph is None:
            out = dec.step()
        else:
            graph.replay()
            out = logits
        ref = record.logits[k]
        bad = out.view(torch.int16) != ref.view(torch.int16)
        if bool(bad.any()):
            d = (out.float() - ref.float()).abs()
            same_tok = bool(torch.equal(out.argmax(-1), ref.argmax(-1)))
            return (
                f"first differs at step {k}: {int(bad.sum())} of {bad.numel()} logits, "
                f"max |diff| {float(d.max()):.3g}; argmax {'same' if same_tok else 'DIFFERS'}"
            )
    return "identical at every step"


def determinism_part(served: Any, stock: Any, dev: Any, batch: int, steps: int) -> None:

    from ple_memops.demo.runner import Decoder, GemmaBench, Ops, Record

    # torch's own SDPA choice (cuDNN on the H200): the backend this part was written to test.
    bench = GemmaBench(
        served, stock, device=dev, track_arrival=bench_cuda(dev), attention="default"
    )
    dec = Decoder(served.model, batch=batch, steps=steps, device=dev)
    print(f"== determinism: gpu-table reference, batch {batch}, {steps} steps")
    differed: list[str] = []

    def show(what: str, style: str = "sync") -> None:
        r = bench.loop(dec, graph, logits, style, Ops(), record)
        state = "same" if not r.state_diff else ", ".join(r.state_diff)
        print(
            f"  {what:<44} logits first differ at {r.first_mismatch}, tokens "
            f"{'identical' if r.tokens_identical else 'DIFFER'}; state after prefill: {state}"
        )
        if r.first_mismatch is not None:
            differed.append(what)
        sys.stdout.flush()

    with contextlib.ExitStack() as stack:
        stack.enter_context(bench.installed("gpu-table"))
        graph, logits = bench.capture(dec)
        stack.callback(served.restore)
        record = Record(dec, True)
        bench.loop(dec, graph, logits, "sync", Ops(), record, recording=True)
        for i in range(3):
            show(f"replay run {i + 1}, nothing in between")
        back_to_back = bool(differed)
        if back_to_back:
            print(f"  (a back-to-back replay: {_first_diff(dec, graph, logits, record)})")
        ok = bench.check_eager(dec, record)
        print(f"  eager check (4 steps): {'bit-identical' if ok else 'DIFFER'}")
        show("replay after the eager check")
        show("replay, async style", "async")
        show("replay after an async run")
        print(f"  eager steps vs the recording: {_first_diff(dec, None, None, record)}")
        served.restore()
        others = [("deferred-device", "late"), ("pinned-uva", "early")]
        for variant, placement in others if bench.cuda else others[:1]:
            for r in bench.run_variant(dec, variant, placement, ["sync"], record, False):
                state = "same" if not r.state_diff else ", ".join(r.state_diff)
                print(
                    f"  {variant} ({placement}) itself: logits first differ at "
                    f"{r.first_mismatch}; state after prefill: {state}"
                )
            show(f"replay after {variant}")
    if back_to_back and bench.cuda:
        _by_attention_backend(bench, served, dec)


def _by_attention_backend(bench: Any, served: Any, dec: Any) -> None:
    """The reference captured and replayed back to back under one SDPA backend at a time
    (the eager prefill too): which of them repeat?"""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ple_memops.demo.runner import Ops, Record

    print("== determinism by attention backend (capture, record, two replays each)")
    for backend in (SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            with contextlib.ExitStack() as stack, sdpa_kernel([backend]):
                stack.enter_context(bench.installed("gpu-table"))
                graph, logits = bench.capture(dec)
                stack.callback(served.restore)
                record = Record(dec, True)
                bench.loop(dec, graph, logits, "sync", Ops(), record, recording=True)
                firsts = [
                    bench.loop(dec, graph, logits, "sync", Ops(), record).first_mismatch
                    for _ in range(2)
                ]
                print(f"  {backend.name:<20} replays first differ at {firsts}")
                del graph
        except Exception as e:
            print(f"  {backend.name:<20} not run: {type(e).__name__}: {str(e)[:100]}")
        sys.stdout.flush()


def bench_cuda(dev: Any) -> bool:
    return bool(dev.type == "cuda")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--parts", default="launch,hang,determinism")
    ap.add_argument("--model", choices=("e2b", "tiny"), default="e2b")
    ap.add_argument("--layers", type=int, default=0, help="layers (0: the model's own)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run")
    ap.add_argument("--kernels", default="16,2048,8192")
    ap.add_argument("--watchdog", type=float, default=3.0, help="seconds (launch part)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hang-batch", type=int, default=8)
    ap.add_argument("--hang-steps", type=int, default=32)
    ap.add_argument("--det-batch", type=int, default=1)
    ap.add_argument("--det-steps", type=int, default=256)
    a = ap.parse_args()
    parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to diagnose here (--device cpu: a dry run)")
        return
    if "launch" in parts and a.device == "cuda":
        launch_part([int(v) for v in a.kernels.split(",")], a.watchdog, a.reps)
    if "hang" in parts and a.device == "cpu":
        print("== hang: skipped on the CPU (deferred-host needs a GPU)")
        parts.remove("hang")
    if "hang" in parts or "determinism" in parts:
        served, stock, dev = _load(a.model, a.layers, a.device)
        failed = False
        for part, fn, batch, steps in (
            ("determinism", determinism_part, a.det_batch, a.det_steps),
            ("hang", hang_part, a.hang_batch, a.hang_steps),
        ):
            if part not in parts:
                continue
            try:
                fn(served, stock, dev, batch, steps)
            except Exception as e:  # the other part still runs
                failed = True
                print(f"!! {part} part failed:")
                print("".join(traceback.format_exception(e)[-10:]))
            sys.stdout.flush()
        served.close()
        if failed:
            sys.exit(1)


if __name__ == "__main__":
    main()
