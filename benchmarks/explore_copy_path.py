"""Exploration (device only): where do the ~13 us of WAIT+H2D+reset go, and would a kernel
that reads the mapped slot directly (optionally spinning on the flag itself) be cheaper?

Needs nvcc (to build rust/src/cuda/kernels/rows.cu to PTX), cupy and cuda.bindings.

    python benchmarks/explore_copy_path.py --ptx rows.ptx
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
from typing import Any

import cupy
import numpy as np
import torch
from cuda.bindings import driver as cu

WAIT_AND = int(cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_AND)
WRITE_DEFAULT = int(cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)
MASK = (1 << 32) | 1


def check(res: Any) -> Any:
    err, *rest = res if isinstance(res, tuple) else (res,)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"driver call failed: {err}")
    return rest[0] if len(rest) == 1 else rest


class Rig:
    def __init__(self, nbytes: int, mod: Any) -> None:
        flags = cu.CU_MEMHOSTALLOC_PORTABLE | cu.CU_MEMHOSTALLOC_DEVICEMAP
        self.n = nbytes
        self.slot_ptr = int(check(cu.cuMemHostAlloc(nbytes, flags)))
        self.flag_ptr = int(check(cu.cuMemHostAlloc(64, flags)))
        ctypes.memset(self.flag_ptr, 0, 64)
        self.flag_dptr = int(check(cu.cuMemHostGetDevicePointer(self.flag_ptr, 0)))
        self.slot_dptr = int(check(cu.cuMemHostGetDevicePointer(self.slot_ptr, 0)))
        self.slot = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(self.slot_ptr))
        self.flag = ctypes.c_uint32.from_address(self.flag_ptr)
        self.staging = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
        self.counter = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.copy_reset = mod.get_function("ple_copy_reset")
        self.wait_copy_reset = mod.get_function("ple_wait_copy_reset")
        n16 = nbytes // 16
        self.blocks = max(1, min(32, (n16 + 255) // 256))
        self.threads = 256 if n16 > 128 else max(32, ((n16 + 31) // 32) * 32)

    def fill(self, data: np.ndarray) -> None:
        while self.flag.value != 0:
            pass
        self.slot[:] = data
        self.flag.value = 1

    def _s(self) -> Any:
        return cu.CUstream(torch.cuda.current_stream().cuda_stream)

    def wait(self) -> None:
        check(cu.cuStreamWaitValue64(self._s(), self.flag_dptr, MASK, WAIT_AND))

    def h2d(self) -> None:
        check(cu.cuMemcpyHtoDAsync(self.staging.data_ptr(), self.slot_ptr, self.n, self._s()))

    def reset(self) -> None:
        check(cu.cuStreamWriteValue32(self._s(), self.flag_dptr, 0, WRITE_DEFAULT))

    def _args(self) -> tuple[Any, ...]:
        return (
            np.uint64(self.slot_dptr),
            np.uint64(self.staging.data_ptr()),
            np.uint64(self.n),
            np.uint64(self.flag_dptr),
            np.uint64(self.counter.data_ptr()),
        )

    def kcopy(self) -> None:
        with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            self.copy_reset((self.blocks,), (self.threads,), self._args())

    def kwait(self) -> None:
        with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            self.wait_copy_reset((self.blocks,), (self.threads,), (*self._args(), np.uint64(MASK)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ptx", default="rows.ptx")
    ap.add_argument("--iters", type=int, default=2000)
    a = ap.parse_args()
    subprocess.run(
        ["nvcc", "-ptx", "-arch=compute_75", "-O3", "-o", a.ptx, "rust/src/cuda/kernels/rows.cu"],
        check=True,
    )
    torch.cuda.init()
    x = torch.zeros(1024, device="cuda")
    x.add_(1)
    mod = cupy.RawModule(path=a.ptx)
    for nbytes in (16 * 160, 4096 * 160):
        variants: dict[str, Any] = {
            "kernel only": lambda r: None,
            "H2D": lambda r: r.h2d(),
            "WAIT+reset": lambda r: (r.wait(), r.reset()),
            "WAIT+H2D+reset (now)": lambda r: (r.wait(), r.h2d(), r.reset()),
            "WAIT+copy kernel(reset)": lambda r: (r.wait(), r.kcopy()),
            "spin+copy kernel(reset)": lambda r: r.kwait(),
        }
        needs_fill = {k: ("WAIT" in k or "spin" in k) for k in variants}
        entries = []
        for rep in range(2):
            for name, body in variants.items():
                r = Rig(nbytes, mod)
                r.fill(np.zeros(nbytes, np.uint8))
                with torch.cuda.stream(torch.cuda.Stream()):
                    body(r)
                    x.add_(1)
                torch.cuda.synchronize()
                r.flag.value = 0
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    body(r)
                    x.add_(1)
                entries.append((f"{name} #{rep + 1}", name, r, g))
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        rng = np.random.default_rng(0)
        data = rng.integers(0, 256, nbytes, dtype=np.uint8)
        times: dict[str, list[float]] = {e[0]: [] for e in entries}
        late: dict[str, list[float]] = {e[0]: [] for e in entries if needs_fill[e[1]]}
        for i in range(a.iters + 50):
            for j in rng.permutation(len(entries)):
                label, name, r, g = entries[j]
                if needs_fill[name]:
                    r.fill(data)
                e0.record()
                g.replay()
                e1.record()
                e1.synchronize()
                if i >= 50:
                    times[label].append(e0.elapsed_time(e1) * 1e3)
                if needs_fill[name] and label.endswith("#1"):
                    # launch first, fill after
                    while r.flag.value != 0:
                        pass
                    e0.record()
                    g.replay()
                    e1.record()
                    r.slot[:] = data
                    r.flag.value = 1
                    e1.synchronize()
                    if i >= 50:
                        late[label].append(e0.elapsed_time(e1) * 1e3)
                if needs_fill[name] and i % 97 == 0 and name != "WAIT+reset":
                    got = r.staging.cpu().numpy()
                    assert np.array_equal(got, data), f"{label}: wrong bytes"
        base = statistics.median(times["kernel only #1"] + times["kernel only #2"])
        print(f"\n{nbytes} B ({nbytes // 160} rows of 160 B), {a.iters} replays, random order")
        print(f"{'variant':<30}{'median':>9}{'p99':>9}{'-kernel':>9}{'fill-after-launch':>19}")
        for label, v in times.items():
            med = statistics.median(v)
            la = f"{statistics.median(late[label]):>19.2f}" if late.get(label) else f"{'':>19}"
            print(f"{label:<30}{med:>9.2f}{np.percentile(v, 99):>9.2f}{med - base:>9.2f}{la}")


if __name__ == "__main__":
    main()
