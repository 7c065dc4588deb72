// The block emulator: runs a kernel of csrc/buddy_kernels.cu (compiled for the
// host through cuda_shim.h, kernels.cpp) over a grid, every thread of a block
// a fiber, and is the driver tests/emulator.py calls.
//
// Scheduling. The blocks of a launch run one after another, in a random
// order; inside a block a seeded random scheduler picks which runnable fiber
// runs next, and a fiber runs until it reaches a synchronisation point:
//   __syncthreads    it waits until every thread of the block is there
//   __syncwarp, a ballot, a shuffle or a match
//                    it waits until the 32 lanes of its warp are at one; the
//                    values are exchanged once all have arrived
// Lanes at different collectives, a barrier some threads never reach, a
// thread that exits while others wait for it: reported with the threads'
// ids and where each waits, never a hang.
//
// Memory. Each launch argument is a buffer of exactly its size (ASan build:
// from the sanitizer's allocator, every byte past it poisoned; otherwise it
// ends at an inaccessible page), 16-byte aligned like the loader's. Outputs
// start as garbage; the static __shared__ arrays and the dynamic shared buffer
// (exactly the launch's bytes) are refilled with garbage before each block.
//
// Races (TSan build). Each fiber is a TSan fiber, switched to without
// synchronisation; the only happens-before edges between threads are the
// ones CUDA guarantees: __syncthreads among the block's threads, __syncwarp
// among the warp's lanes (each participant releases a per-barrier object on
// arrival and acquires it on departure). Ballots and shuffles exchange values
// without ordering memory, and atomics are relaxed (cuda_shim.h). So a read
// of shared or global memory another thread wrote since their last common
// barrier, or a write over it, is reported with both stacks. Blocks are
// ordered (the scheduler releases each after the previous one), so races
// between blocks are not looked for.
//
// usage: emulator KERNEL GRID BLOCK SHARED SEED SCHEDULES IN OUT ARG...
//        emulator --serve      the same launches, one per line of standard
//                              input; "ok" on standard output after each
//   ARG   in:N | out:N | inout:N | scratch:N
//                                 a buffer of N bytes (N = 0: a null pointer);
//                                 out and scratch buffers start as garbage
//         i32:V | i64:V           an integer argument
//   IN    the in and inout buffers' bytes, in argument order
//   OUT   the out and inout buffers' bytes after the launch, in argument order
// Runs the launch SCHEDULES times, schedule s with the random stream of
// SEED + s (block order, thread order, garbage), each on fresh buffers, and
// fails unless every schedule writes the same bytes and leaves the in
// buffers as they were. Any failure ends the process: exit status 2 (usage),
// 3 (schedules disagree or an input changed), 4 (deadlock, divergence, an
// unsupported mask), or the sanitizer's status after its report.
#include "runtime.h"

#include "fiber.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#if defined(BUDDY_EMU_TSAN)
#include <sanitizer/tsan_interface.h>
#endif
#if defined(BUDDY_EMU_TSAN) || defined(BUDDY_EMU_ASAN)
#include <sanitizer/common_interface_defs.h>
#endif

// the static __shared__ arrays of the kernels (cuda_shim.h): the linker marks the section's bounds
extern "C" char __start_buddy_emu_shared[] __attribute__((weak));
extern "C" char __stop_buddy_emu_shared[] __attribute__((weak));

namespace {

const uint32_t WARP = 32;
const unsigned FULL_MASK = 0xffffffffu;
const size_t STACK_BYTES = 1u << 20;  // per fiber (reserved, touched as used)
const uint32_t MAX_THREADS = 1024;     // of a block

[[noreturn]] void fail(int status, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("buddy emulator: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  fflush(stderr);
  _exit(status);
}

// ---------------------------------------------------------------------------
// fibers
// ---------------------------------------------------------------------------
// the fibers (csrc/host/fiber.h)
typedef BuddyFiberContext Context;
void make_context(Context* c, char* stack, size_t size, void (*entry)(int), int arg) {
  buddy_fiber_make(c, stack, size, entry, arg);
}
void switch_context(Context* from, Context* to) { buddy_fiber_switch_to(from, to); }

enum State { RUNNABLE, AT_BARRIER, AT_WARP, BLOCK_DONE };

struct Fiber {
  Context ctx;
  char* stack = nullptr;
  uint32_t tid = 0;
  State state = RUNNABLE;
  // where it waits, and a collective's operands and result
  int kind = 0;
  unsigned mask = 0;
  uint64_t value = 0, result = 0;
  int arg = 0;
  uint32_t generation = 0;  // of the barrier it waits at
  const char* file = nullptr;
  int line = 0;
  void* pc = nullptr;
#if defined(BUDDY_EMU_TSAN)
  void* tsan = nullptr;
#endif
#if defined(BUDDY_EMU_ASAN)
  void* fake_stack = nullptr;
#endif
};

struct Scheduler {
  Context main_ctx;
#if defined(BUDDY_EMU_TSAN)
  void* main_tsan = nullptr;
#endif
#if defined(BUDDY_EMU_ASAN)
  void* main_fake_stack = nullptr;
  const void* main_bottom = nullptr;
  size_t main_size = 0;
#endif
  std::vector<Fiber*> fibers;  // thread t of the block: fibers[t]
  Fiber* current = nullptr;
  const BuddyEmuKernel* kernel = nullptr;
  const BuddyEmuArg* args = nullptr;
  BuddyEmuDim grid{1, 1, 1}, block{1, 1, 1}, block_idx{0, 0, 0};
  uint8_t* dynamic_shared = nullptr;
  // barrier state: arrivals at the block's barrier and at each warp's collective, generations
  uint32_t barrier_arrived = 0, barrier_generation = 0;
  uint32_t warp_arrived[MAX_THREADS / WARP] = {}, warp_generation[MAX_THREADS / WARP] = {};
};

Scheduler S;

// happens-before objects: one per barrier generation parity (a thread cannot pass
// generation g + 1 before every thread has left generation g)
char block_barrier_sync[2];
char warp_sync[2 * MAX_THREADS / WARP];  // [warp * 2 + parity]
char block_start_sync, block_end_sync;

void hb_release(void* addr) {
#if defined(BUDDY_EMU_TSAN)
  __tsan_release(addr);
#else
  (void)addr;
#endif
}

void hb_acquire(void* addr) {
#if defined(BUDDY_EMU_TSAN)
  __tsan_acquire(addr);
#else
  (void)addr;
#endif
}

// Control from the scheduler to fiber f, until f yields.
void switch_to(Fiber* f) {
  S.current = f;
#if defined(BUDDY_EMU_TSAN)
  __tsan_switch_to_fiber(f->tsan, __tsan_switch_to_fiber_no_sync);
#endif
#if defined(BUDDY_EMU_ASAN)
  __sanitizer_start_switch_fiber(&S.main_fake_stack, f->stack, STACK_BYTES);
#endif
  switch_context(&S.main_ctx, &f->ctx);
#if defined(BUDDY_EMU_ASAN)
  __sanitizer_finish_switch_fiber(S.main_fake_stack, nullptr, nullptr);
#endif
  S.current = nullptr;
}

// Control from the running fiber back to the scheduler.
void yield() {
  Fiber* f = S.current;
#if defined(BUDDY_EMU_TSAN)
  __tsan_switch_to_fiber(S.main_tsan, __tsan_switch_to_fiber_no_sync);
#endif
#if defined(BUDDY_EMU_ASAN)
  __sanitizer_start_switch_fiber(&f->fake_stack, S.main_bottom, S.main_size);
#endif
  switch_context(&f->ctx, &S.main_ctx);
#if defined(BUDDY_EMU_ASAN)
  __sanitizer_finish_switch_fiber(f->fake_stack, &S.main_bottom, &S.main_size);
#endif
}

// A fiber's life: thread `tid` of every block the scheduler runs it in.
void fiber_main(int tid) {
#if defined(BUDDY_EMU_ASAN)
  __sanitizer_finish_switch_fiber(nullptr, &S.main_bottom, &S.main_size);
#endif
  for (;;) {
    Fiber* f = S.fibers[(size_t)tid];
    hb_acquire(&block_start_sync);  // the launch's inputs and this block's garbage, written by the scheduler
    S.kernel->run(S.args);
    hb_release(&block_end_sync);  // everything the block wrote, before the scheduler reads it
    f->state = BLOCK_DONE;
    yield();
  }
}

Fiber* make_fiber(uint32_t tid) {
  Fiber* f = new Fiber();
  f->tid = tid;
  // the stack, with an inaccessible page below it (stacks grow down)
  const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  char* base = (char*)mmap(nullptr, STACK_BYTES + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                           -1, 0);
  if (base == MAP_FAILED || mprotect(base, page, PROT_NONE) != 0) fail(2, "cannot map a fiber stack: %s", strerror(errno));
  f->stack = base + page;
  make_context(&f->ctx, f->stack, STACK_BYTES, fiber_main, (int)tid);
#if defined(BUDDY_EMU_TSAN)
  f->tsan = __tsan_create_fiber(0);
  char name[32];
  snprintf(name, sizeof name, "thread %u", tid);
  __tsan_set_fiber_name(f->tsan, name);
#endif
  return f;
}

// ---------------------------------------------------------------------------
// reports: where the threads of a stuck block wait
// ---------------------------------------------------------------------------
std::string where(const Fiber* f) {
  static const char* names[] = {"__syncwarp", "__ballot_sync", "__shfl_sync", "__shfl_up_sync", "__shfl_down_sync",
                                "__shfl_xor_sync", "__match_any_sync"};
  std::string out;
  if (f->state == BLOCK_DONE) return "returned from the kernel";
  if (f->state == RUNNABLE) return "running (between synchronisation points)";
  out = f->state == AT_BARRIER ? "__syncthreads" : names[f->kind];
  out += " (" + std::string(f->file) + ":" + std::to_string(f->line) + ")";
#if defined(BUDDY_EMU_TSAN) || defined(BUDDY_EMU_ASAN)
  // the call chain inlined at the call: which codec function called the collective
  char buf[4096] = {0};
  __sanitizer_symbolize_pc((char*)f->pc - 1, "%F %S", buf, sizeof buf);
  for (const char* frame = buf; *frame && frame < buf + sizeof buf; frame += strlen(frame) + 1)
    if (!strstr(frame, "cuda_shim.h")) out += std::string("\n      ") + frame;  // the kernels' frames
#endif
  return out;
}

// Threads by where they wait: "threads 0-31 (warp 0): __shfl_sync (...)".
[[noreturn]] void report_stuck(const char* what) {
  std::string text = std::string(what) + " in block " + std::to_string(S.block_idx.x) + "; where its threads are:\n";
  std::vector<bool> told(S.fibers.size(), false);
  for (size_t i = 0; i < S.fibers.size(); ++i) {
    if (told[i]) continue;
    const std::string here = where(S.fibers[i]);
    std::string ids;
    for (size_t j = i; j < S.fibers.size(); ++j) {
      if (told[j] || where(S.fibers[j]) != here) continue;
      told[j] = true;
      size_t end = j;
      while (end + 1 < S.fibers.size() && !told[end + 1] && where(S.fibers[end + 1]) == here) told[++end] = true;
      ids += (ids.empty() ? "" : ", ") + std::to_string(j) + (end > j ? "-" + std::to_string(end) : "");
      j = end;
    }
    text += "  threads " + ids + ": " + here + "\n";
  }
  fail(4, "%s", text.c_str());
}

// ---------------------------------------------------------------------------
// the collectives, completed by the scheduler once every participant is there
// ---------------------------------------------------------------------------
void complete_warp(uint32_t w) {
  Fiber** lanes = &S.fibers[(size_t)w * WARP];
  for (uint32_t l = 1; l < WARP; ++l)
    if (lanes[l]->kind != lanes[0]->kind) report_stuck("lanes of a warp at different collectives");
  uint32_t ballot = 0;
  for (uint32_t l = 0; l < WARP; ++l) ballot |= (uint32_t)(lanes[l]->value != 0) << l;
  for (uint32_t l = 0; l < WARP; ++l) {
    Fiber* f = lanes[l];
    const uint32_t a = (uint32_t)f->arg;
    uint32_t src = l;
    switch (f->kind) {
      case BUDDY_EMU_BALLOT: f->result = ballot; break;
      case BUDDY_EMU_MATCH_ANY:
        f->result = 0;
        for (uint32_t m = 0; m < WARP; ++m) f->result |= (uint64_t)(lanes[m]->value == f->value) << m;
        break;
      case BUDDY_EMU_SHFL: src = a % WARP; break;
      case BUDDY_EMU_SHFL_UP: src = l >= a ? l - a : l; break;
      case BUDDY_EMU_SHFL_DOWN: src = l + a < WARP ? l + a : l; break;
      case BUDDY_EMU_SHFL_XOR: src = (l ^ a) < WARP ? l ^ a : l; break;
      default: break;
    }
    if (f->kind != BUDDY_EMU_BALLOT && f->kind != BUDDY_EMU_SYNCWARP && f->kind != BUDDY_EMU_MATCH_ANY)
      f->result = lanes[src]->value;
    f->state = RUNNABLE;
  }
  S.warp_arrived[w] = 0;
  ++S.warp_generation[w];
}

// ---------------------------------------------------------------------------
// one block, one launch
// ---------------------------------------------------------------------------
void garbage(uint8_t* p, size_t n, std::mt19937_64& rng) {
  for (size_t i = 0; i < n; i += 8) {
    const uint64_t v = rng();
    memcpy(p + i, &v, n - i < 8 ? n - i : 8);
  }
}

// The static __shared__ arrays; byte by byte: in the ASan build the section holds redzones between them
__attribute__((no_sanitize_address)) void refill_static_shared(std::mt19937_64& rng) {
  if (!__start_buddy_emu_shared) return;
  for (char* p = __start_buddy_emu_shared; p < __stop_buddy_emu_shared; ++p) *(volatile char*)p = (char)rng();
}

void run_block(std::mt19937_64& rng, size_t shared_bytes) {
  refill_static_shared(rng);
  garbage(S.dynamic_shared, shared_bytes, rng);
  hb_release(&block_start_sync);
  const uint32_t threads = S.block.x;
  std::vector<Fiber*> runnable(S.fibers.begin(), S.fibers.begin() + threads);
  for (Fiber* f : runnable) f->state = RUNNABLE;
  S.barrier_arrived = 0;
  std::fill(S.warp_arrived, S.warp_arrived + MAX_THREADS / WARP, 0u);
  uint32_t done = 0;
  while (done < threads) {
    if (runnable.empty()) report_stuck(done ? "threads returned while others wait for them" : "deadlock");
    const size_t pick = (size_t)(rng() % runnable.size());
    Fiber* f = runnable[pick];
    runnable[pick] = runnable.back();
    runnable.pop_back();
    switch_to(f);
    if (f->state == BLOCK_DONE) {
      ++done;
    } else if (f->state == AT_BARRIER) {
      if (++S.barrier_arrived == threads) {
        for (uint32_t t = 0; t < threads; ++t) {
          S.fibers[t]->state = RUNNABLE;
          runnable.push_back(S.fibers[t]);
        }
        S.barrier_arrived = 0;
        ++S.barrier_generation;
      }
    } else if (f->state == AT_WARP) {
      const uint32_t w = f->tid / WARP;
      if (++S.warp_arrived[w] == WARP) {
        complete_warp(w);
        for (uint32_t l = 0; l < WARP; ++l) runnable.push_back(S.fibers[w * WARP + l]);
      }
    }
  }
  hb_acquire(&block_end_sync);
}

// ---------------------------------------------------------------------------
// buffers of exactly their size
// ---------------------------------------------------------------------------
uint8_t* allocate(size_t n) {
  if (n == 0) return nullptr;
#if defined(BUDDY_EMU_ASAN)
  void* p = nullptr;
  if (posix_memalign(&p, 16, n) != 0) fail(2, "out of memory (%zu bytes)", n);
  return (uint8_t*)p;
#else
  // the last page after it inaccessible; the start 16-byte aligned (up to 15 bytes of slack before the page)
  const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  const size_t span = (n + 15) / 16 * 16, mapped = (span + page - 1) / page * page + page;
  uint8_t* base = (uint8_t*)mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED || mprotect(base + mapped - page, page, PROT_NONE) != 0)
    fail(2, "cannot map %zu bytes: %s", n, strerror(errno));
  return base + mapped - page - span;
#endif
}

void release(uint8_t* p, size_t n) {
  if (!p) return;
#if defined(BUDDY_EMU_ASAN)
  (void)n;
  free(p);
#else
  const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  const size_t span = (n + 15) / 16 * 16, mapped = (span + page - 1) / page * page + page;
  munmap(p + span + page - mapped, mapped);
#endif
}

struct Spec {  // one ARG of the command line
  enum Role { IN, OUT, INOUT, SCRATCH, I32, I64 } role;
  size_t bytes = 0;
  long long value = 0;
};

Spec parse_arg(const char* text) {
  Spec s{};
  const char* colon = strchr(text, ':');
  if (!colon) fail(2, "argument %s: expected ROLE:VALUE", text);
  const std::string role(text, colon);
  char* end = nullptr;
  errno = 0;
  const long long v = strtoll(colon + 1, &end, 10);
  if (errno || *end || end == colon + 1) fail(2, "argument %s: not an integer", text);
  if (role == "in" || role == "out" || role == "inout" || role == "scratch") {
    if (v < 0) fail(2, "argument %s: negative size", text);
    s.role = role == "in" ? Spec::IN : role == "out" ? Spec::OUT : role == "inout" ? Spec::INOUT : Spec::SCRATCH;
    s.bytes = (size_t)v;
  } else if (role == "i32" || role == "i64") {
    s.role = role == "i32" ? Spec::I32 : Spec::I64;
    s.value = v;
  } else {
    fail(2, "argument %s: role must be in, out, inout, scratch, i32 or i64", text);
  }
  return s;
}

std::vector<uint8_t> read_all(const char* path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(2, "cannot read %s", path);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

unsigned long long number(const char* text, const char* what) {
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = strtoull(text, &end, 10);
  if (errno || *end || end == text) fail(2, "%s: %s is not a number", what, text);
  return v;
}

// One schedule of the launch: fresh buffers, the blocks in a random order; returns the out and inout bytes.
std::vector<uint8_t> run_schedule(const std::vector<Spec>& specs, const std::vector<uint8_t>& input, size_t shared,
                                  std::mt19937_64& rng) {
  std::vector<uint8_t*> buffers(specs.size(), nullptr);
  std::vector<BuddyEmuArg> args(specs.size());
  size_t at = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    const Spec& s = specs[i];
    if (s.role == Spec::I32 || s.role == Spec::I64) {
      args[i] = {s.role == Spec::I32 ? BuddyEmuArg::I32 : BuddyEmuArg::I64, nullptr, s.value};
      continue;
    }
    buffers[i] = allocate(s.bytes);
    if (s.role == Spec::OUT || s.role == Spec::SCRATCH) {
      garbage(buffers[i], s.bytes, rng);  // every output byte must be written
    } else {
      if (s.bytes) memcpy(buffers[i], input.data() + at, s.bytes);
      at += s.bytes;
    }
    args[i] = {BuddyEmuArg::BUFFER, buffers[i], 0};
  }
  S.args = args.data();
  S.dynamic_shared = allocate(shared);
  std::vector<uint32_t> order(S.grid.x);
  for (uint32_t b = 0; b < S.grid.x; ++b) order[b] = b;
  std::shuffle(order.begin(), order.end(), rng);
  for (uint32_t b : order) {
    S.block_idx = {b, 0, 0};
    run_block(rng, shared);
  }
  release(S.dynamic_shared, shared);
  S.dynamic_shared = nullptr;
  std::vector<uint8_t> out;
  at = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    const Spec& s = specs[i];
    if (s.role == Spec::IN) {
      if (s.bytes && memcmp(buffers[i], input.data() + at, s.bytes) != 0)
        fail(3, "the kernel changed its input buffer (argument %zu)", i);
    } else if (s.role == Spec::OUT || s.role == Spec::INOUT) {
      if (s.bytes) out.insert(out.end(), buffers[i], buffers[i] + s.bytes);
    }
    if (s.role == Spec::IN || s.role == Spec::INOUT) at += s.bytes;
    release(buffers[i], s.bytes);
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------
// what the shim calls
// ---------------------------------------------------------------------------
BuddyEmuDim buddy_emu_thread_idx() { return {S.current->tid, 0, 0}; }
BuddyEmuDim buddy_emu_block_idx() { return S.block_idx; }
BuddyEmuDim buddy_emu_block_dim() { return S.block; }
BuddyEmuDim buddy_emu_grid_dim() { return S.grid; }
uint8_t* buddy_emu_dynamic_shared() { return S.dynamic_shared; }

void buddy_emu_syncthreads(const char* file, int line) {
  Fiber* f = S.current;
  f->state = AT_BARRIER;
  f->file = file;
  f->line = line;
  f->pc = __builtin_return_address(0);
  f->generation = S.barrier_generation;
  hb_release(&block_barrier_sync[f->generation & 1]);
  yield();
  hb_acquire(&block_barrier_sync[f->generation & 1]);
}

uint64_t buddy_emu_warp(int kind, unsigned mask, uint64_t value, int arg, const char* file, int line) {
  Fiber* f = S.current;
  f->kind = kind;
  f->mask = mask;
  f->value = value;
  f->arg = arg;
  f->file = file;
  f->line = line;
  f->pc = __builtin_return_address(0);
  if (mask != FULL_MASK) {
    f->state = AT_WARP;
    report_stuck("a warp collective with a mask other than all 32 lanes (the emulator supports full masks only)");
  }
  const uint32_t w = f->tid / WARP;
  f->generation = S.warp_generation[w];
  char* sync = &warp_sync[2 * w + (f->generation & 1)];
  f->state = AT_WARP;
  if (kind == BUDDY_EMU_SYNCWARP) hb_release(sync);
  yield();
  if (kind == BUDDY_EMU_SYNCWARP) hb_acquire(sync);
  return f->result;
}

namespace {

// One launch: WORDS = KERNEL GRID BLOCK SHARED SEED SCHEDULES IN OUT ARG... (see the top of the file).
void launch(const std::vector<std::string>& words) {
  if (words.size() < 8) fail(2, "a launch is KERNEL GRID BLOCK SHARED SEED SCHEDULES IN OUT ARG... (see runtime.cpp)");
  const char* name = words[0].c_str();
  const BuddyEmuKernel* kernel = nullptr;
  for (size_t i = 0; i < buddy_emu_kernel_count; ++i)
    if (strcmp(buddy_emu_kernels[i].name, name) == 0) kernel = &buddy_emu_kernels[i];
  if (!kernel) fail(2, "no kernel %s in this build", name);
  const unsigned long long grid = number(words[1].c_str(), "GRID"), block = number(words[2].c_str(), "BLOCK");
  const size_t shared = (size_t)number(words[3].c_str(), "SHARED");
  const unsigned long long seed = number(words[4].c_str(), "SEED"), schedules = number(words[5].c_str(), "SCHEDULES");
  if (grid < 1 || grid > (1u << 20) || block < WARP || block > MAX_THREADS || block % WARP || schedules < 1)
    fail(2, "GRID must be 1 .. 2^20, BLOCK a multiple of 32 up to %u, SCHEDULES at least 1", MAX_THREADS);
  std::vector<Spec> specs;
  std::vector<BuddyEmuArg> probe;
  size_t in_bytes = 0;
  for (size_t i = 8; i < words.size(); ++i) {
    specs.push_back(parse_arg(words[i].c_str()));
    const Spec& s = specs.back();
    if (s.role == Spec::IN || s.role == Spec::INOUT) in_bytes += s.bytes;
    const BuddyEmuArg::Kind kind =
        s.role == Spec::I32 ? BuddyEmuArg::I32 : s.role == Spec::I64 ? BuddyEmuArg::I64 : BuddyEmuArg::BUFFER;
    probe.push_back({kind, nullptr, s.value});
  }
  char why[256];
  if (kernel->check(probe.data(), probe.size(), why, sizeof why) != 0) fail(2, "%s: %s", name, why);
  const std::vector<uint8_t> input = read_all(words[6].c_str());
  if (input.size() != in_bytes)
    fail(2, "%s holds %zu bytes, the in and inout buffers %zu", words[6].c_str(), input.size(), in_bytes);

  S.kernel = kernel;
  S.grid = {(unsigned)grid, 1, 1};
  S.block = {(unsigned)block, 1, 1};
  while (S.fibers.size() < block) S.fibers.push_back(make_fiber((uint32_t)S.fibers.size()));
  std::vector<uint8_t> first;
  for (unsigned long long s = 0; s < schedules; ++s) {
    std::mt19937_64 rng(seed + s);
    std::vector<uint8_t> out = run_schedule(specs, input, shared, rng);
    if (s == 0) {
      first.swap(out);
    } else if (out != first) {
      size_t at = 0;
      while (out[at] == first[at]) ++at;
      fail(3, "%s: schedule %llu (seed %llu) wrote other bytes than schedule 0 (seed %llu): first at output byte %zu",
           name, s, seed + s, seed, at);
    }
  }
  FILE* f = fopen(words[7].c_str(), "wb");
  if (!f || (first.size() && fwrite(first.data(), 1, first.size(), f) != first.size()) || fclose(f) != 0)
    fail(2, "%s: %s", words[7].c_str(), strerror(errno));
}

}  // namespace

// emulator LAUNCH...: one launch; emulator --serve: a launch per line of standard input, "ok" after each.
int main(int argc, char** argv) {
#if defined(BUDDY_EMU_TSAN)
  S.main_tsan = __tsan_get_current_fiber();
#endif
  if (argc == 2 && strcmp(argv[1], "--serve") == 0) {
    char* line = nullptr;
    size_t size = 0;
    while (getline(&line, &size, stdin) > 0) {
      std::vector<std::string> words;
      for (char* word = strtok(line, " \t\n"); word; word = strtok(nullptr, " \t\n")) words.push_back(word);
      if (words.empty()) continue;
      launch(words);
      fputs("ok\n", stdout);
      fflush(stdout);
    }
    free(line);
    return 0;
  }
  launch(std::vector<std::string>(argv + 1, argv + argc));
  return 0;
}
