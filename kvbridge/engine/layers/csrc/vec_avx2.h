// 8-lane AVX2 + FMA forms of vec_avx512.h's helpers, for builds without AVX-512 (KVBRIDGE_CPU_ISA=avx2:
// AMD Zen 2/3, client Intel parts). bf16 is widened by a zero-extend and a shift and narrowed by
// integer rounding (nearest even; a NaN stays a quiet NaN; subnormals kept, as vec_math.h's
// bf16_bits), there being no bf16 instruction to do it.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

#include <cstdint>

namespace kvbridge {

// 8 bf16 (their bits) widened to fp32: exact.
inline __m256 widen8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 8 lanes rounded to bf16 (bf16_bits on 8 lanes), as 8 bf16 in an xmm.
inline __m128i to_bf16_8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i high = _mm256_srli_epi32(u, 16);
  const __m256i lsb = _mm256_and_si256(high, _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const __m256i words = _mm256_blendv_epi8(rounded, _mm256_or_si256(high, _mm256_set1_epi32(0x40)), nan);
  // Every lane is below 0x10000, so the unsigned saturating pack keeps it; the pack works per
  // 128-bit half, the permute puts the two halves' words together.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(words, words), 0x08);
  return _mm256_castsi256_si128(packed);
}

// x rounded to bf16 and widened back.
inline __m256 round_bf16_8(__m256 x) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(to_bf16_8(x)), 16));
}

// x rounded to bf16 (to_bf16_8) and stored as 8 bf16.
inline void store_bf16_8(uint16_t* p, __m256 x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16_8(x)); }

// e^x on 8 lanes: vector_exp's reduction, polynomial, clamps and results (+inf above 88, 0 below
// -87, NaN stays NaN).
inline __m256 exp8(__m256 x) {
  const __m256 c = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(_mm256_set1_ps(-87.0f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(c, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), c));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  const __m256 over = _mm256_cmp_ps(x, _mm256_set1_ps(88.0f), _CMP_GT_OQ);
  const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  const __m256 clamped = _mm256_andnot_ps(under, _mm256_blendv_ps(e, _mm256_set1_ps(__builtin_inff()), over));
  return _mm256_blendv_ps(clamped, x, nan);
}

// The sum of 8 lanes.
inline float reduce_add8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace kvbridge

#endif
