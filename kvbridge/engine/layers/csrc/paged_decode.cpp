// Decode attention that reads K/V in place from kvbridge's paged cache (CPU, fp32 or bf16: a bf16
// cache and query are widened to fp32 as they are read, and every sum is fp32).
//
// One query token per sequence. For each (sequence, KV head) the kernel walks the sequence's
// blocks in the block table once, flash-decoding style: a block's keys are scored for the KV
// head's query heads, the running softmax (max and sum per query head) is updated, and the
// block's values are added in, weighted. Each byte of K and V is read once per step and nothing
// is gathered into a temporary tensor; the next block's K and V are prefetched into L2 while a
// block is scored (prefetch_block). In bf16 with head size 64 or 128 on a CPU with AVX-512 BF16
// (decode_item_bf16) the keys are scored 16 at a time by vdpbf16ps straight from the bf16 cache and
// the values added for all of a KV head's query heads per widened row: 1.7x the widening path's
// arithmetic (16 x 200 tokens of SmolLM2's heads, cache-hot). Registered
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
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define KVBRIDGE_DP_BF16 1  // bf16 scores by vdpbf16ps (AVX-512 BF16), see score_chunk_bf16
#endif

namespace {

using kvbridge::bf16;
using kvbridge::hsum;
using kvbridge::hsum_nat;
using kvbridge::kNat;
using kvbridge::load_nat;
using kvbridge::splat_nat;
using kvbridge::store_nat;
using kvbridge::vnat;
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
// of vector FMAs (one key at a time waits on each FMA's latency; the scores were most of the time),
// in the build's own vectors (vnat), 8 keys with AVX-512, 4 with AVX2, so that the accumulators stay
// in registers. Each key sums the lanes of 16-float chunks as one vfloat would (with AVX2 a chunk's
// halves in two accumulators, added as sum16 adds them): the same result in every build.
constexpr int64_t kTile = kvbridge::kNatRegs >= 32 ? 8 : 4;
constexpr int64_t kHalves = kVec / kNat;  // vnats per 16 floats: 1 with AVX-512, 2 with AVX2

template <typename T>
inline void dot_tile(const float* __restrict__ q, const T* __restrict__ k, int64_t D, float* out) {
  vnat acc[kTile][kHalves] = {};
  for (int64_t d = 0; d < D; d += kVec) {
    for (int64_t h = 0; h < kHalves; ++h) {
      const vnat qv = load_nat(q + d + h * kNat);
      for (int64_t i = 0; i < kTile; ++i) acc[i][h] += qv * load_nat(k + i * D + d + h * kNat);
    }
  }
  for (int64_t i = 0; i < kTile; ++i) {
    vnat lanes = acc[i][0];
    for (int64_t h = 1; h < kHalves; ++h) lanes += acc[i][h];
    out[i] = hsum_nat(lanes);
  }
}

// a[0 .. C * kVec) += sum over t < n of p[t] * v[t * D ..]: even and odd keys in two chains of the
// build's own vectors, in registers, so the accumulator is loaded and stored once per block. Where
// the two chains of C * kVec columns would not fit the registers (AVX2 at C = 4), the columns in
// halves: each column's sum is its own, so the result is the same.
template <int64_t C, typename T>
inline void add_weighted_vectors(float* __restrict__ a, const float* __restrict__ p, const T* __restrict__ v,
                                 int64_t n, int64_t D) {
  constexpr int64_t CN = C * kVec / kNat;
  if constexpr (C > 1 && 2 * CN + 2 > kvbridge::kNatRegs) {
    add_weighted_vectors<C / 2>(a, p, v, n, D);
    add_weighted_vectors<C - C / 2>(a + C / 2 * kVec, p, v + C / 2 * kVec, n, D);
  } else {
    vnat x0[CN], x1[CN];
    for (int64_t c = 0; c < CN; ++c) x0[c] = load_nat(a + c * kNat), x1[c] = vnat{};
    int64_t t = 0;
    for (; t + 1 < n; t += 2) {
      const vnat p0 = splat_nat(p[t]), p1 = splat_nat(p[t + 1]);
      for (int64_t c = 0; c < CN; ++c) {
        x0[c] += p0 * load_nat(v + t * D + c * kNat);
        x1[c] += p1 * load_nat(v + (t + 1) * D + c * kNat);
      }
    }
    if (t < n) {
      const vnat p0 = splat_nat(p[t]);
      for (int64_t c = 0; c < CN; ++c) x0[c] += p0 * load_nat(v + t * D + c * kNat);
    }
    for (int64_t c = 0; c < CN; ++c) store_nat(a + c * kNat, x0[c] + x1[c]);
  }
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

// One query head's running softmax over n new scores p (in place: p becomes e^(score - m_new)):
// m and l are its running maximum and sum of e^(score - m), acc its D output sums; a run with a
// higher maximum rescales l and acc by e^(m_old - m_new) (< 1: the earlier keys' share shrinks).
inline void softmax_update(float* p, int64_t n, float& m, float& l, float* acc, int64_t D) {
  float run_max = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) run_max = std::max(run_max, p[t]);
  const float m_new = std::max(m, run_max);
  float sum = 0.f;
  for (int64_t t = 0; t < n; ++t) {
    p[t] = kvbridge::vector_exp(p[t] - m_new);
    sum += p[t];
  }
  if (m_new > m) {
    const float rescale = kvbridge::vector_exp(m - m_new);
    l *= rescale;
    for (int64_t d = 0; d < D; ++d) acc[d] *= rescale;
    m = m_new;
  }
  l += sum;
}

// One (sequence, KV head) item's keys in the paged cache: `walk` calls on_block(k, v, t_begin,
// t_end) for each block from the one holding key `first` to the one holding key ctx - 1 (K at k,
// V at v, the block's rows t_begin .. t_end - 1 in range), prefetching the next block first (after
// the last, next_first: the next item's first block, if any).
template <typename T>
struct ItemBlocks {
  const T* kv_data;
  const int64_t* row;  // the sequence's block table
  int64_t kv_block, kv_value, head_offset, block_size, first, ctx;
  const T* next_first;

  const T* block_start(int64_t j) const { return kv_data + row[j] * kv_block + head_offset; }

  template <typename OnBlock>
  void walk(int64_t D, OnBlock&& on_block) const {
    const int64_t j_first = first / block_size, j_end = (ctx + block_size - 1) / block_size;
    for (int64_t j = j_first; j < j_end; ++j) {
      const T* k = block_start(j);
      if (j + 1 < j_end) {
        prefetch_block(block_start(j + 1), kv_value, block_size * D);
      } else if (next_first != nullptr) {
        prefetch_block(next_first, kv_value, block_size * D);
      }
      on_block(k, k + kv_value, std::max<int64_t>(first - j * block_size, 0),
               std::min<int64_t>(ctx - j * block_size, block_size));
    }
  }
};

// out[g * D + d] = acc[g * D + d] / l[g] for the group's heads, in out's type.
template <typename T>
inline void store_normalized(T* out, const float* acc, const float* l, int64_t group, int64_t D) {
  for (int64_t g = 0; g < group; ++g) {
    const float inv = 1.f / l[g];
    for (int64_t d = 0; d < D; ++d) kvbridge::store_scalar(out + g * D + d, acc[g * D + d] * inv);
  }
}

#ifdef KVBRIDGE_DP_BF16
// The sums of the 16 lanes of each of a[0 .. 16), as one vector (lane t = the sum of a[t]): an
// add tree over unpacks and 128-bit shuffles, 33 instructions where 16 separate horizontal sums
// take over 100.
inline __m512 lane_sums16(const __m512* a) {
  __m512 u[4];  // u[i], 128-bit chunk c, position j: the sum of a[4i + j]'s lanes 4c .. 4c + 3
  for (int i = 0; i < 4; ++i) {
    const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a[4 * i], a[4 * i + 1]),
                                    _mm512_unpackhi_ps(a[4 * i], a[4 * i + 1]));
    const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a[4 * i + 2], a[4 * i + 3]),
                                    _mm512_unpackhi_ps(a[4 * i + 2], a[4 * i + 3]));
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1))),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1))));
  }
  const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(3, 1, 3, 1)));
}

constexpr int64_t kChunkKeys = 16;  // keys scored together: one vector of scores

// out[0 .. 16) = scale * (q . k[t * D ..]) for the keys of a chunk, q and k bf16, D = 32 * C: each
// key's dot product is C vdpbf16ps (32 bf16 products a step, summed in fp32; a product of two
// bf16 is exact in fp32), the keys in independent chains, then one add tree (lane_sums16) for all
// 16 instead of a horizontal sum per key. kFull: all 16 rows are read (the caller knows they lie
// in the block; lanes of rows past the keys it wants are ignored, as each lane is one row's sum);
// else only rows t < n, the other lanes 0.
template <int64_t C, bool kFull>
inline void score_chunk_bf16(const __m512bh* q, const bf16* __restrict__ k, int64_t n, float scale, float* out) {
  __m512 acc[kChunkKeys];
  const int64_t rows = kFull ? kChunkKeys : n;
  for (int64_t t = 0; t < kChunkKeys; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t c = 0; c < C; ++c) {
      acc[t] = _mm512_dpbf16_ps(acc[t], q[c], (__m512bh)_mm512_loadu_si512(k + t * 32 * C + c * 32));
    }
  }
  _mm512_storeu_ps(out, _mm512_mul_ps(lane_sums16(acc), _mm512_set1_ps(scale)));
}

// acc[r * D ..] += sum over t < n of p[r * kChunkKeys + t] * v[t * D ..] for the NH heads r of a
// pass, D = 16 * CV: each value row is widened once for all of them, the NH x CV sums stay in
// registers (NH * CV <= 16) across the chunk's keys.
template <int64_t CV, int64_t NH>
inline void add_values_bf16(float* __restrict__ acc, const float* __restrict__ p, const bf16* __restrict__ v,
                            int64_t n) {
  constexpr int64_t D = CV * kVec;
  vfloat x[NH][CV];
  for (int64_t r = 0; r < NH; ++r) {
    for (int64_t c = 0; c < CV; ++c) x[r][c] = load(acc + r * D + c * kVec);
  }
  for (int64_t t = 0; t < n; ++t) {
    vfloat row[CV];
    for (int64_t c = 0; c < CV; ++c) row[c] = load(v + t * D + c * kVec);
    for (int64_t r = 0; r < NH; ++r) {
      const vfloat pr = kvbridge::splat(p[r * kChunkKeys + t]);
      for (int64_t c = 0; c < CV; ++c) x[r][c] += pr * row[c];
    }
  }
  for (int64_t r = 0; r < NH; ++r) {
    for (int64_t c = 0; c < CV; ++c) store(acc + r * D + c * kVec, x[r][c]);
  }
}

// The group's heads in passes of up to 16 / CV (one value-row widening per key and pass).
template <int64_t CV>
inline void add_values_group(float* acc, const float* p, const bf16* v, int64_t n, int64_t group) {
  constexpr int64_t kMaxHeads = 16 / CV;
  constexpr int64_t D = CV * kVec;
  int64_t g = 0;
  for (; g + kMaxHeads <= group; g += kMaxHeads) add_values_bf16<CV, kMaxHeads>(acc + g * D, p + g * kChunkKeys, v, n);
  switch (group - g) {  // the rest, fewer than kMaxHeads
    case 3: if constexpr (kMaxHeads > 3) add_values_bf16<CV, 3>(acc + g * D, p + g * kChunkKeys, v, n); break;
    case 2: if constexpr (kMaxHeads > 2) add_values_bf16<CV, 2>(acc + g * D, p + g * kChunkKeys, v, n); break;
    case 1: if constexpr (kMaxHeads > 1) add_values_bf16<CV, 1>(acc + g * D, p + g * kChunkKeys, v, n); break;
    default: break;
  }
}

constexpr int64_t kMaxGroupDp = 32;  // query heads per KV head that decode_item_bf16 takes

// One (sequence, KV head) item at bf16, D = 32 * C (64 or 128): the same walk, running softmax and
// value sums as decode_into's, the block's keys taken 16 at a time: every query head of the group
// is scored (score_chunk_bf16) and its softmax updated, then the values are added for all heads
// at once (add_values_group). out: the item's first query head's output row.
template <int64_t C>
void decode_item_bf16(const bf16* q_item, int64_t q_head, const ItemBlocks<bf16>& blocks, int64_t group,
                      float scale, float* acc, bf16* out) {
  constexpr int64_t D = 32 * C;
  __m512bh q[kMaxGroupDp * C];
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t c = 0; c < C; ++c) q[g * C + c] = (__m512bh)_mm512_loadu_si512(q_item + g * q_head + c * 32);
  }
  float m[kMaxGroupDp], l[kMaxGroupDp];
  alignas(64) float p[kMaxGroupDp * kChunkKeys];
  std::fill(acc, acc + group * D, 0.f);
  std::fill(m, m + group, -std::numeric_limits<float>::infinity());
  std::fill(l, l + group, 0.f);
  const int64_t block_size = blocks.block_size;
  blocks.walk(D, [&](const bf16* k, const bf16* v, int64_t t_begin, int64_t t_end) {
    for (int64_t t0 = t_begin; t0 < t_end; t0 += kChunkKeys) {
      const int64_t n = std::min(kChunkKeys, t_end - t0);
      const bool full = t0 + kChunkKeys <= block_size;  // 16 rows inside the block: read them all
      for (int64_t g = 0; g < group; ++g) {
        float* pg = p + g * kChunkKeys;
        if (full) {
          score_chunk_bf16<C, true>(q + g * C, k + t0 * D, n, scale, pg);
        } else {
          score_chunk_bf16<C, false>(q + g * C, k + t0 * D, n, scale, pg);
        }
        softmax_update(pg, n, m[g], l[g], acc + g * D, D);
      }
      add_values_group<2 * C>(acc, p, v + t0 * D, n, group);
    }
  });
  store_normalized(out, acc, l, group, D);
}
#endif

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
      const ItemBlocks<T> blocks{kv_data, row, kv_block, kv_value, h * kv_head, block_size, first, ctx,
                                 item + 1 < end ? first_block(item + 1) : nullptr};
#ifdef KVBRIDGE_DP_BF16
      if constexpr (std::is_same_v<T, bf16>) {
        if ((D == 64 || D == 128) && group <= kMaxGroupDp) {
          bf16* o = out_data + (b * H + h * group) * D;
          if (D == 64) {
            decode_item_bf16<2>(q_item, q_head, blocks, group, softmax_scale, acc.data(), o);
          } else {
            decode_item_bf16<4>(q_item, q_head, blocks, group, softmax_scale, acc.data(), o);
          }
          continue;
        }
      }
#endif
      for (int64_t g = 0; g < group; ++g) {
        for (int64_t d = 0; d < D; ++d) q_scaled[g * D + d] = to_float(q_item[g * q_head + d]) * softmax_scale;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      blocks.walk(D, [&](const T* k, const T* v, int64_t t0, int64_t t1) {
        const int64_t n = t1 - t0;
        for (int64_t g = 0; g < group; ++g) {
          float* p = probs.data() + g * block_size;
          const float* qg = q_scaled.data() + g * D;
          int64_t t = 0;
          if (D % kVec == 0) {
            for (; t + kTile <= n; t += kTile) dot_tile(qg, k + (t0 + t) * D, D, p + t);
          }
          for (; t < n; ++t) p[t] = dot(qg, k + (t0 + t) * D, D);
          softmax_update(p, n, m[g], l[g], acc.data() + g * D, D);
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
      });
      store_normalized(out_data + (b * H + h * group) * D, acc.data(), l.data(), group, D);
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

KVBRIDGE_LIBRARY(KVBRIDGE_OPS, m) {
  m.def("paged_decode_attention(Tensor q, Tensor kv, Tensor block_table, Tensor context_lens, "
        "int sliding_window, float scale) -> Tensor");
}

KVBRIDGE_LIBRARY_IMPL(KVBRIDGE_OPS, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
