// fpx (float-aware exponent offsets with escapes) of one entry, one warp per
// entry: the device codec the kernels run, host-compilable so the tests check
// it byte for byte against the torch reference (buddy/codecs/fpx.py, whose
// module docstring specifies the format) under an emulated warp. The
// interface is the one every device codec has (see codec_zvc.h).
//
// An entry of E = BUDDY_ENTRY_BYTES bytes is W = E / w words of w bytes; a
// word is sign | exponent field x (e bits) | mantissa (m bits), with
// (e, m) = (4, 3), (8, 7), (8, 23), (11, 52) for w = 1, 2, 4, 8. Payload: a
// little-endian bit stream (stream bit t is bit t % 8 of byte t / 8, a
// field's bit 0 first):
//   header   zmode (1) | emax (e) | b (BB = 3, 4, 4, 4 bits)         H bits
//   bitmap   W bits, bit i set iff word i is non-zero         (zmode 1 only)
//   words    per listed word (all in zmode 0, the non-zero ones in zmode 1),
//            in order: code (b bits: emax - x, or all ones: escape) |
//            sign-mantissa (1 + m bits: sign << m | mantissa)
//   escapes  per escaped word, in order: x (e bits)
// A word escapes iff b > 0 and emax - x >= 2^b - 1. The encoder picks the
// zmode and b (0 <= b <= e + 1) of the shortest stream, T bits (ties: zmode
// 0, then the smaller b; b = 0 only when no listed word would escape at
// b = 1), and k = ceil(T / 256); only mode 0 is used. (b = e + 1 is never
// picked, as b = 1 is never longer, but the decoder accepts it.)
//
// Warp decomposition: a round is 32 consecutive words, lane l holding word
// 32 r + l, so a ballot over a round is 32 bits of the bitmap and a popc of
// a ballot under the lane's mask is its rank among the listed (or escaped)
// words of the round.
//   measure  two passes over the entry, 16 bytes a lane a round (which
//            lane holds a word does not matter to a maximum or a count):
//            emax (warp max) and the non-zero count (the census, which auto
//            also sizes zvc by); then per lane a histogram of how far below
//            emax its words lie (one shift and add per word), turned into
//            the number of escapes at every code width b and summed over the
//            warp, two 16-bit counters per shuffle. Every T(zmode, b)
//            follows from these.
//   encode   the same choice (mode 0 carries neither zmode nor b, so encode
//            repeats measure's work), then per round every lane ORs its fields
//            (code | sign-mantissa at start + rank * (b + 1 + m), an escape
//            at escape start + escape rank * e) as 32-bit words into the
//            zeroed payload; lane 0 ORs the header and the round's bitmap.
//   decode   one pass: ranks from the bitmap (read by every lane) or the
//            word index, each lane reads its field and, for an escape, its
//            escape; the checks (stream length against k, zero bits after
//            the stream, codes not below exponent 0) come after the pass,
//            and a failed entry is zeroed. Reads past 32k bytes give zero
//            bits and are never made.
#pragma once

#include "buddy_bits.h"
#include "buddy_format.h"

// Loops over an fpx word's code widths: unrolled on the device so per-width
// counters live in registers (their indices are then constants).
// The choice's loops over a lane's 16-byte units are kept rolled there: unrolled, their loads in flight take
// the registers of a few more warps.
#if defined(__CUDACC__)
#define BUDDY_FPX_UNROLL _Pragma("unroll")
#define BUDDY_FPX_ROLLED _Pragma("unroll 1")
#else
#define BUDDY_FPX_UNROLL
#define BUDDY_FPX_ROLLED
#endif

template <int WB>
struct BuddyFpx {
  static_assert(WB == 1 || WB == 2 || WB == 4 || WB == 8, "fpx words are 1, 2, 4 or 8 bytes");
  typedef typename buddy_uint<WB>::type word_t;
  typedef typename buddy_uint<WB == 8 ? 8 : 4>::type wide_t;  // holds a sign-mantissa (1 + m bits)
  static constexpr bool TABLED = false;
  static constexpr uint32_t ZERO_MODE = 0;
  static constexpr uint32_t RAW_MODE = 0;
  static constexpr uint32_t entry = BUDDY_ENTRY_BYTES;  // bytes per entry, E
  static constexpr uint32_t words = entry / WB;          // words per entry, W
  static constexpr uint32_t rounds = (words + BUDDY_WARP_SIZE - 1) / BUDDY_WARP_SIZE;  // 32 words each
  // the choice's tiling: per round, lane l reads the 16 bytes at 16 (32 r + l)
  static constexpr uint32_t units = entry / 16u;
  static constexpr uint32_t unit_words = 16u / WB;
  static constexpr uint32_t unit_rounds = (units + BUDDY_WARP_SIZE - 1u) / BUDDY_WARP_SIZE;
  // the split (e, m) and the header: zmode (1) | emax (e) | b (bb bits, bb = bit_length(e + 1))
  static constexpr uint32_t e = buddy_float_split<WB>::e;
  static constexpr uint32_t m = buddy_float_split<WB>::m;
  static constexpr uint32_t bb = WB == 1 ? 3 : 4;
  static constexpr uint32_t header = 1 + e + bb;  // H
  static constexpr uint32_t max_b = e + 1;         // largest code width: never escapes
  static constexpr uint32_t never = 0xFFFFFFFFu;  // the length of a stream that cannot be written

  static_assert(words * WB == entry, "an entry is a whole number of words");
  static_assert(words % BUDDY_WARP_SIZE == 0 || words < BUDDY_WARP_SIZE, "only a lone round is partial");
  static_assert(max_b < (1u << bb) && (1u + e + m) == 8u * WB, "the split fills the word");

  static BUDDY_HD bool coded_mode(uint32_t mode) { return mode == 0; }

  // ---------------------------------------------------------------------------
  // fields of a word
  // ---------------------------------------------------------------------------
  static BUDDY_HD uint32_t exponent(word_t x) { return (uint32_t)(x >> m) & ((1u << e) - 1u); }

  // sign << m | mantissa
  static BUDDY_HD wide_t sign_mantissa(word_t x) {
    const wide_t w = (wide_t)x;
    return (w & (((wide_t)1 << m) - 1u)) | ((w >> (8u * WB - 1u)) << m);
  }

  // the word of an exponent field and a sign-mantissa
  static BUDDY_HD word_t compose(uint32_t exp, wide_t sm) {
    const wide_t mantissa = sm & (((wide_t)1 << m) - 1u);
    const wide_t sign = (sm >> m) & 1u;
    return (word_t)(((wide_t)exp << m) | mantissa | (sign << (8u * WB - 1u)));
  }

  // Word i of the entry for lane-strided rounds; zero past the entry (a
  // partial round only exists when W < 32).
  static BUDDY_HD word_t word_at(const uint8_t* entry_bytes, uint32_t i) {
    return i < words ? buddy_load<word_t>(entry_bytes + i * WB) : (word_t)0;
  }

  // Lanes below this one.
  template <class Warp>
  static BUDDY_WARP_FN uint32_t below(const Warp& warp) {
    return (1u << warp.lane()) - 1u;
  }

  // ---------------------------------------------------------------------------
  // the choice of zmode and b
  // ---------------------------------------------------------------------------
  struct Choice {
    uint32_t emax;     // largest exponent field of the entry
    uint32_t zmode;    // 0: every word listed; 1: bitmap, non-zero words listed
    uint32_t b;        // code width
    uint32_t listed;   // listed words: W or the non-zero count
    uint32_t escapes;  // escaped words
    uint32_t bits;     // stream length T
  };

  // Pass 1 of the choice: the entry's largest exponent field (zero words have exponent 0: no harm) and its
  // non-zero words (zvc's size: auto takes both from one pass, codec_auto.h).
  struct Census {
    uint32_t emax, nnz;
  };
#if !defined(BUDDY_NATIVE_SOLO)
  // f(x) for each word x of the lane's 16-byte unit of round r (buddy_round_unit; none past the entry): both
  // passes of the choice read the entry so.
  template <class Warp, class F>
  static BUDDY_WARP_FN void round_words(const Warp& warp, const uint8_t* entry_bytes, uint32_t r, F&& f) {
    bool valid;
    const buddy_u128 unit = buddy_round_unit(warp, entry_bytes, units, r, &valid);
    if (valid) {
      BUDDY_FPX_UNROLL
      for (uint32_t i = 0; i < unit_words; ++i) f(buddy_unit_word<word_t>(unit, i));
    }
  }
#endif

  template <class Warp>
  static BUDDY_WARP_FN Census census(const Warp& warp, const uint8_t* entry_bytes) {
#if defined(BUDDY_NATIVE_SOLO)
    (void)warp;
    uint32_t top = 0, nnz = 0;  // (plain loops over the words: a host compiler vectorizes them)
    for (uint32_t i = 0; i < words; ++i) {
      const word_t x = buddy_load<word_t>(entry_bytes + (size_t)i * WB);
      top = buddy_max(top, exponent(x));
      nnz += x != 0;
    }
    return {top, nnz};
#else
    // Both passes read the entry 16 bytes a lane at a time (lane l: units l, l + 32, ...): a maximum and counts
    // do not depend on which lane holds which word.
    uint32_t top = 0, nz = 0;
    BUDDY_FPX_ROLLED
    for (uint32_t r = 0; r < unit_rounds; ++r) {
      round_words(warp, entry_bytes, r, [&](word_t x) {
        top = buddy_max(top, exponent(x));
        nz += x != 0;
      });
    }
    return {buddy_warp_max(warp, top), buddy_warp_sum(warp, nz)};
#endif
  }

  template <class Warp>
  static BUDDY_WARP_FN Choice choose(const Warp& warp, const uint8_t* entry_bytes) {
    return choose(warp, entry_bytes, census(warp, entry_bytes));
  }

  // Pass 2 and the choice, from pass 1's census.
  template <class Warp>
  static BUDDY_WARP_FN Choice choose(const Warp& warp, const uint8_t* entry_bytes, Census census) {
#if defined(BUDDY_NATIVE_SOLO)
    (void)warp;
    // one lane: a plain loop over the words, the escapes at each code width b counted directly, v >= 2^b
    uint32_t esc[e + 1] = {};  // esc[b]: the non-zero words that escape at code width b (1 <= b <= e)
    for (uint32_t i = 0; i < words; ++i) {
      const word_t x = buddy_load<word_t>(entry_bytes + (size_t)i * WB);
      const uint32_t v = (census.emax - exponent(x) + 1u) & (0u - (uint32_t)(x != 0));
      for (uint32_t b = 1; b <= e; ++b) esc[b] += v >= (1u << b);
    }
    return pick(census.emax, census.nnz, [&](uint32_t b) { return esc[b]; });
#else
    // pass 2: the non-zero words that escape at each code width b. With
    // v = emax - x + 1 (0 for a zero word: those are counted apart) a word
    // escapes at b iff v >= 2^b, i.e. iff bit_length(v) > b (never at
    // b = e + 1, as v <= 2^e). Each lane histograms bit_length(v) <= e + 1
    // in F-bit fields of one 64-bit word, a shift and an add per word; every
    // `block` units, before a field can overflow, suffix sums turn the
    // histogram into counts of bit_length(v) >= i, added to 16-bit counters
    // two to a word: esc2[p] counts the escapes at b = 2p + 1 (low half) and
    // b = 2p + 2.
    constexpr uint32_t F = 64u / (e + 2u);              // 10, 6, 6, 4 bits for words of 1, 2, 4, 8 bytes
    constexpr uint64_t field_max = ((uint64_t)1 << F) - 1u;
    constexpr uint32_t block = (uint32_t)field_max / unit_words;  // units before a field could overflow
    static_assert(block >= 1u, "a unit's words fit a field");
    constexpr uint32_t pairs = (e + 1) / 2;
    uint32_t esc2[pairs];
    BUDDY_FPX_UNROLL
    for (uint32_t p = 0; p < pairs; ++p) esc2[p] = 0;
    for (uint32_t r0 = 0; r0 < unit_rounds; r0 += block) {
      uint64_t hist = 0;
      const uint32_t r1 = buddy_min(r0 + block, unit_rounds);
      BUDDY_FPX_ROLLED
      for (uint32_t r = r0; r < r1; ++r) {
        round_words(warp, entry_bytes, r, [&](word_t x) {
          const uint32_t v = x != 0 ? census.emax - exponent(x) + 1u : 0u;
          hist += (uint64_t)1 << (F * buddy_bit_length(v));
        });
      }
      // field i += the fields above it: 1, 2, 4, then 8 fields (sums <= field_max: no carries)
      BUDDY_FPX_UNROLL
      for (uint32_t s = F; s < 64u; s *= 2u) hist += hist >> s;
      BUDDY_FPX_UNROLL
      for (uint32_t p = 0; p < pairs; ++p) {  // fields 2p + 2 and 2p + 3: bit_length(v) > 2p + 1, > 2p + 2
        esc2[p] += (uint32_t)((hist >> (F * (2u * p + 2u))) & field_max) |
                   (uint32_t)((hist >> (F * (2u * p + 3u))) & field_max) << 16;
      }
    }
    // Warp sums of the 16-bit counters: a lane counts at most W/32 <= 2048
    // words, and the entry at most W - 1 <= 65535 (the word holding emax
    // never escapes).
    BUDDY_FPX_UNROLL
    for (uint32_t p = 0; p < pairs; ++p) esc2[p] = buddy_warp_sum(warp, esc2[p]);
    return pick(census.emax, census.nnz,
                [&](uint32_t b) { return (esc2[(b - 1) / 2] >> (16u * ((b - 1) % 2))) & 0xFFFFu; });
#endif
  }

  // T(zmode, b) for every b, the first minimum of zmode 0, then of zmode 1, from the entry's emax, its non-zero
  // count and escaped(b): the non-zero words that escape at code width b, 1 <= b <= e (none at b = e + 1).
  // In zmode 0 the zero words are listed too, with offset emax: they escape at b iff emax + 1 >= 2^b.
  template <class Escaped>
  static BUDDY_HD Choice pick(uint32_t emax, uint32_t nnz, Escaped escaped_at) {
    const uint32_t zeros = words - nnz;
    const bool flat = escaped_at(1u) == 0;  // every non-zero word has exponent emax: b = 0 possible
    Choice c;
    c.emax = emax;
    uint32_t dense_bits = flat && (zeros == 0 || emax == 0) ? header + words * (1u + m) : never;
    uint32_t dense_b = 0, dense_esc = 0;
    uint32_t sparse_bits = flat ? header + words + nnz * (1u + m) : never;
    uint32_t sparse_b = 0, sparse_esc = 0;
    BUDDY_FPX_UNROLL
    for (uint32_t b = 1; b <= max_b; ++b) {
      const uint32_t escaped = b <= e ? escaped_at(b) : 0u;
      const uint32_t escaped_zeros = emax + 1u >= (1u << b) ? zeros : 0u;
      const uint32_t dense = header + words * (b + 1u + m) + e * (escaped + escaped_zeros);
      const uint32_t sparse = header + words + nnz * (b + 1u + m) + e * escaped;
      if (dense < dense_bits) {
        dense_bits = dense;
        dense_b = b;
        dense_esc = escaped + escaped_zeros;
      }
      if (sparse < sparse_bits) {
        sparse_bits = sparse;
        sparse_b = b;
        sparse_esc = escaped;
      }
    }
    const bool sparse = sparse_bits < dense_bits;
    c.zmode = sparse ? 1u : 0u;
    c.b = sparse ? sparse_b : dense_b;
    c.listed = sparse ? nnz : words;
    c.escapes = sparse ? sparse_esc : dense_esc;
    c.bits = sparse ? sparse_bits : dense_bits;
    return c;
  }

  // ---------------------------------------------------------------------------
  // the interface
  // ---------------------------------------------------------------------------
  template <class Warp>
  static BUDDY_WARP_FN uint32_t measure(const Warp& warp, const uint8_t* entry_bytes, uint32_t* mode) {
    return measure(warp, entry_bytes, census(warp, entry_bytes), mode);
  }

  // measure with pass 1's census made (auto's measure: codec_auto.h)
  template <class Warp>
  static BUDDY_WARP_FN uint32_t measure(const Warp& warp, const uint8_t* entry_bytes, Census c, uint32_t* mode) {
    *mode = 0;
    return (choose(warp, entry_bytes, c).bits + 8u * BUDDY_SECTOR_BYTES - 1u) / (8u * BUDDY_SECTOR_BYTES);
  }

  template <class Warp>
  static BUDDY_WARP_FN void encode(const Warp& warp, const uint8_t* entry_bytes, uint32_t k, uint32_t mode,
                                   uint8_t* payload) {
    (void)mode;
    const uint32_t lane = warp.lane();
    // the mode does not carry zmode and b: choose again
    const Choice c = choose(warp, entry_bytes);
    // zero bits first: the fields are ORed in, and everything after the stream stays zero
    buddy_warp_fill(warp, nullptr, payload, k * BUDDY_SECTOR_BYTES);
    warp.sync();
    uint32_t* stream = reinterpret_cast<uint32_t*>(payload);
    if (lane == 0) buddy_put32(stream, 0, c.zmode | (c.emax << 1) | (c.b << (1u + e)));

    const uint32_t per_word = c.b + 1u + m;
    const uint32_t start = header + (c.zmode ? words : 0u);
    const uint32_t esc_start = start + c.listed * per_word;
    const uint32_t esc_code = (1u << c.b) - 1u;  // all ones; no word escapes at b = 0
    uint32_t listed_before = 0, esc_before = 0;   // in earlier rounds
    for (uint32_t r = 0; r < rounds; ++r) {
      const uint32_t i = r * BUDDY_WARP_SIZE + lane;
      const word_t x = word_at(entry_bytes, i);
      const uint32_t exp = exponent(x);
      const uint32_t offset = c.emax - exp;
      bool listed = i < words;
      uint32_t rank = i;
      if (c.zmode) {  // the round's bitmap bits are a ballot; ranks count them
        const uint32_t bits = warp.ballot(x != 0);
        if (lane == 0) buddy_put32(stream, header + r * BUDDY_WARP_SIZE, bits);
        listed = x != 0;
        rank = listed_before + buddy_popc(bits & below(warp));
        listed_before += buddy_popc(bits);
      }
      const bool escaped = listed && c.b > 0 && offset >= esc_code;
      if (c.escapes) {  // escapes are in word order: their rank is a ballot's count too
        const uint32_t bits = warp.ballot(escaped);
        if (escaped) buddy_put32(stream, esc_start + (esc_before + buddy_popc(bits & below(warp))) * e, exp);
        esc_before += buddy_popc(bits);
      }
      if (listed) {
        const uint32_t code = escaped ? esc_code : offset;  // < 2^b (offset = 0 when b = 0)
        const uint32_t pos = start + rank * per_word;
        if constexpr (WB <= 2) {  // b + 1 + m <= 17 bits
          buddy_put32(stream, pos, code | ((uint32_t)sign_mantissa(x) << c.b));
        } else if constexpr (WB == 4) {  // <= 33 bits
          buddy_put64(stream, pos, code | ((uint64_t)sign_mantissa(x) << c.b));
        } else {  // <= 65 bits: the code, then the 53-bit sign-mantissa
          buddy_put32(stream, pos, code);
          buddy_put64(stream, pos + c.b, sign_mantissa(x));
        }
      }
    }
  }

#if defined(BUDDY_NATIVE_SOLO)
  // decode by the native engine's warp of one lane (words of 1, 2 or 4 bytes, k >= 1), after decode has read the
  // header: the same pass word by word, each field from one unaligned 8-byte read (at least 57 bits: a field has at
  // most 33) at a place clamped into the payload -- a stream that reads past it is longer than k sectors, which the checks reject as decode's do, so
  // what such reads bring never reaches the output -- an escape's exponent read for every word and selected (no
  // branch on the data), the bitmap 32 bits at a time.
  // (decode's header fields and the stream's layout from them: zmode, emax, b, per_word, start, esc_code.)
  template <class Warp>
  static BUDDY_WARP_FN uint32_t decode_one_lane(const Warp& warp, const uint8_t* payload, uint32_t k, uint8_t* out,
                                                uint32_t zmode, uint32_t emax, uint32_t b, uint32_t per_word,
                                                uint32_t start, uint32_t esc_code) {
    const uint32_t n64 = k * (BUDDY_SECTOR_BYTES / 8u);
    const uint32_t last = 8u * BUDDY_SECTOR_BYTES * k - 1u;  // the payload's last bit (staged: 8 bytes after it read)
    auto peek = [&](uint32_t p) -> uint64_t {
      p = buddy_min(p, last);
      uint64_t v;
      __builtin_memcpy(&v, payload + (p >> 3), 8);
      return v >> (p & 7u);
    };
    const uint32_t emask = (1u << e) - 1u;
    const uint32_t has_escapes = b > 0;
    uint32_t listed_total = words;
    if (zmode) {
      listed_total = 0;
      for (uint32_t r = 0; r < words; r += 32u) {
        const uint32_t n = words - r < 32u ? words - r : 32u;
        listed_total += buddy_popc((uint32_t)peek(header + r) & (uint32_t)(((uint64_t)1 << n) - 1u));
      }
    }
    const uint32_t esc_start = start + listed_total * per_word;
    uint32_t rank = 0, escs = 0, below_zero = 0, bitmap = 0xFFFFFFFFu;
    for (uint32_t i = 0; i < words; ++i) {
      if (zmode && (i & 31u) == 0u) bitmap = (uint32_t)peek(header + i);
      const uint32_t listed = zmode ? (bitmap >> (i & 31u)) & 1u : 1u;
      const uint64_t field = peek(start + rank * per_word);
      const uint32_t code = (uint32_t)field & esc_code;
      const uint32_t escaped = listed & has_escapes & (uint32_t)(code == esc_code);
      const uint32_t escape = (uint32_t)peek(esc_start + escs * e) & emask;
      const uint32_t exp = escaped ? escape : emax - code;
      below_zero |= listed & (escaped ^ 1u) & (uint32_t)(code > emax);
      const word_t w = compose(exp, (wide_t)(field >> b));
      buddy_store<word_t>(out + (size_t)i * WB, (word_t)(w & (word_t)(0u - listed)));
      rank += listed;
      escs += escaped;
    }
    // the stream's length must give k, and nothing may follow it
    const uint32_t total = esc_start + escs * e;
    bool bad = below_zero || (total + 8u * BUDDY_SECTOR_BYTES - 1u) / (8u * BUDDY_SECTOR_BYTES) != k;
    bad |= buddy_bits_after(warp, payload, n64, total);
    if (!bad) return 0;
    buddy_warp_fill(warp, nullptr, out, entry);
    return BUDDY_ERR_STREAM;
  }
#endif

  template <class Warp>
  static BUDDY_WARP_FN uint32_t decode(const Warp& warp, const uint8_t* payload, uint32_t k, uint32_t mode,
                                       uint8_t* out) {
    (void)mode;
    const uint32_t lane = warp.lane();
    const uint32_t n64 = k * (BUDDY_SECTOR_BYTES / 8u);  // 8-byte words of the payload
    const uint32_t head = (uint32_t)buddy_peek(payload, n64, 0);
    const uint32_t zmode = head & 1u;
    const uint32_t emax = (head >> 1) & ((1u << e) - 1u);
    const uint32_t b = (head >> (1u + e)) & ((1u << bb) - 1u);
    if (b > max_b) {
      buddy_warp_fill(warp, nullptr, out, entry);
      return BUDDY_ERR_STREAM;
    }
    const uint32_t per_word = b + 1u + m;
    const uint32_t start = header + (zmode ? words : 0u);
    const uint32_t esc_code = (1u << b) - 1u;
#if defined(BUDDY_NATIVE_SOLO)
    if constexpr (WB < 8) {
      if (k > 0) return decode_one_lane(warp, payload, k, out, zmode, emax, b, per_word, start, esc_code);
    }
#endif
    // bitmap bits of a round that name words (all 32 unless W < 32; one for a warp of one lane)
    const uint32_t round_mask = BUDDY_WARP_SIZE == 1 ? 1u
                                : words < BUDDY_WARP_SIZE ? (1u << (words % BUDDY_WARP_SIZE)) - 1u : 0xFFFFFFFFu;

    // listed words: their count places the escapes
    uint32_t listed_total = words;
    if (zmode) {
      uint32_t mine = 0;
      for (uint32_t r = lane; r < rounds; r += BUDDY_WARP_SIZE)
        mine += buddy_popc((uint32_t)buddy_peek(payload, n64, header + r * BUDDY_WARP_SIZE) & round_mask);
      listed_total = buddy_warp_sum(warp, mine);
    }
    const uint32_t esc_start = start + listed_total * per_word;

    // one pass over the words; a damaged stream reads garbage inside the
    // payload (or zeros past it), and the checks below reject it
    uint32_t listed_before = 0, esc_before = 0;  // in earlier rounds
    bool below_zero = false;                     // a code points below exponent 0
    for (uint32_t r = 0; r < rounds; ++r) {
      const uint32_t i = r * BUDDY_WARP_SIZE + lane;
      bool listed = i < words;
      uint32_t rank = i;
      if (zmode) {  // every lane reads the round's 32 bitmap bits
        const uint32_t bits = (uint32_t)buddy_peek(payload, n64, header + r * BUDDY_WARP_SIZE) & round_mask;
        listed = (bits >> lane) & 1u;
        rank = listed_before + buddy_popc(bits & below(warp));
        listed_before += buddy_popc(bits);
      }
      const uint32_t pos = start + rank * per_word;
      const uint64_t field = buddy_peek(payload, n64, pos);
      const uint32_t code = (uint32_t)field & esc_code;
      wide_t sm;
      if constexpr (WB == 8)  // b + 1 + m can exceed 64 bits
        sm = buddy_peek(payload, n64, pos + b);
      else
        sm = (wide_t)(field >> b);
      const bool escaped = listed && b > 0 && code == esc_code;
      uint32_t exp = emax - code;
      if (b > 0) {  // escapes are in word order: their rank is a ballot's count
        const uint32_t bits = warp.ballot(escaped);
        if (escaped)
          exp = (uint32_t)buddy_peek(payload, n64, esc_start + (esc_before + buddy_popc(bits & below(warp))) * e) &
                ((1u << e) - 1u);
        esc_before += buddy_popc(bits);
      }
      below_zero |= listed && !escaped && code > emax;
      if (i < words) buddy_store<word_t>(out + i * WB, listed ? compose(exp, sm) : (word_t)0);
    }

    // the stream's length must give k, and nothing may follow it
    const uint32_t total = esc_start + esc_before * e;
    bool bad = below_zero || (total + 8u * BUDDY_SECTOR_BYTES - 1u) / (8u * BUDDY_SECTOR_BYTES) != k;
    bad |= buddy_bits_after(warp, payload, n64, total);
    if (warp.ballot(bad) == 0) return 0;
    warp.sync();  // every lane's words are written before any lane zeroes them
    buddy_warp_fill(warp, nullptr, out, entry);
    return BUDDY_ERR_STREAM;
  }
};
