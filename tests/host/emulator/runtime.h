// The block emulator's runtime as the emulated kernels see it (cuda_shim.h)
// and as its driver registers them (kernels.cpp); implemented in runtime.cpp.
// Plain C++: no CUDA macros here, so runtime.cpp compiles without the shim.
// The types a launch needs are shared with the native CPU engine
// (csrc/host/launch.h).
#pragma once

#include "launch.h"

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

// A warp collective (launch.h) of the calling lane.
uint64_t buddy_emu_warp(int kind, unsigned mask, uint64_t value, int arg, const char* file, int line);
