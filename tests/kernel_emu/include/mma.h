// Test-only stand-in for <mma.h> (WMMA), see cuda_runtime.h beside it. Each emulated
// thread holds the whole 16x16 tile in its fragment (a real warp spreads it over its 32
// lanes), and a product is computed by every thread for itself: the kernels' indexing,
// tails and staging are what is checked, with the same fp16 operands and fp32 accumulation.
// A store is done by lane 0 alone; the kernels synchronise the warp before reading it.
#pragma once

#include "cuda_fp16.h"
#include "cuda_runtime.h"

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
enum layout_t { mem_row_major };

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "emulated: 16x16x16 only");
  static constexpr int num_elements = 16 * 16;
  float x[16 * 16];
};

template <class Use, class T, class Layout>
inline void fill_fragment(fragment<Use, 16, 16, 16, T, Layout>& f, float x) {
  for (float& e : f.x) e = x;
}

template <class Use, class Layout>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, __half, Layout>& f, const __half* p,
                             unsigned ldm) {
  if (reinterpret_cast<uintptr_t>(p) & 31u) kvemu::fail("misaligned WMMA load", p);
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c) f.x[r * 16 + c] = __half2float(p[r * ldm + c]);
}

template <class T, class La, class Lb, class Lc>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float, Lc>& d,
                     const fragment<matrix_a, 16, 16, 16, T, La>& a,
                     const fragment<matrix_b, 16, 16, 16, T, Lb>& b,
                     const fragment<accumulator, 16, 16, 16, float, Lc>& c) {
  float out[16 * 16];
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) {
      float s = c.x[i * 16 + j];
      for (int k = 0; k < 16; ++k) s += a.x[i * 16 + k] * b.x[k * 16 + j];
      out[i * 16 + j] = s;
    }
  for (int i = 0; i < 256; ++i) d.x[i] = out[i];
}

template <class Layout>
inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float, Layout>& f,
                              unsigned ldm, layout_t) {
  if (reinterpret_cast<uintptr_t>(p) & 31u) kvemu::fail("misaligned WMMA store", p);
  if ((kvemu::thread_idx.x & 31u) != 0) return;
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c) p[r * ldm + c] = f.x[r * 16 + c];
}

}  // namespace wmma
}  // namespace nvcuda
