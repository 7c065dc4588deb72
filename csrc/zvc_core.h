// ZVC (zero-value compression) of one entry: the logic the CUDA kernels
// (csrc/zvc.cu) run, host-compilable so the tests check it byte for byte
// against the torch reference (buddy/codecs/zvc.py) without a GPU.
//
// Payload of an entry of E = BUDDY_ENTRY_BYTES bytes read as W = E / w words
// of w bytes (w = 1, 2, 4 or 8, from buddy.spec.word_bytes):
//   bytes [0, B)       bitmap, B = ceil(W / 8); bit j of byte b (LSB first)
//                      is set iff word 8*b + j is non-zero
//   bytes [B, P)       zeros, P = B rounded up to a multiple of w
//   bytes [P, P+n*w)   the n non-zero words, in order
//   rest               zeros up to E
// k = ceil((P + n*w) / 32) sectors; k = 0 for an all-zero entry; k = E/32
// (raw escape: the payload is the entry itself) when the encoding would not
// be smaller than the entry.
//
// Each operation exists twice:
//   buddy_zvc_*_entry   one thread does the whole entry (the plain statement
//                       of the format; host tests)
//   buddy_zvc_warp_*    the 32 lanes of a warp share one entry. Written against
//                       a Warp type (lane, ballot, shuffles) so the very same
//                       code runs on the GPU (BuddyCudaWarp in zvc.cu) and on
//                       the host under an emulated warp (tests/zvc_host.cpp).
//                       Every lane must call them with the same arguments
//                       (control flow is uniform across the warp).
// Pointers to entries, payloads and outputs address E bytes each and must be
// 8-byte aligned; entries and payloads never alias.
#pragma once

#include "buddy_format.h"

#if !defined(__CUDACC_RTC__)
#include <string.h>
#endif

#ifdef __CUDACC__
#define BUDDY_WARP_FN __device__ __forceinline__
#else
#define BUDDY_WARP_FN inline
#endif

#define BUDDY_WARP_SIZE 32u

// Error bits of a decode; a kernel ORs them over its entries.
#define BUDDY_ZVC_ERR_K 1u       // k > E/32
#define BUDDY_ZVC_ERR_BITMAP 2u  // a coded entry's bitmap population does not give its k
#define BUDDY_ZVC_ERR_MODE 4u    // a metadata mode zvc never writes (zvc writes 0)
#define BUDDY_ZVC_ERR_WORD 8u    // word size not 1, 2, 4 or 8

template <int N>
struct buddy_uint;
template <>
struct buddy_uint<1> {
  typedef uint8_t type;
};
template <>
struct buddy_uint<2> {
  typedef uint16_t type;
};
template <>
struct buddy_uint<4> {
  typedef uint32_t type;
};
template <>
struct buddy_uint<8> {
  typedef uint64_t type;
};

// Unaligned-safe on the host (memcpy), a plain aligned access on the device.
template <class T>
BUDDY_HD T buddy_load(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const T*>(p);
#else
  T v;
  memcpy(&v, p, sizeof(T));
  return v;
#endif
}

template <class T>
BUDDY_HD void buddy_store(uint8_t* p, T v) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<T*>(p) = v;
#else
  memcpy(p, &v, sizeof(T));
#endif
}

BUDDY_HD uint32_t buddy_popc(uint32_t x) {
#if defined(__CUDA_ARCH__)
  return (uint32_t)__popc(x);
#else
  return (uint32_t)__builtin_popcount(x);
#endif
}

// Geometry of an entry read as words of WB bytes, and its warp tiling.
template <int WB>
struct buddy_zvc_geometry {
  static_assert(WB == 1 || WB == 2 || WB == 4 || WB == 8, "zvc words are 1, 2, 4 or 8 bytes");
  typedef typename buddy_uint<WB>::type word_t;
  static constexpr uint32_t entry = BUDDY_ENTRY_BYTES;            // bytes per entry, E
  static constexpr uint32_t words = entry / WB;                    // words per entry, W
  static constexpr uint32_t bitmap = (words + 7) / 8;              // bitmap bytes, B
  static constexpr uint32_t padded = (bitmap + WB - 1) / WB * WB;  // bitmap + padding bytes, P
  static constexpr uint32_t body_words = (entry - padded) / WB;    // word slots after the bitmap
  static constexpr uint32_t raw = BUDDY_SECTORS_PER_ENTRY;         // k of the raw escape

  // Warp tiling: per step, lane l owns `lane_words` consecutive words
  // (a `chunk`-byte load) starting at word step * step_words + l * lane_words.
  static constexpr uint32_t chunk = WB < 4 ? 4 : WB;                         // bytes per lane per step
  static constexpr uint32_t lane_words = chunk / WB;                         // 4, 2, 1, 1
  static constexpr uint32_t step_words = BUDDY_WARP_SIZE * lane_words;       // words per warp step
  static constexpr uint32_t steps = (words + step_words - 1) / step_words;  // steps per entry
  typedef typename buddy_uint<chunk>::type chunk_t;

  static_assert(words * WB == entry, "an entry is a whole number of words");
  static_assert(words % lane_words == 0, "a lane's chunk is wholly inside the entry or wholly outside");
  static_assert(entry % 8 == 0, "entries are copied in 8-byte units");
};

// Sectors k of an entry with nnz non-zero words.
template <int WB>
BUDDY_HD uint32_t buddy_zvc_sectors(uint32_t nnz) {
  typedef buddy_zvc_geometry<WB> G;
  if (nnz == 0) return 0u;
  const uint32_t k = (G::padded + nnz * (uint32_t)WB + BUDDY_SECTOR_BYTES - 1) / BUDDY_SECTOR_BYTES;
  return k < G::raw ? k : G::raw;
}

// Word i (0-based, little endian) of a lane's chunk.
template <int WB>
BUDDY_HD typename buddy_zvc_geometry<WB>::word_t buddy_zvc_chunk_word(typename buddy_zvc_geometry<WB>::chunk_t c,
                                                                      uint32_t i) {
  typedef buddy_zvc_geometry<WB> G;
  if constexpr (G::lane_words == 1) {
    (void)i;
    return (typename G::word_t)c;
  } else {
    return (typename G::word_t)(c >> (8u * WB * i));
  }
}

// Bit i set iff word i of the chunk is non-zero.
template <int WB>
BUDDY_HD uint32_t buddy_zvc_chunk_mask(typename buddy_zvc_geometry<WB>::chunk_t c) {
  typedef buddy_zvc_geometry<WB> G;
  uint32_t m = 0;
  for (uint32_t i = 0; i < G::lane_words; ++i) m |= (uint32_t)(buddy_zvc_chunk_word<WB>(c, i) != 0) << i;
  return m;
}

// Non-zero words recorded in a payload's bitmap (bits past the last word ignored).
template <int WB>
BUDDY_HD uint32_t buddy_zvc_bitmap_count(const uint8_t* payload) {
  typedef buddy_zvc_geometry<WB> G;
  uint32_t n = 0;
  if constexpr (G::words >= 8) {
    for (uint32_t b = 0; b < G::words / 8; ++b) n += buddy_popc(payload[b]);
  }
  if (G::words % 8) n += buddy_popc(payload[G::words / 8] & ((1u << (G::words % 8)) - 1u));
  return n;
}

// ---------------------------------------------------------------------------
// One thread per entry
// ---------------------------------------------------------------------------

// Non-zero words of an entry.
template <int WB>
BUDDY_HD uint32_t buddy_zvc_count_entry(const uint8_t* entry) {
  typedef buddy_zvc_geometry<WB> G;
  uint32_t nnz = 0;
  for (uint32_t j = 0; j < G::words; ++j) nnz += buddy_load<typename G::word_t>(entry + j * WB) != 0;
  return nnz;
}

// Writes all E bytes of the payload; returns k.
template <int WB>
BUDDY_HD uint32_t buddy_zvc_encode_entry(const uint8_t* entry, uint8_t* payload) {
  typedef buddy_zvc_geometry<WB> G;
  const uint32_t k = buddy_zvc_sectors<WB>(buddy_zvc_count_entry<WB>(entry));
  if (k == G::raw) {
    for (uint32_t i = 0; i < G::entry; ++i) payload[i] = entry[i];
    return k;
  }
  for (uint32_t i = 0; i < G::entry; ++i) payload[i] = 0;
  uint32_t pos = G::padded;
  for (uint32_t j = 0; j < G::words; ++j) {
    const typename G::word_t w = buddy_load<typename G::word_t>(entry + j * WB);
    if (w != 0) {
      payload[j / 8] = (uint8_t)(payload[j / 8] | (1u << (j % 8)));
      buddy_store<typename G::word_t>(payload + pos, w);
      pos += WB;
    }
  }
  return k;
}

// Writes all E bytes of out; returns BUDDY_ZVC_ERR_* bits (0: fine). An entry
// whose k or bitmap is inconsistent decodes to zeros and reads no payload byte
// past k * 32.
template <int WB>
BUDDY_HD uint32_t buddy_zvc_decode_entry(const uint8_t* payload, uint32_t k, uint32_t mode, uint8_t* out) {
  typedef buddy_zvc_geometry<WB> G;
  uint32_t err = mode != 0 ? BUDDY_ZVC_ERR_MODE : 0u;
  if (k > G::raw) err |= BUDDY_ZVC_ERR_K;
  if (k != 0 && k < G::raw && buddy_zvc_sectors<WB>(buddy_zvc_bitmap_count<WB>(payload)) != k)
    err |= BUDDY_ZVC_ERR_BITMAP;
  if (k == G::raw) {
    for (uint32_t i = 0; i < G::entry; ++i) out[i] = payload[i];
    return err;
  }
  if (k == 0 || (err & (BUDDY_ZVC_ERR_K | BUDDY_ZVC_ERR_BITMAP))) {
    for (uint32_t i = 0; i < G::entry; ++i) out[i] = 0;
    return err;
  }
  uint32_t pos = G::padded;
  for (uint32_t j = 0; j < G::words; ++j) {
    typename G::word_t w = 0;
    if ((payload[j / 8] >> (j % 8)) & 1u) {
      w = buddy_load<typename G::word_t>(payload + pos);
      pos += WB;
    }
    buddy_store<typename G::word_t>(out + j * WB, w);
  }
  return err;
}

// ---------------------------------------------------------------------------
// One warp per entry. Warp provides (all lanes call each, in the same order):
//   uint32_t lane() const                          0..31
//   uint32_t ballot(bool p) const                  bit l: p of lane l
//   uint32_t shfl(uint32_t v, uint32_t src) const  v of lane src
//   uint32_t shfl_xor(uint32_t v, uint32_t m) const
//   uint32_t shfl_up(uint32_t v, uint32_t d) const  v of lane l - d (own v when l < d)
// ---------------------------------------------------------------------------

// Sum of v over the warp, on every lane.
template <class Warp>
BUDDY_WARP_FN uint32_t buddy_warp_sum(const Warp& warp, uint32_t v) {
  for (uint32_t d = BUDDY_WARP_SIZE / 2; d > 0; d >>= 1) v += warp.shfl_xor(v, d);
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

// Non-zero words before this lane's chunk in the current step (*total: in the
// whole step), from each lane's chunk mask m.
template <int WB, class Warp>
BUDDY_WARP_FN uint32_t buddy_zvc_warp_rank(const Warp& warp, uint32_t m, uint32_t* total) {
  if constexpr (buddy_zvc_geometry<WB>::lane_words == 1) {
    // one word per lane: the bitmap of the step is a ballot
    const uint32_t bits = warp.ballot(m != 0);
    *total = buddy_popc(bits);
    return buddy_popc(bits & ((1u << warp.lane()) - 1u));
  } else {
    return buddy_warp_exclusive_scan(warp, buddy_popc(m), total);
  }
}

// Copies an entry (src) or writes zeros (src == nullptr), 8 bytes per lane store.
template <class Warp>
BUDDY_WARP_FN void buddy_warp_fill_entry(const Warp& warp, const uint8_t* src, uint8_t* dst) {
  for (uint32_t u = warp.lane(); u < BUDDY_ENTRY_BYTES / 8; u += BUDDY_WARP_SIZE)
    buddy_store<uint64_t>(dst + 8 * u, src ? buddy_load<uint64_t>(src + 8 * u) : (uint64_t)0);
}

// Non-zero words of an entry, on every lane.
template <int WB, class Warp>
BUDDY_WARP_FN uint32_t buddy_zvc_warp_count(const Warp& warp, const uint8_t* entry) {
  typedef buddy_zvc_geometry<WB> G;
  uint32_t mine = 0;
  for (uint32_t s = 0; s < G::steps; ++s) {
    const uint32_t first = s * G::step_words + warp.lane() * G::lane_words;
    if (first < G::words)
      mine += buddy_popc(buddy_zvc_chunk_mask<WB>(buddy_load<typename G::chunk_t>(entry + first * WB)));
  }
  return buddy_warp_sum(warp, mine);
}

// Writes all E bytes of the payload; returns k (on every lane).
template <int WB, class Warp>
BUDDY_WARP_FN uint32_t buddy_zvc_warp_encode(const Warp& warp, const uint8_t* entry, uint8_t* payload) {
  typedef buddy_zvc_geometry<WB> G;
  typedef typename G::word_t word_t;
  typedef typename G::chunk_t chunk_t;
  const uint32_t lane = warp.lane();
  const uint32_t nnz = buddy_zvc_warp_count<WB>(warp, entry);
  const uint32_t k = buddy_zvc_sectors<WB>(nnz);
  if (k == G::raw || k == 0) {
    buddy_warp_fill_entry(warp, k ? entry : nullptr, payload);
    return k;
  }
  uint32_t before = 0;  // non-zero words in earlier steps
  for (uint32_t s = 0; s < G::steps; ++s) {
    const uint32_t first = s * G::step_words + lane * G::lane_words;
    const bool valid = first < G::words;
    const chunk_t c = valid ? buddy_load<chunk_t>(entry + first * WB) : (chunk_t)0;
    const uint32_t m = buddy_zvc_chunk_mask<WB>(c);
    uint32_t total;
    uint32_t pos = G::padded + (before + buddy_zvc_warp_rank<WB>(warp, m, &total)) * WB;
    for (uint32_t i = 0; i < G::lane_words; ++i) {
      if ((m >> i) & 1u) {
        buddy_store<word_t>(payload + pos, buddy_zvc_chunk_word<WB>(c, i));
        pos += WB;
      }
    }
    // bitmap: the lanes whose words share a byte OR their bits together, and
    // the lane holding the byte's first word writes it
    const uint32_t shift = (lane * G::lane_words) & 7u;
    uint32_t bits = m << shift;
    for (uint32_t d = 1; d < 8 / G::lane_words; d <<= 1) bits |= warp.shfl_xor(bits, d);
    if (valid && shift == 0) payload[first / 8] = (uint8_t)bits;
    before += total;
  }
  // zeros: the bitmap's padding [B, P) and everything after the packed words
  if constexpr (G::padded > G::bitmap) {
    if (lane < G::padded - G::bitmap) payload[G::bitmap + lane] = 0;
  }
  const uint32_t tail = G::padded + nnz * WB;  // first byte after the packed words
  const uint32_t aligned = (tail + 7u) & ~7u;  // next 8-byte boundary (<= E: E is a multiple of 8)
  if (lane < aligned - tail) payload[tail + lane] = 0;
  for (uint32_t u = aligned / 8 + lane; u < G::entry / 8; u += BUDDY_WARP_SIZE)
    buddy_store<uint64_t>(payload + 8 * u, (uint64_t)0);
  return k;
}

// Writes all E bytes of out; returns BUDDY_ZVC_ERR_* bits (on every lane), as
// buddy_zvc_decode_entry. Reads no payload byte past k * 32 (nor past E).
template <int WB, class Warp>
BUDDY_WARP_FN uint32_t buddy_zvc_warp_decode(const Warp& warp, const uint8_t* payload, uint32_t k, uint32_t mode,
                                             uint8_t* out) {
  typedef buddy_zvc_geometry<WB> G;
  typedef typename G::word_t word_t;
  typedef typename G::chunk_t chunk_t;
  const uint32_t lane = warp.lane();
  uint32_t err = mode != 0 ? BUDDY_ZVC_ERR_MODE : 0u;
  if (k > G::raw) err |= BUDDY_ZVC_ERR_K;
  if (k != 0 && k < G::raw) {
    // the bitmap must agree with k before any word is read through it
    uint32_t mine = 0;
    if constexpr (G::words >= 8) {
      for (uint32_t b = lane; b < G::words / 8; b += BUDDY_WARP_SIZE) mine += buddy_popc(payload[b]);
    }
    if (G::words % 8 && lane == 0) mine += buddy_popc(payload[G::words / 8] & ((1u << (G::words % 8)) - 1u));
    if (buddy_zvc_sectors<WB>(buddy_warp_sum(warp, mine)) != k) err |= BUDDY_ZVC_ERR_BITMAP;
  }
  if (k == G::raw || k == 0 || (err & (BUDDY_ZVC_ERR_K | BUDDY_ZVC_ERR_BITMAP))) {
    buddy_warp_fill_entry(warp, k == G::raw ? payload : nullptr, out);
    return err;
  }
  uint32_t before = 0;  // non-zero words in earlier steps
  for (uint32_t s = 0; s < G::steps; ++s) {
    const uint32_t first = s * G::step_words + lane * G::lane_words;
    const bool valid = first < G::words;
    const uint32_t m = valid ? (uint32_t)(payload[first / 8] >> (first & 7u)) & ((1u << G::lane_words) - 1u) : 0u;
    uint32_t total;
    uint32_t pos = G::padded + (before + buddy_zvc_warp_rank<WB>(warp, m, &total)) * WB;
    chunk_t c = 0;
    for (uint32_t i = 0; i < G::lane_words; ++i) {
      if ((m >> i) & 1u) {
        c |= (chunk_t)buddy_load<word_t>(payload + pos) << (8u * WB * i);
        pos += WB;
      }
    }
    if (valid) buddy_store<chunk_t>(out + first * WB, c);
    before += total;
  }
  return err;
}
