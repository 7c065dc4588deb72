// The block emulator's runtime as the emulated kernels see it (cuda_shim.h)
// and as its driver registers them (kernels.cpp); implemented in runtime.cpp.
// Plain C++: no CUDA macros here, so runtime.cpp compiles without the shim.
#pragma once

#include <stddef.h>
#include <stdint.h>

struct BuddyEmuDim {
  unsigned x, y, z;
};

// The index and size values of the calling thread (threadIdx and friends).
BuddyEmuDim buddy_emu_thread_idx();
BuddyEmuDim buddy_emu_block_idx();
BuddyEmuDim buddy_emu_block_dim();
BuddyEmuDim buddy_emu_grid_dim();

// The calling block's dynamic shared memory: exactly the launch's bytes.
uint8_t* buddy_emu_dynamic_shared();

// __syncthreads: every thread of the block arrives before any leaves; a
// happens-before edge from each arrival to each departure.
void buddy_emu_syncthreads(const char* file, int line);

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
};
uint64_t buddy_emu_warp(int kind, unsigned mask, uint64_t value, int arg, const char* file, int line);

// An argument of a launch: a buffer (its address; null for an empty one) or an
// integer of 4 or 8 bytes.
struct BuddyEmuArg {
  enum Kind { BUFFER, I32, I64 } kind;
  void* ptr;
  long long value;
};

// A kernel the driver can launch: `check` says whether the arguments fit its
// parameters (0, else writes why), `run` runs it on the calling thread.
struct BuddyEmuKernel {
  const char* name;
  int (*check)(const BuddyEmuArg* args, size_t n, char* why, size_t why_size);
  void (*run)(const BuddyEmuArg* args);
};

// The kernels of the build (kernels.cpp).
extern const BuddyEmuKernel buddy_emu_kernels[];
extern const size_t buddy_emu_kernel_count;
