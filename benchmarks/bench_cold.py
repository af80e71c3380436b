"""Cold tables: gathers from a table whose pages are not in the page cache,
against the storage floor measured in the same run on the same file.

    python benchmarks/bench_cold.py host [--dir DIR] [--gib 2.5] [--zipf] [--json out.json]
    python benchmarks/bench_cold.py overlap [--dir DIR] [--gib 4] [--json out.json]   # GPU

``host`` prints, per batch of 16, 256 and 1024 random rows of 160 B:

* the cold gather time for each ``cold_reads`` way (median over many trials; before each
  trial ``drop_pages()`` evicts the table and ``resident_bytes()`` checks it is cold: trials
  that were not are counted and reported), and the page-cache growth per row;
* the storage floor on the same file: ``fio`` random 4 KiB reads (``--direct=1``,
  io_uring) at queue depth 1, 16 (also 16 submitted and completed together, the way a
  gather issues them) and 64 where fio is installed, and the package's own io_uring probe
  (the same reads, ``O_DIRECT``) in any case;
* the warm gather (rows read before), and the warm 4096-row gather against the memory
  latency floor (a dependent pointer chase over 1 GiB: one cache-line miss per hop);
* with ``--zipf``: hit rate and page-cache footprint under ``rss_budget_bytes`` for
  Zipf-distributed ids (numpy's ``zipf``, several exponents), next to the best static
  cache of the same size and the old drop-everything policy (both computed offline).

``overlap`` (needs a CUDA GPU) measures how much of a cold step's read time the deferred
path hides behind GPU work: host-known ids (``DeferredRows.fill_from`` right after
``graph.replay()``) and device-produced ids (``GatherWorker``), against a prefilled
baseline and a synchronous variant (gather before the launch), the table evicted before
every step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import ple_memops as pm
from ple_memops import _native

NAME = "ple.weight"
ROW_BYTES = 160  # Qwen4Exp FP8 rows (stored here as 80 F16 columns: the same bytes)
WAYS = ("uring", "willneed", "pool", "fault")


# -- the table file ----------------------------------------------------------------------


def make_table(directory: Path, gib: float, seed: int = 0) -> Path:
    """A safetensors file of ``gib`` GiB of random 160 B rows, written by the safetensors
    package and synced (reused when present with the same size)."""
    from safetensors.numpy import save_file

    rows = int(gib * (1 << 30)) // ROW_BYTES
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"cold_{rows}.safetensors"
    if path.exists():
        with pm.MmapTable.open(path, NAME) as t:
            if t.rows == rows:
                return path
    t0 = time.perf_counter()
    data = np.empty((rows, ROW_BYTES // 2), np.float16)
    flat = data.reshape(-1).view(np.uint64)
    rng = np.random.default_rng(seed)
    chunk = 32 << 20
    for lo in range(0, flat.size, chunk):
        hi = min(flat.size, lo + chunk)
        flat[lo:hi] = rng.integers(0, np.iinfo(np.int64).max, hi - lo, dtype=np.int64).view(
            np.uint64
        )
    save_file({NAME: data}, str(path))
    del data, flat
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # only clean pages can be evicted
    finally:
        os.close(fd)
    print(f"wrote {path} ({rows} rows, {gib} GiB) in {time.perf_counter() - t0:.1f} s")
    return path


def rows_of(path: Path) -> tuple[int, int]:
    """(rows, byte offset of row 0) of the table file."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
    with pm.MmapTable.open(path, NAME) as t:
        return t.rows, 8 + n


def check_rows(path: Path, data_start: int, ids: Any, got: Any) -> None:
    """Compare gathered rows with the file read by ``os.pread`` (not through a mapping:
    mapped pages could not be evicted for the next trial)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        for i in range(0, len(ids), max(1, len(ids) // 16)):
            want = os.pread(fd, ROW_BYTES, data_start + int(ids[i]) * ROW_BYTES)
            if bytes(got[i]) != want:
                raise AssertionError(f"row {int(ids[i])} (position {i}) differs from the file")
    finally:
        os.close(fd)


# -- the storage floor -------------------------------------------------------------------


def fio_floor(path: Path, depth: int, batch: bool, secs: float) -> dict[str, float] | None:
    fio = shutil.which("fio")
    if fio is None:
        return None
    cmd = [
        fio,
        "--name=floor",
        f"--filename={path}",
        "--rw=randread",
        "--bs=4k",
        "--direct=1",
        "--ioengine=io_uring",
        f"--iodepth={depth}",
        f"--runtime={secs}",
        "--time_based",
        "--norandommap",
        "--randrepeat=0",
        "--output-format=json",
    ]
    if batch:
        cmd += [f"--iodepth_batch_submit={depth}", f"--iodepth_batch_complete_min={depth}"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=secs + 30, check=True)
        read = json.loads(out.stdout)["jobs"][0]["read"]
    except (subprocess.SubprocessError, KeyError, ValueError) as e:
        print(f"fio failed ({e}); using the package's probe only")
        return None
    return {"iops": float(read["iops"]), "clat_us": float(read["clat_ns"]["mean"]) / 1e3}


def reads_together_us(path: Path, n: int, trials: int = 30) -> float:
    """The median time of ``n`` random 4 KiB ``O_DIRECT`` reads of ``path`` submitted
    together, in us (the floor of a gather of ``n`` cold rows)."""
    return statistics.median(_native._bench_read_batches(str(path), n, trials, True, n)) * 1e6


def probe_floor(path: Path, quick: bool) -> dict[str, Any]:
    """The package's io_uring probe: O_DIRECT random 4 KiB reads (buffered reads of an
    evicted file where O_DIRECT is refused)."""
    direct = True
    try:
        _native._bench_read_batches(str(path), 1, 2, True)
    except pm.TableIoError as e:
        print(f"O_DIRECT refused ({e}); the probe reads through the page cache, evicted")
        direct = False
    k = 2 if quick else 1
    r: dict[str, Any] = {"direct": direct}
    for depth, batches in ((1, 300 // k), (16, 200 // k), (64, 60 // k)):
        t = _native._bench_read_batches(str(path), depth, batches, direct, depth)
        r[f"batch{depth}_us"] = statistics.median(t) * 1e6
    for depth, reads in ((16, 20000 // k), (64, 40000 // k)):
        secs = _native._bench_read_sustained(str(path), depth, reads, direct, 100 + depth)
        r[f"iops{depth}"] = reads / secs
    return r


# -- cold and warm gathers ---------------------------------------------------------------


def cold_trials(
    table: pm.MmapTable,
    path: Path,
    data_start: int,
    n: int,
    trials: int,
    rng: np.random.Generator,
    direct: bool,
) -> dict[str, Any]:
    """``trials`` cold gathers of ``n`` random rows, each paired with the floor measured
    under the same conditions: ``n`` random 4 KiB reads of the file submitted together
    right after the same eviction (this VM's disk answers a burst after an idle spell
    markedly slower than back-to-back: 16 reads took 205 us back to back, 365 us after
    10 ms idle). The order within a pair alternates."""
    out = np.empty((n, ROW_BYTES), np.uint8)
    times, floors, growth, not_cold, worst = [], [], [], 0, 0
    for k in range(trials):
        for what in ("gather", "floor") if k % 2 else ("floor", "gather"):
            table.drop_pages()
            before = table.resident_bytes()
            if what == "floor":
                floors.append(_native._bench_read_batches(str(path), n, 1, direct, k)[0] * 1e6)
                continue
            if before > 0:
                not_cold += 1
                worst = max(worst, before)
            ids = rng.integers(0, table.rows, n, dtype=np.int64)
            t0 = time.perf_counter_ns()
            table.gather_into(ids, out)
            times.append((time.perf_counter_ns() - t0) / 1e3)
            growth.append((table.resident_bytes() - before) / 4096 / n)
            check_rows(path, data_start, ids, out)
    return {
        "median_us": statistics.median(times),
        "p90_us": float(np.percentile(times, 90)),
        "min_us": min(times),
        "floor_median_us": statistics.median(floors),
        "pages_per_row": statistics.median(growth),
        "trials": trials,
        "not_cold": not_cold,
        "worst_resident_bytes": worst,
    }


def busy_trials(
    table: pm.MmapTable, n: int, trials: int, rng: np.random.Generator
) -> dict[str, Any]:
    """``trials`` gathers of fresh random rows back to back, evicted once before the first
    (the device stays busy, as under a steady load); page-cache growth over all of them
    shows they were cold (a fresh random row of a large table is almost never cached)."""
    out = np.empty((n, ROW_BYTES), np.uint8)
    sets = [rng.integers(0, table.rows, n, dtype=np.int64) for _ in range(trials)]
    table.drop_pages()
    before = table.resident_bytes()
    times = []
    for ids in sets:
        t0 = time.perf_counter_ns()
        table.gather_into(ids, out)
        times.append((time.perf_counter_ns() - t0) / 1e3)
    grown = (table.resident_bytes() - before) / 4096
    return {
        "median_us": statistics.median(times),
        "p90_us": float(np.percentile(times, 90)),
        "pages_per_row": grown / (n * trials),
        "trials": trials,
    }


def warm_gathers(
    table: pm.MmapTable, n: int, reps: int, rng: np.random.Generator
) -> dict[str, float]:
    sets = [rng.integers(0, table.rows, n, dtype=np.int64) for _ in range(16)]
    out = np.empty((n, ROW_BYTES), np.uint8)
    for ids in sets:  # read once: their pages are now known resident
        table.gather_into(ids, out)
    misses = table.page_stats()["row_misses"]
    ns = np.empty(reps, np.int64)
    clock = time.perf_counter_ns
    for i in range(reps):
        ids = sets[i % 16]
        t0 = clock()
        table.gather_into(ids, out)
        ns[i] = clock() - t0
    assert table.page_stats()["row_misses"] == misses, "a warm gather read"
    return {"median_us": float(np.median(ns)) / 1e3, "p99_us": float(np.percentile(ns, 99)) / 1e3}


# -- Zipf streams under an RSS budget ------------------------------------------------------


def zipf_stream(
    a: float, rows: int, steps: int, per_step: int, seed: int
) -> list[np.ndarray[Any, Any]]:
    """Row ids of ``steps`` gathers: Zipf ranks (numpy's ``zipf(a)``, ranks beyond the table
    redrawn) scattered over the table by a fixed bijection (hot rows are not neighbours)."""
    rng = np.random.default_rng(seed)
    mult = 2654435761  # odd and prime: rank -> (rank * mult + 12345) % rows is a bijection
    while np.gcd(mult, rows) != 1:
        mult += 2
    out = []
    for _ in range(steps):
        r = rng.zipf(a, per_step)
        while (bad := r > rows).any():
            r[bad] = rng.zipf(a, int(bad.sum()))
        out.append(((r - 1).astype(np.int64) * mult + 12345) % rows)
    return out


def pages_of(ids: np.ndarray[Any, Any], data_start: int) -> np.ndarray[Any, Any]:
    first = (data_start + ids * ROW_BYTES) // 4096
    last = (data_start + ids * ROW_BYTES + ROW_BYTES - 1) // 4096
    return np.concatenate([first, last[last != first]])


def offline_policies(
    stream: list[np.ndarray[Any, Any]], data_start: int, budget_pages: int
) -> dict[str, float]:
    """Row hit rates of two reference policies on the same stream: the best static cache
    (the ``budget_pages`` most used pages, known in advance, each read once on first use)
    and the drop-everything policy (read pages accumulate; over budget, drop all)."""
    all_pages = np.concatenate([pages_of(s, data_start) for s in stream])
    uniq, counts = np.unique(all_pages, return_counts=True)
    top = set(uniq[np.argsort(counts)[::-1][:budget_pages]].tolist())
    hits_static = hits_drop = total = 0
    cached: set[int] = set()
    seen: set[int] = set()
    for s in stream:
        first = ((data_start + s * ROW_BYTES) // 4096).tolist()
        last = ((data_start + s * ROW_BYTES + ROW_BYTES - 1) // 4096).tolist()
        for p, q in zip(first, last, strict=True):
            total += 1
            hits_static += p in top and q in top and p in seen and q in seen
            hits_drop += p in cached and q in cached
        seen.update(first)
        seen.update(last)
        cached.update(first)
        cached.update(last)
        if len(cached) > budget_pages:
            cached.clear()
    return {"static_best": hits_static / total, "drop_all": hits_drop / total}


def zipf_section(path: Path, data_start: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = rows_of(path)[0]
    results = []
    out = np.empty((args.zipf_batch, ROW_BYTES), np.uint8)
    for a in args.zipf_a:
        stream = zipf_stream(a, rows, args.zipf_steps, args.zipf_batch, seed=int(a * 100))
        for budget_mib in [*args.zipf_budget_mib, None]:
            budget = None if budget_mib is None else int(budget_mib) << 20
            with pm.MmapTable.open(path, NAME, rss_budget_bytes=budget) as t:
                t.drop_pages()
                times = []
                s0 = t.page_stats()
                for ids in stream:
                    t0 = time.perf_counter_ns()
                    t.gather_into(ids, out)
                    times.append((time.perf_counter_ns() - t0) / 1e3)
                s = t.page_stats()
                hits = s["row_hits"] - s0["row_hits"]
                misses = s["row_misses"] - s0["row_misses"]
                r: dict[str, Any] = {
                    "a": a,
                    "budget_mib": budget_mib,
                    "hit_rate": hits / max(1, hits + misses),
                    "resident_mib": t.resident_bytes() / 2**20,
                    "known_mib": s["touched_bytes"] / 2**20,
                    "evicted_pages": s["pages_evicted"],
                    "gather_median_us": statistics.median(times),
                    "gather_p99_us": float(np.percentile(times, 99)),
                }
                # Warm-steady part: the second half of the stream.
                half = times[len(times) // 2 :]
                r["gather_median_us_2nd_half"] = statistics.median(half)
                if budget is not None:
                    r.update(offline_policies(stream, data_start, budget // 4096))
                t.drop_pages()
            results.append(r)
            print(
                f"  a={a:<5} budget {('none' if budget_mib is None else f'{budget_mib} MiB'):>9}:"
                f" hit rate {r['hit_rate']:.3f}"
                + (
                    f" (best static {r['static_best']:.3f}, drop-all {r['drop_all']:.3f})"
                    if "static_best" in r
                    else ""
                )
                + f", page cache {r['resident_mib']:.1f} MiB, gather median"
                f" {r['gather_median_us']:.0f} us (p99 {r['gather_p99_us']:.0f})"
            )
    return results


# -- host mode ---------------------------------------------------------------------------


def host(args: argparse.Namespace) -> dict[str, Any]:
    directory = Path(args.dir)
    path = make_table(directory, args.gib)
    rows, data_start = rows_of(path)
    res: dict[str, Any] = {"path": str(path), "rows": rows, "gib": args.gib}
    t_def = pm.MmapTable.open(path, NAME)
    print(
        f"table: {rows} rows x {ROW_BYTES} B ({args.gib} GiB) in {path};"
        f" cold_reads='auto' -> {t_def.cold_reads!r}"
        + (f" ({t_def.cold_reads_reason})" if t_def.cold_reads_reason else "")
    )
    res["auto"] = t_def.cold_reads

    print("\n== storage floor (random 4 KiB reads of the same file)")
    fio = {}
    for depth, batch in ((1, False), (16, False), (16, True), (64, False)):
        f = None if args.no_fio else fio_floor(path, depth, batch, 2.0 if args.quick else 4.0)
        if f is not None:
            fio[f"{'batch' if batch else 'qd'}{depth}"] = f
    probe = probe_floor(path, args.quick)
    res["fio"], res["probe"] = fio, probe
    if fio:
        print(
            "fio (io_uring, --direct=1): "
            + ", ".join(
                f"{k}: {v['iops']:.0f} IOPS, clat {v['clat_us']:.1f} us" for k, v in fio.items()
            )
        )
    else:
        print("fio: not installed (apt-get install fio); the probe alone")
    print(
        f"probe (io_uring, {'O_DIRECT' if probe['direct'] else 'buffered, evicted'}):"
        f" 1 read {probe['batch1_us']:.1f} us; 16 together {probe['batch16_us']:.1f} us;"
        f" 64 together {probe['batch64_us']:.1f} us;"
        f" sustained QD16 {probe['iops16']:.0f} IOPS, QD64 {probe['iops64']:.0f} IOPS"
    )
    floor16 = probe["batch16_us"]
    fio16 = 16 / fio["batch16"]["iops"] * 1e6 if "batch16" in fio else None
    iops64 = fio["qd64"]["iops"] if "qd64" in fio else probe["iops64"]

    print("\n== cold gathers (table evicted before each; median over trials)")
    rng = np.random.default_rng(1)
    trials = {16: 40, 256: 20, 1024: 12}
    if args.quick:
        trials = {16: 15, 256: 8, 1024: 5}
    cold: dict[str, dict[str, Any]] = {}
    ways: dict[str, dict[str, Any]] = {w: {"cold_reads": w} for w in WAYS}
    if t_def.cold_reads != "uring":
        del ways["uring"]
    # For reference, the former defaults ("old"): the kernel's read-around with one fault at
    # a time (access="normal", cold_reads="fault") and MADV_WILLNEED per row (what
    # readahead=True asked for: cold_reads="willneed").
    ways["old default"] = {"access": "normal", "cold_reads": "fault"}
    ways["old readahead=True"] = {"access": "normal", "cold_reads": "willneed"}
    # One table open at a time: a page another mapping holds cannot be evicted.
    t_def.close()
    print(
        f"{'rows':>5} {'way':<19} {'median us':>10} {'p90 us':>9} {'min us':>9}"
        f" {'pages/row':>9} {'not cold':>9} {'floor us':>9}  vs floor"
    )
    for n in (16, 256, 1024):
        for way, opts in ways.items():
            k = trials[n]
            if way.startswith("old"):
                if n == 1024 or (way == "old default" and n > 16):
                    continue
                k = 3
            with pm.MmapTable.open(path, NAME, **opts) as t:
                r = cold_trials(t, path, data_start, n, k, rng, probe["direct"])
                t.drop_pages()
            cold[f"{way}/{n}"] = r
            ratio = r["median_us"] / r["floor_median_us"]
            if n == 16:
                vs = f"{ratio:.2f}x the paired floor; {r['median_us'] / floor16:.2f}x back-to-back"
                if fio16 is not None:
                    vs += f", {r['median_us'] / fio16:.2f}x fio's"
            else:
                rate = n / (r["median_us"] / 1e6)
                vs = (
                    f"{ratio:.2f}x the paired floor; {rate:.0f} rows/s ="
                    f" {rate / iops64:.0%} of QD64 IOPS"
                )
            print(
                f"{n:>5} {way:<19} {r['median_us']:>10.0f} {r['p90_us']:>9.0f}"
                f" {r['min_us']:>9.0f} {r['pages_per_row']:>9.2f}"
                f" {r['not_cold']:>4}/{r['trials']:<4} {r['floor_median_us']:>9.0f}  {vs}"
            )
    res["cold"] = cold

    print(
        "\n== cold gathers back to back (evicted once, then fresh random rows each time;"
        " floor: the probe's back-to-back batches / sustained QD64)"
    )
    busy: dict[str, dict[str, Any]] = {}
    print(f"{'rows':>5} {'way':<10} {'median us':>10} {'p90 us':>9} {'pages/row':>9}  vs floor")
    for n in (16, 256, 1024):
        for way in [w for w in WAYS if w in ways]:
            with pm.MmapTable.open(path, NAME, cold_reads=way) as t:
                r = busy_trials(t, n, trials[n] * 2, rng)
                t.drop_pages()
            busy[f"{way}/{n}"] = r
            if n == 16:
                vs = f"{r['median_us'] / floor16:.2f}x 16 reads together"
            else:
                rate = n / (r["median_us"] / 1e6)
                vs = f"{rate:.0f} rows/s = {rate / iops64:.0%} of QD64 IOPS"
            print(
                f"{n:>5} {way:<10} {r['median_us']:>10.0f} {r['p90_us']:>9.0f}"
                f" {r['pages_per_row']:>9.2f}  {vs}"
            )
    res["busy"] = busy
    t_def = pm.MmapTable.open(path, NAME)

    print("\n== warm gathers (rows read before: their pages known resident), from Python")
    lat = _native._bench_memory_latency_ns(1 << 30, 2_000_000 if args.quick else 5_000_000)
    res["memory_latency_ns"] = lat
    warm = {}
    t_def.drop_pages()
    for n in (16, 256, 1024, 4096):
        w = warm_gathers(t_def, n, 600 if args.quick else 2000, rng)
        warm[n] = w
        extra = ""
        if n == 4096:
            extra = (
                f"   = {w['median_us'] * 1e3 / n:.1f} ns a row; memory-latency floor"
                f" {lat:.1f} ns a dependent miss -> {n * lat / 1e3:.0f} us for {n} rows"
                f" ({w['median_us'] * 1e3 / (n * lat):.2f}x)"
            )
        print(f"{n:>5} rows: median {w['median_us']:.2f} us, p99 {w['p99_us']:.2f} us{extra}")
    res["warm"] = warm
    t_def.drop_pages()
    t_def.close()

    if args.zipf:
        print(
            f"\n== Zipf ids under rss_budget_bytes ({args.zipf_steps} gathers of"
            f" {args.zipf_batch} rows; hit rate = rows served without a read)"
        )
        res["zipf"] = zipf_section(path, data_start, args)
    return res


# -- overlap mode (GPU) ------------------------------------------------------------------


def sleep_cycles_for(us: float) -> int:
    """Calibrate torch.cuda._sleep to about ``us`` microseconds."""
    import torch

    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 100_000
    for _ in range(4):
        e0.record()
        torch.cuda._sleep(cycles)
        e1.record()
        e1.synchronize()
        took = e0.elapsed_time(e1) * 1e3
        cycles = max(1000, int(cycles * us / max(took, 1.0)))
    return cycles


def wait_event(event: Any, timeout: float = 60.0) -> None:
    """Poll a CUDA event (a stuck wait must fail the run, not hang it)."""
    t0 = time.monotonic()
    while not event.query():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"GPU work not done after {timeout} s")
        time.sleep(0.0002)


class Cold:
    """Evict the table before a step and count steps that were not fully cold."""

    def __init__(self, table: pm.MmapTable) -> None:
        self.table, self.not_cold = table, 0

    def __call__(self) -> None:
        self.table.drop_pages()
        if self.table.resident_bytes() != 0:
            self.not_cold += 1


def host_known_case(
    table: pm.MmapTable, n: int, cycles: int, steps: int, rng: np.random.Generator, cold: Cold
) -> dict[str, list[float]]:
    """Graph = ~work of GPU time, then the consumer. Per step, in a random order: the host
    fills right after the launch (deferred), before it (sync), or before it with rows
    gathered earlier (prefilled: no I/O in the step)."""
    import torch

    out: dict[str, list[float]] = {}
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    with pm.DeferredRows(n, ROW_BYTES, device=0, watchdog=10.0) as rows:
        sink = torch.zeros_like(rows.staging)

        def body() -> None:
            torch.cuda._sleep(cycles)  # the layers before the first consumer
            rows.enqueue(rows=n)
            sink.copy_(rows.staging)

        rows.begin(n)
        rows.prepare_dummy()  # eager warm-up: pre-signalled before the enqueue
        body()
        rows.complete()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            body()
        for i in range(steps + 3):
            for mode in rng.permutation(["deferred", "sync", "prefilled"]):
                ids = rng.integers(0, table.rows, n, dtype=np.int64)
                if mode == "prefilled":
                    table.gather(ids)  # warm these rows: the no-I/O baseline
                else:
                    cold()
                torch.cuda.synchronize()
                t0 = time.perf_counter_ns()
                rows.begin(n)
                if mode != "deferred":
                    rows.fill_from(table, ids, busy_wait=5.0)
                ev[0].record()
                g.replay()
                ev[1].record()
                if mode == "deferred":
                    rows.fill_from(table, ids, busy_wait=5.0)
                rows.complete()
                wait_event(ev[1])
                wall = (time.perf_counter_ns() - t0) / 1e3
                if i >= 3:
                    out.setdefault(f"{mode} wall", []).append(wall)
                    out.setdefault(f"{mode} gpu", []).append(ev[0].elapsed_time(ev[1]) * 1e3)
                if not np.array_equal(sink[:n].cpu().numpy(), table.gather(ids)):
                    raise AssertionError(f"{mode}: the consumer read rows unlike the table's")
    return out


def device_ids_case(
    table: pm.MmapTable, n: int, cycles: int, steps: int, cold: Cold
) -> dict[str, list[float]]:
    """Graph = ids computed by kernels at the top of the step and published, ~work of GPU
    time, then the consumer; the worker gathers (cold) meanwhile."""
    import torch

    out: dict[str, list[float]] = {}
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    rows = pm.DeferredRows(n, ROW_BYTES, device=0, watchdog=10.0)
    worker = pm.GatherWorker(rows, table)
    try:
        counter = torch.zeros(1, dtype=torch.int64, device="cuda")
        lanes = torch.arange(n, dtype=torch.int64, device="cuda")
        ids = torch.zeros(n, dtype=torch.int64, device="cuda")
        sink = torch.zeros_like(rows.staging)
        total = table.rows

        def body() -> None:
            counter.add_(1)
            ids.copy_((counter * 7919 + lanes * 104729 + counter * lanes * 31) % total)
            worker.publish(ids)
            torch.cuda._sleep(cycles)
            rows.enqueue(rows=n)
            sink.copy_(rows.staging)

        worker.begin(n)
        body()
        worker.complete(timeout=30.0)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            body()
        for i in range(steps + 3):
            cold()
            torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            worker.begin(n)
            ev[0].record()
            g.replay()
            ev[1].record()
            worker.complete(timeout=30.0)
            wait_event(ev[1])
            wall = (time.perf_counter_ns() - t0) / 1e3
            if i >= 3:
                out.setdefault("worker wall", []).append(wall)
                out.setdefault("worker gpu", []).append(ev[0].elapsed_time(ev[1]) * 1e3)
                out.setdefault("worker fill", []).append(
                    worker.stats().ready_to_filled_ns_last / 1e3
                )
        got, want = sink[:n].cpu().numpy(), table.gather(ids.cpu().numpy())
        if not np.array_equal(got, want):
            raise AssertionError("the consumer read rows that differ from the table")
    finally:
        worker.close()
        rows.close()
    return out


def cpu_check(table: pm.MmapTable, n: int, cold: Cold) -> None:
    """Without a GPU: the same host-side calls in host mode (catches API misuse early)."""
    rng = np.random.default_rng(0)
    with pm.DeferredRows(n, ROW_BYTES, device=None) as rows:
        for _ in range(3):
            ids = rng.integers(0, table.rows, n, dtype=np.int64)
            cold()
            rows.begin(n)
            rows.fill_from(table, ids, busy_wait=5.0)
            rows.complete()
            if not np.array_equal(np.asarray(rows.staging[:n]), table.gather(ids)):
                raise AssertionError("host-mode fill_from differs")
    rows2 = pm.DeferredRows(n, ROW_BYTES, device=None)
    worker = pm.GatherWorker(rows2, table)
    try:
        for _ in range(3):
            ids = rng.integers(0, table.rows, n, dtype=np.int64)
            cold()
            worker.begin(n)
            worker.publish_from_host(ids)
            worker.complete(timeout=30.0)
            if not np.array_equal(np.asarray(rows2.staging[:n]), table.gather(ids)):
                raise AssertionError("host-mode worker fill differs")
    finally:
        worker.close()
        rows2.close()


def overlap(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    path = make_table(Path(args.dir), args.gib)
    table = pm.MmapTable.open(path, NAME)
    cold = Cold(table)
    res: dict[str, Any] = {"rows": table.rows, "cold_reads": table.cold_reads}
    print(f"table: {table.rows} rows x {ROW_BYTES} B, cold_reads={table.cold_reads!r}")
    if not torch.cuda.is_available():
        for n in args.rows:
            cpu_check(table, n, cold)
        print("no CUDA device: the host-side calls were checked in host mode; nothing timed")
        table.close()
        return res
    torch.cuda.init()
    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    rng = np.random.default_rng(7)
    for work_us in args.work_us:
        cycles = sleep_cycles_for(work_us)
        for n in args.rows:
            cold.not_cold = 0
            r = host_known_case(table, n, cycles, args.steps, rng, cold)
            r.update(device_ids_case(table, n, cycles, args.steps, cold))
            o = np.empty((n, ROW_BYTES), np.uint8)
            for _ in range(args.steps):  # the cold gather alone: what there is to hide
                cold()
                ids = rng.integers(0, table.rows, n, dtype=np.int64)
                t0 = time.perf_counter_ns()
                table.gather_into(ids, o)
                r.setdefault("cold gather", []).append((time.perf_counter_ns() - t0) / 1e3)
            med: dict[str, float] = {k: statistics.median(v) for k, v in r.items()}
            med["not_cold"] = cold.not_cold
            res[f"{n}/{work_us:g}us"] = med
            read, base = med["cold gather"], med["prefilled gpu"]

            def hidden(gpu: float, read: float = read, base: float = base) -> str:
                stall = max(0.0, gpu - base)
                frac = 1 - min(stall, read) / read
                return f"GPU {gpu:8.0f} us, stall {stall:6.0f} us: {frac:4.0%} of the read hidden"

            print(
                f"\n{n} rows, ~{work_us:g} us of GPU work before the consumer: cold gather alone"
                f" {read:.0f} us; prefilled graph {base:.0f} us of GPU time"
                + (f"; {cold.not_cold} steps not fully cold" if cold.not_cold else "")
            )
            print(f"  host-known ids, fill after launch: {hidden(med['deferred gpu'])}")
            print(
                f"  device-produced ids (worker):      {hidden(med['worker gpu'])};"
                f" READY->FILLED {med['worker fill']:.0f} us"
            )
            print(
                f"  sync (gather, then launch): GPU {med['sync gpu']:.0f} us, host wall"
                f" {med['sync wall']:.0f} us; deferred wall {med['deferred wall']:.0f} us;"
                f" prefilled wall {med['prefilled wall']:.0f} us"
            )
    table.close()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    sub = ap.add_subparsers(dest="mode", required=True)
    for name in ("host", "overlap"):
        p = sub.add_parser(name)
        p.add_argument(
            "--dir", default=None, help="where the table file goes (default: a temp dir)"
        )
        p.add_argument("--gib", type=float, default=2.5 if name == "host" else 4.0)
        p.add_argument("--json", default=None)
        p.add_argument("--keep", action="store_true", help="keep the table file")
    h = sub.choices["host"]
    h.add_argument("--no-fio", action="store_true")
    h.add_argument("--quick", action="store_true", help="fewer trials")
    h.add_argument("--zipf", action="store_true")
    h.add_argument("--zipf-a", type=float, nargs="+", default=[1.05, 1.2, 1.5])
    h.add_argument("--zipf-budget-mib", type=int, nargs="+", default=[16, 64, 256])
    h.add_argument("--zipf-steps", type=int, default=1500)
    h.add_argument("--zipf-batch", type=int, default=256)
    o = sub.choices["overlap"]
    o.add_argument("--rows", type=int, nargs="+", default=[16, 1024])
    o.add_argument("--work-us", type=float, nargs="+", default=[500.0, 2000.0])
    o.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    tmp = None
    if args.dir is None:
        tmp = tempfile.mkdtemp(prefix="ple-cold-", dir=os.environ.get("TMPDIR", "/var/tmp"))
        args.dir = tmp
    try:
        res = host(args) if args.mode == "host" else overlap(args)
    finally:
        if tmp is not None and not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
