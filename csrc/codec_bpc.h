// BPC (Bit-Plane Compression, Kim et al. ISCA 2016) of one entry, one warp
// per entry: the device codec the kernels run, host-compilable so the tests
// check it byte for byte against the torch reference (buddy/codecs/bpc.py,
// whose module docstring is the format specification). Interface: see
// codec_zvc.h. Only mode 0 is used.
//
// In short: the entry is W words of ws bits (ws = 16 for 2-byte words, 64 for
// 8-byte words, 32 otherwise); the L = W - 1 deltas d_i = x_{i+1} - x_i are
// (ws + 1)-bit numbers; plane DBP_j holds bit j of every delta, DBX_ws =
// DBP_ws (the signs) and DBX_j = DBP_j ^ DBP_{j+1}. The stream is the base
// x_0 (ws bits), then one code per DBX plane from DBX_ws down to DBX_0, LSB
// first, where a zero run covers several planes:
//
//   code            stream bits (field value)  planes
//   zero run n>=2   01 + (n - 2) in RB bits    n zero planes
//   zero run n=1    001                        one zero plane
//   all ones        00000 (0)                  all L bits set
//   DBP = 0         00001 (16)                 DBP_j = 0
//   two ones        00010 (8)  + pos (PB bits) bits pos, pos + 1
//   single one      00011 (24) + pos (PB bits) bit pos
//   raw plane       1          + L bits        the plane
//
// Warp decomposition. Deltas go 32 at a time ("chunks"): in chunk c, lane l
// holds delta i = 32c + l. A 32 x 32 bit transpose over the lanes (five
// shfl_xor rounds) turns the lanes' delta bits into plane pieces: afterwards
// lane j holds bits 32c .. 32c + 31 of plane j. So every lane owns one plane
// per "slot": slot s < G holds plane 32s + lane (G = 2 for ws = 64, else 1);
// for ws >= 32 the sign plane DBX_ws is an extra slot that every lane holds
// alike (a ballot gives its piece), for ws = 16 it is lane 16's plane.
//
//   measure  one pass over the chunks accumulates, per plane, what picks its
//            code (set bits, first and last set bit, all ones; DBP = 0 from
//            an OR of the deltas over the warp); zero runs come from a ballot
//            of the non-zero planes, and a warp sum of the code lengths is T.
//   encode   the same pass, code offsets by a warp scan of the lengths
//            (stream order is top plane first: the highest lane first), the
//            short codes OR-ed into a zeroed payload, then the raw planes'
//            pieces, one shifted 32-bit word per raw plane per chunk: kept in
//            registers from the first pass for small entries (C * slots <=
//            16), from a second pass over the entry otherwise.
//   decode   one walk over the codes, uniform on every lane (a code's position
//            depends on the previous ones; at most P steps), records each
//            plane's code with the lane that owns it; then per chunk the lanes
//            rebuild their DBX pieces, transpose back (lane i: the DBX bits of
//            delta i), undo the XOR chain with a bit-parallel segmented scan
//            inside that row, prefix-sum the deltas from the base over the
//            lanes, and check the sign plane against the words.
// Reads of the payload are clamped to its 32k bytes, whatever the stream says.
#pragma once

#include "buddy_format.h"
#include "buddy_warp.h"

// Unrolling hints for nvcc and NVRTC (a host compiler would warn about them).
#if defined(__CUDACC__)
#define BUDDY_BPC_PRAGMA(x) _Pragma(#x)
#else
#define BUDDY_BPC_PRAGMA(x)
#endif

template <int WB>
struct BuddyBpc {
  static_assert(WB == 1 || WB == 2 || WB == 4 || WB == 8, "bpc words are 1, 2, 4 or 8 bytes");
  static constexpr bool TABLED = false;
  static constexpr uint32_t ZERO_MODE = 0;
  static constexpr uint32_t RAW_MODE = 0;

  // Bits needed to write x (for the constants below; annotated, as NVRTC has no host functions).
  static constexpr BUDDY_HD uint32_t bit_length(uint32_t x) {
    uint32_t n = 0;
    for (; x; x >>= 1) ++n;
    return n;
  }

  static constexpr uint32_t entry = BUDDY_ENTRY_BYTES;                 // bytes per entry, E
  static constexpr uint32_t WS = WB == 2 ? 16u : WB == 8 ? 64u : 32u;  // BPC word bits (1-byte data: 32)
  typedef typename buddy_uint<WS / 8>::type word_t;
  typedef typename buddy_uint<(WS == 64 ? 8 : 4)>::type row_t;  // a delta's DBX bits (ws = 16: with the sign)
  static constexpr uint32_t W = entry * 8 / WS;                        // words
  static constexpr uint32_t L = W - 1;                                 // deltas: the bits of a plane
  static constexpr uint32_t P = WS + 1;                                // planes
  static constexpr uint32_t C = (L + 31) / 32;                         // chunks of 32 deltas
  static constexpr uint32_t PB = bit_length(L - 1);                    // bits of a position
  static constexpr uint32_t RB = bit_length(P - 2);                    // bits of a run length
  static constexpr uint32_t RAW_BITS = 1 + L;                          // a raw plane's code
  static constexpr uint32_t LAST_MASK = L % 32 ? (1u << (L % 32)) - 1u : ~0u;  // valid bits of the last piece
  static constexpr uint32_t G = WS == 64 ? 2u : 1u;                    // lane-owned plane slots
  static constexpr bool UTOP = WS >= 32;                               // the sign plane is a uniform slot
  static constexpr uint32_t NS = G + (UTOP ? 1u : 0u);                 // slots per lane
  static constexpr uint32_t ROW = UTOP ? WS : WS + 1;                  // lane-owned planes: DBX bits of a delta's row
  static constexpr uint32_t STEPS = bit_length(ROW - 1);               // log steps of a scan over a row
  static constexpr word_t SIGN = (word_t)((word_t)1 << (WS - 1));
  // Small entries keep the first pass's DBX pieces in registers for encode's
  // raw planes; larger ones run the transform again.
  static constexpr bool KEEP = C * NS <= 16;
  static constexpr uint32_t KC = KEEP ? C : 1;

  static_assert(W >= 4 && W * WS == entry * 8, "an entry is at least 4 whole BPC words");
  static_assert(PB + 5 <= 32 && 2 + RB <= 32, "a code other than a raw plane fits 32 bits");
  static_assert(WS + P * RAW_BITS < (1u << 29), "a walk's bit offsets fit 29 bits (kind | offset << 3)");

  // Plane kinds; 1 + bits 3-4 of a 5-bit code's field value gives the middle four.
  enum : uint32_t { K_ZERO = 0, K_ONES, K_TWO, K_DBP0, K_ONE, K_RAW };
  // Code prefixes as LSB-first field values.
  static constexpr uint32_t C_RUN = 2, C_RUN1 = 4, C_ONES = 0, C_TWO = 8, C_DBP0 = 16, C_ONE = 24;

  static BUDDY_HD bool coded_mode(uint32_t mode) { return mode == 0; }

  // ---------------------------------------------------------------------------
  // small helpers
  // ---------------------------------------------------------------------------
  static BUDDY_HD uint32_t bit_length64(uint64_t x) {
    const uint32_t hi = (uint32_t)(x >> 32);
    return hi ? 32u + buddy_bit_length(hi) : buddy_bit_length((uint32_t)x);
  }

  // Index of the lowest set bit of a non-zero x (32 for 0).
  static BUDDY_HD uint32_t ctz32(uint32_t x) { return buddy_popc((x & (0u - x)) - 1u); }

  // Bits 0 .. n-1 (n <= 64).
  static BUDDY_HD uint64_t low_bits(uint32_t n) { return n >= 64 ? ~0ull : (1ull << n) - 1ull; }

  // Valid bits of piece c of a plane (the last piece is short: L = 32C - 1 or less).
  static BUDDY_HD uint32_t piece_mask(uint32_t c) { return c + 1 == C ? LAST_MASK : ~0u; }

  // Plane of slot s on this lane: 32s + lane, the sign plane WS for the
  // uniform slot, and ~0 where the slot holds none (ws = 16: lanes 17..31).
  static BUDDY_HD uint32_t plane_of(uint32_t s, uint32_t lane) {
    return s >= G ? WS : 32u * s + lane < ROW ? 32u * s + lane : ~0u;
  }

  // x < y for the ws-bit two's-complement words x and y.
  static BUDDY_HD bool less_signed(word_t x, word_t y) { return (word_t)(x ^ SIGN) < (word_t)(y ^ SIGN); }

  // x rotated left by r (1 <= r <= 31).
  static BUDDY_HD uint32_t rotate_left(uint32_t x, uint32_t r) {
#if defined(__CUDA_ARCH__)
    return __funnelshift_l(x, x, r);
#else
    return x << r | x >> (32 - r);
#endif
  }

  // One round of the 32 x 32 bit transpose: a lane whose bit m is clear swaps
  // its columns with bit m set for the partner's (lane + m) columns with bit m
  // clear, and the partner the other way round; `lo` marks the columns with bit
  // m clear. The partner's columns arrive by a rotation (left by m, or right by
  // m for the upper lane: the bits rotated round land in columns it keeps), and
  // a bitwise select merges them: no branch, no data-dependent mask.
  template <class Warp>
  static BUDDY_WARP_FN uint32_t transpose_round(const Warp& warp, uint32_t x, uint32_t m, uint32_t lo) {
    const uint32_t y = warp.shfl_xor(x, m);
    const bool up = (warp.lane() & m) != 0;
    const uint32_t keep = up ? ~lo : lo;  // the columns this lane keeps
    const uint32_t r = up ? 32 - m : m;   // 1 <= r <= 31
    const uint32_t moved = rotate_left(y, r);
    return (x & keep) | (moved & ~keep);
  }

  // Bit j of lane i's result is bit i of lane j's x (its own inverse).
  template <class Warp>
  static BUDDY_WARP_FN uint32_t transpose(const Warp& warp, uint32_t x) {
#if defined(BUDDY_HOST_WARP_OPS)  // a host runtime's transpose in one exchange, the same bits (buddy_warp.h)
    return buddy_warp_transpose(warp, x);
#else
    x = transpose_round(warp, x, 16, 0x0000FFFFu);
    x = transpose_round(warp, x, 8, 0x00FF00FFu);
    x = transpose_round(warp, x, 4, 0x0F0F0F0Fu);
    x = transpose_round(warp, x, 2, 0x33333333u);
    return transpose_round(warp, x, 1, 0x55555555u);
#endif
  }

  // ---------------------------------------------------------------------------
  // measure: the DBX planes a chunk at a time, and the code of each plane
  // ---------------------------------------------------------------------------
  // Piece c of every slot's DBX plane (bit l: delta 32c + l; zero past the
  // last delta). *dor collects the deltas' low ws bits (OR-ed over the warp at
  // the end, bit j says whether DBP_j has a set bit).
  template <class Warp>
  static BUDDY_WARP_FN void dbx_pieces(const Warp& warp, const uint8_t* entry_bytes, uint32_t c, uint32_t (&dbx)[NS],
                                       word_t* dor) {
    const uint32_t i = 32u * c + warp.lane();
    word_t lo = 0;
    bool neg = false;
    if (i < L) {
      const word_t a = buddy_load<word_t>(entry_bytes + i * (WS / 8));
      const word_t b = buddy_load<word_t>(entry_bytes + (i + 1) * (WS / 8));
      lo = (word_t)(b - a);     // the low ws bits of the (ws + 1)-bit delta
      neg = less_signed(b, a);  // its bit ws
    }
    *dor |= lo;
    // bit j of lo ^ (lo >> 1) is DBP_j ^ DBP_{j+1} = DBX_j of this delta, but for
    // j = ws - 1, whose upper neighbour is the sign
    if constexpr (WS == 16) {
      const uint32_t d = (uint32_t)lo | (uint32_t)neg << 16;  // all 17 bits: lane 16 gets the sign plane
      dbx[0] = transpose(warp, d ^ (d >> 1));
    } else {
      const word_t x = (word_t)(lo ^ (lo >> 1) ^ ((word_t)neg << (WS - 1)));
      dbx[0] = transpose(warp, (uint32_t)x);
      if constexpr (WS == 64) dbx[1] = transpose(warp, (uint32_t)((uint64_t)x >> 32));
      dbx[G] = warp.ballot(neg);  // DBX_ws = DBP_ws: the signs
    }
  }

  // What picks a plane's code, gathered piece by piece.
  struct Summary {
    uint32_t count = 0;  // set bits
    uint32_t first = 0;  // the lowest set bit (when count > 0)
    uint32_t last = 0;   // the highest set bit (when count > 0)
    bool ones = true;    // every piece so far has all its bits set

    BUDDY_HD void add(uint32_t v, uint32_t c) {
      if (!count) first = 32u * c + ctz32(v);  // overwritten until a piece has a set bit
      if (v) last = 32u * c + buddy_bit_length(v) - 1u;
      count += buddy_popc(v);
      ones = ones && v == piece_mask(c);
    }
    // Whether plane j's code is sure to be raw whatever the chunks still to come (dbp: bit j set iff a delta so
    // far has bit j, so DBP_j is not zero): at least 3 set bits, not all ones -- no shorter code fits it.
    BUDDY_HD bool sure_raw(uint32_t j, uint64_t dbp) const {
      return count >= 3u && !ones && (j >= WS || ((dbp >> j) & 1u));
    }
  };

  // Whether the plan of measure_below checks for its early stop after chunk c: after chunks 0, 1, 3, 7, 11, ...
  static BUDDY_HD bool stop_checked(uint32_t c) { return c < 2u || (c & 3u) == 3u; }

  // A plane's code: its kind, its length in bits and its value as an LSB-first
  // field of at most 32 bits (a raw plane: just the prefix bit).
  struct Code {
    uint32_t kind, bits, value;
  };

  // The code of plane j. nz: the non-zero planes below 64 (bit j), top_nz:
  // whether the sign plane is non-zero (ws = 64 keeps it out of nz), dbp: bit
  // j set iff DBP_j is not all zero.
  static BUDDY_HD Code code_of(uint32_t j, const Summary& sum, uint64_t nz, bool top_nz, uint64_t dbp) {
    if (sum.count) {
      Code code = {K_RAW, RAW_BITS, 1u};
      // the special codes in their order of preference; equal lengths go to the first
      if (sum.ones)
        code = {K_ONES, 5u, C_ONES};
      else if (j < WS && !((dbp >> j) & 1u))
        code = {K_DBP0, 5u, C_DBP0};
      else if (sum.count == 2 && sum.last == sum.first + 1)
        code = {K_TWO, 5u + PB, C_TWO | sum.first << 5};
      else if (sum.count == 1)
        code = {K_ONE, 5u + PB, C_ONE | sum.first << 5};
      // a raw plane only when strictly shorter (3-bit planes: E = 32 with 64-bit words)
      if (RAW_BITS < code.bits) code = {K_RAW, RAW_BITS, 1u};
      return code;
    }
    // a zero plane: a maximal run is coded at its top plane
    const bool above_nz = j == WS || (j + 1 < 64 ? ((nz >> (j + 1)) & 1u) != 0 : top_nz);
    if (!above_nz) return {K_ZERO, 0u, 0u};
    // the run goes down to the highest non-zero plane below j
    const uint32_t n = j + 1 - bit_length64(nz & low_bits(j));
    if (n >= 2) return {K_ZERO, 2u + RB, C_RUN | (n - 2) << 2};
    return {K_ZERO, 3u, C_RUN1};
  }

  // Every slot's code (kept: the DBX pieces, when KEEP); returns the stream's
  // length T in bits, the same on every lane. BELOW (measure_below): once the
  // planes sure to be raw (at least 3 set bits, not all ones, DBP not zero)
  // make WS + their bits >= stop, returns that many bits, the codes unset.
  template <bool BELOW = false, class Warp>
  static BUDDY_WARP_FN uint32_t plan(const Warp& warp, const uint8_t* entry_bytes, Code (&code)[NS],
                                     uint32_t (&kept)[KC][NS], uint32_t stop = ~0u) {
    const uint32_t lane = warp.lane();
    Summary sum[NS];
    word_t dor = 0;
    BUDDY_BPC_PRAGMA(unroll(KEEP ? C : 1))
    for (uint32_t c = 0; c < C; ++c) {
      uint32_t dbx[NS];
      dbx_pieces(warp, entry_bytes, c, dbx, &dor);
      BUDDY_BPC_PRAGMA(unroll)
      for (uint32_t s = 0; s < NS; ++s) {
        sum[s].add(dbx[s], c);
        if constexpr (KEEP) kept[c][s] = dbx[s];
      }
      if constexpr (BELOW) {
        if (stop_checked(c)) {  // (uniform: every lane stops at the same chunk)
          uint64_t dbp = buddy_warp_or(warp, (uint32_t)dor);
          if constexpr (WS == 64) dbp |= (uint64_t)buddy_warp_or(warp, (uint32_t)((uint64_t)dor >> 32)) << 32;
          uint32_t mine = 0;
          BUDDY_BPC_PRAGMA(unroll)
          for (uint32_t s = 0; s < G; ++s) {
            const uint32_t j = plane_of(s, lane);
            mine += j != ~0u && sum[s].sure_raw(j, dbp);
          }
          uint32_t raw = buddy_warp_sum(warp, mine);
          if constexpr (UTOP) raw += sum[G].sure_raw(WS, dbp);
          if (WS + raw * RAW_BITS >= stop) return WS + raw * RAW_BITS;
        }
      }
    }
    // DBP_j has a set bit iff some delta has bit j set
    uint64_t dbp = buddy_warp_or(warp, (uint32_t)dor);
    if constexpr (WS == 64) dbp |= (uint64_t)buddy_warp_or(warp, (uint32_t)((uint64_t)dor >> 32)) << 32;
    // the non-zero planes as a mask (bit j: plane j; ws = 64 keeps the sign plane apart)
    uint64_t nz = 0;
    BUDDY_BPC_PRAGMA(unroll)
    for (uint32_t s = 0; s < G; ++s) nz |= (uint64_t)warp.ballot(sum[s].count != 0) << (32 * s);
    bool top_nz;
    if constexpr (UTOP) {
      top_nz = sum[G].count != 0;
      if constexpr (WS < 64) nz |= (uint64_t)top_nz << WS;
    } else {
      top_nz = ((nz >> WS) & 1u) != 0;  // lanes past the sign plane have only zero pieces
    }
    uint32_t mine = 0;  // the code bits of this lane's own planes
    BUDDY_BPC_PRAGMA(unroll)
    for (uint32_t s = 0; s < NS; ++s) {
      const uint32_t j = plane_of(s, lane);
      code[s] = j != ~0u ? code_of(j, sum[s], nz, top_nz, dbp) : Code{K_ZERO, 0u, 0u};
      if (s < G) mine += code[s].bits;
    }
    return WS + (UTOP ? code[G].bits : 0u) + buddy_warp_sum(warp, mine);
  }

  template <class Warp>
  static BUDDY_WARP_FN uint32_t measure(const Warp& warp, const uint8_t* entry_bytes, uint32_t* mode) {
    *mode = 0;
    if constexpr (BUDDY_WARP_SIZE == 1) {
      (void)warp;
      Code code[P];
      return (plan_one_lane(entry_bytes, code, nullptr) + 255u) / 256u;
    } else {
      Code code[NS];
      uint32_t kept[KC][NS];
      return (plan(warp, entry_bytes, code, kept) + 255u) / 256u;
    }
  }

  // measure for a caller that only asks whether the entry takes fewer than `limit` (>= 1) sectors (auto's choice):
  // k when it does, else some k >= limit: the plan stops once the planes sure to be raw make the stream that long
  // (noisy planes: after a chunk or two), checked after chunks 0, 1, 3, 7, 11, ...
  template <class Warp>
  static BUDDY_WARP_FN uint32_t measure_below(const Warp& warp, const uint8_t* entry_bytes, uint32_t* mode,
                                              uint32_t limit) {
    *mode = 0;
    if constexpr (BUDDY_WARP_SIZE == 1) {
      (void)warp;
      Code code[P];
      return (plan_one_lane(entry_bytes, code, nullptr, 256u * (limit - 1u) + 1u) + 255u) / 256u;
    } else {
      Code code[NS];
      uint32_t kept[KC][NS];
      return (plan<true>(warp, entry_bytes, code, kept, 256u * (limit - 1u) + 1u) + 255u) / 256u;
    }
  }

  // plan by a warp of one lane (buddy_warp.h: the native engine's build): it holds a chunk's 32 deltas itself and
  // transposes them in place, and every plane is its own -- the warp's lane l and slot s are plane 32s + l here, its
  // ballots, ORs and sums over lanes are loops over planes. code[j]: plane j's code (j = 0 .. ws); keep, when given
  // (C * P words): piece c of plane j at [P * c + j]. Returns the stream's length T in bits -- or, once the planes
  // sure to be raw (at least 3 set bits, not all ones, DBP not zero) make WS + their bits >= stop, that many bits,
  // the codes then unset.
  static BUDDY_HD uint32_t plan_one_lane(const uint8_t* entry_bytes, Code (&code)[P], uint32_t* keep,
                                         uint32_t stop = ~0u) {
    constexpr uint32_t PLANES = 32u * G;  // the lane-owned planes' places (those at ROW and above hold none)
    Summary sum[PLANES], top;             // top: the uniform sign plane (UTOP)
    word_t dor = 0;
    for (uint32_t c = 0; c < C; ++c) {
      uint32_t rows[G][32];  // rows[s][l]: DBX bits 32s .. 32s + 31 of delta 32c + l
      uint32_t signs = 0;
      for (uint32_t l = 0; l < 32u; ++l) {
        const uint32_t i = 32u * c + l;
        word_t lo = 0;
        bool neg = false;
        if (i < L) {
          const word_t a = buddy_load<word_t>(entry_bytes + i * (WS / 8));
          const word_t b = buddy_load<word_t>(entry_bytes + (i + 1) * (WS / 8));
          lo = (word_t)(b - a);
          neg = less_signed(b, a);
        }
        dor |= lo;
        if constexpr (WS == 16) {
          const uint32_t d = (uint32_t)lo | (uint32_t)neg << 16;
          rows[0][l] = d ^ (d >> 1);
        } else {
          const word_t x = (word_t)(lo ^ (lo >> 1) ^ ((word_t)neg << (WS - 1)));
          rows[0][l] = (uint32_t)x;
          if constexpr (WS == 64) rows[G - 1][l] = (uint32_t)((uint64_t)x >> 32);
          signs |= (uint32_t)neg << l;
        }
      }
      for (uint32_t s = 0; s < G; ++s) {
        transpose_local(rows[s]);  // rows[s][j]: piece c of plane 32s + j
        for (uint32_t j = 0; j < 32u; ++j) sum[32u * s + j].add(rows[s][j], c);
      }
      if constexpr (UTOP) top.add(signs, c);
      if (keep) {
        for (uint32_t j = 0; j < ROW; ++j) keep[P * c + j] = rows[j / 32u][j % 32u];
        if constexpr (UTOP) keep[P * c + WS] = signs;
      }
      if (stop != ~0u && stop_checked(c)) {
        uint32_t raw = UTOP && top.sure_raw(WS, (uint64_t)dor);
        for (uint32_t j = 0; j < ROW; ++j) raw += sum[j].sure_raw(j, (uint64_t)dor);
        if (WS + raw * RAW_BITS >= stop) return WS + raw * RAW_BITS;
      }
    }
    const uint64_t dbp = (uint64_t)dor;
    uint64_t nz = 0;
    for (uint32_t j = 0; j < PLANES; ++j) nz |= (uint64_t)(sum[j].count != 0) << j;
    bool top_nz;
    if constexpr (UTOP) {
      top_nz = top.count != 0;
      if constexpr (WS < 64) nz |= (uint64_t)top_nz << WS;
    } else {
      top_nz = ((nz >> WS) & 1u) != 0;
    }
    uint32_t bits = WS;
    for (uint32_t j = 0; j < P; ++j) {
      code[j] = code_of(j, UTOP && j == WS ? top : sum[j], nz, top_nz, dbp);
      bits += code[j].bits;
    }
    return bits;
  }

  // The 32 x 32 bit transpose of `transpose` on one lane's 32 rows: bit l of row j becomes bit j of row l. Its
  // rounds of block swaps one by one, each a loop of a constant count over runs of W rows (W = 16, 8, 4: runs a
  // host compiler makes vector code of -- the transpose was half of one lane's plan as a loop over rows).
  template <uint32_t W>
  static BUDDY_HD void transpose_round_local(uint32_t (&r)[32], uint32_t m) {  // m: the low half of each 2W bits
    for (uint32_t base = 0; base < 32u; base += 2u * W)
      for (uint32_t k = base; k < base + W; ++k) {
        const uint32_t t = ((r[k] >> W) ^ r[k + W]) & m;
        r[k] ^= t << W;
        r[k + W] ^= t;
      }
  }
  static BUDDY_HD void transpose_local(uint32_t (&r)[32]) {
    transpose_round_local<16>(r, 0x0000FFFFu);
    transpose_round_local<8>(r, 0x00FF00FFu);
    transpose_round_local<4>(r, 0x0F0F0F0Fu);
    transpose_round_local<2>(r, 0x33333333u);
    transpose_round_local<1>(r, 0x55555555u);
  }

  // ---------------------------------------------------------------------------
  // encode
  // ---------------------------------------------------------------------------
  // ORs the field `value` into the stream at bit `off` (the bits it touches lie
  // inside the stream, so inside the payload's 32k bytes).
  static BUDDY_HD void or_field(uint8_t* payload, uint32_t off, uint32_t value) {
    const uint32_t w = off >> 5, s = off & 31u;
    if (value << s) buddy_atomic_or(reinterpret_cast<uint32_t*>(payload) + w, value << s);
    if (s && (value >> (32 - s))) buddy_atomic_or(reinterpret_cast<uint32_t*>(payload) + w + 1, value >> (32 - s));
  }

  // The bits of a raw plane, a piece per chunk: piece c lands at stream bit
  // first + 32c, shifted by first % 32, so it fills stream word first / 32 + c
  // with the previous piece's carry. Those words lie wholly inside the plane
  // except the first and the last ones, which neighbouring codes share.
  struct RawWriter {
    uint32_t word, shift, carry;

    BUDDY_HD void put(uint8_t* payload, uint32_t c, uint32_t piece) {
      const uint32_t v = piece << shift | carry;
      carry = shift ? piece >> (32 - shift) : 0u;
      if (!v) return;  // the payload is zeroed
      if (c == 0 || c + 1 == C)
        buddy_atomic_or(reinterpret_cast<uint32_t*>(payload) + word + c, v);
      else
        buddy_store<uint32_t>(payload + 4 * (word + c), v);
    }
    BUDDY_HD void finish(uint8_t* payload) {
      if (carry) buddy_atomic_or(reinterpret_cast<uint32_t*>(payload) + word + C, carry);
    }
  };

  template <class Warp>
  static BUDDY_WARP_FN void encode(const Warp& warp, const uint8_t* entry_bytes, uint32_t k, uint32_t mode,
                                   uint8_t* payload) {
    (void)mode;
    if constexpr (BUDDY_WARP_SIZE == 1) {
      (void)warp;
      encode_one_lane(entry_bytes, k, payload);
    } else {
      encode_warp(warp, entry_bytes, k, payload);
    }
  }

  // encode by a warp of one lane: the codes and raw planes appended in stream order (the sign plane, then DBX_{ws-1}
  // down to DBX_0), the rest of the k sectors zeroed. The stream fits them (k from measure); a write past them is
  // dropped all the same.
  static BUDDY_HD void encode_one_lane(const uint8_t* entry_bytes, uint32_t k, uint8_t* payload) {
    Code code[P];
    uint32_t keep[C * P];
    plan_one_lane(entry_bytes, code, keep);
    const uint32_t nw = k * (BUDDY_SECTOR_BYTES / 4);
    uint64_t acc = 0;     // the bits not yet stored, the first at bit 0
    uint32_t n = 0, w = 0;  // bits in acc (< 32); words stored
    auto put = [&](uint32_t value, uint32_t bits) {  // value: a field of `bits` <= 32 bits
      acc |= (uint64_t)value << n;
      n += bits;
      if (n >= 32) {
        if (w < nw) buddy_store<uint32_t>(payload + 4 * w, (uint32_t)acc);
        ++w;
        acc >>= 32;
        n -= 32;
      }
    };
    const word_t base = buddy_load<word_t>(entry_bytes);
    if constexpr (WS == 64) {
      put((uint32_t)base, 32);
      put((uint32_t)((uint64_t)base >> 32), 32);
    } else {
      put((uint32_t)base, WS);
    }
    constexpr uint32_t LAST_BITS = L - 32u * (C - 1);  // bits of a plane's last piece
    for (uint32_t j = P; j-- > 0;) {
      if (code[j].kind != K_RAW) {
        if (code[j].bits) put(code[j].value, code[j].bits);
        continue;
      }
      put(1u, 1);
      for (uint32_t c = 0; c + 1 < C; ++c) put(keep[P * c + j], 32);
      put(keep[P * (C - 1) + j], LAST_BITS);
    }
    if (n && w < nw) buddy_store<uint32_t>(payload + 4 * w, (uint32_t)acc);
    for (w += n != 0; w < nw; ++w) buddy_store<uint32_t>(payload + 4 * w, 0u);
  }

  template <class Warp>
  static BUDDY_WARP_FN void encode_warp(const Warp& warp, const uint8_t* entry_bytes, uint32_t k, uint8_t* payload) {
    static_assert(sizeof(Warp) > 0 && BUDDY_WARP_SIZE == 32u, "a transpose across 32 lanes");
    const uint32_t lane = warp.lane();
    Code code[NS];
    uint32_t kept[KC][NS];
    plan(warp, entry_bytes, code, kept);
    // Bit offsets: stream order is the sign plane, then DBX_{ws-1} down to DBX_0,
    // i.e. the higher slot first and, inside a slot, the higher lane first.
    uint32_t off[NS];
    uint32_t above = WS;  // bits before the current slot's planes
    if constexpr (UTOP) {
      off[G] = above;
      above += code[G].bits;
    }
    BUDDY_BPC_PRAGMA(unroll)
    for (uint32_t g = G; g-- > 0;) {
      uint32_t total;
      const uint32_t before = buddy_warp_exclusive_scan(warp, code[g].bits, &total);
      off[g] = above + total - before - code[g].bits;  // the planes of the higher lanes come first
      above += total;
    }
    // a zeroed payload, then every field OR-ed in
    buddy_warp_fill(warp, nullptr, payload, k * BUDDY_SECTOR_BYTES);
    warp.sync();
    // the uniform slot is written by lane 0 alone; a raw plane's prefix is its code's value
    bool raw[NS], any_raw = false;
    if (lane == 0) {
      const word_t base = buddy_load<word_t>(entry_bytes);
      or_field(payload, 0, (uint32_t)base);
      if constexpr (WS == 64) or_field(payload, 32, (uint32_t)((uint64_t)base >> 32));
    }
    BUDDY_BPC_PRAGMA(unroll)
    for (uint32_t s = 0; s < NS; ++s) {
      const bool writes = s < G || lane == 0;
      if (writes && code[s].bits) or_field(payload, off[s], code[s].value);
      raw[s] = writes && code[s].kind == K_RAW;
      any_raw = any_raw || raw[s];
    }
    if (!warp.ballot(any_raw)) return;
    // the raw planes' bits: the kept pieces, or a second pass over the chunks
    RawWriter out[NS];
    BUDDY_BPC_PRAGMA(unroll)
    for (uint32_t s = 0; s < NS; ++s) out[s] = {(off[s] + 1) >> 5, (off[s] + 1) & 31u, 0u};
    BUDDY_BPC_PRAGMA(unroll(KEEP ? C : 1))
    for (uint32_t c = 0; c < C; ++c) {
      uint32_t dbx[NS];
      if constexpr (KEEP) {
        BUDDY_BPC_PRAGMA(unroll)
        for (uint32_t s = 0; s < NS; ++s) dbx[s] = kept[c][s];
      } else {
        word_t dor = 0;
        dbx_pieces(warp, entry_bytes, c, dbx, &dor);
      }
      BUDDY_BPC_PRAGMA(unroll)
      for (uint32_t s = 0; s < NS; ++s)
        if (raw[s]) out[s].put(payload, c, dbx[s]);
    }
    BUDDY_BPC_PRAGMA(unroll)
    for (uint32_t s = 0; s < NS; ++s)
      if (raw[s]) out[s].finish(payload);
  }

  // ---------------------------------------------------------------------------
  // decode
  // ---------------------------------------------------------------------------
  // Stream word w of a payload whose last word is `last`: a clamped index, so
  // a damaged stream never reads past the payload. A valid stream only reads
  // past its end for bits that lie after the code being read, which never
  // matter; a code that itself reaches past the end makes the stream too long.
  static BUDDY_HD uint32_t stream_word(const uint8_t* payload, uint32_t w, uint32_t last) {
    return buddy_load<uint32_t>(payload + 4 * buddy_min(w, last));
  }

  // The bits of a raw plane, a piece per chunk, from one new stream word each.
  struct RawReader {
    uint32_t word, shift, cur;

    BUDDY_HD uint32_t get(const uint8_t* payload, uint32_t c, uint32_t last) {
      const uint32_t next = stream_word(payload, word + c + 1, last);
      const uint32_t v = buddy_funnel_r(cur, next, shift) & piece_mask(c);
      cur = next;
      return v;
    }
  };

  template <class Warp>
  static BUDDY_WARP_FN uint32_t fail(const Warp& warp, uint8_t* out) {
    warp.sync();  // after any lane's writes to out
    buddy_warp_fill(warp, nullptr, out, entry);
    return BUDDY_ERR_STREAM;
  }

  // The code at stream bit off: its kind, bits, planes n and argument (a position, or where a raw plane's bits
  // start), as decode's walk takes it.
  struct Step {
    uint32_t kind, bits, n, arg;
  };
  static BUDDY_HD Step step_at(const uint8_t* payload, uint32_t off, uint32_t last) {
    const uint32_t w = off >> 5;
    const uint32_t h = buddy_funnel_r(stream_word(payload, w, last), stream_word(payload, w + 1, last), off & 31u);
    Step st = {0u, 0u, 1u, (h >> 5) & ((1u << PB) - 1u)};
    if (h & 1u) {
      st.kind = K_RAW, st.bits = RAW_BITS, st.arg = off + 1;
    } else if (h & 2u) {
      st.kind = K_ZERO, st.bits = 2 + RB, st.n = 2 + ((h >> 2) & ((1u << RB) - 1u));
    } else if (h & 4u) {
      st.kind = K_ZERO, st.bits = 3;
    } else {
      st.kind = 1 + ((h >> 3) & 3u), st.bits = h & 8u ? 5 + PB : 5;  // two ones and single one take a position
    }
    return st;
  }

  template <class Warp>
  static BUDDY_WARP_FN uint32_t decode(const Warp& warp, const uint8_t* payload, uint32_t k, uint32_t mode,
                                       uint8_t* out) {
    (void)mode;
    if constexpr (BUDDY_WARP_SIZE == 1) {
      return decode_one_lane(warp, payload, k, out);
    } else {
      return decode_warp(warp, payload, k, out);
    }
  }

  // decode by a warp of one lane (buddy_warp.h: the native engine's build): the same walk and checks, every plane
  // the lane's own, a chunk's 32 deltas transposed in place and summed in order.
  template <class Warp>
  static BUDDY_WARP_FN uint32_t decode_one_lane(const Warp& warp, const uint8_t* payload, uint32_t k, uint8_t* out) {
    constexpr uint32_t PLANES = 32u * G;  // plane j's code at [j] (j < ROW); the uniform sign plane's at [PLANES]
    const uint32_t nw = k * (BUDDY_SECTOR_BYTES / 4), last = nw - 1;
    uint32_t info[PLANES + 1];
    for (uint32_t j = 0; j <= PLANES; ++j) info[j] = K_ZERO;
    uint32_t off = WS, p = 0;
    while (p < P) {
      const Step st = step_at(payload, off, last);
      const uint32_t j = WS - p;
      if (UTOP && j == WS)
        info[PLANES] = st.kind | st.arg << 3;
      else if (j < ROW)
        info[j] = st.kind | st.arg << 3;
      off += st.bits;
      p += st.n;
    }
    bool bad = p != P || (off + 255) / 256 != k;
    for (uint32_t j = 0; j <= PLANES; ++j) {
      const uint32_t kind = info[j] & 7u, arg = info[j] >> 3, plane = j == PLANES ? WS : j;
      bad = bad || (kind == K_ONE && arg >= L) || (kind == K_TWO && arg + 1 >= L) || (kind == K_DBP0 && plane == WS);
    }
    for (uint32_t l = 0; !bad && l < 8u; ++l) {  // bits after the stream
      const uint32_t w = (off >> 5) + l;
      if (w < nw) bad = (stream_word(payload, w, last) & (l ? ~0u : ~0u << (off & 31u))) != 0;
    }
    if (bad) return fail(warp, out);

    uint64_t heads = 0;
    for (uint32_t j = 0; j < PLANES; ++j) heads |= (uint64_t)((info[j] & 7u) == K_DBP0) << j;
    row_t open[STEPS];
    {
      uint64_t f = heads;
      for (uint32_t t = 0; t < STEPS; ++t) {
        open[t] = (row_t)~f;
        f |= f >> (1u << t);
      }
    }
    const row_t under_top = (row_t)~low_bits(bit_length64(heads));
    RawReader raw[PLANES + 1];
    for (uint32_t j = 0; j <= PLANES; ++j) {
      const uint32_t a = info[j] >> 3;
      raw[j] = {a >> 5, a & 31u, (info[j] & 7u) == K_RAW ? stream_word(payload, a >> 5, last) : 0u};
    }
    word_t x = buddy_load<word_t>(payload);
    if constexpr (WS == 16) x = (word_t)(x & 0xFFFFu);
    buddy_store<word_t>(out, x);
    row_t dbp_any = 0;
    uint32_t top_any = 0;
    bool wrong_sign = false;
    for (uint32_t c = 0; c < C; ++c) {
      uint32_t rows[G][32], top = 0;  // the planes' pieces, then (transposed) the deltas' DBX rows
      for (uint32_t j = 0; j <= PLANES; ++j) {
        if (j == PLANES && !UTOP) break;
        const uint32_t kind = info[j] & 7u;
        const uint32_t rel = (info[j] >> 3) - 32u * c;
        uint32_t v = 0;
        if (kind == K_RAW) v = raw[j].get(payload, c, last);
        if (kind == K_ONES) v = piece_mask(c);
        if (kind == K_ONE && rel < 32) v = 1u << rel;
        if (kind == K_TWO) v = rel < 32 ? 3u << rel : rel == ~0u ? 1u : 0u;
        if (j == PLANES)
          top = v;
        else
          rows[j / 32u][j % 32u] = v;
      }
      for (uint32_t s = 0; s < G; ++s) transpose_local(rows[s]);
      top_any |= top;
      for (uint32_t l = 0; l < 32u; ++l) {
        row_t y = rows[0][l];
        if constexpr (WS == 64) y |= (row_t)rows[G - 1][l] << 32;
        for (uint32_t t = 0; t < STEPS; ++t) y ^= (y >> (1u << t)) & open[t];
        bool neg;
        if constexpr (UTOP) {
          neg = (top >> l) & 1u;
          if (neg) y ^= under_top;
        } else {
          neg = (y >> WS) & 1u;
        }
        dbp_any |= y;
        const word_t next = (word_t)(x + (word_t)y);  // x_{32c + l + 1}
        const uint32_t i = 32u * c + l;
        if (i < L) {
          wrong_sign = wrong_sign || less_signed(next, x) != neg;
          buddy_store<word_t>(out + (i + 1) * (WS / 8), next);
        }
        x = next;
      }
    }
    uint64_t dbp_nz = (uint64_t)dbp_any;
    if constexpr (WS == 64) {
      bad = (heads & ~(dbp_nz >> 1) & ~(1ull << 63)) != 0 || ((heads >> 63) && !top_any);
    } else {
      if constexpr (UTOP) dbp_nz |= (uint64_t)(top_any != 0) << WS;
      bad = (heads & ~(dbp_nz >> 1)) != 0;
    }
    if (bad || wrong_sign) return fail(warp, out);
    return 0;
  }

  template <class Warp>
  static BUDDY_WARP_FN uint32_t decode_warp(const Warp& warp, const uint8_t* payload, uint32_t k, uint8_t* out) {
    static_assert(sizeof(Warp) > 0 && BUDDY_WARP_SIZE == 32u, "a transpose across 32 lanes");
    const uint32_t lane = warp.lane();
    const uint32_t nw = k * (BUDDY_SECTOR_BYTES / 4), last = nw - 1;  // stream words

    // 1. Walk the codes, the same on every lane: a code covers a plane or
    // more, so there are P steps at most. The lane owning plane j keeps its
    // code as kind | argument << 3 (a position, or where a raw plane's bits start).
    uint32_t plane[NS], info[NS];
    BUDDY_BPC_PRAGMA(unroll)
    for (uint32_t s = 0; s < NS; ++s) plane[s] = plane_of(s, lane), info[s] = K_ZERO;
    uint32_t off = WS, p = 0;  // the next code's bit offset and stream plane (DBX_{ws-p})
    while (p < P) {
      const Step st = step_at(payload, off, last);
      BUDDY_BPC_PRAGMA(unroll)
      for (uint32_t s = 0; s < NS; ++s)
        if (plane[s] == WS - p) info[s] = st.kind | st.arg << 3;
      off += st.bits;
      p += st.n;
    }
    // The walk must end exactly at the last plane and in the last of k sectors,
    // the sign plane cannot be "DBP = 0", positions lie inside the plane.
    bool bad = p != P || (off + 255) / 256 != k;
    bool mine = false;
    BUDDY_BPC_PRAGMA(unroll)
    for (uint32_t s = 0; s < NS; ++s) {
      const uint32_t kind = info[s] & 7u, arg = info[s] >> 3;
      mine = mine || (kind == K_ONE && arg >= L) || (kind == K_TWO && arg + 1 >= L) ||
             (kind == K_DBP0 && plane[s] == WS);
    }
    // bits after the stream: they all lie in the last sector (at most 8 words)
    if (!bad && lane < 8) {
      const uint32_t w = (off >> 5) + lane;
      if (w < nw) mine = mine || (stream_word(payload, w, last) & (lane ? ~0u : ~0u << (off & 31u))) != 0;
    }
    if (bad || warp.ballot(mine)) return fail(warp, out);

    // 2. Rebuild the deltas chunk by chunk. The "DBP = 0" planes (heads) are the
    // same for every delta: a uniform mask of planes below ws.
    uint64_t heads = 0;
    BUDDY_BPC_PRAGMA(unroll)
    for (uint32_t s = 0; s < G; ++s) heads |= (uint64_t)warp.ballot((info[s] & 7u) == K_DBP0) << (32 * s);
    // Undoing the XOR chain inside a delta's row of DBX bits y: DBP_j = DBX_j ^
    // DBP_{j+1}, restarting at 0 at a head. A segmented suffix XOR in log steps:
    // y ^= (y >> d) & open_d, where open_d marks the bits whose window of d
    // planes above holds no head yet; these masks are the same for all deltas.
    row_t open[STEPS];
    {
      uint64_t f = heads;
      BUDDY_BPC_PRAGMA(unroll)
      for (uint32_t t = 0; t < STEPS; ++t) {
        open[t] = (row_t)~f;
        f |= f >> (1u << t);
      }
    }
    // ws >= 32: the sign plane on top of the row reaches the planes above the highest head
    const row_t under_top = (row_t)~low_bits(bit_length64(heads));
    // each slot's piece: a raw plane's next bits, or made from the code
    RawReader raw[NS];
    BUDDY_BPC_PRAGMA(unroll)
    for (uint32_t s = 0; s < NS; ++s) {
      const uint32_t a = info[s] >> 3;
      raw[s] = {a >> 5, a & 31u, (info[s] & 7u) == K_RAW ? stream_word(payload, a >> 5, last) : 0u};
    }
    word_t x = buddy_load<word_t>(payload);  // the base: stream bits 0 .. ws-1
    if constexpr (WS == 16) x = (word_t)(x & 0xFFFFu);
    if (lane == 0) buddy_store<word_t>(out, x);
    row_t dbp_any = 0;  // bit j: DBP_j has a set bit (ws = 16: bit 16 is the sign plane)
    uint32_t top_any = 0;
    bool wrong_sign = false;
    BUDDY_BPC_PRAGMA(unroll(C <= 8 ? C : 1))
    for (uint32_t c = 0; c < C; ++c) {
      uint32_t dbx[NS];
      BUDDY_BPC_PRAGMA(unroll)
      for (uint32_t s = 0; s < NS; ++s) {
        const uint32_t kind = info[s] & 7u;
        const uint32_t rel = (info[s] >> 3) - 32u * c;  // a position relative to this piece (wraps below it)
        uint32_t v = 0;
        if (kind == K_RAW) v = raw[s].get(payload, c, last);
        if (kind == K_ONES) v = piece_mask(c);
        if (kind == K_ONE && rel < 32) v = 1u << rel;
        if (kind == K_TWO) v = rel < 32 ? 3u << rel : rel == ~0u ? 1u : 0u;  // a pair may straddle two pieces
        dbx[s] = v;
      }
      // lane i: the DBX bits of delta 32c + i
      row_t y = transpose(warp, dbx[0]);
      if constexpr (WS == 64) y |= (row_t)transpose(warp, dbx[1]) << 32;
      BUDDY_BPC_PRAGMA(unroll)
      for (uint32_t t = 0; t < STEPS; ++t) y ^= (y >> (1u << t)) & open[t];
      bool neg;
      if constexpr (UTOP) {
        neg = (dbx[G] >> lane) & 1u;
        if (neg) y ^= under_top;
        top_any |= dbx[G];
      } else {
        neg = (y >> WS) & 1u;
      }
      dbp_any |= y;
      // the words: x_{i+1} = x_{32c} + the deltas 32c .. i (mod 2^ws)
      word_t d = (word_t)y;  // the low ws bits (ws = 16: without the sign)
      BUDDY_BPC_PRAGMA(unroll)
      for (uint32_t s = 1; s < 32; s <<= 1) {
        const word_t t = shfl_up_word(warp, d, s);
        if (lane >= s) d = (word_t)(d + t);
      }
      const word_t next = (word_t)(x + d);  // x_{32c + lane + 1}
      word_t prev = shfl_up_word(warp, next, 1);  // x_{32c + lane}
      if (lane == 0) prev = x;
      const uint32_t i = 32u * c + lane;
      if (i < L) {
        wrong_sign = wrong_sign || less_signed(next, prev) != neg;  // the sign plane must agree with the words
        buddy_store<word_t>(out + (i + 1) * (WS / 8), next);
      }
      x = shfl_word(warp, next, 31);
    }
    // A head needs a non-zero DBP plane above it (else the plane was a zero plane).
    uint64_t dbp_nz = buddy_warp_or(warp, (uint32_t)dbp_any);
    if constexpr (WS == 64) {
      dbp_nz |= (uint64_t)buddy_warp_or(warp, (uint32_t)(dbp_any >> 32)) << 32;
      bad = (heads & ~(dbp_nz >> 1) & ~(1ull << 63)) != 0 || ((heads >> 63) && !top_any);
    } else {
      if constexpr (UTOP) dbp_nz |= (uint64_t)(top_any != 0) << WS;
      bad = (heads & ~(dbp_nz >> 1)) != 0;
    }
    if (bad || warp.ballot(wrong_sign)) return fail(warp, out);
    return 0;
  }

  // Shuffles of a ws-bit word (two 32-bit halves for ws = 64).
  template <class Warp>
  static BUDDY_WARP_FN word_t shfl_up_word(const Warp& warp, word_t v, uint32_t d) {
    if constexpr (WS == 64)
      return (word_t)warp.shfl_up((uint32_t)v, d) | (word_t)warp.shfl_up((uint32_t)(v >> 32), d) << 32;
    else
      return (word_t)warp.shfl_up((uint32_t)v, d);
  }
  template <class Warp>
  static BUDDY_WARP_FN word_t shfl_word(const Warp& warp, word_t v, uint32_t src) {
    if constexpr (WS == 64)
      return (word_t)warp.shfl((uint32_t)v, src) | (word_t)warp.shfl((uint32_t)(v >> 32), src) << 32;
    else
      return (word_t)warp.shfl((uint32_t)v, src);
  }
};
