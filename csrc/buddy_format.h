// The Buddy format, as the kernels see it.
//
// Every constant comes from buddy/spec.py as a -D define (buddy.spec.c_defines);
// this header restates none of them. It derives what the kernels need and
// static_asserts that the derivation matches the Python spec. Host-compilable:
// the metadata helpers are tested on the CPU against buddy.format.
//
// Layout, format version 1 (see buddy/spec.py for the full text):
//   entry     E = BUDDY_ENTRY_BYTES bytes of the tensor, last one zero-padded
//   sector    BUDDY_SECTOR_BYTES (32) bytes; entry i encodes to k_i sectors,
//             0 <= k_i <= E/32 (0: all zero, E/32: stored raw)
//   slots     N * s * 32 bytes on the device; entry i's slot at i * s * 32
//   metadata  N * BUDDY_META_BYTES bytes on the device, little endian:
//               E <= 256: 1 byte   bits 0-3  k | bits 4-7   mode
//               E >= 512: 2 bytes  bits 0-11 k | bits 12-15 mode
//   overflow  sum_i max(k_i - s, 0) sectors in buddy memory, entry order
#pragma once

#if !defined(BUDDY_FORMAT_VERSION) || !defined(BUDDY_SECTOR_BYTES) || !defined(BUDDY_ENTRY_BYTES) || \
    !defined(BUDDY_META_BYTES) || !defined(BUDDY_META_K_BITS) || !defined(BUDDY_META_MODE_BITS)
#error "compile with the defines from buddy.spec.c_defines(entry_bytes)"
#endif

#include "buddy_device.h"

#define BUDDY_SECTORS_PER_ENTRY (BUDDY_ENTRY_BYTES / BUDDY_SECTOR_BYTES)

// format version 2 is version 1 plus codec tables, version 3 fpe's split payload layout (buddy/spec.py):
// the layout below is the same in all three
static_assert(BUDDY_FORMAT_VERSION == 3, "this header describes format version 3");
static_assert(BUDDY_SECTOR_BYTES == 32, "sectors are 32 bytes");
static_assert((BUDDY_ENTRY_BYTES & (BUDDY_ENTRY_BYTES - 1)) == 0, "entry size is a power of two");
static_assert(BUDDY_ENTRY_BYTES >= 32 && BUDDY_ENTRY_BYTES <= 65536, "entry size in [32, 65536] bytes");
static_assert(BUDDY_META_BYTES * 8 == BUDDY_META_K_BITS + BUDDY_META_MODE_BITS, "metadata word is k + mode");
static_assert(BUDDY_SECTORS_PER_ENTRY < (1 << BUDDY_META_K_BITS), "k field holds E/32");
static_assert(BUDDY_META_BYTES == (BUDDY_ENTRY_BYTES <= 256 ? 1 : 2), "metadata width by entry size");

#if BUDDY_META_BYTES == 1
typedef uint8_t buddy_meta_t;
#else
typedef uint16_t buddy_meta_t;
#endif
static_assert(sizeof(buddy_meta_t) == BUDDY_META_BYTES, "metadata word size");

// Metadata word of an entry from its sector count k and codec mode.
BUDDY_HD buddy_meta_t buddy_meta_pack(uint32_t k, uint32_t mode) {
  return (buddy_meta_t)(k | (mode << BUDDY_META_K_BITS));
}

// Sector count k of a metadata word.
BUDDY_HD uint32_t buddy_meta_k(buddy_meta_t word) { return word & ((1u << BUDDY_META_K_BITS) - 1u); }

// Codec mode of a metadata word.
BUDDY_HD uint32_t buddy_meta_mode(buddy_meta_t word) { return (uint32_t)word >> BUDDY_META_K_BITS; }

// Overflow sectors of an entry of k sectors in a slot of s sectors.
BUDDY_HD uint32_t buddy_overflow_sectors(uint32_t k, uint32_t s) { return k > s ? k - s : 0u; }

// Error bits of a decode (per entry; a kernel ORs them over its entries and the
// loader raises CorruptDataError naming them). A codec's own inconsistencies
// (a bitmap that disagrees with k, a stream of the wrong length) are
// BUDDY_ERR_STREAM; the format layer flags the rest.
#define BUDDY_ERR_K 1u       // k > E/32 (or negative as int32)
#define BUDDY_ERR_STREAM 2u  // the coded payload disagrees with its k (damaged slots or metadata)
#define BUDDY_ERR_MODE 4u    // a metadata mode the codec never writes for an entry of this k
#define BUDDY_ERR_WORD 8u    // word size not 1, 2, 4 or 8 (a launch error, not the data's)
#define BUDDY_ERR_OVERFLOW 16u  // the overflow buffer is not the size the metadata needs
