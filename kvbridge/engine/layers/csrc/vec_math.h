// Small math helpers shared by kvbridge's CPU kernels, written so that the compiler vectorises the
// loops that call them (no libm call inside a loop).
#pragma once

#include <cstdint>
#include <limits>

namespace kvbridge {

// e^x: x = n ln2 + r with |r| <= ln2/2, e^r by Cephes' degree-7 polynomial (about 1 ulp), 2^n put
// into the exponent bits. The reduction is clamped to [-87, 88], where 2^n stays a normal float;
// above 88 the result is +inf (so SiLU of a very negative gate is -0, as torch's), below -87 it is 0
// (the true value is under 1.7e-38; e^-inf is 0); NaN stays NaN.
inline float vector_exp(float x) {
  const float c = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest (1.5 x 2^23)
  const float r = (c - n * 0.693359375f) + n * 2.12194440e-4f;  // ln2 in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  const float e = p * __builtin_bit_cast(float, bits);
  return x > 88.0f ? std::numeric_limits<float>::infinity() : (x < -87.0f ? 0.0f : e);
}

}  // namespace kvbridge
