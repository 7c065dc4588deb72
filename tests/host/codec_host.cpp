// Host harness of the device codecs (csrc/codec_*.h) and the format rules
// around them (csrc/buddy_entry.h); tests/test_device_codecs.py builds it with
// g++ and the -D defines of buddy.spec.c_defines(E).
//
// Runs the per-entry device functions on the CPU with the 32 lanes of an
// emulated warp as cooperative fibers (ucontext): every collective (ballot,
// shuffles, sync) posts the lane's value and switches to the next lane, so a
// lane reads the others' values only after all 32 have posted them.
// Buffers end right before an inaccessible page, so a read or write past them
// crashes the program instead of passing unnoticed: an entry and a decoded
// entry have E bytes; an encoded payload has exactly 32k bytes. Outputs are
// pre-filled with 0xAB so a byte the code forgets to write shows up, and a
// decoder sees 0xAB after the payload's 32k bytes (it must not matter).
//
// usage: codec_host CODEC encode WORD_BYTES N IN OUT
//          IN:  N * E bytes of entries
//          OUT: k (N int32) | mode (N int32) | payload (N * E: the 32k bytes
//               encode wrote, zeros after) | decoded (N * E, of that payload) |
//               errors (N uint32)
//        codec_host CODEC decode WORD_BYTES N IN OUT
//          IN:  k (N int32) | mode (N int32) | payload (N * E)
//          OUT: decoded (N * E) | errors (N uint32)
//        codec_host CODEC stream WORD_BYTES N IN OUT      (CODEC: bpc or fpe)
//          the codec's functions alone, without the format rules: k is what
//          measure gives (no raw clamp); entries with 1 <= k <= 2E/32 are
//          encoded into exactly 32k bytes and decoded from exactly those
//          IN:  N * E bytes of non-zero entries
//          OUT: k (N int32) | mode (N int32) | payload (N * 2E: the 32k bytes
//               encode wrote, zeros after) | decoded (N * E) | errors (N uint32)
//        codec_host CODEC measure WORD_BYTES N N_FULL IN OUT
//        codec_host CODEC pack WORD_BYTES N N_FULL S IN OUT
//        codec_host CODEC unpack WORD_BYTES N S M IN OUT
//          the kernels of buddy_kernels.cu over a whole tensor of N entries,
//          entry by entry as buddy_ops.h has them (one warp; the GPU runs
//          many): data holds the N_FULL whole entries, tail the last one
//          zero-padded; metadata words are META_BYTES each; ends are int64.
//          measure  IN:  data (N_FULL * E) | tail (E)
//                   OUT: metadata (N words) | histogram (E/32 + 1 uint64)
//          pack     IN:  data | tail | metadata | ends (N)
//                   OUT: slots (N * S * 32) | overflow (ends[N-1] * 32)
//          unpack   IN:  metadata | ends | slots (N * S * 32) | overflow (M * 32)
//                   OUT: entries (N * E) | the ORed error bits (uint32)
//        codec_host fpe count WORD_BYTES N_UNITS TAIL_WORDS IN OUT
//          fpe's symbol counts (csrc/codec_fpe_fit.h) of N_UNITS 8-byte
//          units and TAIL_WORDS words of a partial last entry
//          IN:  units (N_UNITS * 8) | tail (E)     OUT: counts (S + 2 uint64)
//        codec_host fpe fit WORD_BYTES IN OUT
//        codec_host fpe fit-weights WORD_BYTES IN OUT
//          the table fitted to symbol counts by one warp (codec_fpe_fit.h);
//          fit-weights: to the fit's weights (fpe.fit_weights), not scaled
//          IN:  counts (S + 2 int64)
//          OUT: device table (sizeof(BuddyFpeTable)) | serialized table
//               (BUDDY_FPE_SERIAL_BYTES)
//        codec_host fpe estimate WORD_BYTES IN OUT
//          the split layout's estimate of the code section's bits (fpe.code_section_estimate) for k = 1 .. E/32
//          IN:  device table    OUT: E/32 uint32
// CODEC: zvc | fpx | bpc | auto | fpe | auto2. The codecs with a table (fpe,
// auto2) take it first: for them IN starts with the device table the kernels
// get (sizeof(BuddyFpeTable) bytes, buddy.codecs.fpe_device.device_table), then the above.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <functional>
#include <type_traits>
#include <vector>

#include "buddy_ops.h"
#include "codec_auto2.h"
#include "codec_fpe_fit.h"

static const uint32_t E = BUDDY_ENTRY_BYTES;

// ---------------------------------------------------------------------------
// a warp of 32 fibers
// ---------------------------------------------------------------------------
struct Fibers {
  ucontext_t main;
  ucontext_t lane[32];
  std::vector<char> stack[32];
  uint32_t slot[2][32];  // posted values, double-buffered by collective parity
  uint32_t parity[32];   // collectives each lane has posted, mod 2
  bool done[32];
  std::function<void(uint32_t)> body;
};

static Fibers* g_fibers;

struct HostWarp {
  uint32_t l;
  uint32_t lane() const { return l; }
  // post v, let every other lane post, return the posted values' buffer
  const uint32_t* post(uint32_t v) const {
    Fibers& f = *g_fibers;
    const uint32_t p = f.parity[l] ^= 1u;
    f.slot[p][l] = v;
    const uint32_t next = (l + 1) & 31u;
    if (f.done[next]) {  // the lanes did not make the same collectives
      fprintf(stderr, "warp divergence: lane %u is at a collective that lane %u never reached\n", l, next);
      abort();
    }
    swapcontext(&f.lane[l], &f.lane[next]);
    return f.slot[p];
  }
  uint32_t ballot(bool pred) const {
    const uint32_t* s = post(pred ? 1u : 0u);
    uint32_t bits = 0;
    for (uint32_t i = 0; i < 32; ++i) bits |= (s[i] & 1u) << i;
    return bits;
  }
  uint32_t shfl(uint32_t v, uint32_t src) const { return post(v)[src & 31u]; }
  uint32_t shfl_xor(uint32_t v, uint32_t m) const { return post(v)[(l ^ m) & 31u]; }
  uint32_t shfl_up(uint32_t v, uint32_t d) const {
    const uint32_t* s = post(v);
    return l >= d ? s[l - d] : v;
  }
  void sync() const { post(0); }
};

static void lane_main(int l) {
  Fibers& f = *g_fibers;
  f.body((uint32_t)l);
  f.done[l] = true;
  swapcontext(&f.lane[l], &f.main);  // never resumed
  abort();
}

// Runs body(lane) on 32 fibers until all return (they must make the same collectives).
static void run_warp(const std::function<void(uint32_t)>& body) {
  Fibers* f = new Fibers();
  g_fibers = f;
  f->body = body;
  for (int l = 0; l < 32; ++l) {
    f->stack[l].resize(256 * 1024);
    f->parity[l] = 0;
    f->done[l] = false;
    getcontext(&f->lane[l]);
    f->lane[l].uc_stack.ss_sp = f->stack[l].data();
    f->lane[l].uc_stack.ss_size = f->stack[l].size();
    f->lane[l].uc_link = nullptr;
    makecontext(&f->lane[l], (void (*)())lane_main, 1, l);
  }
  // lanes hand over to each other at collectives; control returns here when
  // a lane finishes, and the next unfinished lane is resumed
  for (;;) {
    int next = -1;
    for (int l = 0; l < 32 && next < 0; ++l)
      if (!f->done[l]) next = l;
    if (next < 0) break;
    swapcontext(&f->main, &f->lane[next]);
  }
  g_fibers = nullptr;
  delete f;
}

// ---------------------------------------------------------------------------
// buffers of exactly E bytes followed by an inaccessible page
// ---------------------------------------------------------------------------
static uint8_t* guarded(size_t n) {
  const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  const size_t span = (n + page - 1) / page * page;
  uint8_t* base = (uint8_t*)mmap(nullptr, span + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED || mprotect(base + span, page, PROT_NONE) != 0) {
    perror("mmap");
    exit(2);
  }
  return base + span - n;  // 8-byte aligned: n is a multiple of 8
}

static std::vector<uint8_t> read_file(const char* path) {
  FILE* f = fopen(path, "rb");
  if (!f) {
    perror(path);
    exit(2);
  }
  std::vector<uint8_t> data;
  uint8_t buf[1 << 16];
  size_t got;
  while ((got = fread(buf, 1, sizeof buf, f)) > 0) data.insert(data.end(), buf, buf + got);
  fclose(f);
  return data;
}

// The zeros a codec's decoder needs after a coded payload of k sectors in a staging buffer of E bytes, as
// buddy_op_unpack writes them (Codec::DECODE_PAD); the rest stays as it is.
template <class Codec>
static void pad_after_payload(uint8_t* staged, uint32_t k) {
  if (k > 0 && k < BUDDY_SECTORS_PER_ENTRY) memset(staged + k * BUDDY_SECTOR_BYTES, 0, buddy_decode_pad<Codec>::value);
}

// ---------------------------------------------------------------------------
// the operations, per codec
// ---------------------------------------------------------------------------
template <class Codec>
static void encode(const Codec& codec, size_t n, const uint8_t* in, FILE* out) {
  uint8_t* entry = guarded(E);
  uint8_t* decoded = guarded(E);
  std::vector<uint8_t*> payload(BUDDY_SECTORS_PER_ENTRY + 1);  // payload[k]: exactly 32k bytes
  for (uint32_t k = 1; k <= BUDDY_SECTORS_PER_ENTRY; ++k) payload[k] = guarded(k * BUDDY_SECTOR_BYTES);
  uint8_t* staged = guarded(E);  // what a decoder sees: the payload, then garbage up to E
  std::vector<int32_t> ks(n), modes(n);
  std::vector<uint32_t> errs(n);
  std::vector<uint8_t> pay(n * E, 0), dec(n * E);

  run_warp([&](uint32_t l) {  // one warp; lane 0 moves data between collectives
    const HostWarp warp{l};
    for (size_t i = 0; i < n; ++i) {
      if (l == 0) memcpy(entry, in + i * E, E);
      warp.sync();
      uint32_t mode;
      const uint32_t k = buddy_entry_measure<Codec>(warp, codec, entry, &mode);
      if (l == 0 && k) memset(payload[k], 0xAB, k * BUDDY_SECTOR_BYTES);
      warp.sync();
      buddy_entry_encode<Codec>(warp, codec, entry, k, mode, payload[k]);
      warp.sync();
      if (l == 0) {
        memset(staged, 0xAB, E);
        if (k) memcpy(staged, payload[k], k * BUDDY_SECTOR_BYTES);
        pad_after_payload<Codec>(staged, k);
        memset(decoded, 0xAB, E);
      }
      warp.sync();
      const uint32_t err = buddy_entry_decode<Codec>(warp, codec, staged, k, mode, decoded);
      warp.sync();
      if (l == 0) {
        ks[i] = (int32_t)k;
        modes[i] = (int32_t)mode;
        errs[i] = err;
        if (k) memcpy(&pay[i * E], payload[k], k * BUDDY_SECTOR_BYTES);
        memcpy(&dec[i * E], decoded, E);
      }
      warp.sync();
    }
  });
  fwrite(ks.data(), 4, n, out);
  fwrite(modes.data(), 4, n, out);
  fwrite(pay.data(), 1, n * E, out);
  fwrite(dec.data(), 1, n * E, out);
  fwrite(errs.data(), 4, n, out);
}

template <class Codec>
static void decode(const Codec& codec, size_t n, const uint8_t* in, FILE* out) {
  const int32_t* ks = (const int32_t*)in;
  const int32_t* modes = ks + n;
  const uint8_t* payloads = (const uint8_t*)(modes + n);
  uint8_t* payload = guarded(E);
  uint8_t* decoded = guarded(E);
  std::vector<uint32_t> errs(n);
  std::vector<uint8_t> dec(n * E);
  run_warp([&](uint32_t l) {
    const HostWarp warp{l};
    for (size_t i = 0; i < n; ++i) {
      if (l == 0) {
        memcpy(payload, payloads + i * E, E);
        pad_after_payload<Codec>(payload, (uint32_t)ks[i]);
        memset(decoded, 0xAB, E);
      }
      warp.sync();
      const uint32_t err =
          buddy_entry_decode<Codec>(warp, codec, payload, (uint32_t)ks[i], (uint32_t)modes[i], decoded);
      warp.sync();
      if (l == 0) {
        errs[i] = err;
        memcpy(&dec[i * E], decoded, E);
      }
      warp.sync();
    }
  });
  fwrite(dec.data(), 1, n * E, out);
  fwrite(errs.data(), 4, n, out);
}

template <class Codec>
static void stream(const Codec& codec, size_t n, const uint8_t* in, FILE* out) {
  const uint32_t kmax = 2 * BUDDY_SECTORS_PER_ENTRY;
  uint8_t* entry = guarded(E);
  uint8_t* decoded = guarded(E);
  std::vector<uint8_t*> payload(kmax + 1);  // payload[k]: exactly 32k bytes (and the decoder's zeros), for both
  for (uint32_t k = 1; k <= kmax; ++k) payload[k] = guarded(k * BUDDY_SECTOR_BYTES + buddy_decode_pad<Codec>::value);
  std::vector<int32_t> ks(n), modes(n);
  std::vector<uint32_t> errs(n, 0);
  std::vector<uint8_t> pay(n * 2 * E, 0), dec(n * E, 0);

  run_warp([&](uint32_t l) {
    const HostWarp warp{l};
    for (size_t i = 0; i < n; ++i) {
      if (l == 0) memcpy(entry, in + i * E, E);
      warp.sync();
      uint32_t mode;
      const uint32_t k = codec.measure(warp, entry, &mode);
      const bool coded = k >= 1 && k <= kmax;
      if (l == 0 && coded) {
        memset(payload[k], 0xAB, k * BUDDY_SECTOR_BYTES);
        memset(payload[k] + k * BUDDY_SECTOR_BYTES, 0, buddy_decode_pad<Codec>::value);
        memset(decoded, 0xAB, E);
      }
      warp.sync();
      uint32_t err = 0;
      if (coded) {
        codec.encode(warp, entry, k, mode, payload[k]);
        warp.sync();
        err = codec.decode(warp, payload[k], k, mode, decoded);
        warp.sync();
      }
      if (l == 0) {
        ks[i] = (int32_t)k;
        modes[i] = (int32_t)mode;
        errs[i] = err;
        if (coded) {
          memcpy(&pay[i * 2 * E], payload[k], k * BUDDY_SECTOR_BYTES);
          memcpy(&dec[i * E], decoded, E);
        }
      }
      warp.sync();
    }
  });
  fwrite(ks.data(), 4, n, out);
  fwrite(modes.data(), 4, n, out);
  fwrite(pay.data(), 1, n * 2 * E, out);
  fwrite(dec.data(), 1, n * E, out);
  fwrite(errs.data(), 4, n, out);
}

// ---------------------------------------------------------------------------
// the kernels' per-entry work over whole tensors (buddy_ops.h)
// ---------------------------------------------------------------------------
struct Tensors {  // the sizes of one tensor-level call (see the usage)
  size_t n, n_full, s, m;
};

static const size_t META = BUDDY_META_BYTES;

// A guarded copy of `n` bytes of `in` (advanced past them).
static uint8_t* take(const uint8_t*& in, size_t n) {
  uint8_t* p = guarded(n);
  memcpy(p, in, n);
  in += n;
  return p;
}

template <class Codec>
static void tensor_measure(const Codec& codec, const Tensors& t, const uint8_t* in, FILE* out) {
  const uint8_t* data = take(in, t.n_full * E);
  const uint8_t* tail = take(in, E);
  buddy_meta_t* meta = (buddy_meta_t*)guarded(t.n * META);
  std::vector<uint64_t> histogram(BUDDY_SECTORS_PER_ENTRY + 1, 0);
  run_warp([&](uint32_t l) {
    const HostWarp warp{l};
    for (size_t i = 0; i < t.n; ++i) {
      const uint32_t k =
          buddy_measure_entry<Codec>(warp, codec, (long long)i, data, tail, (long long)t.n_full, meta);
      if (l == 0) ++histogram[k];
    }
  });
  fwrite(meta, META, t.n, out);
  fwrite(histogram.data(), 8, histogram.size(), out);
}

template <class Codec>
static void tensor_pack(const Codec& codec, const Tensors& t, const uint8_t* in, FILE* out) {
  const uint8_t* data = take(in, t.n_full * E);
  const uint8_t* tail = take(in, E);
  const buddy_meta_t* meta = (const buddy_meta_t*)take(in, t.n * META);
  const long long* ends = (const long long*)take(in, t.n * 8);
  const size_t m = t.n ? (size_t)ends[t.n - 1] : 0;
  uint8_t* slots = guarded(t.n * t.s * BUDDY_SECTOR_BYTES);
  uint8_t* overflow = guarded(m * BUDDY_SECTOR_BYTES);
  uint8_t* staging = guarded(E);
  memset(slots, 0xAB, t.n * t.s * BUDDY_SECTOR_BYTES);  // a byte left unwritten shows up
  memset(overflow, 0xAB, m * BUDDY_SECTOR_BYTES);
  run_warp([&](uint32_t l) {
    const HostWarp warp{l};
    for (size_t i = 0; i < t.n; ++i)
      buddy_pack_entry<Codec>(warp, codec, (long long)i, data, tail, (long long)t.n_full, meta, ends, (uint32_t)t.s,
                              slots, overflow, staging);
  });
  fwrite(slots, 1, t.n * t.s * BUDDY_SECTOR_BYTES, out);
  fwrite(overflow, 1, m * BUDDY_SECTOR_BYTES, out);
}

template <class Codec>
static void tensor_unpack(const Codec& codec, const Tensors& t, const uint8_t* in, FILE* out) {
  const buddy_meta_t* meta = (const buddy_meta_t*)take(in, t.n * META);
  const long long* ends = (const long long*)take(in, t.n * 8);
  const uint8_t* slots = take(in, t.n * t.s * BUDDY_SECTOR_BYTES);
  const uint8_t* overflow = take(in, t.m * BUDDY_SECTOR_BYTES);
  uint8_t* entries = guarded(t.n * E);
  uint8_t* staging = guarded(buddy_unpack_staging_entries<Codec>() * E);
  memset(entries, 0xAB, t.n * E);
  uint32_t err = 0;
  run_warp([&](uint32_t l) {
    const HostWarp warp{l};
    uint32_t mine = 0;
    for (size_t i = 0; i < t.n; ++i)
      mine |= buddy_unpack_entry<Codec>(warp, codec, (long long)i, (long long)t.n, meta, ends, (uint32_t)t.s, slots,
                                        overflow, (long long)t.m, staging, entries);
    if (l == 0) err = mine;
  });
  fwrite(entries, 1, t.n * E, out);
  fwrite(&err, 4, 1, out);
}

// ---------------------------------------------------------------------------
// the command line: codec name, word size and table -> the codec object
// ---------------------------------------------------------------------------
// The codecs `stream` runs (the tests use it for these; fewer instantiations compile faster).
template <class Codec>
struct streamed {
  static constexpr bool value = false;
};
template <int WB>
struct streamed<BuddyBpc<WB>> {
  static constexpr bool value = true;
};
template <int WB>
struct streamed<BuddyFpe<WB>> {
  static constexpr bool value = true;
};

// Calls op(codec) with the codec object of this name and word size (built
// from `table` for a codec that has one); 2 for an unknown name or size.
template <int WB, class Op>
static int with_codec_of(const char* name, const uint8_t* table, Op op) {
  if (strcmp(name, "zvc") == 0)
    op(buddy_codec<BuddyZvc<WB>>(table));
  else if (strcmp(name, "fpx") == 0)
    op(buddy_codec<BuddyFpx<WB>>(table));
  else if (strcmp(name, "bpc") == 0)
    op(buddy_codec<BuddyBpc<WB>>(table));
  else if (strcmp(name, "auto") == 0)
    op(buddy_codec<BuddyAuto<WB>>(table));
  else if (strcmp(name, "fpe") == 0)
    op(buddy_codec<BuddyFpe<WB>>(table));
  else if (strcmp(name, "auto2") == 0)
    op(buddy_codec<BuddyAuto2<WB>>(table));
  else {
    fprintf(stderr, "unknown codec %s\n", name);
    return 2;
  }
  return 0;
}

template <class Op>
static int with_codec(const char* name, int word, const uint8_t* table, Op op) {
  switch (word) {
    case 1: return with_codec_of<1>(name, table, op);
    case 2: return with_codec_of<2>(name, table, op);
    case 4: return with_codec_of<4>(name, table, op);
    case 8: return with_codec_of<8>(name, table, op);
    default: fprintf(stderr, "word size must be 1, 2, 4 or 8, got %d\n", word); return 2;
  }
}

// IN of a command: for a codec with a table (fpe, auto2) a guarded copy of
// the device table comes off its front (see the usage).
struct Input {
  std::vector<uint8_t> bytes;
  const uint8_t* table = nullptr;
  size_t skip = 0;  // bytes of the table
  const uint8_t* data() const { return bytes.data() + skip; }
  size_t size() const { return bytes.size() - skip; }
};

static Input read_input(const char* codec, const char* path) {
  Input in;
  in.bytes = read_file(path);
  if (strcmp(codec, "fpe") == 0 || strcmp(codec, "auto2") == 0) {
    if (in.bytes.size() < sizeof(BuddyFpeTable)) {
      fprintf(stderr, "%s: %zu bytes, too few for the codec's table\n", path, in.bytes.size());
      exit(2);
    }
    const uint8_t* front = in.bytes.data();
    in.table = take(front, sizeof(BuddyFpeTable));
    in.skip = sizeof(BuddyFpeTable);
  }
  return in;
}

// The tensor-level operations: measure | pack | unpack (see the usage).
static int tensor_main(int argc, char** argv) {
  const char* op = argv[2];
  const bool unpack = strcmp(op, "unpack") == 0;
  const int want = strcmp(op, "measure") == 0 ? 8 : 9;
  if (argc != want) {
    fprintf(stderr, "%s: wrong number of arguments (see the usage at the top of codec_host.cpp)\n", op);
    return 2;
  }
  Tensors t{};
  t.n = (size_t)strtoull(argv[4], nullptr, 10);
  if (unpack) {
    t.s = (size_t)strtoull(argv[5], nullptr, 10);
    t.m = (size_t)strtoull(argv[6], nullptr, 10);
  } else {
    t.n_full = (size_t)strtoull(argv[5], nullptr, 10);
    if (want == 9) t.s = (size_t)strtoull(argv[6], nullptr, 10);
  }
  const Input in = read_input(argv[1], argv[want - 2]);
  FILE* out = fopen(argv[want - 1], "wb");
  if (!out) {
    perror(argv[want - 1]);
    return 2;
  }
  const int rc = with_codec(argv[1], atoi(argv[3]), in.table, [&](const auto& codec) {
    if (strcmp(op, "measure") == 0)
      tensor_measure(codec, t, in.data(), out);
    else if (strcmp(op, "pack") == 0)
      tensor_pack(codec, t, in.data(), out);
    else
      tensor_unpack(codec, t, in.data(), out);
  });
  return fclose(out) == 0 ? rc : 2;
}

// ---------------------------------------------------------------------------
// fpe's table on the device: count | fit (see the usage)
// ---------------------------------------------------------------------------
static uint32_t fpe_symbols(int word) {  // S + 2 of a fitted table (format 2), 0 for a word size fpe does not know
  return word == 1 ? 258u : word == 2 || word == 4 || word == 8 ? 4098u : 0u;
}

template <int WB>
static void count_words(const uint8_t* units, size_t n_units, const uint8_t* tail, size_t tail_words,
                        uint32_t* counts) {
  // as the count kernel: 16 bytes a lane, the warp's counts aggregated; the odd 8 bytes a word at a time
  const size_t n16 = n_units / 2;
  run_warp([&](uint32_t l) {
    const HostWarp warp{l};
    for (size_t u0 = 0; u0 < n16; u0 += BUDDY_WARP_SIZE) {
      const size_t u = u0 + l;
      const buddy_u128 zero = {0, 0};
      buddy_fpe_count_unit16<WB>(warp, u < n16 ? buddy_load<buddy_u128>(units + 16 * u) : zero, u < n16, counts);
    }
  });
  for (size_t w = 0; w < (n_units % 2) * (8 / WB); ++w) buddy_fpe_count_word<WB>(units + 16 * n16 + WB * w, counts);
  for (size_t w = 0; w < tail_words; ++w) buddy_fpe_count_word<WB>(tail + WB * w, counts);
}

static int table_main(int argc, char** argv) {
  const bool count = strcmp(argv[2], "count") == 0, weighted = strcmp(argv[2], "fit-weights") == 0;
  if (strcmp(argv[1], "fpe") != 0 || argc != (count ? 8 : 6)) {
    fprintf(stderr, "%s: usage at the top of codec_host.cpp (codec fpe only)\n", argv[2]);
    return 2;
  }
  const int word = atoi(argv[3]);
  const uint32_t symbols = fpe_symbols(word);
  if (!symbols) {
    fprintf(stderr, "word size %d: fpe words are 1, 2, 4 or 8 bytes\n", word);
    return 2;
  }
  const std::vector<uint8_t> in = read_file(argv[argc - 2]);
  FILE* out = fopen(argv[argc - 1], "wb");
  if (!out) {
    perror(argv[argc - 1]);
    return 2;
  }
  if (count) {
    const size_t n_units = (size_t)strtoull(argv[4], nullptr, 10), tail_words = (size_t)strtoull(argv[5], nullptr, 10);
    if (in.size() != n_units * 8 + E || tail_words * word > E) {
      fprintf(stderr, "count: %zu input bytes for %zu units and %zu tail words\n", in.size(), n_units, tail_words);
      return 2;
    }
    const uint8_t* p = in.data();
    uint8_t* units = take(p, n_units * 8);
    uint8_t* tail = take(p, E);
    std::vector<uint32_t> counts(symbols, 0);
    switch (word) {
      case 1: count_words<1>(units, n_units, tail, tail_words, counts.data()); break;
      case 2: count_words<2>(units, n_units, tail, tail_words, counts.data()); break;
      case 4: count_words<4>(units, n_units, tail, tail_words, counts.data()); break;
      default: count_words<8>(units, n_units, tail, tail_words, counts.data()); break;
    }
    std::vector<uint64_t> wide(counts.begin(), counts.end());
    fwrite(wide.data(), 8, wide.size(), out);
    return fclose(out) == 0 ? 0 : 2;
  }
  if (in.size() != symbols * 8u) {
    fprintf(stderr, "fit: %zu input bytes, expected %u counts\n", in.size(), symbols);
    return 2;
  }
  // counts end at a guard page; every output is pre-filled with 0xAB
  int64_t* counts = reinterpret_cast<int64_t*>(guarded(symbols * 8u));
  memcpy(counts, in.data(), in.size());
  BuddyFpeFitWork* work = reinterpret_cast<BuddyFpeFitWork*>(guarded(sizeof(BuddyFpeFitWork)));
  uint8_t* table = guarded(sizeof(BuddyFpeTable));
  uint8_t* serial = guarded(BUDDY_FPE_SERIAL_BYTES);
  memset(work, 0xAB, sizeof(BuddyFpeFitWork));
  memset(table, 0xAB, sizeof(BuddyFpeTable));
  memset(serial, 0xAB, BUDDY_FPE_SERIAL_BYTES);
  run_warp([&](uint32_t l) {
    buddy_fpe_fit(HostWarp{l}, counts, (uint32_t)word, weighted, work, reinterpret_cast<BuddyFpeTable*>(table),
                  serial);
  });
  fwrite(table, 1, sizeof(BuddyFpeTable), out);
  fwrite(serial, 1, BUDDY_FPE_SERIAL_BYTES, out);
  return fclose(out) == 0 ? 0 : 2;
}

template <int WB>
static void write_estimates(const uint8_t* table, FILE* out) {
  const BuddyFpe<WB> codec = buddy_codec<BuddyFpe<WB>>(table);
  for (uint32_t k = 1; k <= E / BUDDY_SECTOR_BYTES; ++k) {
    const uint32_t c = codec.estimate(k);
    fwrite(&c, 4, 1, out);
  }
}

static int estimate_main(int argc, char** argv) {
  if (argc != 6 || strcmp(argv[1], "fpe") != 0) {
    fprintf(stderr, "estimate: usage at the top of codec_host.cpp (codec fpe only)\n");
    return 2;
  }
  const Input in = read_input("fpe", argv[4]);
  if (in.size()) {
    fprintf(stderr, "estimate: %zu bytes after the table, expected none\n", in.size());
    return 2;
  }
  FILE* out = fopen(argv[5], "wb");
  if (!out) {
    perror(argv[5]);
    return 2;
  }
  switch (atoi(argv[3])) {
    case 1: write_estimates<1>(in.table, out); break;
    case 2: write_estimates<2>(in.table, out); break;
    case 4: write_estimates<4>(in.table, out); break;
    case 8: write_estimates<8>(in.table, out); break;
    default: fprintf(stderr, "word size must be 1, 2, 4 or 8\n"); fclose(out); return 2;
  }
  return fclose(out) == 0 ? 0 : 2;
}

int main(int argc, char** argv) {
  if (argc > 2 && strcmp(argv[2], "estimate") == 0) return estimate_main(argc, argv);
  if (argc > 2 && (strcmp(argv[2], "count") == 0 || strcmp(argv[2], "fit") == 0 || strcmp(argv[2], "fit-weights") == 0))
    return table_main(argc, argv);
  if (argc > 2 && (strcmp(argv[2], "measure") == 0 || strcmp(argv[2], "pack") == 0 || strcmp(argv[2], "unpack") == 0))
    return tensor_main(argc, argv);
  if (argc != 7 ||
      (strcmp(argv[2], "encode") != 0 && strcmp(argv[2], "decode") != 0 && strcmp(argv[2], "stream") != 0)) {
    fprintf(stderr, "usage: %s CODEC encode|decode|stream WORD_BYTES N IN OUT\n", argv[0]);
    return 2;
  }
  const char* op = argv[2];
  const size_t n = (size_t)strtoull(argv[4], nullptr, 10);
  const Input in = read_input(argv[1], argv[5]);
  const size_t expected = strcmp(op, "decode") == 0 ? n * (8 + E) : n * E;
  if (in.size() != expected) {
    fprintf(stderr, "input holds %zu bytes, expected %zu\n", in.size(), expected);
    return 2;
  }
  FILE* out = fopen(argv[6], "wb");
  if (!out) {
    perror(argv[6]);
    return 2;
  }
  bool ran = true;
  const int rc = with_codec(argv[1], atoi(argv[3]), in.table, [&](const auto& codec) {
    if (strcmp(op, "encode") == 0)
      encode(codec, n, in.data(), out);
    else if (strcmp(op, "decode") == 0)
      decode(codec, n, in.data(), out);
    else if constexpr (streamed<std::decay_t<decltype(codec)>>::value)
      stream(codec, n, in.data(), out);
    else
      ran = false;
  });
  if (!ran) fprintf(stderr, "stream: only for bpc and fpe\n");
  return fclose(out) == 0 && ran ? rc : 2;
}
