// Warp collectives shared by every codec's device functions.
//
// Device code that works on one entry with the 32 lanes of a warp is written
// against a Warp type, so the very same code runs on the GPU (BuddyCudaWarp
// below) and on the host under an emulated warp (tests/host/codec_host.cpp,
// 32 cooperative fibers). A Warp provides, and every lane calls each of them
// with the same control flow (in the same order):
//   uint32_t lane() const                          0..31
//   uint32_t ballot(bool p) const                  bit l: p of lane l
//   uint32_t shfl(uint32_t v, uint32_t src) const  v of lane src
//   uint32_t shfl_xor(uint32_t v, uint32_t m) const
//   uint32_t shfl_up(uint32_t v, uint32_t d) const  v of lane l - d (own v when l < d)
//   void sync() const                              memory written by any lane before it
//                                                  is visible to every lane after it
#pragma once

#include "buddy_device.h"

// Lanes a warp: 32 on the GPU and under the emulator. The native CPU engine's build of one lane a warp
// (csrc/host/native.cpp, BUDDY_NATIVE_SOLO) defines it as 1, so the work of a warp's 32 lanes runs as one
// lane's plain loops and every collective is the lane's own value -- for code written for any warp size: the
// helpers here, buddy_ops.h, buddy_entry.h, buddy_bits.h and fpe's codec (codec_fpe.h). The codecs whose
// formats tile 32 lanes (zvc, fpx, bpc) and fpe's fit assert 32.
#ifndef BUDDY_WARP_SIZE
#define BUDDY_WARP_SIZE 32u
#endif

// Sum of v over the warp, on every lane.
template <class Warp>
BUDDY_WARP_FN uint32_t buddy_warp_sum(const Warp& warp, uint32_t v) {
  for (uint32_t d = BUDDY_WARP_SIZE / 2; d > 0; d >>= 1) v += warp.shfl_xor(v, d);
  return v;
}

// Largest v over the warp, on every lane.
template <class Warp>
BUDDY_WARP_FN uint32_t buddy_warp_max(const Warp& warp, uint32_t v) {
  for (uint32_t d = BUDDY_WARP_SIZE / 2; d > 0; d >>= 1) v = buddy_max(v, warp.shfl_xor(v, d));
  return v;
}

// Bitwise OR of v over the warp, on every lane.
template <class Warp>
BUDDY_WARP_FN uint32_t buddy_warp_or(const Warp& warp, uint32_t v) {
  for (uint32_t d = BUDDY_WARP_SIZE / 2; d > 0; d >>= 1) v |= warp.shfl_xor(v, d);
  return v;
}

// Exclusive prefix sum of v over lanes 0..lane-1; *total: the sum over the warp.
template <class Warp>
BUDDY_WARP_FN uint32_t buddy_warp_exclusive_scan(const Warp& warp, uint32_t v, uint32_t* total) {
  const uint32_t lane = warp.lane();
  uint32_t x = v;
  for (uint32_t d = 1; d < BUDDY_WARP_SIZE; d <<= 1) {
    const uint32_t y = warp.shfl_up(x, d);
    if (lane >= d) x += y;
  }
  *total = warp.shfl(x, BUDDY_WARP_SIZE - 1);
  return x - v;
}

// The 16 bytes a lane holds in round r of a warp's tiling of an entry of `units` 16-byte units (lane l of round r:
// unit 32 r + l); *valid: whether that unit is inside the entry (zeros if not).
template <class Warp>
BUDDY_WARP_FN buddy_u128 buddy_round_unit(const Warp& warp, const uint8_t* entry_bytes, uint32_t units, uint32_t r,
                                          bool* valid) {
  const uint32_t u = r * BUDDY_WARP_SIZE + warp.lane();
  *valid = units % BUDDY_WARP_SIZE == 0 || u < units;  // (always, at E >= 512: one path)
  const buddy_u128 zero = {0, 0};
  return *valid ? buddy_load<buddy_u128>(entry_bytes + 16u * u) : zero;
}

// Copies n bytes (src) or writes n zeros (src == nullptr), 16 bytes per lane load and store: n is a multiple of
// 16 and both pointers are 16-byte aligned -- sectors are 32 bytes and entries a multiple of 16, and every buffer
// a kernel is given is 16-byte aligned (buddy.engines.cuda checks the tensor's and the overflow's, and allocates
// the rest; the staging buffers are), as the kernels' 16-byte loads of an entry need anyway. (An 8-byte path for
// other pointers was compiled into every kernel and never ran.)
template <class Warp>
BUDDY_WARP_FN void buddy_warp_fill(const Warp& warp, const uint8_t* src, uint8_t* dst, uint32_t n) {
  const buddy_u128 zero = {0, 0};
  BUDDY_UNROLL_2
  for (uint32_t u = warp.lane(); u < n / 16; u += BUDDY_WARP_SIZE)
    buddy_store<buddy_u128>(dst + 16 * u, src ? buddy_load<buddy_u128>(src + 16 * u) : zero);
}

// Whether any of the n bytes at p (n a multiple of 8, p 8-byte aligned) is
// non-zero, on every lane; 16-byte loads where n and p allow. (The kernels'
// pointers are 16-byte aligned, as buddy_warp_fill's, so the 8-byte path does
// not run there; without it ptxas spilled 8 bytes in float32's auto2 measure
// at its 48 registers, so it stays.)
template <class Warp>
BUDDY_WARP_FN bool buddy_warp_any_nonzero(const Warp& warp, const uint8_t* p, uint32_t n) {
  bool mine = false;
  if (n % 16 == 0 && buddy_aligned16(p, p)) {
    for (uint32_t u = warp.lane(); u < n / 16; u += BUDDY_WARP_SIZE) {
      const buddy_u128 v = buddy_load<buddy_u128>(p + 16 * u);
      mine |= (v.lo | v.hi) != 0;
    }
  } else {
    for (uint32_t u = warp.lane(); u < n / 8; u += BUDDY_WARP_SIZE) mine |= buddy_load<uint64_t>(p + 8 * u) != 0;
  }
  return warp.ballot(mine) != 0;
}

// The lanes whose key equals this lane's (bit l: lane l), on every lane; every
// lane takes part. A loop of ballots over the key's `bits` low bits, so any
// Warp can run it (the GPU's has one instruction for it: the overload below).
template <class Warp>
BUDDY_WARP_FN uint32_t buddy_warp_match(const Warp& warp, uint32_t key, uint32_t bits) {
  uint32_t peers = 0xFFFFFFFFu;
  for (uint32_t b = 0; b < bits; ++b) {
    const bool set = (key >> b) & 1u;
    const uint32_t ones = warp.ballot(set);
    peers &= set ? ones : ~ones;
  }
  return peers;
}

#ifdef __CUDACC__
#define BUDDY_FULL_MASK 0xffffffffu

// The Warp on the GPU: lanes are the 32 threads of a warp.
struct BuddyCudaWarp {
  __device__ __forceinline__ uint32_t lane() const { return threadIdx.x & (BUDDY_WARP_SIZE - 1u); }
  __device__ __forceinline__ uint32_t ballot(bool p) const { return __ballot_sync(BUDDY_FULL_MASK, p); }
  __device__ __forceinline__ uint32_t shfl(uint32_t v, uint32_t src) const {
    return __shfl_sync(BUDDY_FULL_MASK, v, (int)src);
  }
  __device__ __forceinline__ uint32_t shfl_xor(uint32_t v, uint32_t m) const {
    return __shfl_xor_sync(BUDDY_FULL_MASK, v, (int)m);
  }
  __device__ __forceinline__ uint32_t shfl_up(uint32_t v, uint32_t d) const {
    return __shfl_up_sync(BUDDY_FULL_MASK, v, d);
  }
  __device__ __forceinline__ void sync() const { __syncwarp(BUDDY_FULL_MASK); }
};

__device__ __forceinline__ uint32_t buddy_warp_match(const BuddyCudaWarp&, uint32_t key, uint32_t) {
  return __match_any_sync(BUDDY_FULL_MASK, key);
}

#if defined(BUDDY_HOST_WARP_OPS)
// A host runtime that runs the lanes one after another (the native CPU engine, csrc/host/native.cpp) pays for
// every collective with a switch per lane; it gives these whole-warp operations in one exchange each, with the
// results of the ladders above bit for bit (sums and scans wrap at 32 bits either way). Not on the GPU, not under
// the emulator: there the ladders run.
__device__ __forceinline__ uint32_t buddy_warp_sum(const BuddyCudaWarp&, uint32_t v) {
  return (uint32_t)buddy_host_warp_op(BUDDY_EMU_SUM, v);
}
__device__ __forceinline__ uint32_t buddy_warp_max(const BuddyCudaWarp&, uint32_t v) {
  return (uint32_t)buddy_host_warp_op(BUDDY_EMU_MAX, v);
}
__device__ __forceinline__ uint32_t buddy_warp_or(const BuddyCudaWarp&, uint32_t v) {
  return (uint32_t)buddy_host_warp_op(BUDDY_EMU_OR, v);
}
__device__ __forceinline__ uint32_t buddy_warp_exclusive_scan(const BuddyCudaWarp&, uint32_t v, uint32_t* total) {
  const uint64_t both = buddy_host_warp_op(BUDDY_EMU_EXCLUSIVE_SCAN, v);
  *total = (uint32_t)(both >> 32);
  return (uint32_t)both;
}
// The 32 x 32 bit transpose of codec_bpc.h (five shfl_xor rounds there): bit j of lane i's result is bit i of
// lane j's x.
__device__ __forceinline__ uint32_t buddy_warp_transpose(const BuddyCudaWarp&, uint32_t x) {
  return (uint32_t)buddy_host_warp_op(BUDDY_EMU_TRANSPOSE, x);
}
#endif
#endif
