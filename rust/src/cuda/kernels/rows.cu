// Device side of the deferred-rows protocol as one kernel: wait on the gate, copy the
// slot into the staging buffer, reset the flag. The crate embeds rows.ptx (built from
// this file; the driver JIT-compiles it for the device at load). Regenerate with
//   python -m pip install "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-crt==13.0.*" \
//       "nvidia-nvvm==13.0.*" "nvidia-cuda-runtime==13.0.*"
//   nvcc -ptx -arch=compute_75 -O3 -o rust/src/cuda/kernels/rows.ptx rust/src/cuda/kernels/rows.cu
//   sed -i "s/^\.version 9\.0$/.version 8.0/" rust/src/cuda/kernels/rows.ptx
// (the slot loads must come out as ld.global.cv: check with grep after regenerating)
// (PTX ISA 8.0 is what a CUDA 12.0 driver JIT-compiles; the kernel needs nothing newer.)
//
// Why a kernel: on an H200 a graph's copy-engine H2D node plus two stream memory operations
// cost 5.5 us (copy engine warm) to 13 us (cold) even for 2.5 KiB; one block that polls the
// mapped flag and reads the mapped slot over PCIe costs under 1 us on top of the graph
// (benchmarks/explore_copy_path.py). It runs as a single block, so a __syncthreads orders
// every read of the slot before the reset.

#include <stdint.h>

// Launch with gridDim.x == 1. `gate` is the device address of the flag line: bytes 0..4
// `filled`, 4..8 `poison`, 8..12 `arrived`; the kernel proceeds once (gate & mask) != 0
// and ends by writing EMPTY (0) into `filled` and 0 into `arrived`, leaving `poison` alone.
extern "C" __global__ void ple_wait_copy_reset(const uint4* src, uint4* __restrict__ dst,
                                               unsigned long long n, unsigned int* gate,
                                               unsigned long long mask) {
    if (threadIdx.x == 0) {
        volatile unsigned long long* g = (volatile unsigned long long*)gate;
        while ((*g & mask) == 0ull) {
            __nanosleep(100);
        }
        // Order the slot reads below after the flag read (the host published the slot
        // before storing FILLED).
        __threadfence_system();
    }
    __syncthreads();
    unsigned long long n16 = n / 16;
    // The slot is mapped host memory the host rewrites every step: read it with ld.cv
    // ("fetch again", no cached line of an earlier step can answer), never ld.ca.
    for (unsigned long long i = threadIdx.x; i < n16; i += blockDim.x) {
        dst[i] = __ldcv(src + i);
    }
    if (threadIdx.x < (n & 15)) {
        ((uint8_t*)dst)[n16 * 16 + threadIdx.x] =
            __ldcv((const unsigned char*)src + n16 * 16 + threadIdx.x);
    }
    // Every read of the slot is done before the host may reuse it.
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        *(volatile unsigned int*)gate = 0u;
        // Clear `arrived` (bytes 8..12), which an optional stream write set before this
        // kernel: the host reads it at fill time to learn whether the GPU was waiting.
        gate[2] = 0u;
    }
}

// Steps above one block's bandwidth (the fused kernel above reads the slot with one SM):
// ple_wait_gate, one warp that polls the gate, then ple_copy_reset, a grid of blocks that
// copy the slot and whose last block resets the flag. Two kernels, so that while the rows
// are awaited only one warp holds an SM (a polling grid would keep dozens of blocks
// resident beside the model's kernels). `done` is a device-memory counter of the finished
// blocks, zero between steps (the last block puts it back).
extern "C" __global__ void ple_wait_gate(const unsigned int* gate, unsigned long long mask) {
    if (threadIdx.x == 0) {
        volatile const unsigned long long* g = (volatile const unsigned long long*)gate;
        while ((*g & mask) == 0ull) {
            __nanosleep(100);
        }
        // The next kernel's slot reads follow this flag read (a kernel boundary orders them
        // too; the fence keeps the two kernels' contract the fused kernel's).
        __threadfence_system();
    }
}

extern "C" __global__ void ple_copy_reset(const uint4* src, uint4* __restrict__ dst,
                                          unsigned long long n, unsigned int* gate,
                                          unsigned int* done) {
    unsigned long long n16 = n / 16;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    // ld.cv, as in the fused kernel: no cached line of an earlier step may answer.
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n16; i += stride) {
        dst[i] = __ldcv(src + i);
    }
    if (blockIdx.x == 0 && threadIdx.x < (n & 15)) {
        ((uint8_t*)dst)[n16 * 16 + threadIdx.x] =
            __ldcv((const unsigned char*)src + n16 * 16 + threadIdx.x);
    }
    // This block's reads are done (each value was stored) before it counts itself.
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(done, 1u) == gridDim.x - 1) {
            // Every block has read its part of the slot: hand it back to the host.
            *done = 0u;
            __threadfence_system();
            *(volatile unsigned int*)gate = 0u;
            ((volatile unsigned int*)gate)[2] = 0u;
        }
    }
}

// Publish the step's ids to the host: copy `count` ids of `elem` bytes (4 or 8) from device
// memory into the pinned, mapped mailbox, store the count, then READY (1) into `ready`.
// `count` is `*count_dev` when that pointer is non-null (clamped to `max_ids`), else
// `max_ids`. Launch with gridDim.x == 1; the fence orders the ids and count before READY.
extern "C" __global__ void ple_publish_ids(const uint8_t* ids, unsigned long long max_ids,
                                           const int* count_dev, unsigned long long elem,
                                           uint8_t* mailbox_ids, unsigned int* mailbox_count,
                                           unsigned int* ready) {
    __shared__ unsigned long long count;
    if (threadIdx.x == 0) {
        long long c = count_dev ? (long long)*count_dev : (long long)max_ids;
        if (c < 0) c = 0;
        if ((unsigned long long)c > max_ids) c = (long long)max_ids;
        count = (unsigned long long)c;
    }
    __syncthreads();
    unsigned long long words = count * elem / 4;
    const unsigned int* src = (const unsigned int*)ids;
    unsigned int* dst = (unsigned int*)mailbox_ids;
    for (unsigned long long i = threadIdx.x; i < words; i += blockDim.x) {
        dst[i] = src[i];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        *(volatile unsigned int*)mailbox_count = (unsigned int)count;
        __threadfence_system();
        *(volatile unsigned int*)ready = 1u;
    }
}

// Stall timing: stamp the GPU's global timer (ns) as stamp `which` (0: the consumer reached
// its join; 1: the rows were copied and the flag reset) of the next step of its kind.
// `counters` (device memory, two u64) count each kind's stamps; `ring` (pinned, mapped host
// memory) holds two mirrored counts, then `cap` pairs {arrived, copied}. Only posted writes
// cross the bus (the count is read from device memory), so the stamp costs the GPU about a
// kernel launch. The host reads entry k of each kind once both counts are past k: the fence
// orders the stamp before its count. Launch with one block of 32 threads.
extern "C" __global__ void ple_stamp(unsigned long long* counters, unsigned long long* ring,
                                     unsigned long long which, unsigned long long cap) {
    if (threadIdx.x == 0) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        unsigned long long k = counters[which];
        volatile unsigned long long* r = ring;
        r[2 + 2 * (k % cap) + which] = t;
        counters[which] = k + 1;
        __threadfence_system();
        r[which] = k + 1;
    }
}
