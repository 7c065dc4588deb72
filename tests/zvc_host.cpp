// Host harness for csrc/zvc_core.h (tests/test_cuda_core.py builds it with g++
// and the -D defines of buddy.spec.c_defines(E)).
//
// Runs both forms of the per-entry logic on the CPU:
//   * the one-thread functions (buddy_zvc_*_entry);
//   * the warp functions (buddy_zvc_warp_*), with the 32 lanes of an emulated
//     warp as cooperative fibers (ucontext): every collective (ballot,
//     shuffles) posts the lane's value and switches to the next lane, so a
//     lane reads the others' values only after all 32 have posted them.
// Each entry is processed in its own buffers that end right before an
// inaccessible page, so a read or write past an entry's E bytes crashes the
// program instead of passing unnoticed. Outputs are pre-filled with 0xAB so a
// byte the code forgets to write shows up as a difference.
//
// usage: zvc_host encode WORD_BYTES N IN OUT
//          IN:  N * E bytes of entries
//          OUT: k (N int32, one thread) | payload (N * E, one thread) |
//               k (N int32, warp size pass) | k (N int32, warp encode) |
//               payload (N * E, warp) | decoded (N * E, one thread, of the
//               one-thread payload) | decoded (N * E, warp, of the warp
//               payload) | errors (N uint32, one thread) | errors (N uint32, warp)
//        zvc_host decode WORD_BYTES N IN OUT
//          IN:  k (N int32) | mode (N int32) | payload (N * E)
//          OUT: decoded (N * E, one thread) | decoded (N * E, warp) |
//               errors (N uint32, one thread) | errors (N uint32, warp)
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <functional>
#include <vector>

#include "zvc_core.h"

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
  return base + span - n;  // 8-byte aligned: n is a multiple of 32
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

// ---------------------------------------------------------------------------
// the operations, per word size
// ---------------------------------------------------------------------------
template <int WB>
static void encode(size_t n, const uint8_t* in, FILE* out) {
  uint8_t* entry = guarded(E);
  uint8_t* payload = guarded(E);
  uint8_t* decoded = guarded(E);
  std::vector<int32_t> k1(n), kw_sizes(n), kw(n);
  std::vector<uint32_t> err1(n), errw(n);
  std::vector<uint8_t> pay1(n * E), payw(n * E), dec1(n * E), decw(n * E);

  for (size_t i = 0; i < n; ++i) {  // one thread
    memcpy(entry, in + i * E, E);
    memset(payload, 0xAB, E);
    k1[i] = (int32_t)buddy_zvc_encode_entry<WB>(entry, payload);
    memcpy(&pay1[i * E], payload, E);
    memset(decoded, 0xAB, E);
    err1[i] = buddy_zvc_decode_entry<WB>(payload, (uint32_t)k1[i], 0u, decoded);
    memcpy(&dec1[i * E], decoded, E);
  }

  run_warp([&](uint32_t l) {  // one warp; lane 0 moves data between collectives
    const HostWarp warp{l};
    for (size_t i = 0; i < n; ++i) {
      if (l == 0) {
        memcpy(entry, in + i * E, E);
        memset(payload, 0xAB, E);
        memset(decoded, 0xAB, E);
      }
      warp.sync();
      const uint32_t nnz = buddy_zvc_warp_count<WB>(warp, entry);
      const uint32_t k = buddy_zvc_warp_encode<WB>(warp, entry, payload);
      warp.sync();
      const uint32_t err = buddy_zvc_warp_decode<WB>(warp, payload, k, 0u, decoded);
      warp.sync();
      if (l == 0) {
        kw_sizes[i] = (int32_t)buddy_zvc_sectors<WB>(nnz);
        kw[i] = (int32_t)k;
        errw[i] = err;
        memcpy(&payw[i * E], payload, E);
        memcpy(&decw[i * E], decoded, E);
      }
      warp.sync();
    }
  });

  fwrite(k1.data(), 4, n, out);
  fwrite(pay1.data(), 1, n * E, out);
  fwrite(kw_sizes.data(), 4, n, out);
  fwrite(kw.data(), 4, n, out);
  fwrite(payw.data(), 1, n * E, out);
  fwrite(dec1.data(), 1, n * E, out);
  fwrite(decw.data(), 1, n * E, out);
  fwrite(err1.data(), 4, n, out);
  fwrite(errw.data(), 4, n, out);
}

template <int WB>
static void decode(size_t n, const uint8_t* in, FILE* out) {
  const int32_t* ks = (const int32_t*)in;
  const int32_t* modes = ks + n;
  const uint8_t* payloads = (const uint8_t*)(modes + n);
  uint8_t* payload = guarded(E);
  uint8_t* decoded = guarded(E);
  std::vector<uint32_t> err1(n), errw(n);
  std::vector<uint8_t> dec1(n * E), decw(n * E);

  for (size_t i = 0; i < n; ++i) {
    memcpy(payload, payloads + i * E, E);
    memset(decoded, 0xAB, E);
    err1[i] = buddy_zvc_decode_entry<WB>(payload, (uint32_t)ks[i], (uint32_t)modes[i], decoded);
    memcpy(&dec1[i * E], decoded, E);
  }
  run_warp([&](uint32_t l) {
    const HostWarp warp{l};
    for (size_t i = 0; i < n; ++i) {
      if (l == 0) {
        memcpy(payload, payloads + i * E, E);
        memset(decoded, 0xAB, E);
      }
      warp.sync();
      const uint32_t err = buddy_zvc_warp_decode<WB>(warp, payload, (uint32_t)ks[i], (uint32_t)modes[i], decoded);
      warp.sync();
      if (l == 0) {
        errw[i] = err;
        memcpy(&decw[i * E], decoded, E);
      }
      warp.sync();
    }
  });
  fwrite(dec1.data(), 1, n * E, out);
  fwrite(decw.data(), 1, n * E, out);
  fwrite(err1.data(), 4, n, out);
  fwrite(errw.data(), 4, n, out);
}

template <int WB>
static void run(const char* op, size_t n, const uint8_t* in, FILE* out) {
  if (strcmp(op, "encode") == 0)
    encode<WB>(n, in, out);
  else
    decode<WB>(n, in, out);
}

int main(int argc, char** argv) {
  if (argc != 6 || (strcmp(argv[1], "encode") != 0 && strcmp(argv[1], "decode") != 0)) {
    fprintf(stderr, "usage: %s encode|decode WORD_BYTES N IN OUT\n", argv[0]);
    return 2;
  }
  const int word = atoi(argv[2]);
  const size_t n = (size_t)strtoull(argv[3], nullptr, 10);
  const std::vector<uint8_t> in = read_file(argv[4]);
  const size_t expected = strcmp(argv[1], "encode") == 0 ? n * E : n * (8 + E);
  if (in.size() != expected) {
    fprintf(stderr, "input holds %zu bytes, expected %zu\n", in.size(), expected);
    return 2;
  }
  FILE* out = fopen(argv[5], "wb");
  if (!out) {
    perror(argv[5]);
    return 2;
  }
  switch (word) {
    case 1: run<1>(argv[1], n, in.data(), out); break;
    case 2: run<2>(argv[1], n, in.data(), out); break;
    case 4: run<4>(argv[1], n, in.data(), out); break;
    case 8: run<8>(argv[1], n, in.data(), out); break;
    default: fprintf(stderr, "word size must be 1, 2, 4 or 8, got %d\n", word); return 2;
  }
  return fclose(out) == 0 ? 0 : 2;
}
