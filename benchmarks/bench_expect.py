"""What expected ids move, without a GPU: a Qwen4Exp prefill chunk's rows gathered before
its ids are published (``GatherWorker.begin(expected=...)``) against after.

For a chunk of ``--tokens`` tokens at Qwen4Exp's real hash shape (n-grams of 2 and 3
tokens, 8 heads each: 16 row ids a token, rows of ``--row-bytes``), from one table of
``--table-mib`` in the page cache:

* ``host ids``: :meth:`PrefillExpectations.step` for the chunk, ``--layers`` tables (the
  host time ``expect_prefill`` adds to a prefill step on the engine's thread);
* ``publish -> rows ready``: from the step's ids being published (the host's publish
  standing in for the GPU's) to the step completed, what the GPU waits out at the chunk's
  first PLE layer in the engine; ``READY -> FILLED`` is the worker's own clock from
  seeing the ids (after an early gather still running at the publish, later than it);
  ``published`` is today's eager step (the whole gather after the publish),
  ``expected`` the same step armed with the host's ids (``-1`` for ``--decodes`` decode
  tokens in front of the chunk, gathered at the publish), ``--lead-ms`` after arming (the
  GPU running the step before). Both in turn, ``--rounds`` each; p50 and p90.

Then ``host ids of a decode step``: :meth:`PrefillExpectations.step` for 1, 8 and 64 decode
tokens read from a token history (``expect_decode``: vLLM's ``all_token_ids``, here a
``[1024, 4096]`` int32 array), ``--layers`` tables, ``--decode-calls`` calls each, checked
against the ids of each request's whole sequence: back to back, then (``--call-gap-us``,
0 to skip) each call after that long asleep, as in an engine, where a step's other work
runs between two calls and leaves the caches cold; with ``--contend US`` also while
another Python thread wants the GIL (``US`` microseconds of Python work, then
``--contend-gap-us`` asleep, as vLLM's threads that move requests and results do beside
the engine's).

On this machine's CPUs and page cache, not the H200 host's: it says what moves and by how
much relative to the gather, not the engine's numbers. It prints the table; it asserts
nothing (the rows' bytes are checked, as every benchmark here does).

    python3 benchmarks/bench_expect.py [--tokens 2048] [--decodes 64] [--rounds 30] \
        [--decode-calls 2000] [--call-gap-us 500] [--contend 200]
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

import ple_memops as pm
from ple_memops.vllm.ngram_ids import HostNGramIds
from ple_memops.vllm.prefill import PrefillExpectations

NGRAM, HEADS = 3, 8


def _hash(rows: int, seed: int) -> HostNGramIds:
    rng = np.random.default_rng(seed)
    heads = (NGRAM - 1) * HEADS
    sizes = np.full(heads, rows // heads, dtype=np.int64)
    return HostNGramIds(
        multipliers=(rng.integers(0, 1 << 62, NGRAM, dtype=np.int64) * 2 + 1),
        sizes=sizes,
        offsets=np.arange(heads, dtype=np.int64) * sizes[0],
        eos_token_id=2,
        ngram_size=NGRAM,
        heads_per_ngram=HEADS,
    )


def _p(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--decodes", type=int, default=64)
    ap.add_argument("--row-bytes", type=int, default=256)
    ap.add_argument("--table-mib", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--lead-ms", type=float, default=5.0)
    ap.add_argument("--decode-calls", type=int, default=2000)
    ap.add_argument("--contend", type=float, default=0.0, help="us of Python work a turn")
    ap.add_argument("--contend-gap-us", type=float, default=300.0)
    ap.add_argument("--call-gap-us", type=float, default=0.0)
    args = ap.parse_args()
    h = (NGRAM - 1) * HEADS
    rows = args.table_mib * (1 << 20) // args.row_bytes
    tokens_total = args.decodes + args.tokens
    rng = np.random.default_rng(2)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.safetensors"
        data = rng.integers(0, 256, (rows, args.row_bytes), dtype=np.uint8)
        save_file({"t.weight": data.view(np.float16)}, str(path))
        del data
        table = pm.MmapTable.open(path, "t.weight")
        table.prewarm()
        # Each layer its own multipliers; one step's inputs shared by all (as in Qwen4Exp).
        layers = {f"layer{i}": _hash(rows, i + 1) for i in range(args.layers)}
        exp = PrefillExpectations(layers, h)
        host_us: list[float] = []
        fills: dict[str, list[float]] = {"published": [], "expected": []}
        waits: dict[str, list[float]] = {"published": [], "expected": []}
        max_rows = tokens_total * h
        drows = pm.DeferredRows(max_rows, args.row_bytes, device="cpu")
        with pm.GatherWorker(drows, table) as w:
            for r in range(args.rounds):
                prompt = rng.integers(3, 150_000, args.tokens + 7)
                exp.add(1, prompt)
                # One request decoding (its rows unknown on the host), then the chunk.
                step_rows = np.array([0] * args.decodes + [1])
                computed = np.array([100] * args.decodes + [7])
                scheduled = np.array([1] * args.decodes + [args.tokens])
                prefill_len = np.array([50] * args.decodes + [args.tokens + 7])
                t0 = time.perf_counter_ns()
                expected = exp.step(step_rows, computed, scheduled, prefill_len)
                host_us.append((time.perf_counter_ns() - t0) / 1e3)
                assert expected is not None
                published = expected["layer0"].copy()
                published[: args.decodes * h] = rng.integers(0, rows, args.decodes * h)
                for kind in ("published", "expected") if r % 2 else ("expected", "published"):
                    if kind == "expected":
                        w.begin(max_rows, eager=True, expected=expected["layer0"])
                    else:
                        w.begin(max_rows, eager=True)
                    time.sleep(args.lead_ms / 1e3)  # the GPU runs the step before
                    t1 = time.perf_counter_ns()
                    w.publish_from_host(published)
                    w.complete(timeout=30.0)
                    waits[kind].append((time.perf_counter_ns() - t1) / 1e3)
                    fills[kind].append(w.stats().ready_to_filled_ns_last / 1e3)
                    k = min(64, published.size)
                    np.testing.assert_array_equal(drows.staging[:k], table.gather(published[:k]))
            s = w.stats()
        drows.close()
        table.close()
    print(
        f"{args.tokens}-token chunk after {args.decodes} decode tokens, {h} ids a token, "
        f"{args.row_bytes}-byte rows, a {args.table_mib} MiB table in the page cache, "
        f"{args.rounds} rounds; expected rows gathered early {s.expected_rows_early}, "
        f"late {s.expected_rows_late}, wrong {s.expected_rows_wrong}"
    )
    print()
    print("| what | p50 us | p90 us |")
    print("|---|---|---|")
    print(f"| host ids, {args.layers} tables | {_p(host_us, 50):.0f} | {_p(host_us, 90):.0f} |")
    for kind in fills:
        for what, values in (
            ("publish -> rows ready", waits[kind]),
            ("READY -> FILLED", fills[kind]),
        ):
            print(f"| {what}, {kind} | {_p(values, 50):.0f} | {_p(values, 90):.0f} |")
    _decode_ids(args)


def _decode_ids(args: argparse.Namespace) -> None:
    """The host's ids of a decode step read from a token history, timed and checked."""
    h = (NGRAM - 1) * HEADS
    rng = np.random.default_rng(3)
    layers = {f"layer{i}": _hash(1 << 20, i + 1) for i in range(args.layers)}
    exp = PrefillExpectations(layers, h)
    history = rng.integers(0, 150_000, (1024, 4096)).astype(np.int32)
    history[:, ::97] = 2  # EOS now and then
    print()
    print(f"| host ids of a decode step, {args.layers} tables | p50 us | p90 us |")
    print("|---|---|---|")
    for n in (1, 8, 64):
        rows = rng.permutation(1024)[:n].astype(np.int32)
        positions = rng.integers(0, 4096, n).astype(np.int32)
        prefill = np.minimum(positions, 100).astype(np.int32)
        ones = np.ones(n, dtype=np.int32)

        step = functools.partial(
            exp.step, rows, prefill, ones, prefill, positions=positions, history=history
        )
        got = step()
        assert got is not None
        for name, ids_of in layers.items():  # each token's ids as its whole sequence's last
            for i in range(n):
                seq = history[rows[i], : positions[i] + 1]
                want = ids_of.for_requests([seq], [int(positions[i])], [1])
                np.testing.assert_array_equal(got[name][i * h : (i + 1) * h], want.reshape(-1))
        times = _timed(step, args.decode_calls)
        print(f"| {n} decode tokens | {_p(times, 50):.1f} | {_p(times, 90):.1f} |")
        if args.call_gap_us > 0:
            gap = f"{n} decode tokens, {args.call_gap_us:.0f} us asleep before each"
            times = _timed(step, args.decode_calls, gap_us=args.call_gap_us)
            print(f"| {gap} | {_p(times, 50):.1f} | {_p(times, 90):.1f} |")
            if args.contend > 0:
                with _contender(args.contend, args.contend_gap_us):
                    times = _timed(step, args.decode_calls, gap_us=args.call_gap_us)
                print(
                    f"| {gap}, another thread {args.contend:.0f} us of every "
                    f"{args.contend + args.contend_gap_us:.0f} | {_p(times, 50):.1f} | "
                    f"{_p(times, 90):.1f} |"
                )


def _timed(call: Callable[[], object], calls: int, gap_us: float = 0.0) -> list[float]:
    """Each call's time in us; ``gap_us`` of sleep between calls (the GIL given up)."""
    times = []
    for _ in range(calls):
        if gap_us:
            time.sleep(gap_us / 1e6)
        t0 = time.perf_counter_ns()
        call()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return times


@contextmanager
def _contender(busy_us: float, gap_us: float) -> Iterator[None]:
    """A thread that wants the GIL: ``busy_us`` of Python work (building and encoding
    small dicts, as a serialiser does), then ``gap_us`` asleep, until the block ends."""
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            end = time.perf_counter_ns() + busy_us * 1e3
            while time.perf_counter_ns() < end:
                repr({"id": 1, "tokens": [1, 2, 3], "text": "x"})
            time.sleep(gap_us / 1e6)

    t = threading.Thread(target=run, name="contender", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


if __name__ == "__main__":
    main()
