// Test-only stand-in for <cuda_fp16.h> (see cuda_runtime.h beside it).
#pragma once

struct __half {
  _Float16 v;
};
inline float __half2float(__half h) { return static_cast<float>(h.v); }
inline __half __float2half_rn(float f) { return __half{static_cast<_Float16>(f)}; }
