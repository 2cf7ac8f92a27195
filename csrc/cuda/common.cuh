// Device helpers shared by the saguaro .cu files: dtype conversion and block reductions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "saguaro_cuda.h"

namespace saguaro_cuda {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// (value, index) in the ops' token order: larger value first, then smaller index. idx INT64_MAX = none.
struct Best {
  float val;
  int64_t idx;
};
__device__ __forceinline__ bool better(const Best& a, const Best& b) {
  return a.val > b.val || (a.val == b.val && a.idx < b.idx);
}
__device__ __forceinline__ Best none_best() { return Best{-__int_as_float(0x7f800000), INT64_MAX}; }

// Block-wide reductions; every thread gets the result. `scratch` must hold 32 elements; blockDim % 32 == 0.
template <typename T, typename Op>
__device__ T block_reduce(T v, Op op, T* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
  for (int o = 16; o > 0; o >>= 1) {
    T other;
    if constexpr (std::is_same_v<T, Best>) {
      other.val = __shfl_xor_sync(0xffffffffu, v.val, o);
      other.idx = __shfl_xor_sync(0xffffffffu, v.idx, o);
    } else {
      other = __shfl_xor_sync(0xffffffffu, v, o);
    }
    v = op(v, other);
  }
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T r = scratch[0];
  for (int w = 1; w < nw; ++w) r = op(r, scratch[w]);
  return r;
}

}  // namespace saguaro_cuda
