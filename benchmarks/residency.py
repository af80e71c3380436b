"""Hold files' share in the page cache at a fraction, from outside every process that reads
them: one mechanism for every backend of a residency run (vLLM's disk offload reads the
table files with ``preadv``, ple-memops maps them, and both go through the page cache).

Each file is cut into chunks (2 MiB by default); a fixed, seeded random subset of
``share`` of them is kept: read into the page cache once at the start (``fill``: a run at
a share starts with that share resident, whatever ran before it), and every other chunk is
dropped whenever it is resident, on each ``tick``:

* ``POSIX_FADV_DONTNEED`` over the chunk drops its pages that no process maps;
* a page some process maps survives that, so for each process whose ``/proc/PID/maps``
  maps the file, ``process_madvise(MADV_PAGEOUT)`` over its mapping of the chunk reclaims
  it from that process too (Linux 5.10 and later; needs ``CAP_SYS_NICE`` and ptrace
  access to the process: root on the GPU host). Where that is refused, the holder says
  so (``HoldError``) rather than hold a share it cannot keep.

What is resident is read with ``mincore`` over a mapping of the holder's own that touches
nothing. A reader between two ticks brings dropped chunks back (that is the cold read the
run measures); the next tick drops them again, so the share over a run stays at or just
above ``share``, and each tick's report says how far above it was.

    python benchmarks/residency.py --share 0.5 FILE [FILE ...] [--interval 0.5]
        [--chunk-mib 2] [--seconds S] [--seed 0]

prints a line per ``--report-every`` seconds: the share resident before and after the tick,
the bytes dropped, the processes whose mappings were paged out.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import mmap
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["HoldError", "ResidencyHolder", "mappers", "resident_bytes", "resident_pages"]

MADV_PAGEOUT = 21
_SYS_PROCESS_MADVISE = 440  # x86_64 and aarch64 alike
_IOV_MAX = 1024

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]  # fmt: skip
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.syscall.restype = ctypes.c_long


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class HoldError(RuntimeError):
    """The share cannot be held: a mapping the holder may not page out (``errno``: why)."""

    def __init__(self, message: str, err: int) -> None:
        super().__init__(message)
        self.errno = err


def resident_pages(path: Path) -> bytes:
    """One byte a page of ``path``: bit 0 set where the page is in the page cache now."""
    size = path.stat().st_size
    if size == 0:
        return b""
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        try:
            vec = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
            return bytes(vec)
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def _in_core(path: Path) -> np.ndarray[Any, np.dtype[np.bool_]]:
    """One bool a page of ``path``: in the page cache now."""
    return (np.frombuffer(resident_pages(path), dtype=np.uint8) & 1).astype(bool)


def resident_bytes(path: Path) -> int:
    """Bytes of ``path`` in the page cache now."""
    return int(np.count_nonzero(_in_core(path))) * mmap.PAGESIZE


@dataclass(frozen=True)
class Mapping:
    """One process's mapping of (part of) a file: ``[start, end)`` at file ``offset``."""

    pid: int
    start: int
    end: int
    offset: int


def mappers(path: Path) -> list[Mapping]:
    """Every mapping of ``path`` (by device and inode) in every process this one may read
    the maps of, itself left out."""
    st = path.stat()
    found: list[Mapping] = []
    me = os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            with open(f"/proc/{entry.name}/maps") as f:
                lines = f.readlines()
        except OSError:
            continue  # gone, or not ours to read
        for line in lines:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or int(parts[4]) != st.st_ino:
                continue
            major, minor = (int(x, 16) for x in parts[3].split(":"))
            if os.makedev(major, minor) != st.st_dev:
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            found.append(Mapping(int(entry.name), lo, hi, int(parts[2], 16)))
    return found


def _page_out(pid: int, ranges: list[tuple[int, int]]) -> None:
    """``process_madvise(MADV_PAGEOUT)`` over ``pid``'s address ranges."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # it exited: its mappings are gone
    try:
        for i in range(0, len(ranges), _IOV_MAX):
            part = ranges[i : i + _IOV_MAX]
            iov = (_Iovec * len(part))(*(_Iovec(a, n) for a, n in part))
            r = _libc.syscall(_SYS_PROCESS_MADVISE, pidfd, iov, len(part), MADV_PAGEOUT, 0)
            if r < 0:
                err = ctypes.get_errno()
                if err == errno.ESRCH:
                    return
                raise HoldError(
                    f"process_madvise(MADV_PAGEOUT) on pid {pid}: {os.strerror(err)} "
                    "(needs Linux 5.10+, CAP_SYS_NICE and ptrace access to the process); "
                    "a page it maps cannot be dropped otherwise",
                    err,
                )
    finally:
        os.close(pidfd)


@dataclass
class _File:
    path: Path
    size: int
    keep: frozenset[int]
    chunks: int


@dataclass
class ResidencyHolder:
    """Keeps ``share`` of each file's chunks resident at most (see the module)."""

    paths: list[Path]
    share: float
    chunk_bytes: int = 2 << 20
    seed: int = 0
    files: list[_File] = field(init=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.share <= 1.0:
            raise ValueError(f"share must be within [0, 1], got {self.share}")
        if self.chunk_bytes <= 0 or self.chunk_bytes % mmap.PAGESIZE:
            raise ValueError(f"chunk_bytes must be a positive multiple of {mmap.PAGESIZE}")
        rng = random.Random(self.seed)
        self.files = []
        for p in self.paths:
            size = Path(p).stat().st_size
            n = (size + self.chunk_bytes - 1) // self.chunk_bytes
            keep = frozenset(rng.sample(range(n), round(self.share * n)))
            self.files.append(_File(Path(p), size, keep, n))

    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def resident_bytes(self) -> int:
        return sum(resident_bytes(f.path) for f in self.files)

    def _fadvise_out(self, path: Path, chunks: list[int]) -> None:
        """``POSIX_FADV_DONTNEED`` over each of ``chunks`` (the pages no process maps)."""
        fd = os.open(path, os.O_RDONLY)
        try:
            for c in chunks:
                os.posix_fadvise(fd, c * self.chunk_bytes, self.chunk_bytes,
                                 os.POSIX_FADV_DONTNEED)  # fmt: skip
        finally:
            os.close(fd)

    def fill(self) -> int:
        """Read every kept chunk that is not wholly resident, so the share starts resident
        (the pages land in the page cache; nothing is kept here); the bytes read."""
        page = mmap.PAGESIZE
        per_chunk = self.chunk_bytes // page
        buf = bytearray(self.chunk_bytes)
        read = 0
        for f in self.files:
            core = _in_core(f.path)
            padded = np.zeros(f.chunks * per_chunk, dtype=bool)
            padded[: core.size] = core
            whole = padded.reshape(f.chunks, per_chunk).all(axis=1)
            with open(f.path, "rb", buffering=0) as fh:
                for c in sorted(f.keep):
                    if whole[c] and (c + 1) * self.chunk_bytes <= f.size:
                        continue
                    fh.seek(c * self.chunk_bytes)
                    read += fh.readinto(buf) or 0
        return read

    def tick(self, measure: bool = True) -> dict[str, Any]:
        """Drop every resident chunk outside the kept set; what it found and did (the share
        resident after it only with ``measure``: a second pass over every page, 0.25 s for
        24 GiB on a 2-vCPU VM; where nothing was dropped it is the share before)."""
        page = mmap.PAGESIZE
        per_chunk = self.chunk_bytes // page
        before = dropped = 0
        paged: set[int] = set()
        for f in self.files:
            core = _in_core(f.path)
            before += int(np.count_nonzero(core)) * page
            padded = np.zeros(f.chunks * per_chunk, dtype=bool)
            padded[: core.size] = core
            touched = np.flatnonzero(padded.reshape(f.chunks, per_chunk).any(axis=1))
            drop = [int(c) for c in touched if int(c) not in f.keep]
            if not drop:
                continue
            self._fadvise_out(f.path, drop)
            by_pid: dict[int, list[tuple[int, int]]] = {}
            for m in mappers(f.path):
                for c in drop:
                    lo = max(c * self.chunk_bytes, m.offset)
                    hi = min((c + 1) * self.chunk_bytes, f.size, m.offset + (m.end - m.start))
                    if lo < hi:
                        by_pid.setdefault(m.pid, []).append((m.start + lo - m.offset, hi - lo))
            for pid, ranges in by_pid.items():
                _page_out(pid, ranges)
                paged.add(pid)
            if by_pid:
                # Pages a mapping just let go of that the fadvise above could not drop.
                self._fadvise_out(f.path, drop)
            dropped += len(drop) * self.chunk_bytes
        total = max(self.total_bytes(), 1)
        after = (self.resident_bytes() if dropped else before) / total if measure else None
        return {"before": before / total, "after": after, "dropped_bytes": dropped,
                "paged_out_pids": sorted(paged)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Hold files' share in the page cache at a fraction (see the module).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--share", type=float, required=True, help="the fraction kept, 0 to 1")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between ticks")
    p.add_argument("--chunk-mib", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seconds", type=float, default=0.0, help="stop after (0: until killed)")
    p.add_argument("--report-every", type=float, default=10.0)
    args = p.parse_args(argv)
    try:
        holder = ResidencyHolder(args.files, args.share, int(args.chunk_mib * 2**20), args.seed)
    except (OSError, ValueError) as exc:
        print(f"residency: {exc}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    filled = holder.fill()
    print(f"residency: share {args.share:.2f}: the kept chunks read in, {filled / 2**20:.0f} MiB "
          f"in {time.monotonic() - t0:.1f} s", flush=True)  # fmt: skip
    end = time.monotonic() + args.seconds if args.seconds > 0 else float("inf")
    last = 0.0
    worst = 0.0
    while time.monotonic() < end:
        report = time.monotonic() - last >= args.report_every
        try:
            r = holder.tick(measure=report)
        except HoldError as exc:
            print(f"residency: {exc}", file=sys.stderr)
            return 1
        worst = max(worst, r["before"])
        if report:
            print(f"residency: share {args.share:.2f}: before tick {r['before']:.3f} (highest "
                  f"{worst:.3f}), after {r['after']:.3f}; dropped {r['dropped_bytes'] / 2**20:.0f}"
                  f" MiB; paged out of pids {r['paged_out_pids']}", flush=True)  # fmt: skip
            last, worst = time.monotonic(), 0.0
        time.sleep(args.interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
