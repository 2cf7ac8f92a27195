// CUDA kernels: KV write (slot mapping) and branch attention over the paged cache.
// Toolkit headers only; templated on the element type and the head size.
#include "common.cuh"

namespace saguaro_cuda {
namespace {

template <typename T>
__global__ void write_kv_kernel(const T* __restrict__ key, int64_t k_s0, int64_t k_s1, const T* __restrict__ value,
                                int64_t v_s0, int64_t v_s1, T* __restrict__ cache, CacheLayout L,
                                const int64_t* __restrict__ slots, int num_kv_heads, int head_size) {
  const int64_t t = blockIdx.x;
  const int64_t slot = slots[t];
  if (slot < 0) return;
  T* dst = cache + (slot / L.block_size) * L.s_block + (slot % L.block_size) * L.s_offset;
  for (int i = threadIdx.x; i < num_kv_heads * head_size; i += blockDim.x) {
    const int h = i / head_size, d = i % head_size;
    dst[h * L.s_head + d] = key[t * k_s0 + h * k_s1 + d];
    dst[L.s_kv + h * L.s_head + d] = value[t * v_s0 + h * v_s1 + d];
  }
}

// One block per (query, kv head); each warp streams a strided share of the query's keys with an online
// softmax for the G query heads of the group; the warps' partial states are merged at the end.
template <typename T, int HEAD>
__global__ void branch_attention_kernel(const T* __restrict__ q, int64_t q_s0, int64_t q_s1,
                                        const T* __restrict__ cache, CacheLayout L,
                                        const int32_t* __restrict__ block_tables, int64_t max_blocks,
                                        const int32_t* __restrict__ prefix_lens, const int32_t* __restrict__ owners,
                                        const int32_t* __restrict__ depths, const int32_t* __restrict__ steps,
                                        const int64_t* __restrict__ branch_slots, int64_t width, T* __restrict__ out,
                                        int num_heads, int group, float scale) {
  constexpr int E = HEAD / 32;
  constexpr int kWarps = 4;
  const int64_t qi = blockIdx.x;
  const int kvh = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r = owners[qi];
  const int64_t n_ctx = static_cast<int64_t>(prefix_lens[r]) + depths[qi] + 1;
  const int64_t total = n_ctx + steps[qi] + 1;
  const int32_t* bt = block_tables + r * max_blocks;

  float qr[kMaxGroup][E], acc[kMaxGroup][E], m[kMaxGroup], l[kMaxGroup];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    m[g] = -__int_as_float(0x7f800000);
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      acc[g][e] = 0.f;
      qr[g][e] = g < group ? to_float(q[qi * q_s0 + (kvh * group + g) * q_s1 + lane * E + e]) * scale : 0.f;
    }
  }
  for (int64_t i = warp; i < total; i += kWarps) {
    const int64_t slot = i < n_ctx ? static_cast<int64_t>(bt[i / L.block_size]) * L.block_size + i % L.block_size
                                   : branch_slots[qi * width + (i - n_ctx)];
    const T* kp = cache + (slot / L.block_size) * L.s_block + (slot % L.block_size) * L.s_offset + kvh * L.s_head;
    const T* vp = kp + L.s_kv;
    float kf[E], vf[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
      kf[e] = to_float(kp[lane * E + e]);
      vf[e] = to_float(vp[lane * E + e]);
    }
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      if (g >= group) break;
      float s = 0.f;
#pragma unroll
      for (int e = 0; e < E; ++e) s += qr[g][e] * kf[e];
      s = warp_sum(s);
      const float m_new = fmaxf(m[g], s);
      const float alpha = expf(m[g] - m_new), p = expf(s - m_new);
      l[g] = l[g] * alpha + p;
#pragma unroll
      for (int e = 0; e < E; ++e) acc[g][e] = acc[g][e] * alpha + p * vf[e];
      m[g] = m_new;
    }
  }
  __shared__ float sm_m[kWarps][kMaxGroup], sm_l[kWarps][kMaxGroup];
  __shared__ float sm_acc[kWarps][kMaxGroup][HEAD];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    if (g >= group) break;
    if (lane == 0) {
      sm_m[warp][g] = m[g];
      sm_l[warp][g] = l[g];
    }
#pragma unroll
    for (int e = 0; e < E; ++e) sm_acc[warp][g][lane * E + e] = acc[g][e];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < group * HEAD; i += blockDim.x) {
    const int g = i / HEAD, d = i % HEAD;
    float M = sm_m[0][g];
    for (int w = 1; w < kWarps; ++w) M = fmaxf(M, sm_m[w][g]);
    float num = 0.f, den = 0.f;
    for (int w = 0; w < kWarps; ++w) {
      const float c = sm_m[w][g] == -__int_as_float(0x7f800000) ? 0.f : expf(sm_m[w][g] - M);
      num += sm_acc[w][g][d] * c;
      den += sm_l[w][g] * c;
    }
    out[(qi * num_heads + kvh * group + g) * HEAD + d] = from_float<T>(num / den);
  }
}

template <typename T>
cudaError_t write_kv_typed(const void* key, int64_t k_s0, int64_t k_s1, const void* value, int64_t v_s0,
                           int64_t v_s1, void* cache, CacheLayout layout, const int64_t* slots, int64_t num_tokens,
                           int num_kv_heads, int head_size, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  write_kv_kernel<T><<<num_tokens, 256, 0, stream>>>(static_cast<const T*>(key), k_s0, k_s1,
                                                     static_cast<const T*>(value), v_s0, v_s1,
                                                     static_cast<T*>(cache), layout, slots, num_kv_heads, head_size);
  return cudaGetLastError();
}

template <typename T>
cudaError_t branch_attention_typed(const void* query, int64_t q_s0, int64_t q_s1, const void* cache,
                                   CacheLayout layout, const int32_t* block_tables, int64_t max_blocks,
                                   const int32_t* prefix_lens, const int32_t* owners, const int32_t* depths,
                                   const int32_t* steps, const int64_t* branch_slots, int64_t width, void* out,
                                   int64_t num_queries, int num_heads, int num_kv_heads, int head_size, float scale,
                                   cudaStream_t stream) {
  if (num_queries == 0) return cudaSuccess;
  const int group = num_heads / num_kv_heads;
  if (group > kMaxGroup || num_heads % num_kv_heads) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(num_queries), num_kv_heads);
  const T* qp = static_cast<const T*>(query);
  const T* cp = static_cast<const T*>(cache);
  T* op = static_cast<T*>(out);
  if (head_size == 64) {
    branch_attention_kernel<T, 64><<<grid, 128, 0, stream>>>(qp, q_s0, q_s1, cp, layout, block_tables, max_blocks,
                                                            prefix_lens, owners, depths, steps, branch_slots,
                                                            width, op, num_heads, group, scale);
  } else if (head_size == 128) {
    branch_attention_kernel<T, 128><<<grid, 128, 0, stream>>>(qp, q_s0, q_s1, cp, layout, block_tables, max_blocks,
                                                             prefix_lens, owners, depths, steps, branch_slots,
                                                             width, op, num_heads, group, scale);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t write_kv(DType dt, const void* key, int64_t k_s0, int64_t k_s1, const void* value, int64_t v_s0,
                     int64_t v_s1, void* cache, CacheLayout layout, const int64_t* slots, int64_t num_tokens,
                     int num_kv_heads, int head_size, cudaStream_t stream) {
  switch (dt) {
    case DType::kFloat32:
      return write_kv_typed<float>(key, k_s0, k_s1, value, v_s0, v_s1, cache, layout, slots, num_tokens,
                                   num_kv_heads, head_size, stream);
    case DType::kFloat16:
      return write_kv_typed<__half>(key, k_s0, k_s1, value, v_s0, v_s1, cache, layout, slots, num_tokens,
                                    num_kv_heads, head_size, stream);
    case DType::kBFloat16:
      return write_kv_typed<__nv_bfloat16>(key, k_s0, k_s1, value, v_s0, v_s1, cache, layout, slots, num_tokens,
                                           num_kv_heads, head_size, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t branch_attention(DType dt, const void* query, int64_t q_s0, int64_t q_s1, const void* cache,
                             CacheLayout layout, const int32_t* block_tables, int64_t max_blocks,
                             const int32_t* prefix_lens, const int32_t* owners, const int32_t* depths,
                             const int32_t* steps, const int64_t* branch_slots, int64_t slots_width, void* out,
                             int64_t num_queries, int num_heads, int num_kv_heads, int head_size, float scale,
                             cudaStream_t stream) {
#define SAGUARO_BA_ARGS                                                                                        \
  query, q_s0, q_s1, cache, layout, block_tables, max_blocks, prefix_lens, owners, depths, steps, branch_slots, \
      slots_width, out, num_queries, num_heads, num_kv_heads, head_size, scale, stream
  switch (dt) {
    case DType::kFloat32:
      return branch_attention_typed<float>(SAGUARO_BA_ARGS);
    case DType::kFloat16:
      return branch_attention_typed<__half>(SAGUARO_BA_ARGS);
    case DType::kBFloat16:
      return branch_attention_typed<__nv_bfloat16>(SAGUARO_BA_ARGS);
  }
#undef SAGUARO_BA_ARGS
  return cudaErrorInvalidValue;
}

}  // namespace saguaro_cuda
