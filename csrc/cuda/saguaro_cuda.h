// Launchers of the saguaro CUDA kernels. Depends only on the CUDA toolkit: raw pointers, sizes, strides
// (in elements). The torch binding (ops_cuda.cpp) validates shapes and calls these.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace saguaro_cuda {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// The flash-layout cache [2, num_blocks, block_size, num_kv_heads, head_size]; head dim contiguous.
struct CacheLayout {
  int64_t s_kv, s_block, s_offset, s_head;
  int64_t block_size;
};

constexpr int kMaxGroup = 8;  // query heads per kv head supported by branch_attention

cudaError_t write_kv(DType dt, const void* key, int64_t k_s0, int64_t k_s1, const void* value, int64_t v_s0,
                     int64_t v_s1, void* cache, CacheLayout layout, const int64_t* slots, int64_t num_tokens,
                     int num_kv_heads, int head_size, cudaStream_t stream);

cudaError_t branch_attention(DType dt, const void* query, int64_t q_s0, int64_t q_s1, const void* cache,
                             CacheLayout layout, const int32_t* block_tables, int64_t max_blocks,
                             const int32_t* prefix_lens, const int32_t* owners, const int32_t* depths,
                             const int32_t* steps, const int64_t* branch_slots, int64_t slots_width, void* out,
                             int64_t num_queries, int num_heads, int num_kv_heads, int head_size, float scale,
                             cudaStream_t stream);

// scores [B, K+1, V] with strides; tokens/values [B, K+1, max_fanout] contiguous, pre-filled by the caller.
cudaError_t select_candidates(DType dt, const void* scores, int64_t s0, int64_t s1, int64_t s2, int64_t batch,
                              int64_t k1, int64_t vocab, const int64_t* drafted, const int64_t* fanout,
                              int64_t max_fanout, int64_t* tokens, float* values, cudaStream_t stream);

// logits [n, V] float32 contiguous; probs [n, V] float32 out.
cudaError_t proposal_probs(const float* logits, const float* temperature, const int64_t* top_k,
                           const float* top_p, const int64_t* saguaro_f, const float* log_c, int64_t rows,
                           int64_t vocab, float* probs, cudaStream_t stream);

}  // namespace saguaro_cuda
