// Runs the CUDA kernels of kernels/cache_autogptq_cuda_kernel_256.cu on the CPU through
// the stand-ins in include/ and compares them with a double-precision reference of the
// formulas. Built and run by tests/test_kernels_cuda_emulated.py (ideally under
// AddressSanitizer). The launch plans are the .cu's own; only the launch glue (stream,
// device guard, <<<>>>) is mirrored here. Prints one line per case; exit status 1 on any
// mismatch.

#define __CUDA_ARCH__ 900  // the device view of the source: no torch glue
#include "cache_autogptq_cuda_kernel_256.cu"

#include <algorithm>
#include <deque>
#include <functional>
#include <random>
#include <thread>
#include <vector>

using kvprep_v1::kThreads;

// The block's kThreads CUDA threads, as OS threads made once for the whole run: making
// them anew for each block was most of the run (under AddressSanitizer above all, which
// maps and poisons every new thread's stack). Blocks still run one after another.
class Block {
 public:
  Block() : start_(kThreads + 1), done_(kThreads + 1) {
    threads_.reserve(kThreads);
    for (int t = 0; t < kThreads; ++t) threads_.emplace_back([this, t] { serve(t); });
  }
  ~Block() {
    stop_ = true;
    start_.arrive_and_wait();
    for (auto& th : threads_) th.join();
  }
  // Every thread runs `kernel` as block `b`; returns when all have returned.
  void run(int64_t b, const std::function<void()>& kernel) {
    kernel_ = &kernel;
    block_ = b;
    start_.arrive_and_wait();  // the barriers order these writes before the threads' reads
    done_.arrive_and_wait();
  }

 private:
  void serve(int t) {
    kvemu::thread_idx.x = static_cast<unsigned>(t);
    for (;;) {
      start_.arrive_and_wait();
      if (stop_) return;
      kvemu::block_idx.x = static_cast<unsigned>(block_);
      (*kernel_)();
      done_.arrive_and_wait();
    }
  }
  std::barrier<> start_, done_;
  std::vector<std::thread> threads_;
  const std::function<void()>* kernel_ = nullptr;
  int64_t block_ = 0;
  bool stop_ = false;
};

static Block& the_block() {
  static Block block;
  return block;
}

template <class F>
static void launch(int64_t blocks, F&& kernel) {
  Block& block = the_block();
  const std::function<void()> body = [&kernel] { kernel(); };
  kvemu::grid_dim = dim3(static_cast<unsigned>(blocks));
  for (int64_t b = 0; b < blocks; ++b) {
    std::barrier<> bar(kThreads);
    kvemu::block_barrier = &bar;
    std::deque<std::barrier<>> warps;
    for (int w = 0; w < kThreads / 32; ++w) kvemu::warp_barrier[w] = &warps.emplace_back(32);
    block.run(b, body);
  }
}

struct Data {
  std::vector<__half> vec, out, scales, zeros;
  std::vector<unsigned char> mat_buf;  // the cache, `offset` bytes into this buffer
  const unsigned char* mat = nullptr;
  int64_t mat_bytes = 0;
};

// `L`: the scales/zeros per head (the buffers' capacity C for a capacity view).
static Data make(int64_t BH, int64_t vec_n, int64_t mat_n, int64_t out_n, int64_t L,
                 int offset, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  Data d;
  d.vec.resize(vec_n);
  for (auto& v : d.vec) v = __float2half_rn(normal(rng));
  d.mat_buf.resize(mat_n + offset);
  for (auto& m : d.mat_buf) m = static_cast<unsigned char>(rng() & 0xFF);
  d.mat = d.mat_buf.data() + offset;
  d.mat_bytes = mat_n;
  d.scales.resize(BH * L);
  d.zeros.resize(BH * L);
  for (auto& s : d.scales) s = __float2half_rn(uni(rng) * 0.03f + 0.002f);
  for (auto& z : d.zeros) z = __float2half_rn(uni(rng) * 255.0f);
  d.out.assign(out_n, __float2half_rn(NAN));
  kvemu::read_lo = d.mat;
  kvemu::read_hi = d.mat + mat_n;
  return d;
}

static double h2d(__half h) { return static_cast<double>(__half2float(h)); }

// Worst |out - ref| / tolerance (must be <= 1); infinity for an unwritten (NaN) element.
// `mag_rel` is the error allowed per unit of sum |term|: 2e-5 for fp32-level paths, 2^-11
// for a path that rounds each dequantized value to fp16 once.
static double compare(const std::vector<__half>& out, const std::vector<double>& ref,
                      const std::vector<double>& mag, double mag_rel = 2e-5) {
  double worst = 0.0;
  for (size_t i = 0; i < out.size(); ++i) {
    const double o = h2d(out[i]);
    if (std::isnan(o)) return INFINITY;
    const double tol = std::fabs(ref[i]) * std::ldexp(1.0, -10) + mag[i] * mag_rel + 1e-6;
    worst = std::max(worst, std::fabs(o - ref[i]) / tol);
  }
  return worst;
}

// The kernels read vec and write out with 16-byte accesses when the host says they may:
// here the buffers come from std::vector, so that is decided the same way.
static bool al16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// cap: the cache is the first L tokens of buffers with room for cap (0: cap = L, the
// contiguous case). The unused bytes and scales of the buffers hold garbage; reads stop at
// the .cu's own qk_mat_end.
static bool run_qk(int64_t BH, int64_t Q, int64_t D, int64_t L, int offset, bool tc = false,
                   int64_t cap = 0) {
  const int64_t C = cap > 0 ? cap : L;
  Data d = make(BH, BH * Q * D, BH * D * C, BH * Q * L, C, offset, 7u * L + D + Q);
  for (int64_t i = 0; i < BH * C; ++i) {
    if (i % C >= L) d.scales[i] = d.zeros[i] = __float2half_rn(NAN);
  }
  const kvprep_v1::QkPlan p = kvprep_v1::qk_plan(BH, Q, L);
  const kvprep_v1::TcQkPlan t = kvprep_v1::tc_qk_plan(BH, Q, L);
  auto go = [&](const unsigned char* mat, const __half* sc, const __half* ze, int64_t pitch,
                std::vector<__half>& out) {
    const unsigned char* mat_end = kvprep_v1::qk_mat_end(mat, BH, D, L, pitch);
    kvemu::read_lo = mat;
    kvemu::read_hi = mat_end;
    if (tc) {
      const bool vec_ok = al16(d.vec.data()) && D % 8 == 0;
      const bool out_ok = al16(out.data()) && L % 8 == 0;
      launch(t.blocks, [&] {
        kvprep_v1::tc_qk(d.vec.data(), mat, out.data(), sc, ze, Q, D, L, pitch, t.n_ltiles,
                         t.n_qtiles, vec_ok, out_ok, mat_end);
      });
    } else if (p.qt == 1) {
      launch(p.blocks, [&] {
        kvprep_v1::qk_q1(d.vec.data(), mat, out.data(), sc, ze, Q, D, L, pitch, p.n_ltiles,
                         p.n_qtiles, mat_end);
      });
    } else {
      launch(p.blocks, [&] {
        kvprep_v1::qk_q4(d.vec.data(), mat, out.data(), sc, ze, Q, D, L, pitch, p.n_ltiles,
                         p.n_qtiles, mat_end);
      });
    }
  };
  go(d.mat, d.scales.data(), d.zeros.data(), C, d.out);
  // A capacity view must give bit for bit what its contiguous copy gives.
  bool same = true;
  if (C != L) {
    std::vector<unsigned char> mat_c(BH * D * L);
    std::vector<__half> sc_c(BH * L), ze_c(BH * L), out_c(BH * Q * L, __float2half_rn(NAN));
    for (int64_t r = 0; r < BH * D; ++r)
      for (int64_t l = 0; l < L; ++l) mat_c[r * L + l] = d.mat[r * C + l];
    for (int64_t bh = 0; bh < BH; ++bh)
      for (int64_t l = 0; l < L; ++l) {
        sc_c[bh * L + l] = d.scales[bh * C + l];
        ze_c[bh * L + l] = d.zeros[bh * C + l];
      }
    go(mat_c.data(), sc_c.data(), ze_c.data(), L, out_c);
    same = std::memcmp(out_c.data(), d.out.data(), out_c.size() * sizeof(__half)) == 0;
  }
  std::vector<double> ref(BH * Q * L, 0.0), mag(BH * Q * L, 0.0);
  for (int64_t bh = 0; bh < BH; ++bh)
    for (int64_t q = 0; q < Q; ++q)
      for (int64_t l = 0; l < L; ++l) {
        double r = 0, m = 0;
        for (int64_t k = 0; k < D; ++k) {
          const double v = h2d(d.vec[(bh * Q + q) * D + k]);
          const double dq = h2d(d.scales[bh * C + l]) *
                            (static_cast<double>(d.mat[(bh * D + k) * C + l]) -
                             h2d(d.zeros[bh * C + l]));
          r += v * dq;
          m += std::fabs(v * dq);
        }
        ref[(bh * Q + q) * L + l] = r;
        mag[(bh * Q + q) * L + l] = m;
      }
  const double worst = compare(d.out, ref, mag);
  const bool ok = worst <= 1.0 && same;
  std::printf(
      "qk%s BH=%lld Q=%lld D=%lld L=%lld C=%lld offset=%d blocks=%lld: error/tolerance %.3g%s "
      "%s\n",
      tc ? "[tc]" : "", (long long)BH, (long long)Q, (long long)D, (long long)L, (long long)C,
      offset, (long long)(tc ? t.blocks : p.blocks), worst,
      C == L ? "" : same ? ", view == contiguous" : ", VIEW DIFFERS FROM CONTIGUOUS",
      ok ? "ok" : "FAIL");
  return ok;
}

enum class Pv { kCudaCores, kTensorHiLo, kTensorSingle };

static bool run_pv(int64_t BH, int64_t Q, int64_t D, int64_t L, int offset, int sms,
                   Pv path = Pv::kCudaCores, int64_t cap = 0) {
  const int64_t C = cap > 0 ? cap : L;
  Data d = make(BH, BH * Q * L, BH * C * D, BH * Q * D, C, offset, 11u * L + D + Q);
  for (int64_t i = 0; i < BH * C; ++i) {
    if (i % C >= L) d.scales[i] = d.zeros[i] = __float2half_rn(NAN);
  }
  const kvprep_v1::PvPlan p = kvprep_v1::pv_plan(sms, BH, Q, L, D);
  const kvprep_v1::TcPvPlan t = kvprep_v1::tc_pv_plan(sms, BH, Q, L, D);
  const bool tc = path != Pv::kCudaCores;
  const int64_t n_split = tc ? t.n_split : p.n_split;
  std::vector<float> part(tc ? t.part_floats : p.part_floats);  // exactly what the plan asks
  float* part_ptr = part.empty() ? nullptr : part.data();
  auto go = [&](const unsigned char* mat, const __half* sc, const __half* ze, int64_t pitch,
                std::vector<__half>& out) {
    const unsigned char* mat_end = kvprep_v1::pv_mat_end(mat, BH, L, D, pitch);
    kvemu::read_lo = mat;
    kvemu::read_hi = mat_end;
    const bool vec_ok = al16(d.vec.data()) && L % 8 == 0;
    const bool out_ok = al16(out.data()) && D % 8 == 0;
    auto body = [&] {
      if (path == Pv::kTensorHiLo) {
        kvprep_v1::tc_pv_hilo(d.vec.data(), mat, out.data(), part_ptr, sc, ze, Q, L, pitch, D,
                              t.n_split, t.rows_per_split, t.n_qtiles, t.n_dtiles, vec_ok,
                              out_ok, mat_end);
      } else if (path == Pv::kTensorSingle) {
        kvprep_v1::tc_pv_single(d.vec.data(), mat, out.data(), part_ptr, sc, ze, Q, L, pitch,
                                D, t.n_split, t.rows_per_split, t.n_qtiles, t.n_dtiles, vec_ok,
                                out_ok, mat_end);
      } else if (p.qt == 1) {
        kvprep_v1::pv_q1(d.vec.data(), mat, out.data(), part_ptr, sc, ze, Q, L, pitch, D, p.tpr,
                         p.n_split, p.rows_per_split, p.n_qtiles, p.n_dtiles, mat_end);
      } else {
        kvprep_v1::pv_q4(d.vec.data(), mat, out.data(), part_ptr, sc, ze, Q, L, pitch, D, p.tpr,
                         p.n_split, p.rows_per_split, p.n_qtiles, p.n_dtiles, mat_end);
      }
    };
    launch(tc ? t.blocks : p.blocks, body);
    if (part_ptr != nullptr) {
      const int64_t total = BH * Q * D;
      launch(kvprep_v1::finalize_blocks(total), [&] {
        kvprep_v1::pv_finalize(part_ptr, out.data(), total, Q, D, n_split);
      });
    }
  };
  go(d.mat, d.scales.data(), d.zeros.data(), C, d.out);
  // A capacity view must give bit for bit what its contiguous copy gives.
  bool same = true;
  if (C != L) {
    std::vector<unsigned char> mat_c(BH * L * D);
    std::vector<__half> sc_c(BH * L), ze_c(BH * L), out_c(BH * Q * D, __float2half_rn(NAN));
    for (int64_t bh = 0; bh < BH; ++bh)
      for (int64_t l = 0; l < L; ++l) {
        std::memcpy(&mat_c[(bh * L + l) * D], d.mat + (bh * C + l) * D, D);
        sc_c[bh * L + l] = d.scales[bh * C + l];
        ze_c[bh * L + l] = d.zeros[bh * C + l];
      }
    go(mat_c.data(), sc_c.data(), ze_c.data(), L, out_c);
    same = std::memcmp(out_c.data(), d.out.data(), out_c.size() * sizeof(__half)) == 0;
  }
  std::vector<double> ref(BH * Q * D, 0.0), mag(BH * Q * D, 0.0);
  for (int64_t bh = 0; bh < BH; ++bh)
    for (int64_t q = 0; q < Q; ++q)
      for (int64_t k = 0; k < D; ++k) {
        double r = 0, m = 0;
        for (int64_t l = 0; l < L; ++l) {
          const double v = h2d(d.vec[(bh * Q + q) * L + l]);
          const double dq = h2d(d.scales[bh * C + l]) *
                            (static_cast<double>(d.mat[(bh * C + l) * D + k]) -
                             h2d(d.zeros[bh * C + l]));
          r += v * dq;
          m += std::fabs(v * dq);
        }
        ref[(bh * Q + q) * D + k] = r;
        mag[(bh * Q + q) * D + k] = m;
      }
  const double worst =
      compare(d.out, ref, mag, path == Pv::kTensorSingle ? std::ldexp(1.0, -11) : 2e-5);
  const bool ok = worst <= 1.0 && same;
  const char* tag = path == Pv::kTensorHiLo ? "[tc]" : path == Pv::kTensorSingle ? "[tc1]" : "";
  std::printf(
      "pv%s BH=%lld Q=%lld D=%lld L=%lld C=%lld offset=%d sms=%d blocks=%lld splits=%lld: "
      "error/tolerance %.3g%s %s\n",
      tag, (long long)BH, (long long)Q, (long long)D, (long long)L, (long long)C, offset, sms,
      (long long)(tc ? t.blocks : p.blocks), (long long)n_split, worst,
      C == L ? "" : same ? ", view == contiguous" : ", VIEW DIFFERS FROM CONTIGUOUS",
      ok ? "ok" : "FAIL");
  return ok;
}

// The GEMM path's dequantize kernel: every value scales * (code - zero), rounded once.
// cap: the token capacity of the buffers (0: contiguous); the tokens are QK's columns
// (per_col) or PV's rows.
static bool run_dequant(int64_t BH, int64_t R, int64_t C, bool per_col, int offset,
                        int64_t cap = 0) {
  const int64_t n = BH * R * C;
  const int64_t tokens = per_col ? C : R;
  const int64_t T = cap > 0 ? cap : tokens;
  const int64_t mat_n = per_col ? BH * R * T : BH * T * C;
  Data d = make(BH, 0, mat_n, n, T, offset, 13u * R + C);
  for (int64_t i = 0; i < BH * T; ++i) {
    if (i % T >= tokens) d.scales[i] = d.zeros[i] = __float2half_rn(NAN);
  }
  const unsigned char* mat_end = per_col ? kvprep_v1::qk_mat_end(d.mat, BH, R, C, T)
                                         : kvprep_v1::pv_mat_end(d.mat, BH, R, C, T);
  kvemu::read_hi = mat_end;
  const bool out_ok = al16(d.out.data()) && C % 8 == 0;
  launch(kvprep_v1::dequant_blocks(BH, R, C, 3), [&] {
    kvprep_v1::dequant(d.mat, d.scales.data(), d.zeros.data(), d.out.data(), BH, R, C, T,
                       per_col, out_ok, mat_end);
  });
  double worst = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t bh = i / (R * C);
    const int64_t r = (i / C) % R;
    const int64_t c = i % C;
    const int64_t idx = bh * T + (per_col ? c : r);
    const int64_t m = per_col ? (bh * R + r) * T + c : (bh * T + r) * C + c;
    const double ref = h2d(d.scales[idx]) * (static_cast<double>(d.mat[m]) - h2d(d.zeros[idx]));
    const double o = h2d(d.out[i]);
    // one rounding to fp16 (of a product already rounded to float: a hair over half an ulp)
    const double tol = std::fabs(ref) * std::ldexp(1.0, -11) * (1 + 1e-3) + 1e-7;
    worst = std::isnan(o) ? INFINITY : std::max(worst, std::fabs(o - ref) / tol);
  }
  std::printf(
      "dequant BH=%lld R=%lld C=%lld cap=%lld per_col=%d offset=%d: error/tolerance %.3g %s\n",
      (long long)BH, (long long)R, (long long)C, (long long)T, per_col ? 1 : 0, offset, worst,
      worst <= 1.0 ? "ok" : "FAIL");
  return worst <= 1.0;
}

// ---- quantize_append ------------------------------------------------------------------

// x's dtype rounding, written independently of the kernel's: fp16 through the compiler's
// _Float16, bf16 (8 significant bits) through frexp / nearbyint (round to nearest even).
static float round_to(float v, int dtype) {
  if (dtype == kvprep_v1::kQaF16) return static_cast<float>(static_cast<_Float16>(v));
  if (dtype == kvprep_v1::kQaBF16) {
    if (v == 0.0f || !std::isfinite(v)) return v;
    int e = 0;
    const double m = std::frexp(static_cast<double>(v), &e);  // v = m * 2^e, |m| in [0.5, 1)
    return static_cast<float>(std::ldexp(std::nearbyint(std::ldexp(m, 8)), e - 8));
  }
  return v;
}

// x [B, S, H, D] with strides xs; codes/scales/zeros buffers of capacity C with garbage
// outside [pos, pos + S); the result against the model's arithmetic as torch does it on
// CUDA (each op in fp32, rounded to x's dtype; the division by 255 as a multiplication by
// fp32(1 / 255)), exactly, and the garbage left as it was.
static bool run_qa(int64_t B, int64_t S, int64_t H, int64_t D, int64_t C, int64_t pos,
                   int dtype, bool key_layout, bool per_token, bool head_major_x) {
  std::mt19937 rng(static_cast<unsigned>(B * 1000 + S * 100 + D + pos + dtype));
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> uni(0.1f, 20.0f);
  // x lives in a bigger buffer: the middle third of a fused projection [B, S, 3, H, D], or
  // (head_major_x) a [B, H, D, S] tensor seen as [B, S, H, D].
  int64_t xs[4];
  int64_t x_off = 0;
  if (head_major_x) {
    xs[0] = H * D * S; xs[1] = 1; xs[2] = D * S; xs[3] = S;
  } else {
    xs[0] = S * 3 * H * D; xs[1] = 3 * H * D; xs[2] = D; xs[3] = 1;
    x_off = H * D;
  }
  const int64_t x_n = head_major_x ? B * H * D * S : B * S * 3 * H * D;
  std::vector<float> xv(x_n);
  for (auto& v : xv) v = round_to(normal(rng), dtype);  // the rest of the projection
  std::vector<float> head_scale(B * H);                 // a different range per head
  for (auto& h : head_scale) h = uni(rng);
  auto idx_of = [&](int64_t b, int64_t s, int64_t h, int64_t d) {
    return x_off + b * xs[0] + s * xs[1] + h * xs[2] + d * xs[3];
  };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) {
          xv[idx_of(b, s, h, d)] =
              round_to((normal(rng) * 3.0f + 0.7f) * head_scale[b * H + h], dtype);
        }
  auto at = [&](int64_t b, int64_t s, int64_t h, int64_t d) { return xv[idx_of(b, s, h, d)]; };
  std::vector<float> x32(xv);
  std::vector<_Float16> x16(x_n);
  std::vector<uint16_t> xbf(x_n);
  for (int64_t i = 0; i < x_n; ++i) {
    x16[i] = static_cast<_Float16>(xv[i]);
    uint32_t u;
    std::memcpy(&u, &xv[i], 4);
    xbf[i] = static_cast<uint16_t>(u >> 16);  // exact: xv holds bf16 values
  }
  const void* xp = dtype == kvprep_v1::kQaF32   ? static_cast<const void*>(x32.data() + x_off)
                   : dtype == kvprep_v1::kQaF16 ? static_cast<const void*>(x16.data() + x_off)
                                                : static_cast<const void*>(xbf.data() + x_off);
  std::vector<unsigned char> codes(B * H * C * D);
  for (auto& c : codes) c = static_cast<unsigned char>(rng() & 0xFF);
  std::vector<__half> scales(B * H * C), zeros(B * H * C);
  for (auto& v : scales) v = __float2half_rn(normal(rng));
  for (auto& v : zeros) v = __float2half_rn(normal(rng));
  std::vector<unsigned char> codes_ref(codes);
  std::vector<__half> scales_ref(scales), zeros_ref(zeros);

  const float inv255 = 1.0f / 255.0f;
  const int64_t ns = per_token ? 1 : S;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t s0 = 0; s0 < S; s0 += ns) {
        float mn = at(b, s0, h, 0), mx = mn;
        for (int64_t s = s0; s < s0 + ns; ++s)
          for (int64_t d = 0; d < D; ++d) {
            mn = std::min(mn, at(b, s, h, d));
            mx = std::max(mx, at(b, s, h, d));
          }
        const float scale = round_to(round_to(mx - mn, dtype) * inv255, dtype);
        const float zero = round_to(0.0f - round_to(mn / scale, dtype), dtype);
        for (int64_t s = s0; s < s0 + ns; ++s) {
          const int64_t p = pos + s;
          scales_ref[(b * H + h) * C + p] = __float2half_rn(scale);
          zeros_ref[(b * H + h) * C + p] = __float2half_rn(zero);
          for (int64_t d = 0; d < D; ++d) {
            const float t = round_to(round_to(at(b, s, h, d) / scale, dtype) + zero, dtype);
            const int64_t idx = key_layout ? ((b * H + h) * D + d) * C + p
                                           : ((b * H + h) * C + p) * D + d;
            codes_ref[idx] = static_cast<unsigned char>(
                static_cast<int>(std::clamp(t, 0.0f, 255.0f)));
          }
        }
      }

  launch(kvprep_v1::quantize_append_blocks(B, H, S, per_token), [&] {
    kvprep_v1::quantize_append(xp, dtype, xs[0], xs[1], xs[2], xs[3], H, S, D, codes.data(),
                               scales.data(), zeros.data(), C, pos, key_layout, per_token);
  });
  int64_t bad_codes = 0;
  for (size_t i = 0; i < codes.size(); ++i) bad_codes += codes[i] != codes_ref[i];
  int64_t bad_sz = 0;
  for (size_t i = 0; i < scales.size(); ++i) {
    bad_sz += std::memcmp(&scales[i], &scales_ref[i], sizeof(__half)) != 0;
    bad_sz += std::memcmp(&zeros[i], &zeros_ref[i], sizeof(__half)) != 0;
  }
  const bool ok = bad_codes == 0 && bad_sz == 0;
  const char* names[] = {"f32", "f16", "bf16"};
  std::printf(
      "qa[%s] B=%lld S=%lld H=%lld D=%lld C=%lld pos=%lld key_layout=%d per_token=%d x=%s: "
      "%lld codes and %lld scales/zeros differ %s\n",
      names[dtype], (long long)B, (long long)S, (long long)H, (long long)D, (long long)C,
      (long long)pos, key_layout ? 1 : 0, per_token ? 1 : 0,
      head_major_x ? "head-major" : "split", (long long)bad_codes, (long long)bad_sz,
      ok ? "ok" : "FAIL");
  return ok;
}

int main() {
  bool ok = true;
  // BH, Q, D, L, byte offset of the cache
  ok &= run_qk(2, 1, 128, 512, 0);   // aligned rows, one full tile
  ok &= run_qk(2, 1, 128, 129, 0);   // misaligned rows (L % 16 != 0), partial tile
  ok &= run_qk(1, 5, 128, 1000, 0);  // two query tiles, two token tiles
  ok &= run_qk(2, 1, 3, 7, 0);       // tiny
  ok &= run_qk(1, 2, 300, 40, 1);    // D over one staged chunk, odd base address
  ok &= run_qk(1, 1, 64, 1, 0);
  ok &= run_qk(3, 4, 80, 513, 1);
  ok &= run_qk(1, 1, 16, 32, 0);     // every row aligned, 16-byte loads only
  // BH, Q, D, L, byte offset, multiprocessors (more => the tokens split over blocks)
  ok &= run_pv(2, 1, 128, 512, 0, 1);
  ok &= run_pv(2, 1, 128, 1100, 0, 100);  // three splits + finalize
  ok &= run_pv(1, 5, 72, 1100, 1, 100);   // misaligned rows, odd base, query tiles, splits
  ok &= run_pv(2, 1, 3, 7, 0, 1);
  ok &= run_pv(1, 2, 600, 40, 0, 1);      // two dim tiles (D > 512)
  ok &= run_pv(1, 3, 128, 2049, 1, 50);
  ok &= run_pv(2, 1, 16, 1, 0, 1);
  // Tensor-core kernels: query and token tiles with tails, odd D (K tail for QK, column
  // tail for PV), misaligned rows and base addresses, split tokens with finalize.
  ok &= run_qk(2, 70, 128, 300, 0, true);   // two query tiles, two token tiles, tails
  ok &= run_qk(1, 5, 72, 1000, 1, true);    // D not a multiple of the 32-wide K chunk
  ok &= run_qk(1, 17, 3, 7, 0, true);       // tiny
  ok &= run_qk(1, 64, 128, 264, 0, true);   // aligned: 16-byte query loads and stores
  ok &= run_pv(2, 70, 128, 300, 0, 1, Pv::kTensorHiLo);
  ok &= run_pv(1, 5, 72, 1000, 1, 100, Pv::kTensorHiLo);    // splits, odd rows and base
  ok &= run_pv(1, 64, 136, 264, 0, 1, Pv::kTensorHiLo);     // two dim tiles, aligned
  ok &= run_pv(1, 3, 5, 9, 0, 1, Pv::kTensorHiLo);
  ok &= run_pv(1, 40, 128, 600, 0, 100, Pv::kTensorSingle);  // splits
  ok &= run_pv(1, 20, 128, 1100, 0, 1, Pv::kTensorHiLo);      // partial sums flushed twice
  // The dequantize kernel of the GEMM path.
  ok &= run_dequant(2, 128, 300, true, 0);   // QK layout, misaligned rows
  ok &= run_dequant(2, 300, 128, false, 1);  // PV layout, odd base address
  ok &= run_dequant(1, 7, 5, true, 0);       // tiny
  ok &= run_dequant(3, 33, 64, false, 0);    // aligned: 16-byte loads and stores
  // Capacity views: the cache is the first L tokens of buffers with room for C (the last
  // argument); every kernel must match the reference and its contiguous copy bit for bit.
  ok &= run_qk(2, 1, 128, 500, 0, false, 512);   // C % 16 == 0: aligned rows, L < C
  ok &= run_qk(2, 1, 64, 1, 0, false, 48);       // one cached token
  ok &= run_qk(1, 5, 80, 129, 1, false, 151);    // odd L, C not a multiple of 16, odd base
  ok &= run_qk(2, 70, 128, 300, 0, true, 320);   // tensor cores
  ok &= run_qk(1, 17, 72, 7, 1, true, 21);
  ok &= run_pv(2, 1, 128, 1100, 0, 100, Pv::kCudaCores, 1200);  // splits + finalize
  ok &= run_pv(1, 5, 72, 1, 1, 1, Pv::kCudaCores, 9);
  ok &= run_pv(1, 3, 40, 77, 0, 1, Pv::kCudaCores, 83);
  ok &= run_pv(2, 70, 128, 300, 0, 1, Pv::kTensorHiLo, 333);
  ok &= run_pv(1, 40, 128, 600, 0, 100, Pv::kTensorSingle, 640);
  ok &= run_dequant(2, 128, 300, true, 0, 320);   // QK layout: rows of 300 at pitch 320
  ok &= run_dequant(2, 300, 128, false, 1, 333);  // PV layout: 300 of 333 rows per head
  ok &= run_dequant(1, 7, 5, true, 0, 21);
  // quantize_append: B, S, H, D, C, pos, dtype, key layout, per token, head-major x
  for (int dt : {kvprep_v1::kQaF32, kvprep_v1::kQaF16, kvprep_v1::kQaBF16}) {
    ok &= run_qa(2, 1, 3, 128, 64, 17, dt, false, false, false);  // decode, values
    ok &= run_qa(2, 1, 3, 128, 64, 63, dt, true, false, false);   // decode, keys, last slot
    ok &= run_qa(1, 37, 2, 24, 80, 5, dt, true, false, true);     // prefill: 888 values/block
    ok &= run_qa(1, 37, 2, 24, 40, 3, dt, false, false, false);
    ok &= run_qa(2, 9, 2, 24, 12, 3, dt, false, true, false);     // per token
    ok &= run_qa(1, 3, 2, 300, 8, 5, dt, true, true, true);       // per token, D > 256
  }
  std::printf(ok ? "ALL OK\n" : "SOME FAILED\n");
  return ok ? 0 : 1;
}
