// CUDA kernels: candidate selection and the proposal q', one block per row. Same semantics and token order
// as the CPU kernels (saguaro_vllm/ops/reference.py): thresholds are found by binary search over the
// order-preserving bit pattern of the values, so no sort is needed.
#include <cfloat>

#include "common.cuh"

namespace saguaro_cuda {
namespace {

constexpr int kThreads = 1024;
constexpr float kNegInf = -__builtin_huge_valf();

struct MaxOp { __device__ float operator()(float a, float b) const { return fmaxf(a, b); } };
struct SumD { __device__ double operator()(double a, double b) const { return a + b; } };
struct SumI { __device__ long long operator()(long long a, long long b) const { return a + b; } };
struct BestOp { __device__ Best operator()(const Best& a, const Best& b) const { return better(b, a) ? b : a; } };

// Order-preserving map of floats onto uint32 (larger float -> larger key).
__device__ __forceinline__ uint32_t order_key(float x) {
  const uint32_t b = __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float key_to_float(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// Is (val, idx) after `prev` in the token order (i.e. not yet taken)?
__device__ __forceinline__ bool after(float val, int64_t idx, const Best& prev) {
  return val < prev.val || (val == prev.val && idx > prev.idx);
}

template <typename T>
__global__ void select_candidates_kernel(const T* __restrict__ scores, int64_t s0, int64_t s1, int64_t s2,
                                         int64_t k1, int64_t vocab, const int64_t* __restrict__ drafted,
                                         const int64_t* __restrict__ fanout, int64_t max_fanout,
                                         int64_t* __restrict__ tokens, float* __restrict__ values) {
  __shared__ Best scratch[32];
  const int64_t row = blockIdx.x, b = row / k1, j = row % k1;
  const int64_t f = fanout[row];
  const int64_t excl = j < k1 - 1 ? drafted[b * (k1 - 1) + j] : -1;
  const T* x = scores + b * s0 + j * s1;
  Best prev = Best{FLT_MAX, -1};
  bool first = true;
  for (int64_t i = 0; i < f; ++i) {
    Best best = none_best();
    for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) {
      if (v == excl) continue;
      const float val = to_float(x[v * s2]);
      if (!first && !after(val, v, prev)) continue;
      const Best c{val, v};
      if (better(c, best)) best = c;
    }
    best = block_reduce(best, BestOp{}, scratch);
    if (best.idx == INT64_MAX) break;
    if (threadIdx.x == 0) {
      tokens[row * max_fanout + i] = best.idx;
      values[row * max_fanout + i] = best.val;
    }
    prev = best;
    first = false;
  }
}

__global__ void proposal_probs_kernel(const float* __restrict__ logits, const float* __restrict__ temperature,
                                      const int64_t* __restrict__ top_k, const float* __restrict__ top_p,
                                      const int64_t* __restrict__ saguaro_f, const float* __restrict__ log_c,
                                      int64_t vocab, float* __restrict__ probs) {
  __shared__ Best sb[32];
  __shared__ float sf[32];
  __shared__ double sd[32];
  __shared__ long long si[32];
  const int64_t r = blockIdx.x;
  const float* x = logits + r * vocab;
  float* pr = probs + r * vocab;
  const float t = temperature[r];
  if (!(t > 0.f)) {  // greedy
    Best best = none_best();
    for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) {
      const Best c{x[v], v};
      if (better(c, best)) best = c;
    }
    best = block_reduce(best, BestOp{}, sb);
    for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) pr[v] = v == best.idx ? 1.f : 0.f;
    return;
  }
  // z_v = x_v / t is recomputed in every pass (IEEE division: identical to the other implementations).
  float zmax = kNegInf;
  for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) zmax = fmaxf(zmax, x[v] / t);
  zmax = block_reduce(zmax, MaxOp{}, sf);

  // Top-k threshold: the k-th largest z (tie-inclusive).
  const int64_t k = (top_k[r] > 0 && top_k[r] < vocab) ? top_k[r] : vocab;
  float kth = kNegInf;
  if (k < vocab) {
    uint32_t ans = 0;
    for (int bit = 31; bit >= 0; --bit) {
      const uint32_t cand = ans | (1u << bit);
      long long cnt = 0;
      for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) cnt += order_key(x[v] / t) >= cand;
      if (block_reduce(cnt, SumI{}, si) >= k) ans = cand;
    }
    kth = key_to_float(ans);
  }
  double zd = 0.0;
  for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) {
    const float z = x[v] / t;
    zd += z >= kth ? expf(z - zmax) : 0.f;
  }
  const float Z = static_cast<float>(block_reduce(zd, SumD{}, sd));

  // Top-p: kept iff mass of larger z < top_p; smallest key u* with mass(key > u*) < top_p.
  uint32_t ukeep = 0;
  const float p_top = top_p[r];
  if (p_top < 1.f) {
    auto mass_above = [&](uint32_t u) {
      double m = 0.0;
      for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) {
        const float z = x[v] / t;
        if (z >= kth && order_key(z) > u) m += static_cast<double>(expf(z - zmax) / Z);
      }
      return block_reduce(m, SumD{}, sd);
    };
    if (!(mass_above(0u) < p_top)) {
      uint32_t ans = 0;  // largest u with mass_above(u) >= p
      for (int bit = 31; bit >= 0; --bit) {
        const uint32_t cand = ans | (1u << bit);
        if (!(mass_above(cand) < p_top)) ans = cand;
      }
      ukeep = ans + 1u;
    }
    const uint32_t kmax = order_key(zmax);
    if (ukeep > kmax) ukeep = kmax;  // the most likely group is always kept
  }
  auto kept = [&](float z) { return z >= kth && order_key(z) >= ukeep; };

  // Top-F boundary: the F-th token in order.
  const int64_t F = min(max(saguaro_f[r], static_cast<int64_t>(0)), vocab);
  Best fth = Best{FLT_MAX, -1};
  for (int64_t i = 0; i < F; ++i) {
    Best best = none_best();
    for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) {
      const float z = x[v] / t;
      if (i > 0 && !after(z, v, fth)) continue;
      const Best c{z, v};
      if (better(c, best)) best = c;
    }
    fth = block_reduce(best, BestOp{}, sb);
  }
  auto in_topf = [&](float z, int64_t v) { return F > 0 && !after(z, v, fth); };

  long long nk = 0;
  for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) nk += kept(x[v] / t);
  const long long n_kept = block_reduce(nk, SumI{}, si);
  float lc = log_c[r];
  if (lc == kNegInf && n_kept <= F) lc = 0.f;
  const float c = F > 0 ? expf(lc) : 1.f;

  double ws = 0.0;
  for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) {
    const float z = x[v] / t;
    if (!kept(z)) continue;
    const float e = expf(z - zmax);
    ws += in_topf(z, v) ? e * c : e;
  }
  const double Zs = block_reduce(ws, SumD{}, sd);
  const float inv = static_cast<float>(1.0 / Zs);
  for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) {
    const float z = x[v] / t;
    float w = 0.f;
    if (kept(z)) {
      const float e = expf(z - zmax);
      w = in_topf(z, v) ? e * c : e;
    }
    pr[v] = w * inv;
  }
}

}  // namespace

cudaError_t select_candidates(DType dt, const void* scores, int64_t s0, int64_t s1, int64_t s2, int64_t batch,
                              int64_t k1, int64_t vocab, const int64_t* drafted, const int64_t* fanout,
                              int64_t max_fanout, int64_t* tokens, float* values, cudaStream_t stream) {
  const int64_t rows = batch * k1;
  if (rows == 0 || max_fanout == 0) return cudaSuccess;
  switch (dt) {
    case DType::kFloat32:
      select_candidates_kernel<float><<<rows, kThreads, 0, stream>>>(
          static_cast<const float*>(scores), s0, s1, s2, k1, vocab, drafted, fanout, max_fanout, tokens, values);
      break;
    case DType::kFloat16:
      select_candidates_kernel<__half><<<rows, kThreads, 0, stream>>>(
          static_cast<const __half*>(scores), s0, s1, s2, k1, vocab, drafted, fanout, max_fanout, tokens, values);
      break;
    case DType::kBFloat16:
      select_candidates_kernel<__nv_bfloat16><<<rows, kThreads, 0, stream>>>(
          static_cast<const __nv_bfloat16*>(scores), s0, s1, s2, k1, vocab, drafted, fanout, max_fanout, tokens,
          values);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t proposal_probs(const float* logits, const float* temperature, const int64_t* top_k,
                           const float* top_p, const int64_t* saguaro_f, const float* log_c, int64_t rows,
                           int64_t vocab, float* probs, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  proposal_probs_kernel<<<rows, kThreads, 0, stream>>>(logits, temperature, top_k, top_p, saguaro_f, log_c, vocab,
                                                       probs);
  return cudaGetLastError();
}

}  // namespace saguaro_cuda
