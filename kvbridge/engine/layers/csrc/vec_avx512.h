// 16-lane AVX-512 helpers for kernels whose hot loops the compiler does not vectorise well from
// vec_math.h's scalar forms (a reduction or a select in the loop). They are not all bit-exact
// copies of those forms: each says where it differs (range handling, subnormals, ulps). Only where
// the build targets AVX-512 (-march=native).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <cstdint>
#include <limits>

namespace kvbridge {

// e^x on 16 lanes: vector_exp's reduction and polynomial, 2^n applied by vscalefps, so the result
// over- and underflows as the true value does (+inf above 88.72, subnormals down to -103.3, then
// 0) instead of vector_exp's clamps at 88 and -87; NaN stays NaN. Within 2 ulp of e^x elsewhere.
inline __m512 exp16(__m512 x) {
  // Clamped so that n stays finite (NaN passes: max and min return their second operand on NaN).
  const __m512 c = _mm512_min_ps(_mm512_set1_ps(150.0f), _mm512_max_ps(_mm512_set1_ps(-150.0f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(c, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), c));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// 2^x on 16 lanes: x = n + f with |f| <= 1/2, 2^f by a degree-5 polynomial (relative error under
// 1e-7 before the fp32 rounding of its terms), 2^n applied by vscalefps (so the result over- and
// underflows as the true value does); x clamped below at -150 (0 there); NaN stays NaN. For a
// softmax, whose argument can be scaled by log2(e) with the scores' scale at no cost: no two-part
// ln 2 reduction, about half of exp16's instructions.
inline __m512 exp2_16(__m512 x) {
  const __m512 c = _mm512_max_ps(_mm512_set1_ps(-150.0f), x);  // NaN: max returns its second operand
  const __m512 n = _mm512_roundscale_ps(c, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(c, n);
  __m512 p = _mm512_set1_ps(1.3266970636e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6754599362e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5507425219e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022121727e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314694405e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000001192e+0f));
  return _mm512_scalef_ps(p, n);
}

// 16 bf16 (their bits) widened to fp32: exact.
inline __m512 widen16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 16 lanes rounded to bf16 (nearest even; a NaN stays a quiet NaN), as 16 bf16 in a ymm. With
// AVX-512 BF16 by vcvtneps2bf16 (one instruction), which also flushes subnormal inputs and results
// to zero (as oneDNN's bf16 outputs do); elsewhere bf16_bits on 16 lanes (keeps subnormals).
inline __m256i to_bf16_16(__m512 x) {
#if defined(__AVX512BF16__)
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
#else
  const __m512i u = _mm512_castps_si512(x);
  const __m512i high = _mm512_srli_epi32(u, 16);
  const __m512i lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(high, _mm512_set1_epi32(0x40))));
#endif
}

// x rounded to bf16 and widened back (round_to(x, bf16*) on 16 lanes, subnormals as to_bf16_16).
inline __m512 round_bf16_16(__m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_16(x)), 16));
}

// x rounded to bf16 (to_bf16_16) and stored as 16 bf16.
inline void store_bf16_16(uint16_t* p, __m512 x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_16(x)); }

// 1 / d on 16 lanes: vrcp14ps refined by one Newton step (within 2 ulp of the quotient; no vdivps,
// which issues once every 16 cycles). 1 / inf is 0 (the step would make it inf * 0 = NaN).
inline __m512 reciprocal16(__m512 d) {
  const __m512 y = _mm512_rcp14_ps(d);
  const __m512 refined = _mm512_fmadd_ps(_mm512_fnmadd_ps(d, y, _mm512_set1_ps(1.0f)), y, y);
  return _mm512_mask_mov_ps(refined, _mm512_cmp_ps_mask(_mm512_abs_ps(d), _mm512_set1_ps(std::numeric_limits<float>::infinity()), _CMP_EQ_OQ), y);
}

}  // namespace kvbridge

#endif
