// Portability of the device code: fixed-width integers, function qualifiers,
// loads and stores, and bit counting that compile both under NVRTC/nvcc (the
// kernels) and under a host C++17 compiler (the emulated-warp tests).
#pragma once

#if defined(__CUDACC_RTC__)
// NVRTC (run-time compilation through CuPy) ships no C library headers.
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
#else
#include <math.h>
#include <stdint.h>
#include <string.h>
#endif

#ifdef __CUDACC__
#define BUDDY_HD __host__ __device__ __forceinline__
#define BUDDY_WARP_FN __device__ __forceinline__
// a copy loop unrolled twice at most: two loads in flight a lane are plenty, more cost registers the
// decoders need (fpe's unpack stays within 64)
#define BUDDY_UNROLL_2 _Pragma("unroll 2")
#else
#define BUDDY_HD inline
#define BUDDY_WARP_FN inline
#define BUDDY_UNROLL_2
#endif

template <int N>
struct buddy_uint;
template <>
struct buddy_uint<1> {
  typedef uint8_t type;
};
template <>
struct buddy_uint<2> {
  typedef uint16_t type;
};
template <>
struct buddy_uint<4> {
  typedef uint32_t type;
};
template <>
struct buddy_uint<8> {
  typedef uint64_t type;
};

// Unaligned-safe on the host (memcpy), a plain aligned access on the device:
// device pointers are aligned to sizeof(T) by every caller.
template <class T>
BUDDY_HD T buddy_load(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const T*>(p);
#else
  T v;
  memcpy(&v, p, sizeof(T));
  return v;
#endif
}

template <class T>
BUDDY_HD void buddy_store(uint8_t* p, T v) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<T*>(p) = v;
#else
  memcpy(p, &v, sizeof(T));
#endif
}

// 16 bytes, for loads and stores 16 bytes wide (a pointer to one is 16-byte aligned).
struct alignas(16) buddy_u128 {
  uint64_t lo, hi;
};

// Word i (0 .. 16 / sizeof(W) - 1) of a 16-byte unit, little endian.
// Words of up to 4 bytes from the unit's 32-bit quarters: a compiler then tests and shifts 32-bit registers, where
// from 64-bit halves it compared a 2-byte word with zero in 64 bits.
template <class W>
BUDDY_HD W buddy_unit_word(buddy_u128 unit, uint32_t i) {
  if constexpr (sizeof(W) <= 4u) {
    constexpr uint32_t quarter = 4u / sizeof(W);  // words per 4 bytes
    const uint64_t v = i < 2u * quarter ? unit.lo : unit.hi;
    const uint32_t q = (uint32_t)(i / quarter % 2u ? v >> 32 : v);
    return (W)(q >> (8u * sizeof(W) * (i % quarter)));
  } else {
    return (W)(i ? unit.hi : unit.lo);
  }
}

// Whether p and q are both 16-byte aligned (16-byte loads and stores may be used).
BUDDY_HD bool buddy_aligned16(const void* p, const void* q) {
  return (((unsigned long long)p | (unsigned long long)q) & 15u) == 0;
}

BUDDY_HD uint32_t buddy_popc(uint32_t x) {
#if defined(__CUDA_ARCH__)
  return (uint32_t)__popc(x);
#else
  return (uint32_t)__builtin_popcount(x);
#endif
}

BUDDY_HD uint32_t buddy_popc64(uint64_t x) {
#if defined(__CUDA_ARCH__)
  return (uint32_t)__popcll(x);
#else
  return (uint32_t)__builtin_popcountll(x);
#endif
}

// Number of bits needed to write x (bit_length; 0 for 0).
BUDDY_HD uint32_t buddy_bit_length(uint32_t x) {
#if defined(__CUDA_ARCH__)
  return 32u - (uint32_t)__clz(x);
#else
  return x ? 32u - (uint32_t)__builtin_clz(x) : 0u;
#endif
}

// Index of the lowest set bit of a non-zero x.
BUDDY_HD uint32_t buddy_ctz(uint32_t x) {
#if defined(__CUDA_ARCH__)
  return (uint32_t)__ffs((int)x) - 1u;
#else
  return (uint32_t)__builtin_ctz(x);
#endif
}

// Index of the lowest set bit of a non-zero x (64 bits).
BUDDY_HD uint32_t buddy_ctz64(uint64_t x) {
#if defined(__CUDA_ARCH__)
  return (uint32_t)__ffsll((long long)x) - 1u;
#else
  return (uint32_t)__builtin_ctzll(x);
#endif
}

// T where the condition holds, else F (std::conditional, which NVRTC's headers lack).
template <bool C, class T, class F>
struct buddy_pick {
  using type = T;
};
template <class T, class F>
struct buddy_pick<false, T, F> {
  using type = F;
};

// A constant as a type (a generic lambda's argument that picks a version of its code at compile time).
template <uint32_t V>
struct buddy_constant {
  static constexpr uint32_t value = V;
};

// The 32 bits from bit s & 31 of the 64-bit little-endian pair lo, hi (one funnel shift on the device, which
// takes the shift mod 32 itself: no mask).
BUDDY_HD uint32_t buddy_funnel_r(uint32_t lo, uint32_t hi, uint32_t s) {
#if defined(__CUDA_ARCH__)
  return __funnelshift_r(lo, hi, s);
#else
  return (uint32_t)(((uint64_t)hi << 32 | lo) >> (s & 31u));
#endif
}

// The high 32 bits of the 64-bit little-endian pair lo, hi shifted left by s & 31 (one funnel shift on the device).
BUDDY_HD uint32_t buddy_funnel_l(uint32_t lo, uint32_t hi, uint32_t s) {
#if defined(__CUDA_ARCH__)
  return __funnelshift_l(lo, hi, s);
#else
  return (uint32_t)((((uint64_t)hi << 32 | lo) << (s & 31u)) >> 32);
#endif
}

// *p += v, atomically on the device (shared or global memory); a plain add on the host and in the native
// engine's blocks of one lane (csrc/host/native.cpp, BUDDY_NATIVE_SOLO), which only add to their own block's
// shared memory here.
BUDDY_HD void buddy_atomic_add(uint32_t* p, uint32_t v) {
#if defined(__CUDA_ARCH__) && !defined(BUDDY_NATIVE_SOLO)
  atomicAdd(p, v);
#else
  *p += v;
#endif
}

// p, a pointer into global memory that the device compiler may be unable to trace back to a kernel argument (one
// of several, picked at run time): told so, its loads and stores through it are global ones, not generic, slower.
// Only for a pointer the caller then reads or writes (never null). On a host: p.
template <class T>
BUDDY_HD T* buddy_global(T* p) {
#if defined(__CUDA_ARCH__) && !defined(BUDDY_EMULATOR)
  __builtin_assume(__isGlobal(p));
#endif
  return p;
}

// x rounded to an integer, halves to even (Python's round of a float).
BUDDY_HD double buddy_rint(double x) { return rint(x); }

template <class T>
BUDDY_HD T buddy_min(T a, T b) {
  return a < b ? a : b;
}

template <class T>
BUDDY_HD T buddy_max(T a, T b) {
  return a < b ? b : a;
}

// The block's dynamic shared memory: the launch's shared_mem bytes, 16-byte
// aligned (pack and unpack stage one entry per warp in it). A function rather
// than an `extern __shared__` array at each use, so that the block emulator
// (tests/host/emulator, which defines BUDDY_EMULATOR and compiles the kernels
// for the host) can give every emulated block a buffer of exactly that size.
#if defined(__CUDACC__) && !defined(BUDDY_EMULATOR)
__device__ __forceinline__ uint8_t* buddy_dynamic_shared() {
  extern __shared__ buddy_u128 buddy_shared[];  // 16-byte aligned: staging is read and written 16 bytes wide
  return reinterpret_cast<uint8_t*>(buddy_shared);
}
#endif

// *p |= v, atomically on the device (lanes of a warp may share a stream word);
// the host emulation runs one lane at a time, so a plain OR is atomic there, as
// in the native engine's warps of one lane (BUDDY_NATIVE_SOLO).
BUDDY_HD void buddy_atomic_or(uint32_t* p, uint32_t v) {
#if defined(__CUDA_ARCH__) && !defined(BUDDY_NATIVE_SOLO)
  atomicOr(p, v);
#else
  *p |= v;
#endif
}
