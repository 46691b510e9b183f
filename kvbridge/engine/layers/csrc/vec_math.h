// Small vector and math helpers shared by kvbridge's CPU kernels; vector_exp is written so that the
// compiler vectorises the loops that call it (no libm call inside a loop).
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>

// The op namespace this build registers in: `kvbridge_<isa>` (cpu_kernels.py passes
// -DKVBRIDGE_OPS=kvbridge_avx2 and so on), so that the builds of several ISAs load into one process
// (tests, benchmarks) without colliding. The wrappers expand the name before torch pastes it.
#ifndef KVBRIDGE_OPS
#define KVBRIDGE_OPS kvbridge
#endif
#define KVBRIDGE_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define KVBRIDGE_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define KVBRIDGE_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

namespace kvbridge {

// 16 floats as one value: a zmm register with AVX-512, two ymm with AVX2 (GCC's vector extension;
// the compiler picks the instructions for the -march it builds for). aligned(4): `load` and `store`
// may be unaligned.
typedef float vfloat __attribute__((vector_size(64), aligned(4)));
constexpr int64_t kVec = 16;  // floats in a vfloat

// Loads and stores through an under-aligned, may-alias view of the floats (as the intrinsics' own
// __m256_u): the compiler emits unaligned vector moves. A memcpy into a local vector instead was
// expanded, for the AVX2 build, into 16-byte pieces stored to the stack and reloaded whole: a
// store-forwarding stall on every load, which left the avx2 build's attention kernels 5-20x slower
// than the avx512 build's on one CPU (benchmarks/README.md, isa_paths).
typedef float vfloat_u __attribute__((vector_size(64), aligned(4), may_alias));

inline vfloat load(const float* p) { return *reinterpret_cast<const vfloat_u*>(p); }

inline void store(float* p, vfloat v) { *reinterpret_cast<vfloat_u*>(p) = v; }

// bfloat16 as stored (the high half of an fp32): the attention kernels read bf16 K/V and queries
// through these and compute in fp32. Widening is exact; narrowing rounds to nearest even, as torch.
struct bf16 {
  uint16_t bits;
};

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return __builtin_bit_cast(float, static_cast<uint32_t>(x.bits) << 16); }

// x rounded to bf16's bits. Branch-free (a select, not a jump), so loops that narrow vectorise.
inline uint16_t bf16_bits(float x) {
  const uint32_t u = __builtin_bit_cast(uint32_t, x);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x40u;  // NaN stays a (quiet) NaN
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

inline void store_scalar(float* p, float x) { *p = x; }
inline void store_scalar(bf16* p, float x) { p->bits = bf16_bits(x); }

// x as a value of T holds it: fp32 as is, bf16 rounded (what torch's op of that dtype leaves).
inline float round_to(float x, const float*) { return x; }
inline float round_to(float x, const bf16*) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(bf16_bits(x)) << 16);
}

// 16 bf16 widened to 16 floats (a zero-extend and a shift: vpmovzxwd + vpslld with AVX-512).
inline vfloat load(const bf16* p) {
  typedef uint16_t vhalf __attribute__((vector_size(32), aligned(2), may_alias));
  typedef uint32_t vword __attribute__((vector_size(64)));
  const vword w = __builtin_convertvector(*reinterpret_cast<const vhalf*>(p), vword) << 16;
  return reinterpret_cast<const vfloat&>(w);
}

inline vfloat splat(float x) { return vfloat{} + x; }

// Lanes i and i + half added, half = 8, 4, 2, 1 (vector shuffles; a scalar tree was 1.6x slower
// for the whole decode kernel): a fixed order, so the result does not depend on the build.
inline float hsum(vfloat v) {
#if defined(__clang__)
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
#else
  typedef int32_t vint __attribute__((vector_size(64)));
  v += __builtin_shuffle(v, vint{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v += __builtin_shuffle(v, vint{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  v += __builtin_shuffle(v, vint{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
#endif
  return v[0] + v[1];
}

// The widest vector the build's registers hold: vnat, kNat floats (a zmm with AVX-512, a ymm with
// AVX2), and how many of them the register file holds (kNatRegs). vfloat is 16 floats whatever the
// build, right for AVX-512; with AVX2 a tile of 16 vfloat accumulators is 32 ymm, twice the register
// file, and spills on every FMA. Register tiles are therefore written in vnat, sized by kNatRegs.
#if defined(__AVX512F__)
constexpr int64_t kNat = 16;
constexpr int64_t kNatRegs = 32;
typedef float vnat __attribute__((vector_size(64), aligned(4)));
#else
constexpr int64_t kNat = 8;
constexpr int64_t kNatRegs = 16;
typedef float vnat __attribute__((vector_size(32), aligned(4)));
#endif

typedef float vnat_u __attribute__((vector_size(kNat * 4), aligned(4), may_alias));

inline vnat load_nat(const float* p) { return *reinterpret_cast<const vnat_u*>(p); }

// kNat bf16 widened to floats (a zero-extend and a shift).
inline vnat load_nat(const bf16* p) {
  typedef uint16_t vhalf __attribute__((vector_size(kNat * 2), aligned(2), may_alias));
  typedef uint32_t vword __attribute__((vector_size(kNat * 4)));
  const vword w = __builtin_convertvector(*reinterpret_cast<const vhalf*>(p), vword) << 16;
  return reinterpret_cast<const vnat&>(w);
}

inline void store_nat(float* p, vnat v) { *reinterpret_cast<vnat_u*>(p) = v; }

inline vnat splat_nat(float x) { return vnat{} + x; }

// The lanes' sum in a fixed order (halves added until one pair is left).
inline float hsum_nat(vnat v) {
#if defined(__AVX512F__)
  return hsum(v);
#elif defined(__clang__)
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  return v[0] + v[1];
#else
  typedef int32_t vint __attribute__((vector_size(32)));
  v += __builtin_shuffle(v, vint{4, 5, 6, 7, 0, 1, 2, 3});
  v += __builtin_shuffle(v, vint{2, 3, 0, 1, 6, 7, 4, 5});
  return v[0] + v[1];
#endif
}

// The sum of the 16 floats at p in hsum's order (lanes i and i + 8 first, then halves): every build
// adds them alike, so the kernels' results do not depend on the build's vector width.
inline float sum16(const float* p) {
#if defined(__AVX512F__)
  return hsum(load(p));
#else
  return hsum_nat(load_nat(p) + load_nat(p + kNat));
#endif
}

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
