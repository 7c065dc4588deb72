// ZVC kernels: one warp per entry, the per-entry logic of zvc_core.h.
//
// Compiled at run time (buddy/cuda.py, through CuPy/NVRTC) once per entry
// size: E = BUDDY_ENTRY_BYTES and the other format constants arrive as -D
// defines from buddy.spec.c_defines(entry_bytes). The word size is a kernel
// argument (the switch below picks the instantiation once per launch).
//
// Launch: blockDim.x a multiple of 32 (one entry per warp at a time; warps
// stride over the entries), any gridDim.x >= 1, on the caller's stream.
// Every buffer is dense, 8-byte aligned and does not alias another; the
// loader checks all of this before launching.
//
// Outputs match buddy/codecs/zvc.py byte for byte: every payload byte and
// every decoded byte is written (so outputs may be allocated uninitialised).
#include "zvc_core.h"

#define BUDDY_FULL_MASK 0xffffffffu

// The Warp of zvc_core.h on the GPU: lanes are the 32 threads of a warp.
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
};

// This warp's first entry and the warp stride over entries.
__device__ __forceinline__ long long buddy_first_warp() {
  return ((long long)blockIdx.x * blockDim.x + threadIdx.x) / BUDDY_WARP_SIZE;
}
__device__ __forceinline__ long long buddy_warp_stride() {
  return (long long)gridDim.x * blockDim.x / BUDDY_WARP_SIZE;
}

template <int WB>
__device__ __forceinline__ void buddy_zvc_sizes_body(const uint8_t* __restrict__ entries,
                                                     int32_t* __restrict__ sectors, long long n_entries) {
  const BuddyCudaWarp warp;
  for (long long i = buddy_first_warp(); i < n_entries; i += buddy_warp_stride()) {
    const uint32_t nnz = buddy_zvc_warp_count<WB>(warp, entries + i * BUDDY_ENTRY_BYTES);
    if (warp.lane() == 0) sectors[i] = (int32_t)buddy_zvc_sectors<WB>(nnz);
  }
}

template <int WB>
__device__ __forceinline__ void buddy_zvc_encode_body(const uint8_t* __restrict__ entries,
                                                      uint8_t* __restrict__ payload, int32_t* __restrict__ sectors,
                                                      int32_t* __restrict__ modes, long long n_entries) {
  const BuddyCudaWarp warp;
  for (long long i = buddy_first_warp(); i < n_entries; i += buddy_warp_stride()) {
    const uint32_t k =
        buddy_zvc_warp_encode<WB>(warp, entries + i * BUDDY_ENTRY_BYTES, payload + i * BUDDY_ENTRY_BYTES);
    if (warp.lane() == 0) {
      sectors[i] = (int32_t)k;
      modes[i] = 0;
    }
  }
}

template <int WB>
__device__ __forceinline__ void buddy_zvc_decode_body(const uint8_t* __restrict__ payload,
                                                      const int32_t* __restrict__ sectors,
                                                      const int32_t* __restrict__ modes, uint8_t* __restrict__ out,
                                                      int* __restrict__ error, long long n_entries) {
  const BuddyCudaWarp warp;
  uint32_t err = 0;
  for (long long i = buddy_first_warp(); i < n_entries; i += buddy_warp_stride()) {
    // a negative k or mode becomes a huge unsigned value: flagged, never used as a size
    err |= buddy_zvc_warp_decode<WB>(warp, payload + i * BUDDY_ENTRY_BYTES, (uint32_t)sectors[i], (uint32_t)modes[i],
                                     out + i * BUDDY_ENTRY_BYTES);
  }
  if (err && warp.lane() == 0) atomicOr(error, (int)err);
}

// Sectors k of each entry (the size pass; no payload is written).
extern "C" __global__ void buddy_zvc_sizes(
    const uint8_t* __restrict__ entries,  // in: n_entries * E bytes, the entries
    int32_t* __restrict__ sectors,        // out: n_entries int32 elements, k of each entry (-1: bad word_bytes)
    long long n_entries,                  // number of entries (elements of sectors), not bytes
    int word_bytes) {                     // ZVC word size in bytes: 1, 2, 4 or 8
  switch (word_bytes) {
    case 1: buddy_zvc_sizes_body<1>(entries, sectors, n_entries); break;
    case 2: buddy_zvc_sizes_body<2>(entries, sectors, n_entries); break;
    case 4: buddy_zvc_sizes_body<4>(entries, sectors, n_entries); break;
    case 8: buddy_zvc_sizes_body<8>(entries, sectors, n_entries); break;
    default:
      for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n_entries;
           i += (long long)gridDim.x * blockDim.x)
        sectors[i] = -1;
  }
}

// Payload, k and mode of each entry.
extern "C" __global__ void buddy_zvc_encode(
    const uint8_t* __restrict__ entries,  // in: n_entries * E bytes, the entries
    uint8_t* __restrict__ payload,        // out: n_entries * E bytes, entry i's payload at byte i * E
    int32_t* __restrict__ sectors,        // out: n_entries int32 elements, k of each entry (-1: bad word_bytes)
    int32_t* __restrict__ modes,          // out: n_entries int32 elements, metadata mode (always 0)
    long long n_entries,                  // number of entries (rows of entries/payload), not bytes
    int word_bytes) {                     // ZVC word size in bytes: 1, 2, 4 or 8
  switch (word_bytes) {
    case 1: buddy_zvc_encode_body<1>(entries, payload, sectors, modes, n_entries); break;
    case 2: buddy_zvc_encode_body<2>(entries, payload, sectors, modes, n_entries); break;
    case 4: buddy_zvc_encode_body<4>(entries, payload, sectors, modes, n_entries); break;
    case 8: buddy_zvc_encode_body<8>(entries, payload, sectors, modes, n_entries); break;
    default:
      for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n_entries;
           i += (long long)gridDim.x * blockDim.x)
        sectors[i] = -1;
  }
}

// Entries back from payloads. Inconsistent metadata never causes an
// out-of-bounds read: the entry decodes to zeros and *error gets its
// BUDDY_ZVC_ERR_* bits (the caller zeroes *error before the launch and
// raises when it is not 0 afterwards).
extern "C" __global__ void buddy_zvc_decode(
    const uint8_t* __restrict__ payload,  // in: n_entries * E bytes, entry i's payload at byte i * E
    const int32_t* __restrict__ sectors,  // in: n_entries int32 elements, k of each entry (metadata)
    const int32_t* __restrict__ modes,    // in: n_entries int32 elements, mode of each entry (metadata)
    uint8_t* __restrict__ out,            // out: n_entries * E bytes, the decoded entries
    int* __restrict__ error,              // in/out: one int, ORed with BUDDY_ZVC_ERR_* bits
    long long n_entries,                  // number of entries (rows of payload/out), not bytes
    int word_bytes) {                     // ZVC word size in bytes: 1, 2, 4 or 8
  switch (word_bytes) {
    case 1: buddy_zvc_decode_body<1>(payload, sectors, modes, out, error, n_entries); break;
    case 2: buddy_zvc_decode_body<2>(payload, sectors, modes, out, error, n_entries); break;
    case 4: buddy_zvc_decode_body<4>(payload, sectors, modes, out, error, n_entries); break;
    case 8: buddy_zvc_decode_body<8>(payload, sectors, modes, out, error, n_entries); break;
    default:
      if (blockIdx.x == 0 && threadIdx.x == 0) atomicOr(error, (int)BUDDY_ZVC_ERR_WORD);
  }
}
