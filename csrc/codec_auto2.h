// auto2 (format version 2): per entry the smallest of zvc, fpx, bpc and fpe --
// the device codec of buddy/codecs/auto.py's AutoCodec(AUTO2_MEMBERS),
// composed from auto (codec_auto.h) and fpe (codec_fpe.h) through the
// interface every device codec has (see codec_zvc.h). It codes with fpe's
// table (TABLED): the tensor's table, the kernels' table argument.
//
// Metadata modes: auto's, and BUDDY_AUTO_MODE_FPE for fpe's entries (the
// values arrive from buddy.spec.AUTO_MODES as -D defines). Choice, as the
// reference: auto's choice among zvc, fpx and bpc, then fpe sizes the entry
// only while it is still above one sector, and wins only when strictly
// smaller.
#pragma once

#include "codec_auto.h"
#include "codec_fpe.h"

#if !defined(BUDDY_AUTO_MODE_FPE)
#error "compile with the defines from buddy.spec.c_defines(entry_bytes)"
#endif

template <int WB>
struct BuddyAuto2 {
  typedef BuddyAuto<WB> Auto;
  typedef BuddyFpe<WB> Fpe;
  static constexpr bool TABLED = true;
  static constexpr uint32_t TABLE_BYTES = Fpe::TABLE_BYTES;
  static constexpr uint32_t ROWS_BYTES = Fpe::ROWS_BYTES;  // (fpe's decode rows)
  static constexpr bool STAGED_DECODE = true;  // lanes write words at scattered places: decode into shared memory
  static constexpr uint32_t DECODE_PAD = Fpe::DECODE_PAD;  // (fpe's decoder reads past its payload)
  static constexpr uint32_t ZERO_MODE = Auto::ZERO_MODE;
  static constexpr uint32_t RAW_MODE = Auto::RAW_MODE;

  Fpe fpe;

  BUDDY_HD explicit BuddyAuto2(const uint8_t* device_table) : fpe(device_table) {}
  BUDDY_HD BuddyAuto2(const uint8_t* device_table, const uint8_t* decode_rows) : fpe(device_table, decode_rows) {}

#if defined(BUDDY_PACK_FIELDS) && BUDDY_PACK_FIELDS && !defined(BUDDY_NATIVE_SOLO)
  static constexpr uint32_t FIELDS_BYTES = Fpe::FIELDS_BYTES;  // (fpe's pack's table of whole fields)
  BUDDY_HD void make_fields(uint32_t* out, uint32_t tid, uint32_t threads) const { fpe.make_fields(out, tid, threads); }
  BUDDY_HD void use_fields(const uint32_t* fields) { fpe.fields = fields; }
#endif

#if defined(BUDDY_NATIVE_SOLO)
  static constexpr uint32_t WALKS = Fpe::WALKS;  // (fpe's decoder's walk table: codec_fpe.h)
  BUDDY_HD void prepare_walk() { fpe.prepare_walk(); }
  BUDDY_HD void prepare_measure() { fpe.prepare_sizes(); }  // (measure_below_one_lane's sizes table)
#endif

  static BUDDY_HD bool coded_mode(uint32_t mode) { return Auto::coded_mode(mode) || mode == BUDDY_AUTO_MODE_FPE; }

#if BUDDY_FPE_AVX512
  // (fpe's two entries at once: codec_fpe.h)
  BUDDY_HD bool pairs(uint32_t mode) const { return mode == BUDDY_AUTO_MODE_FPE && fpe.pairs(0u); }
  template <class Warp>
  BUDDY_WARP_FN uint32_t decode_pair(const Warp& warp, const uint8_t* pa, uint32_t ka, uint8_t* oa,
                                     const uint8_t* pb, uint32_t kb, uint8_t* ob, uint32_t* err_b) const {
    return fpe.decode_pair(warp, pa, ka, oa, pb, kb, ob, err_b);
  }
#endif

  template <class Warp>
  BUDDY_WARP_FN uint32_t measure(const Warp& warp, const uint8_t* entry, uint32_t* mode) const {
    uint32_t k = Auto::measure(warp, entry, mode);  // already clamped to E/32
    if (k > 1) {
      uint32_t member_mode;
      const uint32_t f = fpe.measure_below(warp, entry, &member_mode, k);  // (only whether f < k matters)
      if (f < k) {
        k = f;
        *mode = BUDDY_AUTO_MODE_FPE;
      }
    }
    return k;
  }

  template <class Warp>
  BUDDY_WARP_FN void encode(const Warp& warp, const uint8_t* entry, uint32_t k, uint32_t mode,
                            uint8_t* payload) const {
    if (mode == BUDDY_AUTO_MODE_FPE)
      fpe.encode(warp, entry, k, 0u, payload);
    else
      Auto::encode(warp, entry, k, mode, payload);
  }

  template <class Warp>
  BUDDY_WARP_FN uint32_t decode(const Warp& warp, const uint8_t* payload, uint32_t k, uint32_t mode,
                                uint8_t* out) const {
    if (mode == BUDDY_AUTO_MODE_FPE) return fpe.decode(warp, payload, k, 0u, out);
    return Auto::decode(warp, payload, k, mode, out);
  }
};
