// Runs the CUDA kernels of kernels/cache_autogptq_cuda_kernel_256.cu on the CPU through
// the stand-ins in include/ and compares them with a double-precision reference of the
// formulas. Built and run by tests/test_kernels_cuda_emulated.py (ideally under
// AddressSanitizer). The launch plans are the .cu's own; only the launch glue (stream,
// device guard, <<<>>>) is mirrored here. Prints one line per case; exit status 1 on any
// mismatch.

#define __CUDA_ARCH__ 900  // the device view of the source: no torch glue
#include "cache_autogptq_cuda_kernel_256.cu"

#include <deque>
#include <random>
#include <thread>
#include <vector>

using kvprep_v1::kThreads;

template <class F>
static void launch(int64_t blocks, F&& kernel) {
  kvemu::grid_dim = dim3(static_cast<unsigned>(blocks));
  for (int64_t b = 0; b < blocks; ++b) {
    std::barrier<> bar(kThreads);
    kvemu::block_barrier = &bar;
    std::deque<std::barrier<>> warps;
    for (int w = 0; w < kThreads / 32; ++w) kvemu::warp_barrier[w] = &warps.emplace_back(32);
    std::vector<std::thread> threads;
    threads.reserve(kThreads);
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&kernel, t, b] {
        kvemu::thread_idx.x = static_cast<unsigned>(t);
        kvemu::block_idx.x = static_cast<unsigned>(b);
        kernel();
      });
    }
    for (auto& th : threads) th.join();
  }
}

struct Data {
  std::vector<__half> vec, out, scales, zeros;
  std::vector<unsigned char> mat_buf;  // the cache, `offset` bytes into this buffer
  const unsigned char* mat = nullptr;
  int64_t mat_bytes = 0;
};

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

static bool run_qk(int64_t BH, int64_t Q, int64_t D, int64_t L, int offset, bool tc = false) {
  Data d = make(BH, BH * Q * D, BH * D * L, BH * Q * L, L, offset, 7u * L + D + Q);
  const kvprep_v1::QkPlan p = kvprep_v1::qk_plan(BH, Q, L);
  const unsigned char* mat_end = d.mat + d.mat_bytes;
  const kvprep_v1::TcQkPlan t = kvprep_v1::tc_qk_plan(BH, Q, L);
  if (tc) {
    const bool vec_ok = al16(d.vec.data()) && D % 8 == 0;
    const bool out_ok = al16(d.out.data()) && L % 8 == 0;
    launch(t.blocks, [&] {
      kvprep_v1::tc_qk(d.vec.data(), d.mat, d.out.data(), d.scales.data(), d.zeros.data(), Q, D,
                       L, t.n_ltiles, t.n_qtiles, vec_ok, out_ok, mat_end);
    });
  } else if (p.qt == 1) {
    launch(p.blocks, [&] {
      kvprep_v1::qk_q1(d.vec.data(), d.mat, d.out.data(), d.scales.data(), d.zeros.data(), Q, D,
                       L, p.n_ltiles, p.n_qtiles, mat_end);
    });
  } else {
    launch(p.blocks, [&] {
      kvprep_v1::qk_q4(d.vec.data(), d.mat, d.out.data(), d.scales.data(), d.zeros.data(), Q, D,
                       L, p.n_ltiles, p.n_qtiles, mat_end);
    });
  }
  std::vector<double> ref(BH * Q * L, 0.0), mag(BH * Q * L, 0.0);
  for (int64_t bh = 0; bh < BH; ++bh)
    for (int64_t q = 0; q < Q; ++q)
      for (int64_t l = 0; l < L; ++l) {
        double r = 0, m = 0;
        for (int64_t k = 0; k < D; ++k) {
          const double v = h2d(d.vec[(bh * Q + q) * D + k]);
          const double dq = h2d(d.scales[bh * L + l]) *
                            (static_cast<double>(d.mat[(bh * D + k) * L + l]) -
                             h2d(d.zeros[bh * L + l]));
          r += v * dq;
          m += std::fabs(v * dq);
        }
        ref[(bh * Q + q) * L + l] = r;
        mag[(bh * Q + q) * L + l] = m;
      }
  const double worst = compare(d.out, ref, mag);
  std::printf("qk%s BH=%lld Q=%lld D=%lld L=%lld offset=%d blocks=%lld: error/tolerance %.3g %s\n",
              tc ? "[tc]" : "", (long long)BH, (long long)Q, (long long)D, (long long)L, offset,
              (long long)(tc ? t.blocks : p.blocks), worst, worst <= 1.0 ? "ok" : "FAIL");
  return worst <= 1.0;
}

enum class Pv { kCudaCores, kTensorHiLo, kTensorSingle };

static bool run_pv(int64_t BH, int64_t Q, int64_t D, int64_t L, int offset, int sms,
                   Pv path = Pv::kCudaCores) {
  Data d = make(BH, BH * Q * L, BH * L * D, BH * Q * D, L, offset, 11u * L + D + Q);
  const kvprep_v1::PvPlan p = kvprep_v1::pv_plan(sms, BH, Q, L, D);
  const kvprep_v1::TcPvPlan t = kvprep_v1::tc_pv_plan(sms, BH, Q, L, D);
  const bool tc = path != Pv::kCudaCores;
  const int64_t n_split = tc ? t.n_split : p.n_split;
  std::vector<float> part(tc ? t.part_floats : p.part_floats);  // exactly what the plan asks
  float* part_ptr = part.empty() ? nullptr : part.data();
  const unsigned char* mat_end = d.mat + d.mat_bytes;
  const bool vec_ok = al16(d.vec.data()) && L % 8 == 0;
  const bool out_ok = al16(d.out.data()) && D % 8 == 0;
  auto body = [&] {
    if (path == Pv::kTensorHiLo) {
      kvprep_v1::tc_pv_hilo(d.vec.data(), d.mat, d.out.data(), part_ptr, d.scales.data(),
                            d.zeros.data(), Q, L, D, t.n_split, t.rows_per_split, t.n_qtiles,
                            t.n_dtiles, vec_ok, out_ok, mat_end);
    } else if (path == Pv::kTensorSingle) {
      kvprep_v1::tc_pv_single(d.vec.data(), d.mat, d.out.data(), part_ptr, d.scales.data(),
                              d.zeros.data(), Q, L, D, t.n_split, t.rows_per_split, t.n_qtiles,
                              t.n_dtiles, vec_ok, out_ok, mat_end);
    } else if (p.qt == 1) {
      kvprep_v1::pv_q1(d.vec.data(), d.mat, d.out.data(), part_ptr, d.scales.data(),
                       d.zeros.data(), Q, L, D, p.tpr, p.n_split, p.rows_per_split, p.n_qtiles,
                       p.n_dtiles, mat_end);
    } else {
      kvprep_v1::pv_q4(d.vec.data(), d.mat, d.out.data(), part_ptr, d.scales.data(),
                       d.zeros.data(), Q, L, D, p.tpr, p.n_split, p.rows_per_split, p.n_qtiles,
                       p.n_dtiles, mat_end);
    }
  };
  launch(tc ? t.blocks : p.blocks, body);
  if (part_ptr != nullptr) {
    const int64_t total = BH * Q * D;
    launch(kvprep_v1::finalize_blocks(total), [&] {
      kvprep_v1::pv_finalize(part_ptr, d.out.data(), total, Q, D, n_split);
    });
  }
  std::vector<double> ref(BH * Q * D, 0.0), mag(BH * Q * D, 0.0);
  for (int64_t bh = 0; bh < BH; ++bh)
    for (int64_t q = 0; q < Q; ++q)
      for (int64_t k = 0; k < D; ++k) {
        double r = 0, m = 0;
        for (int64_t l = 0; l < L; ++l) {
          const double v = h2d(d.vec[(bh * Q + q) * L + l]);
          const double dq = h2d(d.scales[bh * L + l]) *
                            (static_cast<double>(d.mat[(bh * L + l) * D + k]) -
                             h2d(d.zeros[bh * L + l]));
          r += v * dq;
          m += std::fabs(v * dq);
        }
        ref[(bh * Q + q) * D + k] = r;
        mag[(bh * Q + q) * D + k] = m;
      }
  const double worst =
      compare(d.out, ref, mag, path == Pv::kTensorSingle ? std::ldexp(1.0, -11) : 2e-5);
  const char* tag = path == Pv::kTensorHiLo ? "[tc]" : path == Pv::kTensorSingle ? "[tc1]" : "";
  std::printf(
      "pv%s BH=%lld Q=%lld D=%lld L=%lld offset=%d sms=%d blocks=%lld splits=%lld: "
      "error/tolerance %.3g %s\n",
      tag, (long long)BH, (long long)Q, (long long)D, (long long)L, offset, sms,
      (long long)(tc ? t.blocks : p.blocks), (long long)n_split, worst,
      worst <= 1.0 ? "ok" : "FAIL");
  return worst <= 1.0;
}

// The GEMM path's dequantize kernel: every value scales * (code - zero), rounded once.
static bool run_dequant(int64_t BH, int64_t R, int64_t C, bool per_col, int offset) {
  const int64_t n = BH * R * C;
  const int64_t per = per_col ? C : R;  // one scale/zero per column (QK) or row (PV)
  Data d = make(BH, 0, n, n, per, offset, 13u * R + C);
  const bool out_ok = al16(d.out.data()) && C % 8 == 0;
  launch(kvprep_v1::dequant_blocks(BH, R, C, 3), [&] {
    kvprep_v1::dequant(d.mat, d.scales.data(), d.zeros.data(), d.out.data(), BH, R, C, per_col,
                       out_ok, d.mat + d.mat_bytes);
  });
  double worst = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t bh = i / (R * C);
    const int64_t idx = bh * per + (per_col ? i % C : (i / C) % R);
    const double ref = h2d(d.scales[idx]) * (static_cast<double>(d.mat[i]) - h2d(d.zeros[idx]));
    const double o = h2d(d.out[i]);
    // one rounding to fp16 (of a product already rounded to float: a hair over half an ulp)
    const double tol = std::fabs(ref) * std::ldexp(1.0, -11) * (1 + 1e-3) + 1e-7;
    worst = std::isnan(o) ? INFINITY : std::max(worst, std::fabs(o - ref) / tol);
  }
  std::printf("dequant BH=%lld R=%lld C=%lld per_col=%d offset=%d: error/tolerance %.3g %s\n",
              (long long)BH, (long long)R, (long long)C, per_col ? 1 : 0, offset, worst,
              worst <= 1.0 ? "ok" : "FAIL");
  return worst <= 1.0;
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
  std::printf(ok ? "ALL OK\n" : "SOME FAILED\n");
  return ok ? 0 : 1;
}
