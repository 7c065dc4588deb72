// The table of the kernels of csrc/buddy_kernels.cu a host runtime launches
// by name (launch.h): for each, whether a launch's arguments fit its
// parameters and how to call it with them. Included after the kernel sources
// (compiled through cuda_shim.h) by the block emulator's kernels.cpp and by
// the native CPU engine's native.cpp.
#pragma once

#include <stdio.h>

#include <type_traits>
#include <utility>

namespace {

// Parameter i of a kernel from launch argument a: a pointer from a buffer, an integer of its exact size.
template <class T>
bool fits(const BuddyEmuArg& a) {
  if constexpr (std::is_pointer_v<T>)
    return a.kind == BuddyEmuArg::BUFFER;
  else
    return std::is_integral_v<T> && a.kind == (sizeof(T) == 8 ? BuddyEmuArg::I64 : BuddyEmuArg::I32) &&
           (sizeof(T) == 4 || sizeof(T) == 8);
}

template <class T>
T as(const BuddyEmuArg& a) {
  if constexpr (std::is_pointer_v<T>)
    return reinterpret_cast<T>(a.ptr);
  else
    return (T)a.value;
}

template <class Kernel>
struct Params;
template <class... P>
struct Params<void (*)(P...)> {
  static constexpr size_t count = sizeof...(P);
  template <size_t... I>
  static int check(const BuddyEmuArg* args, size_t n, char* why, size_t size, std::index_sequence<I...>) {
    if (n != count) {
      snprintf(why, size, "%zu arguments for %zu parameters", n, count);
      return 1;
    }
    const bool ok[] = {true, fits<P>(args[I])...};
    for (size_t i = 0; i < count; ++i)
      if (!ok[i + 1]) {
        snprintf(why, size, "argument %zu is not of its parameter's kind (a buffer, a 4- or an 8-byte integer)", i);
        return 1;
      }
    return 0;
  }
  template <auto F, size_t... I>
  static void run(const BuddyEmuArg* args, std::index_sequence<I...>) {
    F(as<P>(args[I])...);
  }
};

template <auto F>
int check(const BuddyEmuArg* args, size_t n, char* why, size_t size) {
  using K = Params<decltype(F)>;
  return K::check(args, n, why, size, std::make_index_sequence<K::count>());
}

template <auto F>
void run(const BuddyEmuArg* args) {
  using K = Params<decltype(F)>;
  K::template run<F>(args, std::make_index_sequence<K::count>());
}

}  // namespace

#define BUDDY_EMU_KERNEL(F) {#F, check<&F>, run<&F>},
#define BUDDY_EMU_FORMAT(NAME)                                                                  \
  BUDDY_EMU_KERNEL(buddy_##NAME##_measure) BUDDY_EMU_KERNEL(buddy_##NAME##_ends)                 \
  BUDDY_EMU_KERNEL(buddy_##NAME##_sizes) BUDDY_EMU_KERNEL(buddy_##NAME##_pack)                   \
  BUDDY_EMU_KERNEL(buddy_##NAME##_unpack) BUDDY_EMU_KERNEL(buddy_##NAME##_drain)
// the fit kernel of fpe, buddy_fpe_fit, overloads the device function of that name (codec_fpe_fit.h): by its type
typedef void (*BuddyEmuFit)(const long long*, uint8_t*, uint8_t*, uint8_t*, int, int);
#define BUDDY_EMU_FIT(NAME)                                                                                \
  BUDDY_EMU_KERNEL(buddy_##NAME##_count)                                                                   \
  {"buddy_" #NAME "_fit", check<static_cast<BuddyEmuFit>(&buddy_##NAME##_fit)>,                           \
   run<static_cast<BuddyEmuFit>(&buddy_##NAME##_fit)>},

// The kernels buddy_kernels.cu defines for the codec(s) of this build (its BUDDY_CODEC_* conditions).
const BuddyEmuKernel buddy_emu_kernels[] = {
#if defined(BUDDY_CODEC_ZVC) || defined(BUDDY_CODEC_ALL)
    BUDDY_EMU_FORMAT(zvc)
#endif
#if defined(BUDDY_CODEC_FPX) || defined(BUDDY_CODEC_ALL)
    BUDDY_EMU_FORMAT(fpx)
#endif
#if defined(BUDDY_CODEC_BPC) || defined(BUDDY_CODEC_ALL)
    BUDDY_EMU_FORMAT(bpc)
#endif
#if defined(BUDDY_CODEC_AUTO) || defined(BUDDY_CODEC_ALL)
    BUDDY_EMU_FORMAT(auto)
#endif
#if defined(BUDDY_CODEC_FPE) || defined(BUDDY_CODEC_ALL)
    BUDDY_EMU_FORMAT(fpe) BUDDY_EMU_FIT(fpe)
#endif
#if defined(BUDDY_CODEC_AUTO2) || defined(BUDDY_CODEC_ALL)
    BUDDY_EMU_FORMAT(auto2) BUDDY_EMU_FIT(auto2)
#endif
#if (defined(BUDDY_CODEC_FPE) || defined(BUDDY_CODEC_ALL)) && !defined(BUDDY_NATIVE_SOLO)
    BUDDY_EMU_KERNEL(buddy_fpe_lockstep_decode)  // a layout weighed (codec_fpe.h, decode_lockstep)
#endif
};
const size_t buddy_emu_kernel_count = sizeof(buddy_emu_kernels) / sizeof(buddy_emu_kernels[0]);
