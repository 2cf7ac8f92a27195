// Torch binding of the CUDA kernels (compiled only when torch has CUDA). Validates shapes and dtypes, then
// calls the toolkit-only launchers of saguaro_cuda.h on the current stream.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "saguaro_cuda.h"

namespace saguaro {
namespace {

using saguaro_cuda::CacheLayout;
using saguaro_cuda::DType;

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK(false, "saguaro CUDA ops support float32, float16 and bfloat16, got ", t.scalar_type());
  }
}

void check(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, " failed: ", cudaGetErrorString(err));
}

CacheLayout layout_of(const at::Tensor& kv_cache) {
  TORCH_CHECK(kv_cache.is_cuda() && kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "kv_cache must be a CUDA tensor [2, num_blocks, block_size, num_kv_heads, head_size]");
  TORCH_CHECK(kv_cache.stride(4) == 1, "kv_cache: the head dimension must be contiguous");
  return CacheLayout{kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
                     kv_cache.size(2)};
}

void write_kv_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache, const at::Tensor& slot_mapping) {
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  const CacheLayout layout = layout_of(kv_cache);
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key/value must be [num_tokens, num_kv_heads, head_size]");
  TORCH_CHECK(key.size(1) == kv_cache.size(3) && key.size(2) == kv_cache.size(4), "key/value shape vs kv_cache");
  auto k = key.to(kv_cache.scalar_type());
  auto v = value.to(kv_cache.scalar_type());
  if (k.stride(2) != 1) k = k.contiguous();
  if (v.stride(2) != 1) v = v.contiguous();
  const auto slots = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == k.size(0), "slot_mapping needs one slot per token");
  check(saguaro_cuda::write_kv(dtype_of(kv_cache), k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0),
                               v.stride(1), kv_cache.data_ptr(), layout, slots.data_ptr<int64_t>(), k.size(0),
                               static_cast<int>(k.size(1)), static_cast<int>(k.size(2)),
                               c10::cuda::getCurrentCUDAStream()),
        "saguaro write_kv");
}

at::Tensor branch_attention_cuda(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                 const at::Tensor& prefix_lens, const at::Tensor& owners, const at::Tensor& depths,
                                 const at::Tensor& steps, const at::Tensor& branch_slots, double scale) {
  const c10::cuda::CUDAGuard guard(query.device());
  const CacheLayout layout = layout_of(kv_cache);
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == kv_cache.scalar_type(), "query must be [Q, H, D] in the cache dtype");
  const at::Tensor q = query.stride(2) == 1 ? query : query.contiguous();
  const int64_t nq = q.size(0), H = q.size(1), D = q.size(2), Hkv = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D && (D == 64 || D == 128), "head_size must be 64 or 128 and match the cache");
  TORCH_CHECK(H % Hkv == 0 && H / Hkv <= saguaro_cuda::kMaxGroup, "num_heads / num_kv_heads must be <= ",
              saguaro_cuda::kMaxGroup);
  const auto bt = block_tables.to(at::kInt).contiguous();
  const auto pl = prefix_lens.to(at::kInt).contiguous();
  const auto ow = owners.to(at::kInt).contiguous();
  const auto dp = depths.to(at::kInt).contiguous();
  const auto st = steps.to(at::kInt).contiguous();
  const auto bs = branch_slots.to(at::kLong).contiguous();
  TORCH_CHECK(ow.numel() == nq && dp.numel() == nq && st.numel() == nq && bs.dim() == 2 && bs.size(0) == nq,
              "owners/depths/steps/branch_slots need one row per query");
  auto out = at::empty({nq, H, D}, q.options());
  check(saguaro_cuda::branch_attention(dtype_of(q), q.data_ptr(), q.stride(0), q.stride(1), kv_cache.data_ptr(), layout,
                                       bt.data_ptr<int32_t>(), bt.size(1), pl.data_ptr<int32_t>(),
                                       ow.data_ptr<int32_t>(), dp.data_ptr<int32_t>(), st.data_ptr<int32_t>(),
                                       bs.data_ptr<int64_t>(), bs.size(1), out.data_ptr(), nq, static_cast<int>(H),
                                       static_cast<int>(Hkv), static_cast<int>(D), static_cast<float>(scale),
                                       c10::cuda::getCurrentCUDAStream()),
        "saguaro branch_attention");
  return out;
}

std::tuple<at::Tensor, at::Tensor> select_candidates_cuda(const at::Tensor& scores, const at::Tensor& drafted,
                                                          const at::Tensor& fanout, int64_t max_fanout) {
  const c10::cuda::CUDAGuard guard(scores.device());
  TORCH_CHECK(scores.dim() == 3, "scores must be [batch, K+1, vocab]");
  const int64_t B = scores.size(0), K1 = scores.size(1), V = scores.size(2);
  const auto dr = drafted.to(at::kLong).contiguous();
  const auto fo = fanout.to(at::kLong).contiguous();
  TORCH_CHECK(dr.dim() == 2 && dr.size(0) == B && dr.size(1) == K1 - 1, "drafted must be [batch, K]");
  TORCH_CHECK(fo.dim() == 2 && fo.size(0) == B && fo.size(1) == K1, "fanout must be [batch, K+1]");
  TORCH_CHECK(max_fanout >= 0, "max_fanout must be >= 0");
  auto tokens = at::full({B, K1, max_fanout}, -1, scores.options().dtype(at::kLong));
  auto values = at::full({B, K1, max_fanout}, -std::numeric_limits<float>::infinity(), scores.options().dtype(at::kFloat));
  check(saguaro_cuda::select_candidates(dtype_of(scores), scores.data_ptr(), scores.stride(0), scores.stride(1),
                                        scores.stride(2), B, K1, V, dr.data_ptr<int64_t>(), fo.data_ptr<int64_t>(),
                                        max_fanout, tokens.data_ptr<int64_t>(), values.data_ptr<float>(),
                                        c10::cuda::getCurrentCUDAStream()),
        "saguaro select_candidates");
  return {tokens, values};
}

at::Tensor proposal_probs_cuda(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                               const at::Tensor& top_p, const at::Tensor& saguaro_f, const at::Tensor& log_c) {
  const c10::cuda::CUDAGuard guard(logits.device());
  TORCH_CHECK(logits.dim() == 2, "logits must be [rows, vocab]");
  const int64_t n = logits.size(0), V = logits.size(1);
  const auto x = logits.to(at::kFloat).contiguous();
  const auto tt = temperature.to(at::kFloat).contiguous();
  const auto tk = top_k.to(at::kLong).contiguous();
  const auto tp = top_p.to(at::kFloat).contiguous();
  const auto sf = saguaro_f.to(at::kLong).contiguous();
  const auto lc = log_c.to(at::kFloat).contiguous();
  for (const auto* t : {&tt, &tk, &tp, &sf, &lc}) TORCH_CHECK(t->numel() == n, "per-row parameters need one entry per row");
  auto probs = at::empty({n, V}, x.options());
  check(saguaro_cuda::proposal_probs(x.data_ptr<float>(), tt.data_ptr<float>(), tk.data_ptr<int64_t>(),
                                     tp.data_ptr<float>(), sf.data_ptr<int64_t>(), lc.data_ptr<float>(), n, V,
                                     probs.data_ptr<float>(), c10::cuda::getCurrentCUDAStream()),
        "saguaro proposal_probs");
  return probs;
}

}  // namespace
}  // namespace saguaro

TORCH_LIBRARY_IMPL(saguaro, CUDA, m) {
  m.impl("write_kv", &saguaro::write_kv_cuda);
  m.impl("branch_attention", &saguaro::branch_attention_cuda);
  m.impl("select_candidates", &saguaro::select_candidates_cuda);
  m.impl("proposal_probs", &saguaro::proposal_probs_cuda);
}
