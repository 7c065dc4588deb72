// The native CPU engine: the kernels of csrc/buddy_kernels.cu, unchanged,
// compiled for the host through cuda_shim.h (as the block emulator compiles
// them) and run by a runtime made for speed. buddy/engines/native.py builds it into a
// shared library per (codec, entry size) with the loader's defines and
// launches its kernels with the arguments buddy.engines.cuda.Kernels checks.
//
// Execution. Every block is one warp (blockDim.x = 32; the kernels stride
// their warps over the entries, so any block size works), its 32 lanes
// fibers (fiber.h) on one host thread, run in a fixed order: a lane runs until
// its next collective (a ballot, a shuffle, a match, __syncwarp or
// __syncthreads: one and the same with one warp a block), posts its value and
// hands over to the next lane; when lane 31 has posted, lane 0 resumes with
// every lane's value. Results are those of the GPU's collectives, with the
// memory of every lane's earlier writes visible (the fibers share a thread).
// The blocks of a launch are spread over `threads` host threads, each taking
// the next block from a counter: built with OpenMP, the runtime's threads (the
// process has one runtime: torch's, where torch is built with it, whose
// threads spin a while after each of torch's operations and would otherwise
// share the cores with the launch), else, and in a child forked after the
// runtime started, a pool of the engine's own kept between launches; the static
// __shared__ arrays are one per host thread (thread_local), the dynamic shared
// buffer too. Atomics are the shim's relaxed __atomic builtins. buddy_warp.h's
// whole-warp sum, maximum, OR, exclusive scan and bpc's bit transpose are one
// exchange each here (BUDDY_HOST_WARP_OPS), the last lane to post computing
// the result once, where the GPU and the emulator run shuffle ladders.
//
// One lane a warp (-DBUDDY_NATIVE_SOLO with -DBUDDY_WARP_SIZE=1u: the build of
// buddy.engines.native.SOLO_CODECS). For sources written for any warp size
// (buddy_warp.h) a block is one plain call of the kernel on its host thread
// (blockDim.x = 1): the lane's loops do the work of a warp's 32 lanes, each
// collective returns the lane's own value, and no fiber is made. The codecs
// tiled by 32 lanes assert BUDDY_WARP_SIZE 32 and do not build this way.
//
// What this runtime does not do is check: lanes at different collectives abort
// the process with a message (the emulator, which runs the same sources with
// random schedules and sanitizers in the tests, reports such bugs before they
// get here).
//
// C interface (ctypes):
//   int buddy_native_kernel(const char* name)      index of a kernel of this build, -1 if none
//   int buddy_native_launch(int kernel, unsigned grid, size_t shared_bytes, const BuddyEmuArg* args,
//                           size_t n_args, unsigned threads, char* why, size_t why_size)
//       0 after the launch ran; 1 with `why` when the arguments do not fit the kernel
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#if defined(_OPENMP)
#include <omp.h>
#endif
#include <vector>

#define BUDDY_FIBER_NO_FP_STATE 1  // the lanes never change the SSE or x87 control words
#include "fiber.h"
#include "launch.h"

namespace buddy_native {

constexpr uint32_t LANES = 32;
constexpr size_t STACK_BYTES = 256u << 10;  // per lane (reserved; touched as used)

[[noreturn]] inline void fail(const char* what, uint32_t lane) {
  fprintf(stderr, "buddy native engine: %s (lane %u); the emulator's tests find such bugs\n", what, lane);
  fflush(stderr);
  abort();
}

#if defined(BUDDY_NATIVE_SOLO)
// One lane a warp (BUDDY_NATIVE_SOLO, with BUDDY_WARP_SIZE 1: buddy_warp.h): a block is one call of the
// kernel on the host thread, its lane's loops doing the work of a warp's 32 lanes, every collective the lane's
// own value. Only for sources written for any warp size (buddy.engines.native.SOLO_CODECS: fpe, zvc, fpx).
struct Worker {
  uint32_t block = 0, grid = 1;
  std::vector<uint8_t> shared;     // dynamic shared memory
  uint8_t* shared_base = nullptr;  // 16-byte aligned inside it
  const BuddyEmuKernel* kernel = nullptr;
  const BuddyEmuArg* args = nullptr;

  // at least 16 bytes to spare after the buffer: the one lane's bit-field writes are 8-byte ORs (buddy_bits.h)
  void reserve_shared(size_t bytes) {
    if (shared.size() < bytes + 32) shared.resize(bytes + 32);
    shared_base = (uint8_t*)(((uintptr_t)shared.data() + 15) & ~(uintptr_t)15);
  }
  void run_block(uint32_t b) {
    block = b;
    kernel->run(args);
  }
};

Worker& worker() {
  thread_local Worker mine;
  return mine;
}
inline Worker& self() { return worker(); }

#else  // 32 lanes a warp, fibers
// A host thread's warp: its lanes' contexts and stacks, the collectives' mailbox, its shared memory. The lanes'
// stacks lie in one region of REGION bytes aligned to REGION, whose first page holds the worker's address: a lane
// finds its worker from its stack pointer (one mask and a load, where a thread_local in a loaded library would be
// a call into the dynamic loader at every collective).
constexpr size_t REGION = 16u << 20;
constexpr size_t PAGE = 4096;
static_assert(PAGE + LANES * (PAGE + STACK_BYTES) <= REGION, "the lanes' stacks fit the region");

struct Worker {
  BuddyFiberContext main;
  BuddyFiberContext lane[LANES];
  char* region = nullptr;
  void* mapping = nullptr;
  uint32_t current = 0;  // the running lane
  uint32_t block = 0, grid = 1;
  uint64_t slot[2][LANES];  // posted values, double-buffered by each lane's collective parity
  uint32_t bits[2];         // bit l: the low bit of lane l's posted value (a ballot's result, built as lanes post)
  uint64_t whole[2];        // a whole-warp operation's result, by the last lane to post (sum, max, or)
  uint32_t prefix[2][LANES];  // an exclusive scan's or a transpose's, per lane
  uint32_t calls[LANES];    // collectives each lane has made in this block
  bool done[LANES];
  std::vector<uint8_t> shared;  // dynamic shared memory
  uint8_t* shared_base = nullptr;  // 16-byte aligned inside it
  const BuddyEmuKernel* kernel = nullptr;
  const BuddyEmuArg* args = nullptr;

  Worker() {
    if (sysconf(_SC_PAGESIZE) > (long)PAGE) fail("pages larger than 4 KiB are not supported", 0);
    mapping = mmap(nullptr, 2 * REGION, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (mapping == MAP_FAILED) fail("cannot map the lanes' stacks", 0);
    region = (char*)(((uintptr_t)mapping + REGION - 1) & ~(uintptr_t)(REGION - 1));
    *(Worker**)region = this;
    for (uint32_t l = 0; l < LANES; ++l)  // an inaccessible page below each stack (stacks grow down)
      if (mprotect(stack(l) - PAGE, PAGE, PROT_NONE) != 0) fail("cannot guard a stack", l);
  }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;
  ~Worker() { munmap(mapping, 2 * REGION); }

  char* stack(uint32_t l) const { return region + PAGE + l * (PAGE + STACK_BYTES) + PAGE; }

  void reserve_shared(size_t bytes) {
    if (shared.size() < bytes + 16) shared.resize(bytes + 16);
    shared_base = (uint8_t*)(((uintptr_t)shared.data() + 15) & ~(uintptr_t)15);
  }

  void run_block(uint32_t b);
};

// The worker of the calling lane (only lanes call the runtime's functions).
inline Worker& self() {
  const uintptr_t sp = (uintptr_t)__builtin_frame_address(0);
  return **(Worker**)(sp & ~(uintptr_t)(REGION - 1));
}

Worker& worker() {
  thread_local Worker mine;
  return mine;
}

// Hands over from lane l to the next lane that has not finished (the scheduler when none is left).
inline void hand_over(Worker& w, uint32_t l) {
  for (uint32_t d = 1; d <= LANES; ++d) {
    const uint32_t next = (l + d) % LANES;
    if (!w.done[next]) {
      w.current = next;
      buddy_fiber_switch_to(&w.lane[l], &w.lane[next]);
      return;
    }
  }
  buddy_fiber_switch_to(&w.lane[l], &w.main);
}

void lane_main(int l) {
  Worker& w = self();
  w.kernel->run(w.args);
  w.done[l] = true;
  hand_over(w, (uint32_t)l);
  fail("a finished lane was resumed", (uint32_t)l);
}

void Worker::run_block(uint32_t b) {
  block = b;
  for (uint32_t l = 0; l < LANES; ++l) {
    calls[l] = 0;
    done[l] = false;
    buddy_fiber_make(&lane[l], stack(l), STACK_BYTES, lane_main, (int)l);
  }
  current = 0;
  buddy_fiber_switch_to(&main, &lane[0]);
  for (uint32_t l = 1; l < LANES; ++l)
    if (calls[l] != calls[0]) fail("the lanes of a warp made different numbers of collectives", l);
}

#endif

// A pool of host threads kept between launches; the launching thread works too. Helpers are detached and the
// pool never destroyed (its threads wait for work until the process ends); a forked child makes its own.
class Pool {
 public:
  // Runs work() on `threads` threads (this one included) and returns when all are done.
  void run(unsigned threads, const std::function<void()>& work) {
    if (threads <= 1) {
      work();
      return;
    }
    std::unique_lock<std::mutex> lock(mutex_);
    while (helpers_ < threads - 1) std::thread([this, id = helpers_++] { serve(id); }).detach();
    job_ = &work;
    wanted_ = threads - 1;
    busy_ = threads - 1;
    ++generation_;
    lock.unlock();
    wake_.notify_all();
    work();
    lock.lock();
    idle_.wait(lock, [this] { return busy_ == 0; });
    job_ = nullptr;
  }

 private:
  void serve(size_t id) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return generation_ != seen; });
      seen = generation_;
      if (id >= wanted_) continue;  // this launch wants fewer helpers
      const std::function<void()>* job = job_;
      lock.unlock();
      (*job)();
      lock.lock();
      if (--busy_ == 0) idle_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_, idle_;
  size_t helpers_ = 0;
  const std::function<void()>* job_ = nullptr;
  size_t wanted_ = 0, busy_ = 0;
  uint64_t generation_ = 0;
};

// This process's pool (a child after fork() has none of its parent's threads: it starts its own).
Pool& pool() {
  static Pool* pool = nullptr;
  static pid_t owner = 0;
  if (pool == nullptr || owner != getpid()) {
    pool = new Pool();
    owner = getpid();
  }
  return *pool;
}

std::mutex launching;  // one launch at a time (a launch uses every thread it is given)

#if defined(_OPENMP)
// Whether a launch may run on the OpenMP runtime's threads: not inside a parallel region, and not in a child
// forked after the runtime started its threads (its team would wait for threads the child does not have).
const pid_t openmp_owner = getpid();
bool openmp_usable() { return !omp_in_parallel() && getpid() == openmp_owner; }
#endif

#if !defined(BUDDY_NATIVE_SOLO)
// A whole-warp operation over the 32 posted values s (the low 32 bits of each), computed once by the last lane.
inline void whole_warp(Worker& w, int kind, const uint64_t* s, uint32_t p) {
  if (kind == BUDDY_EMU_TRANSPOSE) {  // block swaps of 16, 8, 4, 2 and 1 bits: (row k, bit c) -> (row c, bit k)
    uint32_t* r = w.prefix[p];
    for (uint32_t i = 0; i < LANES; ++i) r[i] = (uint32_t)s[i];
    uint32_t m = 0x0000FFFFu;  // the low half of every 2w-bit block
    for (uint32_t b = 16; b != 0; b >>= 1, m ^= m << b)
      for (uint32_t k = 0; k < LANES; ++k) {
        if (k & b) continue;
        const uint32_t t = ((r[k] >> b) ^ r[k + b]) & m;
        r[k] ^= t << b;
        r[k + b] ^= t;
      }
    return;
  }
  uint32_t acc = kind == BUDDY_EMU_MAX ? (uint32_t)s[0] : 0u;
  for (uint32_t i = 0; i < LANES; ++i) {
    const uint32_t v = (uint32_t)s[i];
    if (kind == BUDDY_EMU_EXCLUSIVE_SCAN) w.prefix[p][i] = acc;
    acc = kind == BUDDY_EMU_MAX ? (v > acc ? v : acc) : kind == BUDDY_EMU_OR ? (acc | v) : acc + v;
  }
  w.whole[p] = acc;
}

#endif
}  // namespace buddy_native

#if defined(BUDDY_NATIVE_SOLO)
// ---------------------------------------------------------------------------
// the runtime's functions as cuda_shim.h calls them, inline: one lane a warp
// ---------------------------------------------------------------------------

inline BuddyEmuDim buddy_emu_thread_idx() { return {0, 0, 0}; }
inline BuddyEmuDim buddy_emu_block_idx() { return {buddy_native::self().block, 0, 0}; }
inline BuddyEmuDim buddy_emu_block_dim() { return {1, 1, 1}; }
inline BuddyEmuDim buddy_emu_grid_dim() { return {buddy_native::self().grid, 1, 1}; }
inline uint8_t* buddy_emu_dynamic_shared() { return buddy_native::self().shared_base; }

// A warp of one lane: a ballot is its own bit, a shuffle its own value, a match itself.
inline uint64_t buddy_emu_warp(int kind, unsigned, uint64_t value, int, const char*, int) {
  switch (kind) {
    case BUDDY_EMU_BALLOT:
      return value & 1u;
    case BUDDY_EMU_MATCH_ANY:
      return 1u;
    case BUDDY_EMU_SYNCWARP:
      return 0;
    default:
      return value;
  }
}

inline void buddy_emu_syncthreads(const char*, int) {}

#define BUDDY_SHARED_STORAGE static thread_local __attribute__((aligned(16)))

#else
// ---------------------------------------------------------------------------
// the runtime's functions as cuda_shim.h calls them, inline
// ---------------------------------------------------------------------------

inline BuddyEmuDim buddy_emu_thread_idx() { return {buddy_native::self().current, 0, 0}; }
inline BuddyEmuDim buddy_emu_block_idx() { return {buddy_native::self().block, 0, 0}; }
inline BuddyEmuDim buddy_emu_block_dim() { return {buddy_native::LANES, 1, 1}; }
inline BuddyEmuDim buddy_emu_grid_dim() { return {buddy_native::self().grid, 1, 1}; }
inline uint8_t* buddy_emu_dynamic_shared() { return buddy_native::self().shared_base; }

inline uint64_t buddy_emu_warp(int kind, unsigned mask, uint64_t value, int arg, const char*, int) {
  using namespace buddy_native;
  Worker& w = self();
  const uint32_t l = w.current;
  if (mask != 0xffffffffu) fail("a warp collective with a mask other than all 32 lanes", l);
  const uint32_t p = w.calls[l]++ & 1u;
  w.slot[p][l] = value;
  // lane 0 posts first in every collective (the lanes run in order, and lane 0 resumes first after lane 31 posts)
  w.bits[p] = (l ? w.bits[p] : 0u) | (uint32_t)(value & 1u) << l;
  if (l == LANES - 1 && kind >= BUDDY_EMU_SUM) whole_warp(w, kind, w.slot[p], p);  // every lane has posted
  const uint32_t next = (l + 1) % LANES;
  if (w.done[next]) fail("a lane is at a collective its warp's next lane never reached", l);
  w.current = next;
  buddy_fiber_switch_to(&w.lane[l], &w.lane[next]);  // back here once every lane has posted
  const uint64_t* s = w.slot[p];
  const uint32_t a = (uint32_t)arg;
  switch (kind) {
    case BUDDY_EMU_BALLOT:
      return w.bits[p];
    case BUDDY_EMU_SHFL:
      return s[a % LANES];
    case BUDDY_EMU_SHFL_UP:
      return l >= a ? s[l - a] : value;
    case BUDDY_EMU_SHFL_DOWN:
      return l + a < LANES ? s[l + a] : value;
    case BUDDY_EMU_SHFL_XOR:
      return s[(l ^ a) % LANES];
    case BUDDY_EMU_MATCH_ANY: {
      uint64_t bits = 0;
      for (uint32_t i = 0; i < LANES; ++i) bits |= (uint64_t)(s[i] == value) << i;
      return bits;
    }
    case BUDDY_EMU_SUM:
    case BUDDY_EMU_MAX:
    case BUDDY_EMU_OR:
      return w.whole[p];
    case BUDDY_EMU_EXCLUSIVE_SCAN:
      return w.prefix[p][l] | w.whole[p] << 32;
    case BUDDY_EMU_TRANSPOSE:
      return w.prefix[p][l];
    default:  // __syncwarp: the lanes share a thread, every write is visible
      return 0;
  }
}

// buddy_warp.h's whole-warp operations (BUDDY_HOST_WARP_OPS): one exchange each.
inline uint64_t buddy_host_warp_op(int kind, uint32_t v) { return buddy_emu_warp(kind, 0xffffffffu, v, 0, "", 0); }

inline void buddy_emu_syncthreads(const char* file, int line) {
  buddy_emu_warp(BUDDY_EMU_SYNCWARP, 0xffffffffu, 0, 0, file, line);  // a block is one warp
}

#define BUDDY_SHARED_STORAGE static thread_local __attribute__((aligned(16)))
#define BUDDY_HOST_WARP_OPS 1  // buddy_warp.h's whole-warp operations through buddy_host_warp_op (above)
#endif
#include "cuda_shim.h"
// the shim first: the sources then compile as for a device
#include "buddy_kernels.cu"
#include "kernel_table.h"

extern "C" __attribute__((visibility("default"))) int buddy_native_kernel(const char* name) {
  for (size_t i = 0; i < buddy_emu_kernel_count; ++i)
    if (strcmp(buddy_emu_kernels[i].name, name) == 0) return (int)i;
  return -1;
}

extern "C" __attribute__((visibility("default"))) int buddy_native_launch(int kernel, unsigned grid,
                                                                         size_t shared_bytes,
                                                                         const BuddyEmuArg* args, size_t n_args,
                                                                         unsigned threads, char* why,
                                                                         size_t why_size) {
  using namespace buddy_native;
  if (kernel < 0 || (size_t)kernel >= buddy_emu_kernel_count) {
    snprintf(why, why_size, "no kernel %d in this build", kernel);
    return 1;
  }
  const BuddyEmuKernel* k = &buddy_emu_kernels[kernel];
  if (k->check(args, n_args, why, why_size) != 0) return 1;
  if (grid == 0) return 0;
  threads = threads < 1 ? 1 : threads > grid ? grid : threads;
  std::lock_guard<std::mutex> lock(launching);
  std::atomic<unsigned> next{0};
  auto work = [&] {
    Worker& w = worker();
    w.kernel = k;
    w.args = args;
    w.grid = grid;
    w.reserve_shared(shared_bytes);
    for (unsigned b = next++; b < grid; b = next++) w.run_block(b);
  };
#if defined(_OPENMP)
  if (threads > 1 && openmp_usable()) {
#pragma omp parallel num_threads(threads)
    work();
    return 0;
  }
#endif
  pool().run(threads, work);
  return 0;
}
