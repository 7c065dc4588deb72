// Kernels per format operation over a whole tensor, with the codec as a
// template parameter: measure (sizes -> metadata + histogram), pack (slots +
// compacted overflow) and unpack (slots + overflow -> the tensor). Each runs
// the per-entry bodies of buddy_ops.h, one warp per entry, warps striding
// over the entries.
//
// Compiled at run time (buddy/engines/cuda.py, through CuPy/NVRTC) once per entry
// size: E = BUDDY_ENTRY_BYTES and the other format constants arrive as -D
// defines from buddy.spec.c_defines(entry_bytes). The word size is a kernel
// argument (a switch picks the instantiation once per launch).
//
// Launch: blockDim.x = 32 * warps per block; pack needs (warps per block) * E
// bytes of dynamic shared memory (each warp's staging buffer), unpack that
// times buddy_unpack_staging_entries (2 for fpe and auto2, which decode into
// shared memory: buddy_ops.h); built with BUDDY_SHARED_TABLES=1, fpe's and
// auto2's unpack the table's bytes before them, and with BUDDY_PACK_FIELDS=1
// too their pack its fields'. Any gridDim.x >= 1, on the caller's stream. Buffers are dense,
// 8-byte aligned (metadata: aligned to its word) and do not alias; the loader
// checks all of this before launching. Every output byte is written, so
// outputs may be allocated uninitialised (the histogram excepted: it is added to).
//
// Where an entry's E bytes are: entry i < n_full is at data + i * E; the last
// entry, when the tensor ends inside it, is a zero-padded copy at `tail`
// (the loader makes it), so no kernel reads past the tensor. The per-entry
// work is buddy_ops.h's; here are only the loops, the staging buffers and
// the histogram.
//
// Tested without a GPU: the block emulator (tests/host/emulator,
// docs/emulator.md) compiles this file unchanged for the host, every thread a
// fiber, with ThreadSanitizer and with ASan + UBSan. Device code here reaches
// shared memory through `__shared__` arrays and buddy_dynamic_shared() (not an
// `extern __shared__` of its own), which the emulator's shim provides.
//
// Codec tables (format version 2): every kernel takes a `table` pointer, the
// device table of a codec that codes with one (fpe and auto2: a
// BuddyFpeTable, csrc/codec_fpe.h, built by buddy.engines.cuda.device_table) and
// null for the others. Each warp builds its codec object from it
// (buddy_codec); built with BUDDY_SHARED_TABLES=1, unpack reads a copy of its
// decode rows the block makes in its shared memory, and with BUDDY_PACK_FIELDS=1 too pack
// a table of whole fields the block makes from it there (before the warps'
// staging: the loader's launch_config gives them room); the other kernels
// read it in global memory, through the cache.
// A table codec's table in each block's shared memory (1): unpack's copy of the device table's decode rows, before
// the warps' staging; or none, the table read in global memory (0). The loader defines it with the launch's shared
// memory (buddy.engines.cuda.launch_config).
#if !defined(BUDDY_SHARED_TABLES)
#define BUDDY_SHARED_TABLES 0
#endif
// Pack's table of whole fields (codec_fpe.h, make_fields) in each block's shared memory, before the warps' staging
// (1, with BUDDY_SHARED_TABLES); or a word's field made from the table in global memory (0, the default: the
// fields' pack runs fewer warps an SM, and a GPU measured it slower; buddy.engines.tuning.Tuning.pack_fields).
#if !defined(BUDDY_PACK_FIELDS)
#define BUDDY_PACK_FIELDS 0
#endif
#if BUDDY_PACK_FIELDS && !BUDDY_SHARED_TABLES
#error "BUDDY_PACK_FIELDS=1 needs BUDDY_SHARED_TABLES=1: the fields are made in the block's shared memory"
#endif

#include "buddy_ops.h"
// the codecs: auto2 and auto, and zvc, fpx, bpc and fpe, which they compose
#include "codec_auto2.h"
// fpe's table counted and fitted on the device
#include "codec_fpe_fit.h"

// Each module instantiates the kernels of one codec (templates not
// instantiated cost nearly nothing to compile): the loader compiles with
// -DBUDDY_CODEC_<NAME>, the tests with -DBUDDY_CODEC_ALL.
#if !defined(BUDDY_CODEC_ZVC) && !defined(BUDDY_CODEC_FPX) && !defined(BUDDY_CODEC_BPC) && \
    !defined(BUDDY_CODEC_AUTO) && !defined(BUDDY_CODEC_FPE) && !defined(BUDDY_CODEC_AUTO2) && !defined(BUDDY_CODEC_ALL)
#error "compile with -DBUDDY_CODEC_<NAME> for the codec whose kernels to build"
#endif

// The entries of n a warp takes: from buddy_first_warp(n) to before buddy_last_warp(n), buddy_warp_stride() apart.
// On a GPU the grid's warps take every (warps in the grid)-th entry, their loads side by side; the native engine's
// one-lane blocks (BUDDY_NATIVE_SOLO) take a contiguous run each, so that a host thread's reads and writes stream.
#if defined(BUDDY_NATIVE_SOLO)
__device__ __forceinline__ long long buddy_first_warp(long long n) {
  return (long long)blockIdx.x * ((n + gridDim.x - 1) / gridDim.x);
}
__device__ __forceinline__ long long buddy_last_warp(long long n) {
  const long long end = buddy_first_warp(n) + (n + gridDim.x - 1) / gridDim.x;
  return end < n ? end : n;
}
__device__ __forceinline__ long long buddy_warp_stride() { return 1; }
#else
__device__ __forceinline__ long long buddy_first_warp(long long n) {
  (void)n;
  return ((long long)blockIdx.x * blockDim.x + threadIdx.x) / BUDDY_WARP_SIZE;
}
__device__ __forceinline__ long long buddy_last_warp(long long n) { return n; }
__device__ __forceinline__ long long buddy_warp_stride() {
  return (long long)gridDim.x * blockDim.x / BUDDY_WARP_SIZE;
}
#endif

// This warp's staging buffer: `entries` * E bytes of the block's dynamic shared memory (16-byte aligned).
__device__ __forceinline__ uint8_t* buddy_staging(uint32_t entries = 1) {
  return buddy_dynamic_shared() + (threadIdx.x / BUDDY_WARP_SIZE) * entries * BUDDY_ENTRY_BYTES;
}

// A __shared__ array's address, for a loop that uses it: on the device as it is. On a host runtime
// (BUDDY_EMULATOR, csrc/host/cuda_shim.h) whose __shared__ storage is thread_local (the native engine's), one the
// compiler cannot trace back to that storage, so the thread's copy is found once, not at every access in the loop
// (in a shared library each is a call into the dynamic linker: the count kernel made one a word).
template <class T>
__device__ __forceinline__ T* buddy_shared_array(T* p) {
#if defined(BUDDY_EMULATOR)
  asm("" : "+r"(p));
#endif
  return p;
}

template <class Codec>
__device__ __forceinline__ void buddy_measure_body(const uint8_t* __restrict__ data, const uint8_t* __restrict__ tail,
                                                   long long n_full, long long n_entries,
                                                   buddy_meta_t* __restrict__ meta,
                                                   unsigned long long* __restrict__ histogram,
                                                   const uint8_t* __restrict__ table) {
  // the block counts its entries per size in shared memory, then adds them to the tensor's histogram once
  __shared__ unsigned int counts[BUDDY_SECTORS_PER_ENTRY + 1];
  for (uint32_t j = threadIdx.x; j <= BUDDY_SECTORS_PER_ENTRY; j += blockDim.x) counts[j] = 0;
  __syncthreads();
  const BuddyCudaWarp warp;
#if defined(BUDDY_NATIVE_SOLO)
  Codec codec = buddy_codec<Codec>(table);
  if constexpr (buddy_sizes<Codec>::value) codec.prepare_measure();  // (auto2: codec_auto2.h)
#else
  const Codec codec = buddy_codec<Codec>(table);
#endif
  for (long long i = buddy_first_warp(n_entries), end = buddy_last_warp(n_entries); i < end; i += buddy_warp_stride()) {
    const uint32_t k = buddy_measure_entry<Codec>(warp, codec, i, data, tail, n_full, meta);
    if (warp.lane() == 0) atomicAdd(&counts[k], 1u);
  }
  __syncthreads();
  for (uint32_t j = threadIdx.x; j <= BUDDY_SECTORS_PER_ENTRY; j += blockDim.x)
    if (counts[j]) atomicAdd(&histogram[j], (unsigned long long)counts[j]);
}

// The threads of a block that sums the overflow (the ends kernel's one block, the sizes kernel's last): each of the
// first BUDDY_ENDS_THREADS sums a contiguous run of entries, the block's runs are put together by its first thread,
// and each writes its run's sums.
#define BUDDY_ENDS_THREADS 256

// Per entry, the overflow sectors of entries 0..i (the inclusive sum of max(k - s, 0)): where pack places each
// entry's overflow and unpack finds it. Every thread of one block calls it (the native engine's block: one thread);
// `run`: BUDDY_ENDS_THREADS of the block's shared memory. `meta` is not __restrict__: the sizes kernel reads here
// what its other blocks wrote in the same launch, which a read-only load path need not see.
__device__ __forceinline__ void buddy_ends_block(const buddy_meta_t* meta, long long n_entries, uint32_t s,
                                                 long long* __restrict__ ends, long long* run) {
  const long long threads = blockDim.x < BUDDY_ENDS_THREADS ? blockDim.x : BUDDY_ENDS_THREADS;
  const bool summing = threadIdx.x < threads;
  const long long per = (n_entries + threads - 1) / threads;
  const long long lo = summing && per * threadIdx.x < n_entries ? per * threadIdx.x : n_entries;
  const long long hi = lo + per < n_entries ? lo + per : n_entries;
  long long sum = 0;
  for (long long i = lo; i < hi; ++i) sum += buddy_overflow_sectors(buddy_meta_k(meta[i]), s);
  if (summing) run[threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {  // the runs' sums before each (a few hundred additions: one thread)
    long long before = 0;
    for (long long t = 0; t < threads; ++t) {
      const long long here = run[t];
      run[t] = before;
      before += here;
    }
  }
  __syncthreads();
  sum = summing ? run[threadIdx.x] : 0;
  for (long long i = lo; i < hi; ++i) {
    sum += buddy_overflow_sectors(buddy_meta_k(meta[i]), s);
    ends[i] = sum;
  }
}

// A block's arrival at the end of its part of a launch: *done + 1, returning what it held. On a GPU the fence before
// it makes the arriving thread's writes, and those of the threads that met it at a barrier, visible to the device
// before the count says so; the one after, what the others made visible before theirs, to the thread that sees the
// last count. On a host runtime (the emulator, the native engine) the add is itself a release and an acquire.
__device__ __forceinline__ unsigned long long buddy_arrive(unsigned long long* done) {
#if defined(BUDDY_EMULATOR)
  return __atomic_fetch_add(done, 1ull, __ATOMIC_ACQ_REL);
#else
  __threadfence();
  const unsigned long long before = atomicAdd(done, 1ull);
  __threadfence();
  return before;
#endif
}

// Whether this block is the last of its launch to get here; every thread of every block calls it once, after the
// writes the last block then reads. `done`: zero before the launch (a count of the blocks arrived); `last`: a word of
// the block's shared memory (the kernel's: a __shared__ variable of an inline function is one the host runtimes'
// shared section cannot hold beside the kernels').
__device__ __forceinline__ bool buddy_last_block(unsigned long long* done, unsigned int* last) {
  __syncthreads();  // the block's threads have written
  if (threadIdx.x == 0) *last = buddy_arrive(done) + 1 == (unsigned long long)gridDim.x;
  __syncthreads();  // `last` written; the acquire above ordered before every thread's reads after
  return *last != 0;
}

// Where the sizes kernel's placement words are (BUDDY_PLACE_*: 4 long longs, zero before the launch): the
// tensor's overflow map (BuddyOverflowMap: cap, r, and the offset of its r sectors in the step's reserve), and the
// count of the launch's blocks done.
#define BUDDY_PLACE_CAP 0
#define BUDDY_PLACE_R 1
#define BUDDY_PLACE_OFFSET 2
#define BUDDY_PLACE_DONE 3

// Where a tensor packed ahead sends its overflow, decided where its sizes are known (one thread): the first `cap`
// sectors to buddy memory, as many as the step's running bound has room for (`room` less what the step's tensors
// before it sent there, step[0]); the rest, up to what is left of the step's reserve (`reserve_sectors` less
// step[1]), to the reserve on the device; past that, buddy memory again (the step passes its bound: the host sees
// it where forward ends). step[0] and step[1] grow by what it sent to each. Without a step (null): `room` alone
// bounds it, and there is no reserve.
__device__ __forceinline__ void buddy_place(long long total, long long room, unsigned long long* step,
                                            long long reserve_sectors, long long* place) {
  const long long left = step != nullptr ? room - (long long)step[0] : room;
  const long long cap = total < left ? total : (left > 0 ? left : 0);
  long long r = 0, offset = 0;
  if (total > cap && reserve_sectors > 0 && step != nullptr) {
    offset = (long long)atomicAdd(&step[1], (unsigned long long)(total - cap));
    const long long free = reserve_sectors - offset;
    r = free <= 0 ? 0 : (free < total - cap ? free : total - cap);
  }
  if (step != nullptr) atomicAdd(&step[0], (unsigned long long)(total - r));
  place[BUDDY_PLACE_CAP] = cap;
  place[BUDDY_PLACE_R] = r;
  place[BUDDY_PLACE_OFFSET] = offset;
}

// The drain kernel (an overflow ring, opt-in): a tensor packed ahead whose pack wrote its overflow into a region of a
// ring on the device (`staged`, as pack writes buddy memory: its sectors in order, less those its placement put in
// the step's reserve) has it copied to its range of buddy memory, on a GPU pinned host memory mapped into the
// device's address space -- the stores cross the bus, a warp's 256 contiguous bytes each, on the stream that runs
// the drain (the copy stream) while forward's kernels go on. How many sectors: ends[n - 1] less the placement's r,
// which the host never reads, clamped to [0, capacity] (a bad count copies what fits, never past either buffer).
__device__ __forceinline__ void buddy_drain_body(const uint8_t* __restrict__ staged, long long capacity,
                                                 const long long* __restrict__ ends, long long n_entries,
                                                 const long long* __restrict__ place, uint8_t* __restrict__ buddy) {
  if (n_entries <= 0) return;
  long long sectors = ends[n_entries - 1] - (place != nullptr ? place[BUDDY_PLACE_R] : 0);
  sectors = sectors < 0 ? 0 : (sectors < capacity ? sectors : capacity);
  const long long words = sectors * (BUDDY_SECTOR_BYTES / 8);
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long w = (long long)blockIdx.x * blockDim.x + threadIdx.x; w < words; w += stride)
    reinterpret_cast<uint64_t*>(buddy)[w] = reinterpret_cast<const uint64_t*>(staged)[w];
}

// The sizes kernel: measure (buddy_measure_body), then, in whichever block is done last, the overflow's prefix sums
// for slots of s sectors (buddy_ends_block) and its placement (buddy_place): a slot chosen before the sizes are
// known (a tracker's plan) compresses in two launches, this and pack, with nothing read back.
template <class Codec>
__device__ __forceinline__ void buddy_sizes_body(const uint8_t* __restrict__ data, const uint8_t* __restrict__ tail,
                                                 long long n_full, long long n_entries, buddy_meta_t* meta,
                                                 unsigned long long* __restrict__ histogram,
                                                 const uint8_t* __restrict__ table, uint32_t s,
                                                 long long* __restrict__ ends, long long* __restrict__ place,
                                                 long long room, unsigned long long* __restrict__ step,
                                                 long long reserve_sectors, long long* run, unsigned int* last) {
  buddy_measure_body<Codec>(data, tail, n_full, n_entries, meta, histogram, table);
  if (!buddy_last_block(reinterpret_cast<unsigned long long*>(place + BUDDY_PLACE_DONE), last)) return;
  buddy_ends_block(meta, n_entries, s, ends, run);
  __syncthreads();  // the last entry's sum is written
  if (threadIdx.x == 0) buddy_place(n_entries ? ends[n_entries - 1] : 0, room, step, reserve_sectors, place);
}

// A tensor's overflow map from its placement words (null: every sector in `overflow`, in order); reserve: the step's.
// (Its reserve pointer is the reserve argument's, whichever: see BuddyOverflowMap.)
__device__ __forceinline__ BuddyOverflowMap buddy_placed(uint8_t* overflow, const long long* place, uint8_t* reserve) {
  if (place == nullptr) return {overflow, reserve, 0, 0};
  return {overflow, reserve + place[BUDDY_PLACE_OFFSET] * BUDDY_SECTOR_BYTES, place[BUDDY_PLACE_CAP],
          place[BUDDY_PLACE_R]};
}

template <class Codec>
__device__ __forceinline__ void buddy_pack_body(const uint8_t* __restrict__ data, const uint8_t* __restrict__ tail,
                                                long long n_full, long long n_entries,
                                                const buddy_meta_t* __restrict__ meta,
                                                const long long* __restrict__ ends, uint32_t s,
                                                uint8_t* __restrict__ slots, uint8_t* __restrict__ overflow,
                                                const long long* __restrict__ place, uint8_t* __restrict__ reserve,
                                                const uint8_t* __restrict__ table) {
  const BuddyCudaWarp warp;
  const BuddyOverflowMap map = buddy_placed(overflow, place, reserve);
#if BUDDY_PACK_FIELDS && !defined(BUDDY_NATIVE_SOLO)
  // A table codec's table of whole fields (make_fields, codec_fpe.h) in the block's first Codec::FIELDS_BYTES of
  // dynamic shared memory, the warps' staging after it (launch_config): a word's field one load from it
  Codec codec = buddy_codec<Codec>(table);
  uint8_t* staging = buddy_staging();
  if constexpr (Codec::TABLED) {
    uint32_t* fields = reinterpret_cast<uint32_t*>(buddy_dynamic_shared());
    codec.make_fields(fields, threadIdx.x, blockDim.x);
    __syncthreads();
    codec.use_fields(fields);
    staging += Codec::FIELDS_BYTES;
  }
#else
  const Codec codec = buddy_codec<Codec>(table);
  uint8_t* staging = buddy_staging();
#endif
  for (long long i = buddy_first_warp(n_entries), end = buddy_last_warp(n_entries); i < end; i += buddy_warp_stride())
    buddy_pack_entry<Codec>(warp, codec, i, data, tail, n_full, meta, ends, s, slots, map, staging);
}

// A table codec's decode rows (the device table's first Codec::ROWS_BYTES) copied into the first Codec::ROWS_BYTES
// of the block's dynamic shared memory by the block's threads (the block waits for them): the decoder reads its
// rows from there, the rest of the table (enc, read only to check an escape) in global memory -- 8 KiB less a
// block, so more warps an SM where shared memory bounds them. Unpack's and the lockstep decoder's.
template <class Codec>
__device__ __forceinline__ const uint8_t* buddy_table_to_shared(const uint8_t* __restrict__ table) {
  uint64_t* copy = reinterpret_cast<uint64_t*>(buddy_dynamic_shared());
  for (uint32_t j = threadIdx.x; j < Codec::ROWS_BYTES / 8u; j += blockDim.x)
    copy[j] = reinterpret_cast<const uint64_t*>(table)[j];
  __syncthreads();
  return reinterpret_cast<const uint8_t*>(copy);
}

template <class Codec>
__device__ __forceinline__ void buddy_unpack_body(const buddy_meta_t* __restrict__ meta,
                                                  const long long* __restrict__ ends, uint32_t s,
                                                  const uint8_t* __restrict__ slots,
                                                  const uint8_t* __restrict__ overflow, long long overflow_sectors,
                                                  const long long* __restrict__ place,
                                                  const uint8_t* __restrict__ reserve, long long reserve_sectors,
                                                  uint8_t* __restrict__ out, int* __restrict__ error,
                                                  long long n_entries, const uint8_t* __restrict__ table) {
  const BuddyCudaWarp warp;
  // the overflow's map, checked: a placement that would read outside the overflow or the reserve flags every
  // entry that reads its overflow, and reads nothing (the overflow then holds none of it)
  BuddyOverflowMap map = buddy_placed(const_cast<uint8_t*>(overflow), place, const_cast<uint8_t*>(reserve));
  long long logical = overflow_sectors;  // the overflow's sectors wherever they are
  if (place != nullptr) {
    const long long offset = place[BUDDY_PLACE_OFFSET];
    const bool good = map.cap >= 0 && map.r >= 0 && offset >= 0 && offset <= reserve_sectors &&
                      map.r <= reserve_sectors - offset && (map.r == 0 || map.cap <= overflow_sectors);
    if (good) {
      logical += map.r;
    } else {
      map.cap = map.r = 0;
      logical = 0;
    }
  }
#if defined(BUDDY_NATIVE_SOLO)
  Codec codec = buddy_codec<Codec>(table);
  // (fpe, auto2: codec_fpe.h) -- for a run of entries worth the walk table's rows, which a new table makes anew
  if constexpr (buddy_walks<Codec>::value)
    if (buddy_last_warp(n_entries) - buddy_first_warp(n_entries) >= BUDDY_WALK_MIN_ENTRIES) codec.prepare_walk();
  uint8_t* staging = buddy_staging(buddy_unpack_staging_entries<Codec>());
#elif BUDDY_SHARED_TABLES
  // The block's first Codec::ROWS_BYTES of dynamic shared memory hold the table's decode rows, the warps' staging
  // follows (launch_config): the rows are read a code at a time, at random, and from global memory they missed L1
  // often (a warp waited on L1TEX for most of its cycles: the profile in docs/kernel_budget.md), shared memory
  // answers every one.
  const uint8_t* rows = table;
  uint8_t* staging = buddy_staging(buddy_unpack_staging_entries<Codec>());
  if constexpr (Codec::TABLED) {
    rows = buddy_table_to_shared<Codec>(table);
    staging += Codec::ROWS_BYTES;
  }
  const Codec codec = buddy_codec<Codec>(table, rows);
#else
  const Codec codec = buddy_codec<Codec>(table);
  uint8_t* staging = buddy_staging(buddy_unpack_staging_entries<Codec>());
#endif
  uint32_t err = 0;
#if BUDDY_FPE_AVX512
  if constexpr (buddy_pairs<Codec>::value) {  // (fpe's walks, two entries at a time: codec_fpe.h)
    alignas(64) static thread_local uint8_t second[BUDDY_ENTRY_BYTES + 64];
    uint8_t* const stagings[2] = {staging, second};
    for (long long i = buddy_first_warp(n_entries), end = buddy_last_warp(n_entries); i < end;) {
      if (i + 1 < end && buddy_unpack_pair<Codec>(warp, codec, i, n_entries, meta, ends, s, slots, map, logical,
                                                  stagings, out, &err)) {
        i += 2;
        continue;
      }
      err |= buddy_unpack_entry<Codec>(warp, codec, i, n_entries, meta, ends, s, slots, map, logical, staging, out);
      ++i;
    }
  } else
#endif
  for (long long i = buddy_first_warp(n_entries), end = buddy_last_warp(n_entries); i < end; i += buddy_warp_stride())
    err |= buddy_unpack_entry<Codec>(warp, codec, i, n_entries, meta, ends, s, slots, map, logical, staging, out);
  if (err && warp.lane() == 0) atomicOr(error, (int)err);
}

// The word size picks the codec's instantiation once per launch. A module built
// for one word size (-DBUDDY_WORD_BYTES=w: what the loader compiles) holds that
// instantiation alone: with all four in one kernel the compiler interleaves
// them and the kernel needs the registers of more than the largest (fpe's
// unpack: 80 instead of at most 64).
#if defined(BUDDY_WORD_BYTES) && BUDDY_WORD_BYTES != 1 && BUDDY_WORD_BYTES != 2 && BUDDY_WORD_BYTES != 4 && \
    BUDDY_WORD_BYTES != 8
#error "BUDDY_WORD_BYTES is 1, 2, 4 or 8"
#endif
#if defined(BUDDY_WORD_BYTES)
#define BUDDY_WORD_SWITCH(CODEC, BODY, ...) \
  if (word_bytes == BUDDY_WORD_BYTES) BODY<CODEC<BUDDY_WORD_BYTES>>(__VA_ARGS__); /* the loader launches no other */
#else
#define BUDDY_WORD_SWITCH(CODEC, BODY, ...)     \
  switch (word_bytes) {                         \
    case 1: BODY<CODEC<1>>(__VA_ARGS__); break; \
    case 2: BODY<CODEC<2>>(__VA_ARGS__); break; \
    case 4: BODY<CODEC<4>>(__VA_ARGS__); break; \
    case 8: BODY<CODEC<8>>(__VA_ARGS__); break; \
    default: break; /* the loader only launches with 1, 2, 4 or 8 */ \
  }
#endif

// The unpack of the table codecs, at entries of 4 KiB and more, is held to 64 registers a thread, 85 for 8-byte
// words (auto2's members need more there): their decoders fit without spilling (nvcc --resource-usage; the kernel
// budget, docs/kernel_budget.md). With the table in global memory a block runs at most 8 warps (4 blocks of 8 warps
// fill an SM's registers at 64); with the table's rows in shared memory at most 24 (one block an SM: the rows and
// 24 warps' staging at 4 KiB fill its shared memory, shared_table_layout). Smaller entries unroll differently and
// are left to the compiler (at most 8 warps a block).
#if BUDDY_ENTRY_BYTES >= 4096 && BUDDY_SHARED_TABLES && !(defined(BUDDY_WORD_BYTES) && BUDDY_WORD_BYTES == 8)
#define BUDDY_UNPACK_BOUNDS_LIMITED __launch_bounds__(1024, 1)
#elif BUDDY_ENTRY_BYTES >= 4096 && BUDDY_SHARED_TABLES
#define BUDDY_UNPACK_BOUNDS_LIMITED __launch_bounds__(768, 1)
#elif BUDDY_ENTRY_BYTES >= 4096 && !(defined(BUDDY_WORD_BYTES) && BUDDY_WORD_BYTES == 8)
#define BUDDY_UNPACK_BOUNDS_LIMITED __launch_bounds__(256, 4)
#elif BUDDY_ENTRY_BYTES >= 4096
#define BUDDY_UNPACK_BOUNDS_LIMITED __launch_bounds__(256, 3)
#else
#define BUDDY_UNPACK_BOUNDS_LIMITED
#endif
#define BUDDY_UNPACK_BOUNDS_FREE
// Pack, at entries of 4 KiB and more and words of 2, 4 or 8 bytes, is held to 64 registers a thread (4 blocks of its
// 8 warps an SM): unbounded, nvcc gave float32's 70 (24 warps an SM) where 64 hold it without a spill, for a few
// more instructions an entry (the kernel budget counts them). 1-byte words would spill there (auto2's members); a
// module of every word size is left to the compiler.
#if BUDDY_ENTRY_BYTES >= 4096 && defined(BUDDY_WORD_BYTES) && BUDDY_WORD_BYTES > 1
#define BUDDY_PACK_BOUNDS __launch_bounds__(256, 4)
#else
#define BUDDY_PACK_BOUNDS
#endif
// Measure (8 warps a block, no staging) at entries of at most 4 KiB and words of 1, 2 or 4 bytes is held to 48
// registers: 5 blocks an SM, 40 warps, where nvcc gave auto2's 54 (32 warps) unbounded; none spills, for a few
// more instructions an entry (the kernel budget counts them). 8-byte words (auto2's) and larger entries (every
// codec's) would spill there.
#if BUDDY_ENTRY_BYTES <= 4096 && defined(BUDDY_WORD_BYTES) && BUDDY_WORD_BYTES < 8
#define BUDDY_MEASURE_BOUNDS __launch_bounds__(256, 5)
#else
#define BUDDY_MEASURE_BOUNDS
#endif

// The extern "C" entry points of one codec (NAME: its registry name; BOUNDS: FREE or LIMITED, the unpack's).
#define BUDDY_MEASURE_KERNEL(NAME, CODEC)                                                                          \
  /* k and mode of every entry into the metadata; the histogram of k (added to: zero it first) */                  \
  extern "C" __global__ void BUDDY_MEASURE_BOUNDS buddy_##NAME##_measure(                                          \
      const uint8_t* __restrict__ data,          /* in: the tensor's bytes, n_full * E of whole entries */          \
      const uint8_t* __restrict__ tail,          /* in: E bytes, the last entry zero-padded (if n_full < n) */      \
      long long n_full,                          /* entries wholly inside data */                                    \
      long long n_entries,                       /* entries of the tensor */                                         \
      uint8_t* __restrict__ meta,                /* out: n_entries metadata words */                                 \
      unsigned long long* __restrict__ histogram, /* in/out: E/32 + 1 counts, entries of k sectors added to [k] */  \
      const uint8_t* __restrict__ table,         /* in: the codec's device table, or null (see above) */            \
      int word_bytes) {                          /* word size in bytes: 1, 2, 4 or 8 */                              \
    BUDDY_WORD_SWITCH(CODEC, buddy_measure_body, data, tail, n_full, n_entries,                                     \
                      reinterpret_cast<buddy_meta_t*>(meta), histogram, table)                                     \
  }
#define BUDDY_PACK_KERNEL(NAME, CODEC)                                                                             \
  /* every entry's slot, and its overflow compacted in entry order */                                              \
  extern "C" __global__ void BUDDY_PACK_BOUNDS buddy_##NAME##_pack(                                                \
      const uint8_t* __restrict__ data,   /* in: the tensor's bytes, n_full * E of whole entries */                 \
      const uint8_t* __restrict__ tail,   /* in: E bytes, the last entry zero-padded (if n_full < n) */             \
      long long n_full,                   /* entries wholly inside data */                                           \
      long long n_entries,                /* entries of the tensor */                                                \
      const uint8_t* __restrict__ meta,   /* in: n_entries metadata words (from measure) */                         \
      const long long* __restrict__ ends, /* in: n_entries, overflow sectors of entries 0..i (inclusive sum) */     \
      int slot,                           /* s: sectors per slot, 0 .. E/32 */                                       \
      uint8_t* __restrict__ slots,        /* out: n_entries * s * 32 bytes */                                        \
      uint8_t* __restrict__ overflow,     /* out: ends[n - 1] * 32 bytes, less those in the reserve */               \
      const long long* __restrict__ place, /* in: the sizes kernel's placement (BUDDY_PLACE_*), or null: none */    \
      uint8_t* __restrict__ reserve,      /* in/out: the step's reserve on the device (null without a placement) */ \
      const uint8_t* __restrict__ table,  /* in: the codec's device table, or null (see above) */                    \
      int word_bytes) {                   /* word size in bytes: 1, 2, 4 or 8 */                                     \
    BUDDY_WORD_SWITCH(CODEC, buddy_pack_body, data, tail, n_full, n_entries,                                        \
                      reinterpret_cast<const buddy_meta_t*>(meta), ends, (uint32_t)slot, slots, overflow, place,    \
                      reserve, table)                                                                              \
  }
#define BUDDY_UNPACK_KERNEL(NAME, CODEC, BOUNDS)                                                                   \
  /* the tensor's entries back; inconsistent buffers never cause an out-of-bounds access: flagged entries decode   \
     to zeros and *error gets their BUDDY_ERR_* bits (the caller zeroes it before the launch) */                   \
  extern "C" __global__ BUDDY_UNPACK_BOUNDS_##BOUNDS void buddy_##NAME##_unpack(                                  \
      const uint8_t* __restrict__ meta,     /* in: n_entries metadata words */                                      \
      const long long* __restrict__ ends,   /* in: n_entries, overflow sectors of entries 0..i (inclusive sum) */   \
      int slot,                             /* s: sectors per slot, 0 .. E/32 */                                     \
      const uint8_t* __restrict__ slots,    /* in: n_entries * s * 32 bytes */                                       \
      const uint8_t* __restrict__ overflow, /* in: overflow_sectors * 32 bytes, on the device */                     \
      long long overflow_sectors,           /* sectors in overflow (those in the reserve not counted) */             \
      const long long* __restrict__ place,  /* in: the sizes kernel's placement (BUDDY_PLACE_*), or null: none */    \
      const uint8_t* __restrict__ reserve,  /* in: the step's reserve on the device (null without a placement) */   \
      long long reserve_sectors,            /* sectors in reserve */                                                 \
      uint8_t* __restrict__ out,            /* out: n_entries * E bytes */                                           \
      int* __restrict__ error,              /* in/out: one int, ORed with BUDDY_ERR_* bits */                        \
      long long n_entries,                  /* entries of the tensor */                                              \
      const uint8_t* __restrict__ table,    /* in: the codec's device table, or null (see above) */                  \
      int word_bytes) {                     /* word size in bytes: 1, 2, 4 or 8 */                                   \
    BUDDY_WORD_SWITCH(CODEC, buddy_unpack_body, reinterpret_cast<const buddy_meta_t*>(meta), ends, (uint32_t)slot, \
                      slots, overflow, overflow_sectors, place, reserve, reserve_sectors, out, error, n_entries,   \
                      table)                                                                                       \
  }
#define BUDDY_ENDS_KERNEL(NAME)                                                                                    \
  /* the overflow's prefix sums pack and unpack place each entry's overflow by (one block: BUDDY_ENDS_THREADS) */  \
  extern "C" __global__ void buddy_##NAME##_ends(                                                                  \
      const uint8_t* __restrict__ meta, /* in: n_entries metadata words (from measure) */                          \
      long long n_entries,              /* entries of the tensor */                                                 \
      int slot,                         /* s: sectors per slot, 0 .. E/32 */                                        \
      long long* __restrict__ ends,     /* out: n_entries, overflow sectors of entries 0..i (inclusive sum) */      \
      int word_bytes) {                 /* word size in bytes (every kernel's last parameter; unused) */            \
    (void)word_bytes;                                                                                              \
    __shared__ long long runs[BUDDY_ENDS_THREADS];                                                                 \
    if (blockIdx.x == 0)                                                                                           \
      buddy_ends_block(reinterpret_cast<const buddy_meta_t*>(meta), n_entries, (uint32_t)slot, ends,               \
                       buddy_shared_array(runs));                                                                  \
  }
#define BUDDY_SIZES_KERNEL(NAME, CODEC)                                                                            \
  /* measure and, in the block done last, the overflow's prefix sums for a slot chosen before (launched as measure) */ \
  extern "C" __global__ void BUDDY_MEASURE_BOUNDS buddy_##NAME##_sizes(                                            \
      const uint8_t* __restrict__ data,  /* in: the tensor's bytes, n_full * E of whole entries */                  \
      const uint8_t* __restrict__ tail,  /* in: E bytes, the last entry zero-padded (if n_full < n) */              \
      long long n_full,                  /* entries wholly inside data */                                            \
      long long n_entries,               /* entries of the tensor */                                                 \
      uint8_t* meta,                     /* out: n_entries metadata words (read again by the last block) */         \
      unsigned long long* __restrict__ histogram, /* in/out: E/32 + 1 counts, entries of k sectors added to [k] */ \
      const uint8_t* __restrict__ table, /* in: the codec's device table, or null (see above) */                    \
      int slot,                          /* s: sectors per slot, 0 .. E/32 */                                        \
      long long* __restrict__ ends,      /* out: n_entries, overflow sectors of entries 0..i (inclusive sum) */     \
      long long* __restrict__ place,     /* in/out: 4, zero: the placement (BUDDY_PLACE_*), the blocks done */       \
      long long room,                    /* overflow sectors the step's bound allows so far, this tensor's in */     \
      unsigned long long* __restrict__ step, /* in/out: 2, the step's sectors sent to buddy memory, to the reserve */ \
      long long reserve_sectors,         /* sectors in the step's reserve */                                         \
      int word_bytes) {                  /* word size in bytes: 1, 2, 4 or 8 */                                      \
    __shared__ long long runs[BUDDY_ENDS_THREADS];                                                                 \
    __shared__ unsigned int last;                                                                                  \
    BUDDY_WORD_SWITCH(CODEC, buddy_sizes_body, data, tail, n_full, n_entries, reinterpret_cast<buddy_meta_t*>(meta), \
                      histogram, table, (uint32_t)slot, ends, place, room, step, reserve_sectors,                  \
                      buddy_shared_array(runs), buddy_shared_array(&last))                                         \
  }
#define BUDDY_DRAIN_KERNEL(NAME)                                                                                   \
  /* an overflow staged in a ring on the device into buddy memory (the overflow ring; any grid, 256 threads) */     \
  extern "C" __global__ void buddy_##NAME##_drain(                                                                 \
      const uint8_t* __restrict__ staged, /* in: the overflow as pack wrote it, capacity * 32 bytes */             \
      long long capacity,                 /* sectors staged holds and buddy takes */                               \
      const long long* __restrict__ ends, /* in: n_entries, overflow sectors of entries 0..i (inclusive sum) */    \
      long long n_entries,                /* entries of the tensor */                                              \
      const long long* __restrict__ place, /* in: the sizes kernel's placement (BUDDY_PLACE_*), or null: none */   \
      uint8_t* __restrict__ buddy,        /* out: its range of buddy memory, capacity * 32 bytes */                \
      int word_bytes) {                   /* word size in bytes (every kernel's last parameter; unused) */         \
    (void)word_bytes;                                                                                              \
    buddy_drain_body(staged, capacity, ends, n_entries, place, buddy);                                             \
  }
#define BUDDY_FORMAT_KERNELS(NAME, CODEC, BOUNDS)                                                                  \
  BUDDY_MEASURE_KERNEL(NAME, CODEC) BUDDY_ENDS_KERNEL(NAME) BUDDY_SIZES_KERNEL(NAME, CODEC)                       \
  BUDDY_PACK_KERNEL(NAME, CODEC) BUDDY_UNPACK_KERNEL(NAME, CODEC, BOUNDS) BUDDY_DRAIN_KERNEL(NAME)

// A codec with a table fits it where the tensor is: its symbol counts (one
// pass over the tensor), then the table (one warp). Launch: count, any grid,
// 256 threads a block, no dynamic shared memory; fit, one block of 32 threads.

// A GPU's count: a lane's 16-byte unit u of the n16 (zeros past them); the first unit of a lane's warp, and the
// warps' stride (the grid's warps stride over the units together).
__device__ __forceinline__ buddy_u128 buddy_count_unit(const uint8_t* __restrict__ data, long long u, long long n16) {
  const buddy_u128 zero = {0, 0};
  return u < n16 ? buddy_load<buddy_u128>(data + 16 * u) : zero;
}
__device__ __forceinline__ long long buddy_count_first() {
  return (long long)blockIdx.x * blockDim.x + (threadIdx.x & ~(BUDDY_WARP_SIZE - 1u));
}

// The count by ballots (the kernel's `aggregate` 0: buddy_fpe_count_unit16_ballot), the warp's zero words added
// once at the end. A function of its own, not a branch in the default's loop (which kept it there: 19
// instructions more a float32 unit) nor a template flag of it (the kernel budget, which charges the default's
// instructions, tells code apart by its source lines: its loop is left out by this function's first line).
template <int WB>
__device__ __forceinline__ void buddy_count_ballots(const BuddyCudaWarp& warp, const uint8_t* __restrict__ data,
                                                    long long n16, uint32_t* local) {
  uint32_t zeros = 0;
  for (long long u0 = buddy_count_first(); u0 < n16; u0 += (long long)gridDim.x * blockDim.x) {
    const long long u = u0 + warp.lane();
    buddy_fpe_count_unit16_ballot<WB>(warp, buddy_count_unit(data, u, n16), u < n16, local, &zeros);
  }
  if (warp.lane() == 0 && zeros) buddy_atomic_add(&local[1u << buddy_fpe_fit_split<WB>::b], zeros);
}

template <int WB>
__device__ __forceinline__ void buddy_count_body(const uint8_t* __restrict__ data, long long n_units,
                                                 const uint8_t* __restrict__ tail, int tail_words,
                                                 unsigned long long* __restrict__ counts, uint32_t* local,
                                                 bool aggregate) {
  // the block counts in shared memory (local: S + 2 words), then adds its counts to the tensor's once
  const uint32_t symbols = (1u << buddy_fpe_fit_split<WB>::b) + 2u;
  for (uint32_t j = threadIdx.x; j < symbols; j += blockDim.x) local[j] = 0;
  __syncthreads();
  // 16 bytes a lane; the warps loop together (the counts are aggregated over a warp)
  const BuddyCudaWarp warp;
  const long long n16 = n_units / 2;
  if constexpr (BUDDY_WARP_SIZE == 1) {
    // one lane a block (the native engine): the units buddy_first_warp gives the block, as the entries of the
    // format kernels (a contiguous run: strided by the grid, each block read a 16-byte unit of every 16 x 16 bytes,
    // and every cache line came from memory once per block)
    // A word's count key is its symbol, zero words' too (a zero word's symbol is 0), and the zero words are then
    // moved to ZERO's count: a shift a word, not a select, fewer operations in the loop (ReLU gains least: half of
    // its words add to one count in turn)
    constexpr uint32_t t = buddy_fpe_fit_split<WB>::t, zero = 1u << buddy_fpe_fit_split<WB>::b;
    uint32_t zeros = 0;
    for (long long u = buddy_first_warp(n16), end = buddy_last_warp(n16); u < end; u += buddy_warp_stride()) {
      const buddy_u128 unit = buddy_load<buddy_u128>(data + u * 16);
      for (uint32_t i = 0; i < 16u / WB; ++i) {
        const typename BuddyFpe<WB>::word_t x = BuddyFpe<WB>::unit_word(unit, i);
        local[(uint32_t)((uint64_t)x >> t)] += 1u;  // (the fit's b: a word's top b bits, below 2^b)
        zeros += x == 0;
      }
    }
    local[0] -= zeros;
    local[zero] += zeros;
    (void)aggregate;
  } else if (aggregate) {  // a warp's equal keys added once (buddy_fpe_count_unit16)
    for (long long u0 = buddy_count_first(); u0 < n16; u0 += (long long)gridDim.x * blockDim.x) {
      const long long u = u0 + warp.lane();
      buddy_fpe_count_unit16<WB>(warp, buddy_count_unit(data, u, n16), u < n16, local);
    }
  } else {
    buddy_count_ballots<WB>(warp, data, n16, local);
  }
  if (blockIdx.x == 0) {  // the odd 8 bytes, and the words of the last, partial entry
    for (int w = threadIdx.x; w < (int)(n_units % 2) * (8 / WB); w += blockDim.x)
      buddy_fpe_count_word<WB>(data + 16 * n16 + WB * w, local);
    for (int w = threadIdx.x; w < tail_words; w += blockDim.x) buddy_fpe_count_word<WB>(tail + WB * w, local);
  }
  __syncthreads();
  for (uint32_t j = threadIdx.x; j < symbols; j += blockDim.x)
    if (local[j]) atomicAdd(&counts[j], (unsigned long long)local[j]);
}

// The count kernel's word sizes (one, in a module built for one: as BUDDY_WORD_SWITCH).
#if defined(BUDDY_WORD_BYTES)
#define BUDDY_COUNT_SWITCH(...) \
  if (word_bytes == BUDDY_WORD_BYTES) buddy_count_body<BUDDY_WORD_BYTES>(__VA_ARGS__);
#else
#define BUDDY_COUNT_SWITCH(...)                          \
  switch (word_bytes) {                                  \
    case 1: buddy_count_body<1>(__VA_ARGS__); break;     \
    case 2: buddy_count_body<2>(__VA_ARGS__); break;     \
    case 4: buddy_count_body<4>(__VA_ARGS__); break;     \
    case 8: buddy_count_body<8>(__VA_ARGS__); break;     \
    default: break;                                      \
  }
#endif

#define BUDDY_COUNT_KERNEL(NAME)                                                                                   \
  /* symbol counts of the tensor's whole words (fpe.symbol_counts; added to: zero them first) */                   \
  extern "C" __global__ void buddy_##NAME##_count(                                                                 \
      const uint8_t* __restrict__ data,          /* in: n_units * 8 bytes, the tensor's whole entries */           \
      long long n_units,                         /* 8-byte units in data */                                         \
      const uint8_t* __restrict__ tail,          /* in: the last, partial entry (zero-padded) */                    \
      int tail_words,                            /* whole words of the tensor in tail */                            \
      unsigned long long* __restrict__ counts,   /* in/out: S + 2 counts (ESC's stays 0) */                         \
      int aggregate,                             /* 1: a warp's equal keys added once (a match), 0: by ballots */  \
      int word_bytes) {                          /* word size in bytes: 1, 2, 4 or 8 */                             \
    __shared__ uint32_t local[BUDDY_FPE_SYMBOLS];                                                                  \
    BUDDY_COUNT_SWITCH(data, n_units, tail, tail_words, counts, buddy_shared_array(local), aggregate != 0)         \
  }

// The fit is a warp of 32 lanes (codec_fpe_fit.h), or one: a build of one lane a warp (the native engine's,
// BUDDY_WARP_SIZE 1) sorts where the 32 lanes rank, and tries the rounds in turn where they try one each.
#define BUDDY_FIT_KERNEL(NAME)                                                                                     \
  /* the table fitted to the counts (fpe.Table.from_counts): its device table and its serialized bytes */          \
  extern "C" __global__ void buddy_##NAME##_fit(                                                                   \
      const long long* __restrict__ counts, /* in: S + 2 symbol counts */                                          \
      uint8_t* __restrict__ work,           /* scratch: sizeof(BuddyFpeFitWork) bytes, 8-byte aligned */           \
      uint8_t* __restrict__ table,          /* out: the device table (sizeof(BuddyFpeTable) bytes) */              \
      uint8_t* __restrict__ serial,         /* out: fpe.Table.to_bytes, zeros after (BUDDY_FPE_SERIAL_BYTES) */    \
      int weighted,                         /* 1: counts are the fit's weights (fpe.fit_weights), not scaled */    \
      int word_bytes) {                     /* word size in bytes: 1, 2, 4 or 8 (every kernel's last parameter) */ \
    if (blockIdx.x != 0 || threadIdx.x >= BUDDY_WARP_SIZE) return;                                                 \
    buddy_fpe_fit(BuddyCudaWarp(), reinterpret_cast<const int64_t*>(counts), (uint32_t)word_bytes, weighted != 0,  \
                  reinterpret_cast<BuddyFpeFitWork*>(work), reinterpret_cast<BuddyFpeTable*>(table), serial);       \
  }
#define BUDDY_FIT_KERNELS(NAME) BUDDY_COUNT_KERNEL(NAME) BUDDY_FIT_KERNEL(NAME)

#if defined(BUDDY_CODEC_ZVC) || defined(BUDDY_CODEC_ALL)
BUDDY_FORMAT_KERNELS(zvc, BuddyZvc, FREE)
#endif
#if defined(BUDDY_CODEC_FPX) || defined(BUDDY_CODEC_ALL)
BUDDY_FORMAT_KERNELS(fpx, BuddyFpx, FREE)
#endif
#if defined(BUDDY_CODEC_BPC) || defined(BUDDY_CODEC_ALL)
BUDDY_FORMAT_KERNELS(bpc, BuddyBpc, FREE)
#endif
#if defined(BUDDY_CODEC_AUTO) || defined(BUDDY_CODEC_ALL)
BUDDY_FORMAT_KERNELS(auto, BuddyAuto, FREE)
#endif
#if defined(BUDDY_CODEC_FPE) || defined(BUDDY_CODEC_ALL)
BUDDY_FORMAT_KERNELS(fpe, BuddyFpe, LIMITED)
BUDDY_FIT_KERNELS(fpe)
#endif
#if defined(BUDDY_CODEC_AUTO2) || defined(BUDDY_CODEC_ALL)
BUDDY_FORMAT_KERNELS(auto2, BuddyAuto2, LIMITED)
BUDDY_FIT_KERNELS(auto2)
#endif

// The lockstep layout's decoder (codec_fpe.h, decode_lockstep): a layout weighed for a format to come, which no
// encoder writes; its streams come from experiments/lab/fpe_lanes.py. Not in the one-lane build (the layout is of 32
// lanes). As unpack's: the table's decode rows in the block's shared memory, then a warp's payload (E + 32 bytes)
// after them; a round's words go straight to global memory, side by side. Launch: dynamic shared memory ROWS_BYTES
// + the warps' (E + 32) bytes.
#if (defined(BUDDY_CODEC_FPE) || defined(BUDDY_CODEC_ALL)) && !defined(BUDDY_NATIVE_SOLO)
template <class Codec>
__device__ __forceinline__ void buddy_lockstep_body(const uint8_t* __restrict__ payloads,
                                                    const int* __restrict__ sectors, long long n_entries,
                                                    uint8_t* __restrict__ out, int* __restrict__ error,
                                                    const uint8_t* __restrict__ table) {
  const BuddyCudaWarp warp;
  const Codec codec = buddy_codec<Codec>(table, buddy_table_to_shared<Codec>(table));
  uint8_t* const staging =
      buddy_dynamic_shared() + Codec::ROWS_BYTES + (threadIdx.x / BUDDY_WARP_SIZE) * (BUDDY_ENTRY_BYTES + 32);
  uint32_t err = 0;
  for (long long i = buddy_first_warp(n_entries); i < n_entries; i += buddy_warp_stride()) {
    const uint32_t k = (uint32_t)sectors[i];
    if (k == 0 || k >= BUDDY_ENTRY_BYTES / BUDDY_SECTOR_BYTES) {  // (coded entries only)
      err |= BUDDY_ERR_STREAM;
      continue;
    }
    buddy_warp_fill(warp, payloads + (BUDDY_ENTRY_BYTES + 32) * i, staging, BUDDY_SECTOR_BYTES * (k + 1u));
    warp.sync();
    err |= codec.decode_lockstep(warp, staging, k, out + (long long)BUDDY_ENTRY_BYTES * i);
    warp.sync();  // the staging is read before the next entry's is written
  }
  if (err && warp.lane() == 0) atomicOr(error, (int)err);
}
extern "C" __global__ void buddy_fpe_lockstep_decode(
    const uint8_t* __restrict__ payloads, /* in: n_entries payloads, E + 32 bytes apart, zeros after each */
    const int* __restrict__ sectors,      /* in: n_entries, each payload's k (1 .. E/32 - 1) */
    long long n_entries,                  /* entries */
    uint8_t* __restrict__ out,            /* out: n_entries * E bytes */
    int* __restrict__ error,              /* in/out: one int, ORed with BUDDY_ERR_* bits */
    const uint8_t* __restrict__ table,    /* in: the fpe device table */
    int word_bytes) {                     /* word size in bytes: 1, 2, 4 or 8 */
  BUDDY_WORD_SWITCH(BuddyFpe, buddy_lockstep_body, payloads, sectors, n_entries, out, error, table)
}
#endif
