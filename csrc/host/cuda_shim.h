// CUDA for the host, as much as csrc/buddy_kernels.cu uses: included before
// the kernel sources, it lets g++ compile them unchanged and run them on a
// host runtime, every thread of a block a fiber: the block emulator
// (tests/host/emulator: kernels.cpp, runtime.cpp) or the native CPU engine
// (native.cpp). The runtime's functions (tests/host/emulator/runtime.h, or
// native.cpp's inline ones) are declared before this header is included.
//
// The sources see a CUDA compiler for a device (__CUDACC__, __CUDA_ARCH__),
// so they take their device branches -- aligned loads through
// reinterpret_cast, atomicAdd/atomicOr, __popc and the funnel shifts -- not
// the host fallbacks the per-entry harness (tests/host/codec_host.cpp) runs.
//   threadIdx, blockIdx, blockDim, gridDim   the calling fiber's (runtime.cpp)
//   __shared__                               BUDDY_SHARED_STORAGE when the runtime
//                                            defines it (native: one per host
//                                            thread), else a static variable in
//                                            the section buddy_emu_shared, which
//                                            the emulator fills with garbage
//                                            before each block
//   buddy_dynamic_shared()                   the block's dynamic shared buffer,
//                                            exactly the launch's size
//   __syncthreads, __syncwarp                barriers among the block / warp,
//                                            happens-before edges for TSan
//   __ballot_sync, __shfl*_sync,             value exchanges, no memory order
//   __match_any_sync
//   __launch_bounds__                        nothing: registers are the
//                                            device compiler's business
//   atomicAdd, atomicOr                      relaxed __atomic builtins: atomic
//                                            to TSan, ordering nothing else
// Only full-warp masks are supported (all the sources use); another mask is
// reported by the runtime.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "launch.h"

#define BUDDY_EMULATOR 1
#define __CUDACC__ 1
#define __CUDA_ARCH__ 900

#define __host__
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#if defined(BUDDY_SHARED_STORAGE)
#define __shared__ BUDDY_SHARED_STORAGE
#else
#define __shared__ static __attribute__((section("buddy_emu_shared"), aligned(16)))
#endif

#define threadIdx (buddy_emu_thread_idx())
#define blockIdx (buddy_emu_block_idx())
#define blockDim (buddy_emu_block_dim())
#define gridDim (buddy_emu_grid_dim())

inline uint8_t* buddy_dynamic_shared() { return buddy_emu_dynamic_shared(); }

#define __syncthreads() buddy_emu_syncthreads(__FILE__, __LINE__)
#define __syncwarp(mask) ((void)buddy_emu_warp(BUDDY_EMU_SYNCWARP, (mask), 0u, 0, __FILE__, __LINE__))
#define __ballot_sync(mask, pred) \
  ((unsigned)buddy_emu_warp(BUDDY_EMU_BALLOT, (mask), (pred) ? 1u : 0u, 0, __FILE__, __LINE__))
#define __shfl_sync(mask, v, src) buddy_emu_shuffle(BUDDY_EMU_SHFL, (mask), (v), (int)(src), __FILE__, __LINE__)
#define __shfl_up_sync(mask, v, d) buddy_emu_shuffle(BUDDY_EMU_SHFL_UP, (mask), (v), (int)(d), __FILE__, __LINE__)
#define __shfl_down_sync(mask, v, d) \
  buddy_emu_shuffle(BUDDY_EMU_SHFL_DOWN, (mask), (v), (int)(d), __FILE__, __LINE__)
#define __shfl_xor_sync(mask, v, m) buddy_emu_shuffle(BUDDY_EMU_SHFL_XOR, (mask), (v), (int)(m), __FILE__, __LINE__)
// the lanes whose value equals the caller's (all 64 bits of it, as the device compares them)
#define __match_any_sync(mask, v) \
  ((unsigned)buddy_emu_warp(BUDDY_EMU_MATCH_ANY, (mask), buddy_emu_match_key(v), 0, __FILE__, __LINE__))

template <class T>
inline T buddy_emu_shuffle(int kind, unsigned mask, T v, int arg, const char* file, int line) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "shuffles move 4 or 8 bytes");
  uint64_t bits = 0;
  memcpy(&bits, &v, sizeof(T));
  bits = buddy_emu_warp(kind, mask, bits, arg, file, line);
  memcpy(&v, &bits, sizeof(T));
  return v;
}

template <class T>
inline uint64_t buddy_emu_match_key(T v) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "__match_any_sync compares 4 or 8 bytes");
  uint64_t bits = 0;
  memcpy(&bits, &v, sizeof(T));
  return bits;
}

// Atomics of global and shared memory: relaxed, as a GPU's atomics order nothing but themselves.
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline unsigned atomicOr(unsigned* p, unsigned v) { return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); }
inline int atomicOr(int* p, int v) { return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); }

// Integer intrinsics with the device's results for every input (__clz(0) = 32, __ffs(0) = __ffsll(0) = 0).
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
// hi:lo shifted right by s & 31, the low 32 bits
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s) {
  return (unsigned)((((unsigned long long)hi << 32) | lo) >> (s & 31u));
}
// hi:lo shifted left by s & 31, the high 32 bits
inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned s) {
  return (unsigned)(((((unsigned long long)hi << 32) | lo) << (s & 31u)) >> 32);
}
