// fpe (a word's top bits -- sign, exponent, the mantissa's top bits --
// entropy-coded with the tensor's prefix code, the rest passed through; format
// version 2) of one entry, one warp per entry: the
// device codec the kernels run, host-compilable so the tests check it byte for
// byte against the torch reference (buddy/codecs/fpe.py, whose module
// docstring specifies the format) under an emulated warp. The interface is
// the one every device codec has (see codec_zvc.h); fpe codes with a table,
// so it is an object holding the device table (TABLED).
//
// A word of w bytes is sign | exponent (e bits) | mantissa (m bits), with
// (e, m) = (4, 3), (8, 7), (8, 23), (11, 52) for w = 1, 2, 4, 8; its symbol
// is its top b bits, its tail the t = 8 w - b bits after them. The table's
// format says b: format 2 (what fits make) min(12, 8 w), format 1 (tensors
// written before it, decoded still) 1 + e; the device table carries b
// (sym_bits), so one kernel codes both. Symbols 0 .. S-1 (S = 2^b),
// ZERO = S, ESC = S + 1.
// Payload: the little-endian bit stream of buddy_bits.h; per word in order:
//   its code      ZERO (an all-zero word, when the table has ZERO), else its
//                 symbol's code, else ESC's code followed by the symbol (b
//                 bits)
//   its tail      t bits, unless the code was ZERO
// T bits in all, k = ceil(T / 256), zero bits after; mode 0 only.
//
// The table (BuddyFpeTable below) is the device form of the tensor's
// fpe.Table: its Table.lookups, built on the host by buddy.cuda.device_table
// and passed to every kernel by pointer (the kernels' `table` argument). A
// code is at most 12 bits (fpe.MAX_CODE_BITS), written most significant bit
// first; `enc` holds it already bit-reversed into stream order, so a code is
// one field, and `dec` is indexed by the next 12 stream bits. The decoder
// trusts the table (the host built it from a checked fpe.Table) and checks
// the stream: a code the table lacks, an escape of a symbol the table has a
// code for, a stream longer or shorter than k sectors, and set bits after it
// are BUDDY_ERR_STREAM, the entry decoded to zeros.
//
// Warp decomposition:
//   measure  per round lane l sizes the words of the 8 bytes at
//            8 (32 r + l): one table lookup per word; a warp sum.
//   encode   the same sizes, a warp scan per round for the bit offsets, then
//            each lane ORs its words' fields into the zeroed payload.
//   decode   serial within an entry: a code's length is known only once it
//            is read. Lane 0 walks the stream -- per word a 64-bit peek at
//            the staged payload, one decode-table lookup, for 8-byte words a
//            second peek for the tail -- and writes the words 8 bytes at
//            a time; then the warp checks what follows the stream. What
//            bounds its speed: that one lane's dependent chain, about 20
//            instructions a word, each issued as a whole warp instruction
//            with 31 lanes idle. With the schedulers of an SM issuing ~4 warp
//            instructions a cycle across the resident warps (one entry each),
//            that is of the order of 0.2 words per cycle per SM -- roughly
//            50e9 words/s on an H100 (an estimate: not measured on a GPU),
//            several times slower than the encoder and than fpx's decoder.
//            Entries decode side by side; going faster needs several entries
//            per warp (a lane each) or a stream split into independently
//            decodable parts (a format change).
#pragma once

#include "buddy_bits.h"
#include "buddy_format.h"
#include "buddy_warp.h"

#define BUDDY_FPE_CODE_BITS 12u                        // longest code (fpe.MAX_CODE_BITS)
#define BUDDY_FPE_ROWS (1u << BUDDY_FPE_CODE_BITS)      // decode rows: one per value of the next 12 stream bits
#define BUDDY_FPE_SYMBOLS ((1u << (1u + 11u)) + 2u)     // most symbols (8-byte words): S + 2 = 4098

// The device table of one fpe.Table (24584 bytes, buddy.cuda.DEVICE_TABLE_BYTES):
//   dec[v]    for the next 12 stream bits v: symbol | code length << 16 of
//             the code they start with (length 0: none does)
//   enc[sym]  stream code | code length << 12 of a symbol (0: it has no code);
//             only the S + 2 symbols of the table are used
//   sym_bits  b: the bits of a word its symbols are (the table's format)
struct BuddyFpeTable {
  uint32_t dec[BUDDY_FPE_ROWS];
  uint16_t enc[BUDDY_FPE_SYMBOLS];
  uint32_t sym_bits;
};
static_assert(sizeof(BuddyFpeTable) == 4u * BUDDY_FPE_ROWS + 2u * BUDDY_FPE_SYMBOLS + 4u, "no padding");

// b of the tables a fit makes (table format 2): a word's top 12 bits, all of a 1-byte word's
template <int WB>
struct buddy_fpe_fit_split {
  static constexpr uint32_t b = WB == 1 ? 8u : 12u;
  static constexpr uint32_t t = 8u * WB - b;
};

template <int WB>
struct BuddyFpe {
  static_assert(WB == 1 || WB == 2 || WB == 4 || WB == 8, "fpe words are 1, 2, 4 or 8 bytes");
  typedef typename buddy_uint<WB>::type word_t;
  static constexpr bool TABLED = true;
  static constexpr uint32_t ZERO_MODE = 0;
  static constexpr uint32_t RAW_MODE = 0;
  static constexpr uint32_t entry = BUDDY_ENTRY_BYTES;  // bytes per entry, E
  static constexpr uint32_t words = entry / WB;          // words per entry, W
  static constexpr uint32_t never = 0xFFFFFFFFu;           // the length of a stream that cannot be decoded
  // Warp tiling: per round, lane l owns the lane_words words of the 8 bytes at 8 * (32 r + l).
  static constexpr uint32_t units = entry / 8u;            // 8-byte units of an entry
  static constexpr uint32_t lane_words = 8u / WB;
  static constexpr uint32_t rounds = (units + BUDDY_WARP_SIZE - 1u) / BUDDY_WARP_SIZE;

  const BuddyFpeTable* table;
  uint32_t sym_bits;    // b: a symbol is the word's top b bits (the table's)
  uint32_t tail_bits;   // t = 8 WB - b: the bits after them
  uint32_t ZERO, ESC;   // the symbols of an all-zero word and of an escape: S, S + 1
  uint64_t tail_mask;

  // The table is on the device; b is read once per warp (a host-built table has it checked: buddy.cuda).
  BUDDY_HD explicit BuddyFpe(const uint8_t* device_table)
      : table(reinterpret_cast<const BuddyFpeTable*>(device_table)),
        sym_bits(table->sym_bits),
        tail_bits(8u * WB - sym_bits),
        ZERO(1u << sym_bits),
        ESC(ZERO + 1u),
        tail_mask(((uint64_t)1 << tail_bits) - 1u) {}  // t <= 52

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
  BUDDY_HD Specials specials() const { return {table->enc[ZERO], table->enc[ESC]}; }

  // A word's code field (the escaped symbol after ESC's code included) and whether a tail follows.
  struct Field {
    uint32_t head, head_bits;
    bool tail;
  };
  BUDDY_HD Field field(word_t x, Specials sp) const {
    if (x == 0 && sp.zero) return {sp.zero & 0xFFFu, sp.zero >> 12, false};
    const uint32_t sym = (uint32_t)((uint64_t)x >> tail_bits) & (ZERO - 1u);
    const uint32_t c = table->enc[sym];
    if (c) return {c & 0xFFFu, c >> 12, true};
    const uint32_t len = sp.esc >> 12;
    return {(sp.esc & 0xFFFu) | sym << len, len + sym_bits, true};
  }

  static BUDDY_HD word_t unit_word(uint64_t unit, uint32_t i) { return (word_t)(unit >> (8u * WB * i)); }

  // Stream bits of the words of an 8-byte unit.
  BUDDY_HD uint32_t unit_bits(uint64_t unit, Specials sp) const {
    uint32_t bits = 0;
    for (uint32_t i = 0; i < lane_words; ++i) {
      const Field f = field(unit_word(unit, i), sp);
      bits += f.head_bits + (f.tail ? tail_bits : 0u);
    }
    return bits;
  }

  // ORs the fields of word x into the stream at bit pos; returns the bit after them.
  BUDDY_HD uint32_t put(uint32_t* stream, uint32_t pos, word_t x, Specials sp) const {
    const Field f = field(x, sp);
    if (!f.tail) {
      buddy_put32(stream, pos, f.head);
      return pos + f.head_bits;
    }
    const uint64_t tail = (uint64_t)x & tail_mask;
    if constexpr (WB == 8) {  // head (<= 24 bits) and tail (52) may exceed 64 bits
      buddy_put32(stream, pos, f.head);
      buddy_put64(stream, pos + f.head_bits, tail);
    } else {  // <= 12 + 12 + 23 bits
      buddy_put64(stream, pos, f.head | tail << f.head_bits);
    }
    return pos + f.head_bits + tail_bits;
  }

  template <class Warp>
  BUDDY_WARP_FN uint32_t measure(const Warp& warp, const uint8_t* entry_bytes, uint32_t* mode) const {
    *mode = 0;
    const Specials sp = specials();
    uint32_t mine = 0;
    for (uint32_t r = 0; r < rounds; ++r) {
      const uint32_t u = r * BUDDY_WARP_SIZE + warp.lane();
      if (u < units) mine += unit_bits(buddy_load<uint64_t>(entry_bytes + 8u * u), sp);
    }
    return sectors(buddy_warp_sum(warp, mine));
  }

  template <class Warp>
  BUDDY_WARP_FN void encode(const Warp& warp, const uint8_t* entry_bytes, uint32_t k, uint32_t mode,
                            uint8_t* payload) const {
    (void)mode;
    const Specials sp = specials();
    // zero bits first: the fields are ORed in, and everything after the stream stays zero
    buddy_warp_fill(warp, nullptr, payload, k * BUDDY_SECTOR_BYTES);
    warp.sync();
    uint32_t* stream = reinterpret_cast<uint32_t*>(payload);
    uint32_t base = 0;  // stream bits of earlier rounds
    for (uint32_t r = 0; r < rounds; ++r) {
      const uint32_t u = r * BUDDY_WARP_SIZE + warp.lane();
      const bool valid = u < units;
      const uint64_t unit = valid ? buddy_load<uint64_t>(entry_bytes + 8u * u) : 0u;
      uint32_t total;
      uint32_t pos = base + buddy_warp_exclusive_scan(warp, valid ? unit_bits(unit, sp) : 0u, &total);
      if (valid) {
        for (uint32_t i = 0; i < lane_words; ++i) pos = put(stream, pos, unit_word(unit, i), sp);
      }
      base += total;
    }
  }

  // ---------------------------------------------------------------------------
  // decoding
  // ---------------------------------------------------------------------------
  // Lane 0's serial walk over a stream of n64 8-byte words: every word into
  // out (8 bytes a store). Returns the stream's length in bits, or `never` for
  // a code the table lacks, an escape of a symbol it has a code for, or a
  // stream already past the payload with words left (each takes a bit at least).
  BUDDY_HD uint32_t walk(const uint8_t* payload, uint32_t n64, uint8_t* out) const {
    const uint32_t limit = 64u * n64;
    uint32_t pos = 0;
    uint64_t unit = 0;  // decoded words of the current 8 bytes
    for (uint32_t i = 0; i < words; ++i) {
      if (pos >= limit) return never;
      const uint64_t bits = buddy_peek(payload, n64, pos);
      const uint32_t row = table->dec[(uint32_t)bits & (BUDDY_FPE_ROWS - 1u)];
      uint32_t len = row >> 16, sym = row & 0xFFFFu;
      if (len == 0) return never;
      if (sym == ESC) {
        sym = (uint32_t)(bits >> len) & (ZERO - 1u);
        if (table->enc[sym]) return never;
        len += sym_bits;
      }
      pos += len;
      if (sym != ZERO) {
        uint64_t tail;
        if constexpr (WB == 8)  // code, symbol and tail can exceed 64 bits
          tail = buddy_peek(payload, n64, pos);
        else
          tail = bits >> len;
        unit |= (((uint64_t)sym << tail_bits) | (tail & tail_mask)) << (8u * WB * (i % lane_words));
        pos += tail_bits;
      }
      if (i % lane_words == lane_words - 1u) {
        buddy_store<uint64_t>(out + 8u * (i / lane_words), unit);
        unit = 0;
      }
    }
    return pos;
  }

  template <class Warp>
  BUDDY_WARP_FN uint32_t decode(const Warp& warp, const uint8_t* payload, uint32_t k, uint32_t mode,
                                uint8_t* out) const {
    (void)mode;
    const uint32_t n64 = k * (BUDDY_SECTOR_BYTES / 8u);  // 8-byte words of the payload
    const uint32_t total = warp.shfl(warp.lane() == 0 ? walk(payload, n64, out) : 0u, 0u);
    // the stream's length must give k, and nothing may follow it
    bool bad = total == never || sectors(total) != k;
    if (!bad) bad = buddy_bits_after(warp, payload, n64, total);
    if (warp.ballot(bad) == 0) return 0;
    warp.sync();  // lane 0's words are written before any lane zeroes them
    buddy_warp_fill(warp, nullptr, out, entry);
    return BUDDY_ERR_STREAM;
  }
};
