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
//            code (set bits, first set bit, adjacent pairs, all ones; DBP = 0
//            from an OR of the deltas); zero runs come from a ballot of the
//            non-zero planes, and a warp sum of the code lengths gives T.
//   encode   the same pass, code offsets by a warp scan of the lengths
//            (stream order is top plane first: highest lane first), the short
//            codes OR-ed into a zeroed payload, then a second pass writes the
//            raw planes' pieces (a shifted 32-bit word per plane per chunk).
//   decode   one walk over the codes, uniform on every lane (a code's position
//            depends on the previous ones), records each plane's code with the
//            lane that owns it; then per chunk the lanes rebuild their DBX
//            pieces, transpose back (lane i: the DBX bits of delta i), undo
//            the XOR chain with a bit-parallel scan inside the word, prefix-sum
//            the deltas from the base over the lanes, and check the sign plane.
#pragma once

#include "buddy_format.h"
#include "buddy_warp.h"

template <int WB>
struct BuddyBpc {
  static_assert(WB == 1 || WB == 2 || WB == 4 || WB == 8, "bpc words are 1, 2, 4 or 8 bytes");
  static constexpr uint32_t ZERO_MODE = 0;
  static constexpr uint32_t RAW_MODE = 0;

  static constexpr uint32_t bit_length(uint32_t x) { return x ? 1u + bit_length(x >> 1) : 0u; }

  static constexpr uint32_t entry = BUDDY_ENTRY_BYTES;       // bytes per entry, E
  static constexpr uint32_t WS = WB == 2 ? 16u : WB == 8 ? 64u : 32u;  // BPC word bits (1-byte data: 32)
  typedef typename buddy_uint<WS / 8>::type word_t;
  typedef typename buddy_uint<(WS == 64 ? 8 : 4)>::type row_t;  // a delta's DBX bits (ws = 16: with the sign)
  static constexpr uint32_t W = entry * 8 / WS;              // words
  static constexpr uint32_t L = W - 1;                       // deltas: the bits of a plane
  static constexpr uint32_t P = WS + 1;                      // planes
  static constexpr uint32_t C = (L + 31) / 32;               // chunks of 32 deltas
  static constexpr uint32_t PB = bit_length(L - 1);          // bits of a position
  static constexpr uint32_t RB = bit_length(P - 2);          // bits of a run length
  static constexpr uint32_t RAW_BITS = 1 + L;                // a raw plane's code
  static constexpr uint32_t LAST_MASK = L % 32 ? (1u << (L % 32)) - 1u : ~0u;  // valid bits of the last piece
  static constexpr uint32_t G = WS == 64 ? 2u : 1u;          // lane-owned plane slots
  static constexpr bool UTOP = WS >= 32;                     // the sign plane is a uniform slot
  static constexpr uint32_t NS = G + (UTOP ? 1u : 0u);       // slots per lane
  static constexpr uint32_t NLP = UTOP ? WS : WS + 1;        // lane-owned planes
  static constexpr uint32_t ROW = UTOP ? WS : WS + 1;        // DBX bits of a delta's row (ws = 16: the sign too)
  static constexpr uint32_t STEPS = bit_length(ROW - 1);     // log steps of a scan over a row
  static constexpr word_t SIGN = (word_t)((word_t)1 << (WS - 1));

  static_assert(W >= 4 && W * WS == entry * 8, "an entry is at least 4 whole BPC words");
  static_assert(PB + 5 <= 32 && 2 + RB <= 32, "a code other than a raw plane fits 32 bits");

  // Plane kinds, as the decoder records them (a zero plane inside a run is K_ZERO too).
  enum : uint32_t { K_ZERO = 0, K_ONES, K_DBP0, K_TWO, K_ONE, K_RAW };
  // Code prefixes as LSB-first field values.
  static constexpr uint32_t C_RUN = 2, C_RUN1 = 4, C_ONES = 0, C_DBP0 = 16, C_TWO = 8, C_ONE = 24;

  static BUDDY_HD bool coded_mode(uint32_t mode) { return mode == 0; }

  // ---------------------------------------------------------------------------
  // small helpers
  // ---------------------------------------------------------------------------
  static BUDDY_HD uint32_t bit_length64(uint64_t x) {
    const uint32_t hi = (uint32_t)(x >> 32);
    return hi ? 32u + buddy_bit_length(hi) : buddy_bit_length((uint32_t)x);
  }

  // Bits 0 .. n-1 (n <= 64).
  static BUDDY_HD uint64_t low_bits(uint32_t n) { return n >= 64 ? ~0ull : (1ull << n) - 1ull; }

  // Valid bits of piece c of a plane (the last piece is short: L = 32C - 1 or less).
  static BUDDY_HD uint32_t piece_mask(uint32_t c) { return c + 1 == C ? LAST_MASK : ~0u; }

  // Plane index of slot s on this lane (the sign plane WS for the uniform slot).
  static BUDDY_HD uint32_t plane_of(uint32_t s, uint32_t lane) { return s < G ? 32u * s + lane : WS; }

  // Whether slot s of this lane holds a plane at all (ws = 16: lanes 17..31 hold none).
  static BUDDY_HD bool holds(uint32_t s, uint32_t lane) { return s >= G || 32u * s + lane < NLP; }

  // x < y for the ws-bit two's-complement words x and y.
  static BUDDY_HD bool less_signed(word_t x, word_t y) { return (word_t)(x ^ SIGN) < (word_t)(y ^ SIGN); }

  // One round of the 32 x 32 bit transpose: a lane whose bit m is clear swaps
  // its columns with bit m set for the partner's (lane + m) columns with bit m
  // clear, and the partner the other way round; `lo` marks the columns with
  // bit m clear. Selects rather than branches: the masks do not depend on the data.
  template <class Warp>
  static BUDDY_WARP_FN uint32_t transpose_round(const Warp& warp, uint32_t x, uint32_t m, uint32_t lo) {
    const uint32_t y = warp.shfl_xor(x, m);
    const bool up = (warp.lane() & m) != 0;
    const uint32_t keep = up ? ~lo : lo;  // the columns this lane keeps
    const uint32_t moved = up ? y >> m : y << m;
    return (x & keep) | (moved & ~keep);
  }

  // Bit j of lane i's result is bit i of lane j's x (its own inverse).
  template <class Warp>
  static BUDDY_WARP_FN uint32_t transpose(const Warp& warp, uint32_t x) {
    x = transpose_round(warp, x, 16, 0x0000FFFFu);
    x = transpose_round(warp, x, 8, 0x00FF00FFu);
    x = transpose_round(warp, x, 4, 0x0F0F0F0Fu);
    x = transpose_round(warp, x, 2, 0x33333333u);
    return transpose_round(warp, x, 1, 0x55555555u);
  }

  // ---------------------------------------------------------------------------
  // the DBX planes, a chunk at a time
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
      lo = (word_t)(b - a);  // the low ws bits of the (ws + 1)-bit delta
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
    uint32_t pos = 0;    // the lowest set bit (when count > 0)
    uint32_t pairs = 0;  // pairs of neighbouring set bits
    uint32_t last = 0;   // bit 31 of the previous piece (a pair may straddle two pieces)
    bool ones = true;    // every piece so far has all its bits set

    BUDDY_HD void add(uint32_t v, uint32_t c) {
      // ctz of v | bit 32: no undefined ctz(0), and the position is only kept for the first set bit
      if (count == 0 && v) pos = 32u * c + buddy_ctz64((uint64_t)v | (1ull << 32));
      count += buddy_popc(v);
      pairs += buddy_popc(v & (v >> 1)) + (last & v & 1u);
      last = v >> 31;
      ones = ones && v == piece_mask(c);
    }
  };

  // A plane's code: its kind, its length in bits and its value as an LSB-first
  // field of at most 32 bits (a raw plane: just the prefix bit).
  struct Code {
    uint32_t kind, bits, value;
  };

  // The code of plane j. nz: the non-zero planes below 64 (bit j), top_nz:
  // whether the sign plane is non-zero (ws = 64 keeps it out of nz), dor: bit j
  // set iff DBP_j is not all zero.
  static BUDDY_HD Code code_of(uint32_t j, const Summary& sum, uint64_t nz, bool top_nz, uint64_t dor) {
    if (sum.count) {
      Code code = {K_RAW, RAW_BITS, 1u};
      // the special codes in their order of preference; equal lengths go to the first
      if (sum.ones)
        code = {K_ONES, 5u, C_ONES};
      else if (j < WS && !((dor >> j) & 1u))
        code = {K_DBP0, 5u, C_DBP0};
      else if (sum.count == 2 && sum.pairs == 1)
        code = {K_TWO, 5u + PB, C_TWO | sum.pos << 5};
      else if (sum.count == 1)
        code = {K_ONE, 5u + PB, C_ONE | sum.pos << 5};
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

  // Every slot's code; returns the stream's length T in bits (the same on every lane).
  template <class Warp>
  static BUDDY_WARP_FN uint32_t plan(const Warp& warp, const uint8_t* entry_bytes, Code (&code)[NS]) {
    const uint32_t lane = warp.lane();
    Summary sum[NS];
    word_t dor = 0;
    for (uint32_t c = 0; c < C; ++c) {
      uint32_t dbx[NS];
      dbx_pieces(warp, entry_bytes, c, dbx, &dor);
      for (uint32_t s = 0; s < NS; ++s) sum[s].add(dbx[s], c);
    }
    // DBP_j has a set bit iff some delta has bit j set
    uint64_t any = buddy_warp_or(warp, (uint32_t)dor);
    if constexpr (WS == 64) any |= (uint64_t)buddy_warp_or(warp, (uint32_t)((uint64_t)dor >> 32)) << 32;
    // the non-zero planes as a mask (bit j: plane j; ws = 64 keeps the sign plane apart)
    uint64_t nz = 0;
    bool top_nz = false;
    for (uint32_t s = 0; s < G; ++s) nz |= (uint64_t)warp.ballot(holds(s, lane) && sum[s].count) << (32 * s);
    if constexpr (UTOP) {
      top_nz = sum[G].count != 0;
      if constexpr (WS < 64) nz |= (uint64_t)top_nz << WS;
    } else {
      top_nz = ((nz >> WS) & 1u) != 0;
    }
    uint32_t mine = 0;  // the code bits of this lane's own planes
    for (uint32_t s = 0; s < NS; ++s) {
      code[s] = holds(s, lane) ? code_of(plane_of(s, lane), sum[s], nz, top_nz, any) : Code{K_ZERO, 0u, 0u};
      if (s < G) mine += code[s].bits;
    }
    return WS + (UTOP ? code[G].bits : 0u) + buddy_warp_sum(warp, mine);
  }

  template <class Warp>
  static BUDDY_WARP_FN uint32_t measure(const Warp& warp, const uint8_t* entry_bytes, uint32_t* mode) {
    *mode = 0;
    Code code[NS];
    return (plan(warp, entry_bytes, code) + 255u) / 256u;
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
    const uint32_t lane = warp.lane();
    Code code[NS];
    plan(warp, entry_bytes, code);
    // Bit offsets: stream order is the sign plane, then DBX_{ws-1} down to DBX_0,
    // i.e. the higher slot first and, inside a slot, the higher lane first.
    uint32_t off[NS];
    uint32_t above = WS;  // bits before the current slot's planes
    if constexpr (UTOP) {
      off[G] = above;
      above += code[G].bits;
    }
    for (uint32_t g = G; g-- > 0;) {
      uint32_t total;
      const uint32_t before = buddy_warp_exclusive_scan(warp, code[g].bits, &total);
      off[g] = above + total - before - code[g].bits;  // the planes of the higher lanes come first
      above += total;
    }
    // a zeroed payload, then every field OR-ed in
    buddy_warp_fill(warp, nullptr, payload, k * BUDDY_SECTOR_BYTES);
    warp.sync();
    // the uniform slot is written by lane 0 alone
    bool writes[NS];
    for (uint32_t s = 0; s < NS; ++s) writes[s] = s < G ? holds(s, lane) : lane == 0;
    if (lane == 0) {
      const word_t base = buddy_load<word_t>(entry_bytes);
      or_field(payload, 0, (uint32_t)base);
      if constexpr (WS == 64) or_field(payload, 32, (uint32_t)((uint64_t)base >> 32));
    }
    bool raw = false;
    for (uint32_t s = 0; s < NS; ++s) {
      if (writes[s] && code[s].bits) or_field(payload, off[s], code[s].value);
      raw = raw || (writes[s] && code[s].kind == K_RAW);
    }
    if (!warp.ballot(raw)) return;
    // the raw planes: a second pass over the chunks
    RawWriter out[NS];
    for (uint32_t s = 0; s < NS; ++s) out[s] = {(off[s] + 1) >> 5, (off[s] + 1) & 31u, 0u};
    word_t dor = 0;
    for (uint32_t c = 0; c < C; ++c) {
      uint32_t dbx[NS];
      dbx_pieces(warp, entry_bytes, c, dbx, &dor);
      for (uint32_t s = 0; s < NS; ++s)
        if (writes[s] && code[s].kind == K_RAW) out[s].put(payload, c, dbx[s]);
    }
    for (uint32_t s = 0; s < NS; ++s)
      if (writes[s] && code[s].kind == K_RAW) out[s].finish(payload);
  }

  // ---------------------------------------------------------------------------
  // decode
  // ---------------------------------------------------------------------------
  // Stream word w of a payload of nw words (zero past them: never read).
  static BUDDY_HD uint32_t stream_word(const uint8_t* payload, uint32_t w, uint32_t nw) {
    return w < nw ? buddy_load<uint32_t>(payload + 4 * w) : 0u;
  }

  // The 32 stream bits from bit off.
  static BUDDY_HD uint32_t read32(const uint8_t* payload, uint32_t off, uint32_t nw) {
    const uint32_t w = off >> 5, s = off & 31u;
    const uint32_t lo = stream_word(payload, w, nw);
    return s ? lo >> s | stream_word(payload, w + 1, nw) << (32 - s) : lo;
  }

  template <class Warp>
  static BUDDY_WARP_FN uint32_t fail(const Warp& warp, uint8_t* out) {
    warp.sync();  // after any lane's writes to out
    buddy_warp_fill(warp, nullptr, out, entry);
    return BUDDY_ERR_STREAM;
  }

  template <class Warp>
  static BUDDY_WARP_FN uint32_t decode(const Warp& warp, const uint8_t* payload, uint32_t k, uint32_t mode,
                                       uint8_t* out) {
    (void)mode;
    const uint32_t lane = warp.lane();
    const uint32_t nw = k * (BUDDY_SECTOR_BYTES / 4);  // stream words

    // 1. Walk the codes, the same on every lane: P steps at most, as each code
    // covers a plane or more. The lane owning plane j keeps its kind and
    // argument (a position, or where a raw plane's bits start).
    uint32_t kind[NS], arg[NS];
    for (uint32_t s = 0; s < NS; ++s) kind[s] = K_ZERO, arg[s] = 0;
    uint32_t off = WS, p = 0;  // the next code's bit offset and stream plane (DBX_{ws-p})
    for (uint32_t step = 0; step < P && p < P; ++step) {
      const uint32_t h = read32(payload, off, nw);
      uint32_t kd = K_ZERO, a = 0, bits, n = 1;
      if (h & 1u) {
        kd = K_RAW, a = off + 1, bits = RAW_BITS;
      } else if (h & 2u) {
        bits = 2 + RB, n = 2 + ((h >> 2) & ((1u << RB) - 1u));
      } else if (h & 4u) {
        bits = 3;
      } else {
        const uint32_t t = (h >> 3) & 3u;  // 0: all ones, 1: two ones, 2: DBP = 0, 3: single one
        kd = t == 0 ? K_ONES : t == 1 ? K_TWO : t == 2 ? K_DBP0 : K_ONE;
        bits = kd == K_TWO || kd == K_ONE ? 5 + PB : 5;
        a = (h >> 5) & ((1u << PB) - 1u);
      }
      const uint32_t j = WS - p;
      for (uint32_t s = 0; s < NS; ++s) {
        if (s < G ? (j >> 5 == s && (j & 31u) == lane) : j == WS) kind[s] = kd, arg[s] = a;
      }
      off += bits;
      p += n;
    }
    // The walk must end exactly at the last plane and in the last of k sectors,
    // the sign plane cannot be "DBP = 0", positions lie inside the plane.
    bool bad = p != P || (off + 255) / 256 != k;
    bool mine = false;
    for (uint32_t s = 0; s < NS; ++s) {
      mine = mine || (kind[s] == K_ONE && arg[s] >= L) || (kind[s] == K_TWO && arg[s] + 1 >= L) ||
             (kind[s] == K_DBP0 && plane_of(s, lane) == WS);
    }
    // bits after the stream: they all lie in the last sector (at most 8 words)
    if (!bad && lane < 8) {
      const uint32_t w = (off >> 5) + lane;
      if (w < nw) mine = mine || (stream_word(payload, w, nw) & (lane ? ~0u : ~0u << (off & 31u))) != 0;
    }
    if (bad || warp.ballot(mine)) return fail(warp, out);

    // 2. Rebuild the deltas chunk by chunk. The "DBP = 0" planes (heads) are the
    // same for every delta: a uniform mask of planes below ws.
    uint64_t heads = 0;
    for (uint32_t s = 0; s < G; ++s) heads |= (uint64_t)warp.ballot(kind[s] == K_DBP0) << (32 * s);
    // Undoing the XOR chain inside a delta's word of DBX bits y: DBP_j = DBX_j ^
    // DBP_{j+1}, restarting at 0 at a head. A segmented suffix XOR in log steps:
    // y ^= (y >> d) & open_d, where open_d marks the bits whose window of d
    // planes above holds no head yet; these masks are the same for all deltas.
    row_t open[STEPS];
    {
      uint64_t f = heads;
      for (uint32_t t = 0; t < STEPS; ++t) {
        open[t] = (row_t)~f;
        f |= f >> (1u << t);
      }
    }
    // ws >= 32: the sign plane on top of the word reaches the planes below the highest head
    const row_t under_top = (row_t)~low_bits(bit_length64(heads));
    word_t x = buddy_load<word_t>(payload);  // the base; stream bits 0 .. ws-1
    if constexpr (WS == 16) x = (word_t)(x & 0xFFFFu);
    if (lane == 0) buddy_store<word_t>(out, x);
    row_t dbp_any = 0;  // bit j: DBP_j has a set bit (ws = 16: bit 16 is the sign plane)
    uint32_t top_any = 0, wrong_sign = 0;
    for (uint32_t c = 0; c < C; ++c) {
      uint32_t dbx[NS];
      for (uint32_t s = 0; s < NS; ++s) {
        const uint32_t rel = arg[s] - 32u * c;  // a position relative to this piece (wraps below)
        uint32_t v = 0;
        switch (kind[s]) {
          case K_RAW: v = read32(payload, arg[s] + 32u * c, nw) & piece_mask(c); break;
          case K_ONES: v = piece_mask(c); break;
          case K_ONE: v = rel < 32 ? 1u << rel : 0u; break;
          case K_TWO: v = rel < 32 ? 3u << rel : rel == ~0u ? 1u : 0u; break;
          default: break;
        }
        dbx[s] = v;
      }
      // lane i: the DBX bits of delta 32c + i
      row_t y = transpose(warp, dbx[0]);
      if constexpr (WS == 64) y |= (row_t)transpose(warp, dbx[1]) << 32;
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
      for (uint32_t s = 1; s < 32; s <<= 1) {
        word_t t;
        if constexpr (WS == 64)
          t = (word_t)warp.shfl_up((uint32_t)d, s) | (word_t)warp.shfl_up((uint32_t)(d >> 32), s) << 32;
        else
          t = (word_t)warp.shfl_up((uint32_t)d, s);
        if (lane >= s) d = (word_t)(d + t);
      }
      const word_t next = (word_t)(x + d);  // x_{32c + lane + 1}
      word_t prev;
      if constexpr (WS == 64)
        prev = (word_t)warp.shfl_up((uint32_t)next, 1) | (word_t)warp.shfl_up((uint32_t)(next >> 32), 1) << 32;
      else
        prev = (word_t)warp.shfl_up((uint32_t)next, 1);
      if (lane == 0) prev = x;
      const uint32_t i = 32u * c + lane;
      if (i < L) {
        wrong_sign |= less_signed(next, prev) != neg;  // the sign plane must agree with the words
        buddy_store<word_t>(out + (i + 1) * (WS / 8), next);
      }
      if constexpr (WS == 64)
        x = (word_t)warp.shfl((uint32_t)next, 31) | (word_t)warp.shfl((uint32_t)(next >> 32), 31) << 32;
      else
        x = (word_t)warp.shfl((uint32_t)next, 31);
    }
    // A head needs a non-zero DBP plane above it (else the plane was a zero plane).
    uint64_t dbp_nz = buddy_warp_or(warp, (uint32_t)dbp_any);
    if constexpr (WS == 64) dbp_nz |= (uint64_t)buddy_warp_or(warp, (uint32_t)((uint64_t)dbp_any >> 32)) << 32;
    if constexpr (WS == 64) {
      bad = (heads & ~(dbp_nz >> 1) & ~(1ull << 63)) != 0 || ((heads >> 63) && !top_any);
    } else {
      if (UTOP) dbp_nz |= (uint64_t)(top_any != 0) << WS;
      bad = (heads & ~(dbp_nz >> 1)) != 0;
    }
    if (bad || warp.ballot(wrong_sign != 0)) return fail(warp, out);
    return 0;
  }
};
