// CPU kernels: KV write and branch attention over the paged cache (flash layout
// [2, num_blocks, block_size, num_kv_heads, head_size], any strides but a contiguous head dim).
//
// Branch attention works per (request, kv head, group of that request's queries): all queries of a request
// share its prefix, so the prefix is streamed once per work item in chunks of 64 keys and multiplied against
// every (query, head-in-group) row at once with a small register-tiled GEMM (flash-style online softmax).
// Glue and own-branch keys (at most 2K+1 per query) are merged per query afterwards.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <limits>
#include <vector>

#include "cpu_common.h"

namespace saguaro {
namespace {

constexpr int kChunk = 64;    // prefix keys per tile
constexpr int kMaxRows = 96;  // (query, head) rows per work item
constexpr int kMaxPad = 16;   // rows of padding a build may add (its VW or TR)

inline float dot(const float* a, const float* b, int n) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int d = 0;
  for (; d + 8 <= n; d += 8)
    for (int u = 0; u < 8; ++u) s[u] += a[d + u] * b[d + u];
  float t = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  for (; d < n; ++d) t += a[d] * b[d];
  return t;
}

struct Geometry {
  int64_t H, Hkv, G, D, bs, num_slots, MB, S;
  int64_t q_s0, q_s1;           // query strides (tokens, heads)
  int64_t c_s0, c_s1, c_s2, c_s3;  // cache strides (k/v, block, offset, head)
  float scale;
};

template <typename T>
struct CacheView {
  const T* base;
  const Geometry* g;
  const T* at(int kv, int64_t slot, int64_t head) const {
    return base + kv * g->c_s0 + (slot / g->bs) * g->c_s1 + (slot % g->bs) * g->c_s2 + head * g->c_s3;
  }
  // The key rows (kv = 0) of logical positions c0 .. c0+n-1 of a sequence, through its block table, into
  // rows[]; the value row is rows[t] + g->c_s0. Walks block and offset without a division per key (64-bit
  // divisions were most of the cost of a decode step).
  void prefix_rows(const int32_t* bt_row, int64_t c0, int n, int64_t head, const T** rows) const {
    int64_t blk = c0 / g->bs, off = c0 % g->bs;
    const T* block = base + static_cast<int64_t>(bt_row[blk]) * g->c_s1 + head * g->c_s3;
    for (int t = 0; t < n; ++t) {
      rows[t] = block + off * g->c_s2;
      if (++off == g->bs && t + 1 < n) {
        off = 0;
        block = base + static_cast<int64_t>(bt_row[++blk]) * g->c_s1 + head * g->c_s3;
      }
    }
  }
};

// Per-thread buffers; kt/v also hold the glue and branch keys (at most kChunk per query).
struct Scratch {
  std::vector<float> q, qt, acc, m, l, s, kt, v;
  explicit Scratch(const Geometry& g) {
    const int64_t rows = kMaxRows + kMaxPad;
    q.resize(rows * g.D); qt.resize(rows * g.D); acc.resize(rows * g.D); m.resize(rows); l.resize(rows);
    s.resize(rows * kChunk); kt.assign(g.D * kChunk, 0.f); v.assign(kChunk * g.D, 0.f);
  }
};

// The vector helpers are static and inlined: the 32-byte-vector ABI note does not concern them.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace generic {
#define SAGUARO_TARGET
#define VW 8
#define TR 8
#include "attention_core.inc"
#undef TR
#undef VW
#undef SAGUARO_TARGET
}  // namespace generic

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SAGUARO_HAVE_X86_PATHS 1
namespace avx2 {
#define SAGUARO_TARGET __attribute__((target("avx2,fma")))
#define VW 8
#define TR 8
#include "attention_core.inc"
#undef TR
#undef VW
#undef SAGUARO_TARGET
}  // namespace avx2

// 16 lanes and 16-row tiles: 16 accumulators of the 32 zmm registers, FMAs with embedded broadcasts.
namespace avx512 {
#define SAGUARO_TARGET __attribute__((target("avx512f,avx2,fma")))
#define VW 16
#define TR 16
#include "attention_core.inc"
#undef TR
#undef VW
#undef SAGUARO_TARGET
}  // namespace avx512
#endif

// The prefix kernel for this CPU: 0 baseline, 1 AVX2+FMA, 2 AVX-512F. Chosen once per process;
// SAGUARO_CPU_ISA=generic|avx2 caps it.
struct Isa {
  int level = 0;
  Isa() {
#ifdef SAGUARO_HAVE_X86_PATHS
    const char* env = std::getenv("SAGUARO_CPU_ISA");
    const std::string cap = env != nullptr ? env : "";
    if (cap != "generic" && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) level = 1;
    if (cap != "generic" && cap != "avx2" && level == 1 && __builtin_cpu_supports("avx512f")) level = 2;
#endif
  }
};

Isa& isa() {
  static Isa instance;
  return instance;
}

const char* isa_name(int level) { return level == 2 ? "avx512" : level == 1 ? "avx2" : "generic"; }

// "" -> the active ISA; "generic" / "avx2" / "avx512" -> switch (if this CPU has it) and return the active one.
std::string cpu_isa(std::string request) {
  Isa& i = isa();
  if (request == "generic") i.level = 0;
#ifdef SAGUARO_HAVE_X86_PATHS
  const bool has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (request == "avx2" && has_avx2) i.level = 1;
  if (request == "avx512" && has_avx2 && __builtin_cpu_supports("avx512f")) i.level = 2;
#endif
  return isa_name(i.level);
}

constexpr int kFewRows = 4;  // passes over at most this many rows take the row-at-a-time kernel

// Keys begin..end-1 of one sequence into the running state of R rows, at the given ISA level (the AVX-512 build
// needs D % 16 == 0). `few` takes the row-at-a-time kernel, which pads nothing (a decode step's G heads, one
// query's own keys); otherwise the tiled kernel, which pads the rows to its tile height: the state must then
// have that many rows, all owned by this pass.
template <typename T>
void attend_keys(int level, bool few, const Geometry& g, const CacheView<T>& cache, const int32_t* bt_row,
                 int64_t begin, int64_t end, int64_t kvh, int R, const float* Q, float* m, float* l, float* A,
                 Scratch& sc) {
  if (begin >= end) return;
#ifdef SAGUARO_HAVE_X86_PATHS
  if (level == 2 && g.D % 16 != 0) level = 1;
  if (level == 2) return few ? avx512::attend_keys_few<T>(g, cache, bt_row, begin, end, kvh, R, Q, m, l, A, sc)
                             : avx512::attend_keys_tiled<T>(g, cache, bt_row, begin, end, kvh, R, Q, m, l, A, sc);
  if (level == 1) return few ? avx2::attend_keys_few<T>(g, cache, bt_row, begin, end, kvh, R, Q, m, l, A, sc)
                             : avx2::attend_keys_tiled<T>(g, cache, bt_row, begin, end, kvh, R, Q, m, l, A, sc);
#endif
  few ? generic::attend_keys_few<T>(g, cache, bt_row, begin, end, kvh, R, Q, m, l, A, sc)
      : generic::attend_keys_tiled<T>(g, cache, bt_row, begin, end, kvh, R, Q, m, l, A, sc);
}

inline float softmax_merge(float* s, int n, float& m, float& l) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int t = 0; t < n; ++t) mx = std::max(mx, s[t]);
  const float m_new = std::max(m, mx);
  const float alpha = exp_nonpos(m - m_new);
  float sum = 0.f;
  for (int t = 0; t < n; ++t) {
    s[t] = exp_nonpos(s[t] - m_new);
    sum += s[t];
  }
  m = m_new;
  l = l * alpha + sum;
  return alpha;
}

// The block tables and prefix lengths of all sequences, and the owner of each query.
struct Sequences {
  const int32_t* bt;  // [B x MB]
  int64_t MB;
  const int32_t* prefix_lens;
  const int32_t* owners;
  const int32_t* row(int64_t r) const { return bt + r * MB; }
};

// One work item: queries qlist[0..nq) (of one or several sequences) and one kv head. Keys 0..shared-1 lie in
// blocks all their sequences share (forked branches of one request: the same physical blocks), so they are
// streamed once for all rows; each query then adds the rest of its own prefix, its glue and its branch keys.
template <typename T>
void attend_item(const Geometry& g, const T* q, const CacheView<T>& cache, const Sequences& seqs, int64_t shared,
                 const int32_t* depths, const int32_t* steps, const int64_t* bslots, const int64_t* qlist, int nq,
                 int64_t kvh, T* out, Scratch& sc, int level) {
  const int64_t D = g.D, G = g.G;
  const int R = static_cast<int>(nq * G);
  const int RP = (R + kMaxPad - 1) / kMaxPad * kMaxPad;
  float* Q = sc.q.data();
  float* A = sc.acc.data();
  float* m = sc.m.data();
  float* l = sc.l.data();
  for (int i = 0; i < nq; ++i)
    for (int64_t gi = 0; gi < G; ++gi) {
      const T* src = q + qlist[i] * g.q_s0 + (kvh * G + gi) * g.q_s1;
      float* dst = Q + (i * G + gi) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = to_float(src[d]) * g.scale;
    }
  std::fill(A, A + RP * D, 0.f);
  std::fill(m, m + RP, -std::numeric_limits<float>::infinity());
  std::fill(l, l + RP, 0.f);
  // (a) the committed prefix: the shared part for all rows at once, then each query's own rest.
  const int32_t* first_row = seqs.row(seqs.owners[qlist[0]]);
  attend_keys<T>(level, R <= kFewRows, g, cache, first_row, 0, shared, kvh, R, Q, m, l, A, sc);
  for (int i = 0; i < nq; ++i) {
    const int64_t r = seqs.owners[qlist[i]];
    const int64_t o = i * G;
    attend_keys<T>(level, true, g, cache, seqs.row(r), shared, seqs.prefix_lens[r], kvh, static_cast<int>(G),
                   Q + o * D, m + o, l + o, A + o * D, sc);
  }
  // (b) glue 0..depth and (c) own branch tokens 0..step, per query.
  float* ke = sc.kt.data();
  float* ve = sc.v.data();
  float e[kChunk];
  for (int i = 0; i < nq; ++i) {
    const int64_t qi = qlist[i];
    const int64_t depth = depths[qi], step = steps[qi];
    const int32_t* bt_row = seqs.row(seqs.owners[qi]);
    const int64_t n_pre = seqs.prefix_lens[seqs.owners[qi]];
    int ne = 0;
    for (int64_t j = 0; j <= depth; ++j, ++ne) {
      const int64_t p = n_pre + j, slot = static_cast<int64_t>(bt_row[p / g.bs]) * g.bs + p % g.bs;
      const T* kp = cache.at(0, slot, kvh);
      const T* vp = cache.at(1, slot, kvh);
      for (int64_t d = 0; d < D; ++d) ke[ne * D + d] = to_float(kp[d]);
      for (int64_t d = 0; d < D; ++d) ve[ne * D + d] = to_float(vp[d]);
    }
    for (int64_t s = 0; s <= step; ++s, ++ne) {
      const int64_t slot = bslots[qi * g.S + s];
      const T* kp = cache.at(0, slot, kvh);
      const T* vp = cache.at(1, slot, kvh);
      for (int64_t d = 0; d < D; ++d) ke[ne * D + d] = to_float(kp[d]);
      for (int64_t d = 0; d < D; ++d) ve[ne * D + d] = to_float(vp[d]);
    }
    for (int64_t gi = 0; gi < G; ++gi) {
      const int64_t r = i * G + gi;
      const float* qr = Q + r * D;
      for (int t = 0; t < ne; ++t) e[t] = dot(qr, ke + t * D, static_cast<int>(D));
      const float alpha = softmax_merge(e, ne, m[r], l[r]);
      float* a = A + r * D;
      for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
      for (int t = 0; t < ne; ++t) {
        const float w = e[t];
        const float* vr = ve + t * D;
        for (int64_t d = 0; d < D; ++d) a[d] += w * vr[d];
      }
      const float inv = 1.0f / l[r];
      T* o = out + (qi * g.H + kvh * G + gi) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = from_float<T>(a[d] * inv);
    }
  }
}

void check_cache(const at::Tensor& kv_cache) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_size]");
  TORCH_CHECK(kv_cache.stride(4) == 1, "kv_cache: the head dimension must be contiguous");
}

at::Tensor branch_attention_cpu(const at::Tensor& query, const at::Tensor& kv_cache,
                                const at::Tensor& block_tables, const at::Tensor& prefix_lens,
                                const at::Tensor& owners, const at::Tensor& depths, const at::Tensor& steps,
                                const at::Tensor& branch_slots, double scale) {
  check_cache(kv_cache);
  TORCH_CHECK(query.dim() == 3, "query must be [num_queries, num_heads, head_size]");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type(), "query and kv_cache dtypes differ");
  at::Tensor q = query.stride(2) == 1 ? query : query.contiguous();
  const int64_t nq = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = kv_cache.size(3), bs = kv_cache.size(2), nb = kv_cache.size(1);
  TORCH_CHECK(kv_cache.size(4) == D, "head sizes of query and kv_cache differ");
  TORCH_CHECK(H % Hkv == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(D % 8 == 0, "head_size must be a multiple of 8");
  const auto bt = block_tables.to(at::kInt).contiguous();
  const auto pl = prefix_lens.to(at::kInt).contiguous();
  const auto ow = owners.to(at::kInt).contiguous();
  const auto dp = depths.to(at::kInt).contiguous();
  const auto st = steps.to(at::kInt).contiguous();
  const auto bsl = branch_slots.to(at::kLong).contiguous();
  TORCH_CHECK(bt.dim() == 2 && pl.dim() == 1 && pl.size(0) == bt.size(0), "block_tables/prefix_lens shapes");
  TORCH_CHECK(ow.numel() == nq && dp.numel() == nq && st.numel() == nq, "owners/depths/steps need one entry per query");
  TORCH_CHECK(bsl.dim() == 2 && bsl.size(0) == nq && bsl.size(1) <= 62, "branch_slots must be [num_queries, <=62]");
  const int64_t B = bt.size(0), MB = bt.size(1), S = bsl.size(1);
  const int32_t *btp = bt.data_ptr<int32_t>(), *plp = pl.data_ptr<int32_t>(), *owp = ow.data_ptr<int32_t>();
  const int32_t *dpp = dp.data_ptr<int32_t>(), *stp = st.data_ptr<int32_t>();
  const int64_t* bsp = bsl.data_ptr<int64_t>();

  // Validate every index the kernel will touch (serially: cheap next to the attention itself).
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t r = owp[i];
    TORCH_CHECK(r >= 0 && r < B, "owner ", r, " of query ", i, " out of range");
    TORCH_CHECK(dpp[i] >= 0 && stp[i] >= -1 && stp[i] < S && dpp[i] + stp[i] + 2 <= kChunk,
                "query ", i, ": bad depth/step");
    TORCH_CHECK(plp[r] >= 0 && plp[r] + dpp[i] + 1 <= MB * bs, "query ", i, ": prefix + glue exceeds its block table");
    for (int64_t s = 0; s <= stp[i]; ++s)
      TORCH_CHECK(bsp[i * S + s] >= 0 && bsp[i * S + s] < nb * bs, "query ", i, ": branch slot out of range");
  }
  std::vector<int64_t> need(B, 0);
  for (int64_t i = 0; i < nq; ++i) need[owp[i]] = std::max<int64_t>(need[owp[i]], plp[owp[i]] + dpp[i] + 1);
  for (int64_t r = 0; r < B; ++r)
    for (int64_t b = 0; b < (need[r] + bs - 1) / bs; ++b)
      TORCH_CHECK(btp[r * MB + b] >= 0 && btp[r * MB + b] < nb, "block table entry out of range");
  // Sequences that share their leading blocks (branches forked from one request) form a cluster: keys in
  // the blocks all members share are streamed once for all their queries.
  std::vector<int64_t> cluster_of(B), shared_len;
  {
    std::vector<int64_t> by_first(B);
    for (int64_t r = 0; r < B; ++r) by_first[r] = r;
    // Sequences without queries (their tables are not validated) or without a prefix stay alone.
    auto first = [&](int64_t r) { return need[r] > 0 && plp[r] > 0 ? static_cast<int64_t>(btp[r * MB]) : -1 - r; };
    std::stable_sort(by_first.begin(), by_first.end(), [&](int64_t a, int64_t b) { return first(a) < first(b); });
    for (int64_t i = 0; i < B;) {
      int64_t j = i;
      while (j < B && first(by_first[j]) == first(by_first[i])) ++j;
      int64_t shared = plp[by_first[i]];
      for (int64_t k = i; k < j; ++k) shared = std::min<int64_t>(shared, plp[by_first[k]]);
      int64_t blocks = 0;
      const int32_t* lead = btp + by_first[i] * MB;
      for (; blocks * bs < shared; ++blocks) {
        bool same = true;
        for (int64_t k = i + 1; k < j && same; ++k) same = btp[by_first[k] * MB + blocks] == lead[blocks];
        if (!same) break;
      }
      const int64_t c = static_cast<int64_t>(shared_len.size());
      shared_len.push_back(std::min<int64_t>(shared, blocks * bs));
      for (int64_t k = i; k < j; ++k) cluster_of[by_first[k]] = c;
      i = j;
    }
  }
  const int64_t C = static_cast<int64_t>(shared_len.size());
  // Queries grouped by cluster (stable counting sort).
  std::vector<int64_t> ccount(C + 1, 0);
  for (int64_t i = 0; i < nq; ++i) ccount[cluster_of[owp[i]] + 1]++;
  for (int64_t c = 0; c < C; ++c) ccount[c + 1] += ccount[c];
  std::vector<int64_t> order(nq), fill(ccount.begin(), ccount.end() - 1);
  for (int64_t i = 0; i < nq; ++i) order[fill[cluster_of[owp[i]]]++] = i;

  Geometry g{H, Hkv, H / Hkv, D, bs, nb * bs, MB, S,
             q.stride(0), q.stride(1),
             kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
             static_cast<float>(scale)};
  TORCH_CHECK(g.G <= kMaxRows, "too many query heads per kv head");
  const int per_item = static_cast<int>(std::max<int64_t>(1, kMaxRows / g.G));
  struct Item { int64_t cluster, kvh, begin; int n; };
  std::vector<Item> items;
  for (int64_t c = 0; c < C; ++c)
    for (int64_t b = ccount[c]; b < ccount[c + 1]; b += per_item)
      for (int64_t h = 0; h < Hkv; ++h)
        items.push_back({c, h, b, static_cast<int>(std::min<int64_t>(per_item, ccount[c + 1] - b))});
  const Sequences seqs{btp, MB, plp, owp};

  auto out = at::empty({nq, H, D}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "branch_attention_cpu", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    CacheView<scalar_t> cache{kv_cache.data_ptr<scalar_t>(), &g};
    scalar_t* op = out.data_ptr<scalar_t>();
    const int level = isa().level;
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t lo, int64_t hi) {
      Scratch sc(g);
      for (int64_t w = lo; w < hi; ++w) {
        const Item& it = items[w];
        attend_item<scalar_t>(g, qp, cache, seqs, shared_len[it.cluster], dpp, stp, bsp, order.data() + it.begin,
                              it.n, it.kvh, op, sc, level);
      }
    });
  });
  return out.to(query.scalar_type());
}

void write_kv_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                  const at::Tensor& slot_mapping) {
  check_cache(kv_cache);
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key/value must be [num_tokens, num_kv_heads, head_size]");
  TORCH_CHECK(key.size(1) == kv_cache.size(3) && key.size(2) == kv_cache.size(4), "key/value shape vs kv_cache");
  const auto k = key.to(kv_cache.scalar_type());
  const auto v = value.to(kv_cache.scalar_type());
  const auto slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t T = k.size(0), Hkv = k.size(1), D = k.size(2), bs = kv_cache.size(2);
  const int64_t num_slots = kv_cache.size(1) * bs;
  TORCH_CHECK(slots.numel() == T, "slot_mapping needs one slot per token");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] < num_slots, "slot ", sp[t], " out of range");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv_cache.scalar_type(), "write_kv_cpu", [&] {
    scalar_t* c = kv_cache.data_ptr<scalar_t>();
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    const int64_t c0 = kv_cache.stride(0), c1 = kv_cache.stride(1), c2 = kv_cache.stride(2), c3 = kv_cache.stride(3);
    at::parallel_for(0, T, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t slot = sp[t];
        if (slot < 0) continue;
        scalar_t* dst = c + (slot / bs) * c1 + (slot % bs) * c2;
        for (int64_t h = 0; h < Hkv; ++h) {
          const scalar_t* ks = kp + t * k.stride(0) + h * k.stride(1);
          const scalar_t* vs = vp + t * v.stride(0) + h * v.stride(1);
          for (int64_t d = 0; d < D; ++d) dst[h * c3 + d] = ks[d * k.stride(2)];
          for (int64_t d = 0; d < D; ++d) dst[c0 + h * c3 + d] = vs[d * v.stride(2)];
        }
      }
    });
  });
}

}  // namespace
}  // namespace saguaro

TORCH_LIBRARY_IMPL(saguaro, CPU, m) {
  m.impl("branch_attention", &saguaro::branch_attention_cpu);
  m.impl("write_kv", &saguaro::write_kv_cpu);
}

TORCH_LIBRARY_FRAGMENT(saguaro, m) {
  // Which CPU prefix kernel branch_attention uses ("generic", "avx2" or "avx512"); a non-empty argument
  // switches (to one this CPU supports).
  m.def("cpu_isa(str request=\"\") -> str", &saguaro::cpu_isa);
}
