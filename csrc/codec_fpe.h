// fpe (a word's top bits -- sign, exponent, the mantissa's top bits --
// entropy-coded with the tensor's prefix code, the rest passed through;
// format versions 2 and 3) of one entry, one warp per entry: the device codec
// the kernels run, host-compilable so the tests check it byte for byte
// against the torch reference (buddy/codecs/fpe.py, whose module docstring
// specifies the format) under an emulated warp. The interface is the one
// every device codec has (see codec_zvc.h); fpe codes with a table, so it is
// an object holding the device table (TABLED).
//
// A word of w bytes is sign | exponent (e bits) | mantissa (m bits), with
// (e, m) = (4, 3), (8, 7), (8, 23), (11, 52) for w = 1, 2, 4, 8; its symbol
// is its top b bits, its tail the t = 8 w - b bits after them. The table's
// format says b and the payload's layout: format 3 (what fits make) and 2
// b = min(12, 8 w), format 1 (tensors written before format 2) 1 + e; the
// device table carries b (sym_bits) and the layout (split), so one kernel
// codes all three. Symbols 0 .. S-1 (S = 2^b), ZERO = S, ESC = S + 1.
// Each of the W = E / w words has a code -- ZERO's (an all-zero word, when
// the table has ZERO), else its symbol's, else ESC's followed by the symbol
// (b bits) -- and, unless its code is ZERO, a tail (t bits). C bits of codes,
// N tails, T = C + N t bits, k = ceil(T / 256); mode 0 only. Payload: the
// little-endian bit stream of buddy_bits.h,
//   split layout (format 3)      the codes in word order from bit 0; the
//                                j-th tail at bits [256 k - (j + 1) t,
//                                256 k - j t); zero bits between
//   serial layout (formats 1, 2) per word its code, then its tail; zero bits
//                                after the T bits
//
// The table (BuddyFpeTable below) is the device form of the tensor's
// fpe.Table: its Table.lookups and Table.multi_rows, built on the host by
// buddy.engines.cuda.device_table or by the fit kernel (codec_fpe_fit.h) and passed
// to every kernel by pointer (the kernels' `table` argument). A code is at
// most 12 bits (fpe.MAX_CODE_BITS), written most significant bit first;
// `enc` holds it already bit-reversed into stream order, so a code is one
// field, and `dec` is indexed by the next 12 stream bits. The decoder trusts
// the table (the host built it from a checked fpe.Table) and checks the
// stream: a code the table lacks, an escape of a symbol the table has a code
// for, a stream longer or shorter than k sectors, and set bits outside the
// codes and tails are BUDDY_ERR_STREAM, the entry decoded to zeros.
//
// Warp decomposition (E = 4 KiB: W = 1024 float32 or 2048 bfloat16 words):
//   measure  per round lane l sizes the words of the 16 bytes at
//            16 (32 r + l) (one 16-byte load): one table lookup per word; a
//            warp sum.
//   encode   the same sizes, per round one warp scan of (code bits, tails)
//            for the codes' offsets and the tails' places, then each lane
//            ORs its words' fields into the zeroed payload (shared memory)
//            through two 64-bit buffers, its codes' and its tails', a
//            32-bit word at a time (put_unit).
//   decode   split layout: every lane. The code section is cut into 32
//            spans of equal bits -- its length C estimated from k and the
//            table (span_model; nothing is stored, so the layout costs no
//            bit). A prefix code resynchronizes: decoded from inside a code,
//            it soon lands on a true boundary. So lane l decodes from 128
//            bits before its span (warm_up) to the first code start in it,
//            then every code that starts inside the span, a step taking
//            every code that lies in the next 12 bits (multi rows: a run of
//            1-bit ZERO codes is one step), and records which of its first
//            32 bits start a code. A lane whose start is not the true end of
//            the lane before (rare after the warm-up) decodes again from
//            that end until it meets a start it recorded, rounds of this
//            until no lane moves (31 at most). A warp scan of the lanes' code counts gives each its
//            words' indices, one of their tail counts its tails' places;
//            each lane then walks its span again, writing its words with
//            tails (ZERO words are the zeroed output's). When the estimate
//            falls short of C, another pass like it takes the rest from the
//            true end. Work: about 2 W / 32 steps per lane plus a few
//            rounds' scans (python -m experiments.lab.fpe_lanes measures
//            the passes, rounds and steps on the capture workloads; the
//            kernel budget, docs/kernel_budget.md, turns them into rates).
//            Serial layout: lane 0 walks the stream (each code's length and
//            the tail after it: serial by construction), 31 lanes idle --
//            kept so older tensors decode; nothing writes it any more.
#pragma once

#include "buddy_bits.h"
#include "buddy_format.h"
#include "buddy_warp.h"

#define BUDDY_FPE_CODE_BITS 12u                        // longest code (fpe.MAX_CODE_BITS)
#define BUDDY_FPE_ROWS (1u << BUDDY_FPE_CODE_BITS)      // decode rows: one per value of the next 12 stream bits
#define BUDDY_FPE_SYMBOLS ((1u << (1u + 11u)) + 2u)     // most symbols (8-byte words): S + 2 = 4098

// The device table of one fpe.Table (40976 bytes, buddy.engines.cuda.DEVICE_TABLE_BYTES):
//   dec[v]      for the next 12 stream bits v: symbol | code length << 16 of
//               the code they start with (length 0: none does)
//   multi[v]    fpe.Table.multi_rows: the codes wholly inside the next 12
//               stream bits v, starts | tails << 12 | bits << 24 (0: the
//               first is ESC or not a code)
//   enc[sym]    stream code | code length << 12 of a symbol (0: it has no
//               code); only the S + 2 symbols of the table are used
//   sym_bits    b: the bits of a word its symbols are (the table's format)
//   split       1: the split layout (table format 3), 0: the serial layout
//   span_model  fpe.Table.span_model: ZERO's code length (0: no ZERO) |
//               mean head bits * 256 << 8 (the code section's estimate)
struct BuddyFpeTable {
  uint32_t dec[BUDDY_FPE_ROWS];
  uint32_t multi[BUDDY_FPE_ROWS];
  uint16_t enc[BUDDY_FPE_SYMBOLS];
  uint32_t sym_bits;
  uint32_t split;
  uint32_t span_model;
};
// (no padding: the decode rows, dec and multi, are its first 8 * BUDDY_FPE_ROWS bytes, which unpack copies alone)
static_assert(sizeof(BuddyFpeTable) == 8u * BUDDY_FPE_ROWS + 2u * BUDDY_FPE_SYMBOLS + 12u, "no padding");
static_assert(sizeof(BuddyFpeTable) % 16u == 0u, "whole 16-byte units");

// b of the tables a fit makes (table format 3): a word's top 12 bits, all of a 1-byte word's
template <int WB>
struct buddy_fpe_fit_split {
  static constexpr uint32_t b = WB == 1 ? 8u : 12u;
  static constexpr uint32_t t = 8u * WB - b;
};

// What one lane of the split layout's decoder found in its span of the code
// section: from `start`, every code that starts before its limit. Packed in
// four words: the decoder's registers are few (64 a lane, no spills).
struct BuddyFpeSpan {
  uint32_t start;   // where the lane decoded from
  uint32_t end;     // the first code start at or past the limit; `never`: it stopped at a code the table lacks
  uint32_t counts;  // codes found | those of them with tails (not ZERO) << 16 (a span has < 2^16 bits)
  uint32_t marks;   // bit i: a code starts at start + i (i < 32: `window`)
};

#if defined(BUDDY_NATIVE_SOLO) && defined(__AVX2__)
#include <immintrin.h>
// The code bits of n words of WB bytes (2 or 4; n a multiple of 32 / WB) by their symbols' entries in the byte table
// sb (the top b bits of a word, t = 8 WB - b below them; sb readable 3 bytes past its last symbol), and the count
// of the non-zero words added to *nnz: measure_below_one_lane's sums, eight words a gather.
template <int WB>
inline uint32_t buddy_fpe_avx2_sizes(const uint8_t* p, uint32_t n, const uint8_t* sb, uint32_t t, uint32_t* nnz) {
  const __m256i low = _mm256_set1_epi32(0xFF), zero = _mm256_setzero_si256();
  const __m128i shift = _mm_cvtsi32_si128((int)t);
  __m256i bits = zero;
  uint32_t zeros = 0;
  for (uint32_t i = 0; i < n; i += 32u / WB) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + (size_t)WB * i));
    if constexpr (WB == 4) {
      const __m256i g = _mm256_i32gather_epi32(reinterpret_cast<const int*>(sb), _mm256_srl_epi32(x, shift), 1);
      bits = _mm256_add_epi32(bits, _mm256_and_si256(g, low));
      const __m256 none = _mm256_castsi256_ps(_mm256_cmpeq_epi32(x, zero));
      zeros += (uint32_t)__builtin_popcount((uint32_t)_mm256_movemask_ps(none));
    } else {
      const __m256i lo = _mm256_cvtepu16_epi32(_mm256_castsi256_si128(x));
      const __m256i hi = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(x, 1));
      const __m256i g0 = _mm256_i32gather_epi32(reinterpret_cast<const int*>(sb), _mm256_srl_epi32(lo, shift), 1);
      const __m256i g1 = _mm256_i32gather_epi32(reinterpret_cast<const int*>(sb), _mm256_srl_epi32(hi, shift), 1);
      bits = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_and_si256(g0, low), _mm256_and_si256(g1, low)));
      zeros += (uint32_t)__builtin_popcount((uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi16(x, zero))) / 2u;
    }
  }
  *nnz += n - zeros;
  const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
  const __m128i q = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  return (uint32_t)_mm_cvtsi128_si32(_mm_add_epi32(q, _mm_shuffle_epi32(q, 0xB1)));
}
#endif

// BUDDY_FPE_AVX512: the native engine's one-lane build for a host with AVX-512 (-march=native), whose encode of 2-
// and 4-byte words takes 16 words at a time where the plain loops take one (a build without it is tested alike)
#if defined(BUDDY_NATIVE_SOLO) && defined(__AVX512F__)
#define BUDDY_FPE_AVX512 1
// 16 words of WB bytes (2 or 4) at p, each in a 32-bit lane
template <int WB>
inline __m512i buddy_fpe_load16(const uint8_t* p) {
  if constexpr (WB == 4) return _mm512_loadu_si512(p);
  return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#else
#define BUDDY_FPE_AVX512 0
#endif

template <int WB>
struct BuddyFpe {
  static_assert(WB == 1 || WB == 2 || WB == 4 || WB == 8, "fpe words are 1, 2, 4 or 8 bytes");
  typedef typename buddy_uint<WB>::type word_t;
  static constexpr bool TABLED = true;
  static constexpr uint32_t TABLE_BYTES = sizeof(BuddyFpeTable);  // the device table's (a multiple of 8)
  static constexpr uint32_t ROWS_BYTES = 8u * BUDDY_FPE_ROWS;      // its decode rows, dec and multi: its first bytes
  static constexpr bool STAGED_DECODE = true;  // lanes write words at scattered places: decode into shared memory
  static constexpr uint32_t DECODE_PAD = 8;    // zeros after the payload: the walks' 32-bit reads need no bounds
  static constexpr uint32_t ZERO_MODE = 0;
  static constexpr uint32_t RAW_MODE = 0;
  static constexpr uint32_t entry = BUDDY_ENTRY_BYTES;  // bytes per entry, E
  static constexpr uint32_t words = entry / WB;          // words per entry, W
  static constexpr uint32_t never = 0xFFFFFFFFu;           // the length of a stream that cannot be decoded
  // Warp tiling of measure and encode: per round, lane l owns the words of the 16 bytes at 16 (32 r + l).
  static constexpr uint32_t units = entry / 16u;           // 16-byte units of an entry
  static constexpr uint32_t unit_words = 16u / WB;
  static constexpr uint32_t rounds = (units + BUDDY_WARP_SIZE - 1u) / BUDDY_WARP_SIZE;
  // The split layout's decoder: no span shorter than this many bits; resynchronizing rounds at most.
  static constexpr uint32_t min_span = 64u;
  static_assert(min_span > BUDDY_FPE_CODE_BITS, "walk: limit - 12 does not wrap");
  static constexpr uint32_t window = 32u;     // bits of a span whose code starts a lane records
  static constexpr uint32_t overshoot = 32u;  // the first pass covers the estimated C and 1/32 more
  static constexpr uint32_t warmup = 128u;    // a lane decodes this many bits before its span to fall in step

  // The table is on the device; b is read once per warp (a host-built table has it checked: buddy.engines.cuda), what
  // follows from it is computed where it is used (the object lives in registers across a kernel's loop).
  // The decoders read their rows (dec, multi) through `rows`: the table's own, or unpack's copy of them in the
  // block's shared memory (buddy_kernels.cu; the table's first ROWS_BYTES); the rest of the table -- enc, which a
  // decoder reads only to check an escape, sym_bits, split, span_model -- stays where the table is.
  const BuddyFpeTable* table;
  const BuddyFpeTable* rows;  // (only dec and multi are read through it)
  uint32_t sym_bits;  // b: a symbol is the word's top b bits (the table's)

  // (two constructors, not a default argument and a select: a select between the table and a copy in shared
  // memory hides where the rows are, and the compiler then reads them with generic loads)
  BUDDY_HD explicit BuddyFpe(const uint8_t* device_table)
      : table(reinterpret_cast<const BuddyFpeTable*>(device_table)), rows(table), sym_bits(table->sym_bits) {}
  BUDDY_HD BuddyFpe(const uint8_t* device_table, const uint8_t* decode_rows)
      : table(reinterpret_cast<const BuddyFpeTable*>(device_table)),
        rows(reinterpret_cast<const BuddyFpeTable*>(decode_rows)), sym_bits(table->sym_bits) {}

#if defined(BUDDY_PACK_FIELDS) && BUDDY_PACK_FIELDS && !defined(BUDDY_NATIVE_SOLO)
  // Pack's table of whole fields, made by the block in its shared memory (buddy_kernels.cu): for each symbol of
  // the fit's b the field encode_split packs for a word of it -- head | bits << 24 | a tail follows << 31 --, and
  // at 2^b a zero word's. A word's field is then one load where it was a table load and the selects around it.
  const uint32_t* fields = nullptr;
  BUDDY_HD void use_fields(const uint32_t* f) { fields = f; }
  static constexpr uint32_t FIELDS_BYTES = 16400u;  // (2^12 + 1) words, to 16 bytes (buddy.engines.cuda)
  static_assert(4u * ((1u << buddy_fpe_fit_split<WB>::b) + 1u) <= FIELDS_BYTES, "a field a symbol and ZERO's");
  // fields[0 .. 2^b] by the threads `tid` of `threads`, from the table's entries (field, as encode_split packs it)
  BUDDY_HD void make_fields(uint32_t* out, uint32_t tid, uint32_t threads) const {
    constexpr uint32_t b = buddy_fpe_fit_split<WB>::b, t = 8u * WB - b;
    const Specials sp = specials();
    for (uint32_t sym = tid; sym <= (1u << b); sym += threads) {
      // a non-zero word of the symbol (symbol 0's: 1 below its tail; a 1-byte word of symbol 0 is the zero word),
      // and at 2^b the zero word
      const word_t x = sym == (1u << b) ? (word_t)0 : (word_t)((uint64_t)sym << t | (uint64_t)(sym == 0u && t > 0u));
      const Field f = field<b>(x, sp);
      out[sym] = f.head | f.head_bits << 24 | (uint32_t)f.tail << 31;
    }
  }
#endif

#if defined(BUDDY_NATIVE_SOLO)
  // The native engine's one-lane decoder steps with a walk table (emit_walk): one 8-byte row per value of the
  // next WALK_BITS stream bits (32 KiB) with all a step needs -- emit reads a multi row and a dec row a step and
  // dec again for each further code with a tail, branching on how many. A row takes the codes wholly inside
  // those bits, up to the third with a tail:
  //   bits | codes << 4 | tails << 8 | at0 << 10 | at1 << 14 | sym0 << 18 | sym1 << 30 | tails * t << 42
  //   | (tails > 1) << 62 | (tails > 0) << 63
  // (at: the tail code's place among the row's codes, `codes` for a tail code the row lacks; bits 0: the first
  // code is ESC or not in the table -- emit_walk's one-code path; the last fields are what a step computes from
  // `tails`: its tails' bits, and each slot's mask as a sign bit). The rows follow from dec and b alone; a host
  // thread keeps the last table's (about 4,096 x 6 dec reads to make, a 16 KiB compare to reuse). 12 bits, not
  // 11: a row then holds two codes of 6 bits, fewer steps an entry; not 14 (128 KiB): little faster still, but
  // four times the rows to make a table.
  static constexpr uint32_t WALKS = 1u, WALK_BITS = 12u, WALK_ROWS = 1u << WALK_BITS;
// A launch's block makes the walk table only for a run of at least this many entries (buddy_kernels.cu): a new
// table's rows cost about as much as decoding ten entries without them, and a tensor of a few entries is decoded
// sooner with emit alone (experiments.host_cost's small tensors: the table would cost more than it saves)
#define BUDDY_WALK_MIN_ENTRIES 8
  struct WalkCache {
    bool made = false;
    uint32_t sym_bits = 0;
    uint32_t dec[BUDDY_FPE_ROWS];
    uint64_t rows[WALK_ROWS];
  };
  const uint64_t* walk_rows = nullptr;  // null: emit (tables of the serial layout, words of 8 bytes)

  BUDDY_HD void build_walk(uint64_t* rows) const {
    const BuddyFpeTable* const tab = table;
    const uint32_t zero = zero_sym(), esc = esc_sym();
    for (uint32_t v = 0; v < WALK_ROWS; ++v) {
      uint32_t pos = 0, codes = 0, tails = 0, at[2] = {0u, 0u}, sym[2] = {0u, 0u};
      for (;;) {
        const uint32_t one = tab->dec[(v >> pos) & (BUDDY_FPE_ROWS - 1u)], len = one >> 16, s = one & 0xFFFFu;
        if (len == 0 || s == esc || pos + len > WALK_BITS) break;  // (decided by the bits inside: taken)
        if (s != zero) {
          if (tails == 2u) break;
          at[tails] = codes;
          sym[tails++] = s;
        }
        ++codes;
        pos += len;
      }
      for (uint32_t i = tails; i < 2u; ++i) at[i] = codes;
      rows[v] = pos | codes << 4 | tails << 8 | at[0] << 10 | at[1] << 14 | (uint64_t)sym[0] << 18 |
                (uint64_t)sym[1] << 30 | (uint64_t)(tails * buddy_fpe_fit_split<WB>::t) << 42 |
                (uint64_t)(tails > 1u) << 62 | (uint64_t)(tails > 0u) << 63;
    }
  }
  // measure_below_one_lane's sizes table: a symbol's code bits, an escape's for a symbol without a code (the
  // fit's b, words of 1, 2 or 4 bytes); a host thread keeps the last table's (4,098 enc reads to make, an 8 KiB
  // compare to reuse).
  struct SizeCache {
    bool made = false;
    uint16_t enc[BUDDY_FPE_SYMBOLS];
    uint8_t bits[BUDDY_FPE_SYMBOLS + 3u];  // (3 bytes after: a 4-byte gather at the last symbol's)
  };
  const uint8_t* size_bits = nullptr;  // null: measure_below_one_lane from enc
  BUDDY_HD void prepare_sizes() {
    if (WB == 8 || sym_bits != buddy_fpe_fit_split<WB>::b) return;
    static thread_local SizeCache cache;
    if (!cache.made || memcmp(cache.enc, table->enc, sizeof(cache.enc)) != 0) {
      const uint32_t esc_bits = (specials().esc >> 12) + sym_bits;  // (<= 12 + 12)
      for (uint32_t s = 0; s < BUDDY_FPE_SYMBOLS; ++s) {
        const uint32_t e = table->enc[s];
        cache.bits[s] = (uint8_t)(e ? e >> 12 : esc_bits);
      }
      memcpy(cache.enc, table->enc, sizeof(cache.enc));
      cache.made = true;
    }
    size_bits = cache.bits;
  }
  // Points walk_rows at this host thread's rows of the table (made when the table differs from the last one's).
  BUDDY_HD void prepare_walk() {
    // emit_walk: the split layout's b as a constant, and two tails read at once (2 t + 7 <= 64 bits)
    static_assert(WB == 8 || 2u * buddy_fpe_fit_split<WB>::t + 7u <= 64u, "two tails in one 8-byte read");
    static_assert(WB == 8 || 2u * buddy_fpe_fit_split<WB>::t < 64u, "a row's tails' bits in its 6-bit field");
    if (!table->split || WB == 8 || sym_bits != buddy_fpe_fit_split<WB>::b) return;
    static thread_local WalkCache cache;
    if (!cache.made || cache.sym_bits != sym_bits || memcmp(cache.dec, table->dec, sizeof(cache.dec)) != 0) {
      build_walk(cache.rows);
      memcpy(cache.dec, table->dec, sizeof(cache.dec));
      cache.sym_bits = sym_bits;
      cache.made = true;
    }
    walk_rows = cache.rows;
  }
#endif

  BUDDY_HD uint32_t tail_bits() const { return 8u * WB - sym_bits; }  // t: the bits after the symbol
  BUDDY_HD uint32_t zero_sym() const { return 1u << sym_bits; }        // ZERO = S
  BUDDY_HD uint32_t esc_sym() const { return (1u << sym_bits) + 1u; }  // ESC = S + 1
  BUDDY_HD uint64_t tail_mask() const { return ((uint64_t)1 << tail_bits()) - 1u; }  // t <= 52
  // Whether words have tails: always for words of 2 bytes and more (b <= 12), so the compiler makes one path
  BUDDY_HD bool has_tails() const { return WB > 1 || tail_bits() != 0u; }

  static BUDDY_HD bool coded_mode(uint32_t mode) { return mode == 0; }

  static BUDDY_HD uint32_t sectors(uint32_t bits) {
    return (bits + 8u * BUDDY_SECTOR_BYTES - 1u) / (8u * BUDDY_SECTOR_BYTES);
  }

  // ---------------------------------------------------------------------------
  // encoding
  // ---------------------------------------------------------------------------
  // The entries of ZERO (0 when the table has none) and ESC: read once per call.
  struct Specials {
    uint32_t zero, esc;
  };
  BUDDY_HD Specials specials() const { return {table->enc[zero_sym()], table->enc[esc_sym()]}; }

  // A word's code field (the escaped symbol after ESC's code included) and whether a tail follows.
  struct Field {
    uint32_t head, head_bits;
    bool tail;
  };
  // Without branches (selects: a warp's lanes take no different paths): the symbol's entry is loaded for a
  // zero word too (symbol 0's, unused).
  // B: the table's b when it is known at compile time (the split layout's, buddy_fpe_fit_split), 0 for any.
  // has_zero: whether the table has ZERO where the caller knows it (1: it has, 0: it has not), -1: from sp.
  template <uint32_t B = 0u>
  BUDDY_HD Field field(word_t x, Specials sp, int has_zero = -1) const {
    if constexpr (BUDDY_WARP_SIZE == 1) return field_one_lane(x, sp);
    const uint32_t b = B ? B : sym_bits;
    const uint32_t sym = (uint32_t)((uint64_t)x >> (8u * WB - b)) & ((1u << b) - 1u);
    const uint32_t c = table->enc[sym];
    const uint32_t len = sp.esc >> 12;
    // (no short circuit: a host compiler keeps it a select too)
    const bool zero = has_zero < 0 ? (x == 0) & (sp.zero != 0) : has_zero > 0 && x == 0;
    const uint32_t entry = zero ? sp.zero : c;  // a code of the table: stream code | length << 12 (0: none)
    const uint32_t head = entry ? entry & 0xFFFu : (sp.esc & 0xFFFu) | sym << len;
    const uint32_t bits = entry ? entry >> 12 : len + b;
    return {head, bits, !zero};
  }
  // field for one lane (buddy_warp.h): the selects as masks -- a host compiler turns `zero ? :` into a branch,
  // which half-zero activations mispredict.
  // ZERO's entry is enc[S], and a zero word's symbol is 0: its index is the symbol with bit b set.
  BUDDY_HD Field field_one_lane(word_t x, Specials sp) const {
    const uint32_t sym = (uint32_t)((uint64_t)x >> tail_bits()) & (zero_sym() - 1u);
    const bool zero = (x == 0) & (sp.zero != 0);
    const uint32_t entry = table->enc[sym | (uint32_t)zero << sym_bits];
    if (entry == 0u) {  // an escape (rare: a branch the host predicts)
      const uint32_t len = sp.esc >> 12;
      return {(sp.esc & 0xFFFu) | sym << len, len + sym_bits, !zero};
    }
    return {entry & 0xFFFu, entry >> 12, !zero};
  }

  // Word i (0 .. 16 / WB - 1) of a 16-byte unit.
  static BUDDY_HD word_t unit_word(buddy_u128 unit, uint32_t i) { return buddy_unit_word<word_t>(unit, i); }

  // ORs the tail of word x into the stream at bit pos.
  BUDDY_HD void put_tail(uint32_t* stream, uint32_t pos, word_t x) const {
    if constexpr (WB == 8)
      buddy_put64(stream, pos, (uint64_t)x & tail_mask());
    else
      buddy_put32(stream, pos, (uint32_t)((uint64_t)x & tail_mask()));
  }

  // The serial layout: ORs the fields of word x into the stream at bit pos; returns the bit after them.
  BUDDY_HD uint32_t put(uint32_t* stream, uint32_t pos, word_t x, Specials sp) const {
    const Field f = field(x, sp);
    if (!f.tail) {
      buddy_put32(stream, pos, f.head);
      return pos + f.head_bits;
    }
    const uint64_t tail = (uint64_t)x & tail_mask();
    if constexpr (WB == 8) {  // head (<= 24 bits) and tail (52) may exceed 64 bits
      buddy_put32(stream, pos, f.head);
      buddy_put64(stream, pos + f.head_bits, tail);
    } else {  // <= 12 + 12 + 23 bits
      buddy_put64(stream, pos, f.head | tail << f.head_bits);
    }
    return pos + f.head_bits + tail_bits();
  }

  template <class Warp>
  BUDDY_WARP_FN uint32_t measure(const Warp& warp, const uint8_t* entry_bytes, uint32_t* mode) const {
    *mode = 0;
    const Specials sp = specials();
    uint32_t head = 0, zeros = 0, n = 0;  // code bits, ZERO words and words of this lane's units
    auto rounds_of = [&](auto b, bool has_zero) {  // (versions: b a constant or not, a table with ZERO or not)
      for (uint32_t r = 0; r < rounds; ++r) {
        bool valid;
        const buddy_u128 unit = buddy_round_unit(warp, entry_bytes, units, r, &valid);
        if (valid) unit_sizes<decltype(b)::value>(unit, sp, has_zero, &head, &zeros);
        n += valid ? unit_words : 0u;
      }
    };
    auto sized = [&](auto b) { sp.zero ? rounds_of(b, true) : rounds_of(b, false); };  // (one line: one call site)
    if (sym_bits == buddy_fpe_fit_split<WB>::b) {  // b a constant
      sized(buddy_constant<buddy_fpe_fit_split<WB>::b>{});
    } else {  // a table of another b (format 1's)
      sized(buddy_constant<0u>{});
    }
    // both layouts hold the same bits: every word's code and, unless it is ZERO, its tail
    return sectors(buddy_warp_sum(warp, head) + buddy_warp_sum(warp, n - zeros) * tail_bits());
  }

  // The code bits of the words of a 16-byte unit added to *head_bits, its ZERO words to *zeros: field's sizes
  // alone, a word's code bits from its symbol's (or ZERO's) entry, an escape's where it has none. B, has_zero: as
  // field's.
  template <uint32_t B>
  BUDDY_HD void unit_sizes(buddy_u128 unit, Specials sp, bool has_zero, uint32_t* head_bits, uint32_t* zeros) const {
    const uint32_t b = B ? B : sym_bits, esc_bits = (sp.esc >> 12) + b;
    uint32_t h = *head_bits, z = *zeros;
    for (uint32_t i = 0; i < unit_words; ++i) {
      const word_t x = unit_word(unit, i);
      const bool zero = has_zero && x == 0;
      const uint32_t c = table->enc[zero ? zero_sym() : (uint32_t)((uint64_t)x >> (8u * WB - b)) & ((1u << b) - 1u)];
      h += c ? c >> 12 : esc_bits;
      z += zero;
    }
    *head_bits = h;
    *zeros = z;
  }

  // measure_below by a warp of one lane: word by word (a word's code bits from its enc entry, ZERO's at enc[S],
  // an escape's without a branch), checked against the limit every 256 bytes.
  // B: the table's b when it is the fit's (a constant: the usual case), 0 for any other (read from the table).
  template <uint32_t B>
  BUDDY_HD uint32_t measure_below_one_lane(const uint8_t* entry_bytes, uint32_t limit) const {
    const Specials sp = specials();
    const uint16_t* const enc = table->enc;
    const uint32_t b = B ? B : sym_bits, t = 8u * WB - b, esc_bits = (sp.esc >> 12) + b;
    const uint32_t zero_at = (uint32_t)(sp.zero != 0) << b, no_zero = sp.zero == 0;
    const uint32_t stop = 8u * BUDDY_SECTOR_BYTES * (limit - 1u) + 1u;
    constexpr uint32_t chunk = 256u / WB < words ? 256u / WB : words;  // words between checks
#if defined(BUDDY_NATIVE_SOLO)
    if constexpr (B != 0 && WB < 8) {
      if (size_bits) {
        // With the sizes table (prepare_sizes): a word's code bits by its symbol alone, a zero word's as symbol
        // 0's, the difference made up per zero word at each check, and the tails from the non-zero count -- the
        // same sums at every check, so the same stop and result. (The fit's b: a word's top b bits are its
        // symbol, nothing to mask: a byte load and two adds a word, where the loop below masks, selects ZERO's
        // code and tests for an escape.)
        const uint8_t* const sb = size_bits;
        const uint32_t zero_fix = sp.zero ? (sp.zero >> 12) - sb[0] : 0u;  // (mod 2^32: may be "negative")
        uint32_t sum = 0, nnz = 0, bits = 0;
        for (uint32_t i0 = 0; i0 < words; i0 += chunk) {
#if defined(__AVX2__)
          if constexpr (WB == 4 || WB == 2) {
            // eight words' code bits at a time by one gather (4 bytes at each symbol's byte, its low byte kept),
            // the zero words by a compare: the same sums, an instruction for eight words where the loop takes
            // a few a word
            sum += buddy_fpe_avx2_sizes<WB>(entry_bytes + (size_t)WB * i0, chunk, sb, t, &nnz);
          } else
#endif
          for (uint32_t i = i0; i < i0 + chunk; ++i) {
            const word_t x = buddy_load<word_t>(entry_bytes + (size_t)WB * i);
            sum += sb[(uint32_t)((uint64_t)x >> t)];
            nnz += x != 0;
          }
          const uint32_t seen = i0 + chunk;
          bits = sum + (seen - nnz) * zero_fix + (no_zero ? seen : nnz) * t;
          if (bits >= stop) break;
        }
        return sectors(bits);
      }
    }
#endif
    uint32_t head = 0, tails = 0;
    for (uint32_t i0 = 0; i0 < words; i0 += chunk) {
      for (uint32_t i = i0; i < i0 + chunk; ++i) {
        const word_t x = buddy_load<word_t>(entry_bytes + (size_t)WB * i);
        const uint32_t sym = (uint32_t)((uint64_t)x >> t) & ((1u << b) - 1u);
        const uint32_t zero = x == 0;
        const uint32_t e = enc[sym | (zero_at & (0u - zero))];
        head += e ? e >> 12 : esc_bits;
        tails += (zero ^ 1u) | no_zero;
      }
      if (head + tails * t >= stop) break;
    }
    return sectors(head + tails * t);
  }

  // measure for a caller that only asks whether the entry takes fewer than `limit` (>= 1) sectors (auto2's choice):
  // k when it does, else some k >= limit. A warp of one lane stops once the words sized so far take that many; a
  // warp of 32 measures the whole entry.
  template <class Warp>
  BUDDY_WARP_FN uint32_t measure_below(const Warp& warp, const uint8_t* entry_bytes, uint32_t* mode,
                                       uint32_t limit) const {
    if constexpr (BUDDY_WARP_SIZE == 1) {
      *mode = 0;
      constexpr uint32_t fit_b = buddy_fpe_fit_split<WB>::b;
      return sym_bits == fit_b ? measure_below_one_lane<fit_b>(entry_bytes, limit)
                               : measure_below_one_lane<0u>(entry_bytes, limit);
    } else {
      (void)limit;
      return measure(warp, entry_bytes, mode);
    }
  }

  // The split layout's encode by a warp of one lane (words of 1, 2 or 4 bytes): the tails from the payload's end
  // down, then the codes from bit 0 (two passes: each keeps its bit buffer and counters in registers), each through
  // a 64-bit bit buffer whose current 32-bit word is stored after every word (plain stores, no read-modify-write,
  // no branch on the data); where the two share a word the codes' partial word stands, and the end stores both.
  // B: as measure_below_one_lane's.
  template <uint32_t B>
  BUDDY_HD void encode_split_one_lane(const uint8_t* entry_bytes, uint32_t k, uint8_t* payload) const {
    const Specials sp = specials();
    const BuddyFpeTable* const tab = table;  // (locals: the stores below could alias the members for a compiler)
    const uint32_t b = B ? B : sym_bits, t = 8u * WB - b, nw = k * (BUDDY_SECTOR_BYTES / 4u);
    const uint64_t tmask = ((uint64_t)1 << t) - 1u;
    uint32_t* const stream = reinterpret_cast<uint32_t*>(payload);
    for (uint32_t w = 0; w < nw; ++w) stream[w] = 0u;
    // the tails: a word has one unless it is zero and the table has ZERO
    const uint64_t zero_tails = sp.zero ? 0u : ~0ull;
    uint64_t tails = 0;  // the nt bits below word tw + 1, from bit 63 down
    uint32_t nt = 0, tw = nw - 1u;
    // G words' tails at a time where they fit the buffer beside a partial word (G t <= 32; the fit's b for words
    // of 2 bytes: 4 tails of 4 bits), else a word at a time: the buffer's counters are a chain of dependent
    // operations per group, not per word (a word's tail of 4 bits, bfloat16's, is a short step of that chain;
    // float32's, one at a time, gain little)
    constexpr uint32_t G = B && 8u * WB - B <= 8u ? 4u : 1u;
    static_assert(words % G == 0, "whole groups");
    // 4-byte words (the fit's b: tails of 20 bits): the tails first gathered, a chunk of words at a time, then
    // written eight at a time: 160 bits are five whole stream words (the tails start at a word's top: the payload
    // is whole sectors), made with fixed shifts and no buffer; the last few go through the buffer (put_tails).
    // (Fixed shifts are independent of each other: no chain through the buffer's counters.)
    auto put_tails = [&](uint32_t group, uint32_t bits) {  // a group's tails (its first the highest), bits < 32
      nt += bits;
      tails |= (uint64_t)group << ((64u - nt) & 63u);
      stream[buddy_min(tw, nw - 1u)] = (uint32_t)(tails >> 32);
      const uint32_t full = nt >> 5;  // a word filled (nt < 32 + 32: at most one)
      tails <<= 32u * full;
      nt -= 32u * full;
      tw -= full;
    };
    if constexpr (B != 0 && ((WB == 4 && 8u * WB - B == 20u) || (BUDDY_FPE_AVX512 && WB == 2 && 8u * WB - B == 4u))) {
      constexpr uint32_t chunk = words < 64u ? words : 64u;
      uint32_t pend[chunk + 24u];  // tails not yet written (fewer than 8 carried over), and 16 slots to spare
      uint32_t np = 0;
      for (uint32_t i0 = 0; i0 < words; i0 += chunk) {
#if BUDDY_FPE_AVX512
        if constexpr (chunk % 16u == 0) {
          // 16 words' tails at a time, those of the words that have one moved together (the same tails; one
          // compress for 16 words, no branch on which have one)
          const __m512i low = _mm512_set1_epi32((int)tmask);
          for (uint32_t i = i0; i < i0 + chunk; i += 16u) {
            const __m512i x = buddy_fpe_load16<WB>(entry_bytes + (size_t)WB * i);
            const __mmask16 has = zero_tails ? (__mmask16)0xFFFFu : _mm512_test_epi32_mask(x, x);
            _mm512_storeu_si512(pend + np, _mm512_maskz_compress_epi32(has, _mm512_and_si512(x, low)));
            np += (uint32_t)__builtin_popcount((uint32_t)has);
          }
        } else
#endif
        for (uint32_t i = i0; i < i0 + chunk; ++i) {
          const word_t x = buddy_load<word_t>(entry_bytes + (size_t)WB * i);
          pend[np] = (uint32_t)x & (uint32_t)tmask;  // (kept only if the word has a tail)
          np += (uint32_t)((x != 0) | (zero_tails != 0));
        }
        uint32_t g = 0;
        for (; g + 8u <= np; g += 8u) {
          const uint32_t* v = pend + g;  // tails v[0..7], v[0]'s the highest
          if constexpr (WB == 4) {  // of 20 bits: five words
            const uint32_t w[5] = {v[0] << 12 | v[1] >> 8, v[1] << 24 | v[2] << 4 | v[3] >> 16,
                                   v[3] << 16 | v[4] >> 4, v[4] << 28 | v[5] << 8 | v[6] >> 12, v[6] << 20 | v[7]};
            for (uint32_t q = 0; q < 5u; ++q) stream[buddy_min(tw - q, nw - 1u)] = w[q];
            tw -= 5u;
          } else {  // of 4 bits: one word
            stream[buddy_min(tw, nw - 1u)] = v[0] << 28 | v[1] << 24 | v[2] << 20 | v[3] << 16 | v[4] << 12 |
                                             v[5] << 8 | v[6] << 4 | v[7];
            tw -= 1u;
          }
        }
        for (uint32_t r = g; r < np; ++r) pend[r - g] = pend[r];
        np -= g;
      }
      for (uint32_t r = 0; r < np; ++r) put_tails(pend[r], t);  // the last tails, through the buffer
    } else {
      for (uint32_t i = 0; i < words; i += G) {
        uint32_t group = 0, bits = 0;  // the group's tails, the first one's highest, and their bits
        for (uint32_t g = 0; g < G; ++g) {
          const word_t x = buddy_load<word_t>(entry_bytes + (size_t)WB * (i + g));
          const uint64_t has = (0ull - (uint64_t)(x != 0)) | zero_tails;
          const uint32_t n = t & (uint32_t)has;
          group = G == 1u ? 0u : group << n;  // (a word without a tail adds nothing)
          group |= (uint32_t)((uint64_t)x & tmask & has);
          bits += n;
        }
        put_tails(group, bits);  // (nt < 32 + 23, and < 32 + 16 for groups)
      }
    }
    // the codes
    uint64_t codes = 0;  // the nc bits from word cw's bit 0 on
    uint32_t nc = 0, cw = 0;
    const uint32_t esc_head = sp.esc & 0xFFFu, esc_len = sp.esc >> 12;
    const uint32_t zero_at = (uint32_t)(sp.zero != 0) << b;  // ZERO's entry is enc[S] (a zero word's symbol is 0)
    auto entry_of = [&](word_t x) {  // code | length << 12; 0: none
      const uint32_t sym = (uint32_t)((uint64_t)x >> t) & ((1u << b) - 1u);
      return (uint32_t)tab->enc[sym | (zero_at & (0u - (uint32_t)(x == 0)))];
    };
    auto put = [&](uint32_t head, uint32_t len) {  // len <= 24 (nc < 32 + 24)
      codes |= (uint64_t)head << nc;
      nc += len;
      stream[buddy_min(cw, nw - 1u)] = (uint32_t)codes;
      const uint32_t c = nc >> 5;  // a word filled
      codes >>= 32u * c;
      nc -= 32u * c;
      cw += c;
    };
    auto put_word = [&](word_t x) {
      const uint32_t entry = entry_of(x);
      if (entry == 0u)  // no code: ESC's code and the symbol (rare: a branch the host predicts)
        put(esc_head | ((uint32_t)((uint64_t)x >> t) & ((1u << b) - 1u)) << esc_len, esc_len + b);
      else
        put(entry & 0xFFFu, entry >> 12);
    };
    // two words' codes at a time (at most 2 x 12 bits: one put), unless either escapes (word by word then)
    static_assert(words % 2u == 0, "whole pairs");
    auto put_pair = [&](uint32_t i) {
      const word_t x0 = buddy_load<word_t>(entry_bytes + (size_t)WB * i);
      const word_t x1 = buddy_load<word_t>(entry_bytes + (size_t)WB * (i + 1u));
      const uint32_t e0 = entry_of(x0), e1 = entry_of(x1);
      if (e0 == 0u || e1 == 0u) {
        put_word(x0);
        put_word(x1);
        return;
      }
      put((e0 & 0xFFFu) | (e1 & 0xFFFu) << (e0 >> 12), (e0 >> 12) + (e1 >> 12));
    };
    uint32_t i = 0;
#if BUDDY_FPE_AVX512
    if constexpr (B != 0 && (WB == 4 || WB == 2) && words % 16u == 0) {
      // 16 words' table entries by one gather and their 8 pairs' fields made at once, a chunk of words' worth
      // before their puts (the gathers of a chunk do not wait on the chain of puts, nor it on them); the puts read
      // the fields from a small buffer (fewer values live across their chain); 16 words with an escape are marked
      // (bit 31 of their first pair's field: a field has at most 29 bits) and go word by word
      const __m512i low = _mm512_set1_epi32((1 << B) - 1), half = _mm512_set1_epi32(0xFFFF);
      const __m512i zero_sym = _mm512_set1_epi32((int)zero_at), code = _mm512_set1_epi64(0xFFF);
      const __m512i len = _mm512_set1_epi64(0xF);
      constexpr uint32_t chunk = words < 128u ? words : 128u;
      static_assert(words % chunk == 0 && chunk % 16u == 0, "whole chunks of whole vectors");
      alignas(32) uint32_t fields[chunk / 2u];
      for (; i < words; i += chunk) {
        for (uint32_t v = 0; v < chunk; v += 16u) {
          const __m512i x = buddy_fpe_load16<WB>(entry_bytes + (size_t)WB * (i + v));
          const __m512i sym = _mm512_mask_or_epi32(_mm512_and_si512(_mm512_srli_epi32(x, 8 * WB - B), low),
                                                   _mm512_testn_epi32_mask(x, x), zero_sym, zero_sym);
          // (enc has S + 2 entries: the 4 bytes read at ZERO's, enc[S], end inside it)
          const __m512i e = _mm512_and_si512(_mm512_i32gather_epi32(sym, tab->enc, 2), half);
          // a pair in a 64-bit lane: the first word's entry low, the second's from bit 32
          const __m512i l0 = _mm512_and_si512(_mm512_srli_epi64(e, 12), len);
          const __m512i l1 = _mm512_and_si512(_mm512_srli_epi64(e, 44), len);
          const __m512i head = _mm512_or_si512(
              _mm512_and_si512(e, code), _mm512_sllv_epi64(_mm512_and_si512(_mm512_srli_epi64(e, 32), code), l0));
          const __m512i packed = _mm512_or_si512(head, _mm512_slli_epi64(_mm512_add_epi64(l0, l1), 24));
          _mm256_store_si256(reinterpret_cast<__m256i*>(fields + v / 2u), _mm512_cvtepi64_epi32(packed));
          if (_mm512_testn_epi32_mask(e, e)) fields[v / 2u] |= 0x80000000u;
        }
        for (uint32_t v = 0; v < chunk; v += 16u) {
          if (fields[v / 2u] >> 31) {
            for (uint32_t q = 0; q < 16u; q += 2u) put_pair(i + v + q);
            continue;
          }
          for (uint32_t q = v / 2u; q < v / 2u + 8u; ++q) put(fields[q] & 0xFFFFFFu, fields[q] >> 24);
        }
      }
    }
#endif
    for (; i < words; i += 2u) put_pair(i);
    // the words where the codes end and the tails begin (one word when they share it)
    const uint32_t last = (uint32_t)codes, first = (uint32_t)(tails >> 32);
    if (cw == tw) {
      if (cw < nw) stream[cw] = last | first;
    } else {
      if (nc && cw < nw) stream[cw] = last;
      if (nt && tw < nw) stream[tw] = first;
    }
  }

  // The split layout's fields of a lane's 16-byte unit (words of 1, 2 or 4 bytes; `packed` as encode makes them):
  // its codes from stream bit `pos` up, its tails down from bit `top`, the first highest. The codes of each group
  // of code_group words are shifted into three registers from its last word to its first (at most 4 x 24 bits,
  // the first lowest: no running offset) and ORed in after the group; the tails, where the split layout's b is a
  // constant B, into registers too, from the first (a word without a tail shifts nothing in), ORed in after the
  // unit, else through a 64-bit buffer filled from bit 63 down that ORs a 32-bit word into the stream once it is
  // whole. A unit's fields lie in a few words, of which only the first and last can hold another lane's, where a
  // field at a time took two ORs a field. Words with no set bit are not touched.
  template <uint32_t B>
  BUDDY_HD void put_unit(uint32_t* stream, uint32_t pos, uint32_t top, const uint32_t* packed,
                         buddy_u128 unit) const {
    for (uint32_t g = 0; g < unit_words; g += code_group) {
      uint32_t codes[3] = {}, bits = 0;  // the group's codes, little-endian, and their bits
      for (uint32_t i = code_group; i-- > 0u;) {
        const uint32_t f = packed[g + i], len = (f >> 24) & 0x1Fu;  // (a code of at most 24 bits)
        codes[2] = buddy_funnel_l(codes[1], codes[2], len);
        codes[1] = buddy_funnel_l(codes[0], codes[1], len);
        codes[0] = codes[0] << len | (f & 0xFFFFFFu);
        bits += len;
      }
      put_bits<3>(stream, pos, codes);
      pos += bits;
    }
    constexpr uint32_t R = tail_regs<B>;
    const uint32_t t = 8u * WB - (B ? B : sym_bits);
    const uint64_t tmask = ((uint64_t)1 << t) - 1u;
    uint64_t tails = 0;  // R == 0: the nt bits below word tw + 1, from bit 63 down (those at and above top: zeros)
    uint32_t tw = (top - 1u) >> 5, nt = R ? 0u : 32u * (tw + 1u) - top;
    uint32_t few[R ? R : 1] = {};  // R > 0: the unit's nt bits of tails, little-endian
    for (uint32_t i = 0; i < unit_words; ++i) {
      const uint32_t s = t & (0u - (packed[i] >> 31));  // (a word without a tail is zero: nothing ORed)
      nt += s;
      if constexpr (R > 0) {  // shifted in below the tails before it (s < 32)
        for (uint32_t r = R - 1u; r > 0u; --r) few[r] = buddy_funnel_l(few[r - 1u], few[r], s);
        few[0] = few[0] << s | (uint32_t)((uint64_t)unit_word(unit, i) & tmask);
      } else if (t != 0u) {
        tails |= ((uint64_t)unit_word(unit, i) & tmask) << ((64u - nt) & 63u);
        if (nt >= 32u) {  // (t <= 23: nt < 32 + 23)
          if (tails >> 32) buddy_atomic_or(stream + tw, (uint32_t)(tails >> 32));
          tails <<= 32;
          nt -= 32u;
          --tw;
        }
      }
    }
    if constexpr (R > 0) {
      put_bits<R>(stream, top - nt, few);  // (the nt bits just below top)
    } else {
      if (tails >> 32) buddy_atomic_or(stream + tw, (uint32_t)(tails >> 32));
    }
  }

  // ORs the N little-endian words v into the stream at bit pos: the N + 1 words from the one pos is in, those
  // with a bit set.
  template <uint32_t N>
  static BUDDY_HD void put_bits(uint32_t* stream, uint32_t pos, const uint32_t (&v)[N]) {
    uint32_t* const at = stream + (pos >> 5);
    for (uint32_t r = 0; r <= N; ++r) {
      const uint32_t w = buddy_funnel_l(r ? v[r - 1u] : 0u, r < N ? v[r] : 0u, pos);
      if (w) buddy_atomic_or(at + r, w);
    }
  }

  // The words whose codes put_unit shifts into its three registers at once: 4 (a code is at most 24 bits).
  static constexpr uint32_t code_group = unit_words < 4u ? unit_words : 4u;

  // The 32-bit registers a unit's tails fill where the split layout's b is a constant B (put_unit), words of 1 to
  // 4 bytes (2-byte words: 8 tails of 4 bits, 1; 4-byte words: 4 of 20 bits, 3); 0: put_unit's 64-bit buffer.
  template <uint32_t B>
  static constexpr uint32_t tail_regs = B != 0u && WB < 8 ? (unit_words * (8u * WB - B) + 31u) / 32u : 0u;

  template <class Warp>
  BUDDY_WARP_FN void encode(const Warp& warp, const uint8_t* entry_bytes, uint32_t k, uint32_t mode,
                            uint8_t* payload) const {
    (void)mode;
    if constexpr (BUDDY_WARP_SIZE == 1 && WB < 8) {
      if (table->split) {
        (void)warp;
        constexpr uint32_t fit_b = buddy_fpe_fit_split<WB>::b;
        if (sym_bits == fit_b)
          encode_split_one_lane<fit_b>(entry_bytes, k, payload);
        else
          encode_split_one_lane<0u>(entry_bytes, k, payload);
        return;
      }
    }
    const Specials sp = specials();
    // zero bits first: the fields are ORed in, and everything between and after them stays zero
    buddy_warp_fill(warp, nullptr, payload, k * BUDDY_SECTOR_BYTES);
    warp.sync();
    uint32_t* stream = reinterpret_cast<uint32_t*>(payload);
    if (!table->split) {
      encode_serial(warp, entry_bytes, stream, sp);
    } else if (sym_bits == buddy_fpe_fit_split<WB>::b) {  // b a constant
      encode_split<buddy_fpe_fit_split<WB>::b>(warp, entry_bytes, k, stream, sp);
    } else {  // a split table of another b (none: fpe.symbol_bits gives every table of the layout the fit's)
      encode_split<0u>(warp, entry_bytes, k, stream, sp);
    }
  }

  // The serial layout's encode by a warp (tables of format 1, 2; fits make format 3).
  template <class Warp>
  BUDDY_WARP_FN void encode_serial(const Warp& warp, const uint8_t* entry_bytes, uint32_t* stream,
                                   Specials sp) const {
    uint32_t base = 0;  // bits of earlier rounds
    for (uint32_t r = 0; r < rounds; ++r) {
      bool valid;
      const buddy_u128 unit = buddy_round_unit(warp, entry_bytes, units, r, &valid);
      uint32_t h = 0, zeros = 0, total;
      if (valid) unit_sizes<0u>(unit, sp, sp.zero != 0, &h, &zeros);
      const uint32_t z = valid ? unit_words - zeros : 0u;  // the words with tails
      uint32_t pos = base + buddy_warp_exclusive_scan(warp, h + z * tail_bits(), &total);
      if (valid) {
        for (uint32_t i = 0; i < unit_words; ++i) pos = put(stream, pos, unit_word(unit, i), sp);
      }
      base += total;
    }
  }

  // The split layout's encode by a warp (into the zeroed payload). B: as field's. Its rounds in two versions, for
  // a table with ZERO and one without: the compiler made the two inside the loop over rounds anyway (two copies of
  // the fields, one run: the condition is the table's), and the kernel budget counts a loop's versions called
  // from one line as versions, one of which runs (a copy inside a loop it charged as run).
  template <uint32_t B, class Warp>
  BUDDY_WARP_FN void encode_split(const Warp& warp, const uint8_t* entry_bytes, uint32_t k, uint32_t* stream,
                                  Specials sp) const {
    auto rounds = [&](bool has_zero) { encode_split_rounds<B>(warp, entry_bytes, k, stream, sp, has_zero); };
    sp.zero ? rounds(true) : rounds(false);  // (one line: one call site for the count)
  }
  template <uint32_t B, class Warp>
  BUDDY_WARP_FN void encode_split_rounds(const Warp& warp, const uint8_t* entry_bytes, uint32_t k, uint32_t* stream,
                                         Specials sp, bool has_zero) const {
    const uint32_t end = 8u * BUDDY_SECTOR_BYTES * k, t = 8u * WB - (B ? B : sym_bits);
    uint32_t base = 0, tails = 0;  // code bits and tails of earlier rounds
    for (uint32_t r = 0; r < rounds; ++r) {
      bool valid;
      const buddy_u128 unit = buddy_round_unit(warp, entry_bytes, units, r, &valid);
      uint32_t h = 0, z = 0, total;
      // each word's field once (registers: head < 2^24 | its bits << 24 | a tail follows << 31)
      uint32_t packed[unit_words];
      for (uint32_t i = 0; i < unit_words; ++i) {
#if defined(BUDDY_PACK_FIELDS) && BUDDY_PACK_FIELDS && !defined(BUDDY_NATIVE_SOLO)
        if constexpr (B != 0u) {  // the fit's b: pack's table of whole fields (make_fields)
          const word_t x = unit_word(unit, i);
          const uint32_t sym = (uint32_t)((uint64_t)x >> (8u * WB - B)) & ((1u << B) - 1u);
          packed[i] = valid ? fields[x == 0 ? 1u << B : sym] : 0u;
          h += (packed[i] >> 24) & 0x1Fu;
          z += packed[i] >> 31;
          continue;
        }
#endif
        const Field f = valid ? field<B>(unit_word(unit, i), sp, has_zero) : Field{0u, 0u, false};
        packed[i] = f.head | f.head_bits << 24 | (uint32_t)f.tail << 31;
        h += f.head_bits;
        z += f.tail;
      }
      // code bits (at most 16 words x 24 bits a lane) and tails (16) of a round in one scan
      const uint32_t before = buddy_warp_exclusive_scan(warp, h | z << 16, &total);
      uint32_t pos = base + (before & 0xFFFFu), j = tails + (before >> 16);
      if (valid) {
        if constexpr (WB < 8) {  // (one lane: encode_split_one_lane)
          put_unit<B>(stream, pos, end - j * t, packed, unit);
        } else {  // a tail of up to 52 bits: a field at a time
          for (uint32_t i = 0; i < unit_words; ++i) {
            buddy_put32(stream, pos, packed[i] & 0xFFFFFFu);
            pos += (packed[i] >> 24) & 0x1Fu;
            if (packed[i] >> 31) put_tail(stream, end - (j + 1u) * t, unit_word(unit, i));
            j += packed[i] >> 31;
          }
        }
      }
      base += total & 0xFFFFu;
      tails += total >> 16;
    }
  }

  // ---------------------------------------------------------------------------
  // decoding
  // ---------------------------------------------------------------------------
  template <class Warp>
  BUDDY_WARP_FN uint32_t decode(const Warp& warp, const uint8_t* payload, uint32_t k, uint32_t mode,
                                uint8_t* out) const {
    (void)mode;
    return table->split ? decode_split(warp, payload, k, out) : decode_serial(warp, payload, k, out);
  }

  // ---- the split layout: every lane -------------------------------------------
  // fpe.code_section_estimate: the code section's bits, estimated from k (integers, as the reference).
  // Its terms are below 2^16 E (256 zero W, 256 x the code section's bits): 32-bit integers up to E = 16 KiB
  // (a warp's division and products of 32 bits, not 64), 64-bit ones above.
  using estimate_int = typename buddy_pick<(uint64_t)65536u * entry < ((uint64_t)1 << 31), int32_t, int64_t>::type;
  BUDDY_HD uint32_t estimate(uint32_t k) const {
    using I = estimate_int;
    const I zero = (I)(table->span_model & 0xFFu), head = (I)(table->span_model >> 8);
    const I middle = ((I)256 * (I)k - 128) * 256;
    const I per_tail = head + 256 * (I)tail_bits() - 256 * zero;
    I tails;
    if (zero == 0)
      tails = (I)words;
    else if (per_tail <= 0)
      tails = 0;
    else
      tails = buddy_min<I>((I)words, buddy_max<I>(0, middle - 256 * zero * (I)words) / per_tail);
    const I c = (middle - 256 * tails * (I)tail_bits()) / 256;
    return (uint32_t)buddy_min<I>(256 * (I)k, buddy_max<I>(1, c));
  }

  // The walks below read the 32 stream bits at a place before the payload's end (a code and an escaped symbol
  // are at most 24 bits) with two 4-byte loads and no bounds: the payload is followed by DECODE_PAD zero
  // bytes (buddy_op_unpack's staging), so bits past it read as zeros, as the reference reads them.
  //
  // Steps from pos over the codes of the code section that start before `limit`, recording them in sp, until
  // it meets a code start the lane recorded before (bit i of `merge`: a start at merge_at + i; 0: none).
  // Returns where it stopped: a code start at or past the limit, the start it met, or `never` at a code the
  // table lacks. In three loops, each a step a lookup: the span's first bits (its starts recorded, and those
  // recorded before met), the steps that end before the limit (no code of the next lane's to cut, nothing to
  // record or meet: most steps), and the last steps before the limit.
  BUDDY_HD uint32_t walk(const uint8_t* payload, BuddyFpeSpan& sp, uint32_t pos, uint32_t limit,
                         uint32_t merge_at, uint32_t merge) const {
    const uint32_t early = (merge ? buddy_max(sp.start, merge_at) : sp.start) + window;  // (a start met: before)
    // (`never`, a code the table lacks, ends every loop: limit >= min_span > 12)
    while (pos < limit && pos < early) {  // the first bits: every check
      const uint32_t d = pos - merge_at;  // (wraps when pos < merge_at)
      if (d < window && (merge >> d) & 1u) return pos;
      pos = step<true>(buddy_peek32_padded(payload, pos), sp, pos, limit);
    }
    while (pos <= limit - BUDDY_FPE_CODE_BITS) {  // the middle: a step's codes all start before the limit
      pos = step<false>(buddy_peek32_padded(payload, pos), sp, pos, limit);
    }
    while (pos < limit) {  // the last bits: a step cut at the limit
      pos = step<true>(buddy_peek32_padded(payload, pos), sp, pos, limit);
    }
    return pos;
  }

  // A walk's step at pos (`bits`: the 32 stream bits there): the codes in the next 12 bits (a multi row: a run
  // of 1-bit ZERO codes is one step), or ESC with its symbol, added to sp's counts; where the next step starts,
  // or `never` at a code the table lacks. EDGE: the codes from the limit on are cut (the next lane's), and
  // those in the span's first `window` bits are recorded.
  template <bool EDGE>
  BUDDY_HD uint32_t step(uint32_t bits, BuddyFpeSpan& sp, uint32_t pos, uint32_t limit) const {
    const uint32_t row = rows->multi[bits & (BUDDY_FPE_ROWS - 1u)];
    uint32_t starts, tails, took;  // (tails: the row's mask where it lies, bits 12 to 23: one mask, no shift)
    if (row) {  // the codes inside the next 12 bits at once
      starts = row & 0xFFFu;
      tails = row & 0xFFF000u;
      took = row >> 24;
      if constexpr (EDGE) {
        // codes from the limit on are the next lane's (a start the walk meets inside a step is not looked
        // for: the decodes agree from there on, so the step's end is a recorded start too, or past them)
        const uint32_t cut = limit - pos < took ? starts & ~((1u << (limit - pos)) - 1u) : 0u;
        if (cut) {
          took = buddy_ctz(cut);
          starts &= (1u << took) - 1u;
          tails &= starts << 12;
        }
      }
    } else {  // ESC with its symbol, or not a code
      const uint32_t one = rows->dec[bits & (BUDDY_FPE_ROWS - 1u)];
      const uint32_t len = one >> 16, sym = one & 0xFFFFu;
      if (len == 0) return never;
      starts = 1u;
      tails = (uint32_t)(sym != (1u << sym_bits)) << 12;  // not ZERO
      took = len + (sym == (1u << sym_bits) + 1u ? sym_bits : 0u);  // ESC: its symbol follows
    }
    if constexpr (EDGE) {
      const uint32_t off = pos - sp.start;
      if (off < window) sp.marks |= starts << off;
    }
    sp.counts += buddy_popc(starts) + (buddy_popc(tails) << 16);
    return pos + took;
  }

  // The bits of the one code at the stream bits `bits`, ESC with its symbol; 0 for a code the table lacks.
  BUDDY_HD uint32_t one_code(uint32_t bits) const {
    const uint32_t one = rows->dec[bits & (BUDDY_FPE_ROWS - 1u)];
    return (one >> 16) == 0 ? 0u : (one >> 16) + ((one & 0xFFFFu) == esc_sym() ? sym_bits : 0u);
  }

  // Where a lane whose span starts at `guess` starts: the first code start at or past it of a decode from
  // `warmup` bits before it (not before `base`, the pass's true start) -- a prefix code falls in step within a
  // few codes, so this is nearly always the true end of the lane before, and the lane need not decode again.
  // `guess` itself if that decode meets a code the table lacks. Two loops: the steps that end before the guess,
  // then the last (a step that crosses it stops at its first code start past it).
  BUDDY_HD uint32_t warm_up(const uint8_t* payload, uint32_t guess, uint32_t base) const {
    uint32_t pos = guess - base > warmup ? guess - warmup : base;
    while (pos + BUDDY_FPE_CODE_BITS <= guess) {
      const uint32_t bits = buddy_peek32_padded(payload, pos);
      const uint32_t row = rows->multi[bits & (BUDDY_FPE_ROWS - 1u)];
      if (row) {
        pos += row >> 24;
      } else {  // ESC with its symbol, or not a code
        const uint32_t len = one_code(bits);
        if (len == 0) return guess;
        pos += len;
      }
    }
    while (pos < guess) {
      const uint32_t bits = buddy_peek32_padded(payload, pos);
      const uint32_t row = rows->multi[bits & (BUDDY_FPE_ROWS - 1u)];
      if (row) {
        const uint32_t ahead = guess - pos < (row >> 24) ? (row & 0xFFFu) & ~((1u << (guess - pos)) - 1u) : 0u;
        pos += ahead ? buddy_ctz(ahead) : row >> 24;  // the first start at or past the guess, if in this step
      } else {  // ESC with its symbol, or not a code
        const uint32_t len = one_code(bits);
        if (len == 0) return guess;
        pos += len;
      }
    }
    return pos;
  }

  // The lane's span decoded again from `from` (the true end of the lane before), until it meets a start of
  // its earlier decode: from there that decode is the true one, and its counts and end stand.
  BUDDY_HD void resync(const uint8_t* payload, BuddyFpeSpan& sp, uint32_t from, uint32_t limit) const {
    const BuddyFpeSpan old = sp;
    sp.start = from;
    sp.counts = sp.marks = 0;
    const uint32_t pos = walk(payload, sp, from, limit, old.start, old.marks);
    const uint32_t d = pos - old.start;
    if (pos >= limit || d >= window || !((old.marks >> d) & 1u)) {  // (never >= limit: a code the table lacks)
      sp.end = pos;
      return;
    }
    // the old codes before the meeting point are not the lane's: their count, and their tails counted again
    const uint32_t before = buddy_popc(old.marks & ((1u << d) - 1u));  // d < 32
    sp.counts += old.counts - (before | tails_between(payload, old.start, pos) << 16);
    const uint32_t off = pos - from;
    if (off < window) sp.marks |= (old.marks >> d) << off;
    sp.end = old.end;
  }

  // Codes with tails among those from p to `stop`, both code starts of one decode (a few codes: p and stop
  // are less than `window` bits apart).
  BUDDY_HD uint32_t tails_between(const uint8_t* payload, uint32_t p, uint32_t stop) const {
    uint32_t tails = 0;
    while (p < stop) {
      const uint32_t bits = buddy_peek32_padded(payload, p);
      const uint32_t row = rows->multi[(uint32_t)bits & (BUDDY_FPE_ROWS - 1u)];
      if (row) {
        const uint32_t step = buddy_min(row >> 24, stop - p);  // the codes that start before `stop` end there
        tails += buddy_popc((row >> 12) & ((1u << step) - 1u));
        p += step;
      } else {
        const uint32_t one = rows->dec[(uint32_t)bits & (BUDDY_FPE_ROWS - 1u)], sym = one & 0xFFFFu;
        tails += sym != zero_sym();
        p += (one >> 16) + (sym == esc_sym() ? sym_bits : 0u);
      }
    }
    return tails;
  }

  // Writes the words of the first `count` codes from pos: word index `first` on, the tails from the entry's
  // (tail_first)-th on (the j-th at end - (j + 1) t); *tails_at: where the lane's last tail begins, end - j t for
  // the j tails up to its own (end - tail_first t where it writes none). Returns the bit after the last code, or
  // `never` for an escape of a symbol the table has a code for or a tail outside the payload. That last check is made
  // once, after the walk (the places of a lane's tails only go down): a tail before the payload is read at bit 0
  // and the entry is then flagged and zeroed.
  BUDDY_HD uint32_t emit(const uint8_t* payload, uint32_t n64, uint32_t pos, uint32_t count, uint32_t first,
                         uint32_t tail_first, uint32_t end, uint8_t* out, uint32_t* tails_at) const {
    // the bit after the next tail, taken down a tail at a time (signed: below 0, the tail is before the payload);
    // next_tail: the place of the code's tail, where it has one (else of the last, unused)
    const int32_t t = (int32_t)tail_bits();
    int32_t top = (int32_t)end - (int32_t)(tail_first * tail_bits());
    auto next_tail = [&](bool has = true) {
      top -= has ? t : 0;
      return (uint32_t)buddy_max(top, (int32_t)0);
    };
    uint32_t done = 0;
    while (done < count) {
      if constexpr (BUDDY_WARP_SIZE == 1) {  // one lane walks unchecked codes (decode_split): stay in the payload
        if (pos >= end) return never;
      }
      const uint32_t bits = buddy_peek32_padded(payload, pos);
      // both rows of the next 12 bits at once (two independent loads): the step's codes, and the first code's
      // symbol and length -- all a step of one code needs (most steps of 2-byte words)
      const uint32_t row = rows->multi[(uint32_t)bits & (BUDDY_FPE_ROWS - 1u)];
      const uint32_t one = rows->dec[(uint32_t)bits & (BUDDY_FPE_ROWS - 1u)];
      const uint32_t starts = row & 0xFFFu;
      if (row && buddy_popc(starts) <= count - done) {  // the codes of the step, unless the lane's end is inside it
        uint32_t m = (row >> 12) & 0xFFFu;  // the codes with tails (the first starts at bit 0)
        {  // the first code's word, or a zero where the output holds one already (ZERO): a store either way, no
           // branch (a warp's lanes seldom agree: it would run both ways and the branch)
          const bool has = m & 1u;
          const uint64_t word = word_at(payload, n64, one & 0xFFFFu, next_tail(has));
          buddy_store<word_t>(out + (size_t)WB * (first + done), (word_t)(has ? word : 0u));
          m &= ~1u;
        }
        for (; m; m &= m - 1u) {  // (bit 0 is gone: 1 <= off < 12)
          const uint32_t off = buddy_ctz(m);
          const uint32_t sym = rows->dec[(uint32_t)(bits >> off) & (BUDDY_FPE_ROWS - 1u)] & 0xFFFFu;
          const uint32_t at = done + buddy_popc(starts << (32u - off));  // the codes before it
          put_word_at(payload, n64, sym, next_tail(), out + (size_t)WB * (first + at));
        }
        done += buddy_popc(starts);
        pos += row >> 24;
      } else {  // one code: ESC with its symbol, a code the table lacks, or the lane's last codes
        uint32_t sym, len;
        if (!code_at(bits, one, &sym, &len)) return never;  // (the find walk stops before such a code: not reached)
        if (sym != zero_sym()) put_word_at(payload, n64, sym, next_tail(), out + (size_t)WB * (first + done));
        done += 1;
        pos += len;
      }
    }
    *tails_at = (uint32_t)buddy_max(top, (int32_t)0);
    return top < 0 ? never : pos;  // the lane's last tail in the payload
  }

#if defined(BUDDY_NATIVE_SOLO)
  // emit for one lane with the walk table, from the code section's start: a step of a row stores its tail codes'
  // words (two slots, no branch: a slot the row lacks stores zero after the row's codes, the next code's place,
  // which that code writes again); ZERO words are the zeroed output's. Steps so while a row's codes and that place
  // are inside the entry; the last codes, ESC and codes the table lacks take emit's one-code path. Same result
  // and checks as emit.
  BUDDY_HD uint32_t emit_walk(const uint8_t* payload, uint32_t end, uint8_t* out, uint32_t* tails) const {
    const uint64_t* const rows = walk_rows;
    const BuddyFpeTable* const tab = table;
    // a table of the split layout has the fit's b (prepare_walk checks): constants, and registers to spare
    constexpr uint32_t b = buddy_fpe_fit_split<WB>::b, t = buddy_fpe_fit_split<WB>::t;
    constexpr uint32_t zero = 1u << b, tmask = (uint32_t)(((uint64_t)1 << t) - 1u);
    uint32_t done = 0, pos = 0;
    // `tp`: where the next two tails are read from, end - (j + 2) t for the j tails so far (mod 2^32, as the
    // formula in 32 bits: a place before the payload wraps, and buddy_min then reads at `end`, the pad); j itself
    // follows from it (tails_of), so a step keeps one counter for the tails, not two
    uint32_t tp = end - 2u * t, j1 = 0;  // (j1: the tails of 1-byte words, which have no tail bits to count by)
    auto tails_of = [&]() -> uint32_t {
      if constexpr (t == 0) return j1;
      return (end - 2u * t - tp) / t;
    };
    // The stream's next bits in a 64-bit buffer, refilled without a branch: a step's lookup waits on the
    // buffer's shift, not on a load from a place computed from the step before. `ptr`: the first byte not wholly
    // in the buffer; `count`: its bits (56-63 after a refill; a row takes at most 12, one code at most 24). The
    // 8-byte reads end at most 16 bytes past the code bits read (< end + 24 bits): inside the staging buffer (the
    // payload is at most E - 32 bytes of it); the bits they bring past the payload's pad are never a step's.
    const uint8_t* ptr = payload;
    uint64_t buf = 0;
    uint32_t count = 0;
    auto refill = [&]() {
      uint64_t next;
      __builtin_memcpy(&next, ptr, 8);
      buf |= next << count;
      ptr += (63u - count) >> 3;
      count |= 56u;
    };
    auto consume = [&](uint32_t len) {  // (a step's bits: refilled after it or not, as the path says)
      pos += len;
      buf >>= len;
      count -= len;
    };
    refill();
    for (;;) {
      // a row's steps, while a row's codes and the place after them are inside the entry, a refill every third
      // step, after its lookup (from 56 bits and more, three rows leave at least 20: the next lookup's 12 are in
      // the buffer): a lookup waits on the shift before it, a refill's load on no step (a refill every step
      // would put its work into every step's chain, not one step's in three)
      for (uint32_t step = 0;; step = step == 2u ? 0u : step + 1u) {
        if (done + WALK_BITS >= words) break;
        if (pos >= end) return never;  // unchecked codes: stay in the payload
        const uint64_t row = rows[(uint32_t)buf & (WALK_ROWS - 1u)];
        if (step == 0) refill();
        if (!(row & 15u)) break;
        uint8_t* const o = out + (size_t)WB * done;
        // the j-th and (j + 1)-th tails with one read (2 t + 7 <= 64): the (j + 1)-th is below the j-th
        const uint32_t at = buddy_min(tp, end);
        uint64_t both;
        __builtin_memcpy(&both, payload + (at >> 3), 8);
        both >>= at & 7u;
        // a slot the row lacks stores zero (its mask: the row's sign bits)
        const uint32_t w0 = ((uint32_t)(row >> 18 & 0xFFFu) << t | ((uint32_t)(both >> t) & tmask)) &
                            (uint32_t)((int64_t)row >> 63);
        const uint32_t w1 = ((uint32_t)(row >> 30 & 0xFFFu) << t | ((uint32_t)both & tmask)) &
                            (uint32_t)((int64_t)(row << 1) >> 63);
        buddy_store<word_t>(o + (size_t)WB * ((row >> 10) & 15u), (word_t)w0);
        buddy_store<word_t>(o + (size_t)WB * ((row >> 14) & 15u), (word_t)w1);
        tp -= (uint32_t)(row >> 42) & 63u;
        if constexpr (t == 0) j1 += (uint32_t)(row >> 8) & 3u;
        done += (uint32_t)(row >> 4) & 15u;
        consume((uint32_t)row & 15u);
      }
      refill();  // (the one-code path takes up to 24 bits)
      if (done >= words) break;
      // one code: ESC with its symbol, a code the table lacks, or the section's last codes
      if (pos >= end) return never;
      const uint32_t bits = (uint32_t)buf;
      uint32_t sym, len;
      if (!code_at(bits, tab->dec[bits & (BUDDY_FPE_ROWS - 1u)], &sym, &len)) return never;
      if (sym != zero) {
        put_word(payload, 0u, sym, end, tails_of(), out + (size_t)WB * done);
        tp -= t;
        if constexpr (t == 0) ++j1;
      }
      done += 1;
      consume(len);
      refill();
    }
    const uint32_t j = tails_of();
    *tails = j;
    return (uint64_t)j * t > end ? never : pos;  // the last tail (the (j - 1)-th) in the payload
  }
#endif

#if BUDDY_FPE_AVX512
  // ---- two entries at once (the one-lane build with AVX-512: decode_pair) ---------------
  // A walk's steps are a chain: each row's lookup waits on the shift of the step before, a load's latency a step
  // whatever else the step does; two entries' walks in one loop overlap their chains. Each walk (SymWalk) stores
  // a word's symbol, 0x8000 | symbol for a word with a tail and 0 for ZERO's, into 2-byte slots and leaves the
  // tails in the stream; expand then makes 16 words at a time. The same words, places and checks as emit_walk's
  // (a walk that rows, refills and the one-code path take alike).
  static constexpr bool PAIRS = (WB == 2 || WB == 4) && words % 32u == 0;
  struct SymWalk {
    const uint8_t* ptr;  // (emit_walk's refill: the first byte not wholly in buf, and buf's bits)
    uint64_t buf;
    uint32_t count, pos, done, tails;  // and the code bits, words and tails so far
  };
  BUDDY_HD static void sym_refill(SymWalk& w) {
    uint64_t next;
    __builtin_memcpy(&next, w.ptr, 8);
    w.buf |= next << w.count;
    w.ptr += (63u - w.count) >> 3;
    w.count |= 56u;
  }
  BUDDY_HD static void sym_consume(SymWalk& w, uint32_t len) {
    w.pos += len;
    w.buf >>= len;
    w.count -= len;
  }
  BUDDY_HD static void sym_step(SymWalk& w, uint64_t row, uint16_t* syms) {  // a row's codes (emit_walk's slots)
    uint16_t* const o = syms + w.done;
    o[(row >> 10) & 15u] = (uint16_t)((0x8000u | (uint32_t)(row >> 18 & 0xFFFu)) & (uint32_t)((int64_t)row >> 63));
    o[(row >> 14) & 15u] =
        (uint16_t)((0x8000u | (uint32_t)(row >> 30 & 0xFFFu)) & (uint32_t)((int64_t)(row << 1) >> 63));
    w.tails += (uint32_t)(row >> 8) & 3u;
    w.done += (uint32_t)(row >> 4) & 15u;
    sym_consume(w, (uint32_t)row & 15u);
  }
  // Both walks' row steps in one loop while both take one; each walk's buffer holds at least 20 bits after a step
  // (a refill every third), so sym_finish goes on from either at any step.
  BUDDY_HD void sym_steps2(SymWalk& a, uint32_t end_a, uint16_t* sa, SymWalk& b, uint32_t end_b, uint16_t* sb) const {
    const uint64_t* const rows = walk_rows;
    for (uint32_t step = 0;; step = step == 2u ? 0u : step + 1u) {
      if (a.done + WALK_BITS >= words || b.done + WALK_BITS >= words || a.pos >= end_a || b.pos >= end_b) return;
      const uint64_t ra = rows[(uint32_t)a.buf & (WALK_ROWS - 1u)], rb = rows[(uint32_t)b.buf & (WALK_ROWS - 1u)];
      if (!(ra & 15u) || !(rb & 15u)) return;
      if (step == 0) {
        sym_refill(a);
        sym_refill(b);
      }
      sym_step(a, ra, sa);
      sym_step(b, rb, sb);
    }
  }
  // A walk to the end of its code section, from where it is (emit_walk's loops); its length as emit_walk's.
  BUDDY_HD uint32_t sym_finish(SymWalk& w, uint32_t end, uint16_t* syms, uint32_t* tails) const {
    constexpr uint32_t t = buddy_fpe_fit_split<WB>::t, zero = 1u << buddy_fpe_fit_split<WB>::b;
    const uint64_t* const rows = walk_rows;
    for (;;) {
      for (uint32_t step = 0;; step = step == 2u ? 0u : step + 1u) {
        if (w.done + WALK_BITS >= words) break;
        if (w.pos >= end) return never;  // unchecked codes: stay in the payload
        const uint64_t row = rows[(uint32_t)w.buf & (WALK_ROWS - 1u)];
        if (step == 0) sym_refill(w);
        if (!(row & 15u)) break;
        sym_step(w, row, syms);
      }
      sym_refill(w);  // (the one-code path takes up to 24 bits)
      if (w.done >= words) break;
      if (w.pos >= end) return never;
      const uint32_t bits = (uint32_t)w.buf;
      uint32_t sym, len;
      if (!code_at(bits, table->dec[bits & (BUDDY_FPE_ROWS - 1u)], &sym, &len)) return never;
      if (sym != zero) {
        syms[w.done] = (uint16_t)(0x8000u | sym);
        ++w.tails;
      }
      w.done += 1;
      sym_consume(w, len);
      sym_refill(w);
    }
    *tails = w.tails;
    return (uint64_t)w.tails * t > end ? never : w.pos;  // the last tail in the payload
  }
  // The words from their symbols (sym_finish's, which found every tail's place inside the payload) and the tails:
  // 16 at a time, the next tails gathered (the j-th at end - (j + 1) t: 4 bytes at its first byte hold it, t + 7 <=
  // 32, at most 3 past the payload, in the staging buffer), expanded to the words that have one, ORed under the
  // symbols; every word stored, ZERO's too.
  BUDDY_HD void expand(const uint16_t* syms, const uint8_t* payload, uint32_t end, uint8_t* out) const {
    constexpr uint32_t t = buddy_fpe_fit_split<WB>::t;
    const __m512i flag = _mm512_set1_epi32(0x8000), sym = _mm512_set1_epi32(0xFFF), seven = _mm512_set1_epi32(7);
    const __m512i tmask = _mm512_set1_epi32((int)((1u << t) - 1u));
    const __m512i below = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32((int)t));  // tail j + q lies q t below tail j
    uint32_t j = 0;
    for (uint32_t i = 0; i < words; i += 16u) {
      const __m512i s = _mm512_cvtepu16_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(syms + i)));
      const __mmask16 has = _mm512_test_epi32_mask(s, flag);
      const uint32_t n = (uint32_t)__builtin_popcount((uint32_t)has);
      const __m512i at = _mm512_sub_epi32(_mm512_set1_epi32((int)(end - (j + 1u) * t)), below);
      __m512i g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), (__mmask16)((1u << n) - 1u),
                                              _mm512_srli_epi32(at, 3), payload, 1);
      g = _mm512_and_si512(_mm512_srlv_epi32(g, _mm512_and_si512(at, seven)), tmask);
      const __m512i w =
          _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(s, sym), t), _mm512_maskz_expand_epi32(has, g));
      if constexpr (WB == 4)
        _mm512_storeu_si512(out + 4u * i, w);
      else
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2u * i), _mm512_cvtepi32_epi16(w));
      j += n;
    }
  }
  // Whether an entry of this mode decodes with decode_pair: the split layout, walked (prepare_walk made the rows).
  BUDDY_HD bool pairs(uint32_t mode) const { return PAIRS && coded_mode(mode) && walk_rows != nullptr; }
  // Two entries of the split layout (each 0 < k < E/32, staged with DECODE_PAD zeros after): decode_split's words
  // and error for each, a's returned, b's in *err_b.
  template <class Warp>
  BUDDY_WARP_FN uint32_t decode_pair(const Warp& warp, const uint8_t* pa, uint32_t ka, uint8_t* oa,
                                     const uint8_t* pb, uint32_t kb, uint8_t* ob, uint32_t* err_b) const {
    alignas(64) uint16_t syms[2][words];  // (128 KiB at most: 2-byte words, E = 64 KiB)
    for (uint32_t i = 0; i < 2u * words; i += 32u)
      _mm512_store_si512(reinterpret_cast<__m512i*>(&syms[0][0] + i), _mm512_setzero_si512());
    const uint32_t ea = 8u * BUDDY_SECTOR_BYTES * ka, eb = 8u * BUDDY_SECTOR_BYTES * kb;
    SymWalk a = {pa, 0u, 0u, 0u, 0u, 0u}, b = {pb, 0u, 0u, 0u, 0u, 0u};
    sym_refill(a);
    sym_refill(b);
    sym_steps2(a, ea, syms[0], b, eb, syms[1]);
    uint32_t ta = 0, tb = 0;
    const uint32_t ca = sym_finish(a, ea, syms[0], &ta), cb = sym_finish(b, eb, syms[1], &tb);
    *err_b = pair_words(warp, pb, kb, cb, tb, syms[1], ob);
    return pair_words(warp, pa, ka, ca, ta, syms[0], oa);
  }
  // One entry of a pair: its words, unless its walk or decode_split's checks (split_fails) fail: then zeros and
  // BUDDY_ERR_STREAM.
  template <class Warp>
  BUDDY_WARP_FN uint32_t pair_words(const Warp& warp, const uint8_t* payload, uint32_t k, uint32_t codes,
                                    uint32_t tails, const uint16_t* syms, uint8_t* out) const {
    if (codes != never && !split_fails(warp, payload, k, codes, tails)) {
      expand(syms, payload, 8u * BUDDY_SECTOR_BYTES * k, out);
      return 0;
    }
    buddy_warp_fill(warp, nullptr, out, entry);
    return BUDDY_ERR_STREAM;
  }
#endif

  // The code that starts the stream bits `bits` (at least the next 24; `one`: their dec row): its symbol (ESC's:
  // the symbol that follows it) in *sym and its bits in *len; false for a code the table lacks or an escape of a
  // symbol the table has a code for.
  BUDDY_HD bool code_at(uint32_t bits, uint32_t one, uint32_t* sym, uint32_t* len) const {
    *len = one >> 16;
    *sym = one & 0xFFFFu;
    if (*len == 0) return false;
    if (*sym == esc_sym()) {
      *sym = (bits >> *len) & (zero_sym() - 1u);
      if (table->enc[*sym]) return false;
      *len += sym_bits;
    }
    return true;
  }

  // Writes the word of symbol sym and the entry's j-th tail (at end - (j + 1) t) to out; a tail placed before
  // the payload's start (the place wraps past it) reads as zeros: emit checks the places.
  BUDDY_HD void put_word(const uint8_t* payload, uint32_t n64, uint32_t sym, uint32_t end, uint32_t j,
                         uint8_t* out) const {
    // (a place before the payload wraps: read at the end, past which the payload reads as zeros)
    put_word_at(payload, n64, sym, buddy_min(end - (j + 1u) * tail_bits(), end), out);
  }
  // The word of symbol `sym` and the tail at bit `at` into out.
  BUDDY_HD void put_word_at(const uint8_t* payload, uint32_t n64, uint32_t sym, uint32_t at, uint8_t* out) const {
    buddy_store<word_t>(out, (word_t)word_at(payload, n64, sym, at));
  }
  // The word of symbol `sym` and the tail at bit `at`.
  BUDDY_HD uint64_t word_at(const uint8_t* payload, uint32_t n64, uint32_t sym, uint32_t at) const {
    (void)n64;  // (a tail of 8-byte words is read with bounds)
    uint64_t word = (uint64_t)sym << tail_bits();
    if constexpr (WB == 8)  // a tail of up to 52 bits
      word |= buddy_peek(payload, n64, at) & tail_mask();
    else if (has_tails())   // at most 23 bits
      word |= buddy_peek32_padded(payload, at) & (uint32_t)tail_mask();
    return word;
  }

  // A split entry's stream checked once its codes (`codes` bits) and `tails` tails are found: the lengths must give
  // k, and nothing may be set between the codes and the tails (every lane's answer the same).
  template <class Warp>
  BUDDY_WARP_FN bool split_fails(const Warp& warp, const uint8_t* payload, uint32_t k, uint32_t codes,
                                 uint32_t tails) const {
    const uint64_t bits = (uint64_t)tails * tail_bits(), end = 8u * BUDDY_SECTOR_BYTES * k;
    return bits > end || split_fails_at(warp, payload, k, codes, (uint32_t)(end - bits));
  }
  // The same, the tails from bit `tails_at` to the payload's end (at most the end).
  template <class Warp>
  BUDDY_WARP_FN bool split_fails_at(const Warp& warp, const uint8_t* payload, uint32_t k, uint32_t codes,
                                    uint32_t tails_at) const {
    const uint32_t end = 8u * BUDDY_SECTOR_BYTES * k, n64 = k * (BUDDY_SECTOR_BYTES / 8u);
    const uint64_t total = (uint64_t)codes + (end - tails_at);
    if (total > end || sectors((uint32_t)total) != k) return true;
    return warp.ballot(buddy_bits_between(warp, payload, n64, codes, tails_at)) != 0;
  }

  template <class Warp>
  BUDDY_WARP_FN uint32_t decode_split(const Warp& warp, const uint8_t* payload, uint32_t k, uint8_t* out) const {
    const uint32_t lane = warp.lane();
    const uint32_t n64 = k * (BUDDY_SECTOR_BYTES / 8u);  // 8-byte words of the payload
    const uint32_t end = 8u * BUDDY_SECTOR_BYTES * k;
    buddy_warp_fill(warp, nullptr, out, entry);  // ZERO words are written by this
    warp.sync();                                  // the zeros land before any lane writes a word
    uint32_t base = 0, done = 0, tails = 0, codes = 0;  // where this pass starts; codes and tails before it
    uint32_t tails_at = end;                             // where the tails begin (known with the last code)
    uint32_t want = estimate(k);                         // bits the pass's spans cover: the estimate and
    want += want / overshoot;                            // a little more, so one pass nearly always does
    bool bad = false;
    if constexpr (BUDDY_WARP_SIZE == 1) {
      // A warp of one lane (the native engine's build, buddy_warp.h): its span is the whole code section and
      // its first word is word 0, so it writes the words as it walks -- no find walk, no passes; the walk stops
      // at the payload's end, and the checks below are the warp's.
      (void)lane, (void)want;
#if defined(BUDDY_NATIVE_SOLO)
      if constexpr (WB < 8) {
        if (walk_rows) {
          codes = emit_walk(payload, end, out, &tails);
          tails_at = codes == never ? 0u : end - tails * tail_bits();  // (its tails are in the payload)
        } else {
          codes = emit(payload, n64, 0u, words, 0u, 0u, end, out, &tails_at);
        }
      } else
#endif
        codes = emit(payload, n64, 0u, words, 0u, 0u, end, out, &tails_at);
      bad = codes == never;
      done = words;
    }
    while (done < words) {
      // (a span has fewer than 2^15 bits: a lane's counts fit 16 bits each)
      const uint32_t span = buddy_min(0x7FFFu, buddy_max(min_span, (want + BUDDY_WARP_SIZE - 1u) / BUDDY_WARP_SIZE));
      const uint32_t limit = buddy_min(base + (lane + 1u) * span, end);
      BuddyFpeSpan sp = {buddy_min(base + lane * span, end), 0, 0, 0};
      if (lane) sp.start = warm_up(payload, sp.start, base);
      sp.end = walk(payload, sp, sp.start, limit, never, 0u);
      // a lane whose start is not the true end of the lane before decodes again from there, until none does (the
      // check before the rounds: most passes take none)
      uint32_t from;
      auto redo = [&] {
        from = warp.shfl_up(sp.end, 1u);
        if (lane == 0) from = base;
        return from != never && from != sp.start;  // nothing true follows a code the table lacks
      };
      bool again = redo();
      for (uint32_t round = 0; round < BUDDY_WARP_SIZE && warp.ballot(again); ++round) {
        if (again) resync(payload, sp, from, limit);
        again = redo();
      }
      // the lanes up to the first that stopped at a code the table lacks hold the true codes
      const uint32_t invalid = warp.ballot(sp.end == never);
      const uint32_t n = !invalid || lane <= buddy_ctz(invalid) ? sp.counts : 0u;
      uint32_t found, found_tails, first, tail_first;
      if constexpr (8u * entry < 0x10000u) {  // both counts in one scan: a pass's fit 16 bits (codes <= its bits)
        uint32_t both;
        const uint32_t before = buddy_warp_exclusive_scan(warp, n, &both);
        first = done + (before & 0xFFFFu), tail_first = tails + (before >> 16);
        found = both & 0xFFFFu, found_tails = both >> 16;
      } else {
        first = done + buddy_warp_exclusive_scan(warp, n & 0xFFFFu, &found);
        tail_first = tails + buddy_warp_exclusive_scan(warp, n >> 16, &found_tails);
      }
      const uint32_t count = first < words ? buddy_min(n & 0xFFFFu, words - first) : 0u;
      uint32_t at = end;  // where the lane's last tail begins
      const uint32_t stop = count ? emit(payload, n64, sp.start, count, first, tail_first, end, out, &at) : 0u;
      bad |= warp.ballot(stop == never) != 0;
      const uint32_t last = warp.ballot(count && first + count == words);  // the lane with the section's last code
      if (last) {  // its code and tail are the entry's last
        codes = warp.shfl(stop, buddy_ctz(last));
        tails_at = warp.shfl(at, buddy_ctz(last));
        done = words;
        break;
      }
      // the code section goes on past this pass (or the stream is damaged)
      base = warp.shfl(sp.end, BUDDY_WARP_SIZE - 1u);
      if (invalid || found == 0 || bad || base >= end) {
        bad = true;
        break;
      }
      done += found;
      tails += found_tails;
      want = (uint32_t)buddy_max<uint64_t>(1u, (uint64_t)(words - done) * base / done);
    }
    if (!bad) bad = split_fails_at(warp, payload, k, codes, tails_at);
    if (!bad) return 0;
    warp.sync();  // every lane's words are written before any lane zeroes them
    buddy_warp_fill(warp, nullptr, out, entry);
    return BUDDY_ERR_STREAM;
  }

  // ---- the lockstep layout: weighed for a format to come; no encoder writes it ------------------------------------
  // experiments/lab/fpe_lanes.py (`lockstep`) specifies it and makes its streams (docs/format-v3.md, "A layout for one
  // walk"). Word i is lane i % 32's, a word a lane each round, from a bit buffer the lane fills from the code section
  // in the order the lanes need bits. Before each word a lane holding fewer than LOCK_LOOKAHEAD bits tops it up by
  // what its words left are sure to hold (each at least the table's shortest code): 32 bits where they hold that many
  // (the lanes in order: a ballot), else fewer (then, in order: a warp scan of how many). Then it takes exactly the
  // bits its code lacks (a scan): a canonical code looked up in the bits held, zeros past them, is the shortest code
  // they begin, never longer than the true one. The tails lie as the split layout's, the j-th for the j-th word with
  // one (a ballot a round). buddy_fpe_lockstep_decode (buddy_kernels.cu) runs it: the tests check it under the
  // emulator against the simulation's streams, and the kernel budget counts it.
#if !defined(BUDDY_NATIVE_SOLO)  // (the layout is of 32 lanes: not in the one-lane build)
  static constexpr uint32_t LOCK_LOOKAHEAD = 24;  // a code and an escaped symbol: at most 24 bits

  // The f (at most 32) stream bits at `at` into the lane's buffer above its `level` bits; a place past the payload
  // reads zeros (its DECODE_PAD).
  BUDDY_HD static void lock_put(const uint8_t* payload, uint32_t end, uint32_t at, uint32_t f, uint64_t* buf,
                                uint32_t* level) {
    const uint32_t bits = buddy_peek32_padded(payload, buddy_min(at, end)) & (uint32_t)(((uint64_t)1 << f) - 1u);
    *buf |= (uint64_t)bits << *level;
    *level += f;
  }
  // f bits for each lane from the warp's place `cursor` on, the lanes in order (a warp scan).
  template <class Warp>
  BUDDY_WARP_FN void lock_take(const Warp& warp, const uint8_t* payload, uint32_t end, uint32_t f, uint64_t* buf,
                               uint32_t* level, uint32_t* cursor) const {
    uint32_t total;
    lock_put(payload, end, *cursor + buddy_warp_exclusive_scan(warp, f, &total), f, buf, level);
    *cursor += total;
  }

  template <class Warp>
  BUDDY_WARP_FN uint32_t decode_lockstep(const Warp& warp, const uint8_t* payload, uint32_t k, uint8_t* out) const {
    const uint32_t lane = warp.lane(), end = 8u * BUDDY_SECTOR_BYTES * k, n64 = k * (BUDDY_SECTOR_BYTES / 8u);
    const uint32_t below = (1u << lane) - 1u;       // the lanes before this one
    const uint32_t shortest = rows->dec[0] >> 16;  // (canonical: the code of value 0 is a shortest one)
    constexpr uint32_t rounds = (words + 31u) / 32u;
    const uint32_t mine = words % 32u == 0u ? rounds : (words - lane + 31u) / 32u;  // the lane's words
    uint64_t buf = 0;
    uint32_t level = 0, cursor = 0, tails = 0;
    bool bad = false;  // (a lane gone wrong decodes on: the entry is flagged at the end)
    uint8_t* at = out + (size_t)WB * lane;  // (a round's 32 words side by side)
    for (uint32_t r = 0; r < rounds; ++r, at += 32u * WB) {
      const bool live = r < mine, low = live && level < LOCK_LOOKAHEAD;
      const int32_t sure = (int32_t)((mine - r) * shortest) - (int32_t)level;  // the lane's bits not yet taken
      const uint32_t whole = warp.ballot(low && sure >= 32);
      if (low && sure >= 32) lock_put(payload, end, cursor + 32u * buddy_popc(whole & below), 32u, &buf, &level);
      cursor += 32u * buddy_popc(whole);
      if (warp.ballot(low && sure > 0 && sure < 32))  // (a lane's last words)
        lock_take(warp, payload, end, low && sure > 0 && sure < 32 ? (uint32_t)sure : 0u, &buf, &level, &cursor);
      uint32_t one, need;
      for (;;) {  // the code, then its escaped symbol: exactly the bits it lacks (none for a code the table lacks)
        one = rows->dec[(uint32_t)buf & ((1u << buddy_min(level, BUDDY_FPE_CODE_BITS)) - 1u)];
        const uint32_t len = one >> 16;
        need = len <= level && (one & 0xFFFFu) == esc_sym() ? len + sym_bits : len;
        const bool want = live && need > level;
        if (!warp.ballot(want)) break;
        lock_take(warp, payload, end, want ? need - level : 0u, &buf, &level, &cursor);
      }
      uint32_t sym, len;  // (a code the table lacks, or an escape of a symbol it has a code for: the entry is bad)
      bad |= !code_at((uint32_t)buf, one, &sym, &len) && live;
      const bool tail = live && sym != zero_sym();
      const uint32_t with = warp.ballot(tail);
      if (tail)
        put_word(payload, n64, sym, end, tails + buddy_popc(with & below), at);
      else if (live)
        buddy_store<word_t>(at, (word_t)0);
      tails += buddy_popc(with);
      buf >>= need;
      level -= need;
    }
    bad = warp.ballot(bad) != 0;
    if (!bad && !split_fails(warp, payload, k, cursor, tails)) return 0;
    warp.sync();  // every lane's words are written before any lane zeroes them
    buddy_warp_fill(warp, nullptr, out, entry);
    return BUDDY_ERR_STREAM;
  }
#endif

  // ---- the serial layout: lane 0 ----------------------------------------------
  // Lane 0's serial walk over a stream of n64 8-byte words: every word into
  // out (a store a word: out is the warp's shared staging on the GPU).
  // Returns the stream's length in bits, or `never` for a code the table
  // lacks, an escape of a symbol it has a code for, or a stream already past
  // the payload with words left (each takes a bit at least).
  BUDDY_HD uint32_t walk_serial(const uint8_t* payload, uint32_t n64, uint8_t* out) const {
    const uint32_t limit = 64u * n64;
    uint32_t pos = 0;
    for (uint32_t i = 0; i < words; ++i) {
      if (pos >= limit) return never;
      const uint64_t bits = buddy_peek(payload, n64, pos);
      uint32_t sym, len;
      if (!code_at((uint32_t)bits, rows->dec[(uint32_t)bits & (BUDDY_FPE_ROWS - 1u)], &sym, &len)) return never;
      pos += len;
      uint64_t word = 0;
      if (sym != zero_sym()) {
        // code, symbol and tail can exceed 64 bits for 8-byte words: the tail is read on its own
        word = (uint64_t)sym << tail_bits() | (buddy_peek(payload, n64, pos) & tail_mask());
        pos += tail_bits();
      }
      buddy_store<word_t>(out + (size_t)WB * i, (word_t)word);
    }
    return pos;
  }

  template <class Warp>
  BUDDY_WARP_FN uint32_t decode_serial(const Warp& warp, const uint8_t* payload, uint32_t k, uint8_t* out) const {
    const uint32_t n64 = k * (BUDDY_SECTOR_BYTES / 8u);  // 8-byte words of the payload
    const uint32_t total = warp.shfl(warp.lane() == 0 ? walk_serial(payload, n64, out) : 0u, 0u);
    // the stream's length must give k, and nothing may follow it
    bool bad = total == never || sectors(total) != k;
    if (!bad) bad = warp.ballot(buddy_bits_after(warp, payload, n64, total)) != 0;
    if (!bad) return 0;
    warp.sync();  // lane 0's words are written before any lane zeroes them
    buddy_warp_fill(warp, nullptr, out, entry);
    return BUDDY_ERR_STREAM;
  }
};
