// CUDA kernels for Qwen (v1)'s Int8 KV cache, written for qwen-kvprep from the interface
// description alone (see cache_autogptq_cuda_256.cpp for the Python-facing side and the
// argument checks; this file trusts its caller).
//
//   QK: mul[b,h,q,l] = sum_d vec[b,h,q,d] * scales[b,h,l] * (mat[b,h,d,l] - zeros[b,h,l])
//   PV: mul[b,h,q,d] = sum_l vec[b,h,q,l] * scales[b,h,l] * (mat[b,h,l,d] - zeros[b,h,l])
//
// The cache may be the first L tokens of buffers with room for C >= L tokens per head (a
// caller that appends in place): C is the pitch of the token axis of mat (QK: its row
// length; PV: its rows per head) and of scales / zeros; C == L for contiguous tensors.
// quantize_append (below) fills such buffers.
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
#include <mma.h>

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
                                        int64_t D, int64_t L, int64_t C, int64_t n_ltiles,
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
  const uint8_t* mbh = mat + bh * D * C;

  float z[16];
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    z[k] = k < n_valid ? __half2float(zeros[bh * C + l_lane + k]) : 0.0f;
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
            load16(mbh + (d0 + rr) * C + l_lane, n_valid, mat, mat_end, w[u]);
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
              __float2half_rn(sum * __half2float(scales[bh * C + l]));
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
                                        int64_t L, int64_t C, int64_t D, int tpr,
                                        int64_t n_split,
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
  const uint8_t* mbh = mat + bh * C * D;

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
      const float s = __half2float(scales[bh * C + l]);
      s_z[i] = __half2float(zeros[bh * C + l]);
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
          const __half* zeros, int64_t Q, int64_t D, int64_t L, int64_t C,
          int64_t n_ltiles, int64_t n_qtiles, const uint8_t* mat_end) {
  qk_body<1>(vec, mat, out, scales, zeros, Q, D, L, C, n_ltiles, n_qtiles, mat_end);
}

__global__ void __launch_bounds__(kThreads)
    qk_q4(const __half* vec, const uint8_t* mat, __half* out, const __half* scales,
          const __half* zeros, int64_t Q, int64_t D, int64_t L, int64_t C,
          int64_t n_ltiles, int64_t n_qtiles, const uint8_t* mat_end) {
  qk_body<4>(vec, mat, out, scales, zeros, Q, D, L, C, n_ltiles, n_qtiles, mat_end);
}

__global__ void __launch_bounds__(kThreads)
    pv_q1(const __half* vec, const uint8_t* mat, __half* out, float* part,
          const __half* scales, const __half* zeros, int64_t Q, int64_t L, int64_t C,
          int64_t D, int tpr, int64_t n_split, int64_t rows_per_split, int64_t n_qtiles,
          int64_t n_dtiles, const uint8_t* mat_end) {
  pv_body<1>(vec, mat, out, part, scales, zeros, Q, L, C, D, tpr, n_split, rows_per_split,
             n_qtiles, n_dtiles, mat_end);
}

__global__ void __launch_bounds__(kThreads)
    pv_q4(const __half* vec, const uint8_t* mat, __half* out, float* part,
          const __half* scales, const __half* zeros, int64_t Q, int64_t L, int64_t C,
          int64_t D, int tpr, int64_t n_split, int64_t rows_per_split, int64_t n_qtiles,
          int64_t n_dtiles, const uint8_t* mat_end) {
  pv_body<4>(vec, mat, out, part, scales, zeros, Q, L, C, D, tpr, n_split, rows_per_split,
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


// ---- tensor-core path for long query blocks (prefill, chunked prefill) ----------------
//
// With many queries per cached token the work is arithmetic, not bytes: the CUDA-core
// kernels above reach only the fp32 FMA rate, and the fallback (dequantize, then an fp16
// matmul on tensor cores) wins. Here a block dequantizes a tile of the cache into fp16 in
// shared memory and multiplies it on tensor cores (WMMA, sm_70 and newer), fp32
// accumulation. Both keep the CUDA-core path's accuracy:
//
//   QK  acc[q,l] = sum_d vec[q,d] * mat[d,l]   (the uint8 codes are exact in fp16)
//       mul[q,l] = scales[l] * (acc[q,l] - zeros[l] * sum_d vec[q,d])     in fp32
//   PV  B[l,d]  = f * scales[l] * (mat[l,d] - zeros[l])  in fp32, split into two fp16
//       operands hi + lo (hi = fp16(B), lo = fp16(B - hi)), so the product keeps about
//       22 bits; f is a power of two that puts the block's largest |B| near 2^13, so
//       neither part falls into fp16's subnormal range. mul[q,d] = (vec x (hi + lo))[q,d] / f.
//       With `hilo` off, B is rounded to fp16 once (like the fallback's dequantize).
//
// Tiles: 64 queries x BN columns per block, 8 warps as 2 (rows) x 4 (columns), the
// reduction dimension staged 32 at a time, double-buffered through registers.

constexpr int kTcBM = 64;
constexpr int kTcK = 32;
constexpr int kTcLdA = kTcK + 8;  // padded rows: fewer shared-memory bank conflicts
constexpr int kTcEpiLd = 20;      // per-warp 16x16 fp32 staging tile, padded
constexpr int kTcQkBN = 256;      // QK: cached tokens per block
constexpr int kTcPvBN = 128;      // PV: head dims per block
constexpr int kTcFlush = 16;      // PV: chunks (512 tokens) per tensor-core partial sum

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 700
#define KVPREP_HAVE_WMMA 1
#else
#define KVPREP_HAVE_WMMA 0
#endif

// 8 fp16 of row `r` of a row-major matrix, columns [k, k+8); zeros outside [0, k_end).
__device__ __forceinline__ uint4 tc_load_a8(const __half* __restrict__ row, int64_t k,
                                            int64_t k_end, bool vec_ok, float* rowsum) {
  uint4 out;
  __half* h = reinterpret_cast<__half*>(&out);
  if (vec_ok && k + 8 <= k_end) {
    out = *reinterpret_cast<const uint4*>(row + k);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) h[i] = k + i < k_end ? row[k + i] : __float2half_rn(0.0f);
  }
  if (rowsum != nullptr) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) s += __half2float(h[i]);
    *rowsum += s;
  }
  return out;
}

// Shared memory of one tensor-core block: two stages of the A and B tiles, later reused
// as the per-warp epilogue staging tiles.
template <int BN, bool HILO>
struct TcSmem {
  static constexpr int kLdB = BN + 8;
  static constexpr int kA = kTcBM * kTcLdA;          // halves per A stage
  static constexpr int kB = kTcK * kLdB;             // halves per B stage (per part)
  static constexpr int kStage = kA + kB * (HILO ? 2 : 1);
  static constexpr int kBytes = 2 * kStage * 2;
  static constexpr int kEpiBytes = kWarps * 16 * kTcEpiLd * 4;
  static constexpr int kTotal = kBytes > kEpiBytes ? kBytes : kEpiBytes;
};

#if KVPREP_HAVE_WMMA
// One staged K-chunk of the block's product: warp (wm, wn) multiplies its 32 rows of A by
// its BN/4 columns of B (and of B's low part).
template <int BN, bool HILO>
__device__ __forceinline__ void tc_mma_chunk(
    const __half* As, const __half* Bs, const __half* Bs_lo, int wm, int wn,
    nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> (&acc)[2][BN / 64]) {
  using namespace nvcuda;
  constexpr int FN = BN / 64;
  constexpr int kLdB = TcSmem<BN, HILO>::kLdB;
#pragma unroll
  for (int kk = 0; kk < kTcK; kk += 16) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      wmma::load_matrix_sync(a[i], As + (wm * 32 + i * 16) * kTcLdA + kk, kTcLdA);
    }
#pragma unroll
    for (int j = 0; j < FN; ++j) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> b;
      wmma::load_matrix_sync(b, Bs + kk * kLdB + wn * (BN / 4) + j * 16, kLdB);
#pragma unroll
      for (int i = 0; i < 2; ++i) wmma::mma_sync(acc[i][j], a[i], b, acc[i][j]);
      if (HILO) {
        wmma::load_matrix_sync(b, Bs_lo + kk * kLdB + wn * (BN / 4) + j * 16, kLdB);
#pragma unroll
        for (int i = 0; i < 2; ++i) wmma::mma_sync(acc[i][j], a[i], b, acc[i][j]);
      }
    }
  }
}
#endif

// QK on tensor cores. Block = (b·h, tile of kTcQkBN tokens, tile of kTcBM queries).
__device__ __forceinline__ void tc_qk_body(const __half* __restrict__ vec,
                                           const uint8_t* __restrict__ mat,
                                           __half* __restrict__ out,
                                           const __half* __restrict__ scales,
                                           const __half* __restrict__ zeros, int64_t Q,
                                           int64_t D, int64_t L, int64_t C,
                                           int64_t n_ltiles, int64_t n_qtiles, bool vec_ok,
                                           bool out_ok, const uint8_t* mat_end) {
#if KVPREP_HAVE_WMMA
  using namespace nvcuda;
  constexpr int BN = kTcQkBN;
  using S = TcSmem<BN, false>;
  constexpr int FN = BN / 64;
  constexpr int kVecPerThread = BN / 128;  // 16-byte cache loads per thread per chunk
  __shared__ __align__(128) unsigned char smem[S::kTotal];
  __shared__ float s_scale[BN];
  __shared__ float s_zero[BN];
  __shared__ float s_rowsum[kTcBM * 4];

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int wm = warp >> 2;
  const int wn = warp & 3;
  int64_t blk = blockIdx.x;
  const int64_t qt = blk % n_qtiles;
  blk /= n_qtiles;
  const int64_t lt = blk % n_ltiles;
  const int64_t bh = blk / n_ltiles;
  const int64_t q0 = qt * kTcBM;
  const int64_t l0 = lt * BN;
  const uint8_t* mbh = mat + bh * D * C;

  for (int i = tid; i < BN; i += kThreads) {
    const int64_t l = l0 + i;
    s_scale[i] = l < L ? __half2float(scales[bh * C + l]) : 0.0f;
    s_zero[i] = l < L ? __half2float(zeros[bh * C + l]) : 0.0f;
  }

  // Thread t stages 8 query values of row t/4 and 16-byte cache segments of the chunk.
  const int a_row = tid >> 2;
  const int a_col = (tid & 3) * 8;
  const bool a_valid = q0 + a_row < Q;
  const __half* a_src = vec + (bh * Q + q0 + (a_valid ? a_row : 0)) * D;
  float rowsum = 0.0f;

  uint4 a_reg;
  uint32_t b_reg[kVecPerThread][4];
  auto fetch = [&](int64_t k0) {
    a_reg = a_valid ? tc_load_a8(a_src, k0 + a_col, D, vec_ok, &rowsum) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int v = 0; v < kVecPerThread; ++v) {
      const int idx = tid + v * kThreads;
      const int r = idx / (BN / 16);
      const int c = (idx % (BN / 16)) * 16;
      const int64_t d = k0 + r;
      const int64_t n_valid = L - (l0 + c);
      if (d < D && n_valid > 0) {
        load16(mbh + d * C + l0 + c, n_valid, mat, mat_end, b_reg[v]);
      } else {
        b_reg[v][0] = b_reg[v][1] = b_reg[v][2] = b_reg[v][3] = 0;
      }
    }
  };
  auto stash = [&](int stage) {
    __half* As = reinterpret_cast<__half*>(smem) + stage * S::kStage;
    __half* Bs = As + S::kA;
    *reinterpret_cast<uint4*>(As + a_row * kTcLdA + a_col) = a_reg;
#pragma unroll
    for (int v = 0; v < kVecPerThread; ++v) {
      const int idx = tid + v * kThreads;
      const int r = idx / (BN / 16);
      const int c = (idx % (BN / 16)) * 16;
      uint4 h[2];
      __half* hh = reinterpret_cast<__half*>(h);
#pragma unroll
      for (int k = 0; k < 16; ++k) hh[k] = __float2half_rn(byte_as_float(b_reg[v][k >> 2], k & 3));
      uint4* dst = reinterpret_cast<uint4*>(Bs + r * S::kLdB + c);
      dst[0] = h[0];
      dst[1] = h[1];
    }
  };

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][FN];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < FN; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
  }

  const int64_t n_chunks = (D + kTcK - 1) / kTcK;
  fetch(0);
  stash(0);
  __syncthreads();
  for (int64_t c = 0; c < n_chunks; ++c) {
    const int stage = static_cast<int>(c & 1);
    if (c + 1 < n_chunks) fetch((c + 1) * kTcK);  // global loads in flight during the MMAs
    const __half* As = reinterpret_cast<const __half*>(smem) + stage * S::kStage;
    tc_mma_chunk<BN, false>(As, As + S::kA, nullptr, wm, wn, acc);
    if (c + 1 < n_chunks) stash(stage ^ 1);
    __syncthreads();
  }

  s_rowsum[tid] = rowsum;  // 4 partial sums per query row (thread t: row t/4)
  __syncthreads();
  float* stage_buf = reinterpret_cast<float*>(smem) + warp * 16 * kTcEpiLd;
  const int er = lane >> 1;
  const int ec = (lane & 1) * 8;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = wm * 32 + i * 16 + er;
    const int64_t q = q0 + row;
    const float rs = s_rowsum[row * 4] + s_rowsum[row * 4 + 1] + s_rowsum[row * 4 + 2] +
                     s_rowsum[row * 4 + 3];
#pragma unroll
    for (int j = 0; j < FN; ++j) {
      wmma::store_matrix_sync(stage_buf, acc[i][j], kTcEpiLd, wmma::mem_row_major);
      __syncwarp();
      const int col = wn * (BN / 4) + j * 16 + ec;
      const int64_t l = l0 + col;
      if (q < Q && l < L) {
        uint4 o;
        __half* oh = reinterpret_cast<__half*>(&o);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float v = stage_buf[er * kTcEpiLd + ec + e];
          oh[e] = __float2half_rn(s_scale[col + e] * (v - s_zero[col + e] * rs));
        }
        __half* dst = out + (bh * Q + q) * L + l;
        if (out_ok && l + 8 <= L) {
          *reinterpret_cast<uint4*>(dst) = o;
        } else {
          for (int e = 0; e < 8 && l + e < L; ++e) dst[e] = oh[e];
        }
      }
      __syncwarp();
    }
  }
#endif
}

// PV on tensor cores. Block = (b·h, split of the tokens, tile of kTcBM queries, tile of
// kTcPvBN head dims). With several splits the block writes fp32 partials (pv_finalize).
template <bool HILO>
__device__ __forceinline__ void tc_pv_body(const __half* __restrict__ vec,
                                           const uint8_t* __restrict__ mat,
                                           __half* __restrict__ out, float* __restrict__ part,
                                           const __half* __restrict__ scales,
                                           const __half* __restrict__ zeros, int64_t Q,
                                           int64_t L, int64_t C, int64_t D, int64_t n_split,
                                           int64_t rows_per_split, int64_t n_qtiles,
                                           int64_t n_dtiles, bool vec_ok, bool out_ok,
                                           const uint8_t* mat_end) {
#if KVPREP_HAVE_WMMA
  using namespace nvcuda;
  constexpr int BN = kTcPvBN;
  using S = TcSmem<BN, HILO>;
  constexpr int FN = BN / 64;
  constexpr int kVecPerThread = BN / 128;
  __shared__ __align__(128) unsigned char smem[S::kTotal];
  __shared__ float s_max[kThreads];

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int wm = warp >> 2;
  const int wn = warp & 3;
  int64_t blk = blockIdx.x;
  const int64_t dt = blk % n_dtiles;
  blk /= n_dtiles;
  const int64_t qt = blk % n_qtiles;
  blk /= n_qtiles;
  const int64_t sp = blk % n_split;
  const int64_t bh = blk / n_split;
  const int64_t q0 = qt * kTcBM;
  const int64_t d0 = dt * BN;
  const int64_t l_begin = sp * rows_per_split;
  const int64_t l_end = L - l_begin < rows_per_split ? L : l_begin + rows_per_split;
  const uint8_t* mbh = mat + bh * C * D;
  const __half* sbh = scales + bh * C;
  const __half* zbh = zeros + bh * C;

  // f: the power of two that brings the largest |scale * (code - zero)| of this block's
  // tokens near 2^13 (codes are 0..255).
  float m = 0.0f;
  for (int64_t l = l_begin + tid; l < l_end; l += kThreads) {
    const float z = __half2float(zbh[l]);
    const float b = fabsf(__half2float(sbh[l])) * fmaxf(fabsf(z), fabsf(255.0f - z));
    m = b > m ? b : m;  // NaN and inf are left to the products (as in the fallback)
  }
  s_max[tid] = m;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w >>= 1) {
    if (tid < w) s_max[tid] = fmaxf(s_max[tid], s_max[tid + w]);
    __syncthreads();
  }
  const float mx = s_max[0];
  int e = 0;
  float f = 1.0f;
  if (mx > 0.0f && mx < 3.0e38f) {
    frexpf(mx, &e);  // mx = m * 2^e, m in [0.5, 1)
    f = ldexpf(1.0f, 13 - e);
  }
  const float inv_f = 1.0f / f;

  const int a_row = tid >> 2;
  const int a_col = (tid & 3) * 8;
  const bool a_valid = q0 + a_row < Q;
  const __half* a_src = vec + (bh * Q + q0 + (a_valid ? a_row : 0)) * L;

  uint4 a_reg;
  uint32_t b_reg[kVecPerThread][4];
  float b_z[kVecPerThread];
  float b_s[kVecPerThread];
  auto fetch = [&](int64_t k0) {
    a_reg = a_valid ? tc_load_a8(a_src, k0 + a_col, l_end, vec_ok, nullptr)
                    : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int v = 0; v < kVecPerThread; ++v) {
      const int idx = tid + v * kThreads;
      const int r = idx / (BN / 16);
      const int c = (idx % (BN / 16)) * 16;
      const int64_t l = k0 + r;
      const int64_t n_valid = D - (d0 + c);
      if (l < l_end && n_valid > 0) {
        load16(mbh + l * D + d0 + c, n_valid, mat, mat_end, b_reg[v]);
        b_z[v] = __half2float(zbh[l]);
        b_s[v] = __half2float(sbh[l]) * f;
      } else {
        b_reg[v][0] = b_reg[v][1] = b_reg[v][2] = b_reg[v][3] = 0;
        b_z[v] = 0.0f;
        b_s[v] = 0.0f;
      }
    }
  };
  auto stash = [&](int stage) {
    __half* As = reinterpret_cast<__half*>(smem) + stage * S::kStage;
    __half* Bs = As + S::kA;
    *reinterpret_cast<uint4*>(As + a_row * kTcLdA + a_col) = a_reg;
#pragma unroll
    for (int v = 0; v < kVecPerThread; ++v) {
      const int idx = tid + v * kThreads;
      const int r = idx / (BN / 16);
      const int c = (idx % (BN / 16)) * 16;
      uint4 hi[2];
      uint4 lo[2];
      __half* hh = reinterpret_cast<__half*>(hi);
      __half* lh = reinterpret_cast<__half*>(lo);
#pragma unroll
      for (int k = 0; k < 16; ++k) {
        const float x = (byte_as_float(b_reg[v][k >> 2], k & 3) - b_z[v]) * b_s[v];
        hh[k] = __float2half_rn(x);
        if (HILO) lh[k] = __float2half_rn(x - __half2float(hh[k]));
      }
      uint4* dst = reinterpret_cast<uint4*>(Bs + r * S::kLdB + c);
      dst[0] = hi[0];
      dst[1] = hi[1];
      if (HILO) {
        uint4* dlo = reinterpret_cast<uint4*>(Bs + S::kB + r * S::kLdB + c);
        dlo[0] = lo[0];
        dlo[1] = lo[1];
      }
    }
  };

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][FN];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < FN; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
  }

  // Tensor cores round their fp32 sums less carefully than FMA units; over tens of
  // thousands of tokens that drifts past fp32 accuracy. So every kTcFlush chunks the
  // fragments are added into plain fp32 totals and restarted from zero.
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> total[2][FN];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < FN; ++j) wmma::fill_fragment(total[i][j], 0.0f);
  }
  const int64_t n_chunks = (l_end - l_begin + kTcK - 1) / kTcK;
  fetch(l_begin);
  stash(0);
  __syncthreads();
  for (int64_t c = 0; c < n_chunks; ++c) {
    const int stage = static_cast<int>(c & 1);
    if (c + 1 < n_chunks) fetch(l_begin + (c + 1) * kTcK);
    const __half* As = reinterpret_cast<const __half*>(smem) + stage * S::kStage;
    tc_mma_chunk<BN, HILO>(As, As + S::kA, As + S::kA + S::kB, wm, wn, acc);
    if (c + 1 < n_chunks) stash(stage ^ 1);
    if ((c + 1) % kTcFlush == 0 || c + 1 == n_chunks) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int j = 0; j < FN; ++j) {
#pragma unroll
          for (int t = 0; t < acc[i][j].num_elements; ++t) total[i][j].x[t] += acc[i][j].x[t];
          wmma::fill_fragment(acc[i][j], 0.0f);
        }
      }
    }
    __syncthreads();
  }

  float* stage_buf = reinterpret_cast<float*>(smem) + warp * 16 * kTcEpiLd;
  const int er = lane >> 1;
  const int ec = (lane & 1) * 8;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t q = q0 + wm * 32 + i * 16 + er;
#pragma unroll
    for (int j = 0; j < FN; ++j) {
      wmma::store_matrix_sync(stage_buf, total[i][j], kTcEpiLd, wmma::mem_row_major);
      __syncwarp();
      const int64_t d = d0 + wn * (BN / 4) + j * 16 + ec;
      if (q < Q && d < D) {
        const float* src = stage_buf + er * kTcEpiLd + ec;
        if (part != nullptr) {
          float* dst = part + ((bh * n_split + sp) * Q + q) * D + d;
          for (int k = 0; k < 8 && d + k < D; ++k) dst[k] = src[k] * inv_f;
        } else {
          uint4 o;
          __half* oh = reinterpret_cast<__half*>(&o);
#pragma unroll
          for (int k = 0; k < 8; ++k) oh[k] = __float2half_rn(src[k] * inv_f);
          __half* dst = out + (bh * Q + q) * D + d;
          if (out_ok && d + 8 <= D) {
            *reinterpret_cast<uint4*>(dst) = o;
          } else {
            for (int k = 0; k < 8 && d + k < D; ++k) dst[k] = oh[k];
          }
        }
      }
      __syncwarp();
    }
  }
#endif
}

__global__ void __launch_bounds__(kThreads)
    tc_qk(const __half* vec, const uint8_t* mat, __half* out, const __half* scales,
          const __half* zeros, int64_t Q, int64_t D, int64_t L, int64_t C,
          int64_t n_ltiles, int64_t n_qtiles, bool vec_ok, bool out_ok,
          const uint8_t* mat_end) {
  tc_qk_body(vec, mat, out, scales, zeros, Q, D, L, C, n_ltiles, n_qtiles, vec_ok, out_ok,
             mat_end);
}

__global__ void __launch_bounds__(kThreads)
    tc_pv_hilo(const __half* vec, const uint8_t* mat, __half* out, float* part,
               const __half* scales, const __half* zeros, int64_t Q, int64_t L,
               int64_t C, int64_t D, int64_t n_split, int64_t rows_per_split,
               int64_t n_qtiles, int64_t n_dtiles, bool vec_ok, bool out_ok,
               const uint8_t* mat_end) {
  tc_pv_body<true>(vec, mat, out, part, scales, zeros, Q, L, C, D, n_split, rows_per_split,
                   n_qtiles, n_dtiles, vec_ok, out_ok, mat_end);
}

__global__ void __launch_bounds__(kThreads)
    tc_pv_single(const __half* vec, const uint8_t* mat, __half* out, float* part,
                 const __half* scales, const __half* zeros, int64_t Q, int64_t L,
                 int64_t C, int64_t D, int64_t n_split, int64_t rows_per_split,
                 int64_t n_qtiles, int64_t n_dtiles, bool vec_ok, bool out_ok,
                 const uint8_t* mat_end) {
  tc_pv_body<false>(vec, mat, out, part, scales, zeros, Q, L, C, D, n_split, rows_per_split,
                    n_qtiles, n_dtiles, vec_ok, out_ok, mat_end);
}

// ---- dequantize-to-workspace path for long query blocks --------------------------------
//
// From some query length on, cuBLAS's own tensor-core GEMM beats any kernel that must
// dequantize as it goes. The cache is then expanded once into an fp16 workspace,
// W = fp16(scales * (mat - zeros)) (each value rounded once, as the fallback's dequantize
// does, which rounds twice), and the caller multiplies with torch's matmul. `per_col`:
// the scale belongs to the column (QK's [D, L] layout) rather than the row (PV's [L, D]).
// `cap`: the token-axis capacity of the cache's buffer (the row pitch of QK's layout, the
// rows per head of PV's, and the pitch of scales/zeros per head); `out` is contiguous
// [BH, R, C].
__device__ __forceinline__ void dequant_body(const uint8_t* __restrict__ mat,
                                             const __half* __restrict__ scales,
                                             const __half* __restrict__ zeros,
                                             __half* __restrict__ out, int64_t BH, int64_t R,
                                             int64_t C, int64_t cap, bool per_col,
                                             bool out_ok, const uint8_t* mat_end) {
  const int64_t segs = (C + 15) / 16;  // 16-byte segments per row
  const int64_t total = BH * R * segs;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < total;
       i += step) {
    const int64_t seg = i % segs;
    const int64_t row = i / segs;  // bh * R + r
    const int64_t bh = row / R;
    const int64_t r = row - bh * R;
    const int64_t c0 = seg * 16;
    const int64_t n_valid = C - c0;
    uint32_t w[4];
    const uint8_t* src = per_col ? mat + row * cap + c0 : mat + (bh * cap + r) * C + c0;
    load16(src, n_valid, mat, mat_end, w);
    uint4 o[2];
    __half* oh = reinterpret_cast<__half*>(o);
    if (per_col) {
#pragma unroll
      for (int k = 0; k < 16; ++k) {
        const int64_t c = c0 + k < C ? c0 + k : C - 1;
        const float sc = __half2float(scales[bh * cap + c]);
        const float z = __half2float(zeros[bh * cap + c]);
        oh[k] = __float2half_rn(sc * (byte_as_float(w[k >> 2], k & 3) - z));
      }
    } else {
      const float sc = __half2float(scales[bh * cap + r]);
      const float z = __half2float(zeros[bh * cap + r]);
#pragma unroll
      for (int k = 0; k < 16; ++k) {
        oh[k] = __float2half_rn(sc * (byte_as_float(w[k >> 2], k & 3) - z));
      }
    }
    __half* dst = out + row * C + c0;
    if (out_ok && n_valid >= 16) {
      reinterpret_cast<uint4*>(dst)[0] = o[0];
      reinterpret_cast<uint4*>(dst)[1] = o[1];
    } else {
      for (int k = 0; k < 16 && k < n_valid; ++k) dst[k] = oh[k];
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    dequant(const uint8_t* mat, const __half* scales, const __half* zeros, __half* out,
            int64_t BH, int64_t R, int64_t C, int64_t cap, bool per_col, bool out_ok,
            const uint8_t* mat_end) {
  dequant_body(mat, scales, zeros, out, BH, R, C, cap, per_col, out_ok, mat_end);
}

// ---- quantize_append: new keys or values into preallocated capacity buffers -----------
//
// x [B, S, H, D] (any element strides, fp32 / fp16 / bf16) is quantized the way the model
// does it and written at token positions [pos, pos + S) of codes ([B, H, C, D], or the key
// layout [B, H, D, C]) and of scales / zeros ([B, H, C, 1] fp16). One block per group:
// (b, h) over all S·D values of the chunk, or (b, h, s) over the D values of one token with
// per_token. Each operation is done in fp32 and rounded to x's dtype, as torch's eager
// CUDA ops do: mn / mx (NaN wins, as amin / amax), scale = (mx - mn) · fp32(1/255) (torch on
// CUDA divides by a CPU scalar as a multiplication by its reciprocal), zero = 0 - mn / scale,
// q = trunc(clamp(x / scale + zero, 0, 255)). The explicit _rn intrinsics keep
// --use_fast_math from approximating the divisions or fusing a multiply and an add.

constexpr int kQaF32 = 0;
constexpr int kQaF16 = 1;
constexpr int kQaBF16 = 2;

__device__ __forceinline__ float qa_load(const void* x, int64_t off, int dtype) {
  if (dtype == kQaF16) return __half2float(static_cast<const __half*>(x)[off]);
  if (dtype == kQaBF16) {
    return __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(x)[off]) << 16);
  }
  return static_cast<const float*>(x)[off];
}

// An fp32 result rounded to x's dtype (round to nearest even), back as fp32.
__device__ __forceinline__ float qa_round(float v, int dtype) {
  if (dtype == kQaF32) return v;
  if (dtype == kQaF16) return __half2float(__float2half_rn(v));
  uint32_t u = __float_as_uint(v);  // bf16
  if ((u & 0x7fffffffu) > 0x7f800000u) return v;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return __uint_as_float(u & 0xffff0000u);
}

__device__ __forceinline__ float qa_max(float a, float b) { return a > b || a != a ? a : b; }
__device__ __forceinline__ float qa_min(float a, float b) { return a < b || a != a ? a : b; }

// clamp to [0, 255], then truncate toward zero (NaN gives 0, as the conversion does).
__device__ __forceinline__ uint8_t qa_code(float t) {
  if (!(t > 0.0f)) return 0;
  if (t >= 255.0f) return 255;
  return static_cast<uint8_t>(static_cast<int>(t));
}

__device__ __forceinline__ void qa_body(const void* __restrict__ x, int dtype, int64_t xs_b,
                                        int64_t xs_s, int64_t xs_h, int64_t xs_d, int64_t H,
                                        int64_t S, int64_t D, uint8_t* __restrict__ codes,
                                        __half* __restrict__ scales,
                                        __half* __restrict__ zeros, int64_t C, int64_t pos,
                                        bool key_layout, bool per_token) {
  __shared__ float s_mn[kThreads];
  __shared__ float s_mx[kThreads];
  const int tid = threadIdx.x;
  int64_t g = blockIdx.x;
  int64_t s0 = 0;
  int64_t ns = S;
  if (per_token) {
    s0 = g % S;
    g /= S;
    ns = 1;
  }
  const int64_t h = g % H;
  const int64_t b = g / H;
  const int64_t n = ns * D;
  const int64_t xbase = b * xs_b + h * xs_h + s0 * xs_s;
  // Element i of the group: token s, dim d. The key layout stores a token's D codes C
  // bytes apart, so there consecutive threads take consecutive tokens.
  auto coords = [&](int64_t i, int64_t& s, int64_t& d) {
    if (key_layout) {
      d = i / ns;
      s = i - d * ns;
    } else {
      s = i / D;
      d = i - s * D;
    }
  };

  const float inf = __int_as_float(0x7f800000);
  float mn = inf;
  float mx = -inf;
  for (int64_t i = tid; i < n; i += kThreads) {
    int64_t s, d;
    coords(i, s, d);
    const float v = qa_load(x, xbase + s * xs_s + d * xs_d, dtype);
    mn = qa_min(mn, v);
    mx = qa_max(mx, v);
  }
  s_mn[tid] = mn;
  s_mx[tid] = mx;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w >>= 1) {
    if (tid < w) {
      s_mn[tid] = qa_min(s_mn[tid], s_mn[tid + w]);
      s_mx[tid] = qa_max(s_mx[tid], s_mx[tid + w]);
    }
    __syncthreads();
  }
  mn = s_mn[0];
  mx = s_mx[0];
  constexpr float kInv255 = 0x1.010102p-8f;  // fp32(1 / 255), correctly rounded
  const float scale = qa_round(__fmul_rn(qa_round(__fsub_rn(mx, mn), dtype), kInv255), dtype);
  const float zero = qa_round(__fsub_rn(0.0f, qa_round(__fdiv_rn(mn, scale), dtype)), dtype);

  const int64_t head = b * H + h;
  for (int64_t s = tid; s < ns; s += kThreads) {
    scales[head * C + pos + s0 + s] = __float2half_rn(scale);
    zeros[head * C + pos + s0 + s] = __float2half_rn(zero);
  }
  for (int64_t i = tid; i < n; i += kThreads) {
    int64_t s, d;
    coords(i, s, d);
    const float v = qa_load(x, xbase + s * xs_s + d * xs_d, dtype);
    const float t = qa_round(__fadd_rn(qa_round(__fdiv_rn(v, scale), dtype), zero), dtype);
    const int64_t p = pos + s0 + s;
    codes[key_layout ? (head * D + d) * C + p : (head * C + p) * D + d] = qa_code(t);
  }
}

__global__ void __launch_bounds__(kThreads)
    quantize_append(const void* x, int dtype, int64_t xs_b, int64_t xs_s, int64_t xs_h,
                    int64_t xs_d, int64_t H, int64_t S, int64_t D, uint8_t* codes,
                    __half* scales, __half* zeros, int64_t C, int64_t pos, bool key_layout,
                    bool per_token) {
  qa_body(x, dtype, xs_b, xs_s, xs_h, xs_d, H, S, D, codes, scales, zeros, C, pos, key_layout,
          per_token);
}

inline int64_t quantize_append_blocks(int64_t B, int64_t H, int64_t S, bool per_token) {
  return B * H * (per_token ? S : 1);
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

// Tensor-core plans.
struct TcQkPlan {
  int64_t n_ltiles;
  int64_t n_qtiles;
  int64_t blocks;
};

inline TcQkPlan tc_qk_plan(int64_t BH, int64_t Q, int64_t L) {
  TcQkPlan p{};
  p.n_ltiles = ceil_div(L, kTcQkBN);
  p.n_qtiles = ceil_div(Q, kTcBM);
  p.blocks = BH * p.n_ltiles * p.n_qtiles;
  return p;
}

struct TcPvPlan {
  int64_t n_qtiles;
  int64_t n_dtiles;
  int64_t n_split;
  int64_t rows_per_split;  // a multiple of kTcK
  int64_t blocks;
  int64_t part_floats;
};

// Splits the tokens over blocks until about two blocks per multiprocessor are in flight.
inline TcPvPlan tc_pv_plan(int sms, int64_t BH, int64_t Q, int64_t L, int64_t D) {
  TcPvPlan p{};
  p.n_qtiles = ceil_div(Q, kTcBM);
  p.n_dtiles = ceil_div(D, kTcPvBN);
  const int64_t base = BH * p.n_qtiles * p.n_dtiles;
  const int64_t n_chunks = ceil_div(L, kTcK);
  const int64_t target = 2 * static_cast<int64_t>(sms > 0 ? sms : 1);
  int64_t split = base >= target ? 1 : ceil_div(target, base);
  // Each split keeps at least 8 chunks (256 tokens) so partials stay a small extra cost.
  const int64_t max_split = ceil_div(n_chunks, 8);
  if (split > max_split) split = max_split;
  if (split < 1) split = 1;
  p.rows_per_split = ceil_div(n_chunks, split) * kTcK;
  p.n_split = ceil_div(L, p.rows_per_split);
  p.blocks = base * p.n_split;
  p.part_floats = p.n_split > 1 ? BH * p.n_split * Q * D : 0;
  return p;
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// One past the last byte of the cache a call may read. The cache is the first L tokens of
// buffers of capacity C >= L per head (C == L when contiguous): QK's [BH, D, C] (rows of L
// used bytes at pitch C), PV's [BH, C, D] (the first L rows of each head). Bytes between
// used rows belong to the buffer, so the aligned loads around a misaligned address may
// touch them; nothing past this end is read.
inline const uint8_t* qk_mat_end(const uint8_t* mat, int64_t BH, int64_t D, int64_t L,
                                 int64_t C) {
  return mat + (BH * D - 1) * C + L;
}
inline const uint8_t* pv_mat_end(const uint8_t* mat, int64_t BH, int64_t L, int64_t D,
                                 int64_t C) {
  return mat + (BH - 1) * C * D + L * D;
}

inline int64_t dequant_blocks(int64_t BH, int64_t R, int64_t C, int sms) {
  const int64_t b = ceil_div(BH * R * ceil_div(C, 16), kThreads);
  const int64_t cap = 16 * static_cast<int64_t>(sms > 0 ? sms : 1);
  return b < cap ? b : cap;
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

#include <atomic>

namespace kvprep_v1 {
constexpr int64_t kMaxGrid = 2147483647;  // gridDim.x limit

inline int sm_count(int device) {
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

inline bool has_tensor_cores(int device) {
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  return major >= 7;
}

// From which query length each op takes its tensor-core kernel, and from which its
// dequantize + cuBLAS path: the crossovers that `bench/kernels.py --sweep` measured on an
// H100 (bench/RESULTS.md): the shortest query block from which the newer path is faster in
// geometric mean over batch 1 and 32 at 1024 and 4096 cached tokens, at every longer block.
constexpr int64_t kTcMinQQk = 2;
constexpr int64_t kTcMinQPv = 16;
constexpr int64_t kGemmMinQQk = 256;
constexpr int64_t kGemmMinQPv = 128;

// Run-time settings, for benchmarks: the thresholds above, and whether the tensor-core
// P·V splits the dequantized cache into two fp16 parts.
static std::atomic<int64_t> g_tc_min_q_qk{kTcMinQQk};
static std::atomic<int64_t> g_tc_min_q_pv{kTcMinQPv};
static std::atomic<int64_t> g_pv_hilo{1};
static std::atomic<int64_t> g_gemm_min_q_qk{kGemmMinQQk};
static std::atomic<int64_t> g_gemm_min_q_pv{kGemmMinQPv};

inline bool use_tc_qk(int device, int64_t Q) {
  return Q >= g_tc_min_q_qk.load() && has_tensor_cores(device);
}
inline bool use_tc_pv(int device, int64_t Q) {
  return Q >= g_tc_min_q_pv.load() && has_tensor_cores(device);
}
}  // namespace kvprep_v1

// settings[0..4]: tensor-core minimum Q for QK, for PV, PV hi/lo split (0/1), GEMM-path
// minimum Q for QK, for PV. A negative entry leaves the setting alone; the previous
// values are written back.
extern "C" KVPREP_CUDA_ENTRY void kvprep_v1_tuning(int64_t* settings) {
  std::atomic<int64_t>* all[5] = {&kvprep_v1::g_tc_min_q_qk, &kvprep_v1::g_tc_min_q_pv,
                                  &kvprep_v1::g_pv_hilo, &kvprep_v1::g_gemm_min_q_qk,
                                  &kvprep_v1::g_gemm_min_q_pv};
  for (int i = 0; i < 5; ++i) {
    const int64_t want = settings[i];
    settings[i] = want >= 0 ? all[i]->exchange(want) : all[i]->load();
  }
}

// Entry points called by cache_autogptq_cuda_256.cpp, which has checked devices, dtypes,
// contiguity and shapes, and handles empty sizes (all of BH, Q, D, L are >= 1 here).
// Errors are thrown as c10::Error.

extern "C" KVPREP_CUDA_ENTRY void kvprep_v1_qk_cuda(int device, const void* vec,
                                                    const uint8_t* mat, void* mul,
                                                    const void* scales, const void* zeros,
                                                    int64_t BH, int64_t Q, int64_t D,
                                                    int64_t L, int64_t C) {
  using namespace kvprep_v1;
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const cudaStream_t stream =
      c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  const uint8_t* mat_end = qk_mat_end(mat, BH, D, L, C);
  const auto* v = reinterpret_cast<const __half*>(vec);
  auto* o = reinterpret_cast<__half*>(mul);
  const auto* s = reinterpret_cast<const __half*>(scales);
  const auto* z = reinterpret_cast<const __half*>(zeros);
  if (use_tc_qk(device, Q)) {
    const TcQkPlan t = tc_qk_plan(BH, Q, L);
    TORCH_CHECK(t.blocks <= kMaxGrid,
                "vecquant8matmul_batched_faster_old: problem too large (", t.blocks,
                " thread blocks)");
    const bool vec_ok = aligned16(vec) && D % 8 == 0;
    const bool out_ok = aligned16(mul) && L % 8 == 0;
    tc_qk<<<dim3(static_cast<unsigned>(t.blocks)), kThreads, 0, stream>>>(
        v, mat, o, s, z, Q, D, L, C, t.n_ltiles, t.n_qtiles, vec_ok, out_ok, mat_end);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  const QkPlan p = qk_plan(BH, Q, L);
  TORCH_CHECK(p.blocks <= kMaxGrid, "vecquant8matmul_batched_faster_old: problem too large (",
              p.blocks, " thread blocks)");
  const dim3 grid(static_cast<unsigned>(p.blocks));
  if (p.qt == 1) {
    qk_q1<<<grid, kThreads, 0, stream>>>(v, mat, o, s, z, Q, D, L, C, p.n_ltiles,
                                         p.n_qtiles, mat_end);
  } else {
    qk_q4<<<grid, kThreads, 0, stream>>>(v, mat, o, s, z, Q, D, L, C, p.n_ltiles,
                                         p.n_qtiles, mat_end);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

namespace kvprep_v1 {
inline void pv_tc_launch(cudaStream_t stream, int sms, const void* vec, const uint8_t* mat,
                         void* mul, const void* scales, const void* zeros, float* workspace,
                         int64_t workspace_floats, int64_t BH, int64_t Q, int64_t L,
                         int64_t D, int64_t C) {
  const TcPvPlan t = tc_pv_plan(sms, BH, Q, L, D);
  TORCH_CHECK(t.blocks <= kMaxGrid,
              "vecquant8matmul_batched_column_compression_faster_old: problem too large (",
              t.blocks, " thread blocks)");
  TORCH_CHECK(t.part_floats <= workspace_floats && (t.part_floats == 0 || workspace),
              "vecquant8matmul_batched_column_compression_faster_old: workspace of ",
              workspace_floats, " floats is smaller than the ", t.part_floats, " needed");
  float* part = t.part_floats > 0 ? workspace : nullptr;
  const auto* v = reinterpret_cast<const __half*>(vec);
  auto* o = reinterpret_cast<__half*>(mul);
  const auto* s = reinterpret_cast<const __half*>(scales);
  const auto* z = reinterpret_cast<const __half*>(zeros);
  const bool vec_ok = aligned16(vec) && L % 8 == 0;
  const bool out_ok = aligned16(mul) && D % 8 == 0;
  const uint8_t* mat_end = pv_mat_end(mat, BH, L, D, C);
  const dim3 grid(static_cast<unsigned>(t.blocks));
  if (g_pv_hilo.load() != 0) {
    tc_pv_hilo<<<grid, kThreads, 0, stream>>>(v, mat, o, part, s, z, Q, L, C, D, t.n_split,
                                              t.rows_per_split, t.n_qtiles, t.n_dtiles,
                                              vec_ok, out_ok, mat_end);
  } else {
    tc_pv_single<<<grid, kThreads, 0, stream>>>(v, mat, o, part, s, z, Q, L, C, D, t.n_split,
                                                t.rows_per_split, t.n_qtiles, t.n_dtiles,
                                                vec_ok, out_ok, mat_end);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (part != nullptr) {
    const int64_t total = BH * Q * D;
    pv_finalize<<<static_cast<unsigned>(finalize_blocks(total)), kThreads, 0, stream>>>(
        part, o, total, Q, D, t.n_split);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}
}  // namespace kvprep_v1

extern "C" KVPREP_CUDA_ENTRY int64_t kvprep_v1_pv_workspace_floats(int device, int64_t BH,
                                                                   int64_t Q, int64_t L,
                                                                   int64_t D) {
  using namespace kvprep_v1;
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  if (use_tc_pv(device, Q)) return tc_pv_plan(sm_count(device), BH, Q, L, D).part_floats;
  return pv_plan(sm_count(device), BH, Q, L, D).part_floats;
}

extern "C" KVPREP_CUDA_ENTRY void kvprep_v1_pv_cuda(int device, const void* vec,
                                                    const uint8_t* mat, void* mul,
                                                    const void* scales, const void* zeros,
                                                    float* workspace,
                                                    int64_t workspace_floats, int64_t BH,
                                                    int64_t Q, int64_t L, int64_t D,
                                                    int64_t C) {
  using namespace kvprep_v1;
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const cudaStream_t stream =
      c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  if (use_tc_pv(device, Q)) {
    pv_tc_launch(stream, sm_count(device), vec, mat, mul, scales, zeros, workspace,
                 workspace_floats, BH, Q, L, D, C);
    return;
  }
  const PvPlan p = pv_plan(sm_count(device), BH, Q, L, D);
  TORCH_CHECK(p.blocks <= kMaxGrid,
              "vecquant8matmul_batched_column_compression_faster_old: problem too large (",
              p.blocks, " thread blocks)");
  TORCH_CHECK(p.part_floats <= workspace_floats && (p.part_floats == 0 || workspace),
              "vecquant8matmul_batched_column_compression_faster_old: workspace of ",
              workspace_floats, " floats is smaller than the ", p.part_floats, " needed");
  float* part = p.part_floats > 0 ? workspace : nullptr;
  const uint8_t* mat_end = pv_mat_end(mat, BH, L, D, C);
  const auto* v = reinterpret_cast<const __half*>(vec);
  auto* o = reinterpret_cast<__half*>(mul);
  const auto* s = reinterpret_cast<const __half*>(scales);
  const auto* z = reinterpret_cast<const __half*>(zeros);
  const dim3 grid(static_cast<unsigned>(p.blocks));
  if (p.qt == 1) {
    pv_q1<<<grid, kThreads, 0, stream>>>(v, mat, o, part, s, z, Q, L, C, D, p.tpr, p.n_split,
                                         p.rows_per_split, p.n_qtiles, p.n_dtiles, mat_end);
  } else {
    pv_q4<<<grid, kThreads, 0, stream>>>(v, mat, o, part, s, z, Q, L, C, D, p.tpr, p.n_split,
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
// Fills `out` (fp16, the layout of `mat`) with scales * (mat - zeros) for the GEMM path.
// per_col: QK's [BH, D, L] cache (scale per column); else PV's [BH, L, D] (per row). `cap`:
// the buffers' token capacity (see dequant_body).
extern "C" KVPREP_CUDA_ENTRY void kvprep_v1_dequant_cuda(int device, int per_col,
                                                        const uint8_t* mat, const void* scales,
                                                        const void* zeros, void* out,
                                                        int64_t BH, int64_t R, int64_t C,
                                                        int64_t cap) {
  using namespace kvprep_v1;
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const cudaStream_t stream =
      c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  const int64_t blocks = dequant_blocks(BH, R, C, sm_count(device));
  dequant<<<dim3(static_cast<unsigned>(blocks)), kThreads, 0, stream>>>(
      mat, reinterpret_cast<const __half*>(scales), reinterpret_cast<const __half*>(zeros),
      reinterpret_cast<__half*>(out), BH, R, C, cap, per_col != 0,
      aligned16(out) && C % 8 == 0,
      per_col != 0 ? qk_mat_end(mat, BH, R, C, cap) : pv_mat_end(mat, BH, R, C, cap));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Quantizes x [B, S, H, D] (strides in elements; dtype kQaF32 / kQaF16 / kQaBF16) into
// positions [pos, pos + S) of the capacity-C buffers (see qa_body); one launch.
extern "C" KVPREP_CUDA_ENTRY void kvprep_v1_quantize_append_cuda(
    int device, int dtype, const void* x, const int64_t* x_strides, int64_t B, int64_t S,
    int64_t H, int64_t D, uint8_t* codes, void* scales, void* zeros, int64_t C, int64_t pos,
    int key_layout, int per_token) {
  using namespace kvprep_v1;
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const cudaStream_t stream =
      c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  const int64_t blocks = quantize_append_blocks(B, H, S, per_token != 0);
  TORCH_CHECK(blocks <= kMaxGrid, "quantize_append: problem too large (", blocks,
              " thread blocks)");
  quantize_append<<<dim3(static_cast<unsigned>(blocks)), kThreads, 0, stream>>>(
      x, dtype, x_strides[0], x_strides[1], x_strides[2], x_strides[3], H, S, D, codes,
      reinterpret_cast<__half*>(scales), reinterpret_cast<__half*>(zeros), C, pos,
      key_layout != 0, per_token != 0);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
#endif  // !defined(__CUDA_ARCH__)
