// Runs the CUDA kernels of kernels/cache_autogptq_cuda_kernel_256.cu on the CPU through
// the stand-ins in include/ and compares them with a double-precision reference of the
// formulas. Built and run by tests/test_kernels_cuda_emulated.py (ideally under
// AddressSanitizer). The launch plans are the .cu's own; only the launch glue (stream,
// device guard, <<<>>>) is mirrored here. Prints one line per case; exit status 1 on any
// mismatch.

#define __CUDA_ARCH__ 900  // the device view of the source: no torch glue
#include "cache_autogptq_cuda_kernel_256.cu"

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
static double compare(const std::vector<__half>& out, const std::vector<double>& ref,
                      const std::vector<double>& mag) {
  double worst = 0.0;
  for (size_t i = 0; i < out.size(); ++i) {
    const double o = h2d(out[i]);
    if (std::isnan(o)) return INFINITY;
    const double tol = std::fabs(ref[i]) * std::ldexp(1.0, -10) + mag[i] * 2e-5 + 1e-6;
    worst = std::max(worst, std::fabs(o - ref[i]) / tol);
  }
  return worst;
}

static bool run_qk(int64_t BH, int64_t Q, int64_t D, int64_t L, int offset) {
  Data d = make(BH, BH * Q * D, BH * D * L, BH * Q * L, L, offset, 7u * L + D + Q);
  const kvprep_v1::QkPlan p = kvprep_v1::qk_plan(BH, Q, L);
  const unsigned char* mat_end = d.mat + d.mat_bytes;
  if (p.qt == 1) {
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
  std::printf("qk BH=%lld Q=%lld D=%lld L=%lld offset=%d blocks=%lld: error/tolerance %.3g %s\n",
              (long long)BH, (long long)Q, (long long)D, (long long)L, offset,
              (long long)p.blocks, worst, worst <= 1.0 ? "ok" : "FAIL");
  return worst <= 1.0;
}

static bool run_pv(int64_t BH, int64_t Q, int64_t D, int64_t L, int offset, int sms) {
  Data d = make(BH, BH * Q * L, BH * L * D, BH * Q * D, L, offset, 11u * L + D + Q);
  const kvprep_v1::PvPlan p = kvprep_v1::pv_plan(sms, BH, Q, L, D);
  std::vector<float> part(p.part_floats);  // exactly what the plan asks for
  float* part_ptr = p.part_floats > 0 ? part.data() : nullptr;
  const unsigned char* mat_end = d.mat + d.mat_bytes;
  auto body = [&] {
    if (p.qt == 1) {
      kvprep_v1::pv_q1(d.vec.data(), d.mat, d.out.data(), part_ptr, d.scales.data(),
                       d.zeros.data(), Q, L, D, p.tpr, p.n_split, p.rows_per_split, p.n_qtiles,
                       p.n_dtiles, mat_end);
    } else {
      kvprep_v1::pv_q4(d.vec.data(), d.mat, d.out.data(), part_ptr, d.scales.data(),
                       d.zeros.data(), Q, L, D, p.tpr, p.n_split, p.rows_per_split, p.n_qtiles,
                       p.n_dtiles, mat_end);
    }
  };
  launch(p.blocks, body);
  if (part_ptr != nullptr) {
    const int64_t total = BH * Q * D;
    launch(kvprep_v1::finalize_blocks(total), [&] {
      kvprep_v1::pv_finalize(part_ptr, d.out.data(), total, Q, D, p.n_split);
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
  const double worst = compare(d.out, ref, mag);
  std::printf(
      "pv BH=%lld Q=%lld D=%lld L=%lld offset=%d sms=%d blocks=%lld splits=%lld: "
      "error/tolerance %.3g %s\n",
      (long long)BH, (long long)Q, (long long)D, (long long)L, offset, sms, (long long)p.blocks,
      (long long)p.n_split, worst, worst <= 1.0 ? "ok" : "FAIL");
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
  std::printf(ok ? "ALL OK\n" : "SOME FAILED\n");
  return ok ? 0 : 1;
}
