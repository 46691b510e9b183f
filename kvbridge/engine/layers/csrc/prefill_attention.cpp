// Causal prefill attention over a prompt's own new K/V (CPU, fp32): flash-attention style, in
// tiles of 16 queries x 32 keys, with a running softmax per query row.
//
// Work item: (KV head, tile of 16 query positions); the KV head's query heads (its GQA group)
// share the item, so each key and value tile is read once for all of them. Scores: K is
// transposed once per call ([D][keys]), so each query row's 32 scores are 2 (AVX-512) or 4 (AVX2) vectors built by D
// broadcast-FMAs, 8 rows at a time in independent chains (no horizontal sums). Values: each row's
// output (D floats) is accumulated in registers over the tile's keys. Items are scheduled
// dynamically, the longest (the last query tiles, which see the most keys) first. Against
// torch's CPU flash attention (SDPA) with SmolLM2's heads (9 query, 3 KV, of 64), 2 threads:
// 1.6x faster at 128 tokens, 1.5x at 512, 1.1x at 1024, about equal at 2048
// (benchmarks/README.md). Registered as torch.ops.kvbridge.prefill_attention;
// kvbridge/engine/layers/cpu_kernels.py builds and loads it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec_math.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using kvbridge::kNat;
using kvbridge::kNatRegs;
using kvbridge::kVec;
using kvbridge::load_nat;
using kvbridge::splat_nat;
using kvbridge::store_nat;
using kvbridge::vnat;

constexpr int64_t kTile = 16;  // queries per tile
constexpr int64_t kKeys = 32;  // keys per tile
constexpr int64_t kPer = kKeys / kNat;  // vectors of scores per query row (2 with AVX-512, 4 with AVX2)
// Query rows scored together (independent FMA chains): their kRows x kPer accumulators and one key
// tile's kPer vectors stay in registers: 8 rows with AVX-512 (16 + 2 of 32 zmm), 2 with AVX2 (8 + 4
// of 16 ymm).
constexpr int64_t kRows = kNatRegs >= 32 ? 8 : 2;

// The largest of 16 floats, as a tree.
inline float max16(const float* p) {
  float x[8];
  for (int64_t i = 0; i < 8; ++i) x[i] = std::max(p[i], p[i + 8]);
  for (int64_t i = 0; i < 4; ++i) x[i] = std::max(x[i], x[i + 4]);
  return std::max(std::max(x[0], x[2]), std::max(x[1], x[3]));
}

// One query row's weighted sum of the tile's values: out[0 .. D) = out * rescale + sum over
// t < n of p[t] * v[t * v_row ..]; D a multiple of kVec, at most kMaxD.
constexpr int64_t kMaxD = 256;

inline void add_values(float* __restrict__ out, float rescale, const float* __restrict__ p,
                       const float* __restrict__ v, int64_t v_row, int64_t n, int64_t D) {
  vnat acc[kMaxD / kNat];
  const int64_t C = D / kNat;
  const vnat r = splat_nat(rescale);
  for (int64_t c = 0; c < C; ++c) acc[c] = load_nat(out + c * kNat) * r;
  for (int64_t t = 0; t < n; ++t) {
    const vnat pt = splat_nat(p[t]);
    const float* row = v + t * v_row;
    for (int64_t c = 0; c < C; ++c) acc[c] += pt * load_nat(row + c * kNat);
  }
  for (int64_t c = 0; c < C; ++c) store_nat(out + c * kNat, acc[c]);
}

// s[r][j] += the scores of query row r (q + r * D, r < nr <= kRows) against keys j * kNat ..
// (j + 1) * kNat - 1 of a key tile (kt[d * L_pad + t]). kFull: nr == kRows, a constant the loop
// unrolls by.
template <bool kFull>
inline void score_rows(vnat (*s)[kPer], const float* __restrict__ q, const float* __restrict__ kt, int64_t D,
                       int64_t L_pad, int64_t nr) {
  const int64_t n = kFull ? kRows : nr;
  for (int64_t d = 0; d < D; ++d) {
    vnat k[kPer];
    for (int64_t j = 0; j < kPer; ++j) k[j] = load_nat(kt + d * L_pad + j * kNat);
    for (int64_t r = 0; r < n; ++r) {
      const vnat qd = splat_nat(q[r * D + d]);
      for (int64_t j = 0; j < kPer; ++j) s[r][j] += qd * k[j];
    }
  }
}

// q [L, H, D], k and v [L, kv_heads, D] (each with D contiguous; any row strides: the model's
// views into its fused QKV output), causal: query i attends keys 0..i. Query head i attends with
// KV head i / (H / kv_heads). Returns [L, H, D], contiguous.
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "prefill_attention: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "prefill_attention: q, k and v must be float32");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 &&
                  v.stride(2) == 1,
              "prefill_attention: q, k and v must be [tokens, heads, head_dim] with head_dim contiguous");
  const int64_t L = q.size(0), H = q.size(1), D = q.size(2), kv_heads = k.size(1);
  TORCH_CHECK(k.size(0) == L && v.size(0) == L && v.size(1) == kv_heads && k.size(2) == D && v.size(2) == D,
              "prefill_attention: q, k and v disagree on tokens, KV heads or head_dim");
  TORCH_CHECK(kv_heads > 0 && H % kv_heads == 0, "prefill_attention: query heads must be a multiple of KV heads");
  TORCH_CHECK(D % kVec == 0 && D <= kMaxD, "prefill_attention: head_dim must be a multiple of 16, at most 256");
  static_assert(kVec % kNat == 0 && kKeys % kNat == 0);

  at::Tensor out = at::empty({L, H, D}, q.options());
  if (L == 0) return out;
  const int64_t group = H / kv_heads;
  const int64_t tiles = (L + kTile - 1) / kTile;
  const float softmax_scale = static_cast<float>(scale);
  const float* q_data = q.data_ptr<float>();
  const float* k_data = k.data_ptr<float>();
  const float* v_data = v.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const int64_t q_tok = q.stride(0), q_head = q.stride(1);
  const int64_t k_tok = k.stride(0), k_head = k.stride(1), v_tok = v.stride(0), v_head = v.stride(1);
  // K transposed once per call, [kv_heads][D][L_pad] (L rounded up to kKeys; padding keys 0, never visible), so
  // that a tile's keys are one vector per d for every query tile that reads them.
  const int64_t L_pad = (L + kKeys - 1) / kKeys * kKeys;
  std::vector<float> k_t(kv_heads * D * L_pad, 0.f);
  for (int64_t h = 0; h < kv_heads; ++h) {  // one pass, serially: about 1% of the work
    for (int64_t t = 0; t < L; ++t) {
      const float* src = k_data + t * k_tok + h * k_head;
      float* dst = k_t.data() + h * D * L_pad + t;
      for (int64_t d = 0; d < D; ++d) dst[d * L_pad] = src[d];
    }
  }
  const int64_t items = kv_heads * tiles;
  const int threads = std::max(1, std::min<int>(at::get_num_threads(), static_cast<int>(items)));

#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t qt = tiles - 1 - item / kv_heads, h = item % kv_heads;  // longest first
    const int64_t r0 = qt * kTile, rows = std::min(kTile, L - r0);
    const int64_t NR = group * rows;  // query rows of the item: row g * rows + i is head h*group+g, position r0+i
    std::vector<float> qs(NR * D), acc(NR * D, 0.f), m(NR, -std::numeric_limits<float>::infinity()), l(NR, 0.f);
    alignas(64) float s[kRows][kKeys];
    for (int64_t g = 0; g < group; ++g) {
      for (int64_t i = 0; i < rows; ++i) {
        const float* src = q_data + (r0 + i) * q_tok + (h * group + g) * q_head;
        for (int64_t d = 0; d < D; ++d) qs[(g * rows + i) * D + d] = src[d] * softmax_scale;
      }
    }
    for (int64_t k0 = 0; k0 < r0 + rows; k0 += kKeys) {  // key tiles up to the tile's last query
      const int64_t nk = std::min(kKeys, L - k0);
      const float* kt = k_t.data() + h * D * L_pad + k0;  // kt[d * L_pad + t]: key k0 + t, dimension d
      const float* vt = v_data + k0 * v_tok + h * v_head;
      for (int64_t R0 = 0; R0 < NR; R0 += kRows) {
        const int64_t nr = std::min(kRows, NR - R0);
        vnat scores[kRows][kPer] = {};  // row r's scores of keys k0 .. k0 + 31
        if (nr == kRows) {
          score_rows<true>(scores, qs.data() + R0 * D, kt, D, L_pad, nr);
        } else {
          score_rows<false>(scores, qs.data() + R0 * D, kt, D, L_pad, nr);
        }
        for (int64_t r = 0; r < nr; ++r) {
          const int64_t R = R0 + r, pos = r0 + R % rows;  // the row's query position
          const int64_t n = std::min(nk, pos - k0 + 1);  // keys k0 .. k0 + n - 1 are visible to it
          if (n <= 0) continue;
          float* p = s[r];
          for (int64_t j = 0; j < kPer; ++j) store_nat(p + j * kNat, scores[r][j]);
          for (int64_t t = n; t < kKeys; ++t) p[t] = -std::numeric_limits<float>::infinity();
          const float m_new = std::max(m[R], std::max(max16(p), max16(p + kVec)));
          for (int64_t t = 0; t < kKeys; ++t) p[t] = kvbridge::vector_exp(p[t] - m_new);  // 0 where masked
          const float sum = kvbridge::sum16(p) + kvbridge::sum16(p + kVec);
          float rescale = 1.f;
          if (m_new > m[R]) {  // e^(m_old - m_new) < 1: the earlier keys' share shrinks
            rescale = kvbridge::vector_exp(m[R] - m_new);
            m[R] = m_new;
          }
          l[R] = l[R] * rescale + sum;
          add_values(acc.data() + R * D, rescale, p, vt, v_tok, n, D);
        }
      }
    }
    for (int64_t R = 0; R < NR; ++R) {
      const int64_t g = R / rows, i = R % rows;
      float* o = out_data + ((r0 + i) * H + h * group + g) * D;
      const float inv = 1.f / l[R];
      for (int64_t d = 0; d < D; ++d) o[d] = acc[R * D + d] * inv;
    }
  }
  return out;
}

}  // namespace

KVBRIDGE_LIBRARY_FRAGMENT(KVBRIDGE_OPS, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
}

KVBRIDGE_LIBRARY_IMPL(KVBRIDGE_OPS, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
