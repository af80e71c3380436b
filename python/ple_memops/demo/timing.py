"""The timing loop: a variant's decode steps, replayed (CUDA) or run eagerly (the CPU
path), a CUDA event after each step, the logits compared with the recording's on the
device without a host synchronisation in the loop."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import PleMemopsError
from .decode import Decoder, Record, RunResult, bits, in_table
from .state import check_state
from .variants import Ops

__all__ = ["loop", "loop_host"]


def loop(
    bench: Any,
    dec: Decoder,
    graph: Any,
    logits: Any,
    style: str,
    ops: Ops,
    record: Record,
    *,
    recording: bool = False,
) -> RunResult:
    """One run of ``bench``'s decode steps: replayed on a GPU, eager on the CPU path
    (:func:`loop_host`). ``GemmaBench.loop`` is this function."""
    if not bench.cuda:
        return loop_host(bench, dec, style, ops, record, recording)
    import torch

    steps, b = dec.steps, dec.batch
    stream = torch.cuda.current_stream(bench.device)
    first = dec.prefill()
    torch.cuda.synchronize(bench.device)
    assert dec.first_tokens is not None
    ids_prev = in_table(dec.first_tokens, dec.vocab_rows)
    toks = torch.empty((steps, b), dtype=torch.int64).pin_memory()
    tok_ev = [torch.cuda.Event() for _ in range(steps)]  # type: ignore[no-untyped-call]
    ends = [
        torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        for _ in range(steps + 1)
    ]
    mism = torch.zeros(steps, dtype=torch.bool, device=bench.device)
    # Preallocated, so the loop allocates nothing while a step may wait for its rows.
    diff = torch.empty(bits(logits).shape, dtype=torch.bool, device=bench.device)
    state_diff = check_state(bench, dec, first, record, recording)
    launch_max = 0.0

    def ids_of(k: int, prev: Any) -> Callable[[], Any]:
        def get() -> Any:
            if style == "async" and k > 0:
                tok_ev[k - 1].synchronize()  # step k-1 only: never waits for step k
                return in_table(toks[k - 1].numpy(), dec.vocab_rows)
            return prev

        return get

    ends[0].record(stream)
    try:
        for k in range(steps):
            if ops.needs_ids_before and k > 0 and style == "async":
                # The ids of step k are step k-1's tokens: they must reach the host
                # first, which drains the device queue.
                tok_ev[k - 1].synchronize()
                ids_prev = in_table(toks[k - 1].numpy(), dec.vocab_rows)
            ops.arm(k)
            ops.before(k, ids_prev)
            if ops.launching is not None:
                ops.launching(k, ids_of(k, ids_prev))
            t0 = time.perf_counter()
            graph.replay()
            ends[k + 1].record(stream)
            launch_max = max(launch_max, time.perf_counter() - t0)
            toks[k].copy_(dec.tok.view(-1), non_blocking=True)
            tok_ev[k].record(stream)
            if recording:
                record.logits[k].copy_(logits)
            else:
                torch.ne(bits(logits), bits(record.logits[k]), out=diff)
                torch.any(diff, out=mism[k])
            ops.after_launch(k)
            if style == "sync":
                tok_ev[k].synchronize()
                ids_prev = in_table(toks[k].numpy(), dec.vocab_rows)
            elif k > 0:
                tok_ev[k - 1].synchronize()  # the host reads step k-1's tokens
        ops.finish()
    except BaseException:
        with contextlib.suppress(PleMemopsError):
            bench.served.server.close_steps()
        raise
    finally:
        ops.close()
    torch.cuda.synchronize(bench.device)
    step_us = [ends[i].elapsed_time(ends[i + 1]) * 1e3 for i in range(steps)]
    tokens = toks.numpy().copy()
    r = RunResult("", b, style, "", steps, step_us, captured=True, tokens=tokens)
    r.state_diff, r.launch_us_max = state_diff, launch_max * 1e6
    if recording:
        record.tokens = tokens
    else:
        bad = mism.cpu().numpy()
        r.logits_identical = not bool(bad.any())
        r.first_mismatch = int(np.argmax(bad)) if bad.any() else None
        r.tokens_identical = bool(np.array_equal(tokens, record.tokens))
    return r


def loop_host(
    bench: Any, dec: Decoder, style: str, ops: Ops, record: Record, recording: bool
) -> RunResult:
    """The CPU path: the same step function, run eagerly, fills before each step."""
    import torch

    steps, b = dec.steps, dec.batch
    first = dec.prefill()
    assert dec.first_tokens is not None
    state_diff = check_state(bench, dec, first, record, recording)
    ids = in_table(dec.first_tokens, dec.vocab_rows)
    tokens = np.empty((steps, b), dtype=np.int64)
    step_us: list[float] = []
    mism = np.zeros(steps, dtype=bool)
    for k in range(steps):
        t0 = time.perf_counter()
        ops.arm(k)
        ops.before(k, ids)
        server = bench.served.server
        server.graph_path = bench.cpu_graph_path
        try:
            logits = dec.step()
        finally:
            server.graph_path = False
        ops.after_launch(k)
        tokens[k] = dec.tok.view(-1).numpy()
        ids = in_table(tokens[k], dec.vocab_rows)
        step_us.append((time.perf_counter() - t0) * 1e6)
        if recording:
            record.logits[k].copy_(logits)
        else:
            mism[k] = not torch.equal(bits(logits), bits(record.logits[k]))
    ops.finish()
    ops.close()
    r = RunResult("", b, style, "", steps, step_us, captured=False, tokens=tokens)
    r.state_diff = state_diff
    if recording:
        record.tokens = tokens
    else:
        r.logits_identical = not bool(mism.any())
        r.first_mismatch = int(np.argmax(mism)) if mism.any() else None
        r.tokens_identical = bool(np.array_equal(tokens, record.tokens))
    return r
