// Decode attention that reads K/V in place from kvbridge's paged cache (CPU, fp32 or bf16: a bf16
// cache and query are widened to fp32 as they are read, and every sum is fp32).
//
// One query token per sequence. For each (sequence, KV head) the kernel walks the sequence's
// blocks in the block table once, flash-decoding style: a block's keys are scored for the KV
// head's query heads, the running softmax (max and sum per query head) is updated, and the
// block's values are added in, weighted. Each byte of K and V is read once per step and nothing
// is gathered into a temporary tensor; the next block's K and V are prefetched into L2 while a
// block is scored (prefetch_block). Registered
// as torch.ops.kvbridge.paged_decode_attention; kvbridge/engine/layers/cpu_kernels.py builds and
// loads it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using kvbridge::bf16;
using kvbridge::hsum;
using kvbridge::kVec;
using kvbridge::load;
using kvbridge::store;
using kvbridge::store_scalar;
using kvbridge::to_float;
using kvbridge::vfloat;

// A dot product in 8 independent lanes (one vector register) summed as a tree: a left-to-right
// sum, or the compiler's own lane-by-lane reduction, is one long chain of dependent adds and was
// most of the kernel's time. The order is fixed, so the result is deterministic.
constexpr int64_t kLanes = 8;

template <typename T>
inline float dot(const float* __restrict__ a, const T* __restrict__ b, int64_t n) {
  float lanes[kLanes] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += a[d + l] * to_float(b[d + l]);
  }
  for (int64_t l = 0; d < n; ++d, ++l) lanes[l] += a[d] * to_float(b[d]);
  for (int64_t l = 0; l < 4; ++l) lanes[l] += lanes[l + 4];
  lanes[0] += lanes[2];
  lanes[1] += lanes[3];
  return lanes[0] + lanes[1];
}

// out[i] = q . k[i * D ..] for kTile keys at once, D a multiple of kVec: kTile independent chains
// of vector FMAs (one key at a time waits on each FMA's latency; the scores were most of the time).
constexpr int64_t kTile = 8;

template <typename T>
inline void dot_tile(const float* __restrict__ q, const T* __restrict__ k, int64_t D, float* out) {
  vfloat acc[kTile] = {};
  for (int64_t d = 0; d < D; d += kVec) {
    const vfloat qv = load(q + d);
    for (int64_t i = 0; i < kTile; ++i) acc[i] += qv * load(k + i * D + d);
  }
  for (int64_t i = 0; i < kTile; ++i) out[i] = hsum(acc[i]);
}

// a[0 .. C * kVec) += sum over t < n of p[t] * v[t * D ..]: even and odd keys in two chains of
// C vectors each, in registers, so the accumulator is loaded and stored once per block.
template <int64_t C, typename T>
inline void add_weighted_vectors(float* __restrict__ a, const float* __restrict__ p, const T* __restrict__ v,
                                 int64_t n, int64_t D) {
  vfloat x0[C], x1[C];
  for (int64_t c = 0; c < C; ++c) x0[c] = load(a + c * kVec), x1[c] = vfloat{};
  int64_t t = 0;
  for (; t + 1 < n; t += 2) {
    const vfloat p0 = vfloat{} + p[t], p1 = vfloat{} + p[t + 1];
    for (int64_t c = 0; c < C; ++c) {
      x0[c] += p0 * load(v + t * D + c * kVec);
      x1[c] += p1 * load(v + (t + 1) * D + c * kVec);
    }
  }
  if (t < n) {
    const vfloat p0 = vfloat{} + p[t];
    for (int64_t c = 0; c < C; ++c) x0[c] += p0 * load(v + t * D + c * kVec);
  }
  for (int64_t c = 0; c < C; ++c) store(a + c * kVec, x0[c] + x1[c]);
}

// a[c..c+W) += sum over t < n of p[t] * v[t * D + c ..], for the W columns from c: even and odd
// keys in two register chains, so the accumulator is loaded and stored once per block.
template <int64_t W, typename T>
inline void add_weighted_rows(float* __restrict__ a, const float* __restrict__ p, const T* __restrict__ v,
                              int64_t n, int64_t D) {
  float x0[W], x1[W] = {};
  for (int64_t l = 0; l < W; ++l) x0[l] = a[l];
  int64_t t = 0;
  for (; t + 1 < n; t += 2) {
    const float p0 = p[t], p1 = p[t + 1];
    const T* v0 = v + t * D;
    const T* v1 = v0 + D;
    for (int64_t l = 0; l < W; ++l) {
      x0[l] += p0 * to_float(v0[l]);
      x1[l] += p1 * to_float(v1[l]);
    }
  }
  if (t < n) {
    for (int64_t l = 0; l < W; ++l) x0[l] += p[t] * to_float(v[t * D + l]);
  }
  for (int64_t l = 0; l < W; ++l) a[l] = x0[l] + x1[l];
}

// Asks the L2 cache for one block's K and V runs (`elems` elements each, `kv_value` apart) while
// another block is scored. Each run is a few KB wherever the block table puts it, so the
// hardware prefetcher, which follows streams within a 4 KB page, gets little ahead of it: without
// this, a 64-sequence step read K/V at about 13.5 GB/s; with it about 17.5 (2 cores, whose read
// bandwidth is about 34 GB/s). Into L2 (locality 2), not L1: prefetching a whole block into L1
// was 2-3x less of a gain (L1's miss buffers fill); 2-4 blocks ahead was no better than 1.
template <typename T>
inline void prefetch_block(const T* k, int64_t kv_value, int64_t elems) {
  for (int64_t i = 0; i < elems; i += 64 / static_cast<int64_t>(sizeof(T))) {
    __builtin_prefetch(k + i, 0, 2);
    __builtin_prefetch(k + kv_value + i, 0, 2);
  }
}

// The attention itself, once the inputs are checked: T is float or bf16 (q, kv and the result).
template <typename T>
void decode_into(const at::Tensor& q, const at::Tensor& kv, const int64_t* table, const int64_t* ctxs,
                 int64_t max_blocks, int64_t sliding_window, double scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t block_size = kv.size(2), kv_heads = kv.size(3);
  const int64_t group = H / kv_heads;
  const float softmax_scale = static_cast<float>(scale);
  const T* q_data = reinterpret_cast<const T*>(q.data_ptr());
  const T* kv_data = reinterpret_cast<const T*>(kv.data_ptr());
  const int64_t q_seq = q.stride(0), q_head = q.stride(1);
  const int64_t kv_block = kv.stride(0), kv_value = kv.stride(1), kv_head = kv.stride(3);
  T* out_data = reinterpret_cast<T*>(out.data_ptr());

  // One pass per (sequence, KV head), block by block: with m the running maximum score and l the
  // running sum of e^(score - m) of a query head, a block with a higher maximum rescales l and the
  // head's accumulated output by e^(m_old - m_new) before its own keys are added.
  // The first block an item (sequence b = item / kv_heads, KV head item % kv_heads) reads.
  auto first_block = [&](int64_t item) {
    const int64_t b = item / kv_heads, ctx = ctxs[b];
    const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, ctx - sliding_window) : 0;
    return kv_data + table[b * max_blocks + first / block_size] * kv_block + (item % kv_heads) * kv_head;
  };
  at::parallel_for(0, B * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q_scaled(group * D), acc(group * D), probs(group * block_size), m(group), l(group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, h = item % kv_heads;
      const int64_t ctx = ctxs[b];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, ctx - sliding_window) : 0;
      const int64_t* row = table + b * max_blocks;
      const T* q_item = q_data + b * q_seq + h * group * q_head;
      for (int64_t g = 0; g < group; ++g) {
        for (int64_t d = 0; d < D; ++d) q_scaled[g * D + d] = to_float(q_item[g * q_head + d]) * softmax_scale;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      auto block_start = [&](int64_t j) { return kv_data + row[j] * kv_block + h * kv_head; };
      const int64_t j_first = first / block_size, j_end = (ctx + block_size - 1) / block_size;
      for (int64_t j = j_first; j < j_end; ++j) {
        const T* k = block_start(j);
        const T* v = k + kv_value;
        if (j + 1 < j_end) {
          prefetch_block(block_start(j + 1), kv_value, block_size * D);
        } else if (item + 1 < end) {  // the next item's first block
          prefetch_block(first_block(item + 1), kv_value, block_size * D);
        }
        const int64_t t0 = std::max<int64_t>(first - j * block_size, 0);
        const int64_t t1 = std::min<int64_t>(ctx - j * block_size, block_size);
        const int64_t n = t1 - t0;
        for (int64_t g = 0; g < group; ++g) {
          float* p = probs.data() + g * block_size;
          const float* qg = q_scaled.data() + g * D;
          float block_max = -std::numeric_limits<float>::infinity();
          int64_t t = 0;
          if (D % kVec == 0) {
            for (; t + kTile <= n; t += kTile) dot_tile(qg, k + (t0 + t) * D, D, p + t);
          }
          for (; t < n; ++t) p[t] = dot(qg, k + (t0 + t) * D, D);
          for (t = 0; t < n; ++t) block_max = std::max(block_max, p[t]);
          const float m_new = std::max(m[g], block_max);
          float sum = 0.f;
          for (int64_t t = 0; t < n; ++t) {
            p[t] = kvbridge::vector_exp(p[t] - m_new);
            sum += p[t];
          }
          if (m_new > m[g]) {  // e^(m_old - m_new) < 1: the earlier blocks' share shrinks
            const float rescale = kvbridge::vector_exp(m[g] - m_new);
            l[g] *= rescale;
            for (int64_t d = 0; d < D; ++d) acc[g * D + d] *= rescale;
            m[g] = m_new;
          }
          l[g] += sum;
        }
        for (int64_t g = 0; g < group; ++g) {
          const float* pg = probs.data() + g * block_size;
          float* a = acc.data() + g * D;
          int64_t c = 0;
          for (; c + 4 * kVec <= D; c += 4 * kVec) add_weighted_vectors<4>(a + c, pg, v + t0 * D + c, n, D);
          for (; c + kVec <= D; c += kVec) add_weighted_vectors<1>(a + c, pg, v + t0 * D + c, n, D);
          for (; c + 8 <= D; c += 8) add_weighted_rows<8>(a + c, pg, v + t0 * D + c, n, D);
          for (; c < D; ++c) add_weighted_rows<1>(a + c, pg, v + t0 * D + c, n, D);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* o = out_data + (b * H + h * group + g) * D;
        const float inv = 1.f / l[g];
        for (int64_t d = 0; d < D; ++d) store_scalar(o + d, acc[g * D + d] * inv);
      }
    }
  });
}

// q [B, H, D] (head_dim contiguous), kv [num_blocks, 2, block_size, kv_heads, D] (0 = K, 1 = V; a
// strided view of the cache in which one block's tokens of one head are one contiguous run),
// block_table [B, max_blocks] int64, context_lens [B] int64: keys 0..ctx-1 of sequence b sit at
// block_table[b][p / block_size], offset p % block_size. q and kv are both fp32 or both bf16 (the
// result has their dtype; scores, softmax and sums are fp32 either way). sliding_window > 0: only keys
// ctx - sliding_window .. ctx - 1 are attended (table entries wholly behind them are not read).
// Query head i attends with KV head i / (H / kv_heads), as SDPA's enable_gqa. Returns [B, H, D].
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& block_table,
                                  const at::Tensor& context_lens, int64_t sliding_window, double scale) {
  TORCH_CHECK(q.device().is_cpu() && kv.device().is_cpu(), "paged_decode_attention: CPU tensors only");
  TORCH_CHECK((q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) &&
                  kv.scalar_type() == q.scalar_type(),
              "paged_decode_attention: q and kv must be both float32 or both bfloat16");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "paged_decode_attention: q must be [B, H, D] with D contiguous");
  TORCH_CHECK(kv.dim() == 5 && kv.size(1) == 2 && kv.stride(4) == 1 && kv.stride(2) == kv.size(4),
              "paged_decode_attention: kv must be [blocks, 2, block_size, kv_heads, D] with each block's "
              "tokens of one head contiguous");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 2 && block_table.is_contiguous(),
              "paged_decode_attention: block_table must be a contiguous int64 [B, max_blocks]");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.dim() == 1 && context_lens.is_contiguous(),
              "paged_decode_attention: context_lens must be a contiguous int64 [B]");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = kv.size(0), block_size = kv.size(2), kv_heads = kv.size(3);
  const int64_t max_blocks = block_table.size(1);
  TORCH_CHECK(kv.size(4) == D, "paged_decode_attention: head_dim of q and kv differ");
  TORCH_CHECK(kv_heads > 0 && H % kv_heads == 0, "paged_decode_attention: query heads must be a multiple of KV heads");
  TORCH_CHECK(block_table.size(0) == B && context_lens.size(0) == B,
              "paged_decode_attention: one block table row and one context length per sequence");
  TORCH_CHECK(sliding_window >= 0, "paged_decode_attention: sliding_window must be >= 0");

  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* ctxs = context_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {  // validate everything the kernel will read, before reading any of it
    const int64_t ctx = ctxs[b];
    TORCH_CHECK(ctx >= 1 && ctx <= max_blocks * block_size, "paged_decode_attention: context length ", ctx,
                " of sequence ", b, " outside 1..", max_blocks * block_size);
    const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, ctx - sliding_window) : 0;
    for (int64_t j = first / block_size; j * block_size < ctx; ++j) {
      const int64_t block = table[b * max_blocks + j];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_decode_attention: block ", block, " of sequence ", b,
                  " outside the cache's ", num_blocks, " blocks");
    }
  }

  at::Tensor out = at::empty({B, H, D}, q.options());
  if (q.scalar_type() == at::kBFloat16) {
    decode_into<bf16>(q, kv, table, ctxs, max_blocks, sliding_window, scale, out);
  } else {
    decode_into<float>(q, kv, table, ctxs, max_blocks, sliding_window, scale, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(kvbridge, m) {
  m.def("paged_decode_attention(Tensor q, Tensor kv, Tensor block_table, Tensor context_lens, "
        "int sliding_window, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvbridge, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
