// y = x @ W^T with W kept in GGUF's 32-weight blocks (Q4_1, Q8_0), widened to fp32 on the fly.
//
// A CPU decode step is bound by the bytes of weights it reads: fp32 weights are 4 bytes each,
// Q4_1 blocks 0.625 and Q8_0 1.0625. Each weight is widened exactly as gguf-py's dequantizer does
// (Q4_1: d * q + m, a multiply then an add; Q8_0: d * q), so the multiply sees, bit for bit, the
// fp32 weights transformers loads from the same file.
//
// Layout (kvshare_kernels/block_linear.py packs it): the columns in panels of 16, k-major, so that
// one 16-byte load widens to the 16 columns' weights at one k (Q8_0) or at two k (Q4_1: low nibble
// k, high nibble k + 1), with the block's 16 scales (and mins) loaded once per 32 k.
//   Q4_1: qs [N/16, K/2, 16] uint8, d, m [N/16, K/32, 16] fp16 bits
//   Q8_0: qs [N/16, K, 16] int8,     d    [N/16, K/32, 16] fp16 bits
//
// Every output element is one fp32 lane summed over k in ascending order by fused multiply-adds:
// its bits depend neither on how many rows come with it, nor on its place among them, nor on the
// thread count. The engine relies on that (a prompt's tail computed after a prefix-cache hit gets
// the bits its first, longer prefill gave it).
//
// AVX-512F; supported() says whether this CPU has it (the caller keeps fp32 weights where not).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>
#include <immintrin.h>

#include "check.h"

#include <algorithm>
#include <cstdint>
#include <memory>

namespace {

constexpr int64_t kBlock = 32;   // weights per GGUF block
constexpr int64_t kLanes = 16;   // columns per panel: one fp32 vector
constexpr int64_t kNV = 2;       // panels per register tile: 32 columns
constexpr int64_t kMR = 12;      // rows per register tile: 24 accumulators of 32 registers
constexpr int64_t kMC = 48;      // rows per chunk: a chunk's x stays in L2 while the panels pass

enum class Format { q4_1, q8_0 };

#define KV_TARGET __attribute__((target("avx512f,f16c,fma")))

// Panel p widened into out[k * ldo + 0..15] for every k.
template <Format F>
KV_TARGET inline void widen_panel(const uint8_t* qs, const uint16_t* d, const uint16_t* m, int64_t K, float* out,
                                  int64_t ldo) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + b * kLanes)));
    float* o = out + b * kBlock * ldo;
    if constexpr (F == Format::q4_1) {
      const __m512 min = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + b * kLanes)));
      const uint8_t* q = qs + b * (kBlock / 2) * kLanes;
      for (int64_t kk = 0; kk < kBlock / 2; ++kk) {
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + kk * kLanes)));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0f)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
        _mm512_store_ps(o + (2 * kk) * ldo, _mm512_add_ps(_mm512_mul_ps(scale, lo), min));
        _mm512_store_ps(o + (2 * kk + 1) * ldo, _mm512_add_ps(_mm512_mul_ps(scale, hi), min));
      }
    } else {
      const int8_t* q = reinterpret_cast<const int8_t*>(qs) + b * kBlock * kLanes;
      for (int64_t kk = 0; kk < kBlock; ++kk) {
        const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + kk * kLanes)));
        _mm512_store_ps(o + kk * ldo, _mm512_mul_ps(scale, _mm512_cvtepi32_ps(v)));
      }
    }
  }
}

// MR rows x NV*16 columns: y[r][c] = sum over k, in order, of x[r][k] * w[k][c].
template <int MR, int NV>
KV_TARGET inline void tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K, float* y,
                           int64_t ldy) {
  __m512 acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = _mm512_load_ps(w + k * ldw + v * kLanes);
    for (int r = 0; r < MR; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(xb, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(y + r * ldy + v * kLanes, acc[r][v]);
}

template <int NV>
KV_TARGET void rows(int64_t mr, const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K, float* y,
                    int64_t ldy) {
  switch (mr) {
#define KV_ROWS(n) case n: tile<n, NV>(x, ldx, w, ldw, K, y, ldy); break;
    KV_ROWS(12) KV_ROWS(11) KV_ROWS(10) KV_ROWS(9) KV_ROWS(8) KV_ROWS(7)
    KV_ROWS(6) KV_ROWS(5) KV_ROWS(4) KV_ROWS(3) KV_ROWS(2) KV_ROWS(1)
#undef KV_ROWS
    default: kv_check_failed("row tile of %lld", (long long)mr);
  }
}

template <Format F>
KV_TARGET void gemm(const float* x, int64_t M, int64_t K, const uint8_t* qs, const uint16_t* d, const uint16_t* m,
                    int64_t N, float* y) {
  const int64_t panel_bytes = (F == Format::q4_1 ? K / 2 : K) * kLanes;
  const int64_t panel_scales = K / kBlock * kLanes;
  const int64_t tiles = (N / kLanes + kNV - 1) / kNV;
  // A thread takes whole column tiles: no output element is split between threads.
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    const int64_t ldw = kNV * kLanes;
    std::unique_ptr<float[]> raw(new float[K * ldw + 16]);
    float* wbuf = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(raw.get()) + 63) & ~uintptr_t(63));
    for (int64_t c0 = 0; c0 < M; c0 += kMC) {
      const int64_t c1 = std::min(M, c0 + kMC);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t p0 = t * kNV, nv = std::min(kNV, N / kLanes - p0);
        for (int64_t v = 0; v < nv; ++v) {
          const int64_t p = p0 + v;
          widen_panel<F>(qs + p * panel_bytes, d + p * panel_scales, m ? m + p * panel_scales : nullptr, K,
                         wbuf + v * kLanes, ldw);
        }
        for (int64_t r0 = c0; r0 < c1; r0 += kMR) {
          const int64_t mr = std::min(kMR, c1 - r0);
          float* yt = y + r0 * N + p0 * kLanes;
          if (nv == 2) rows<2>(mr, x + r0 * K, K, wbuf, ldw, K, yt, N);
          else rows<1>(mr, x + r0 * K, K, wbuf, ldw, K, yt, N);
        }
      }
    }
  });
}

bool supported() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
}

at::Tensor block_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                        const std::optional<at::Tensor>& m, int64_t format) {
  TORCH_CHECK(supported(), "kvshare_cpu.block_linear needs AVX-512F, F16C and FMA");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous float32 CPU matrix [M, K]");
  TORCH_CHECK(format == 0 || format == 1, "format must be 0 (Q4_1) or 1 (Q8_0)");
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.dim() == 3 && qs.size(2) == kLanes && qs.is_contiguous(),
              "qs must be contiguous uint8 [N/16, k rows, 16]");
  TORCH_CHECK(d.scalar_type() == at::kShort && d.dim() == 3 && d.size(0) == qs.size(0) && d.size(2) == kLanes &&
              d.is_contiguous(), "d must be contiguous int16 (fp16 bits) [N/16, K/32, 16]");
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0) * kLanes;
  KV_CHECK(K % kBlock == 0 && d.size(1) == K / kBlock, "x has %lld columns, the weight %lld blocks of 32", (long long)K,
           (long long)d.size(1));
  KV_CHECK(qs.size(1) == (format == 0 ? K / 2 : K), "qs holds %lld k rows, not %lld", (long long)qs.size(1),
           (long long)(format == 0 ? K / 2 : K));
  const uint16_t* mp = nullptr;
  if (format == 0) {
    TORCH_CHECK(m.has_value() && m->scalar_type() == at::kShort && m->sizes() == d.sizes() && m->is_contiguous(),
                "Q4_1 needs m, contiguous int16 (fp16 bits) shaped like d");
    mp = reinterpret_cast<const uint16_t*>(m->data_ptr<int16_t>());
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const auto* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<int16_t>());
  if (format == 0) gemm<Format::q4_1>(x.data_ptr<float>(), M, K, qs.data_ptr<uint8_t>(), dp, mp, N, y.data_ptr<float>());
  else gemm<Format::q8_0>(x.data_ptr<float>(), M, K, qs.data_ptr<uint8_t>(), dp, nullptr, N, y.data_ptr<float>());
  return y;
}

}  // namespace

TORCH_LIBRARY(kvshare_cpu, lib) {
  lib.def("block_linear(Tensor x, Tensor qs, Tensor d, Tensor? m, int format) -> Tensor");
  lib.def("supported() -> bool", supported);
}

TORCH_LIBRARY_IMPL(kvshare_cpu, CPU, lib) { lib.impl("block_linear", block_linear); }
