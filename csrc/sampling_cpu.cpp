// CPU kernels: candidate selection (top-f per depth, drafted token excluded) and proposal sampling
// (temperature, top-k, top-p, Saguaro top-F scaling, Gumbel-max draw). Token order everywhere:
// value descending, then index ascending. Semantics are spelled out in saguaro_vllm/ops/reference.py.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "cpu_common.h"

namespace saguaro {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

std::tuple<at::Tensor, at::Tensor> select_candidates_cpu(const at::Tensor& scores, const at::Tensor& drafted,
                                                         const at::Tensor& fanout, int64_t max_fanout) {
  TORCH_CHECK(scores.dim() == 3, "scores must be [batch, K+1, vocab]");
  const int64_t B = scores.size(0), K1 = scores.size(1), V = scores.size(2), F = max_fanout;
  const auto dr = drafted.to(at::kLong).contiguous();
  const auto fo = fanout.to(at::kLong).contiguous();
  TORCH_CHECK(dr.dim() == 2 && dr.size(0) == B && dr.size(1) == K1 - 1, "drafted must be [batch, K]");
  TORCH_CHECK(fo.dim() == 2 && fo.size(0) == B && fo.size(1) == K1, "fanout must be [batch, K+1]");
  TORCH_CHECK(F >= 0, "max_fanout must be >= 0");
  const int64_t* drp = dr.data_ptr<int64_t>();
  const int64_t* fop = fo.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * K1; ++i)
    TORCH_CHECK(fop[i] >= 0 && fop[i] <= F, "fanout entries must lie in 0..max_fanout");
  auto tokens = at::full({B, K1, F}, -1, scores.options().dtype(at::kLong));
  auto values = at::full({B, K1, F}, kNegInf, scores.options().dtype(at::kFloat));
  int64_t* tp = tokens.data_ptr<int64_t>();
  float* vp = values.data_ptr<float>();
  const int64_t s0 = scores.stride(0), s1 = scores.stride(1), s2 = scores.stride(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, scores.scalar_type(), "select_candidates_cpu", [&] {
    const scalar_t* sp = scores.data_ptr<scalar_t>();
    at::parallel_for(0, B * K1, 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> bv(F + 1);
      std::vector<int64_t> bi(F + 1);
      for (int64_t row = lo; row < hi; ++row) {
        const int64_t b = row / K1, j = row % K1, f = fop[row];
        if (f == 0) continue;
        const int64_t excl = j < K1 - 1 ? drp[b * (K1 - 1) + j] : -1;
        const scalar_t* x = sp + b * s0 + j * s1;
        int64_t n = 0;  // kept so far, sorted by (value desc, index asc); indices ascend so ties keep order
        for (int64_t v = 0; v < V; ++v) {
          if (v == excl) continue;
          const float val = to_float(x[v * s2]);
          if (n == f && !(val > bv[n - 1])) continue;
          int64_t pos = n < f ? n++ : n - 1;
          while (pos > 0 && val > bv[pos - 1]) {
            bv[pos] = bv[pos - 1];
            bi[pos] = bi[pos - 1];
            --pos;
          }
          bv[pos] = val;
          bi[pos] = v;
        }
        for (int64_t i = 0; i < n; ++i) {
          tp[row * F + i] = bi[i];
          vp[row * F + i] = bv[i];
        }
      }
    });
  });
  return {tokens, values};
}

// Indices of a row ordered by (z desc, index asc), materialised lazily: prefix(m) sorts the first m.
struct LazyOrder {
  const float* z;
  std::vector<int64_t> idx;
  int64_t sorted = 0;
  LazyOrder(const float* z_, int64_t V) : z(z_), idx(V) {
    for (int64_t v = 0; v < V; ++v) idx[v] = v;
  }
  bool before(int64_t a, int64_t b) const { return z[a] > z[b] || (z[a] == z[b] && a < b); }
  void prefix(int64_t m) {
    m = std::min<int64_t>(m, static_cast<int64_t>(idx.size()));
    if (m <= sorted) return;
    auto cmp = [this](int64_t a, int64_t b) { return before(a, b); };
    std::nth_element(idx.begin() + sorted, idx.begin() + (m - 1), idx.end(), cmp);
    std::sort(idx.begin() + sorted, idx.begin() + m, cmp);
    sorted = m;
  }
};

at::Tensor proposal_probs_cpu(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                              const at::Tensor& top_p, const at::Tensor& saguaro_f, const at::Tensor& log_c) {
  TORCH_CHECK(logits.dim() == 2, "logits must be [rows, vocab]");
  const int64_t n = logits.size(0), V = logits.size(1);
  const auto x = logits.to(at::kFloat).contiguous();
  const auto tt = temperature.to(at::kFloat).contiguous();
  const auto tk = top_k.to(at::kLong).contiguous();
  const auto tp = top_p.to(at::kFloat).contiguous();
  const auto sf = saguaro_f.to(at::kLong).contiguous();
  const auto lc = log_c.to(at::kFloat).contiguous();
  for (const auto* t : {&tt, &tk, &tp, &sf, &lc}) TORCH_CHECK(t->numel() == n, "per-row parameters need one entry per row");
  auto probs = at::zeros({n, V}, x.options());
  const float *xp = x.data_ptr<float>(), *ttp = tt.data_ptr<float>();
  const float *tpp = tp.data_ptr<float>(), *lcp = lc.data_ptr<float>();
  const int64_t *tkp = tk.data_ptr<int64_t>(), *sfp = sf.data_ptr<int64_t>();
  float* pp = probs.data_ptr<float>();
  at::parallel_for(0, n, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> z(V), e(V);
    std::vector<uint8_t> topf(V);
    for (int64_t r = lo; r < hi; ++r) {
      const float* xr = xp + r * V;
      float* pr = pp + r * V;
      const float t = ttp[r];
      if (!(t > 0.f)) {  // greedy: argmax, one-hot proposal
        int64_t best = 0;
        for (int64_t v = 1; v < V; ++v)
          if (xr[v] > xr[best]) best = v;
        pr[best] = 1.f;
        continue;
      }
      for (int64_t v = 0; v < V; ++v) z[v] = xr[v] / t;
      LazyOrder order(z.data(), V);
      const int64_t k = (tkp[r] > 0 && tkp[r] < V) ? tkp[r] : V;
      const int64_t F = std::min<int64_t>(std::max<int64_t>(sfp[r], 0), V);
      const float p_top = tpp[r];
      order.prefix(std::max<int64_t>({k < V ? k : 1, F, 256}));
      const float zmax = z[order.idx[0]];
      const float kth = k < V ? z[order.idx[k - 1]] : kNegInf;
      double Zd = 0.0;
      for (int64_t v = 0; v < V; ++v) {
        e[v] = z[v] >= kth ? exp_nonpos(z[v] - zmax) : 0.f;
        Zd += e[v];
      }
      const float Z = static_cast<float>(Zd);
      // Top-p, tie-inclusive: keep v iff the mass of tokens with larger z is < top_p (first group always).
      float cut = kNegInf;  // kept: z > cut (and z >= kth)
      if (p_top < 1.f) {
        double above = 0.0;
        int64_t i = 0;
        while (true) {
          if (i >= order.sorted) {
            if (order.sorted == V) break;
            order.prefix(order.sorted * 4);
          }
          const float zv = z[order.idx[i]];
          if (zv < kth) break;
          if (i > 0 && !(above < p_top)) {
            cut = zv;
            break;
          }
          int64_t j = i;
          while (true) {  // the whole group of equal z
            if (j >= order.sorted && order.sorted < V) order.prefix(order.sorted * 4);
            if (j >= order.sorted || z[order.idx[j]] != zv) break;
            above += static_cast<double>(e[order.idx[j]] / Z);
            ++j;
          }
          i = j;
        }
      }
      int64_t n_kept = 0;
      for (int64_t v = 0; v < V; ++v) {
        const bool keep = z[v] >= kth && z[v] > cut;
        if (!keep) e[v] = 0.f;
        n_kept += keep;
      }
      std::fill(topf.begin(), topf.end(), 0);
      for (int64_t i = 0; i < F; ++i) topf[order.idx[i]] = 1;
      float lcr = lcp[r];
      if (lcr == kNegInf && n_kept <= F) lcr = 0.f;  // C = 0 would leave no mass: no scaling
      const float c = F > 0 ? std::exp(lcr) : 1.f;
      double Zs = 0.0;
      for (int64_t v = 0; v < V; ++v) {
        if (e[v] == 0.f && !(z[v] >= kth && z[v] > cut)) continue;
        const float w = topf[v] ? e[v] * c : e[v];
        pr[v] = w;
        Zs += w;
      }
      const float inv = static_cast<float>(1.0 / Zs);
      for (int64_t v = 0; v < V; ++v) pr[v] *= inv;
    }
  });
  return probs.to(logits.device());
}

}  // namespace
}  // namespace saguaro

TORCH_LIBRARY_IMPL(saguaro, CPU, m) {
  m.impl("select_candidates", &saguaro::select_candidates_cpu);
  m.impl("proposal_probs", &saguaro::proposal_probs_cpu);
}
