// One-pass CPU versions of the small per-layer ops that torch runs as several passes, each a
// parallel region: RMSNorm (with the residual add before it), rotary embedding in place, the
// write of a step's K/V into the paged cache, and the MLP's SiLU(gate) * up. fp32 or bf16: every
// tensor of a call has one dtype; bf16 values are widened to fp32 as they are read, all arithmetic
// is fp32, and a bf16 result is rounded (to nearest even) where torch's bf16 path rounds, so the
// bf16 ops give torch's bf16 results (RMSNorm: the normalised row rounded, then times the weight;
// the residual add rounded before the norm). With AVX-512 the bf16 loops are intrinsics rounding by
// vcvtneps2bf16: within 1 bf16 ulp of torch's, subnormal results flushed; with AVX2 + FMA 8-lane
// intrinsics rounding in integer arithmetic (vec_avx2.h). They run on the calling thread unless a tensor is
// large (kSerialBelow elements), so a decode step's [batch, hidden] rows wake no OpenMP threads.
// Registered in the build's op namespace (KVBRIDGE_OPS) (paged_decode.cpp defines it);
// kvbridge/engine/layers/cpu_kernels.py builds and loads them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec_avx2.h"
#include "vec_avx512.h"
#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using kvbridge::bf16;
using kvbridge::round_to;
using kvbridge::store_scalar;
using kvbridge::to_float;

constexpr int64_t kSerialBelow = 1 << 16;  // elements; below this one thread does the whole op

int64_t grain(int64_t rows, int64_t row_elems) {
  return rows * row_elems < kSerialBelow ? rows : std::max<int64_t>(1, kSerialBelow / std::max<int64_t>(1, row_elems));
}

bool is_float_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && is_float_or_bf16(t), name, " must be a float32 or bfloat16 CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* what) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), what, " must be all float32 or all bfloat16, got ",
              a.scalar_type(), " and ", b.scalar_type());
}

// Calls body.template operator()<T>() with T = float or bf16, after x's dtype.
template <typename Body>
void dispatch(const at::Tensor& x, Body&& body) {
  if (x.scalar_type() == at::kBFloat16) {
    body(static_cast<bf16*>(nullptr));
  } else {
    body(static_cast<float*>(nullptr));
  }
}

template <typename T>
T* ptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}


#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// The vector forms of the bf16 rows' loops, in one 16- or 8-lane abstraction (V): AVX-512 (16
// lanes, rounded by kvbridge::to_bf16_16: subnormal results flush to zero with AVX-512 BF16) or
// AVX2 + FMA (8 lanes, vec_avx2.h: widened by shifts and rounded in integer arithmetic, the CPU
// having no bf16 instruction). fp32 arithmetic. The compiler's vectorisation of the scalar forms
// below left bf16 rows 2-3x slower than memory (a select per rounding).
#define KVBRIDGE_SIMD 1
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using V = __m512;
inline V widen(const uint16_t* p) { return kvbridge::widen16(p); }
inline void store_bf16(uint16_t* p, V x) { kvbridge::store_bf16_16(p, x); }
inline V round_bf16(V x) { return kvbridge::round_bf16_16(x); }
inline V vexp(V x) { return kvbridge::exp16(x); }
inline V recip(V x) { return kvbridge::reciprocal16(x); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vfmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vset1(float x) { return _mm512_set1_ps(x); }
inline V vzero() { return _mm512_setzero_ps(); }
inline float reduce(V v) { return _mm512_reduce_add_ps(v); }
inline V load_f(const float* p) { return _mm512_loadu_ps(p); }
inline void store_f(float* p, V x) { _mm512_storeu_ps(p, x); }
#else
constexpr int64_t kLanes = 8;
using V = __m256;
inline V widen(const uint16_t* p) { return kvbridge::widen8(p); }
inline void store_bf16(uint16_t* p, V x) { kvbridge::store_bf16_8(p, x); }
inline V round_bf16(V x) { return kvbridge::round_bf16_8(x); }
inline V vexp(V x) { return kvbridge::exp8(x); }
inline V recip(V x) { return _mm256_div_ps(_mm256_set1_ps(1.f), x); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vfmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vset1(float x) { return _mm256_set1_ps(x); }
inline V vzero() { return _mm256_setzero_ps(); }
inline float reduce(V v) { return kvbridge::reduce_add8(v); }
inline V load_f(const float* p) { return _mm256_loadu_ps(p); }
inline void store_f(float* p, V x) { _mm256_storeu_ps(p, x); }
#endif

// kLanes values of T as fp32 lanes and back (bf16 rounded), and a product rounded as T holds it.
inline V loadv(const float* p) { return load_f(p); }
inline V loadv(const bf16* p) { return widen(reinterpret_cast<const uint16_t*>(p)); }
inline void storev(float* p, V x) { store_f(p, x); }
inline void storev(bf16* p, V x) { store_bf16(reinterpret_cast<uint16_t*>(p), x); }
inline V roundv(V x, const float*) { return x; }
inline V roundv(V x, const bf16*) { return round_bf16(x); }

inline const uint16_t* bits(const bf16* p) { return reinterpret_cast<const uint16_t*>(p); }
inline uint16_t* bits(bf16* p) { return reinterpret_cast<uint16_t*>(p); }

// Sum of squares of the first nv (a multiple of kLanes) values.
inline float sum_squares_v(const bf16* x, int64_t nv) {
  V acc = vzero();
  for (int64_t i = 0; i < nv; i += kLanes) {
    const V v = widen(bits(x + i));
    acc = vfmadd(v, v, acc);
  }
  return reduce(acc);
}

// out[i] = round(x[i] * scale) * w[i], rounded, for the first nv values.
inline void scale_row_v(const bf16* x, const bf16* w, bf16* out, int64_t nv, float scale) {
  const V vs = vset1(scale);
  for (int64_t i = 0; i < nv; i += kLanes) {
    const V normed = round_bf16(vmul(widen(bits(x + i)), vs));
    store_bf16(bits(out + i), vmul(normed, widen(bits(w + i))));
  }
}
#endif

template <typename T>
void norm_row(const T* __restrict x, const T* __restrict w, T* __restrict out, int64_t n, float eps) {
#if KVBRIDGE_SIMD
  if constexpr (std::is_same_v<T, bf16>) {
    const int64_t nv = n / kLanes * kLanes;
    float sum = sum_squares_v(x, nv);
    for (int64_t i = nv; i < n; ++i) sum += to_float(x[i]) * to_float(x[i]);
    const float scale = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
    scale_row_v(x, w, out, nv, scale);
    for (int64_t j = nv; j < n; ++j) store_scalar(out + j, round_to(to_float(x[j]) * scale, out) * to_float(w[j]));
    return;
  }
#endif
  float lanes[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int64_t l = 0; l < 8; ++l) {
      const float v = to_float(x[i + l]);
      lanes[l] += v * v;
    }
  }
  for (int64_t l = 0; i < n; ++i, ++l) {
    const float v = to_float(x[i]);
    lanes[l] += v * v;
  }
  float sum = 0.f;
  for (float lane : lanes) sum += lane;
  const float scale = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t j = 0; j < n; ++j) {
    store_scalar(out + j, round_to(to_float(x[j]) * scale, out) * to_float(w[j]));
  }
}

void check_weight(const at::Tensor& weight, const at::Tensor& x, const char* what) {
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.scalar_type() == x.scalar_type() &&
              weight.size(0) == x.size(1), what, ": weight must be a contiguous [hidden] of x's dtype");
}

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm: x");
  check_weight(weight, x, "rms_norm");
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows, n}, x.options());
  const int64_t stride = x.stride(0);
  dispatch(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xd = ptr<T>(x);
    const T* wd = ptr<T>(weight);
    T* od = ptr<T>(out);
    at::parallel_for(0, rows, grain(rows, n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) norm_row(xd + r * stride, wd, od + r * n, n, static_cast<float>(eps));
    });
  });
  return out;
}

// residual += delta (in place), then rms_norm(residual): a decoder layer's add and norm in one pass.
at::Tensor add_rms_norm_(at::Tensor residual, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  check_rows(residual, "add_rms_norm_: residual");
  check_rows(delta, "add_rms_norm_: delta");
  check_same_dtype(residual, delta, "add_rms_norm_: residual and delta");
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == delta.sizes(),
              "add_rms_norm_: residual must be contiguous and shaped like delta");
  check_weight(weight, residual, "add_rms_norm_");
  const int64_t rows = residual.size(0), n = residual.size(1);
  at::Tensor out = at::empty({rows, n}, residual.options());
  const int64_t dstride = delta.stride(0);
  dispatch(residual, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* hd = ptr<T>(residual);
    const T* dd = ptr<T>(delta);
    const T* wd = ptr<T>(weight);
    T* od = ptr<T>(out);
    at::parallel_for(0, rows, grain(rows, n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        T* __restrict h = hd + r * n;
        const T* __restrict d = dd + r * dstride;
        int64_t j = 0;
#if KVBRIDGE_SIMD
        if constexpr (std::is_same_v<T, bf16>) {
          for (; j + kLanes <= n; j += kLanes) {
            store_bf16(bits(h + j), vadd(widen(bits(h + j)), widen(bits(d + j))));
          }
        }
#endif
        for (; j < n; ++j) store_scalar(h + j, to_float(h[j]) + to_float(d[j]));
        norm_row(h, wd, od + r * n, n, static_cast<float>(eps));
      }
    });
  });
  return out;
}

template <typename T>
void silu_mul_row(const T* __restrict gate, const T* __restrict up, T* __restrict out, int64_t n) {
#if KVBRIDGE_SIMD
  // fp32 and bf16 in vector intrinsics. AVX-512, 16 lanes at a time: bf16 roundings by
  // vcvtneps2bf16 (subnormal results flush to zero), 1 / (1 + e^-g) by a refined reciprocal
  // instead of a division, the exp's range by vscalefps; AVX2, 8 lanes: integer rounding, a
  // division, vector_exp's clamps. Faster than the loops below, which the compiler vectorises but
  // which stay arithmetic-bound (benchmarks/isa_paths.py).
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const V g = loadv(gate + i);
    const V e = vexp(vsub(vzero(), g));
    const V silu = roundv(vmul(g, recip(vadd(vset1(1.f), e))), out);
    storev(out + i, vmul(silu, loadv(up + i)));
  }
  gate += i;
  up += i;
  out += i;
  n -= i;
#endif
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (1.f + kvbridge::vector_exp(-gate[i])) * up[i];
  } else {
    // bf16: a chunk of gate and up widened into fp32 buffers first, so the SiLU loop is plain fp32
    // arithmetic over unaliased arrays (it vectorises; element by element from bf16 it did not, and
    // ran at 1.4x torch's two bf16 ops). SiLU(gate) is rounded to bf16 before the product, as torch's.
    constexpr int64_t kChunk = 256;
    alignas(64) float g[kChunk], u[kChunk];
    for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
      const int64_t m = std::min(kChunk, n - i0);
      int64_t i = 0;
      for (; i + kvbridge::kVec <= m; i += kvbridge::kVec) {
        kvbridge::store(g + i, kvbridge::load(gate + i0 + i));
        kvbridge::store(u + i, kvbridge::load(up + i0 + i));
      }
      for (; i < m; ++i) {
        g[i] = to_float(gate[i0 + i]);
        u[i] = to_float(up[i0 + i]);
      }
      for (int64_t i = 0; i < m; ++i) g[i] = round_to(g[i] / (1.f + kvbridge::vector_exp(-g[i])), out) * u[i];
      for (int64_t i = 0; i < m; ++i) store_scalar(out + i0 + i, g[i]);
    }
  }
}

// gate_up [T, 2 * I] (gate then up, as the fused projection writes them) -> SiLU(gate) * up [T, I]:
// one pass instead of torch's three (SiLU, product, and the temporaries in between).
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_and_mul: gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_and_mul: gate_up must have an even number of columns");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, gate_up.options());
  const int64_t stride = gate_up.stride(0);
  dispatch(gate_up, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* gd = ptr<T>(gate_up);
    T* od = ptr<T>(out);
    at::parallel_for(0, rows, grain(rows, n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) silu_mul_row(gd + r * stride, gd + r * stride + n, od + r * n, n);
    });
  });
  return out;
}

// In place on x [T, heads, head_dim] (head_dim contiguous; any token and head strides): the first
// rope_dim dims of each head become x * cos + rotate_half(x) * sin, where signed_sin carries
// rotate_half's sign (RotaryEmbedding's tables: cos and signed_sin [T, 1, rope_dim] rows, of x's
// dtype). In bf16 x * cos is rounded first, then the sum once, as torch's addcmul.
void rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& signed_sin) {
  TORCH_CHECK(x.device().is_cpu() && is_float_or_bf16(x) && x.dim() == 3 && x.stride(2) == 1,
              "rotary_: x must be a float32 or bfloat16 CPU [T, heads, head_dim] with head_dim contiguous");
  const int64_t tokens = x.size(0), heads = x.size(1), rope = cos.size(-1);
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && signed_sin.scalar_type() == x.scalar_type() &&
              cos.is_contiguous() && signed_sin.is_contiguous() && cos.numel() == tokens * rope &&
              signed_sin.numel() == tokens * rope,
              "rotary_: cos and signed_sin must be contiguous, of x's dtype, with rope_dim values per token");
  TORCH_CHECK(rope % 2 == 0 && rope <= x.size(2), "rotary_: rope_dim must be even and <= head_dim");
  const int64_t half = rope / 2;
  const int64_t ts = x.stride(0), hs = x.stride(1);
  dispatch(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* xd = ptr<T>(x);
    const T* cd = ptr<T>(cos);
    const T* sd = ptr<T>(signed_sin);
#if KVBRIDGE_SIMD
    {  // fp32 and bf16 in vector intrinsics, where a half of the rotated dims is whole vectors
      if (half % kLanes == 0) {
        at::parallel_for(0, tokens, grain(tokens, heads * rope), [&](int64_t begin, int64_t end) {
          for (int64_t t = begin; t < end; ++t) {
            const T* c = cd + t * rope;
            const T* s = sd + t * rope;
            for (int64_t h = 0; h < heads; ++h) {
              T* v = xd + t * ts + h * hs;
              for (int64_t i = 0; i < half; i += kLanes) {
                const V a = loadv(v + i), b = loadv(v + i + half);
                const V first = vfmadd(b, loadv(s + i), roundv(vmul(a, loadv(c + i)), v));
                const V second = vfmadd(a, loadv(s + i + half), roundv(vmul(b, loadv(c + i + half)), v));
                storev(v + i, first);
                storev(v + i + half, second);
              }
            }
          }
        });
        return;
      }
    }
#endif
    at::parallel_for(0, tokens, grain(tokens, heads * rope), [&](int64_t begin, int64_t end) {
      // One token's tables and one head's values widened to fp32 once, so the rotation's loop is
      // plain fp32 arithmetic over unaliased buffers (it vectorises; bf16 element by element did not).
      std::vector<float> buffers(3 * rope);
      float* __restrict c = buffers.data();
      float* __restrict s = c + rope;
      float* __restrict a = s + rope;
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t i = 0; i < rope; ++i) {
          c[i] = to_float(cd[t * rope + i]);
          s[i] = to_float(sd[t * rope + i]);
        }
        for (int64_t h = 0; h < heads; ++h) {
          T* __restrict v = xd + t * ts + h * hs;
          for (int64_t i = 0; i < rope; ++i) a[i] = to_float(v[i]);
          for (int64_t i = 0; i < half; ++i) {
            store_scalar(v + i, round_to(a[i] * c[i], v) + a[i + half] * s[i]);
            store_scalar(v + i + half, round_to(a[i + half] * c[i + half], v) + a[i] * s[i + half]);
          }
        }
      }
    });
  });
}

// kv_layer [blocks, 2, block_size, kv_heads, head_dim] (the cache's strided layer view) at
// slot_mapping[t] (block * block_size + offset) gets k[t] (index 0) and v[t] (index 1).
void write_kv_(at::Tensor kv_layer, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_layer.device().is_cpu() && is_float_or_bf16(kv_layer) && kv_layer.dim() == 5 &&
              kv_layer.size(1) == 2 && kv_layer.stride(4) == 1,
              "write_kv_: kv_layer must be a float32 or bfloat16 CPU [blocks, 2, block_size, kv_heads, head_dim]");
  const int64_t num_blocks = kv_layer.size(0), block_size = kv_layer.size(2);
  const int64_t heads = kv_layer.size(3), dim = kv_layer.size(4);
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->scalar_type() == kv_layer.scalar_type() && t->dim() == 3 && t->size(1) == heads &&
                t->size(2) == dim && t->stride(2) == 1, "write_kv_: k and v must be [T, kv_heads, head_dim] of the "
                "cache's dtype");
  }
  const int64_t tokens = k.size(0);
  TORCH_CHECK(v.size(0) == tokens && slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
              slot_mapping.is_contiguous() && slot_mapping.size(0) == tokens,
              "write_kv_: one int64 slot per token");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_blocks * block_size, "write_kv_: slot ", slots[t],
                " outside the cache's ", num_blocks * block_size, " slots");
  }
  const int64_t s_block = kv_layer.stride(0), s_value = kv_layer.stride(1), s_token = kv_layer.stride(2);
  const int64_t s_head = kv_layer.stride(3);
  const int64_t k_t = k.stride(0), k_h = k.stride(1), v_t = v.stride(0), v_h = v.stride(1);
  dispatch(kv_layer, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* cache = ptr<T>(kv_layer);
    const T* kd = ptr<T>(k);
    const T* vd = ptr<T>(v);
    at::parallel_for(0, tokens, grain(tokens, 2 * heads * dim), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        T* base = cache + (slots[t] / block_size) * s_block + (slots[t] % block_size) * s_token;
        for (int64_t h = 0; h < heads; ++h) {
          std::copy(kd + t * k_t + h * k_h, kd + t * k_t + h * k_h + dim, base + h * s_head);
          std::copy(vd + t * v_t + h * v_h, vd + t * v_t + h * v_h + dim, base + s_value + h * s_head);
        }
      }
    });
  });
}

}  // namespace

KVBRIDGE_LIBRARY_FRAGMENT(KVBRIDGE_OPS, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) residual, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor signed_sin) -> ()");
  m.def("write_kv_(Tensor(a!) kv_layer, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
}

KVBRIDGE_LIBRARY_IMPL(KVBRIDGE_OPS, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("rotary_", &rotary_);
  m.impl("write_kv_", &write_kv_);
  m.impl("silu_and_mul", &silu_and_mul);
}
