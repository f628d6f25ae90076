// Int8 KV-cache kernels for Qwen (v1) remote code, written for qwen-kvprep from the
// interface description alone (no code from Qwen's repositories).
//
// Exports the two functions modeling_qwen.py calls, with its argument order:
//
//   vecquant8matmul_batched_faster_old(vec, mat, mul, scales, zeros)          (Q·Kᵀ)
//     vec [B,H,Q,D] fp16, mat [B,H,D,L] uint8, mul [B,H,Q,L] fp16, scales/zeros [B,H,L,1] fp16
//     mul[b,h,q,l] = Σ_d vec[b,h,q,d] · scales[b,h,l] · (mat[b,h,d,l] − zeros[b,h,l])
//
//   vecquant8matmul_batched_column_compression_faster_old(vec, mat, mul, scales, zeros)  (P·V)
//     vec [B,H,Q,L] fp16, mat [B,H,L,D] uint8, mul [B,H,Q,D] fp16, scales/zeros [B,H,L,1] fp16
//     mul[b,h,q,d] = Σ_l vec[b,h,q,l] · scales[b,h,l] · (mat[b,h,l,d] − zeros[b,h,l])
//
// Both overwrite every element of `mul` and return None. Inputs are checked; a bad call
// raises TypeError / ValueError / RuntimeError. vec and mul must be contiguous; mat, scales
// and zeros may instead be "capacity views", the first L tokens of contiguous buffers with
// room for C >= L tokens (a caller that appends in place): QK's mat = kbuf[..., :L] of
// kbuf [B,H,D,C], strides (H*D*C, D*C, C, 1); PV's mat = vbuf[:, :, :L, :] of
// [B,H,C,D], strides (H*C*D, C*D, D, 1); scales/zeros = sbuf[:, :, :L] of [B,H,C,1],
// strides (H*C, C, 1, 1). C is read from the strides (those of size-1 dimensions are
// ignored) and must be the same for all three; any other layout is refused. Results equal
// those for .contiguous() copies bit for bit. Accuracy: fp32 accumulation and one fp16
// rounding of the result, except on CUDA for long query blocks (prefill; see
// cuda_tuning), where the cache is dequantized into fp16 once (each value rounded once,
// as the model's own fallback does twice) and multiplied by torch's matmul.
//
// Also exported (not called by the model):
//
//   quantize_append(x, codes, scales, zeros, pos, key_layout, per_token)
//     x [B,S,H,D] fp32/fp16/bf16, any strides (e.g. a slice of the fused projection);
//     codes: contiguous uint8 [B,H,C,D] (key_layout false) or [B,H,D,C] (true);
//     scales/zeros: contiguous fp16 [B,H,C,1]; 0 <= pos, pos + S <= C.
//     Quantizes x as the model does, per (b,h) over all S*D values (per (b,h,s) over D
//     with per_token): mn/mx = min/max, scale = (mx - mn) / 255, zero = 0 - mn / scale,
//     code = trunc(clamp(x / scale + zero, 0, 255)), each operation done in fp32 and
//     rounded to x's dtype as torch's eager ops do on that device (on CUDA the division by
//     255 is a multiplication by fp32(1/255), as torch's is there). Writes the codes at
//     token positions [pos, pos+S) and fp16(scale), fp16(zero) at each of those positions
//     of scales/zeros; nothing else in the buffers changes. Returns None.
//
//   attention_step(query_key, value, <six buffers>, pos, ...): one attention step of
//     qwen-kvprep's fast path (quantize_append of the keys and values, then the model's
//     attention with the two kernels); see its definition below.
//
//   features() -> ["capacity-views", "quantize-append", "attention-step-2"]: what this
//     build offers beyond the model's two functions (Qwen's official extension and older
//     builds of ours have no `features`; "attention-step-2" is attention_step taking the
//     queries and keys as one tensor and returning the cache as nested tuples).
//
// Two builds from the same sources, with no extra defines:
//   * this file alone: a CPU-only extension (CUDA tensors are refused with a clear error);
//   * this file + cache_autogptq_cuda_kernel_256.cu: CPU and CUDA, chosen by the tensors'
//     device.
// The CUDA entry points are declared weak and hidden here: when the .cu is not linked in
// they resolve to null at link time, and the dispatch below sees that.

// ATen plus torch's pybind11 glue rather than <torch/extension.h>: the full header pulls in
// autograd and torch::nn, and parsing it is most of a CPU build's time (a newcomer's first
// `fix` or `demo` waits on it).
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>
#if __has_include(<torch/version.h>)
#include <torch/version.h>
#endif

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#if defined(__GNUC__) || defined(__clang__)
#define KVPREP_WEAK_CUDA_ENTRY __attribute__((weak, visibility("hidden")))
#else
#define KVPREP_WEAK_CUDA_ENTRY
#endif

extern "C" {
void kvprep_v1_qk_cuda(int device, const void* vec, const uint8_t* mat, void* mul,
                       const void* scales, const void* zeros, int64_t BH, int64_t Q,
                       int64_t D, int64_t L, int64_t C) KVPREP_WEAK_CUDA_ENTRY;
int64_t kvprep_v1_pv_workspace_floats(int device, int64_t BH, int64_t Q, int64_t L,
                                      int64_t D) KVPREP_WEAK_CUDA_ENTRY;
void kvprep_v1_pv_cuda(int device, const void* vec, const uint8_t* mat, void* mul,
                       const void* scales, const void* zeros, float* workspace,
                       int64_t workspace_floats, int64_t BH, int64_t Q, int64_t L,
                       int64_t D, int64_t C) KVPREP_WEAK_CUDA_ENTRY;
void kvprep_v1_tuning(int64_t* settings) KVPREP_WEAK_CUDA_ENTRY;
void kvprep_v1_dequant_cuda(int device, int per_col, const uint8_t* mat, const void* scales,
                            const void* zeros, void* out, int64_t BH, int64_t R, int64_t C,
                            int64_t cap) KVPREP_WEAK_CUDA_ENTRY;
void kvprep_v1_quantize_append_cuda(int device, int dtype, const void* x,
                                    const int64_t* x_strides, int64_t B, int64_t S, int64_t H,
                                    int64_t D, uint8_t* codes, void* scales, void* zeros,
                                    int64_t C, int64_t pos, int key_layout,
                                    int per_token) KVPREP_WEAK_CUDA_ENTRY;
}

#if defined(_MSC_VER) && !defined(__clang__)
// MSVC has no weak symbols: an entry point the .cu does not define resolves to a local
// stand-in, and the dispatch compares addresses. (Untested: the project is built and tested
// on Linux.)
#pragma comment(linker, "/alternatename:kvprep_v1_qk_cuda=kvprep_v1_qk_cuda_missing")
#pragma comment(linker, \
                "/alternatename:kvprep_v1_pv_workspace_floats=kvprep_v1_pv_workspace_missing")
#pragma comment(linker, "/alternatename:kvprep_v1_pv_cuda=kvprep_v1_pv_cuda_missing")
#pragma comment(linker, "/alternatename:kvprep_v1_tuning=kvprep_v1_tuning_missing")
#pragma comment(linker, "/alternatename:kvprep_v1_dequant_cuda=kvprep_v1_dequant_missing")
#pragma comment(linker, \
                "/alternatename:kvprep_v1_quantize_append_cuda=kvprep_v1_quantize_append_missing")
extern "C" {
void kvprep_v1_tuning_missing(int64_t*) {}
void kvprep_v1_dequant_missing(int, int, const uint8_t*, const void*, const void*, void*,
                               int64_t, int64_t, int64_t, int64_t) {}
void kvprep_v1_qk_cuda_missing(int, const void*, const uint8_t*, void*, const void*,
                               const void*, int64_t, int64_t, int64_t, int64_t, int64_t) {}
int64_t kvprep_v1_pv_workspace_missing(int, int64_t, int64_t, int64_t, int64_t) { return 0; }
void kvprep_v1_pv_cuda_missing(int, const void*, const uint8_t*, void*, const void*,
                               const void*, float*, int64_t, int64_t, int64_t, int64_t,
                               int64_t, int64_t) {}
void kvprep_v1_quantize_append_missing(int, int, const void*, const int64_t*, int64_t,
                                       int64_t, int64_t, int64_t, uint8_t*, void*, void*,
                                       int64_t, int64_t, int, int) {}
}
static bool cuda_entries_present() {
  return reinterpret_cast<const void*>(&kvprep_v1_qk_cuda) !=
             reinterpret_cast<const void*>(&kvprep_v1_qk_cuda_missing) &&
         reinterpret_cast<const void*>(&kvprep_v1_pv_cuda) !=
             reinterpret_cast<const void*>(&kvprep_v1_pv_cuda_missing);
}
#else
static bool cuda_entries_present() {
  return &kvprep_v1_qk_cuda != nullptr && &kvprep_v1_pv_workspace_floats != nullptr &&
         &kvprep_v1_pv_cuda != nullptr && &kvprep_v1_tuning != nullptr &&
         &kvprep_v1_dequant_cuda != nullptr && &kvprep_v1_quantize_append_cuda != nullptr;
}
#endif

namespace {

constexpr const char* kQkName = "vecquant8matmul_batched_faster_old";
constexpr const char* kPvName = "vecquant8matmul_batched_column_compression_faster_old";

std::string shape_str(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) {
    if (i) s += ", ";
    s += std::to_string(t.size(i));
  }
  return s + "]";
}

std::string expected_str(std::initializer_list<int64_t> dims) {
  std::string s = "[";
  for (const int64_t d : dims) {
    if (s.size() > 1) s += ", ";
    s += std::to_string(d);
  }
  return s + "]";
}

const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return "torch.float16";
    case at::kByte: return "torch.uint8";
    case at::kFloat: return "torch.float32";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kDouble: return "torch.float64";
    case at::kChar: return "torch.int8";
    default: return c10::toString(t);
  }
}

void check_dtype(const char* fn, const char* arg, const at::Tensor& t, at::ScalarType want) {
  TORCH_CHECK_TYPE(t.scalar_type() == want, fn, ": ", arg, " must be ", dtype_name(want),
                   ", got ", dtype_name(t.scalar_type()));
}

// `want` is an initializer list, not a vector: checks run at every decoding step, and
// none of them may allocate unless it fails.
void check_shape(const char* fn, const char* arg, const at::Tensor& t,
                 std::initializer_list<int64_t> want, const char* layout) {
  TORCH_CHECK_VALUE(t.dim() == static_cast<int64_t>(want.size()), fn, ": ", arg,
                    " must be a 4-d tensor ", layout, ", got shape ", shape_str(t));
  bool same = true;
  int64_t i = 0;
  for (const int64_t w : want) same = same && t.size(i++) == w;
  TORCH_CHECK_VALUE(same, fn, ": ", arg, " must have shape ", layout, " = ",
                    expected_str(want), ", got ", shape_str(t));
}

enum class Where { kCpu, kCuda };

// Checks devices, dtypes and ranks, and that the build can serve the device; returns where
// to run. Shapes are checked by each function, layout by check_layout.
Where check_common(const char* fn, const at::Tensor& vec, const at::Tensor& mat,
                   const at::Tensor& mul, const at::Tensor& scales, const at::Tensor& zeros) {
  const at::Tensor* all[] = {&vec, &mat, &mul, &scales, &zeros};
  const char* names[] = {"vec", "mat", "mul", "scales", "zeros"};
  for (int i = 0; i < 5; ++i) {
    TORCH_CHECK(all[i]->defined(), fn, ": ", names[i], " is an undefined tensor");
  }
  const c10::Device dev = vec.device();
  for (int i = 1; i < 5; ++i) {
    TORCH_CHECK(all[i]->device() == dev, fn, ": all tensors must be on the same device; vec is on ",
                dev.str(), " but ", names[i], " is on ", all[i]->device().str());
  }
  check_dtype(fn, "vec", vec, at::kHalf);
  check_dtype(fn, "mat", mat, at::kByte);
  check_dtype(fn, "mul", mul, at::kHalf);
  check_dtype(fn, "scales", scales, at::kHalf);
  check_dtype(fn, "zeros", zeros, at::kHalf);
  for (int i = 0; i < 5; ++i) {
    TORCH_CHECK_VALUE(all[i]->dim() == 4, fn, ": ", names[i],
                      " must be a 4-d tensor, got shape ", shape_str(*all[i]));
  }
  Where where = Where::kCpu;
  if (dev.is_cuda()) {
    TORCH_CHECK(cuda_entries_present(), fn, ": got tensors on ", dev.str(),
                ", but this extension was built without CUDA (only "
                "cache_autogptq_cuda_256.cpp was compiled); rebuild it together with "
                "cache_autogptq_cuda_kernel_256.cu to use CUDA tensors");
    where = Where::kCuda;
  } else {
    TORCH_CHECK(dev.is_cpu(), fn, ": unsupported device ", dev.str(),
                "; expected CPU or CUDA tensors");
  }
  return where;
}

// The strides of a tensor of sizes n[0..3] that is the view of the first L tokens of a
// contiguous buffer with room for C tokens: stride[i] = a[i] * C + k[i].
struct CapacityForm {
  int64_t a[4];
  int64_t k[4];
};

// The capacity C this tensor's strides show (strides of size-1 dimensions are ignored), 0
// when they fit any C (nothing to learn from them), -1 when they fit none.
int64_t capacity_of(const at::Tensor& t, const CapacityForm& f) {
  int64_t c = 0;
  for (int i = 3; i >= 0; --i) {  // the innermost C-dependent stride reveals C
    if (t.size(i) == 1 || f.a[i] == 0) continue;
    const int64_t st = t.stride(i) - f.k[i];
    if (st <= 0 || st % f.a[i] != 0) return -1;
    c = st / f.a[i];
    break;
  }
  for (int i = 0; i < 4; ++i) {
    if (t.size(i) != 1 && t.stride(i) != f.a[i] * c + f.k[i]) return -1;
  }
  return c;
}

// True when the two tensors share storage and their spans (first to last element) meet
// (conservative: the gaps of a strided view count as used).
bool spans_overlap(const at::Tensor& a_t, const at::Tensor& b_t) {
  if (a_t.numel() == 0 || b_t.numel() == 0) return false;
  if (!a_t.storage().is_alias_of(b_t.storage())) return false;
  auto span = [](const at::Tensor& x) {
    int64_t last = 0;
    for (int64_t i = 0; i < x.dim(); ++i) last += (x.size(i) - 1) * x.stride(i);
    const auto* lo = static_cast<const char*>(x.data_ptr());
    return std::make_pair(lo, lo + (last + 1) * static_cast<int64_t>(x.element_size()));
  };
  const auto a = span(a_t);
  const auto b = span(b_t);
  return a.first < b.second && b.first < a.second;
}

// Checks the layouts; returns C, the pitch of the token axis of mat and scales / zeros: L
// when all three are contiguous, else the capacity of the buffers they are views of
// (`qk`: mat is [B, H, D, L] = kbuf[..., :L] of [B, H, D, C]; else [B, H, L, D] =
// vbuf[:, :, :L] of [B, H, C, D]; scales / zeros [B, H, L, 1] of [B, H, C, 1]).
int64_t check_layout(const char* fn, bool qk, const at::Tensor& vec, const at::Tensor& mat,
                     const at::Tensor& mul, const at::Tensor& scales, const at::Tensor& zeros) {
  const at::Tensor* all[] = {&vec, &mat, &mul, &scales, &zeros};
  const char* names[] = {"vec", "mat", "mul", "scales", "zeros"};
  const int64_t H = mat.size(1);
  const int64_t D = qk ? mat.size(2) : mat.size(3);
  const int64_t L = scales.size(2);
  const CapacityForm mat_form = qk ? CapacityForm{{H * D, D, 1, 0}, {0, 0, 0, 1}}
                                   : CapacityForm{{H * D, D, 0, 0}, {0, 0, D, 1}};
  const CapacityForm sz_form{{H, 1, 0, 0}, {0, 0, 1, 1}};
  const char* buffer = qk ? "kbuf[..., :L] of a contiguous kbuf [B, H, D, C]"
                          : "vbuf[:, :, :L, :] of a contiguous vbuf [B, H, C, D]";
  const bool views = !(mat.is_contiguous() && scales.is_contiguous() && zeros.is_contiguous());
  for (int i = 0; i < 5; ++i) {
    if (views && (i == 1 || i == 3 || i == 4)) continue;
    TORCH_CHECK_VALUE(all[i]->is_contiguous(), fn, ": ", names[i],
                      " must be contiguous (call .contiguous() first), got shape ",
                      shape_str(*all[i]), " with strides ", all[i]->strides());
  }
  int64_t cap = L;
  if (views) {
    // Any of the three may be a view of a buffer of capacity C >= L (the same C for all).
    int64_t found = 0;
    const char* found_in = nullptr;
    for (int i : {1, 3, 4}) {
      const int64_t c = capacity_of(*all[i], i == 1 ? mat_form : sz_form);
      TORCH_CHECK_VALUE(c >= 0, fn, ": ", names[i],
                        " must be contiguous (call .contiguous() first) or the first L "
                        "tokens of a contiguous buffer with room for C >= L (",
                        i == 1 ? buffer : "sbuf[:, :, :L] of a contiguous sbuf [B, H, C, 1]",
                        "), got shape ", shape_str(*all[i]), " with strides ",
                        all[i]->strides());
      if (c == 0) continue;
      TORCH_CHECK_VALUE(c >= L, fn, ": ", names[i], "'s strides say its buffer holds C = ", c,
                        " tokens, fewer than the L = ", L, " used (its rows would overlap)");
      TORCH_CHECK_VALUE(found == 0 || c == found, fn, ": mat, scales and zeros must be views "
                        "of buffers with the same token capacity C, but ", found_in,
                        "'s strides say C = ", found, " and ", names[i], "'s say C = ", c);
      found = c;
      found_in = names[i];
    }
    if (found != 0) cap = found;
  }
  // The output is written while the inputs are read: it must not share memory with them.
  TORCH_CHECK_VALUE(at::has_internal_overlap(mul) != at::MemOverlap::Yes, fn,
                    ": mul must not have overlapping elements");
  for (int i = 0; i < 5; ++i) {
    if (all[i] == &mul) continue;
    const at::MemOverlapStatus st = at::get_overlap_status(mul, *all[i]);
    // A capacity view is not dense, so torch cannot tell; compare the spans instead.
    const bool shares = st == at::MemOverlapStatus::TooHard ? spans_overlap(mul, *all[i])
                                                            : st != at::MemOverlapStatus::No;
    TORCH_CHECK_VALUE(!shares, fn, ": mul must not share memory with ", names[i]);
  }
  return cap;
}

// ---------------------------------------------------------------------------------------
// CPU implementation. Parallel over independent output tiles; fp32 accumulation; the uint8
// rows are dequantized (minus zero) into a small fp32 buffer once per tile of queries, and
// the inner loops run over contiguous memory so the compiler vectorizes them.

// CUDA, long query blocks: expand the cache into an fp16 workspace with our kernel, then
// multiply with torch's matmul (cuBLAS on tensor cores), on the current stream.
struct CudaSettings {
  int64_t gemm_min_q_qk;
  int64_t gemm_min_q_pv;
};

CudaSettings cuda_settings() {
  int64_t t[5] = {-1, -1, -1, -1, -1};
  kvprep_v1_tuning(t);
  return {t[3], t[4]};
}

void qk_cuda_gemm(const at::Tensor& vec, const at::Tensor& mat, const at::Tensor& mul,
                  const at::Tensor& scales, const at::Tensor& zeros, int64_t BH, int64_t Q,
                  int64_t D, int64_t L, int64_t C) {
  at::Tensor w = at::empty({BH, D, L}, vec.options());
  kvprep_v1_dequant_cuda(static_cast<int>(vec.get_device()), 1, mat.data_ptr<uint8_t>(),
                         scales.data_ptr<at::Half>(), zeros.data_ptr<at::Half>(),
                         w.data_ptr<at::Half>(), BH, D, L, C);
  at::Tensor out = mul.view({BH, Q, L});
  at::bmm_out(out, vec.view({BH, Q, D}), w);
}

void pv_cuda_gemm(const at::Tensor& vec, const at::Tensor& mat, const at::Tensor& mul,
                  const at::Tensor& scales, const at::Tensor& zeros, int64_t BH, int64_t Q,
                  int64_t L, int64_t D, int64_t C) {
  at::Tensor w = at::empty({BH, L, D}, vec.options());
  kvprep_v1_dequant_cuda(static_cast<int>(vec.get_device()), 0, mat.data_ptr<uint8_t>(),
                         scales.data_ptr<at::Half>(), zeros.data_ptr<at::Half>(),
                         w.data_ptr<at::Half>(), BH, L, D, C);
  at::Tensor out = mul.view({BH, Q, D});
  at::bmm_out(out, vec.view({BH, Q, L}), w);
}

constexpr int64_t kCpuTileL = 256;  // QK: cached tokens per task
constexpr int64_t kCpuTileQ = 16;   // queries sharing one dequantized row
// Multiply-adds below which a task is not worth handing to another thread: a decoding step
// at batch 1 is a few thousand per head, far less than waking the thread pool costs (and on
// a busy machine a wait for a thread that is not running). Which thread computes an output
// does not change it: each output is one task's, summed in one order.
constexpr int64_t kCpuMinTaskWork = int64_t{1} << 15;

int64_t grain_for(int64_t work_per_task) {
  return std::max<int64_t>(1, kCpuMinTaskWork / std::max<int64_t>(1, work_per_task));
}

// C: the token capacity of mat's and scales'/zeros' buffers (L when contiguous).
void qk_cpu(const at::Half* vec, const uint8_t* mat, at::Half* out, const at::Half* scales,
            const at::Half* zeros, int64_t BH, int64_t Q, int64_t D, int64_t L, int64_t C) {
  const int64_t n_ltiles = (L + kCpuTileL - 1) / kCpuTileL;
  const int64_t grain = grain_for(Q * D * std::min(kCpuTileL, L));
  at::parallel_for(0, BH * n_ltiles, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> vf;
    std::vector<float> row(kCpuTileL);
    std::vector<float> zf(kCpuTileL);
    std::vector<float> sf(kCpuTileL);
    std::vector<float> acc(kCpuTileQ * kCpuTileL);
    int64_t vf_bh = -1;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / n_ltiles;
      const int64_t l0 = (task % n_ltiles) * kCpuTileL;
      const int64_t nl = std::min(kCpuTileL, L - l0);
      if (vf_bh != bh) {
        const at::Half* v = vec + bh * Q * D;
        vf.resize(Q * D);
        for (int64_t i = 0; i < Q * D; ++i) vf[i] = static_cast<float>(v[i]);
        vf_bh = bh;
      }
      for (int64_t i = 0; i < nl; ++i) {
        zf[i] = static_cast<float>(zeros[bh * C + l0 + i]);
        sf[i] = static_cast<float>(scales[bh * C + l0 + i]);
      }
      const uint8_t* m = mat + bh * D * C + l0;
      for (int64_t qb = 0; qb < Q; qb += kCpuTileQ) {
        const int64_t nq = std::min(kCpuTileQ, Q - qb);
        std::fill(acc.begin(), acc.begin() + nq * kCpuTileL, 0.0f);
        for (int64_t d = 0; d < D; ++d) {
          const uint8_t* mr = m + d * C;
          float* rp = row.data();
          const float* zp = zf.data();
          if (nq == 1) {  // decoding: no reuse of the dequantized row, skip the buffer
            const float a = vf[qb * D + d];
            float* ap = acc.data();
            for (int64_t i = 0; i < nl; ++i) ap[i] += a * (static_cast<float>(mr[i]) - zp[i]);
            continue;
          }
          for (int64_t i = 0; i < nl; ++i) rp[i] = static_cast<float>(mr[i]) - zp[i];
          for (int64_t q = 0; q < nq; ++q) {
            const float a = vf[(qb + q) * D + d];
            float* ap = acc.data() + q * kCpuTileL;
            for (int64_t i = 0; i < nl; ++i) ap[i] += a * rp[i];
          }
        }
        for (int64_t q = 0; q < nq; ++q) {
          at::Half* o = out + (bh * Q + qb + q) * L + l0;
          const float* ap = acc.data() + q * kCpuTileL;
          for (int64_t i = 0; i < nl; ++i) o[i] = static_cast<at::Half>(ap[i] * sf[i]);
        }
      }
    }
  });
}

void pv_cpu(const at::Half* vec, const uint8_t* mat, at::Half* out, const at::Half* scales,
            const at::Half* zeros, int64_t BH, int64_t Q, int64_t L, int64_t D, int64_t C) {
  const int64_t n_qtiles = (Q + kCpuTileQ - 1) / kCpuTileQ;
  const int64_t grain = grain_for(std::min(kCpuTileQ, Q) * L * D);
  at::parallel_for(0, BH * n_qtiles, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> row(D);
    std::vector<float> acc(kCpuTileQ * D);
    std::vector<float> w(kCpuTileQ);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / n_qtiles;
      const int64_t qb = (task % n_qtiles) * kCpuTileQ;
      const int64_t nq = std::min(kCpuTileQ, Q - qb);
      std::fill(acc.begin(), acc.begin() + nq * D, 0.0f);
      const uint8_t* m = mat + bh * C * D;
      const at::Half* v = vec + (bh * Q + qb) * L;
      for (int64_t l = 0; l < L; ++l) {
        const float s = static_cast<float>(scales[bh * C + l]);
        const float z = static_cast<float>(zeros[bh * C + l]);
        const uint8_t* mr = m + l * D;
        float* rp = row.data();
        if (nq == 1) {  // decoding: no reuse of the dequantized row, skip the buffer
          const float a = static_cast<float>(v[l]) * s;
          float* ap = acc.data();
          for (int64_t d = 0; d < D; ++d) ap[d] += a * (static_cast<float>(mr[d]) - z);
          continue;
        }
        for (int64_t d = 0; d < D; ++d) rp[d] = static_cast<float>(mr[d]) - z;
        for (int64_t q = 0; q < nq; ++q) w[q] = static_cast<float>(v[q * L + l]) * s;
        for (int64_t q = 0; q < nq; ++q) {
          const float a = w[q];
          float* ap = acc.data() + q * D;
          for (int64_t d = 0; d < D; ++d) ap[d] += a * rp[d];
        }
      }
      for (int64_t q = 0; q < nq; ++q) {
        at::Half* o = out + (bh * Q + qb + q) * D;
        const float* ap = acc.data() + q * D;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<at::Half>(ap[d]);
      }
    }
  });
}

// Many queries at once (prefill): the loops above are bound by arithmetic, and a tuned
// fp32 GEMM wins. The cache is dequantized exactly in fp32 (q - zero is exact, one
// rounding for the scale), a few heads at a time to bound the temporary memory.
constexpr int64_t kCpuGemmMinQ = 32;
constexpr int64_t kCpuGemmChunkBytes = int64_t{16} << 20;

int64_t heads_per_chunk(int64_t L, int64_t D) {
  const int64_t per_head = std::max<int64_t>(1, L * D * static_cast<int64_t>(sizeof(float)));
  return std::max<int64_t>(1, kCpuGemmChunkBytes / per_head);
}

void qk_cpu_gemm(const at::Tensor& vec, const at::Tensor& mat, const at::Tensor& mul,
                 const at::Tensor& scales, const at::Tensor& zeros, int64_t BH, int64_t Q,
                 int64_t D, int64_t L) {
  const at::Tensor v = vec.view({BH, Q, D});
  // reshape: mat/scales/zeros may be capacity views (still views after the reshape).
  const at::Tensor m = mat.reshape({BH, D, L});
  const at::Tensor s = scales.reshape({BH, 1, L});
  const at::Tensor z = zeros.reshape({BH, 1, L});
  at::Tensor o = mul.view({BH, Q, L});
  const int64_t step = heads_per_chunk(L, D);
  for (int64_t b0 = 0; b0 < BH; b0 += step) {
    const int64_t b1 = std::min(BH, b0 + step);
    const at::Tensor dq = m.slice(0, b0, b1).to(at::kFloat) - z.slice(0, b0, b1).to(at::kFloat);
    at::Tensor r = at::bmm(v.slice(0, b0, b1).to(at::kFloat), dq);
    r.mul_(s.slice(0, b0, b1).to(at::kFloat));
    o.slice(0, b0, b1).copy_(r);
  }
}

void pv_cpu_gemm(const at::Tensor& vec, const at::Tensor& mat, const at::Tensor& mul,
                 const at::Tensor& scales, const at::Tensor& zeros, int64_t BH, int64_t Q,
                 int64_t L, int64_t D) {
  const at::Tensor v = vec.view({BH, Q, L});
  const at::Tensor m = mat.reshape({BH, L, D});
  const at::Tensor s = scales.reshape({BH, L, 1});
  const at::Tensor z = zeros.reshape({BH, L, 1});
  at::Tensor o = mul.view({BH, Q, D});
  const int64_t step = heads_per_chunk(L, D);
  for (int64_t b0 = 0; b0 < BH; b0 += step) {
    const int64_t b1 = std::min(BH, b0 + step);
    at::Tensor dq = m.slice(0, b0, b1).to(at::kFloat) - z.slice(0, b0, b1).to(at::kFloat);
    dq.mul_(s.slice(0, b0, b1).to(at::kFloat));
    o.slice(0, b0, b1).copy_(at::bmm(v.slice(0, b0, b1).to(at::kFloat), dq));
  }
}

// ---------------------------------------------------------------------------------------

void qk_run(Where where, const at::Tensor& vec, const at::Tensor& mat, const at::Tensor& mul,
            const at::Tensor& scales, const at::Tensor& zeros, int64_t BH, int64_t Q,
            int64_t D, int64_t L, int64_t C);
void pv_run(Where where, const at::Tensor& vec, const at::Tensor& mat, const at::Tensor& mul,
            const at::Tensor& scales, const at::Tensor& zeros, int64_t BH, int64_t Q,
            int64_t L, int64_t D, int64_t C);

void vecquant8matmul_batched_faster_old(const at::Tensor& vec, const at::Tensor& mat,
                                        const at::Tensor& mul, const at::Tensor& scales,
                                        const at::Tensor& zeros) {
  const Where where = check_common(kQkName, vec, mat, mul, scales, zeros);
  const int64_t B = vec.size(0), H = vec.size(1), Q = vec.size(2), D = vec.size(3);
  const int64_t L = mat.size(3);
  check_shape(kQkName, "mat", mat, {B, H, D, L}, "[B, H, D, L]");
  check_shape(kQkName, "mul", mul, {B, H, Q, L}, "[B, H, Q, L]");
  check_shape(kQkName, "scales", scales, {B, H, L, 1}, "[B, H, L, 1]");
  check_shape(kQkName, "zeros", zeros, {B, H, L, 1}, "[B, H, L, 1]");
  const int64_t C = check_layout(kQkName, true, vec, mat, mul, scales, zeros);
  qk_run(where, vec, mat, mul, scales, zeros, B * H, Q, D, L, C);
}

// QK once its arguments are known to be valid: vec [B, H, Q, D] and mul [B, H, Q, L]
// contiguous, mat / scales / zeros the first L tokens of buffers with room for C tokens.
void qk_run(Where where, const at::Tensor& vec, const at::Tensor& mat, const at::Tensor& mul,
            const at::Tensor& scales, const at::Tensor& zeros, int64_t BH, int64_t Q,
            int64_t D, int64_t L, int64_t C) {
  if (mul.numel() == 0) return;
  if (D == 0) {  // an empty sum
    mul.zero_();
    return;
  }
  if (where == Where::kCuda) {
    if (Q >= cuda_settings().gemm_min_q_qk) {
      qk_cuda_gemm(vec, mat, mul, scales, zeros, BH, Q, D, L, C);
      return;
    }
    kvprep_v1_qk_cuda(static_cast<int>(vec.get_device()), vec.data_ptr<at::Half>(),
                      mat.data_ptr<uint8_t>(), mul.data_ptr<at::Half>(),
                      scales.data_ptr<at::Half>(), zeros.data_ptr<at::Half>(), BH, Q, D, L, C);
    return;
  }
  if (Q >= kCpuGemmMinQ) {
    qk_cpu_gemm(vec, mat, mul, scales, zeros, BH, Q, D, L);
    return;
  }
  qk_cpu(vec.data_ptr<at::Half>(), mat.data_ptr<uint8_t>(), mul.data_ptr<at::Half>(),
         scales.data_ptr<at::Half>(), zeros.data_ptr<at::Half>(), BH, Q, D, L, C);
}

void vecquant8matmul_batched_column_compression_faster_old(const at::Tensor& vec,
                                                           const at::Tensor& mat,
                                                           const at::Tensor& mul,
                                                           const at::Tensor& scales,
                                                           const at::Tensor& zeros) {
  const Where where = check_common(kPvName, vec, mat, mul, scales, zeros);
  const int64_t B = vec.size(0), H = vec.size(1), Q = vec.size(2), L = vec.size(3);
  const int64_t D = mat.size(3);
  check_shape(kPvName, "mat", mat, {B, H, L, D}, "[B, H, L, D]");
  check_shape(kPvName, "mul", mul, {B, H, Q, D}, "[B, H, Q, D]");
  check_shape(kPvName, "scales", scales, {B, H, L, 1}, "[B, H, L, 1]");
  check_shape(kPvName, "zeros", zeros, {B, H, L, 1}, "[B, H, L, 1]");
  const int64_t C = check_layout(kPvName, false, vec, mat, mul, scales, zeros);
  pv_run(where, vec, mat, mul, scales, zeros, B * H, Q, L, D, C);
}

// PV once its arguments are known to be valid (as qk_run; vec [B, H, Q, L], mul
// [B, H, Q, D]).
void pv_run(Where where, const at::Tensor& vec, const at::Tensor& mat, const at::Tensor& mul,
            const at::Tensor& scales, const at::Tensor& zeros, int64_t BH, int64_t Q,
            int64_t L, int64_t D, int64_t C) {
  if (mul.numel() == 0) return;
  if (L == 0) {  // an empty sum
    mul.zero_();
    return;
  }
  if (where == Where::kCuda) {
    if (Q >= cuda_settings().gemm_min_q_pv) {
      pv_cuda_gemm(vec, mat, mul, scales, zeros, BH, Q, L, D, C);
      return;
    }
    const int device = static_cast<int>(vec.get_device());
    const int64_t n = kvprep_v1_pv_workspace_floats(device, BH, Q, L, D);
    at::Tensor workspace;
    if (n > 0) workspace = at::empty({n}, vec.options().dtype(at::kFloat));
    kvprep_v1_pv_cuda(device, vec.data_ptr<at::Half>(), mat.data_ptr<uint8_t>(),
                      mul.data_ptr<at::Half>(), scales.data_ptr<at::Half>(),
                      zeros.data_ptr<at::Half>(),
                      n > 0 ? workspace.data_ptr<float>() : nullptr, n, BH, Q, L, D, C);
    return;
  }
  if (Q >= kCpuGemmMinQ) {
    pv_cpu_gemm(vec, mat, mul, scales, zeros, BH, Q, L, D);
    return;
  }
  pv_cpu(vec.data_ptr<at::Half>(), mat.data_ptr<uint8_t>(), mul.data_ptr<at::Half>(),
         scales.data_ptr<at::Half>(), zeros.data_ptr<at::Half>(), BH, Q, L, D, C);
}

// ---- quantize_append ------------------------------------------------------------------
//
// The model's own quantization of new keys / values, written in place into preallocated
// buffers at token positions [pos, pos + S). Every operation is done in fp32 and rounded
// to x's dtype, as torch's eager ops do for that dtype (identity for fp32); scale and zero
// are then stored as fp16. The CPU divides by 255 as torch's CPU ops do; the CUDA kernel
// multiplies by fp32(1/255) as torch's CUDA ops do (see the .cu).

constexpr const char* kQaName = "quantize_append";

template <typename T>
inline float qa_round(float v) {
  return static_cast<float>(static_cast<T>(v));
}
template <>
inline float qa_round<float>(float v) {
  return v;
}

inline float qa_max(float a, float b) { return a > b || a != a ? a : b; }  // NaN wins
inline float qa_min(float a, float b) { return a < b || a != a ? a : b; }

// clamp to [0, 255], then truncate toward zero; NaN gives 0 (no undefined conversion).
inline uint8_t qa_code(float t) {
  if (!(t > 0.0f)) return 0;
  if (t >= 255.0f) return 255;
  return static_cast<uint8_t>(static_cast<int>(t));
}

template <typename T>
void quantize_append_cpu(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                         const at::Tensor& zeros, int64_t pos, bool key_layout,
                         bool per_token) {
  const int64_t B = x.size(0), S = x.size(1), H = x.size(2), D = x.size(3);
  const int64_t C = scales.size(2);
  const int64_t xs_b = x.stride(0), xs_s = x.stride(1), xs_h = x.stride(2), xs_d = x.stride(3);
  const T* xp = x.data_ptr<T>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  at::Half* sp = scales.data_ptr<at::Half>();
  at::Half* zp = zeros.data_ptr<at::Half>();
  const int64_t n_groups = per_token ? S : 1;
  const int64_t ns = per_token ? 1 : S;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t head = b * H + h;
      for (int64_t g = 0; g < n_groups; ++g) {
        const int64_t s0 = g * ns;
        const T* xg = xp + b * xs_b + h * xs_h + s0 * xs_s;
        float mn = std::numeric_limits<float>::infinity();
        float mx = -mn;
        for (int64_t s = 0; s < ns; ++s) {
          for (int64_t d = 0; d < D; ++d) {
            const float v = static_cast<float>(xg[s * xs_s + d * xs_d]);
            mn = qa_min(mn, v);
            mx = qa_max(mx, v);
          }
        }
        const float scale = qa_round<T>(qa_round<T>(mx - mn) / 255.0f);
        const float zero = qa_round<T>(0.0f - qa_round<T>(mn / scale));
        for (int64_t s = 0; s < ns; ++s) {
          const int64_t p = pos + s0 + s;
          sp[head * C + p] = static_cast<at::Half>(scale);
          zp[head * C + p] = static_cast<at::Half>(zero);
          for (int64_t d = 0; d < D; ++d) {
            const float v = static_cast<float>(xg[s * xs_s + d * xs_d]);
            const float t = qa_round<T>(qa_round<T>(v / scale) + zero);
            cp[key_layout ? (head * D + d) * C + p : (head * C + p) * D + d] = qa_code(t);
          }
        }
      }
    }
  }
}

// The names a caller's error messages use for x and the three buffers.
struct AppendNames {
  const char* fn;
  const char* arg[4];
};
constexpr AppendNames kQaNames{kQaName, {"x", "codes", "scales", "zeros"}};

// Every check quantize_append makes before it writes; returns where to run. Cheap enough
// for each decoding step: no allocation, no tensor operation (messages are built only on
// failure; the overlap test compares storages and address spans).
Where check_append(const AppendNames& n, const at::Tensor& x, const at::Tensor& codes,
                   const at::Tensor& scales, const at::Tensor& zeros, int64_t pos,
                   bool key_layout) {
  const char* fn = n.fn;
  const at::Tensor* all[] = {&x, &codes, &scales, &zeros};
  for (int i = 0; i < 4; ++i) {
    TORCH_CHECK(all[i]->defined(), fn, ": ", n.arg[i], " is an undefined tensor");
  }
  const c10::Device dev = x.device();
  for (int i = 1; i < 4; ++i) {
    TORCH_CHECK(all[i]->device() == dev, fn, ": all tensors must be on the same device; ",
                n.arg[0], " is on ", dev.str(), " but ", n.arg[i], " is on ",
                all[i]->device().str());
  }
  TORCH_CHECK(dev.is_cpu() || dev.is_cuda(), fn, ": unsupported device ", dev.str(),
              "; expected CPU or CUDA tensors");
  TORCH_CHECK(dev.is_cpu() || cuda_entries_present(), fn, ": got tensors on ", dev.str(),
              ", but this extension was built without CUDA (only "
              "cache_autogptq_cuda_256.cpp was compiled); rebuild it together with "
              "cache_autogptq_cuda_kernel_256.cu to use CUDA tensors");
  const at::ScalarType xt = x.scalar_type();
  TORCH_CHECK_TYPE(xt == at::kFloat || xt == at::kHalf || xt == at::kBFloat16, fn, ": ",
                   n.arg[0], " must be torch.float32, torch.float16 or torch.bfloat16, got ",
                   dtype_name(xt));
  check_dtype(fn, n.arg[1], codes, at::kByte);
  check_dtype(fn, n.arg[2], scales, at::kHalf);
  check_dtype(fn, n.arg[3], zeros, at::kHalf);
  for (int i = 0; i < 4; ++i) {
    TORCH_CHECK_VALUE(all[i]->dim() == 4, fn, ": ", n.arg[i],
                      " must be a 4-d tensor, got shape ", shape_str(*all[i]));
  }
  const int64_t B = x.size(0), S = x.size(1), H = x.size(2), D = x.size(3);
  const int64_t C = scales.size(2);
  check_shape(fn, n.arg[2], scales, {B, H, C, 1}, "[B, H, C, 1]");
  check_shape(fn, n.arg[3], zeros, {B, H, C, 1}, "[B, H, C, 1]");
  if (key_layout) {
    check_shape(fn, n.arg[1], codes, {B, H, D, C}, "[B, H, D, C] (key_layout=True)");
  } else {
    check_shape(fn, n.arg[1], codes, {B, H, C, D}, "[B, H, C, D] (key_layout=False)");
  }
  for (int i = 1; i < 4; ++i) {
    TORCH_CHECK_VALUE(all[i]->is_contiguous(), fn, ": ", n.arg[i],
                      " must be a contiguous buffer, got shape ", shape_str(*all[i]),
                      " with strides ", all[i]->strides());
  }
  TORCH_CHECK_VALUE(pos >= 0, fn, ": pos must be >= 0, got ", pos);
  TORCH_CHECK_VALUE(pos <= C - S, fn, ": pos + S (pos = ", pos, ", S = ", S,
                    ") exceeds the buffers' capacity C = ", C,
                    " (grow the buffers before appending)");
  TORCH_CHECK_VALUE(D > 0 || B * H * S == 0, fn, ": ", n.arg[0],
                    " has head_dim 0: there is nothing to take a min / max of");
  // The buffers are written while x is read. spans_overlap is exact for the contiguous
  // buffers and conservative for a strided x.
  for (int i = 1; i < 4; ++i) {
    for (int j = 0; j < 4; ++j) {
      if (j == i || (j > 0 && j < i)) continue;  // each pair once, x against all three
      TORCH_CHECK_VALUE(!spans_overlap(*all[i], *all[j]), fn, ": ", n.arg[i],
                        " must not share memory with ", n.arg[j]);
    }
  }
  return dev.is_cuda() ? Where::kCuda : Where::kCpu;
}

// quantize_append once check_append has passed.
void run_append(Where where, const at::Tensor& x, const at::Tensor& codes,
                const at::Tensor& scales, const at::Tensor& zeros, int64_t pos, bool key_layout,
                bool per_token) {
  const int64_t B = x.size(0), S = x.size(1), H = x.size(2), D = x.size(3);
  if (B * H * S == 0) return;
  const at::ScalarType xt = x.scalar_type();
  if (where == Where::kCuda) {
    const int64_t strides[4] = {x.stride(0), x.stride(1), x.stride(2), x.stride(3)};
    const int dtype = xt == at::kFloat ? 0 : xt == at::kHalf ? 1 : 2;
    kvprep_v1_quantize_append_cuda(static_cast<int>(x.get_device()), dtype, x.data_ptr(),
                                   strides, B, S, H, D, codes.data_ptr<uint8_t>(),
                                   scales.data_ptr(), zeros.data_ptr(), scales.size(2), pos,
                                   key_layout ? 1 : 0, per_token ? 1 : 0);
    return;
  }
  if (xt == at::kFloat) {
    quantize_append_cpu<float>(x, codes, scales, zeros, pos, key_layout, per_token);
  } else if (xt == at::kHalf) {
    quantize_append_cpu<at::Half>(x, codes, scales, zeros, pos, key_layout, per_token);
  } else {
    quantize_append_cpu<at::BFloat16>(x, codes, scales, zeros, pos, key_layout, per_token);
  }
}

void quantize_append(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     const at::Tensor& zeros, int64_t pos, bool key_layout, bool per_token) {
  const Where where = check_append(kQaNames, x, codes, scales, zeros, pos, key_layout);
  run_append(where, x, codes, scales, zeros, pos, key_layout, per_token);
}

// ---- attention_step ---------------------------------------------------------------------
//
// One attention step of qwen-kvprep's fast path (templates/qwen_kvprep_kv.py): quantize the
// new keys and values into the buffers, then the model's own quantized-cache attention with
// the two kernels. The numbers are those of the model's ATen operations in its order; doing
// them here instead of from Python saves the interpreter's overhead of each, which at batch 1
// costs more than the kernels themselves. Every argument is checked once, up front, before
// anything is written; the kernels then run without checking again (their inputs are the
// checked buffers and tensors allocated here), and no step is taken that does not change a
// number: fp16 -> fp32 -> fp16 round trips, which are exact, are skipped.
//
// query_key: [B, S, 2H, D], the rotated queries (heads 0..H-1) then keys (H..2H-1), any
// strides, the model's dtype; value: [B, S, H, D], any strides, the same dtype.
// key_codes [B,H,D,C], value_codes [B,H,C,D] uint8; the four scale/zero buffers [B,H,C,1]
// fp16; no buffer may share memory with another or with the inputs. pos: the tokens already
// cached. attention_mask: added to the scores (the model's additive mask) or None; causal:
// mask the scores causally (the model does so only when nothing is cached); scale_div: the
// scores are divided by it (0: not scaled); head_mask: multiplies the probabilities, or None;
// per_token: one scale and zero point per new token instead of one per chunk (see
// quantize_append).
// Returns (context [B, S, H*D] in the query's dtype, the cache as the model returns it:
// ((key codes [B,H,L,D] (a transposed view of key_codes), key scales, key zeros),
// (value codes [B,H,L,D], value scales, value zeros))), L = pos + S, views of the buffers.

constexpr const char* kStepName = "attention_step";
constexpr AppendNames kStepKeyNames{kStepName, {"key", "key_codes", "key_scales", "key_zeros"}};
constexpr AppendNames kStepValueNames{
    kStepName, {"value", "value_codes", "value_scales", "value_zeros"}};

// torch < 2.1 has no fp16 softmax or clamp on the CPU: there the scores go through fp32 and
// back (clamping is exact either way; the model's own code fails outright there). Decided by
// the torch this is built against (a build serves one torch), not by catching the error: a
// Python dispatch mode (a profiler, a memory tracer) raises a Python error, not a c10::Error.
#if defined(TORCH_VERSION_MAJOR) && defined(TORCH_VERSION_MINOR)
constexpr bool kOldCpuHalf =
    TORCH_VERSION_MAJOR < 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 1);
#else
constexpr bool kOldCpuHalf = true;  // torch older than its version header
#endif

bool old_cpu_half(const at::Tensor& w) {
  return kOldCpuHalf && w.scalar_type() == at::kHalf && w.device().is_cpu();
}

at::Tensor softmax_last(const at::Tensor& w) {
  if (old_cpu_half(w)) return w.to(at::kFloat).softmax(-1).to(at::kHalf);
  return w.softmax(-1);
}

at::Tensor clamp_fp16_min(const at::Tensor& w) {
  if (old_cpu_half(w)) {
    return w.to(at::kFloat).clamp_(at::Scalar(-65504.0), c10::nullopt).to(at::kHalf);
  }
  return w.clamp_(at::Scalar(-65504.0), c10::nullopt);
}

using CacheTriple = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using StepResult = std::tuple<at::Tensor, std::tuple<CacheTriple, CacheTriple>>;

StepResult attention_step(const at::Tensor& query_key, const at::Tensor& value,
                          const at::Tensor& key_codes, const at::Tensor& key_scales,
                          const at::Tensor& key_zeros, const at::Tensor& value_codes,
                          const at::Tensor& value_scales, const at::Tensor& value_zeros,
                          int64_t pos, const c10::optional<at::Tensor>& attention_mask,
                          bool causal, double scale_div, bool softmax_in_fp32,
                          const c10::optional<at::Tensor>& head_mask, bool per_token) {
  TORCH_CHECK(query_key.defined() && value.defined(), kStepName,
              ": query_key and value must be tensors");
  TORCH_CHECK_VALUE(query_key.dim() == 4 && value.dim() == 4, kStepName,
                    ": query_key must be [B, S, 2H, D] and value [B, S, H, D], got ",
                    shape_str(query_key), ", ", shape_str(value));
  const int64_t B = value.size(0), S = value.size(1), H = value.size(2), D = value.size(3);
  TORCH_CHECK_VALUE(query_key.size(0) == B && query_key.size(1) == S &&
                        query_key.size(2) == 2 * H && query_key.size(3) == D,
                    kStepName, ": query_key must be [B, S, 2H, D] for value [B, S, H, D] = ",
                    shape_str(value), ", got ", shape_str(query_key));
  TORCH_CHECK_TYPE(query_key.scalar_type() == value.scalar_type() &&
                       query_key.device() == value.device(),
                   kStepName, ": query_key and value must have one dtype and device");
  const at::Tensor query = query_key.narrow(2, 0, H);
  const at::Tensor key = query_key.narrow(2, H, H);
  const Where where =
      check_append(kStepKeyNames, key, key_codes, key_scales, key_zeros, pos, true);
  check_append(kStepValueNames, value, value_codes, value_scales, value_zeros, pos, false);
  // Each append is checked against its own buffers above; the two sets must not meet
  // either, and the queries (read after the keys are written) must not lie in any buffer.
  const at::Tensor* kbufs[] = {&key_codes, &key_scales, &key_zeros};
  const at::Tensor* vbufs[] = {&value_codes, &value_scales, &value_zeros};
  for (int i = 0; i < 3; ++i) {
    TORCH_CHECK_VALUE(!spans_overlap(query, *kbufs[i]) && !spans_overlap(query, *vbufs[i]) &&
                          !spans_overlap(key, *vbufs[i]) && !spans_overlap(value, *kbufs[i]),
                      kStepName, ": the buffers must not share memory with query_key or value");
    for (int j = 0; j < 3; ++j) {
      TORCH_CHECK_VALUE(!spans_overlap(*kbufs[i], *vbufs[j]), kStepName,
                        ": the key buffers must not share memory with the value buffers");
    }
  }
  if (attention_mask.has_value() && attention_mask->defined()) {
    TORCH_CHECK(attention_mask->device() == value.device(), kStepName,
                ": attention_mask must be on ", value.device().str());
  }
  if (head_mask.has_value() && head_mask->defined()) {
    TORCH_CHECK(head_mask->device() == value.device(), kStepName,
                ": head_mask must be on ", value.device().str());
  }

  run_append(where, key, key_codes, key_scales, key_zeros, pos, true, per_token);
  run_append(where, value, value_codes, value_scales, value_zeros, pos, false, per_token);
  const int64_t L = pos + S;
  const int64_t key_cap = key_scales.size(2), value_cap = value_scales.size(2);
  const at::Tensor k = key_codes.narrow(3, 0, L);
  const at::Tensor ks = key_scales.narrow(2, 0, L), kz = key_zeros.narrow(2, 0, L);
  const at::Tensor v = value_codes.narrow(2, 0, L);
  const at::Tensor vs = value_scales.narrow(2, 0, L), vz = value_zeros.narrow(2, 0, L);

  const at::ScalarType qt = query.scalar_type();
  const at::TensorOptions half = query.options().dtype(at::kHalf);
  // the model: query.permute(0, 2, 1, 3), then .to(float16).contiguous()
  at::Tensor q = at::empty({B, H, S, D}, half);
  q.copy_(query.permute({0, 2, 1, 3}));
  at::Tensor w = at::empty({B, H, S, L}, half);
  qk_run(where, q, k, w, ks, kz, B * H, S, D, L, key_cap);
  if (scale_div != 0.0) w.div_(scale_div);  // w is ours: in place, the same rounding
  if (causal) {
    const at::Tensor mask =
        at::ones({L, L}, w.options().dtype(at::kBool)).tril_().view({1, 1, L, L});
    w = at::where(mask, w, at::Scalar(-65504.0));  // torch.finfo(torch.float16).min
  }
  if (attention_mask.has_value() && attention_mask->defined()) {
    w = w.add(*attention_mask);  // not in place: the mask's dtype may promote the scores
    if (w.scalar_type() == at::kHalf) {
      // fp16 min + fp16 min is -inf, and a row of them would make softmax NaN
      w = clamp_fp16_min(w);
    }
  }
  w = softmax_in_fp32 ? w.to(at::kFloat).softmax(-1) : softmax_last(w);
  // the model: probabilities .type(query.dtype), times head_mask, then .to(float16) for PV.
  // fp16 probabilities through fp32 (or fp16) and back are unchanged: skip the two copies.
  const bool exact_trip = w.scalar_type() == at::kHalf && (qt == at::kFloat || qt == at::kHalf);
  const bool masked = head_mask.has_value() && head_mask->defined();
  if (masked || !exact_trip) {
    w = w.to(qt);
    if (masked) w = w.mul(*head_mask);
    w = w.to(at::kHalf);
  }
  w = w.contiguous();
  at::Tensor out = at::empty({B, H, S, D}, half);
  pv_run(where, w, v, out, vs, vz, B * H, S, L, D, value_cap);
  // the model: .to(query.dtype), .transpose(1, 2), .contiguous(), .view(B, S, H * D); one
  // copy does the conversion and the transposition
  at::Tensor context = at::empty({B, S, H * D}, query.options());
  context.view({B, S, H, D}).copy_(out.transpose(1, 2));
  return {context, {{k.transpose(2, 3), ks, kz}, {v, vs, vz}}};
}

// What this build offers beyond the two functions the model calls, so that a caller can
// tell it from Qwen's official extension and from older builds of ours.
std::vector<std::string> features() {
  return {"capacity-views", "quantize-append", "attention-step-2"};
}

// For benchmarks and tests; the model never calls it.
constexpr const char* kTuningNames[5] = {"tensor_core_min_q_qk", "tensor_core_min_q_pv",
                                         "pv_split_fp16", "gemm_min_q_qk", "gemm_min_q_pv"};

py::dict cuda_tuning(int64_t tensor_core_min_q_qk, int64_t tensor_core_min_q_pv,
                     int64_t pv_split_fp16, int64_t gemm_min_q_qk, int64_t gemm_min_q_pv) {
  TORCH_CHECK(cuda_entries_present(),
              "cuda_tuning: this extension was built without CUDA (only "
              "cache_autogptq_cuda_256.cpp was compiled)");
  int64_t settings[5] = {tensor_core_min_q_qk, tensor_core_min_q_pv, pv_split_fp16,
                         gemm_min_q_qk, gemm_min_q_pv};
  kvprep_v1_tuning(settings);
  py::dict previous;
  for (int i = 0; i < 5; ++i) previous[kTuningNames[i]] = settings[i];
  return previous;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() =
      "Int8 KV-cache kernels for Qwen (v1), written for qwen-kvprep (CPU, and CUDA when "
      "cache_autogptq_cuda_kernel_256.cu is compiled in).";
  m.def("vecquant8matmul_batched_faster_old", &vecquant8matmul_batched_faster_old,
        "mul[b,h,q,l] = sum_d vec[b,h,q,d] * scales[b,h,l] * (mat[b,h,d,l] - zeros[b,h,l]); "
        "vec [B,H,Q,D] fp16, mat [B,H,D,L] uint8, mul [B,H,Q,L] fp16 (overwritten), "
        "scales/zeros [B,H,L,1] fp16",
        py::arg("vec"), py::arg("mat"), py::arg("mul"), py::arg("scales"), py::arg("zeros"),
        py::call_guard<py::gil_scoped_release>());
  m.def("vecquant8matmul_batched_column_compression_faster_old",
        &vecquant8matmul_batched_column_compression_faster_old,
        "mul[b,h,q,d] = sum_l vec[b,h,q,l] * scales[b,h,l] * (mat[b,h,l,d] - zeros[b,h,l]); "
        "vec [B,H,Q,L] fp16, mat [B,H,L,D] uint8, mul [B,H,Q,D] fp16 (overwritten), "
        "scales/zeros [B,H,L,1] fp16",
        py::arg("vec"), py::arg("mat"), py::arg("mul"), py::arg("scales"), py::arg("zeros"),
        py::call_guard<py::gil_scoped_release>());
  m.def("cuda_tuning", &cuda_tuning,
        "Benchmarks only: set (values >= 0) or read (-1) the CUDA dispatch settings: the query "
        "length from which QK and PV use their tensor-core kernels, whether the tensor-core "
        "PV splits the dequantized cache into two fp16 parts (1) or rounds it once (0), and "
        "the query length from which they dequantize into a workspace and use torch's "
        "matmul. Returns the previous settings.",
        py::arg("tensor_core_min_q_qk") = -1, py::arg("tensor_core_min_q_pv") = -1,
        py::arg("pv_split_fp16") = -1, py::arg("gemm_min_q_qk") = -1,
        py::arg("gemm_min_q_pv") = -1);
  m.def("quantize_append", &quantize_append,
        "Quantizes x [B,S,H,D] (fp32/fp16/bf16, any strides) as the model does (per (b,h) "
        "over the chunk, or per (b,h,s) with per_token) and writes the codes at token "
        "positions [pos, pos+S) of codes (contiguous uint8 [B,H,C,D], or [B,H,D,C] with "
        "key_layout) and the fp16 scale/zero at those positions of scales/zeros "
        "(contiguous [B,H,C,1]); the rest of the buffers is untouched",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("zeros"), py::arg("pos"),
        py::arg("key_layout"), py::arg("per_token"), py::call_guard<py::gil_scoped_release>());
  m.def("attention_step", &attention_step,
        "qwen-kvprep's fast path, one attention step: quantize the keys (the second half of "
        "query_key's heads) and values into the buffers at pos, then the model's "
        "quantized-cache attention; returns (context, ((key codes, key scales, key zeros), "
        "(value codes, value scales, value zeros))), the cache as views of the buffers in "
        "the model's layout",
        py::arg("query_key"), py::arg("value"), py::arg("key_codes"), py::arg("key_scales"),
        py::arg("key_zeros"), py::arg("value_codes"), py::arg("value_scales"),
        py::arg("value_zeros"), py::arg("pos"), py::arg("attention_mask"), py::arg("causal"),
        py::arg("scale_div"), py::arg("softmax_in_fp32"), py::arg("head_mask"),
        py::arg("per_token") = false, py::call_guard<py::gil_scoped_release>());
  m.def("features", &features,
        "Capabilities beyond the model's two functions: 'capacity-views' (mat/scales/zeros "
        "may be views of the first L tokens of bigger contiguous buffers), "
        "'quantize-append', 'attention-step-2' (attention_step as this build defines it)");
  m.def("built_with_cuda", &cuda_entries_present,
        "True when the CUDA kernels were compiled into this extension");
}
