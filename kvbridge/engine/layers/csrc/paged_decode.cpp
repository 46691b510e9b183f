// Decode attention that reads K/V in place from kvbridge's paged cache (CPU, fp32).
//
// One query token per sequence. For each (sequence, KV head) the kernel walks the sequence's
// blocks in the block table twice, scoring K for the KV head's query heads, then summing V
// weighted by the softmax, so each byte of K and V is read once per step and nothing is
// gathered into a temporary tensor. Registered as torch.ops.kvbridge.
// paged_decode_attention; kvbridge/engine/layers/cpu_kernels.py builds and loads it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// A dot product in 8 independent lanes (one vector register) summed as a tree: a left-to-right
// sum, or the compiler's own lane-by-lane reduction, is one long chain of dependent adds and was
// most of the kernel's time. The order is fixed, so the result is deterministic.
constexpr int64_t kLanes = 8;
constexpr int64_t kChunk = 16;  // head_dim columns of V accumulated at once, in registers

inline float dot(const float* __restrict__ a, const float* __restrict__ b, int64_t n) {
  float lanes[kLanes] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += a[d + l] * b[d + l];
  }
  for (int64_t l = 0; d < n; ++d, ++l) lanes[l] += a[d] * b[d];
  for (int64_t l = 0; l < 4; ++l) lanes[l] += lanes[l + 4];
  lanes[0] += lanes[2];
  lanes[1] += lanes[3];
  return lanes[0] + lanes[1];
}

// a0 += p[t] * v[t] for even t, a1 for odd t, t in [t0, t1), over the first W columns of rows
// `stride` floats apart: two independent chains of FMAs, kept in registers.
template <int64_t W>
inline void weighted_rows(float* __restrict__ a0, float* __restrict__ a1, const float* p, const float* v,
                          int64_t t0, int64_t t1, int64_t stride) {
  float x0[W], x1[W];
  for (int64_t l = 0; l < W; ++l) x0[l] = a0[l], x1[l] = a1[l];
  int64_t t = t0;
  for (; t + 1 < t1; t += 2) {
    const float p0 = p[t], p1 = p[t + 1];
    const float* v0 = v + t * stride;
    const float* v1 = v0 + stride;
    for (int64_t l = 0; l < W; ++l) {
      x0[l] += p0 * v0[l];
      x1[l] += p1 * v1[l];
    }
  }
  if (t < t1) {
    for (int64_t l = 0; l < W; ++l) x0[l] += p[t] * v[t * stride + l];
  }
  for (int64_t l = 0; l < W; ++l) a0[l] = x0[l], a1[l] = x1[l];
}

inline void weighted_rows_partial(float* a0, float* a1, const float* p, const float* v, int64_t t0, int64_t t1,
                                  int64_t stride, int64_t width) {
  for (int64_t t = t0; t < t1; ++t) {
    float* a = (t - t0) % 2 ? a1 : a0;
    for (int64_t l = 0; l < width; ++l) a[l] += p[t] * v[t * stride + l];
  }
}

// q [B, H, D] (head_dim contiguous), kv [num_blocks, 2, block_size, kv_heads, D] (0 = K, 1 = V; a
// strided view of the cache in which one block's tokens of one head are one contiguous run),
// block_table [B, max_blocks] int64, context_lens [B] int64: keys 0..ctx-1 of sequence b sit at
// block_table[b][p / block_size], offset p % block_size. sliding_window > 0: only keys
// ctx - sliding_window .. ctx - 1 are attended (table entries wholly behind them are not read).
// Query head i attends with KV head i / (H / kv_heads), as SDPA's enable_gqa. Returns [B, H, D].
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& block_table,
                                  const at::Tensor& context_lens, int64_t sliding_window, double scale) {
  TORCH_CHECK(q.device().is_cpu() && kv.device().is_cpu(), "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kFloat && kv.scalar_type() == at::kFloat,
              "paged_decode_attention: q and kv must be float32");
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

  const int64_t group = H / kv_heads;
  const float softmax_scale = static_cast<float>(scale);
  const float* q_data = q.data_ptr<float>();
  const float* kv_data = kv.data_ptr<float>();
  const int64_t q_seq = q.stride(0), q_head = q.stride(1);
  const int64_t kv_block = kv.stride(0), kv_value = kv.stride(1), kv_head = kv.stride(3);
  at::Tensor out = at::empty({B, H, D}, q.options());
  float* out_data = out.data_ptr<float>();

  // Two passes per (sequence, KV head): scores of every visible key for the head's `group` query
  // heads (K read once; the next block's K prefetched while the current one is scored), then
  // softmax and the weighted sum of V, kChunk columns at a time (V comes from memory with the
  // first chunk and from cache for the others; prefetching every V block up front was slower).
  at::parallel_for(0, B * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, h = item % kv_heads;
      const int64_t ctx = ctxs[b];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, ctx - sliding_window) : 0;
      const int64_t n = ctx - first;
      const int64_t* row = table + b * max_blocks;
      const float* q_item = q_data + b * q_seq + h * group * q_head;
      scores.resize(group * n);
      auto block_start = [&](int64_t j) { return kv_data + row[j] * kv_block + h * kv_head; };
      auto prefetch = [&](const float* p, int64_t rows) {
        for (int64_t i = 0; i < rows * D; i += 16) __builtin_prefetch(p + i);
      };
      const int64_t j_first = first / block_size, j_end = (ctx + block_size - 1) / block_size;
      for (int64_t j = j_first; j < j_end; ++j) {
        if (j + 1 < j_end) prefetch(block_start(j + 1), block_size);
        const float* k = block_start(j);
        const int64_t t0 = std::max<int64_t>(first - j * block_size, 0);
        const int64_t t1 = std::min<int64_t>(ctx - j * block_size, block_size);
        for (int64_t t = t0; t < t1; ++t) {
          const float* kt = k + t * D;
          const int64_t pos = j * block_size + t - first;
          for (int64_t g = 0; g < group; ++g) scores[g * n + pos] = dot(q_item + g * q_head, kt, D) * softmax_scale;
        }
      }
      for (int64_t g = 0; g < group; ++g) {  // softmax of each query head's scores, in place
        float* sg = scores.data() + g * n;
        const float m = *std::max_element(sg, sg + n);
        float sum = 0.f;
        for (int64_t i = 0; i < n; ++i) {
          sg[i] = std::exp(sg[i] - m);
          sum += sg[i];
        }
        const float inv = 1.f / sum;
        for (int64_t i = 0; i < n; ++i) sg[i] *= inv;
      }
      for (int64_t g = 0; g < group; ++g) {
        const float* pg = scores.data() + g * n;
        float* o = out_data + (b * H + h * group + g) * D;
        for (int64_t c = 0; c < D; c += kChunk) {
          const int64_t width = std::min<int64_t>(kChunk, D - c);
          float acc[2][kChunk] = {};  // even and odd keys: two independent chains of FMAs
          for (int64_t j = j_first; j < j_end; ++j) {
            const float* v = block_start(j) + kv_value + c;
            const int64_t t0 = std::max<int64_t>(first - j * block_size, 0);
            const int64_t t1 = std::min<int64_t>(ctx - j * block_size, block_size);
            const float* pj = pg + j * block_size - first;
            if (width == kChunk) {
              weighted_rows<kChunk>(acc[0], acc[1], pj, v, t0, t1, D);
            } else {  // the last, partial chunk of a head_dim that is not a multiple of kChunk
              weighted_rows_partial(acc[0], acc[1], pj, v, t0, t1, D, width);
            }
          }
          for (int64_t l = 0; l < width; ++l) o[c + l] = acc[0][l] + acc[1][l];
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(kvbridge, m) {
  m.def("paged_decode_attention(Tensor q, Tensor kv, Tensor block_table, Tensor context_lens, "
        "int sliding_window, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvbridge, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
