// ZVC (zero-value compression, cDMA, Rhu et al. HPCA 2018) of one entry, one
// warp per entry: the device codec the kernels run, host-compilable so the
// tests check it byte for byte against the torch reference
// (buddy/codecs/zvc.py) under an emulated warp.
//
// Payload of a coded entry of E = BUDDY_ENTRY_BYTES bytes read as W = E / w
// words of w bytes (w = 1, 2, 4 or 8, from buddy.spec.word_bytes):
//   bytes [0, B)       bitmap, B = ceil(W / 8); bit j of byte b (LSB first)
//                      is set iff word 8*b + j is non-zero
//   bytes [B, P)       zeros, P = B rounded up to a multiple of w
//   bytes [P, P+n*w)   the n non-zero words, in order
//   rest               zeros up to the sector boundary
// k = ceil((P + n*w) / 32) sectors. The format layer (buddy_entry.h) stores
// all-zero entries as k = 0 and entries with k >= E/32 raw.
//
// Every device codec (codec_*.h) is a class template over the word size WB
// with this interface (all lanes of a warp call each function together, on a
// codec object; see buddy_codec() in buddy_entry.h):
//
//   static constexpr bool TABLED                    whether it codes with a
//       table the tensor carries (format version 2; codec_fpe.h). Such a codec
//       is built from the kernels' table argument, Codec(table), and its
//       functions read the table; a codec without one is empty, Codec().
//   static constexpr uint32_t ZERO_MODE, RAW_MODE   metadata modes of an
//                                                   all-zero and a raw entry
//   static bool coded_mode(uint32_t mode)           modes of coded entries
//   uint32_t measure(warp, entry, &mode)            coded size in sectors of a
//       non-zero entry, before the raw clamp (>= 1); *mode: its metadata mode.
//       The same on every lane.
//   void encode(warp, entry, k, mode, payload)      writes bytes [0, 32k) of
//       the payload of a non-zero entry that measured k < E/32 sectors with
//       this mode: its stream, then zero bits. Writes nothing else.
//   uint32_t decode(warp, payload, k, mode, out)    a coded entry (0 < k <
//       E/32, coded_mode(mode)) back into all E bytes of out. Reads payload
//       bytes [0, 32k + DECODE_PAD); bytes after them (the rest of a staging
//       buffer) may hold anything and never change a valid decode. Returns 0,
//       or BUDDY_ERR_STREAM when the payload disagrees with k (out is then
//       zeros).
//   static constexpr uint32_t DECODE_PAD (optional, 0 when absent)  zero
//       bytes the decoder needs after the payload (buddy_op_unpack writes
//       them into its staging: k < E/32 leaves room), so its reads of a few
//       bytes at a place inside the payload need no bounds (codec_fpe.h).
// Pointers address E bytes each, are 8-byte aligned, and never alias.
#pragma once

#include "buddy_format.h"
#include "buddy_warp.h"

template <int WB>
struct BuddyZvc {
  static_assert(WB == 1 || WB == 2 || WB == 4 || WB == 8, "zvc words are 1, 2, 4 or 8 bytes");
  typedef typename buddy_uint<WB>::type word_t;
  static constexpr bool TABLED = false;
  static constexpr uint32_t ZERO_MODE = 0;
  static constexpr uint32_t RAW_MODE = 0;
  static constexpr uint32_t entry = BUDDY_ENTRY_BYTES;            // bytes per entry, E
  static constexpr uint32_t words = entry / WB;                    // words per entry, W
  static constexpr uint32_t bitmap = (words + 7) / 8;              // bitmap bytes, B
  static constexpr uint32_t padded = (bitmap + WB - 1) / WB * WB;  // bitmap + padding bytes, P

  // Warp tiling: per step, lane l owns `lane_words` consecutive words
  // (a `chunk`-byte load) starting at word step * step_words + l * lane_words.
  static constexpr uint32_t chunk = WB < 4 ? 4 : WB;                         // bytes per lane per step
  static constexpr uint32_t lane_words = chunk / WB;                         // 4, 2, 1, 1
  static constexpr uint32_t step_words = BUDDY_WARP_SIZE * lane_words;       // words per warp step
  static constexpr uint32_t steps = (words + step_words - 1) / step_words;  // steps per entry
  typedef typename buddy_uint<chunk>::type chunk_t;

  static_assert(words * WB == entry, "an entry is a whole number of words");
  static_assert(words % lane_words == 0, "a lane's chunk is wholly inside the entry or wholly outside");

  static BUDDY_HD bool coded_mode(uint32_t mode) { return mode == 0; }

  // Sectors of a coded entry with nnz non-zero words (before the raw clamp).
  static BUDDY_HD uint32_t sectors(uint32_t nnz) {
    return (padded + nnz * (uint32_t)WB + BUDDY_SECTOR_BYTES - 1) / BUDDY_SECTOR_BYTES;
  }

  // Word i (0-based, little endian) of a lane's chunk.
  static BUDDY_HD word_t chunk_word(chunk_t c, uint32_t i) {
    if constexpr (lane_words == 1) {
      (void)i;
      return (word_t)c;
    } else {
      return (word_t)(c >> (8u * WB * i));
    }
  }

  // Bit i set iff word i of the chunk is non-zero.
  static BUDDY_HD uint32_t chunk_mask(chunk_t c) {
    uint32_t m = 0;
    for (uint32_t i = 0; i < lane_words; ++i) m |= (uint32_t)(chunk_word(c, i) != 0) << i;
    return m;
  }

  // Non-zero words before this lane's chunk in the current step (*total: in
  // the whole step), from each lane's chunk mask m.
  template <class Warp>
  static BUDDY_WARP_FN uint32_t rank(const Warp& warp, uint32_t m, uint32_t* total) {
    if constexpr (lane_words == 1) {
      // one word per lane: the bitmap of the step is a ballot
      const uint32_t bits = warp.ballot(m != 0);
      *total = buddy_popc(bits);
      return buddy_popc(bits & ((1u << warp.lane()) - 1u));
    } else {
      return buddy_warp_exclusive_scan(warp, buddy_popc(m), total);
    }
  }

  // Non-zero words of an entry, on every lane.
  template <class Warp>
  static BUDDY_WARP_FN uint32_t count(const Warp& warp, const uint8_t* entry_bytes) {
    uint32_t mine = 0;
    for (uint32_t s = 0; s < steps; ++s) {
      const uint32_t first = s * step_words + warp.lane() * lane_words;
      if (first < words) mine += buddy_popc(chunk_mask(buddy_load<chunk_t>(entry_bytes + first * WB)));
    }
    return buddy_warp_sum(warp, mine);
  }

  template <class Warp>
  static BUDDY_WARP_FN uint32_t measure(const Warp& warp, const uint8_t* entry_bytes, uint32_t* mode) {
    *mode = 0;
    return sectors(count(warp, entry_bytes));
  }

  template <class Warp>
  static BUDDY_WARP_FN void encode(const Warp& warp, const uint8_t* entry_bytes, uint32_t k, uint32_t mode,
                                   uint8_t* payload) {
    (void)mode;
    const uint32_t lane = warp.lane();
    uint32_t before = 0;  // non-zero words in earlier steps
    for (uint32_t s = 0; s < steps; ++s) {
      const uint32_t first = s * step_words + lane * lane_words;
      const bool valid = first < words;
      const chunk_t c = valid ? buddy_load<chunk_t>(entry_bytes + first * WB) : (chunk_t)0;
      const uint32_t m = chunk_mask(c);
      uint32_t total;
      uint32_t pos = padded + (before + rank(warp, m, &total)) * WB;
      for (uint32_t i = 0; i < lane_words; ++i) {
        if constexpr (BUDDY_WARP_SIZE == 1) {  // one lane: every word stored, a zero one overwritten by the next
          buddy_store<word_t>(payload + pos, chunk_word(c, i));
          pos += WB * ((m >> i) & 1u);
        } else if ((m >> i) & 1u) {
          buddy_store<word_t>(payload + pos, chunk_word(c, i));
          pos += WB;
        }
      }
      // bitmap: the lanes whose words share a byte OR their bits together, and
      // the lane holding the byte's first word writes it (a warp of one lane:
      // its steps share the byte, the first writes it and the others OR in)
      const uint32_t shift = BUDDY_WARP_SIZE == 1 ? first & 7u : (lane * lane_words) & 7u;
      uint32_t bits = m << shift;
      if constexpr (BUDDY_WARP_SIZE == 1) {
        if (valid) payload[first / 8] = (uint8_t)(shift ? payload[first / 8] | bits : bits);
      } else {
        for (uint32_t d = 1; d < 8 / lane_words; d <<= 1) bits |= warp.shfl_xor(bits, d);
        if (valid && shift == 0) payload[first / 8] = (uint8_t)bits;
      }
      before += total;
    }
    // zeros: the bitmap's padding [B, P) and everything after the packed words up to 32k
    // (fewer than 8 bytes each: a lane a byte, or one lane's loop)
    const uint32_t tail = padded + before * WB;  // first byte after the packed words
    const uint32_t aligned = (tail + 7u) & ~7u;  // next 8-byte boundary (<= 32k: a multiple of 8)
    if constexpr (BUDDY_WARP_SIZE == 1) {
      for (uint32_t b = bitmap; b < padded; ++b) payload[b] = 0;
      for (uint32_t b = tail; b < aligned; ++b) payload[b] = 0;
    } else {
      if constexpr (padded > bitmap) {
        if (lane < padded - bitmap) payload[bitmap + lane] = 0;
      }
      if (lane < aligned - tail) payload[tail + lane] = 0;
    }
    for (uint32_t u = aligned / 8 + lane; u < k * (BUDDY_SECTOR_BYTES / 8); u += BUDDY_WARP_SIZE)
      buddy_store<uint64_t>(payload + 8 * u, (uint64_t)0);
  }

  template <class Warp>
  static BUDDY_WARP_FN uint32_t decode(const Warp& warp, const uint8_t* payload, uint32_t k, uint32_t mode,
                                       uint8_t* out) {
    (void)mode;
    const uint32_t lane = warp.lane();
    if (padded > k * BUDDY_SECTOR_BYTES) {  // the bitmap alone needs more sectors: read nothing past 32k
      buddy_warp_fill(warp, nullptr, out, entry);
      return BUDDY_ERR_STREAM;
    }
    // The bitmap must give k before any word is read through it; it lies
    // inside the payload's 32k bytes, and so do the words it lists.
    uint32_t mine = 0;
    if constexpr (words >= 8) {
      for (uint32_t b = lane; b < words / 8; b += BUDDY_WARP_SIZE) mine += buddy_popc(payload[b]);
    }
    if (words % 8 && lane == 0) mine += buddy_popc(payload[words / 8] & ((1u << (words % 8)) - 1u));
    if (sectors(buddy_warp_sum(warp, mine)) != k) {
      buddy_warp_fill(warp, nullptr, out, entry);
      return BUDDY_ERR_STREAM;
    }
    uint32_t before = 0;  // non-zero words in earlier steps
    for (uint32_t s = 0; s < steps; ++s) {
      const uint32_t first = s * step_words + lane * lane_words;
      const bool valid = first < words;
      const uint32_t m = valid ? (uint32_t)(payload[first / 8] >> (first & 7u)) & ((1u << lane_words) - 1u) : 0u;
      uint32_t total;
      uint32_t pos = padded + (before + rank(warp, m, &total)) * WB;
      chunk_t c = 0;
      for (uint32_t i = 0; i < lane_words; ++i) {
        if constexpr (BUDDY_WARP_SIZE == 1) {  // one lane: no branch on zero words (pos stays inside 32k bytes)
          const word_t keep = (word_t)0 - (word_t)((m >> i) & 1u);
          c |= (chunk_t)(buddy_load<word_t>(payload + pos) & keep) << (8u * WB * i);
          pos += WB * ((m >> i) & 1u);
        } else if ((m >> i) & 1u) {
          c |= (chunk_t)buddy_load<word_t>(payload + pos) << (8u * WB * i);
          pos += WB;
        }
      }
      if (valid) buddy_store<chunk_t>(out + first * WB, c);
      before += total;
    }
    return 0;
  }
};
