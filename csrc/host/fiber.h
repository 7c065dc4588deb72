// Fibers for running the 32 lanes of an emulated warp on one host thread: a
// context is a saved stack pointer, a switch a few instructions. Shared by
// the block emulator (tests/host/emulator/runtime.cpp) and the native CPU
// engine (native.cpp); include it in one translation unit per binary (it
// defines two assembly functions).
//
// On x86-64, buddy_fiber_switch pushes the callee-saved registers (and, unless
// BUDDY_FIBER_NO_FP_STATE, the SSE and x87 control words: the native engine's
// fibers never change them) on the current stack, stores its pointer in
// *from, and pops the other context's from `to` (swapcontext would make a
// system call per switch, and ASan's interceptor of it clears the shadow of
// the whole target stack each time). A new context starts in
// buddy_fiber_start, which calls r13(r12). Elsewhere: ucontext.
#pragma once

#include <stddef.h>
#include <stdint.h>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#if defined(__x86_64__)
#if defined(BUDDY_FIBER_NO_FP_STATE)
#define BUDDY_FIBER_SAVE_FP ""
#define BUDDY_FIBER_LOAD_FP ""
#else
#define BUDDY_FIBER_SAVE_FP "stmxcsr (%rsp)\n  fnstcw 4(%rsp)"
#define BUDDY_FIBER_LOAD_FP "ldmxcsr (%rsp)\n  fldcw 4(%rsp)"
#endif
extern "C" void buddy_fiber_switch(void** from, void* to);
extern "C" void buddy_fiber_start();
asm(R"(
  .text
  .globl buddy_fiber_switch
  .hidden buddy_fiber_switch
  .type buddy_fiber_switch, @function
buddy_fiber_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
)" BUDDY_FIBER_SAVE_FP R"(
  movq %rsp, (%rdi)
  movq %rsi, %rsp
)" BUDDY_FIBER_LOAD_FP R"(
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size buddy_fiber_switch, .-buddy_fiber_switch
  .globl buddy_fiber_start
  .hidden buddy_fiber_start
  .type buddy_fiber_start, @function
buddy_fiber_start:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size buddy_fiber_start, .-buddy_fiber_start
)");

struct BuddyFiberContext {
  void* sp = nullptr;
};

// A context that calls entry(arg) on the stack [stack, stack + size).
inline void buddy_fiber_make(BuddyFiberContext* c, char* stack, size_t size, void (*entry)(int), int arg) {
  uint64_t* top = (uint64_t*)(((uintptr_t)(stack + size)) & ~(uintptr_t)15);
  uint64_t* sp = top - 8;
  sp[0] = 0x1F80u | (uint64_t)0x037Fu << 32;       // MXCSR, x87 control word: the defaults
  sp[1] = 0;                                       // r15
  sp[2] = 0;                                       // r14
  sp[3] = (uint64_t)(uintptr_t)entry;              // r13
  sp[4] = (uint64_t)(int64_t)arg;                  // r12
  sp[5] = 0;                                       // rbx
  sp[6] = 0;                                       // rbp: the end of the frame chain
  sp[7] = (uint64_t)(uintptr_t)buddy_fiber_start;  // where the first switch returns to
  c->sp = sp;
}

inline void buddy_fiber_switch_to(BuddyFiberContext* from, BuddyFiberContext* to) {
  buddy_fiber_switch(&from->sp, to->sp);
}
#else
struct BuddyFiberContext {
  ucontext_t uc;
};

inline void buddy_fiber_make(BuddyFiberContext* c, char* stack, size_t size, void (*entry)(int), int arg) {
  getcontext(&c->uc);
  c->uc.uc_stack.ss_sp = stack;
  c->uc.uc_stack.ss_size = size;
  c->uc.uc_link = nullptr;
  makecontext(&c->uc, (void (*)())entry, 1, arg);
}

inline void buddy_fiber_switch_to(BuddyFiberContext* from, BuddyFiberContext* to) { swapcontext(&from->uc, &to->uc); }
#endif
