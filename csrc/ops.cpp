// Schemas of the saguaro ops. Implementations register per dispatch key in their own files
// (attention_cpu.cpp, sampling_cpu.cpp, cuda/ops_cuda.cpp); fake kernels live in saguaro_vllm/ops/loader.py.
#include <torch/library.h>

TORCH_LIBRARY(saguaro, m) {
  // Store each new token's K/V at its cache slot; negative slots are skipped (padding).
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  // One query per branch; see saguaro_vllm/ops/branch_attention.py for the attention pattern.
  m.def(
      "branch_attention(Tensor query, Tensor kv_cache, Tensor block_tables, Tensor prefix_lens, "
      "Tensor owners, Tensor depths, Tensor steps, Tensor branch_slots, float scale) -> Tensor");
  // Top-f per (request, depth) excluding the drafted token; -1 pads ranks >= fanout.
  m.def("select_candidates(Tensor scores, Tensor drafted, Tensor fanout, int max_fanout) -> (Tensor, Tensor)");
  // Proposal q' (temperature, top-k, top-p, Saguaro scaling); tokens are drawn from it by the caller.
  m.def(
      "proposal_probs(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor saguaro_f, "
      "Tensor log_c) -> Tensor");
}
