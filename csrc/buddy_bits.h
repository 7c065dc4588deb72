// Little-endian bit streams in a payload, shared by the variable-length
// device codecs (fpx, fpe): the bit order of buddy/codecs/_bitstream.py.
// Stream bit t is bit t % 8 of payload byte t / 8; a field of width w holding
// v occupies stream bits [pos, pos + w), bit i of v at stream bit pos + i.
//
// Writers OR fields into a zeroed payload viewed as 32-bit words; lanes of a
// warp may share a word, hence the atomics. Only words that receive set bits
// are touched, so nothing past the stream is written. Readers take a payload
// of n64 8-byte words: bits past it read as zero and are never loaded.
#pragma once

#include "buddy_warp.h"

// The float split of a word of WB bytes, shared by fpx and fpe (SPLITS in
// buddy/codecs/fpx.py): sign (1 bit) | exponent (e) | mantissa (m); 1-byte
// words as e4m3, 2-byte words as bfloat16 (float16 included).
template <int WB>
struct buddy_float_split {
  static constexpr uint32_t e = WB == 1 ? 4 : WB == 8 ? 11 : 8;
  static constexpr uint32_t m = 8u * WB - 1u - e;
};

// ORs v (its set bits inside the stream) into the stream at bit pos.
BUDDY_HD void buddy_put32(uint32_t* stream, uint32_t pos, uint32_t v) {
#if defined(BUDDY_NATIVE_SOLO)
  // one lane writes its own staging buffer, which native.cpp follows with spare bytes: one 8-byte OR, no branch
  uint64_t w;
  memcpy(&w, stream + (pos >> 5), 8);
  w |= (uint64_t)v << (pos & 31u);
  memcpy(stream + (pos >> 5), &w, 8);
  return;
#endif
  const uint32_t s = pos & 31u;
  const uint32_t lo = v << s;
  const uint32_t hi = (v >> 1) >> (31u - s);  // v >> (32 - s), 0 for s = 0
  if (lo) buddy_atomic_or(stream + (pos >> 5), lo);
  if (hi) buddy_atomic_or(stream + (pos >> 5) + 1, hi);
}

BUDDY_HD void buddy_put64(uint32_t* stream, uint32_t pos, uint64_t v) {
  const uint32_t s = pos & 31u;
  const uint64_t lo = v << s;
  const uint32_t spill = (uint32_t)((v >> 1) >> (63u - s));  // v >> (64 - s), 0 for s = 0
  if ((uint32_t)lo) buddy_atomic_or(stream + (pos >> 5), (uint32_t)lo);
  if (lo >> 32) buddy_atomic_or(stream + (pos >> 5) + 1, (uint32_t)(lo >> 32));
  if (spill) buddy_atomic_or(stream + (pos >> 5) + 2, spill);
}

// The 64 stream bits from bit pos of a payload of n64 8-byte words.
BUDDY_HD uint64_t buddy_peek(const uint8_t* payload, uint32_t n64, uint32_t pos) {
  const uint32_t q = pos >> 6, s = pos & 63u;
  const uint64_t lo = q < n64 ? buddy_load<uint64_t>(payload + 8u * q) : 0u;
  const uint64_t hi = q + 1u < n64 ? buddy_load<uint64_t>(payload + 8u * (q + 1u)) : 0u;
  return (lo >> s) | ((hi << 1) << (63u - s));  // hi << (64 - s), 0 for s = 0
}

// The 32 stream bits from bit pos (< the payload's bits) of a payload
// followed by at least 8 zero bytes (buddy_op_unpack's staging for the
// codecs that decode there): two 4-byte loads and a funnel shift, no bounds.
BUDDY_HD uint32_t buddy_peek32_padded(const uint8_t* payload, uint32_t pos) {
  const uint32_t q = pos >> 5;
  const uint32_t lo = buddy_load<uint32_t>(payload + 4u * q), hi = buddy_load<uint32_t>(payload + 4u * q + 4u);
  return buddy_funnel_r(lo, hi, pos);
}

// Whether a bit at or after stream bit `total` is set in a payload of n64
// 8-byte words: this lane's share of the words (OR it over the warp).
template <class Warp>
BUDDY_WARP_FN bool buddy_bits_after(const Warp& warp, const uint8_t* payload, uint32_t n64, uint32_t total) {
  bool set = false;
  for (uint32_t u = total / 64u + warp.lane(); u < n64; u += BUDDY_WARP_SIZE) {
    const uint64_t after = u == total / 64u ? ~(uint64_t)0 << (total % 64u) : ~(uint64_t)0;
    set |= (buddy_load<uint64_t>(payload + 8u * u) & after) != 0;
  }
  return set;
}

// Whether a bit in [lo, hi) of a payload of n64 8-byte words is set (none when hi <= lo): this lane's share
// of the words (OR it over the warp). Read by 4-byte words (the gap between the split layout's codes and tails,
// its one use, is a few of them: 32-bit masks, no 64-bit ones).
template <class Warp>
BUDDY_WARP_FN bool buddy_bits_between(const Warp& warp, const uint8_t* payload, uint32_t n64, uint32_t lo,
                                      uint32_t hi) {
  bool set = false;
  hi = buddy_min(hi, 64u * n64);
  if (lo >= hi) return false;
  const uint32_t first = lo / 32u, last = (hi - 1u) / 32u;
  for (uint32_t u = first + warp.lane(); u <= last; u += BUDDY_WARP_SIZE) {
    uint32_t w = buddy_load<uint32_t>(payload + 4u * u);
    if (u == first) w &= ~0u << (lo % 32u);
    if (u == last) w &= ~0u >> (31u - (hi - 1u) % 32u);
    set |= w != 0u;
  }
  return set;
}
