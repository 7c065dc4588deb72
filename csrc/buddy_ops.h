// The three format operations on one entry -- measure, pack, unpack -- with
// the codec as a template parameter: the bodies the kernels of
// buddy_kernels.cu run for each entry, host-compilable so that the host
// harness (tests/host/codec_host.cpp) runs them under an emulated warp over
// whole tensors.
//
// measure  entry -> (k, mode): its size in sectors and its metadata mode.
// pack     entry, (k, mode), slot s -> the first min(k, s) sectors into the
//          entry's slot (the rest of the slot zero), the other max(k - s, 0)
//          sectors into the overflow at the entry's offset. The payload is
//          written first into a staging buffer of E bytes (shared memory on
//          the GPU), then copied out a sector at a time.
// unpack   slot, overflow, (k, mode) -> the E bytes of the entry. The payload
//          is gathered into the staging buffer first; every read of the slot
//          and the overflow stays inside the bounds it is given. A codec whose
//          lanes write words at scattered places (Codec::STAGED_DECODE: fpe,
//          auto2) decodes into the staging buffer's second E bytes, copied out
//          16 bytes a lane store. A codec that needs zeros after its payload
//          (Codec::DECODE_PAD: fpe, auto2) gets them there.
//
// All lanes of a warp call these together (see buddy_warp.h), with the codec
// object the kernel built (buddy_codec in buddy_entry.h). Pointers are
// 8-byte aligned; slot, overflow and out pointers address exactly the bytes
// their arguments say.
#pragma once

#include "buddy_entry.h"

// 8-byte units of one sector
#define BUDDY_SECTOR_UNITS (BUDDY_SECTOR_BYTES / 8)

// Whether a codec decodes into shared memory first (Codec::STAGED_DECODE; false when it does not say), and
// so the entries of staging buffer a warp of unpack needs: 2, else 1. A warp of one lane (the native engine)
// decodes into the output: its scattered writes are one thread's, and the copy would cost more than it saves.
template <class Codec, class = void>
struct buddy_staged_decode {
  static constexpr bool value = false;
};
template <class Codec>
struct buddy_staged_decode<Codec, decltype((void)Codec::STAGED_DECODE)> {
  static constexpr bool value = Codec::STAGED_DECODE && BUDDY_WARP_SIZE > 1;
};
template <class Codec>
BUDDY_HD constexpr uint32_t buddy_unpack_staging_entries() {
  return buddy_staged_decode<Codec>::value ? 2u : 1u;
}

// Zero bytes a codec's decoder needs after its payload (Codec::DECODE_PAD; 0 when it does not say).
template <class Codec, class = void>
struct buddy_decode_pad {
  static constexpr uint32_t value = 0;
};
template <class Codec>
struct buddy_decode_pad<Codec, decltype((void)Codec::DECODE_PAD)> {
  static constexpr uint32_t value = Codec::DECODE_PAD;
};

// Whether a codec's decoder steps with a walk table in the native engine's one-lane build (Codec::WALKS, made by
// Codec::prepare_walk: codec_fpe.h).
template <class Codec, class = void>
struct buddy_walks {
  static constexpr bool value = false;
};
template <class Codec>
struct buddy_walks<Codec, decltype((void)Codec::WALKS)> {
  static constexpr bool value = Codec::WALKS != 0;
};

// Whether a codec's measure sizes with a table of its own in the native engine's one-lane build
// (Codec::prepare_measure: codec_auto2.h).
template <class Codec, class = void>
struct buddy_sizes {
  static constexpr bool value = false;
};
template <class Codec>
struct buddy_sizes<Codec, decltype((void)&Codec::prepare_measure)> {
  static constexpr bool value = true;
};

// Copies `sectors` sectors from src to dst (both 8-byte aligned), 8 bytes per lane store.
template <class Warp>
BUDDY_WARP_FN void buddy_warp_copy_sectors(const Warp& warp, const uint8_t* src, uint8_t* dst, uint32_t sectors) {
  buddy_warp_fill(warp, src, dst, sectors * BUDDY_SECTOR_BYTES);
}

// Where a tensor's overflow sectors are. Overflow sector g -- the entries' overflow in entry order, as the prefix
// sums `ends` count them -- is at host + 32 g for g < cap, in the device reserve at reserve + 32 (g - cap) for the r
// sectors after those, and at host + 32 (g - r) past them: the first cap sectors in buddy memory (the tensor's share
// of its step's bound), the next r on the device, the rest in buddy memory again (the reserve ran out). r = 0, the
// plain map (buddy_overflow_plain): every sector at host + 32 g. Each pointer comes from one kernel argument, and
// each copy reads or writes through one of them, never a pointer that may be either (or a literal null): through
// such a pointer the compiler no longer knows the memory's space, and its loads and stores are generic, slower.
struct BuddyOverflowMap {
  uint8_t* host;
  uint8_t* reserve;
  long long cap;
  long long r;
};
BUDDY_HD BuddyOverflowMap buddy_overflow_plain(uint8_t* host) { return {host, host, 0, 0}; }

// How `count` overflow sectors from sector g on lie: n[0] of them in buddy memory before the reserve's sectors (from
// sector g there), n[1] in the reserve (from sector at1 there), n[2] in buddy memory after them (from at2). Each run
// is copied through a pointer the device compiler is told is global (buddy_global): picked at run time from two
// kernel arguments, it would otherwise be a generic one.
struct BuddyOverflowRuns {
  uint32_t n[3];
  long long at1, at2;
};
BUDDY_HD BuddyOverflowRuns buddy_overflow_runs(long long cap, long long r, long long g, uint32_t count) {
  BuddyOverflowRuns runs = {{count, 0u, 0u}, 0, 0};
  if (r == 0) return runs;
  const long long end = g + count;
  const long long before = end < cap ? end : cap, inside = end < cap + r ? end : cap + r;
  runs.n[0] = before > g ? (uint32_t)(before - g) : 0u;
  const long long from1 = g > cap ? g : cap;
  runs.n[1] = inside > from1 ? (uint32_t)(inside - from1) : 0u;
  runs.n[2] = count - runs.n[0] - runs.n[1];
  runs.at1 = from1 - cap;
  runs.at2 = (g > cap + r ? g : cap + r) - r;
  return runs;
}

// `count` sectors from src into the overflow from sector g on (at most three runs).
template <class Warp>
BUDDY_WARP_FN void buddy_overflow_put(const Warp& warp, const uint8_t* src, const BuddyOverflowMap& map, long long g,
                                      uint32_t count) {
  const BuddyOverflowRuns runs = buddy_overflow_runs(map.cap, map.r, g, count);
  if (runs.n[0]) buddy_warp_copy_sectors(warp, src, buddy_global(map.host + g * BUDDY_SECTOR_BYTES), runs.n[0]);
  src += runs.n[0] * BUDDY_SECTOR_BYTES;
  if (runs.n[1])
    buddy_warp_copy_sectors(warp, src, buddy_global(map.reserve + runs.at1 * BUDDY_SECTOR_BYTES), runs.n[1]);
  src += runs.n[1] * BUDDY_SECTOR_BYTES;
  if (runs.n[2])
    buddy_warp_copy_sectors(warp, src, buddy_global(map.host + runs.at2 * BUDDY_SECTOR_BYTES), runs.n[2]);
}

// `count` sectors of the overflow from sector g on into dst (at most three runs).
template <class Warp>
BUDDY_WARP_FN void buddy_overflow_get(const Warp& warp, const BuddyOverflowMap& map, long long g, uint32_t count,
                                      uint8_t* dst) {
  const BuddyOverflowRuns runs = buddy_overflow_runs(map.cap, map.r, g, count);
  if (runs.n[0]) buddy_warp_copy_sectors(warp, buddy_global(map.host + g * BUDDY_SECTOR_BYTES), dst, runs.n[0]);
  dst += runs.n[0] * BUDDY_SECTOR_BYTES;
  if (runs.n[1])
    buddy_warp_copy_sectors(warp, buddy_global(map.reserve + runs.at1 * BUDDY_SECTOR_BYTES), dst, runs.n[1]);
  dst += runs.n[1] * BUDDY_SECTOR_BYTES;
  if (runs.n[2])
    buddy_warp_copy_sectors(warp, buddy_global(map.host + runs.at2 * BUDDY_SECTOR_BYTES), dst, runs.n[2]);
}

// k and metadata mode of an entry (E bytes at `entry`).
template <class Codec, class Warp>
BUDDY_WARP_FN uint32_t buddy_op_measure(const Warp& warp, const Codec& codec, const uint8_t* entry, uint32_t* mode) {
  return buddy_entry_measure<Codec>(warp, codec, entry, mode);
}

// Stores an entry measured at (k, mode) in a slot of s sectors:
//   slot      s * 32 bytes: sectors [0, min(k, s)) of the payload, then zeros
//   overflow  max(k - s, 0) sectors: sectors [s, k) of the payload, at overflow sectors g.. of `map`
// `staging` holds E bytes of scratch (the warp's own).
template <class Codec, class Warp>
BUDDY_WARP_FN void buddy_op_pack(const Warp& warp, const Codec& codec, const uint8_t* entry, uint32_t k, uint32_t mode,
                                 uint32_t s, uint8_t* slot, const BuddyOverflowMap& map, long long g,
                                 uint8_t* staging) {
  // the payload in the staging buffer: a coded entry's encoded there, a raw entry's bytes copied there -- on a
  // GPU the copy below then reads shared memory alone (through a pointer that may be to the entry or to the
  // staging buffer its loads were generic ones, slower than either's own); one lane (the native engine) copies a
  // raw entry from where it is. A zero entry has no payload.
  const uint8_t* payload = staging;
  if (k == BUDDY_SECTORS_PER_ENTRY) {
    if constexpr (BUDDY_WARP_SIZE == 1)
      payload = entry;
    else
      buddy_warp_fill(warp, entry, staging, BUDDY_ENTRY_BYTES);
  } else if (k != 0) {
    buddy_entry_encode<Codec>(warp, codec, entry, k, mode, staging);
  }
  warp.sync();  // the lanes wrote the staging buffer; every lane copies from it
  const uint32_t in_slot = k < s ? k : s;
  buddy_warp_copy_sectors(warp, payload, slot, in_slot);
  buddy_warp_fill(warp, nullptr, slot + in_slot * BUDDY_SECTOR_BYTES, (s - in_slot) * BUDDY_SECTOR_BYTES);
  if (k > s) buddy_overflow_put(warp, payload + s * BUDDY_SECTOR_BYTES, map, g, k - s);
  warp.sync();  // the staging buffer is read before the warp's next entry writes it
}

// An entry's k sectors gathered into `staging` (at most s from its slot, the rest from overflow sectors g.. of
// `map`, which holds them), and the codec's DECODE_PAD zeros after a coded payload: what its decoder reads.
template <class Codec, class Warp>
BUDDY_WARP_FN void buddy_stage_payload(const Warp& warp, uint32_t k, uint32_t s, const uint8_t* slot,
                                       const BuddyOverflowMap& map, long long g, uint8_t* staging) {
  const uint32_t in_slot = k < s ? k : s;
  buddy_warp_copy_sectors(warp, slot, staging, in_slot);
  if (k > s) buddy_overflow_get(warp, map, g, k - s, staging + s * BUDDY_SECTOR_BYTES);
  if constexpr (buddy_decode_pad<Codec>::value > 0) {  // zeros after a coded payload (k < E/32: they fit)
    static_assert(buddy_decode_pad<Codec>::value % 8 == 0 && buddy_decode_pad<Codec>::value < BUDDY_SECTOR_BYTES,
                  "whole 8-byte words, inside the sector a coded payload leaves");
    static_assert(buddy_decode_pad<Codec>::value / 8 <= BUDDY_WARP_SIZE, "a lane a word of them");
    if (k < BUDDY_SECTORS_PER_ENTRY && warp.lane() < buddy_decode_pad<Codec>::value / 8)
      buddy_store<uint64_t>(staging + k * BUDDY_SECTOR_BYTES + 8u * warp.lane(), 0u);
  }
  warp.sync();  // the gathered payload is complete before any lane decodes from it
}

// The E bytes of an entry from its metadata word, its slot of s sectors and
// its overflow: `available` sectors of overflow follow sector g of `map`
// (what is left of it from the entry's offset on), of which it reads
// max(k - s, 0). Returns BUDDY_ERR_* bits; a flagged entry decodes to zeros
// and nothing is read out of bounds. `staging`: buddy_unpack_staging_entries
// * E bytes of scratch (the warp's own).
template <class Codec, class Warp>
BUDDY_WARP_FN uint32_t buddy_op_unpack(const Warp& warp, const Codec& codec, buddy_meta_t word, uint32_t s,
                                       const uint8_t* slot, const BuddyOverflowMap& map, long long g,
                                       uint64_t available, uint8_t* staging, uint8_t* out) {
  const uint32_t k = buddy_meta_k(word), mode = buddy_meta_mode(word);
  if (k > BUDDY_SECTORS_PER_ENTRY || (k > s && available < k - s)) {
    buddy_warp_fill(warp, nullptr, out, BUDDY_ENTRY_BYTES);
    return k > BUDDY_SECTORS_PER_ENTRY ? BUDDY_ERR_K : BUDDY_ERR_OVERFLOW;
  }
  buddy_stage_payload<Codec>(warp, k, s, slot, map, g, staging);
  if constexpr (buddy_staged_decode<Codec>::value) {
    uint8_t* decoded = staging + BUDDY_ENTRY_BYTES;
    const uint32_t err = buddy_entry_decode<Codec>(warp, codec, staging, k, mode, decoded);
    warp.sync();  // every lane's words are in the staging buffer before any lane copies them out
    buddy_warp_fill(warp, decoded, out, BUDDY_ENTRY_BYTES);
    warp.sync();  // the staging buffer is read before the warp's next entry writes it
    return err;
  } else {
    const uint32_t err = buddy_entry_decode<Codec>(warp, codec, staging, k, mode, out);
    warp.sync();  // the staging buffer is read before the warp's next entry writes it
    return err;
  }
}

#if defined(BUDDY_NATIVE_SOLO) && defined(__AVX512F__)  // (BUDDY_FPE_AVX512, codec_fpe.h: included after this)
// Whether a codec decodes two entries at once (Codec::decode_pair: fpe's and auto2's in the one-lane build with
// AVX-512, codec_fpe.h).
template <class Codec, class = void>
struct buddy_pairs {
  static constexpr bool value = false;
};
template <class Codec>
struct buddy_pairs<Codec, decltype((void)&Codec::template decode_pair<BuddyCudaWarp>)> {
  static constexpr bool value = true;
};
#endif

// ---------------------------------------------------------------------------
// Entry i of a whole tensor: what one warp of each kernel does per entry (the
// kernels of buddy_kernels.cu loop warps over i; the host harness loops i).
//   data, tail  entry i < n_full is at data + i * E, the last entry (when the
//               tensor ends inside it) is a zero-padded copy at tail
//   meta        one metadata word per entry
//   ends        per entry, the overflow sectors of entries 0..i (inclusive
//               prefix sum of max(k - s, 0)), so entry i's overflow starts at
//               ends[i] - max(k_i - s, 0)
// ---------------------------------------------------------------------------
BUDDY_HD const uint8_t* buddy_entry_at(const uint8_t* data, const uint8_t* tail, long long n_full, long long i) {
  return i < n_full ? data + i * BUDDY_ENTRY_BYTES : tail;
}

// Measures entry i into meta[i]; returns its k (on every lane).
template <class Codec, class Warp>
BUDDY_WARP_FN uint32_t buddy_measure_entry(const Warp& warp, const Codec& codec, long long i, const uint8_t* data,
                                           const uint8_t* tail, long long n_full, buddy_meta_t* meta) {
  uint32_t mode;
  const uint32_t k = buddy_op_measure<Codec>(warp, codec, buddy_entry_at(data, tail, n_full, i), &mode);
  if (warp.lane() == 0) meta[i] = buddy_meta_pack(k, mode);
  return k;
}

// Packs entry i into its slot and its place in the overflow (`map`: where its sectors are).
template <class Codec, class Warp>
BUDDY_WARP_FN void buddy_pack_entry(const Warp& warp, const Codec& codec, long long i, const uint8_t* data,
                                    const uint8_t* tail, long long n_full, const buddy_meta_t* meta,
                                    const long long* ends, uint32_t s, uint8_t* slots, const BuddyOverflowMap& map,
                                    uint8_t* staging) {
  const buddy_meta_t word = meta[i];
  const uint32_t k = buddy_meta_k(word);
  const long long start = ends[i] - buddy_overflow_sectors(k, s);  // overflow sectors of the entries before it
  buddy_op_pack<Codec>(warp, codec, buddy_entry_at(data, tail, n_full, i), k, buddy_meta_mode(word), s,
                       slots + i * s * BUDDY_SECTOR_BYTES, map, start, staging);
}
// ... with every overflow sector in one buffer, in order.
template <class Codec, class Warp>
BUDDY_WARP_FN void buddy_pack_entry(const Warp& warp, const Codec& codec, long long i, const uint8_t* data,
                                    const uint8_t* tail, long long n_full, const buddy_meta_t* meta,
                                    const long long* ends, uint32_t s, uint8_t* slots, uint8_t* overflow,
                                    uint8_t* staging) {
  buddy_pack_entry<Codec>(warp, codec, i, data, tail, n_full, meta, ends, s, slots, buddy_overflow_plain(overflow),
                          staging);
}

// Where entry i's overflow starts in a buffer of overflow_sectors sectors, and how many sectors it holds from there:
// (0, 0) for a start the prefix sums put outside it.
struct BuddyEntryOverflow {
  long long start;
  uint64_t available;
};
BUDDY_HD BuddyEntryOverflow buddy_entry_overflow(long long i, const buddy_meta_t* meta, const long long* ends,
                                                 uint32_t s, long long overflow_sectors) {
  const long long start = ends[i] - buddy_overflow_sectors(buddy_meta_k(meta[i]), s);
  if (start < 0 || start > overflow_sectors) return {0, 0u};
  return {start, (uint64_t)(overflow_sectors - start)};
}

// Unpacks entry i of n into out + i * E, reading the overflow (overflow_sectors
// sectors where `map` puts them: map.r of them in the reserve, the others in
// map.host) only inside its bounds; returns BUDDY_ERR_* bits. The last entry
// also checks that the overflow holds no more than the metadata needs.
template <class Codec, class Warp>
BUDDY_WARP_FN uint32_t buddy_unpack_entry(const Warp& warp, const Codec& codec, long long i, long long n,
                                          const buddy_meta_t* meta, const long long* ends, uint32_t s,
                                          const uint8_t* slots, const BuddyOverflowMap& map,
                                          long long overflow_sectors, uint8_t* staging, uint8_t* out) {
  const BuddyEntryOverflow at = buddy_entry_overflow(i, meta, ends, s, overflow_sectors);
  uint32_t err = buddy_op_unpack<Codec>(warp, codec, meta[i], s, slots + i * s * BUDDY_SECTOR_BYTES, map, at.start,
                                        at.available, staging, out + i * BUDDY_ENTRY_BYTES);
  if (i == n - 1 && ends[i] != overflow_sectors) err |= BUDDY_ERR_OVERFLOW;
  return err;
}
// ... with every overflow sector in one buffer, in order.
template <class Codec, class Warp>
BUDDY_WARP_FN uint32_t buddy_unpack_entry(const Warp& warp, const Codec& codec, long long i, long long n,
                                          const buddy_meta_t* meta, const long long* ends, uint32_t s,
                                          const uint8_t* slots, const uint8_t* overflow, long long overflow_sectors,
                                          uint8_t* staging, uint8_t* out) {
  return buddy_unpack_entry<Codec>(warp, codec, i, n, meta, ends, s, slots,
                                   buddy_overflow_plain(const_cast<uint8_t*>(overflow)), overflow_sectors, staging,
                                   out);
}

#if defined(BUDDY_NATIVE_SOLO) && defined(__AVX512F__)
// Entries i and i + 1 at once (Codec::decode_pair), when both are of a mode it decodes so, coded (0 < k < E/32)
// and wholly in their slots and the overflow; else false and nothing done. Each staged as buddy_op_unpack stages
// one (buddy_stage_payload); `err` ORed with what buddy_unpack_entry would flag.
template <class Codec, class Warp>
BUDDY_WARP_FN bool buddy_unpack_pair(const Warp& warp, const Codec& codec, long long i, long long n,
                                     const buddy_meta_t* meta, const long long* ends, uint32_t s,
                                     const uint8_t* slots, const BuddyOverflowMap& map, long long overflow_sectors,
                                     uint8_t* const staging[2], uint8_t* out, uint32_t* err) {
  uint32_t k[2];
  BuddyEntryOverflow at[2];
  for (uint32_t j = 0; j < 2u; ++j) {
    k[j] = buddy_meta_k(meta[i + j]);
    if (k[j] == 0 || k[j] >= BUDDY_SECTORS_PER_ENTRY || !codec.pairs(buddy_meta_mode(meta[i + j]))) return false;
    at[j] = buddy_entry_overflow(i + j, meta, ends, s, overflow_sectors);
    if (k[j] > s && at[j].available < k[j] - s) return false;
  }
  for (uint32_t j = 0; j < 2u; ++j)
    buddy_stage_payload<Codec>(warp, k[j], s, slots + (i + j) * s * BUDDY_SECTOR_BYTES, map, at[j].start,
                               staging[j]);
  uint32_t err_b = 0;
  *err |= codec.decode_pair(warp, staging[0], k[0], out + i * BUDDY_ENTRY_BYTES, staging[1], k[1],
                            out + (i + 1) * BUDDY_ENTRY_BYTES, &err_b);
  *err |= err_b;
  if (i + 1 == n - 1 && ends[i + 1] != overflow_sectors) *err |= BUDDY_ERR_OVERFLOW;
  return true;
}
#endif
