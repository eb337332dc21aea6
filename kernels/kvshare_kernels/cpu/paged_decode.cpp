// Paged decode attention on the CPU: one query token per sequence against its cached tokens,
// read in place from the fp32 page pool through the sequence's page table.
//
// torch's path (kvshare_kernels.reference) gathers every sequence's pages into a dense K and V
// (two index_selects of the whole context per layer), builds a mask and calls SDPA: on SmolLM2 at
// 12 sequences that is ~0.27 ms a layer, a fifth of a one-core decode step. Here each
// sequence is one task that walks its pages itself: the scores of every query head, a softmax in
// fp32, then the values summed in token order.
//
// Each output is computed by one thread in a fixed order (tokens ascending, lanes of D summed by
// one horizontal add), so its bits depend neither on the thread count nor on the other sequences
// of the step. AVX-512F (the library's supported()); D a multiple of 16.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <torch/library.h>
#include <immintrin.h>

#include "check.h"

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

#define KV_TARGET __attribute__((target("avx512f,fma")))

KV_TARGET inline float dot(const float* a, const float* b, int64_t D) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < D; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  return _mm512_reduce_add_ps(acc);
}

KV_TARGET inline void axpy(float p, const float* v, float* acc, int64_t D) {
  const __m512 w = _mm512_set1_ps(p);
  for (int64_t i = 0; i < D; i += 16)
    _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(w, _mm512_loadu_ps(v + i), _mm512_loadu_ps(acc + i)));
}

// One sequence, all its heads: token t's K (then V) rows of every KV head lie side by side in its
// page, so the walk reads each page once, front to back, where a task per KV head would stride
// through it Hkv times (the pool is cold by the time attention runs: the linear layers passed).
KV_TARGET void one_sequence(const float* q, const float* k, const float* v, const int32_t* pages, int64_t L,
                            int64_t S, int64_t Hkv, int64_t G, int64_t D, float scale, float* out,
                            std::vector<float>& scores) {
  const int64_t Hq = Hkv * G;
  scores.resize(static_cast<size_t>(Hq * L));
  for (int64_t t = 0; t < L; ++t) {
    const float* kr = k + (static_cast<int64_t>(pages[t / S]) * S + t % S) * Hkv * D;
    for (int64_t h = 0; h < Hq; ++h) scores[h * L + t] = dot(q + h * D, kr + (h / G) * D, D) * scale;
  }
  for (int64_t h = 0; h < Hq; ++h) {
    float* s = scores.data() + h * L;
    float m = s[0];
    for (int64_t t = 1; t < L; ++t) m = std::max(m, s[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < L; ++t) {
      s[t] = std::exp(s[t] - m);
      sum += s[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < L; ++t) s[t] *= inv;
  }
  for (int64_t t = 0; t < L; ++t) {
    const float* vr = v + (static_cast<int64_t>(pages[t / S]) * S + t % S) * Hkv * D;
    for (int64_t h = 0; h < Hq; ++h) axpy(scores[h * L + t], vr + (h / G) * D, out + h * D, D);
  }
}

// q [B, Hq, D]; k_cache, v_cache [P, S, Hkv, D]; page_table int32 [B, W]; context_lens int32 [B].
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& page_table, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat,
              "paged_decode_attention: q, k_cache and v_cache must be float32");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "paged_decode_attention: q must be [B, Hq, D] and k_cache, v_cache equal [P, S, Hkv, D]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode_attention: q, k_cache and v_cache must be contiguous");
  TORCH_CHECK(page_table.scalar_type() == at::kInt && page_table.dim() == 2 && page_table.is_contiguous() &&
                  context_lens.scalar_type() == at::kInt && context_lens.dim() == 1 && context_lens.is_contiguous(),
              "paged_decode_attention: page_table must be contiguous int32 [B, W], context_lens int32 [B]");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t P = k_cache.size(0), S = k_cache.size(1), Hkv = k_cache.size(2), W = page_table.size(1);
  KV_CHECK(k_cache.size(3) == D && D % 16 == 0, "paged_decode_attention: head_dim must match and be a multiple of 16, got %lld",
           (long long)D);
  KV_CHECK(Hkv > 0 && Hq % Hkv == 0, "paged_decode_attention: %lld query heads for %lld KV heads", (long long)Hq, (long long)Hkv);
  KV_CHECK(page_table.size(0) == B && context_lens.size(0) == B,
           "paged_decode_attention: page_table and context_lens must have one row per query (%lld)", (long long)B);
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* table = page_table.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    KV_CHECK(lens[b] >= 0 && (lens[b] + S - 1) / S <= W,
             "paged_decode_attention: context_lens[%lld] = %d needs more pages than page_table's %lld columns",
             (long long)b, lens[b], (long long)W);
    for (int64_t i = 0; i < (lens[b] + S - 1) / S; ++i)
      KV_CHECK(table[b * W + i] >= 0 && table[b * W + i] < P,
               "paged_decode_attention: page_table[%lld, %lld] = %d is outside the pool of %lld pages", (long long)b,
               (long long)i, table[b * W + i], (long long)P);
  }
  at::Tensor out = at::zeros_like(q);      // a context of 0 tokens reads as zeros, not NaN
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t G = Hq / Hkv;
  const float s = static_cast<float>(scale);
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    // Flush denormals for this task: a peaked softmax leaves probabilities below FLT_MIN, and a
    // multiply-add on a denormal takes a microcode assist.
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);   // FTZ | DAZ
    std::vector<float> scores;
    for (int64_t b = begin; b < end; ++b) {
      if (lens[b] == 0) continue;
      // query head j reads KV head j / G (grouped-query attention)
      one_sequence(qp + b * Hq * D, kp, vp, table + b * W, lens[b], S, Hkv, G, D, s, op + b * Hq * D, scores);
    }
    _mm_setcsr(csr);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvshare_cpu, lib) {
  lib.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor context_lens, "
          "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvshare_cpu, CPU, lib) { lib.impl("paged_decode_attention", paged_decode_attention); }
