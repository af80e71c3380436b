"""Host memory for one PLE table as the processes that serve it are added, without a GPU.

``N`` processes each open the same table file and read every row of it, then hold it
while the memory is counted:

* ``mmap``: each opens it with :class:`ple_memops.MmapTable` (what the mmap backend does
  in every server) and gathers every row into one small buffer of its own; the rows stay
  in the page cache, which every process shares;
* ``copy``: each reads the whole table into memory of its own, as a vLLM server's pinned
  UVA table is one copy a server (pinned where ``--pinned`` and CUDA are there, else
  anonymous memory, which counts the same: private, one copy a process), then drops the
  file's pages, which it no longer needs (the kernel would, under pressure).

Counted while all ``N`` hold: the table file's pages in the page cache (``mincore``, one
count for every process), each process's private memory grown since before it opened
the table (``RssAnon`` of ``/proc/PID/status``), and the table's host memory, the two
together, against one copy of the table. ``RssFile`` is shown too: it counts the shared
pages once per process that maps them, so summing it over servers overstates.

    python benchmarks/bench_shared_table.py [--table-gib 1] [--processes 1,2,4]
        [--backends mmap,copy] [--repeats 2] [--pinned] [--json PATH]

The file's pages are dropped from the page cache (``POSIX_FADV_DONTNEED``) before each
configuration, so each starts cold. It prints the table; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from residency import resident_bytes
from vllm_probes import evict, host_rss

NAME = "model.layers.0.per_layer_table.weight"
ROW_BYTES = 512
CHUNK_ROWS = 2048  # one gather: 1 MiB at 512 B a row


def _rss(pid: int) -> dict[str, int]:
    """Bytes of ``RssAnon``, ``RssFile`` and ``RssShmem`` of process ``pid``."""
    return {k: round(v * 2**30) for k, v in host_rss([pid]).items()}


def write_table(path: Path, table_bytes: int) -> int:
    """A safetensors file of one ``[rows, ROW_BYTES / 2]`` F16 table of about
    ``table_bytes``, written in pieces (the writer holds at most 64 MiB); returns its rows."""
    rows = max(1, table_bytes // ROW_BYTES)
    header = json.dumps(
        {
            NAME: {
                "dtype": "F16",
                "shape": [rows, ROW_BYTES // 2],
                "data_offsets": [0, rows * ROW_BYTES],
            }
        }
    ).encode()
    header += b" " * (-len(header) % 8)
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        left = rows * ROW_BYTES
        while left:
            n = min(left, 64 << 20)
            f.write(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
            left -= n
    return rows


def _serve(path: str, backend: str, pinned: bool, conn: Any) -> None:
    """One process serving the table: read every row, report, hold until told to exit."""
    if backend == "mmap":
        import ple_memops as pm
    elif pinned:
        import torch
    before = _rss(os.getpid())  # after the imports: the table's own memory only
    if backend == "mmap":
        table = pm.MmapTable.open(path, NAME)
        out = np.empty((CHUNK_ROWS, table.row_bytes), dtype=np.uint8)
        for start in range(0, table.rows, CHUNK_ROWS):
            ids = np.arange(start, min(start + CHUNK_ROWS, table.rows), dtype=np.int64)
            table.gather_into(ids, out[: len(ids)])
        held: Any = (table, out)
    else:
        with open(path, "rb") as f:
            offset = 8 + int.from_bytes(f.read(8), "little")
            size = os.fstat(f.fileno()).st_size - offset
            f.seek(offset)
            buf: Any = (
                torch.empty(size, dtype=torch.uint8, pin_memory=True)
                if pinned
                else np.empty(size, dtype=np.uint8)
            )
            view = memoryview(buf.numpy() if pinned else buf).cast("B")
            got = 0
            while got < size:
                got += f.readinto(view[got:]) or 0
            # The copy no longer needs the file: its pages go, as they would under pressure.
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        held = buf
    after = _rss(os.getpid())
    conn.send({k: after[k] - before.get(k, 0) for k in after} | {"pid": os.getpid()})
    conn.recv()  # hold until the parent has counted
    del held


def measure(path: Path, table_bytes: int, backend: str, n: int, pinned: bool) -> dict[str, Any]:
    """``n`` processes of ``backend`` holding the table at once: what the host holds."""
    evict([path])
    time.sleep(0.2)
    cold = resident_bytes(path)
    if cold > table_bytes // 2:
        raise RuntimeError(
            f"{path}: {cold} bytes stay in the page cache after dropping them (a tmpfs?); "
            "put the table on a disk-backed file system (--dir)"
        )
    ctx = mp.get_context("spawn")
    procs, conns, grown = [], [], []
    try:
        for _ in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(str(path), backend, pinned, child))
            p.start()
            procs.append(p)
            conns.append(parent)
        for c in conns:
            if not c.poll(600):
                raise TimeoutError(f"a {backend} process did not report within 600 s")
            grown.append(c.recv())
        cache = resident_bytes(path) - cold
        status = [_rss(g["pid"]) for g in grown]
    finally:
        for c in conns:
            try:
                c.send("exit")
            except OSError:
                pass
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    anon = sum(g["anon"] + g["shmem"] for g in grown)
    return {
        "backend": backend,
        "processes": n,
        "page_cache_bytes": cache,
        "private_bytes": anon,
        "host_bytes": cache + anon,
        "copies": (cache + anon) / table_bytes,
        "rss_file_bytes_summed": sum(s["file"] for s in status),
    }


def _span(runs: list[dict[str, Any]], key: str, scale: float, fmt: str) -> str:
    """``key`` over ``runs`` (its repeats) as one value where they agree, else lo-hi."""
    vals = [x[key] / scale for x in runs]
    lo, hi = f"{min(vals):{fmt}}", f"{max(vals):{fmt}}"
    return lo if lo == hi else f"{lo}-{hi}"


def report(
    runs: list[dict[str, Any]],
    backends: list[str],
    counts: list[int],
    table_bytes: int,
    rows: int,
    repeats: int,
) -> str:
    """The table of :func:`main`, each cell over the configuration's repeats."""
    gib, mib = float(1 << 30), float(1 << 20)
    lines = [
        f"host memory for one {table_bytes / gib:.2f} GiB table ({rows:,} rows of {ROW_BYTES} "
        f"B) as processes serving it are added; {repeats} repeats, interleaved",
        "",
        "| backend | processes | page cache GiB | private MiB | host GiB | copies of the table "
        "| RssFile summed GiB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    medians = []
    for b in backends:
        for n in counts:
            got = [x for x in runs if x["backend"] == b and x["processes"] == n]
            cells = [
                _span(got, "page_cache_bytes", gib, ".2f"),
                _span(got, "private_bytes", mib, ".0f"),
                _span(got, "host_bytes", gib, ".2f"),
                _span(got, "copies", 1.0, ".3f"),
                _span(got, "rss_file_bytes_summed", gib, ".2f"),
            ]
            lines.append(f"| {b} | {n} | " + " | ".join(cells) + " |")
            medians.append(f"{b} x{n} {statistics.median(x['copies'] for x in got):.3f}")
    lines += ["", "copies of the table, median: " + ", ".join(medians)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--table-gib", type=float, default=1.0, help="the table's size")
    p.add_argument("--processes", default="1,2,4", help="servers of the table, comma-separated")
    p.add_argument("--backends", default="mmap,copy", help="mmap and/or copy")
    p.add_argument("--repeats", type=int, default=2, help="each configuration, interleaved")
    p.add_argument("--pinned", action="store_true", help="copy into pinned memory (CUDA)")
    p.add_argument("--dir", default=None, help="where the table file goes (default: a temp dir)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    counts = [int(x) for x in args.processes.split(",")]
    backends = args.backends.split(",")
    for b in backends:
        if b not in ("mmap", "copy"):
            p.error(f"unknown backend {b!r} (mmap or copy)")
    if min(counts) < 1 or args.repeats < 1 or args.table_gib <= 0:
        p.error("--processes, --repeats and --table-gib must be positive")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "table.safetensors"
        rows = write_table(path, int(args.table_gib * (1 << 30)))
        table_bytes = rows * ROW_BYTES
        runs = []
        for r in range(args.repeats):
            order = [(b, n) for n in counts for b in backends]
            for b, n in order if r % 2 == 0 else reversed(order):
                runs.append(measure(path, table_bytes, b, n, args.pinned) | {"repeat": r + 1})
    print(report(runs, backends, counts, table_bytes, rows, args.repeats))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"table_bytes": table_bytes, "rows": rows, "runs": runs}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
