// auto: per entry the smallest of zvc, fpx and bpc -- the device codec of
// buddy/codecs/auto.py, composed from the three device codecs through the
// interface every device codec has (see codec_zvc.h).
//
// Metadata modes (format version 1; the values arrive from buddy.spec.AUTO_MODES
// as -D defines): zero, raw, then one per member. A member's entry is exactly
// that member's payload, decoded as if it had written the entry alone.
// Choice, as the reference: zvc sizes the entry; fpx, then bpc, size it only
// while it is still above one sector (the least a non-zero entry takes), and
// a later member wins only when strictly smaller. auto2 (codec_auto2.h) is
// this choice followed by fpe.
#pragma once

#include "codec_bpc.h"
#include "codec_fpx.h"
#include "codec_zvc.h"

#if !defined(BUDDY_AUTO_MODE_ZERO) || !defined(BUDDY_AUTO_MODE_RAW) || !defined(BUDDY_AUTO_MODE_ZVC) || \
    !defined(BUDDY_AUTO_MODE_FPX) || !defined(BUDDY_AUTO_MODE_BPC)
#error "compile with the defines from buddy.spec.c_defines(entry_bytes)"
#endif

template <int WB>
struct BuddyAuto {
  typedef BuddyZvc<WB> Zvc;
  typedef BuddyFpx<WB> Fpx;
  typedef BuddyBpc<WB> Bpc;
  static constexpr bool TABLED = false;
  static constexpr uint32_t ZERO_MODE = BUDDY_AUTO_MODE_ZERO;
  static constexpr uint32_t RAW_MODE = BUDDY_AUTO_MODE_RAW;

  static BUDDY_HD bool coded_mode(uint32_t mode) {
    return mode == BUDDY_AUTO_MODE_ZVC || mode == BUDDY_AUTO_MODE_FPX || mode == BUDDY_AUTO_MODE_BPC;
  }

  template <class Warp>
  static BUDDY_WARP_FN uint32_t measure(const Warp& warp, const uint8_t* entry, uint32_t* mode) {
    uint32_t member_mode;
    *mode = BUDDY_AUTO_MODE_ZVC;
    // one pass for zvc's size (its non-zero words) and fpx's emax: fpx's first
    const typename Fpx::Census census = Fpx::census(warp, entry);
    uint32_t k = Zvc::sectors(census.nnz);
    k = k < BUDDY_SECTORS_PER_ENTRY ? k : BUDDY_SECTORS_PER_ENTRY;  // compared clamped, as the reference
    if (k > 1) {
      const uint32_t f = Fpx::measure(warp, entry, census, &member_mode);
      if (f < k) {
        k = f;
        *mode = BUDDY_AUTO_MODE_FPX;
      }
    }
    if (k > 1) {
      const uint32_t b = Bpc::measure_below(warp, entry, &member_mode, k);  // (only whether b < k matters)
      if (b < k) {
        k = b;
        *mode = BUDDY_AUTO_MODE_BPC;
      }
    }
    return k;
  }

  template <class Warp>
  static BUDDY_WARP_FN void encode(const Warp& warp, const uint8_t* entry, uint32_t k, uint32_t mode,
                                   uint8_t* payload) {
    if (mode == BUDDY_AUTO_MODE_ZVC)
      Zvc::encode(warp, entry, k, 0u, payload);
    else if (mode == BUDDY_AUTO_MODE_FPX)
      Fpx::encode(warp, entry, k, 0u, payload);
    else
      Bpc::encode(warp, entry, k, 0u, payload);
  }

  template <class Warp>
  static BUDDY_WARP_FN uint32_t decode(const Warp& warp, const uint8_t* payload, uint32_t k, uint32_t mode,
                                       uint8_t* out) {
    if (mode == BUDDY_AUTO_MODE_ZVC) return Zvc::decode(warp, payload, k, 0u, out);
    if (mode == BUDDY_AUTO_MODE_FPX) return Fpx::decode(warp, payload, k, 0u, out);
    return Bpc::decode(warp, payload, k, 0u, out);
  }
};
