// Test-only stand-in for <cuda_runtime.h>: lets the kernels of
// kernels/cache_autogptq_cuda_kernel_256.cu run on a CPU, one OS thread per CUDA thread
// and a barrier for __syncthreads, so their indexing, tails, misaligned loads and
// reductions are checked on machines without a GPU. Vector loads must be 16-byte aligned
// and every cache read must stay inside the tensor, as on a GPU (checked here).
#pragma once

#include <barrier>
#include <cmath>
#include <math.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct uint3 {
  unsigned x = 0, y = 0, z = 0;
};
struct dim3 {
  unsigned x, y, z;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};

namespace kvemu {
inline thread_local uint3 thread_idx;
inline thread_local uint3 block_idx;
inline dim3 grid_dim;
inline std::barrier<>* block_barrier = nullptr;
inline std::barrier<>* warp_barrier[32] = {};  // one per warp of the block
// The bytes the cache reads (__ldg) may touch: [read_lo, read_hi).
inline const unsigned char* read_lo = nullptr;
inline const unsigned char* read_hi = nullptr;

[[noreturn]] inline void fail(const char* what, const void* p) {
  std::fprintf(stderr, "EMULATION FAULT: %s at %p\n", what, p);
  std::abort();
}
inline void check_read(const void* p, size_t n) {
  auto* b = static_cast<const unsigned char*>(p);
  if (b < read_lo || b + n > read_hi) fail("cache read outside the tensor", p);
}
}  // namespace kvemu

#define threadIdx (::kvemu::thread_idx)
#define blockIdx (::kvemu::block_idx)
#define gridDim (::kvemu::grid_dim)

inline void __syncthreads() { kvemu::block_barrier->arrive_and_wait(); }
inline void __syncwarp() { kvemu::warp_barrier[kvemu::thread_idx.x / 32]->arrive_and_wait(); }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

inline uint4 __ldg(const uint4* p) {
  if (reinterpret_cast<uintptr_t>(p) & 15u) kvemu::fail("misaligned 16-byte load", p);
  kvemu::check_read(p, 16);
  return *p;
}
inline unsigned char __ldg(const unsigned char* p) {
  kvemu::check_read(p, 1);
  return *p;
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t v = (static_cast<uint64_t>(y) << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) {
    const unsigned sel = (s >> (4 * i)) & 7u;
    r |= static_cast<unsigned>((v >> (8 * sel)) & 0xFFu) << (8 * i);
  }
  return r;
}
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned shift) {
  return static_cast<unsigned>(((static_cast<uint64_t>(hi) << 32) | lo) >> (shift & 31u));
}
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, sizeof f);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
// IEEE single-precision operations, rounded to nearest even (the host's default; the
// driver is compiled without -ffast-math and with contraction off, as ISO C++ has it).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
