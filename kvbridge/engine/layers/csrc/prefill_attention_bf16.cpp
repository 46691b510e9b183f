// Causal prefill attention in bf16, for every fresh prompt of a step in one call: each prompt
// attends over its own new K/V, written straight into the step's output rows. Two instruction sets
// share everything but the two products: AMX (Intel's tile matrix units) where the CPU has them,
// AVX-512 BF16 dot products (vdpbf16ps) on CPUs that have only those.
//
// Work item: (prompt, query head, tile of 16 query positions), scheduled dynamically, longest
// first. Per item, two passes: (1) the scores of the tile's 16 queries against every key up to its
// last position as bf16 dot products into fp32 (AMX: Q tile x K tile, over head dims 32 at a time;
// AVX-512: 8 queries x 32 keys of fp32 accumulators, one dim pair at a time); then an exact softmax
// per row (max, exp, sum in fp32; the probabilities rounded to bf16 for the second product, as
// torch's bf16 flash attention rounds them); (2) probabilities x V, 32 keys at a time on AMX (the
// 16 x 64 fp32 result held in four tiles across all keys), a key pair at a time in AVX-512 (4 rows
// x 64 dims of accumulators), then divided by the row sums and rounded to bf16 once. K and V are
// first repacked per (prompt, KV head) into AMX's pair-interleaved layout (a B tile: 16 rows of 16
// columns x 2 bf16 along the reduction), which is also the layout vdpbf16ps reads: one 512-bit row
// of a block is 16 keys' (or dims') pairs. The score row of a tile (16 x L fp32) stays in this
// thread's buffer: for prompts of L tokens, 64 L bytes.
//
// Built where the compiler targets AVX-512 BF16 (the build uses -march=native), the AMX path where
// it also targets AMX-BF16; `prefill_attention_bf16_isa()` says which runs here (2 AMX, 1 AVX-512
// BF16, 0 neither: the op raises and callers keep torch's SDPA). Registered as
// torch.ops.kvbridge.prefill_attention_bf16_; kvbridge/engine/layers/cpu_kernels.py builds and
// loads it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec_avx512.h"
#include "vec_math.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define KVBRIDGE_BF16_VEC 1
#include <immintrin.h>
#else
#define KVBRIDGE_BF16_VEC 0
#endif
#if KVBRIDGE_BF16_VEC && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define KVBRIDGE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define KVBRIDGE_AMX 0
#endif

namespace {

using bf16 = uint16_t;  // bfloat16's bits (kvbridge::bf16_bits rounds into them)

constexpr int64_t kRows = 16;     // queries per tile (an A tile's rows)
constexpr int64_t kScoreKeys = 16;  // keys per score tile (a C tile's columns)
constexpr int64_t kValueKeys = 32;  // keys per value step (an A tile's 32 bf16 columns)
constexpr int64_t kBlock = 512;   // bf16 in one packed B tile (16 rows x 64 bytes)

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// bf16 elements of one (prompt, KV head)'s packed K and V (pack_keys, pack_values) for len keys.
inline int64_t packed_keys(int64_t len, int64_t D) { return round_up(len, kScoreKeys) / kScoreKeys * (D / 32) * kBlock; }
inline int64_t packed_values(int64_t len, int64_t D) { return round_up(len, kValueKeys) / kValueKeys * (D / 16) * kBlock; }

struct Seq {
  int64_t start, len;
  int64_t k_off, v_off;  // where its packed K and V begin in the packed buffers (KV head 0's)
};

#if KVBRIDGE_AMX
// Linux gives a process AMX's tile state only on request (once; it holds for every thread).
bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kXtileData = 18;         // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows x 64 bytes; per thread (the configuration is thread state).
void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}
#endif  // KVBRIDGE_AMX

#if KVBRIDGE_BF16_VEC

// K of one (prompt, KV head) as score B tiles: block (kc, dc) holds keys kc*16 .. +15 over head
// dims dc*32 .. +31, element [r][c][i] = K[key kc*16 + c][dim dc*32 + 2r + i] (0 past the prompt):
// a key's dims stay in pairs, so each pair moves as one 32-bit word.
void pack_keys(bf16* dst, const bf16* k, int64_t k_tok, int64_t len, int64_t D) {
  const int64_t chunks = round_up(len, kScoreKeys) / kScoreKeys, dcs = D / 32;
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);  // [chunk][dc][r 16][c 16]
  for (int64_t kc = 0; kc < chunks; ++kc) {
    const int64_t n = std::min(kScoreKeys, len - kc * kScoreKeys);
    for (int64_t dc = 0; dc < dcs; ++dc) {
      uint32_t* block = out + (kc * dcs + dc) * (kBlock / 2);
      if (n < kScoreKeys) std::memset(block, 0, kBlock * sizeof(bf16));
      for (int64_t c = 0; c < n; ++c) {
        uint32_t pairs[16];
        std::memcpy(pairs, k + (kc * kScoreKeys + c) * k_tok + dc * 32, sizeof pairs);
        for (int64_t r = 0; r < 16; ++r) block[r * 16 + c] = pairs[r];
      }
    }
  }
}

// V of one (prompt, KV head) as value B tiles: block (vc, dc) holds keys vc*32 .. +31 for head dims
// dc*16 .. +15, element [r][c][i] = V[key vc*32 + 2r + i][dim dc*16 + c] (0 past the prompt): two
// keys' rows interleaved element by element, 16 dims at a time (each pair one 32-bit lane).
void pack_values(bf16* dst, const bf16* v, int64_t v_tok, int64_t len, int64_t D) {
  const int64_t chunks = round_up(len, kValueKeys) / kValueKeys, dcs = D / 16;
  for (int64_t vc = 0; vc < chunks; ++vc) {
    for (int64_t r = 0; r < 16; ++r) {
      const int64_t t0 = vc * kValueKeys + 2 * r;
      for (int64_t dc = 0; dc < dcs; ++dc) {
        bf16* row = dst + (vc * dcs + dc) * kBlock + r * 32;
        const __m512i a = t0 < len ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                         reinterpret_cast<const __m256i*>(v + t0 * v_tok + dc * 16)))
                                   : _mm512_setzero_si512();
        const __m512i b = t0 + 1 < len ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                             reinterpret_cast<const __m256i*>(v + (t0 + 1) * v_tok + dc * 16)))
                                       : _mm512_setzero_si512();
        _mm512_storeu_si512(row, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
      }
    }
  }
}

#if KVBRIDGE_AMX
// Scores of the 16 query rows at `qrows` (D bf16 each, q_ld apart) against keys 0 .. 16*chunks-1 into
// s[16][s_ld] fp32. Tiles: 0 and 3 = Q (its first 64 dims, kept for every chunk; further dims
// reloaded), 1 = K block, 2 and 5 = scores of alternate chunks (a store overlaps the next product);
// head size 64 has its own loop below, with a K tile per block.
void score_tile_amx(const bf16* qrows, int64_t q_ld, const bf16* kp, int64_t chunks, int64_t D, float* s, int64_t s_ld) {
  const int64_t dcs = D / 32;
  const int64_t q_stride = q_ld * sizeof(bf16), s_stride = s_ld * sizeof(float);
  _tile_loadd(0, qrows, q_stride);
  _tile_loadd(3, qrows + 32, q_stride);
  if (dcs == 2) {
    // Head dims 64: two chunks at a time, each with K tiles of its own (1 and 4; 6 and 7) and its
    // own scores (2; 5), so no tile load waits on the product still reading that tile (tiles are
    // not renamed: reusing one K tile serialised every load behind the product before it).
    int64_t kc = 0;
    for (; kc + 2 <= chunks; kc += 2) {
      const bf16* b0 = kp + kc * 2 * kBlock;
      const bf16* b1 = b0 + 2 * kBlock;
      _tile_zero(2);
      _tile_zero(5);
      _tile_loadd(1, b0, 64);
      _tile_loadd(4, b0 + kBlock, 64);
      _tile_loadd(6, b1, 64);
      _tile_loadd(7, b1 + kBlock, 64);
      _tile_dpbf16ps(2, 0, 1);
      _tile_dpbf16ps(5, 0, 6);
      _tile_dpbf16ps(2, 3, 4);
      _tile_dpbf16ps(5, 3, 7);
      _tile_stored(2, s + kc * kScoreKeys, s_stride);
      _tile_stored(5, s + (kc + 1) * kScoreKeys, s_stride);
    }
    if (kc < chunks) {
      const bf16* b0 = kp + kc * 2 * kBlock;
      _tile_zero(2);
      _tile_loadd(1, b0, 64);
      _tile_loadd(4, b0 + kBlock, 64);
      _tile_dpbf16ps(2, 0, 1);
      _tile_dpbf16ps(2, 3, 4);
      _tile_stored(2, s + kc * kScoreKeys, s_stride);
    }
    return;
  }
  for (int64_t kc = 0; kc < chunks; ++kc) {
    const bf16* blocks = kp + kc * dcs * kBlock;
    const bool odd = kc & 1;
    if (odd) {
      _tile_zero(5);
    } else {
      _tile_zero(2);
    }
    _tile_loadd(1, blocks, 64);
    if (odd) {
      _tile_dpbf16ps(5, 0, 1);
    } else {
      _tile_dpbf16ps(2, 0, 1);
    }
    _tile_loadd(1, blocks + kBlock, 64);
    if (odd) {
      _tile_dpbf16ps(5, 3, 1);
    } else {
      _tile_dpbf16ps(2, 3, 1);
    }
    for (int64_t dc = 2; dc < dcs; ++dc) {  // head dims past 64: Q's further tiles reloaded
      _tile_loadd(6, qrows + dc * 32, q_stride);
      _tile_loadd(1, blocks + dc * kBlock, 64);
      if (odd) {
        _tile_dpbf16ps(5, 6, 1);
      } else {
        _tile_dpbf16ps(2, 6, 1);
      }
    }
    if (odd) {
      _tile_stored(5, s + kc * kScoreKeys, s_stride);
    } else {
      _tile_stored(2, s + kc * kScoreKeys, s_stride);
    }
  }
}

// o[16][D] fp32 = p[16][p_ld] (bf16, keys 0 .. 32*chunks-1) x V. Tiles: 0 = P (32 keys),
// 1-3 = V blocks, 4-7 = the output's 64 columns of the current dim group.
void value_tile_amx(const bf16* p, int64_t p_ld, const bf16* vp, int64_t chunks, int64_t D, float* o) {
  const int64_t dcs = D / 16;
  for (int64_t g = 0; g < D / 64; ++g) {
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t vc = 0; vc < chunks; ++vc) {
      _tile_loadd(0, p + vc * kValueKeys, p_ld * sizeof(bf16));
      const bf16* blocks = vp + (vc * dcs + g * 4) * kBlock;
      // Three V tiles (1-3), so only the fourth block's load waits on a product still reading its tile.
      _tile_loadd(1, blocks, 64);
      _tile_loadd(2, blocks + kBlock, 64);
      _tile_loadd(3, blocks + 2 * kBlock, 64);
      _tile_dpbf16ps(4, 0, 1);
      _tile_dpbf16ps(5, 0, 2);
      _tile_dpbf16ps(6, 0, 3);
      _tile_loadd(1, blocks + 3 * kBlock, 64);
      _tile_dpbf16ps(7, 0, 1);
    }
    float* og = o + g * 64;
    _tile_stored(4, og, D * sizeof(float));
    _tile_stored(5, og + 16, D * sizeof(float));
    _tile_stored(6, og + 32, D * sizeof(float));
    _tile_stored(7, og + 48, D * sizeof(float));
  }
}

#endif  // KVBRIDGE_AMX

// A bf16 pair (two adjacent elements) as one 32-bit lane on all 16 lanes: vdpbf16ps's broadcast operand.
inline __m512bh pair16(const bf16* at) {
  uint32_t word;
  std::memcpy(&word, at, sizeof word);
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(word)));
}

inline __m512bh load_bh(const bf16* at) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(at)); }

// score_tile_amx's scores for kRowsVec query rows x C chunks of 16 keys (C 1 or 2) starting at chunk
// kc, with AVX-512 BF16: per dim pair, the rows' pairs broadcast against the chunks' packed K rows
// (a packed block's row rr is 16 keys' dims (32 dc + 2 rr, +1)).
constexpr int64_t kRowsVec = 8;
template <int C>
inline void score_rows_vec(const bf16* q0, int64_t q_ld, const bf16* kp, int64_t kc, int64_t D, float* s,
                           int64_t s_ld) {
  const int64_t dcs = D / 32;
  __m512 acc[kRowsVec][C];
  for (int i = 0; i < kRowsVec; ++i) {
    for (int c = 0; c < C; ++c) acc[i][c] = _mm512_setzero_ps();
  }
  const bf16* chunk = kp + kc * dcs * kBlock;
  for (int64_t p = 0; p < D / 2; ++p) {
    const int64_t off = (p >> 4) * kBlock + (p & 15) * 32;
    __m512bh keys[C];
    for (int c = 0; c < C; ++c) keys[c] = load_bh(chunk + c * dcs * kBlock + off);
    for (int i = 0; i < kRowsVec; ++i) {
      const __m512bh qp = pair16(q0 + i * q_ld + 2 * p);
      for (int c = 0; c < C; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], qp, keys[c]);
    }
  }
  for (int i = 0; i < kRowsVec; ++i) {
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(s + i * s_ld + (kc + c) * kScoreKeys, acc[i][c]);
  }
}

// score_tile_amx's result for the tile's first `rows` query rows (rounded up to 8; the rows past
// the prompt are zeros in the caller's copy), 32 keys at a time.
void score_tile_vec(const bf16* qrows, int64_t q_ld, int64_t rows, const bf16* kp, int64_t chunks, int64_t D,
                    float* s, int64_t s_ld) {
  for (int64_t r0 = 0; r0 < rows; r0 += kRowsVec) {
    const bf16* q0 = qrows + r0 * q_ld;
    float* s0 = s + r0 * s_ld;
    int64_t kc = 0;
    for (; kc + 2 <= chunks; kc += 2) score_rows_vec<2>(q0, q_ld, kp, kc, D, s0, s_ld);
    if (kc < chunks) score_rows_vec<1>(q0, q_ld, kp, kc, D, s0, s_ld);
  }
}

// value_tile_amx's o for 4 rows and the 64 head dims of group g, with AVX-512 BF16: per key pair,
// the rows' probability pairs broadcast against the pair's packed V rows (a packed block's row rr
// is 16 dims of keys 2 rr and 2 rr + 1).
constexpr int64_t kValueRowsVec = 4;
inline void value_rows_vec(const bf16* p, int64_t p_ld, const bf16* vp, int64_t chunks, int64_t D, int64_t g,
                           float* o) {
  const int64_t dcs = D / 16;
  __m512 acc[kValueRowsVec][4];
  for (int i = 0; i < kValueRowsVec; ++i) {
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  }
  for (int64_t m = 0; m < chunks * (kValueKeys / 2); ++m) {
    const bf16* block = vp + ((m >> 4) * dcs + g * 4) * kBlock + (m & 15) * 32;
    __m512bh values[4];
    for (int j = 0; j < 4; ++j) values[j] = load_bh(block + j * kBlock);
    for (int i = 0; i < kValueRowsVec; ++i) {
      const __m512bh pp = pair16(p + i * p_ld + 2 * m);
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], pp, values[j]);
    }
  }
  for (int i = 0; i < kValueRowsVec; ++i) {
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(o + i * D + g * 64 + j * 16, acc[i][j]);
  }
}

// value_tile_amx's o[16][D] for the tile's first `rows` rows (rounded up to 4; those rows of p are
// zeros past the prompt).
void value_tile_vec(const bf16* p, int64_t p_ld, int64_t rows, const bf16* vp, int64_t chunks, int64_t D, float* o) {
  for (int64_t g = 0; g < D / 64; ++g) {
    for (int64_t r0 = 0; r0 < rows; r0 += kValueRowsVec) value_rows_vec(p + r0 * p_ld, p_ld, vp, chunks, D, g, o + r0 * D);
  }
}

// The two products by instruction set: AMX tiles where built and asked for, AVX-512 BF16 otherwise.
inline void score_tile(bool amx, const bf16* qrows, int64_t q_ld, int64_t rows, const bf16* kp, int64_t chunks,
                       int64_t D, float* s, int64_t s_ld) {
#if KVBRIDGE_AMX
  if (amx) return score_tile_amx(qrows, q_ld, kp, chunks, D, s, s_ld);
#endif
  score_tile_vec(qrows, q_ld, rows, kp, chunks, D, s, s_ld);
}

inline void value_tile(bool amx, const bf16* p, int64_t p_ld, int64_t rows, const bf16* vp, int64_t chunks, int64_t D,
                       float* o) {
#if KVBRIDGE_AMX
  if (amx) return value_tile_amx(p, p_ld, vp, chunks, D, o);
#endif
  value_tile_vec(p, p_ld, rows, vp, chunks, D, o);
}

// One query row's softmax over its first `visible` scores: p[t] = e^(scale (row[t] - max)) rounded
// to bf16, 0 from `visible` to p_cols (a multiple of 16); returns the sum of the exps (fp32).
inline float softmax_row(const float* row, bf16* p, int64_t visible, int64_t p_cols, float scale) {
  // Keys past `visible` masked in registers: written into the row as scalars they made each
  // row's vector loads wait on the stores (about 300 cycles a row, more than its exps at 128 keys).
  const int64_t full = visible / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (visible - full)) - 1u);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 mx = neg_inf;
  for (int64_t t = 0; t < full; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(row + t));
  if (tail) mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(neg_inf, tail, row + full));
  // e^(scale * (s - max)) as 2^(s * scale log2 e - max * scale log2 e): one fused multiply-subtract.
  constexpr float kLog2e = 1.44269504088896341f;
  const __m512 vs = _mm512_set1_ps(scale * kLog2e), vm = _mm512_set1_ps(_mm512_reduce_max_ps(mx) * scale * kLog2e);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < full; t += 16) {
    const __m512 e = kvbridge::exp2_16(_mm512_fmsub_ps(_mm512_loadu_ps(row + t), vs, vm));
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + t), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
  }
  int64_t t = full;
  if (tail) {  // masked lanes: e^-inf = 0
    const __m512 e = _mm512_maskz_mov_ps(tail, kvbridge::exp2_16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(tail, row + t), vs, vm)));
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + t), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
    t += 16;
  }
  for (; t < p_cols; t += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + t), _mm256_setzero_si256());
  return _mm512_reduce_add_ps(sum);
}
#endif

}  // namespace

// Which product this build runs here: 2 AMX (AMX-BF16 compiled in and granted by the kernel), 1
// AVX-512 BF16, 0 neither (the op raises).
int64_t prefill_attention_bf16_isa() {
#if KVBRIDGE_AMX
  if (amx_permitted()) return 2;
#endif
  return KVBRIDGE_BF16_VEC ? 1 : 0;
}

// out [T, H*D] bf16 (rows written: the listed prompts' tokens), q [T, H, D], k and v [T, kv_heads,
// D] bf16 (D contiguous; any token and head strides); prompt j is tokens starts[j] .. starts[j] +
// lens[j] - 1, attending causally over its own keys. Query head h attends with KV head
// h / (H / kv_heads). D a multiple of 64, at most 256. isa: 2 AMX, 1 AVX-512 BF16 (at most
// prefill_attention_bf16_isa(): an AMX machine runs either, for tests and A/B runs).
void prefill_attention_bf16_(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& starts, const at::Tensor& lens, double scale, int64_t isa) {
  TORCH_CHECK(isa == 1 || isa == 2, "prefill_attention_bf16_: isa must be 1 (AVX-512 BF16) or 2 (AMX), got ", isa);
  TORCH_CHECK(isa <= prefill_attention_bf16_isa(), "prefill_attention_bf16_: this build or CPU has no ",
              isa == 2 ? "AMX-BF16" : "AVX-512 BF16");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && out.device().is_cpu(),
              "prefill_attention_bf16_: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "prefill_attention_bf16_: q, k, v and out must be bfloat16");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 &&
                  v.stride(2) == 1,
              "prefill_attention_bf16_: q, k and v must be [tokens, heads, head_dim] with head_dim contiguous");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), kv_heads = k.size(1);
  TORCH_CHECK(k.size(0) == T && v.size(0) == T && v.size(1) == kv_heads && k.size(2) == D && v.size(2) == D,
              "prefill_attention_bf16_: q, k and v disagree on tokens, KV heads or head_dim");
  TORCH_CHECK(kv_heads > 0 && H % kv_heads == 0, "prefill_attention_bf16_: query heads must be a multiple of KV heads");
  TORCH_CHECK(D % 64 == 0 && D <= 256, "prefill_attention_bf16_: head_dim must be a multiple of 64, at most 256");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == T && out.size(1) == H * D && out.stride(1) == 1,
              "prefill_attention_bf16_: out must be [tokens, heads * head_dim] with rows contiguous");
  TORCH_CHECK(starts.scalar_type() == at::kLong && lens.scalar_type() == at::kLong && starts.dim() == 1 &&
                  lens.sizes() == starts.sizes() && starts.is_contiguous() && lens.is_contiguous(),
              "prefill_attention_bf16_: starts and lens must be 1-d int64 tensors of one length");
  const int64_t n = starts.numel();
  const int64_t* sd = starts.data_ptr<int64_t>();
  const int64_t* ld = lens.data_ptr<int64_t>();
  std::vector<Seq> seqs;
  seqs.reserve(n);
  int64_t k_total = 0, v_total = 0, max_len = 0;
  for (int64_t j = 0; j < n; ++j) {
    TORCH_CHECK(ld[j] >= 0 && sd[j] >= 0 && sd[j] + ld[j] <= T,
                "prefill_attention_bf16_: a prompt's tokens lie outside q");
    if (ld[j] == 0) continue;
    seqs.push_back({sd[j], ld[j], k_total, v_total});
    k_total += kv_heads * packed_keys(ld[j], D);
    v_total += kv_heads * packed_values(ld[j], D);
    max_len = std::max(max_len, ld[j]);
  }
#if KVBRIDGE_BF16_VEC
  if (seqs.empty()) return;
  const bool amx = isa == 2;
  const int64_t group = H / kv_heads;
  const bf16* q_data = reinterpret_cast<const bf16*>(q.data_ptr<at::BFloat16>());
  const bf16* k_data = reinterpret_cast<const bf16*>(k.data_ptr<at::BFloat16>());
  const bf16* v_data = reinterpret_cast<const bf16*>(v.data_ptr<at::BFloat16>());
  bf16* out_data = reinterpret_cast<bf16*>(out.data_ptr<at::BFloat16>());
  const int64_t q_tok = q.stride(0), q_head = q.stride(1), k_tok = k.stride(0), k_head = k.stride(1);
  const int64_t v_tok = v.stride(0), v_head = v.stride(1), o_tok = out.stride(0);
  // Every element is written by the packing (zeros past each prompt): no initialisation needed.
  std::unique_ptr<bf16[]> k_packed(new bf16[k_total]), v_packed(new bf16[v_total]);
  // Items: (prompt, query head, query tile), the tiles with the most keys first.
  struct Item {
    int32_t seq, head, tile;
    int64_t keys;
  };
  std::vector<Item> items;
  for (int32_t j = 0; j < static_cast<int32_t>(seqs.size()); ++j) {
    const int64_t tiles = round_up(seqs[j].len, kRows) / kRows;
    for (int32_t t = 0; t < tiles; ++t) {
      for (int32_t h = 0; h < H; ++h) items.push_back({j, h, t, std::min(seqs[j].len, (t + 1) * kRows)});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.keys > b.keys; });
  const int64_t packs = static_cast<int64_t>(seqs.size()) * kv_heads;
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int threads = std::max(1, std::min<int>(at::get_num_threads(), static_cast<int>(n_items)));
  // Score and probability rows, 16 columns longer than the longest prompt's keys: at a multiple of
  // 1024 keys the 16 rows of a tile were 4 KB apart, all in one L1 set (more rows than its ways).
  const int64_t s_ld = round_up(max_len, kValueKeys) + 16;
  const float softmax_scale = static_cast<float>(scale);

#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < packs; ++i) {
      const Seq& s = seqs[i / kv_heads];
      const int64_t h = i % kv_heads;
      pack_keys(k_packed.get() + s.k_off + h * packed_keys(s.len, D), k_data + s.start * k_tok + h * k_head, k_tok,
                s.len, D);
      pack_values(v_packed.get() + s.v_off + h * packed_values(s.len, D), v_data + s.start * v_tok + h * v_head,
                  v_tok, s.len, D);
    }  // the implicit barrier: every prompt packed before any item reads
#if KVBRIDGE_AMX
    if (amx) configure_tiles();
#endif
    std::vector<bf16> qbuf(kRows * D), pbuf(kRows * s_ld);
    std::vector<float> sbuf(kRows * s_ld), obuf(kRows * D), row_sum(kRows);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < n_items; ++it) {
      const Item& item = items[it];
      const Seq& s = seqs[item.seq];
      const int64_t kvh = item.head / group, r0 = static_cast<int64_t>(item.tile) * kRows;
      const int64_t rows = std::min(kRows, s.len - r0), keys = item.keys;
      // The tile's queries: read in place (a tile load takes any row stride), or for a prompt's
      // last, partial tile copied with zero rows past the prompt (its rows past T are not q's).
      const bf16* qrows = q_data + (s.start + r0) * q_tok + item.head * q_head;
      int64_t q_ld = q_tok;
      if (rows < kRows) {
        for (int64_t r = 0; r < kRows; ++r) {
          bf16* dst = qbuf.data() + r * D;
          if (r < rows) {
            std::memcpy(dst, qrows + r * q_tok, D * sizeof(bf16));
          } else {
            std::memset(dst, 0, D * sizeof(bf16));
          }
        }
        qrows = qbuf.data();
        q_ld = D;
      }
      const bf16* kp = k_packed.get() + s.k_off + kvh * packed_keys(s.len, D);
      const bf16* vp = v_packed.get() + s.v_off + kvh * packed_values(s.len, D);
      const int64_t score_chunks = round_up(keys, kScoreKeys) / kScoreKeys;
      const int64_t value_chunks = round_up(keys, kValueKeys) / kValueKeys;
      const int64_t p_cols = value_chunks * kValueKeys;
      score_tile(amx, qrows, q_ld, rows, kp, score_chunks, D, sbuf.data(), s_ld);
      for (int64_t r = 0; r < kRows; ++r) {  // exact softmax per row; P in bf16, 0 where masked
        bf16* p = pbuf.data() + r * s_ld;
        if (r >= rows) {
          std::memset(p, 0, p_cols * sizeof(bf16));
          row_sum[r] = 1.f;
          continue;
        }
        // Keys 0 .. r0 + r; p's columns past them (to p_cols, a multiple of 16) zero.
        row_sum[r] = softmax_row(sbuf.data() + r * s_ld, p, r0 + r + 1, p_cols, softmax_scale);
      }
      value_tile(amx, pbuf.data(), s_ld, rows, vp, value_chunks, D, obuf.data());
      for (int64_t r = 0; r < rows; ++r) {
        bf16* o = out_data + (s.start + r0 + r) * o_tok + item.head * D;
        const __m512 inv = _mm512_set1_ps(1.f / row_sum[r]);
        const float* src = obuf.data() + r * D;
        for (int64_t d = 0; d < D; d += 16) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d),
                              reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(src + d), inv))));
        }
      }
    }
#if KVBRIDGE_AMX
    if (amx) _tile_release();
#endif
  }
#else
  TORCH_CHECK(false, "prefill_attention_bf16_: built without AVX-512 BF16");
#endif
}

KVBRIDGE_LIBRARY_FRAGMENT(KVBRIDGE_OPS, m) {
  m.def("prefill_attention_bf16_isa() -> int", &prefill_attention_bf16_isa);
  m.def("prefill_attention_bf16_(Tensor(a!) out, Tensor q, Tensor k, Tensor v, Tensor starts, Tensor lens, "
        "float scale, int isa) -> ()");
}

KVBRIDGE_LIBRARY_IMPL(KVBRIDGE_OPS, CPU, m) { m.impl("prefill_attention_bf16_", &prefill_attention_bf16_); }
