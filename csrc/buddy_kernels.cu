// Kernels per entry operation, with the codec as a template parameter: one
// warp per entry (warps stride over the entries), the format rules of
// buddy_entry.h around the codec's device functions (codec_*.h).
//
// Compiled at run time (buddy/cuda.py, through CuPy/NVRTC) once per entry
// size: E = BUDDY_ENTRY_BYTES and the other format constants arrive as -D
// defines from buddy.spec.c_defines(entry_bytes). The word size is a kernel
// argument (the switch picks the instantiation once per launch).
//
// Launch: blockDim.x a multiple of 32, any gridDim.x >= 1, on the caller's
// stream. Every buffer is dense, 8-byte aligned and does not alias another;
// the loader checks all of this before launching. Every output byte is
// written (outputs may be allocated uninitialised).
#include "buddy_entry.h"
#include "codec_zvc.h"

// This warp's first entry and the warp stride over entries.
__device__ __forceinline__ long long buddy_first_warp() {
  return ((long long)blockIdx.x * blockDim.x + threadIdx.x) / BUDDY_WARP_SIZE;
}
__device__ __forceinline__ long long buddy_warp_stride() {
  return (long long)gridDim.x * blockDim.x / BUDDY_WARP_SIZE;
}

template <class Codec>
__device__ __forceinline__ void buddy_measure_body(const uint8_t* __restrict__ entries, int32_t* __restrict__ sectors,
                                                   int32_t* __restrict__ modes, long long n_entries) {
  const BuddyCudaWarp warp;
  for (long long i = buddy_first_warp(); i < n_entries; i += buddy_warp_stride()) {
    uint32_t mode;
    const uint32_t k = buddy_entry_measure<Codec>(warp, entries + i * BUDDY_ENTRY_BYTES, &mode);
    if (warp.lane() == 0) {
      sectors[i] = (int32_t)k;
      modes[i] = (int32_t)mode;
    }
  }
}

template <class Codec>
__device__ __forceinline__ void buddy_encode_body(const uint8_t* __restrict__ entries, uint8_t* __restrict__ payload,
                                                  int32_t* __restrict__ sectors, int32_t* __restrict__ modes,
                                                  long long n_entries) {
  const BuddyCudaWarp warp;
  for (long long i = buddy_first_warp(); i < n_entries; i += buddy_warp_stride()) {
    const uint8_t* entry = entries + i * BUDDY_ENTRY_BYTES;
    uint8_t* out = payload + i * BUDDY_ENTRY_BYTES;
    uint32_t mode;
    const uint32_t k = buddy_entry_measure<Codec>(warp, entry, &mode);
    buddy_entry_encode<Codec>(warp, entry, k, mode, out);
    // the rest of the E-byte row is zero (the torch reference's payload rows)
    buddy_warp_fill(warp, nullptr, out + k * BUDDY_SECTOR_BYTES, (BUDDY_SECTORS_PER_ENTRY - k) * BUDDY_SECTOR_BYTES);
    if (warp.lane() == 0) {
      sectors[i] = (int32_t)k;
      modes[i] = (int32_t)mode;
    }
  }
}

template <class Codec>
__device__ __forceinline__ void buddy_decode_body(const uint8_t* __restrict__ payload,
                                                  const int32_t* __restrict__ sectors,
                                                  const int32_t* __restrict__ modes, uint8_t* __restrict__ out,
                                                  int* __restrict__ error, long long n_entries) {
  const BuddyCudaWarp warp;
  uint32_t err = 0;
  for (long long i = buddy_first_warp(); i < n_entries; i += buddy_warp_stride()) {
    err |= buddy_entry_decode<Codec>(warp, payload + i * BUDDY_ENTRY_BYTES, (uint32_t)sectors[i],
                                     (uint32_t)modes[i], out + i * BUDDY_ENTRY_BYTES);
  }
  if (err && warp.lane() == 0) atomicOr(error, (int)err);
}

// Fills `sectors` with -1 when the word size is not one the codecs take.
__device__ __forceinline__ void buddy_bad_word(int32_t* sectors, long long n_entries) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n_entries;
       i += (long long)gridDim.x * blockDim.x)
    sectors[i] = -1;
}

#define BUDDY_WORD_SWITCH(CODEC, BODY, BAD, ...) \
  switch (word_bytes) {                          \
    case 1: BODY<CODEC<1>>(__VA_ARGS__); break;  \
    case 2: BODY<CODEC<2>>(__VA_ARGS__); break;  \
    case 4: BODY<CODEC<4>>(__VA_ARGS__); break;  \
    case 8: BODY<CODEC<8>>(__VA_ARGS__); break;  \
    default: BAD;                                \
  }

// The extern "C" entry points of one codec (NAME: its registry name).
#define BUDDY_ENTRY_KERNELS(NAME, CODEC)                                                                             \
  /* k and mode of each entry (the size pass; no payload is written) */                                             \
  extern "C" __global__ void buddy_##NAME##_measure(                                                                \
      const uint8_t* __restrict__ entries, /* in: n_entries * E bytes, the entries */                               \
      int32_t* __restrict__ sectors,       /* out: n_entries int32, k of each entry (-1: bad word_bytes) */         \
      int32_t* __restrict__ modes,         /* out: n_entries int32, metadata mode of each entry */                  \
      long long n_entries,                 /* number of entries, not bytes */                                       \
      int word_bytes) {                    /* word size in bytes: 1, 2, 4 or 8 */                                   \
    BUDDY_WORD_SWITCH(CODEC, buddy_measure_body, buddy_bad_word(sectors, n_entries), entries, sectors, modes,       \
                      n_entries)                                                                                    \
  }                                                                                                                 \
  /* payload (E bytes per entry, zeros after k sectors), k and mode of each entry */                                \
  extern "C" __global__ void buddy_##NAME##_encode(                                                                 \
      const uint8_t* __restrict__ entries, /* in: n_entries * E bytes, the entries */                               \
      uint8_t* __restrict__ payload,       /* out: n_entries * E bytes, entry i's payload at byte i * E */          \
      int32_t* __restrict__ sectors,       /* out: n_entries int32, k of each entry (-1: bad word_bytes) */         \
      int32_t* __restrict__ modes,         /* out: n_entries int32, metadata mode of each entry */                  \
      long long n_entries,                 /* number of entries, not bytes */                                       \
      int word_bytes) {                    /* word size in bytes: 1, 2, 4 or 8 */                                   \
    BUDDY_WORD_SWITCH(CODEC, buddy_encode_body, buddy_bad_word(sectors, n_entries), entries, payload, sectors,      \
                      modes, n_entries)                                                                             \
  }                                                                                                                 \
  /* entries back from payloads; damaged metadata never causes an out-of-bounds read: the entry decodes to zeros    \
     and *error gets its BUDDY_ERR_* bits (the caller zeroes *error before and raises when it is not 0 after) */    \
  extern "C" __global__ void buddy_##NAME##_decode(                                                                 \
      const uint8_t* __restrict__ payload, /* in: n_entries * E bytes, entry i's payload at byte i * E */           \
      const int32_t* __restrict__ sectors, /* in: n_entries int32, k of each entry (metadata) */                    \
      const int32_t* __restrict__ modes,   /* in: n_entries int32, mode of each entry (metadata) */                 \
      uint8_t* __restrict__ out,           /* out: n_entries * E bytes, the decoded entries */                      \
      int* __restrict__ error,             /* in/out: one int, ORed with BUDDY_ERR_* bits */                        \
      long long n_entries,                 /* number of entries, not bytes */                                       \
      int word_bytes) {                    /* word size in bytes: 1, 2, 4 or 8 */                                   \
    BUDDY_WORD_SWITCH(CODEC, buddy_decode_body,                                                                     \
                      if (blockIdx.x == 0 && threadIdx.x == 0) atomicOr(error, (int)BUDDY_ERR_WORD), payload,       \
                      sectors, modes, out, error, n_entries)                                                        \
  }

BUDDY_ENTRY_KERNELS(zvc, BuddyZvc)
