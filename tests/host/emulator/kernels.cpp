// The kernels of csrc/buddy_kernels.cu, unchanged, compiled for the host
// through the CUDA shim, and the table of them the driver launches by name.
// Built by tests/emulator.py with buddy.engines.sources.compile_options(E, codec) -- the
// defines the loader gives NVRTC -- and instrumented by a sanitizer (runtime.cpp).
#include "runtime.h"
// the runtime's functions, then the shim: the sources then compile as for a device
#include "cuda_shim.h"
#include "buddy_kernels.cu"
// the table of them (csrc/host/kernel_table.h)
#include "kernel_table.h"
