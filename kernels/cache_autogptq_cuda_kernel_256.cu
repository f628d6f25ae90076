// CUDA kernels for Qwen (v1)'s Int8 KV cache, written for qwen-kvprep from the interface
// description alone (see cache_autogptq_cuda_256.cpp for the Python-facing side and the
// argument checks; this file trusts its caller).
//
//   QK: mul[b,h,q,l] = sum_d vec[b,h,q,d] * scales[b,h,l] * (mat[b,h,d,l] - zeros[b,h,l])
//   PV: mul[b,h,q,d] = sum_l vec[b,h,q,l] * scales[b,h,l] * (mat[b,h,l,d] - zeros[b,h,l])
//
// Both are memory-bound during decoding: the uint8 cache is read exactly once from DRAM,
// 16 bytes per thread per load, coalesced across each warp; accumulation is fp32; every
// output element is written exactly once (no atomics, so the output need not be zeroed).
//
// Build cost matters (the extension is compiled on the user's machine, often for many
// architectures): device passes see only <cuda_fp16.h>; the torch headers needed for the
// stream, the device guard and error reporting are seen by the host pass alone. Kernels are
// plain (non-template) __global__ functions so that nothing is instantiated only from host
// code.

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace kvprep_v1 {

constexpr int kThreads = 256;        // every kernel: 8 warps
constexpr int kWarps = kThreads / 32;
constexpr int kTileL = 32 * 16;      // QK: cached tokens per block (a warp-wide row segment)
constexpr int kChunkD = 256;         // QK: rows of the query staged in shared memory at once
constexpr int kChunkL = 512;         // PV: tokens whose weights are staged at once
constexpr int kRedPad = 33;          // QK: padded row length of the reduction buffer

// Reads the 16 bytes at p, which may have any alignment, into four little-endian words.
// Bytes at index >= n_valid read as 0 and are not fetched. [lo, hi) is the whole cache
// tensor: a misaligned read is served by the two aligned 16-byte words around it when
// those lie inside the tensor (their extra bytes belong to neighbouring threads, so DRAM
// traffic stays one read per byte; the overlap is served by L1), else byte by byte.
__device__ __forceinline__ void load16(const uint8_t* p, int64_t n_valid, const uint8_t* lo,
                                       const uint8_t* hi, uint32_t w[4]) {
  const unsigned s = static_cast<unsigned>(reinterpret_cast<uintptr_t>(p) & 15u);
  if (n_valid >= 16) {
    if (s == 0) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
      w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
      return;
    }
    const uint8_t* base = p - s;
    if (base >= lo && base + 32 <= hi) {
      const uint4 a = __ldg(reinterpret_cast<const uint4*>(base));
      const uint4 b = __ldg(reinterpret_cast<const uint4*>(base + 16));
      const uint32_t W[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
      const unsigned ws = s >> 2;
      const unsigned bs = (s & 3u) * 8u;
      // Select with constant register indices only (a run-time index would spill the
      // array to local memory).
      uint32_t X[5];
#pragma unroll
      for (int i = 0; i < 5; ++i) {
        X[i] = ws == 0 ? W[i] : ws == 1 ? W[i + 1] : ws == 2 ? W[i + 2] : W[i + 3];
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) w[j] = __funnelshift_r(X[j], X[j + 1], bs);
      return;
    }
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) w[j] = 0;
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    if (k < n_valid) w[k >> 2] |= static_cast<uint32_t>(__ldg(p + k)) << (8 * (k & 3));
  }
}

// Byte k of w as a float, exactly: 0x4B0000xx is the float 2^23 + xx. A byte permute and
// an add run at full rate where an integer-to-float conversion does not.
__device__ __forceinline__ float byte_as_float(uint32_t w, int k) {
  return __int_as_float(static_cast<int>(__byte_perm(w, 0x4B000000u, 0x7540u + k))) -
         8388608.0f;
}

// QK. Block = (b·h, tile of kTileL tokens, tile of QT queries). Lane i of every warp owns
// the 16 tokens [16i, 16i+16) of the tile; the 8 warps split the D rows of the cache
// (warp w takes rows w, w+8, ...), so each row segment is one 512-byte coalesced read.
// The per-warp partial sums are added in shared memory at the end.
template <int QT>
__device__ __forceinline__ void qk_body(const __half* __restrict__ vec,
                                        const uint8_t* __restrict__ mat,
                                        __half* __restrict__ out,
                                        const __half* __restrict__ scales,
                                        const __half* __restrict__ zeros, int64_t Q,
                                        int64_t D, int64_t L, int64_t n_ltiles,
                                        int64_t n_qtiles, const uint8_t* mat_end) {
  __shared__ float s_vec[QT][kChunkD];
  __shared__ float s_red[kWarps][16 * kRedPad];

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  int64_t blk = blockIdx.x;
  const int64_t qt = blk % n_qtiles;
  blk /= n_qtiles;
  const int64_t lt = blk % n_ltiles;
  const int64_t bh = blk / n_ltiles;

  const int64_t q0 = qt * QT;
  const int64_t l_tile = lt * kTileL;
  const int64_t l_lane = l_tile + lane * 16;
  const int64_t n_valid = L - l_lane;  // tokens of this lane inside the cache (may be <= 0)
  const uint8_t* mbh = mat + bh * D * L;

  float z[16];
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    z[k] = k < n_valid ? __half2float(zeros[bh * L + l_lane + k]) : 0.0f;
  }

  float acc[QT][16];
#pragma unroll
  for (int q = 0; q < QT; ++q) {
#pragma unroll
    for (int k = 0; k < 16; ++k) acc[q][k] = 0.0f;
  }

  for (int64_t d0 = 0; d0 < D; d0 += kChunkD) {
    const int dc = static_cast<int>(D - d0 < kChunkD ? D - d0 : kChunkD);
    __syncthreads();  // the previous chunk's readers are done with s_vec
    for (int i = tid; i < QT * kChunkD; i += kThreads) {
      const int q = i / kChunkD;
      const int dd = i - q * kChunkD;
      float v = 0.0f;
      if (q0 + q < Q && dd < dc) v = __half2float(vec[(bh * Q + q0 + q) * D + d0 + dd]);
      s_vec[q][dd] = v;
    }
    __syncthreads();
    if (n_valid > 0) {
      // Four rows per step, all loads issued before the arithmetic.
      for (int r = warp; r < dc; r += 4 * kWarps) {
        uint32_t w[4][4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int rr = r + u * kWarps;
          if (rr < dc) {
            load16(mbh + (d0 + rr) * L + l_lane, n_valid, mat, mat_end, w[u]);
          } else {
            w[u][0] = w[u][1] = w[u][2] = w[u][3] = 0;
          }
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int rr = r + u * kWarps;
          if (rr < dc) {
            float m[16];
#pragma unroll
            for (int k = 0; k < 16; ++k) m[k] = byte_as_float(w[u][k >> 2], k & 3) - z[k];
#pragma unroll
            for (int q = 0; q < QT; ++q) {
              const float v = s_vec[q][rr];
#pragma unroll
              for (int k = 0; k < 16; ++k) acc[q][k] = fmaf(v, m[k], acc[q][k]);
            }
          }
        }
      }
    }
  }

#pragma unroll
  for (int q = 0; q < QT; ++q) {
    if (q0 + q < Q) {  // uniform across the block
#pragma unroll
      for (int k = 0; k < 16; ++k) s_red[warp][k * kRedPad + lane] = acc[q][k];
      __syncthreads();
      for (int j = tid; j < kTileL; j += kThreads) {
        const int64_t l = l_tile + j;
        if (l < L) {
          const int owner = j >> 4;
          const int k = j & 15;
          float sum = 0.0f;
#pragma unroll
          for (int w = 0; w < kWarps; ++w) sum += s_red[w][k * kRedPad + owner];
          out[(bh * Q + q0 + q) * L + l] =
              __float2half_rn(sum * __half2float(scales[bh * L + l]));
        }
      }
      __syncthreads();
    }
  }
}

// PV. Block = (b·h, split of the tokens, tile of QT queries, tile of head dims). `tpr`
// threads cover one cache row (16 dims each: one 16-byte load), so a warp reads 32·16
// contiguous bytes of consecutive rows; the kThreads / tpr row groups take rows r,
// r + rps, ... of each staged chunk. Partial sums of the row groups are added in shared
// memory; when the tokens are split over several blocks (to occupy the GPU when b·h is
// small), each block writes fp32 partials to `part` and pv_finalize adds them.
template <int QT>
__device__ __forceinline__ void pv_body(const __half* __restrict__ vec,
                                        const uint8_t* __restrict__ mat,
                                        __half* __restrict__ out, float* __restrict__ part,
                                        const __half* __restrict__ scales,
                                        const __half* __restrict__ zeros, int64_t Q,
                                        int64_t L, int64_t D, int tpr, int64_t n_split,
                                        int64_t rows_per_split, int64_t n_qtiles,
                                        int64_t n_dtiles, const uint8_t* mat_end) {
  __shared__ float s_w[QT][kChunkL];
  __shared__ float s_z[kChunkL];
  __shared__ float s_red[kThreads * 16 + kThreads];

  const int tid = threadIdx.x;
  const int rps = kThreads / tpr;  // rows per step
  const int g = tid / tpr;
  const int j = tid - g * tpr;
  const bool active = g < rps;

  int64_t blk = blockIdx.x;
  const int64_t dt = blk % n_dtiles;
  blk /= n_dtiles;
  const int64_t qt = blk % n_qtiles;
  blk /= n_qtiles;
  const int64_t sp = blk % n_split;
  const int64_t bh = blk / n_split;

  const int width = 16 * tpr;  // head dims per block
  const int64_t q0 = qt * QT;
  const int64_t d_lane = dt * width + 16 * j;
  const int64_t n_valid = D - d_lane;
  const int64_t l_begin = sp * rows_per_split;
  const int64_t l_end = L - l_begin < rows_per_split ? L : l_begin + rows_per_split;
  const uint8_t* mbh = mat + bh * L * D;

  float acc[QT][16];
#pragma unroll
  for (int q = 0; q < QT; ++q) {
#pragma unroll
    for (int k = 0; k < 16; ++k) acc[q][k] = 0.0f;
  }

  for (int64_t c0 = l_begin; c0 < l_end; c0 += kChunkL) {
    const int cl = static_cast<int>(l_end - c0 < kChunkL ? l_end - c0 : kChunkL);
    __syncthreads();  // the previous chunk's readers are done with s_w / s_z
    for (int i = tid; i < cl; i += kThreads) {
      const int64_t l = c0 + i;
      const float s = __half2float(scales[bh * L + l]);
      s_z[i] = __half2float(zeros[bh * L + l]);
#pragma unroll
      for (int q = 0; q < QT; ++q) {
        s_w[q][i] = q0 + q < Q ? __half2float(vec[(bh * Q + q0 + q) * L + l]) * s : 0.0f;
      }
    }
    __syncthreads();
    if (active && n_valid > 0) {
      for (int r = g; r < cl; r += 4 * rps) {
        uint32_t w[4][4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int rr = r + u * rps;
          if (rr < cl) {
            load16(mbh + (c0 + rr) * D + d_lane, n_valid, mat, mat_end, w[u]);
          } else {
            w[u][0] = w[u][1] = w[u][2] = w[u][3] = 0;
          }
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int rr = r + u * rps;
          if (rr < cl) {
            const float zr = s_z[rr];
            float m[16];
#pragma unroll
            for (int k = 0; k < 16; ++k) m[k] = byte_as_float(w[u][k >> 2], k & 3) - zr;
#pragma unroll
            for (int q = 0; q < QT; ++q) {
              const float wq = s_w[q][rr];
#pragma unroll
              for (int k = 0; k < 16; ++k) acc[q][k] = fmaf(wq, m[k], acc[q][k]);
            }
          }
        }
      }
    }
  }

  const int stride = width + 1;
#pragma unroll
  for (int q = 0; q < QT; ++q) {
    if (q0 + q < Q) {  // uniform across the block
      if (active) {
#pragma unroll
        for (int k = 0; k < 16; ++k) s_red[g * stride + 16 * j + k] = acc[q][k];
      }
      __syncthreads();
      for (int e = tid; e < width; e += kThreads) {
        const int64_t d = dt * width + e;
        if (d < D) {
          float sum = 0.0f;
          for (int gg = 0; gg < rps; ++gg) sum += s_red[gg * stride + e];
          if (part != nullptr) {
            part[((bh * n_split + sp) * Q + q0 + q) * D + d] = sum;
          } else {
            out[(bh * Q + q0 + q) * D + d] = __float2half_rn(sum);
          }
        }
      }
      __syncthreads();
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    qk_q1(const __half* vec, const uint8_t* mat, __half* out, const __half* scales,
          const __half* zeros, int64_t Q, int64_t D, int64_t L, int64_t n_ltiles,
          int64_t n_qtiles, const uint8_t* mat_end) {
  qk_body<1>(vec, mat, out, scales, zeros, Q, D, L, n_ltiles, n_qtiles, mat_end);
}

__global__ void __launch_bounds__(kThreads)
    qk_q4(const __half* vec, const uint8_t* mat, __half* out, const __half* scales,
          const __half* zeros, int64_t Q, int64_t D, int64_t L, int64_t n_ltiles,
          int64_t n_qtiles, const uint8_t* mat_end) {
  qk_body<4>(vec, mat, out, scales, zeros, Q, D, L, n_ltiles, n_qtiles, mat_end);
}

__global__ void __launch_bounds__(kThreads)
    pv_q1(const __half* vec, const uint8_t* mat, __half* out, float* part,
          const __half* scales, const __half* zeros, int64_t Q, int64_t L, int64_t D,
          int tpr, int64_t n_split, int64_t rows_per_split, int64_t n_qtiles,
          int64_t n_dtiles, const uint8_t* mat_end) {
  pv_body<1>(vec, mat, out, part, scales, zeros, Q, L, D, tpr, n_split, rows_per_split,
             n_qtiles, n_dtiles, mat_end);
}

__global__ void __launch_bounds__(kThreads)
    pv_q4(const __half* vec, const uint8_t* mat, __half* out, float* part,
          const __half* scales, const __half* zeros, int64_t Q, int64_t L, int64_t D,
          int tpr, int64_t n_split, int64_t rows_per_split, int64_t n_qtiles,
          int64_t n_dtiles, const uint8_t* mat_end) {
  pv_body<4>(vec, mat, out, part, scales, zeros, Q, L, D, tpr, n_split, rows_per_split,
             n_qtiles, n_dtiles, mat_end);
}

// Adds the per-split fp32 partials of pv_* and writes the fp16 output.
__global__ void __launch_bounds__(kThreads)
    pv_finalize(const float* __restrict__ part, __half* __restrict__ out, int64_t total,
                int64_t Q, int64_t D, int64_t n_split) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < total;
       i += step) {
    const int64_t d = i % D;
    const int64_t t = i / D;
    const int64_t q = t % Q;
    const int64_t bh = t / Q;
    const float* p = part + (bh * n_split * Q + q) * D + d;
    float sum = 0.0f;
    for (int64_t s = 0; s < n_split; ++s) sum += p[s * Q * D];
    out[i] = __float2half_rn(sum);
  }
}

// ---- launch plans: plain host arithmetic, kept apart from the CUDA/torch glue below ----

constexpr int kMaxTpr = 32;  // PV: at most one warp per cache row (512 bytes)

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

struct QkPlan {
  int qt;  // queries per block: 1 (decode) or 4
  int64_t n_ltiles;
  int64_t n_qtiles;
  int64_t blocks;
};

inline QkPlan qk_plan(int64_t BH, int64_t Q, int64_t L) {
  QkPlan p{};
  p.qt = Q == 1 ? 1 : 4;
  p.n_ltiles = ceil_div(L, kTileL);
  p.n_qtiles = ceil_div(Q, p.qt);
  p.blocks = BH * p.n_ltiles * p.n_qtiles;
  return p;
}

struct PvPlan {
  int qt;
  int tpr;  // threads per cache row
  int64_t n_qtiles;
  int64_t n_dtiles;
  int64_t n_split;  // blocks sharing one (b·h, query tile, dim tile), each over a token range
  int64_t rows_per_split;
  int64_t blocks;
  int64_t part_floats;  // fp32 partials needed when n_split > 1
};

// Splits the tokens over blocks only as far as needed to give every multiprocessor a few
// blocks: the partials cost BH·n_split·Q·D floats of extra traffic.
inline PvPlan pv_plan(int sms, int64_t BH, int64_t Q, int64_t L, int64_t D) {
  PvPlan p{};
  p.qt = Q == 1 ? 1 : 4;
  const int64_t tpr = ceil_div(D, 16);
  p.tpr = static_cast<int>(tpr < kMaxTpr ? tpr : kMaxTpr);
  p.n_qtiles = ceil_div(Q, p.qt);
  p.n_dtiles = ceil_div(D, 16 * static_cast<int64_t>(p.tpr));
  const int64_t base = BH * p.n_qtiles * p.n_dtiles;
  const int64_t n_chunks = ceil_div(L, kChunkL);
  const int64_t target = 4 * static_cast<int64_t>(sms > 0 ? sms : 1);
  int64_t split = base >= target ? 1 : ceil_div(target, base);
  if (split > n_chunks) split = n_chunks;
  p.rows_per_split = ceil_div(n_chunks, split) * kChunkL;
  p.n_split = ceil_div(L, p.rows_per_split);
  p.blocks = base * p.n_split;
  p.part_floats = p.n_split > 1 ? BH * p.n_split * Q * D : 0;
  return p;
}

inline int64_t finalize_blocks(int64_t total) {
  const int64_t b = ceil_div(total, kThreads);
  return b < 65535 ? b : 65535;
}

}  // namespace kvprep_v1

#if !defined(__CUDA_ARCH__)
// ---- host side: only the host compilation pass sees the torch headers ----
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#if defined(__GNUC__) || defined(__clang__)
#define KVPREP_CUDA_ENTRY __attribute__((visibility("hidden")))
#else
#define KVPREP_CUDA_ENTRY
#endif

namespace kvprep_v1 {
constexpr int64_t kMaxGrid = 2147483647;  // gridDim.x limit

inline int sm_count(int device) {
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}
}  // namespace kvprep_v1

// Entry points called by cache_autogptq_cuda_256.cpp, which has checked devices, dtypes,
// contiguity and shapes, and handles empty sizes (all of BH, Q, D, L are >= 1 here).
// Errors are thrown as c10::Error.

extern "C" KVPREP_CUDA_ENTRY void kvprep_v1_qk_cuda(int device, const void* vec,
                                                    const uint8_t* mat, void* mul,
                                                    const void* scales, const void* zeros,
                                                    int64_t BH, int64_t Q, int64_t D,
                                                    int64_t L) {
  using namespace kvprep_v1;
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const cudaStream_t stream =
      c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  const QkPlan p = qk_plan(BH, Q, L);
  TORCH_CHECK(p.blocks <= kMaxGrid, "vecquant8matmul_batched_faster_old: problem too large (",
              p.blocks, " thread blocks)");
  const uint8_t* mat_end = mat + BH * D * L;
  const auto* v = reinterpret_cast<const __half*>(vec);
  auto* o = reinterpret_cast<__half*>(mul);
  const auto* s = reinterpret_cast<const __half*>(scales);
  const auto* z = reinterpret_cast<const __half*>(zeros);
  const dim3 grid(static_cast<unsigned>(p.blocks));
  if (p.qt == 1) {
    qk_q1<<<grid, kThreads, 0, stream>>>(v, mat, o, s, z, Q, D, L, p.n_ltiles, p.n_qtiles,
                                         mat_end);
  } else {
    qk_q4<<<grid, kThreads, 0, stream>>>(v, mat, o, s, z, Q, D, L, p.n_ltiles, p.n_qtiles,
                                         mat_end);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

extern "C" KVPREP_CUDA_ENTRY int64_t kvprep_v1_pv_workspace_floats(int device, int64_t BH,
                                                                   int64_t Q, int64_t L,
                                                                   int64_t D) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  return kvprep_v1::pv_plan(kvprep_v1::sm_count(device), BH, Q, L, D).part_floats;
}

extern "C" KVPREP_CUDA_ENTRY void kvprep_v1_pv_cuda(int device, const void* vec,
                                                    const uint8_t* mat, void* mul,
                                                    const void* scales, const void* zeros,
                                                    float* workspace,
                                                    int64_t workspace_floats, int64_t BH,
                                                    int64_t Q, int64_t L, int64_t D) {
  using namespace kvprep_v1;
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const cudaStream_t stream =
      c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  const PvPlan p = pv_plan(sm_count(device), BH, Q, L, D);
  TORCH_CHECK(p.blocks <= kMaxGrid,
              "vecquant8matmul_batched_column_compression_faster_old: problem too large (",
              p.blocks, " thread blocks)");
  TORCH_CHECK(p.part_floats <= workspace_floats && (p.part_floats == 0 || workspace),
              "vecquant8matmul_batched_column_compression_faster_old: workspace of ",
              workspace_floats, " floats is smaller than the ", p.part_floats, " needed");
  float* part = p.part_floats > 0 ? workspace : nullptr;
  const uint8_t* mat_end = mat + BH * L * D;
  const auto* v = reinterpret_cast<const __half*>(vec);
  auto* o = reinterpret_cast<__half*>(mul);
  const auto* s = reinterpret_cast<const __half*>(scales);
  const auto* z = reinterpret_cast<const __half*>(zeros);
  const dim3 grid(static_cast<unsigned>(p.blocks));
  if (p.qt == 1) {
    pv_q1<<<grid, kThreads, 0, stream>>>(v, mat, o, part, s, z, Q, L, D, p.tpr, p.n_split,
                                         p.rows_per_split, p.n_qtiles, p.n_dtiles, mat_end);
  } else {
    pv_q4<<<grid, kThreads, 0, stream>>>(v, mat, o, part, s, z, Q, L, D, p.tpr, p.n_split,
                                         p.rows_per_split, p.n_qtiles, p.n_dtiles, mat_end);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (part != nullptr) {
    const int64_t total = BH * Q * D;
    pv_finalize<<<static_cast<unsigned>(finalize_blocks(total)), kThreads, 0, stream>>>(
        part, o, total, Q, D, p.n_split);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}
#endif  // !defined(__CUDA_ARCH__)
