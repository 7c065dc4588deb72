// The format rules of one entry, written once for every codec: the zero
// entry, the raw escape, the k clamp and the metadata mode checks. A codec
// (codec_*.h) only codes entries that are neither zero nor raw; these
// wrappers are what the kernels call, with the codec as a template
// parameter and a codec object (buddy_codec). All lanes of a warp call them
// together (see buddy_warp.h).
#pragma once

#include "buddy_format.h"
#include "buddy_warp.h"

// The codec object the kernels call: built from the device table for a codec
// that codes with one (Codec::TABLED; `table` is the kernels' table
// argument), empty otherwise (`table` unused: null for such codecs).
template <class Codec>
BUDDY_HD Codec buddy_codec(const uint8_t* table) {
  if constexpr (Codec::TABLED) {
    return Codec(table);
  } else {
    (void)table;
    return Codec();
  }
}
// The same, a table codec's decode rows (Codec::ROWS_BYTES) read from `rows`, a copy of them (unpack's, in
// shared memory).
template <class Codec>
BUDDY_HD Codec buddy_codec(const uint8_t* table, const uint8_t* rows) {
  if constexpr (Codec::TABLED) {
    return Codec(table, rows);
  } else {
    (void)table;
    (void)rows;
    return Codec();
  }
}

// Sectors k of an entry, 0 <= k <= E/32, and its metadata mode.
template <class Codec, class Warp>
BUDDY_WARP_FN uint32_t buddy_entry_measure(const Warp& warp, const Codec& codec, const uint8_t* entry,
                                           uint32_t* mode) {
  if (!buddy_warp_any_nonzero(warp, entry, BUDDY_ENTRY_BYTES)) {
    *mode = Codec::ZERO_MODE;
    return 0u;
  }
  const uint32_t k = codec.measure(warp, entry, mode);
  if (k >= BUDDY_SECTORS_PER_ENTRY) {  // not smaller than the entry: stored raw
    *mode = Codec::RAW_MODE;
    return BUDDY_SECTORS_PER_ENTRY;
  }
  return k;
}

// Writes bytes [0, 32k) of the payload of an entry measured at (k, mode).
template <class Codec, class Warp>
BUDDY_WARP_FN void buddy_entry_encode(const Warp& warp, const Codec& codec, const uint8_t* entry, uint32_t k,
                                      uint32_t mode, uint8_t* payload) {
  if (k == BUDDY_SECTORS_PER_ENTRY)
    buddy_warp_fill(warp, entry, payload, BUDDY_ENTRY_BYTES);
  else if (k != 0)
    codec.encode(warp, entry, k, mode, payload);
}

// All E bytes of an entry from its payload (bytes [0, 32k) are read), k and
// mode; returns BUDDY_ERR_* bits (0: fine). A flagged entry decodes to zeros.
template <class Codec, class Warp>
BUDDY_WARP_FN uint32_t buddy_entry_decode(const Warp& warp, const Codec& codec, const uint8_t* payload, uint32_t k,
                                          uint32_t mode, uint8_t* out) {
  uint32_t err = 0;
  if (k > BUDDY_SECTORS_PER_ENTRY)
    err = BUDDY_ERR_K;  // a negative int32 k arrives here as a huge value
  else if (k == 0)
    err = mode == Codec::ZERO_MODE ? 0u : BUDDY_ERR_MODE;
  else if (k == BUDDY_SECTORS_PER_ENTRY)
    err = mode == Codec::RAW_MODE ? 0u : BUDDY_ERR_MODE;
  else if (!Codec::coded_mode(mode))
    err = BUDDY_ERR_MODE;
  else
    return codec.decode(warp, payload, k, mode, out);
  buddy_warp_fill(warp, k == BUDDY_SECTORS_PER_ENTRY && !err ? payload : nullptr, out, BUDDY_ENTRY_BYTES);
  return err;
}
