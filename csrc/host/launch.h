// What a host runtime of the kernels of csrc/buddy_kernels.cu shares with the
// kernels compiled through cuda_shim.h: the index values, the warp
// collectives, and a launch's arguments and kernels (kernel_table.h). Two
// runtimes implement the functions cuda_shim.h calls (declared before it is
// included): the block emulator (tests/host/emulator/runtime.h, runtime.cpp:
// random schedules, sanitizers) and the native CPU engine (native.cpp: a
// fixed order, fast). Plain C++: no CUDA macros here.
#pragma once

#include <stddef.h>
#include <stdint.h>

struct BuddyEmuDim {
  unsigned x, y, z;
};

// The warp collectives: the 32 lanes of the calling warp arrive (each with its
// value and argument), then each leaves with its result. Only SYNCWARP orders
// memory (a happens-before edge among the lanes); the others exchange values.
enum BuddyEmuCollective : int {
  BUDDY_EMU_SYNCWARP = 0,
  BUDDY_EMU_BALLOT,
  BUDDY_EMU_SHFL,
  BUDDY_EMU_SHFL_UP,
  BUDDY_EMU_SHFL_DOWN,
  BUDDY_EMU_SHFL_XOR,
  BUDDY_EMU_MATCH_ANY,  // result: bit l set where lane l's value equals the caller's
  // whole-warp operations the native runtime provides in one exchange (buddy_warp.h uses them there, under
  // BUDDY_HOST_WARP_OPS, in place of its shuffle ladders; the emulator runs the ladders, as the GPU does)
  BUDDY_EMU_SUM,             // the 32-bit sum of every lane's value (wrapping)
  BUDDY_EMU_MAX,             // the largest value
  BUDDY_EMU_OR,              // the bitwise OR
  BUDDY_EMU_EXCLUSIVE_SCAN,  // the sum over lanes 0 .. l-1 (32 bits, wrapping) | the sum over the warp << 32
  BUDDY_EMU_TRANSPOSE,       // bit j: bit l of lane j's value (the 32 x 32 bit transpose)
};

// An argument of a launch: a buffer (its address; null for an empty one) or an
// integer of 4 or 8 bytes.
struct BuddyEmuArg {
  enum Kind { BUFFER, I32, I64 } kind;
  void* ptr;
  long long value;
};

// A kernel a runtime can launch: `check` says whether the arguments fit its
// parameters (0, else writes why), `run` runs it on the calling thread.
struct BuddyEmuKernel {
  const char* name;
  int (*check)(const BuddyEmuArg* args, size_t n, char* why, size_t why_size);
  void (*run)(const BuddyEmuArg* args);
};

// The kernels of the build (kernel_table.h).
extern const BuddyEmuKernel buddy_emu_kernels[];
extern const size_t buddy_emu_kernel_count;
