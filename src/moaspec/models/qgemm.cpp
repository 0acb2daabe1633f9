// Weight-only int8 / int4 linear layers for x86 CPUs with AVX2 (VNNI, and 512-bit registers, where present).
//
// y = x @ W.T (+ b) for x [R, K] float32. The activations are quantised on the fly to int8 in blocks of
// 32 values, one float scale per block (outliers stay local to their block), and every weight block
// is multiplied with integer dot products, so each weight byte is read once for up to 8 rows.
//   int8: W = q * s[n]            q int8 in [-127, 127], one scale per output channel
//   int4: W = q * s[n, g] + m[n, g]  q in [0, 15], scale and offset (fp16) per group of G inputs
// The weights lie interleaved by output channel (see `Lanes` below and quant.interleave_int8/int4).
// The offset term needs only the activations' block sums: sum_b dx_b * sum(qx_b) per group.
// Also: llama.cpp's GGUF block formats multiplied as stored ("GGUF block formats" below, blocks.py), fp16
// weights for a few rows (`linear_f16`), attention whose rows do not depend on each other, and every
// decoder layer of a quantised pass in one call (`Stack`).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int QK = 32;  // values per activation block

#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define MOASPEC_VNNI 1
#endif

struct QuantRows {
  std::vector<int8_t> q;     // [R, K]
  std::vector<float> d;      // [R, K / 32] block scales
  std::vector<float> gsum;   // [R, K / G] sum over the group's blocks of d * sum(q)
  std::vector<int32_t> s;    // [R, K / 16] sum(q) of each 16-value half of a block (integer zero points)
};

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The 8 horizontal sums of a[0..7] as one vector (lane s: a[s]'s sum, in the same order for every s).
inline __m256 hsum8(const __m256 (&a)[8]) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// e^x for x <= 0 (Cephes' single-precision polynomial, ~2 ulp); below -87.3 it returns e^-87.3.
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// acc + u8 x s8 products summed in fours to 8 int32 lanes (u8 pairs times s8 must not exceed int16
// without VNNI: the callers keep u8 <= 128 there or 4 bits).
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#elif defined(MOASPEC_VNNI)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

QuantRows quantize_rows(const float* x, int64_t R, int64_t K, int64_t G) {
  const int64_t nb = K / QK, ng = K / G, per_group = G / QK;
  QuantRows out;
  out.q.resize(R * K);
  out.d.resize(R * nb);
  out.gsum.assign(R * ng, 0.f);
  out.s.resize(R * nb * 2);
  const __m256 sign_mask = _mm256_set1_ps(-0.0f);
  // rows are independent: many rows (a prefill) are split among the threads
  at::parallel_for(0, R, R >= 16 ? 8 : R, [&](int64_t r_begin, int64_t r_end) {
  for (int64_t r = r_begin; r < r_end; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * K + b * QK;
      __m256 v[4];
      __m256 amax = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_mask, v[i]));
      }
      __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m = _mm_max_ps(m, _mm_movehl_ps(m, m));
      m = _mm_max_ss(m, _mm_movehdup_ps(m));
      const float d = _mm_cvtss_f32(m) / 127.f;
      const __m256 id = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
      __m256i i32[4];
      for (int i = 0; i < 4; ++i) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));  // round to nearest
      // 4 x 8 int32 -> 32 int8 in order (the packs interleave 128-bit lanes; the permute restores order)
      __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
      p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      int8_t* dst = out.q.data() + r * K;
      int32_t half[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i s = _mm256_add_epi32(i32[2 * h], i32[2 * h + 1]);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        s4 = _mm_hadd_epi32(s4, s4);
        s4 = _mm_hadd_epi32(s4, s4);
        half[h] = out.s[(r * nb + b) * 2 + h] = _mm_cvtsi128_si32(s4);
      }
      const float c = d * static_cast<float>(half[0] + half[1]);  // the block's sum, dequantised
      out.gsum[r * ng + b / per_group] += c;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + b * QK), p8);
      out.d[r * nb + b] = d;
    }
  }
  });
  return out;
}

void check_input(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous float32 [rows, in] tensor");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, the weight ", K);
}

// The integer kernels read weights interleaved by output channels (`quant.interleave_int8/int4` with
// `channels()` of them, one int32 lane each: 16 with AVX-512, else 8): for each 4-value chunk of the
// inputs, the channels' 4 bytes lie side by side in one register. One chunk of a row's activations,
// broadcast, meets all of them in one integer dot product, so a 32-value block costs 8 dot products,
// one conversion and one FMA per row and no horizontal sums. A chunk is loaded (and unpacked) once for up
// to RT_MAX rows, and the weights stream sequentially.
//
// Row invariance: a row's integer sums are exact whatever their chain split, and its float sums run over
// the blocks in order, one accumulator, whatever the row count, tile or thread split: a row's result
// never depends on the rows beside it.
#if defined(__AVX512VL__)
constexpr int RT_MAX = 8;  // 32 vector registers
#else
constexpr int RT_MAX = 4;  // 16 vector registers
#endif
constexpr int64_t ROW_BLOCK = 64;     // prefill: rows a pass over a thread's weights serves from L2
#ifndef MOASPEC_Q_PREFETCH
#define MOASPEC_Q_PREFETCH 1024
#endif
constexpr int64_t Q_PREFETCH = MOASPEC_Q_PREFETCH;  // bytes of weights prefetched ahead

// 8 channels a register: AVX2 (VNNI where present).
struct Lanes8 {
  static constexpr int CH = 8;
  using I = __m256i;
  using F = __m256;
  static I load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  static I zero() { return _mm256_setzero_si256(); }
  static I bcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I nibbles(I p, int shift) {
    return _mm256_and_si256(shift ? _mm256_srli_epi16(p, 4) : p, _mm256_set1_epi8(0x0F));
  }
#ifdef MOASPEC_VNNI
  static I unsigned_w(I w) { return _mm256_xor_si256(w, _mm256_set1_epi8(char(0x80))); }  // w + 128
  static I dot_w(I acc, I w, I u, I x) { return dot_u8s8(acc, u, x); }
#else
  static I unsigned_w(I w) { return _mm256_sign_epi8(w, w); }  // |w|, its sign moved onto x
  static I dot_w(I acc, I w, I u, I x) { return dot_u8s8(acc, u, _mm256_sign_epi8(x, w)); }
#endif
  static I dot(I acc, I u, I x) { return dot_u8s8(acc, u, x); }
  static F zerof() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F half(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  // (the GGUF block kernels')
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I mullo(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I set1i(int32_t v) { return _mm256_set1_epi32(v); }
  // the bits `mask` of each byte after shifting h left by s (right where s < 0) within 16-bit lanes: the
  // callers' shifts (<= 4 left, <= 3 right) bring no bit of the neighbouring byte under the mask
  static I bits(I h, int s, int mask) {
    h = s > 0 ? _mm256_slli_epi16(h, s) : s < 0 ? _mm256_srli_epi16(h, -s) : h;
    return _mm256_and_si256(h, _mm256_set1_epi8(static_cast<char>(mask)));
  }
  static F u8f(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }
  static I s8i(const int8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static F fnma(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
};

#if defined(MOASPEC_VNNI) && defined(__AVX512BW__) && defined(__AVX512F__)
#define MOASPEC_ZMM 1
// 16 channels a register: AVX-512 VNNI.
struct Lanes16 {
  static constexpr int CH = 16;
  using I = __m512i;
  using F = __m512;
  static I load(const void* p) { return _mm512_loadu_si512(p); }
  static I zero() { return _mm512_setzero_si512(); }
  static I bcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I nibbles(I p, int shift) {
    return _mm512_and_si512(shift ? _mm512_srli_epi16(p, 4) : p, _mm512_set1_epi8(0x0F));
  }
  static I unsigned_w(I w) { return _mm512_xor_si512(w, _mm512_set1_epi8(char(0x80))); }
  static I dot_w(I acc, I, I u, I x) { return _mm512_dpbusd_epi32(acc, u, x); }
  static I dot(I acc, I u, I x) { return _mm512_dpbusd_epi32(acc, u, x); }
  static F zerof() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F half(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I mullo(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I set1i(int32_t v) { return _mm512_set1_epi32(v); }
  static I bits(I h, int s, int mask) {
    h = s > 0 ? _mm512_slli_epi16(h, s) : s < 0 ? _mm512_srli_epi16(h, -s) : h;
    return _mm512_and_si512(h, _mm512_set1_epi8(static_cast<char>(mask)));
  }
  static F u8f(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }
  static I s8i(const int8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F fnma(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
};
using Lanes = Lanes16;
#else
using Lanes = Lanes8;
#endif
constexpr int NCH = Lanes::CH;

// int8 weights (one scale per channel, applied by the caller); res[r] = the channels of row r0 + r.
template <int RT, typename V = Lanes>
void q8_group(const QuantRows& a, int64_t r0, const int8_t* wg, int64_t K, typename V::F* res) {
  constexpr int CH = RT >= 4 ? 1 : 2;  // independent integer chains per row
  const int64_t nb = K / QK;
  typename V::F acc[RT];
  for (int r = 0; r < RT; ++r) acc[r] = V::zerof();
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* wb = wg + b * QK * V::CH;
    if constexpr (RT >= 4)  // (at 1-2 rows the hardware prefetcher alone streams faster)
      for (int64_t off = 0; off < QK * V::CH; off += 256)
        _mm_prefetch(reinterpret_cast<const char*>(wb + Q_PREFETCH + off), _MM_HINT_T0);
    typename V::I ia[RT][CH];
    for (int r = 0; r < RT; ++r)
      for (int c = 0; c < CH; ++c) ia[r][c] = V::zero();
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {
      const auto w = V::load(wb + 4 * V::CH * k);
      const auto u = V::unsigned_w(w);
      for (int r = 0; r < RT; ++r)
        ia[r][k % CH] = V::dot_w(ia[r][k % CH], w, u, V::bcast4(a.q.data() + (r0 + r) * K + b * QK + 4 * k));
    }
    for (int r = 0; r < RT; ++r) {
      auto s = ia[r][0];
      for (int c = 1; c < CH; ++c) s = V::add(s, ia[r][c]);
      acc[r] = V::fma(V::cvt(s), V::set1(a.d[(r0 + r) * nb + b]), acc[r]);
    }
  }
  for (int r = 0; r < RT; ++r) {
#ifdef MOASPEC_VNNI
    acc[r] = V::fma(V::set1(-128.f), V::set1(a.gsum[r0 + r]), acc[r]);  // the w + 128 correction
#endif
    res[r] = acc[r];
  }
}

// int4 weights, fp16 scale and offset per group of G inputs (sc, mn: [K / G][channels] for these
// channels). A block's 4 chunks hold, per channel, values 4k..4k+3 in the low nibbles and 16+4k..16+4k+3
// in the high ones.
template <int RT, typename V = Lanes>
void q4_group(const QuantRows& a, int64_t r0, const uint8_t* wg, const uint16_t* sc, const uint16_t* mn,
              int64_t K, int64_t G, typename V::F* res) {
  constexpr int CH = RT >= 4 ? 1 : 2;
  const int64_t nb = K / QK, ng = K / G, per_group = G / QK;
  typename V::F acc[RT];
  for (int r = 0; r < RT; ++r) acc[r] = V::zerof();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = wg + b * (QK / 2) * V::CH;
    if constexpr (RT >= 4)
      for (int64_t off = 0; off < QK / 2 * V::CH; off += 256)
        _mm_prefetch(reinterpret_cast<const char*>(wb + Q_PREFETCH + off), _MM_HINT_T0);
    typename V::I ia[RT][CH];
    for (int r = 0; r < RT; ++r)
      for (int c = 0; c < CH; ++c) ia[r][c] = V::zero();
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const auto p = V::load(wb + 4 * V::CH * k);
      const auto lo = V::nibbles(p, 0), hi = V::nibbles(p, 4);
      for (int r = 0; r < RT; ++r) {
        const int8_t* x = a.q.data() + (r0 + r) * K + b * QK + 4 * k;
        ia[r][0] = V::dot(ia[r][0], lo, V::bcast4(x));
        ia[r][CH - 1] = V::dot(ia[r][CH - 1], hi, V::bcast4(x + 16));
      }
    }
    const auto sv = V::half(sc + (b / per_group) * V::CH);
    for (int r = 0; r < RT; ++r) {
      auto s = ia[r][0];
      for (int c = 1; c < CH; ++c) s = V::add(s, ia[r][c]);
      acc[r] = V::fma(V::cvt(s), V::mul(sv, V::set1(a.d[(r0 + r) * nb + b])), acc[r]);
    }
  }
  // the offsets' share: sum_g m[g] * (the row's dequantised sum over group g)
  for (int64_t g = 0; g < ng; ++g) {
    const auto mv = V::half(mn + g * V::CH);
    for (int r = 0; r < RT; ++r) acc[r] = V::fma(mv, V::set1(a.gsum[(r0 + r) * ng + g]), acc[r]);
  }
  for (int r = 0; r < RT; ++r) res[r] = acc[r];
}

const float* bias_ptr(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias.has_value() || !bias->defined() || bias->numel() == 0) return nullptr;
  TORCH_CHECK(bias->numel() == N && bias->scalar_type() == torch::kFloat32 && bias->is_contiguous(),
              "bias must be a contiguous float32 [out] tensor");
  return bias->data_ptr<float>();
}

// Runs group(rt, g, r0, res) over all groups of channels and tiles of up to RT_MAX rows; threads split
// the groups, so each weight byte is read from memory once per ROW_BLOCK rows. Row r's N outputs go to
// yp + r * ld (a slice of a wider output: the parts of a `Stack` slot).
template <typename Group>
void run_groups_into(int64_t R, int64_t N, const float* bp, const float* post_scale, Group group, float* yp,
                     int64_t ld) {
  using V = Lanes;
  at::parallel_for(0, N / NCH, 1, [&](int64_t begin, int64_t end) {
    V::F res[RT_MAX];
    for (int64_t rb = 0; rb < R; rb += ROW_BLOCK) {
      const int64_t re = std::min(R, rb + ROW_BLOCK);
      for (int64_t g = begin; g < end; ++g) {
        const auto ps = post_scale ? V::loadf(post_scale + g * NCH) : V::set1(1.f);
        const auto bv = bp ? V::loadf(bp + g * NCH) : V::zerof();
        for (int64_t r0 = rb; r0 < re; r0 += RT_MAX) {
          const int rt = static_cast<int>(std::min<int64_t>(RT_MAX, re - r0));
          group(rt, g, r0, res);
          for (int r = 0; r < rt; ++r) V::store(yp + (r0 + r) * ld + g * NCH, V::fma(res[r], ps, bv));
        }
      }
    }
  });
}

template <typename Group>
torch::Tensor run_groups(int64_t R, int64_t N, const c10::optional<torch::Tensor>& bias, const float* post_scale,
                         Group group) {
  auto y = torch::empty({R, N}, torch::kFloat32);
  run_groups_into(R, N, bias_ptr(bias, N), post_scale, group, y.data_ptr<float>(), N);
  return y;
}

// CALL(RT) for the tile size rt (1..RT_MAX).
#define MOASPEC_TILES(rt, CALL)                        \
  switch (rt) {                                        \
    case 1: CALL(1); break;                            \
    case 2: CALL(2); break;                            \
    case 3: CALL(3); break;                            \
    case 4: CALL(4); break;                            \
    case 5: if constexpr (RT_MAX >= 8) CALL(5); break; \
    case 6: if constexpr (RT_MAX >= 8) CALL(6); break; \
    case 7: if constexpr (RT_MAX >= 8) CALL(7); break; \
    default: if constexpr (RT_MAX >= 8) CALL(8);       \
  }

// fp16 weights, fp32 activations and sums, for the few rows of a decode step, a draft step or a small
// tree: one channel's weights are converted once (F16C) for all RT rows, so 2-8 rows stream the weights
// about as fast as one (fbgemm's fp16 kernel: +10-35% at 2-6 rows in a Qwen 0.5B pass). Two
// accumulators per row alternate 8-value chunks whatever RT is: a row's sum never depends on the rows
// beside it (row-invariant), so a k-row verification scores a token exactly as a 1-row step does. The
// weights are prefetched 2 KB ahead, which keeps more of the stream in flight than the hardware does.
constexpr int64_t F16_PREFETCH = 1024;  // fp16 values

template <int NC, int RT>
void f16_tile(const float* x, int64_t r0, const uint16_t* w, int64_t K, float* out) {
  __m256 acc[NC][RT][2];
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < RT; ++r) acc[c][r][0] = acc[c][r][1] = _mm256_setzero_ps();
  const float* xr = x + r0 * K;
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    for (int c = 0; c < NC; ++c) _mm_prefetch(reinterpret_cast<const char*>(w + c * K + k + F16_PREFETCH), _MM_HINT_T0);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      for (int c = 0; c < NC; ++c) {
        const __m256 wv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c * K + k + 8 * j)));
        for (int r = 0; r < RT; ++r)
          acc[c][r][j & 1] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xr + r * K + k + 8 * j), acc[c][r][j & 1]);
      }
    }
  }
  for (int j = 0; k < K; k += 8, ++j)
    for (int c = 0; c < NC; ++c) {
      const __m256 wv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c * K + k)));
      for (int r = 0; r < RT; ++r)
        acc[c][r][j & 1] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xr + r * K + k), acc[c][r][j & 1]);
    }
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < RT; ++r) out[r * NC + c] = hsum(_mm256_add_ps(acc[c][r][0], acc[c][r][1]));
}

template <int RT>
void f16_rows(const float* x, int64_t r0, const uint16_t* w, int64_t K, int64_t n0, int64_t n1, int64_t N,
              const float* bias, float* y) {
  // several channels a tile where few rows leave registers free: fewer calls and reductions per byte
  constexpr int NC = 1;
  float out[NC * RT];
  int64_t n = n0;
  auto store = [&](int nc) {
    for (int r = 0; r < RT; ++r)
      for (int c = 0; c < nc; ++c) y[(r0 + r) * N + n + c] = out[r * nc + c] + (bias ? bias[n + c] : 0.f);
  };
  for (; n + NC <= n1; n += NC) {
    f16_tile<NC, RT>(x, r0, w + n * K, K, out);
    store(NC);
  }
  for (; n < n1; ++n) {
    f16_tile<1, RT>(x, r0, w + n * K, K, out);
    store(1);
  }
}

torch::Tensor linear_f16(const torch::Tensor& x, const torch::Tensor& w16, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(w16.dim() == 2 && w16.scalar_type() == torch::kHalf && w16.is_contiguous(), "w must be fp16 [out, in]");
  const int64_t N = w16.size(0), K = w16.size(1), R = x.size(0);
  check_input(x, K);
  TORCH_CHECK(K % 8 == 0, "fp16 layers need in_features divisible by 8");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == torch::kFloat32 && bias->is_contiguous(),
                "bias must be a contiguous float32 [out] tensor");
    bp = bias->data_ptr<float>();
  }
  auto y = torch::empty({R, N}, torch::kFloat32);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const uint16_t* w = reinterpret_cast<const uint16_t*>(w16.data_ptr<at::Half>());
  constexpr int64_t NB = 16;
  at::parallel_for(0, (N + NB - 1) / NB, 1, [&](int64_t begin, int64_t end) {
    const int64_t n0 = begin * NB, n1 = std::min(N, end * NB);
    for (int64_t r0 = 0; r0 < R; r0 += 8) {
      switch (std::min<int64_t>(8, R - r0)) {
        case 8: f16_rows<8>(xp, r0, w, K, n0, n1, N, bp, yp); break;
        case 7: f16_rows<7>(xp, r0, w, K, n0, n1, N, bp, yp); break;
        case 6: f16_rows<6>(xp, r0, w, K, n0, n1, N, bp, yp); break;
        case 5: f16_rows<5>(xp, r0, w, K, n0, n1, N, bp, yp); break;
        case 4: f16_rows<4>(xp, r0, w, K, n0, n1, N, bp, yp); break;
        case 3: f16_rows<3>(xp, r0, w, K, n0, n1, N, bp, yp); break;
        case 2: f16_rows<2>(xp, r0, w, K, n0, n1, N, bp, yp); break;
        default: f16_rows<1>(xp, r0, w, K, n0, n1, N, bp, yp);
      }
    }
  });
  return y;
}

// The drafters' decoder blocks for a few rows in two calls instead of ~20 small torch ops: at 1-4 rows
// a draft step's time was mostly per-op dispatch, not weights. Inference only; the norms sum in another
// order than torch's, so results match the reference math up to float rounding, not bit for bit.

// x [R, K] -> x * rsqrt(mean(x^2) + eps) * w, each row alone (many rows split among the threads)
torch::Tensor rms_rows(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x must be contiguous float32 [rows, in]");
  const int64_t R = x.size(0), K = x.size(1);
  TORCH_CHECK(w.numel() == K && w.scalar_type() == torch::kFloat32 && w.is_contiguous(), "norm weight must be float32 [in]");
  auto h = torch::empty({R, K}, torch::kFloat32);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  at::parallel_for(0, R, R >= 32 ? 16 : R, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * K;
      double ss = 0.0;
      for (int64_t k = 0; k < K; ++k) ss += double(xr[k]) * xr[k];
      const float inv = 1.f / std::sqrt(float(ss / K) + float(eps));
      for (int64_t k = 0; k < K; ++k) hp[r * K + k] = xr[k] * inv * wp[k];
    }
  });
  return h;
}

// RoPE (rotate-half, its sign folded into `sin_signed`) in place on the first `cols` columns of y [R, N],
// head by head of d; row r takes row r % P of cos, sin_signed [P, d].
void rope_rows_inplace(float* yp, int64_t R, int64_t N, int64_t cols, const float* cp, const float* sp, int64_t P,
                       int64_t d) {
  const int64_t half = d / 2;
  std::vector<float> tmp(d);
  for (int64_t r = 0; r < R; ++r) {
    const float *c = cp + (r % P) * d, *s = sp + (r % P) * d;
    for (int64_t h0 = 0; h0 < cols; h0 += d) {
      float* v = yp + r * N + h0;
      std::memcpy(tmp.data(), v, d * sizeof(float));
      for (int64_t j = 0; j < d; ++j) v[j] = tmp[j] * c[j] + tmp[(j + half) % d] * s[j];
    }
  }
}

void check_rope(const torch::Tensor& y, const torch::Tensor& cos, const torch::Tensor& sin_signed, int64_t cols) {
  TORCH_CHECK(cos.dim() == 2 && sin_signed.sizes() == cos.sizes() && cos.is_contiguous() && sin_signed.is_contiguous() &&
              cos.scalar_type() == torch::kFloat32 && sin_signed.scalar_type() == torch::kFloat32,
              "cos and sin_signed must be contiguous float32 [positions, head_dim]");
  TORCH_CHECK(cols % cos.size(1) == 0 && cols <= y.size(1) && cos.size(1) % 2 == 0, "rope_cols must be whole heads of the output");
}

// RoPE in place on the first `cols` columns of y [R, N] (the decoding path's q|k heads).
void rope_(torch::Tensor y, const torch::Tensor& cos, const torch::Tensor& sin_signed, int64_t cols) {
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == torch::kFloat32 && y.is_contiguous(), "y must be contiguous float32 [rows, cols]");
  check_rope(y, cos, sin_signed, cols);
  rope_rows_inplace(y.data_ptr<float>(), y.size(0), y.size(1), cols, cos.data_ptr<float>(), sin_signed.data_ptr<float>(),
                    cos.size(0), cos.size(1));
}

// [g | u] [R, 2M] -> act(g) * u [R, M], 8 lanes at a time, each element alone; `act` maps 8 g to 8 act(g).
template <typename Act>
torch::Tensor gated(const torch::Tensor& gu, Act act) {
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 16 == 0 && gu.scalar_type() == torch::kFloat32 && gu.is_contiguous(),
              "gate_up must be contiguous float32 [rows, 2 * M] with M a multiple of 8");
  const int64_t R = gu.size(0), M = gu.size(1) / 2;
  auto a = torch::empty({R, M}, torch::kFloat32);
  const float* g = gu.data_ptr<float>();
  float* ap = a.data_ptr<float>();
  at::parallel_for(0, R, R >= 32 ? 16 : R, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t j = 0; j < M; j += 8) {
        const __m256 gv = _mm256_loadu_ps(g + r * 2 * M + j), uv = _mm256_loadu_ps(g + r * 2 * M + M + j);
        _mm256_storeu_ps(ap + r * M + j, _mm256_mul_ps(act(gv), uv));
      }
  });
  return a;
}

// silu(g) * u; e^-|g| vectorised (sigmoid from either side).
torch::Tensor silu_mul(const torch::Tensor& gu) {
  return gated(gu, [](__m256 gv) {
    const __m256 one = _mm256_set1_ps(1.f);
    const __m256 e = exp256(_mm256_or_ps(gv, _mm256_set1_ps(-0.0f)));  // e^-|g|
    const __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
    const __m256 pos = _mm256_cmp_ps(gv, _mm256_setzero_ps(), _CMP_GE_OQ);
    return _mm256_mul_ps(gv, _mm256_blendv_ps(_mm256_mul_ps(e, inv), inv, pos));
  });
}

// gelu(g) * u, gelu's tanh form (Gemma's gelu_pytorch_tanh): 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))),
// tanh from e^-2|z|.
torch::Tensor gelu_mul(const torch::Tensor& gu) {
  return gated(gu, [](__m256 gv) {
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.0f);
    const __m256 z = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                   _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), gv), _mm256_mul_ps(gv, gv), gv));
    const __m256 e = exp256(_mm256_mul_ps(_mm256_set1_ps(-2.f), _mm256_andnot_ps(sign, z)));  // e^-2|z|
    const __m256 th = _mm256_or_ps(_mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e)), _mm256_and_ps(sign, z));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), gv), _mm256_add_ps(one, th));
  });
}

// RMS norm in place over each head of d columns of y [R, N], `heads` heads from column col0, weight w [d]
// (Qwen3's and Gemma 3's q and k norms); the sums as `rms_rows` takes them.
void rms_heads_(torch::Tensor y, const torch::Tensor& w, double eps, int64_t col0, int64_t heads) {
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == torch::kFloat32 && y.is_contiguous(), "y must be contiguous float32 [rows, cols]");
  TORCH_CHECK(w.dim() == 1 && w.scalar_type() == torch::kFloat32 && w.is_contiguous(), "norm weight must be float32 [head_dim]");
  const int64_t R = y.size(0), N = y.size(1), d = w.numel();
  TORCH_CHECK(col0 >= 0 && col0 + heads * d <= N, "the heads lie outside y");
  float* yp = y.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < heads; ++h) {
      float* v = yp + r * N + col0 + h * d;
      double ss = 0.0;
      for (int64_t k = 0; k < d; ++k) ss += double(v[k]) * v[k];
      const float inv = 1.f / std::sqrt(float(ss / d) + float(eps));
      for (int64_t k = 0; k < d; ++k) v[k] = v[k] * inv * wp[k];
    }
}

// y = rms_norm(x) @ w.T (x @ w.T without `ln`) with RoPE (rotate-half, the sign folded into `sin_signed`) on the first
// `rope_cols` output columns, head by head: x [R, K]; cos, sin_signed [P, d] (row r at position row
// r % P: one row for rows at one position, one per row, or the L layers of the LSA).
torch::Tensor norm_linear_rope_f16(const torch::Tensor& x, const c10::optional<torch::Tensor>& ln, double eps,
                                   const torch::Tensor& w16, const torch::Tensor& cos, const torch::Tensor& sin_signed,
                                   int64_t rope_cols) {
  check_input(x, w16.size(1));
  auto y = linear_f16(ln.has_value() && ln->defined() ? rms_rows(x, *ln, eps) : x, w16, c10::nullopt);
  if (rope_cols == 0) return y;
  check_rope(y, cos, sin_signed, rope_cols);
  rope_rows_inplace(y.data_ptr<float>(), y.size(0), y.size(1), rope_cols, cos.data_ptr<float>(), sin_signed.data_ptr<float>(),
                    cos.size(0), cos.size(1));
  return y;
}

// The residual tail of a block: y = x + att @ o.T, then y + down(silu(g) * u) with [g | u] = rms_norm(y)
// @ gate_up.T. x [R, D], att [R, A]; a new tensor (x is not written).
torch::Tensor block_tail_f16(const torch::Tensor& x, const torch::Tensor& att, const torch::Tensor& o16,
                             const torch::Tensor& ln2, double eps, const torch::Tensor& gu16, const torch::Tensor& down16) {
  check_input(x, o16.size(0));
  auto y = linear_f16(att, o16, c10::nullopt);
  const int64_t R = y.size(0), D = y.size(1), M = gu16.size(0) / 2;
  TORCH_CHECK(down16.size(1) == M && down16.size(0) == D && gu16.size(1) == D, "gate_up / down shapes do not match");
  float* yp = y.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < R * D; ++i) yp[i] += xp[i];
  auto gu = linear_f16(rms_rows(y, ln2, eps), gu16, c10::nullopt);
  auto a = torch::empty({R, M}, torch::kFloat32);
  const float* g = gu.data_ptr<float>();
  float* ap = a.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < M; ++j) {
      const float gv = g[r * 2 * M + j];
      ap[r * M + j] = gv / (1.f + std::exp(-gv)) * g[r * 2 * M + M + j];
    }
  auto dn = linear_f16(a, down16, c10::nullopt);
  const float* dp = dn.data_ptr<float>();
  for (int64_t i = 0; i < R * D; ++i) yp[i] += dp[i];
  return y;
}

void check_q8(const torch::Tensor& qw, const torch::Tensor& scale) {
  TORCH_CHECK(qw.dim() == 4 && qw.size(2) == NCH && qw.size(3) == 4 && qw.scalar_type() == torch::kInt8 &&
                  qw.is_contiguous(), "qw must be int8 [out / channels, in / 4, channels, 4] (quant.interleave_int8)");
  TORCH_CHECK(qw.size(1) * 4 % QK == 0, "int8 layers need in_features divisible by 32");
  TORCH_CHECK(scale.numel() == qw.size(0) * NCH && scale.scalar_type() == torch::kFloat32 && scale.is_contiguous(),
              "scale must be float32 [out]");
}

// y[r, :N] (row stride ld) = x @ (q * s).T + b
void q8_into(const torch::Tensor& x, const torch::Tensor& qw, const torch::Tensor& scale, const float* bp, float* y,
             int64_t ld) {
  const int64_t N = qw.size(0) * NCH, K = qw.size(1) * 4, R = x.size(0);
  const QuantRows a = quantize_rows(x.data_ptr<float>(), R, K, K);
  const int8_t* w = qw.data_ptr<int8_t>();
  run_groups_into(R, N, bp, scale.data_ptr<float>(), [&](int rt, int64_t g, int64_t r0, Lanes::F* res) {
    const int8_t* wg = w + g * NCH * K;
#define Q8(RT) q8_group<RT>(a, r0, wg, K, res)
    MOASPEC_TILES(rt, Q8)
#undef Q8
  }, y, ld);
}

torch::Tensor linear_q8(const torch::Tensor& x, const torch::Tensor& qw, const torch::Tensor& scale,
                        const c10::optional<torch::Tensor>& bias) {
  check_q8(qw, scale);
  const int64_t N = qw.size(0) * NCH;
  check_input(x, qw.size(1) * 4);
  auto y = torch::empty({x.size(0), N}, torch::kFloat32);
  q8_into(x, qw, scale, bias_ptr(bias, N), y.data_ptr<float>(), N);
  return y;
}

void check_q4(const torch::Tensor& qw, const torch::Tensor& scale, const torch::Tensor& offset, int64_t G) {
  TORCH_CHECK(qw.dim() == 5 && qw.size(2) == 4 && qw.size(3) == NCH && qw.size(4) == 4 &&
                  qw.scalar_type() == torch::kUInt8 && qw.is_contiguous(),
              "qw must be uint8 [out / channels, in / 32, 4, channels, 4] (quant.interleave_int4)");
  const int64_t N = qw.size(0) * NCH, K = qw.size(1) * QK;
  TORCH_CHECK(G > 0 && G % QK == 0 && K % G == 0, "group size must be a multiple of 32 dividing in_features");
  for (const auto* t : {&scale, &offset})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == N / NCH && t->size(1) == K / G && t->size(2) == NCH &&
                    t->scalar_type() == torch::kFloat16 && t->is_contiguous(),
                "scale and offset must be float16 [out / channels, in / group, channels] (quant.interleave_int4)");
}

void q4_into(const torch::Tensor& x, const torch::Tensor& qw, const torch::Tensor& scale, const torch::Tensor& offset,
             int64_t G, const float* bp, float* y, int64_t ld) {
  const int64_t N = qw.size(0) * NCH, K = qw.size(1) * QK, R = x.size(0);
  const QuantRows a = quantize_rows(x.data_ptr<float>(), R, K, G);
  const uint8_t* w = qw.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>());
  const uint16_t* mp = reinterpret_cast<const uint16_t*>(offset.data_ptr<at::Half>());
  const int64_t ng = K / G;
  run_groups_into(R, N, bp, nullptr, [&](int rt, int64_t g, int64_t r0, Lanes::F* res) {
    const uint8_t* wg = w + g * NCH * (K / 2);
    const uint16_t *sg = sp + g * ng * NCH, *mg = mp + g * ng * NCH;
#define Q4(RT) q4_group<RT>(a, r0, wg, sg, mg, K, G, res)
    MOASPEC_TILES(rt, Q4)
#undef Q4
  }, y, ld);
}

torch::Tensor linear_q4(const torch::Tensor& x, const torch::Tensor& qw, const torch::Tensor& scale,
                        const torch::Tensor& offset, int64_t G, const c10::optional<torch::Tensor>& bias) {
  check_q4(qw, scale, offset, G);
  const int64_t N = qw.size(0) * NCH;
  check_input(x, qw.size(1) * QK);
  auto y = torch::empty({x.size(0), N}, torch::kFloat32);
  q4_into(x, qw, scale, offset, G, bias_ptr(bias, N), y.data_ptr<float>(), N);
  return y;
}

// ---- GGUF block formats: llama.cpp's weights multiplied as the file stores them (blocks.py) ----
// Each tensor keeps the file's values and scales at (within 3% of) its bytes per weight, repacked by
// `blocks.pack` into the int4 kernel's layout: per group of NCH channels and block of 32 inputs, 4 chunks
// k of NCH x 4 bytes, byte j of a channel holding value 4k+j in its low nibble and 16+4k+j in its high one
// (Q8_0: 8 chunks of signed bytes, values 4k..4k+3). Plane i of a block is chunk i / 2's low (i even) or
// high (i odd) nibbles. The 5th bit (Q5_*) of plane i lies in bit i of the block's high-bit vector, at the
// nibble's byte; Q6_K's 5th and 6th bits in bits 2 (i % 4) and 2 (i % 4) + 1 of vector i / 4: one shift and
// one mask put them above the nibble.
//   format  value                         tensors (C = NCH, B = K / 32 blocks, S = K / 256 super-blocks)
//   Q4_0    d (q - 8)                     qs [N/C, B, 4, C, 4] u8, d [N/C, B, C] f16
//   Q4_1    d q + m                       qs, dm [N/C, B, 2, C] f16 (d, m)
//   Q5_0    d (q - 16)                    qs, qh [N/C, B, C, 4] u8, d
//   Q5_1    d q + m                       qs, qh, dm
//   Q8_0    d q                           qs [N/C, B, 8, C, 4] i8, d
//   Q4_K    d sc[j] q - dmin m[j]         qs, dm [N/C, S, 2, C] f16 (d, dmin), scm [N/C, S, 2, 8, C] u8 (sc, m)
//   Q5_K    as Q4_K with 5 bits           qs, qh, dm, scm
//   Q6_K    d sc[i] (q - 32)              qs, qh [N/C, B, 2, C, 4] u8, d [N/C, S, C] f16, sc [N/C, S, 16, C] i8
// (K-quants: j the block of 32 within the super-block of 256, i the half-block of 16.) Zero points stay
// integer: sum(xq (q - Z)) = isum - Z sum(xq), exact with the activations' integer block (or half) sums;
// a min adds min * (the block's dequantised sum); Q6_K's two scales a block multiply its planes' integer
// sums (|.| < 2^24: exact in float). Then one conversion and one FMA per block and row, in block order, as in q4_group:
// row-invariant the same way.
enum BlockFmt : int { kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ8_0, kQ4_K, kQ5_K, kQ6_K, kBlockFormats };

struct BlockGroup {  // one group of channels' data
  const uint8_t* qs;  // chunks
  const uint8_t* qh;  // high-bit vectors (Q5_*, Q6_K)
  const uint16_t* h;  // fp16 scales: d; d, m; or d, dmin
  const uint8_t* sc;  // K-quants' sub-block scales (and mins)
};

template <int F, int RT, typename V = Lanes>
void block_group(const QuantRows& a, int64_t r0, const BlockGroup& w, int64_t K, typename V::F* res) {
  constexpr int HB = F == kQ5_0 || F == kQ5_1 || F == kQ5_K ? 1 : F == kQ6_K ? 2 : 0;  // high-bit vectors
  constexpr int Z = F == kQ4_0 ? 8 : F == kQ5_0 ? 16 : F == kQ6_K ? 32 : 0;           // integer zero point
  constexpr bool MIN = F == kQ4_1 || F == kQ5_1, KQ = F == kQ4_K || F == kQ5_K;
  constexpr int CH = F == kQ6_K || RT < 4 ? 2 : 1;  // integer chains a row (Q6_K: its planes' scales differ)
  constexpr int64_t BW = QK / 2 * V::CH;            // bytes of nibbles a block
  const int64_t nb = K / QK;
  typename V::F acc[RT];
  for (int r = 0; r < RT; ++r) acc[r] = V::zerof();
  typename V::F dsup = V::zerof(), msup = V::zerof();  // K-quants: the super-block's d (and dmin)
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = w.qs + b * BW;
    if constexpr (RT >= 4)
      for (int64_t off = 0; off < BW; off += 256)
        _mm_prefetch(reinterpret_cast<const char*>(wb + Q_PREFETCH + off), _MM_HINT_T0);
    typename V::I hb[2];
    if constexpr (HB > 0) hb[0] = V::load(w.qh + b * HB * 4 * V::CH);
    if constexpr (HB > 1) hb[1] = V::load(w.qh + b * HB * 4 * V::CH + 4 * V::CH);
    typename V::I ia[RT][CH];
    for (int r = 0; r < RT; ++r)
      for (int c = 0; c < CH; ++c) ia[r][c] = V::zero();
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const auto p = V::load(wb + 4 * V::CH * k);
      auto lo = V::nibbles(p, 0), hi = V::nibbles(p, 4);
      if constexpr (HB == 1) {  // planes 2k, 2k + 1: bits 2k, 2k + 1 to bit 4
        lo = V::or_(lo, V::bits(hb[0], 4 - 2 * k, 0x10));
        hi = V::or_(hi, V::bits(hb[0], 3 - 2 * k, 0x10));
      } else if constexpr (HB == 2) {  // bits 4 (k % 2) (+1) and 4 (k % 2) + 2 (+1) of vector k / 2 to bits 4-5
        lo = V::or_(lo, V::bits(hb[k / 2], 4 - 4 * (k % 2), 0x30));
        hi = V::or_(hi, V::bits(hb[k / 2], 2 - 4 * (k % 2), 0x30));
      }
      for (int r = 0; r < RT; ++r) {
        const int8_t* x = a.q.data() + (r0 + r) * K + b * QK + 4 * k;
        ia[r][0] = V::dot(ia[r][0], lo, V::bcast4(x));
        ia[r][CH - 1] = V::dot(ia[r][CH - 1], hi, V::bcast4(x + 16));
      }
    }
    const int64_t sb = b / 8, j = b % 8;  // K-quants: super-block, block within it
    if constexpr (F == kQ6_K) {
      if (j == 0) dsup = V::half(w.h + sb * V::CH);
      const int8_t* sc = reinterpret_cast<const int8_t*>(w.sc) + (sb * 16 + 2 * j) * V::CH;
      const auto sc_lo = V::s8i(sc), sc_hi = V::s8i(sc + V::CH);
      for (int r = 0; r < RT; ++r) {
        const int32_t* s2 = a.s.data() + ((r0 + r) * nb + b) * 2;
        const auto t = V::add(V::mullo(V::sub(ia[r][0], V::set1i(Z * s2[0])), sc_lo),
                              V::mullo(V::sub(ia[r][1], V::set1i(Z * s2[1])), sc_hi));
        acc[r] = V::fma(V::cvt(t), V::mul(dsup, V::set1(a.d[(r0 + r) * nb + b])), acc[r]);
      }
    } else {
      typename V::F dw, mw = V::zerof();
      if constexpr (KQ) {  // d * sc[j] and dmin * m[j] are exact in float
        if (j == 0) {
          dsup = V::half(w.h + 2 * sb * V::CH);
          msup = V::half(w.h + (2 * sb + 1) * V::CH);
        }
        dw = V::mul(dsup, V::u8f(w.sc + (16 * sb + j) * V::CH));
        mw = V::mul(msup, V::u8f(w.sc + (16 * sb + 8 + j) * V::CH));
      } else if constexpr (MIN) {
        dw = V::half(w.h + 2 * b * V::CH);
        mw = V::half(w.h + (2 * b + 1) * V::CH);
      } else {
        dw = V::half(w.h + b * V::CH);
      }
      for (int r = 0; r < RT; ++r) {
        auto s = ia[r][0];
        if constexpr (CH == 2) s = V::add(s, ia[r][1]);
        if constexpr (Z != 0) {
          const int32_t* s2 = a.s.data() + ((r0 + r) * nb + b) * 2;
          s = V::sub(s, V::set1i(Z * (s2[0] + s2[1])));
        }
        acc[r] = V::fma(V::cvt(s), V::mul(dw, V::set1(a.d[(r0 + r) * nb + b])), acc[r]);
        if constexpr (MIN) acc[r] = V::fma(mw, V::set1(a.gsum[(r0 + r) * nb + b]), acc[r]);
        if constexpr (KQ) acc[r] = V::fnma(mw, V::set1(a.gsum[(r0 + r) * nb + b]), acc[r]);
      }
    }
  }
  for (int r = 0; r < RT; ++r) res[r] = acc[r];
}

// Q8_0: signed bytes as in q8_group, with a fp16 scale a block.
template <int RT, typename V = Lanes>
void q8_0_group(const QuantRows& a, int64_t r0, const BlockGroup& w, int64_t K, typename V::F* res) {
  constexpr int CH = RT >= 4 ? 1 : 2;
  constexpr int64_t BW = QK * V::CH;
  const int64_t nb = K / QK;
  typename V::F acc[RT];
  for (int r = 0; r < RT; ++r) acc[r] = V::zerof();
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* wb = reinterpret_cast<const int8_t*>(w.qs) + b * BW;
    if constexpr (RT >= 4)
      for (int64_t off = 0; off < BW; off += 256)
        _mm_prefetch(reinterpret_cast<const char*>(wb + Q_PREFETCH + off), _MM_HINT_T0);
    typename V::I ia[RT][CH];
    for (int r = 0; r < RT; ++r)
      for (int c = 0; c < CH; ++c) ia[r][c] = V::zero();
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {
      const auto wv = V::load(wb + 4 * V::CH * k);
      const auto u = V::unsigned_w(wv);
      for (int r = 0; r < RT; ++r)
        ia[r][k % CH] = V::dot_w(ia[r][k % CH], wv, u, V::bcast4(a.q.data() + (r0 + r) * K + b * QK + 4 * k));
    }
    const auto dw = V::half(w.h + b * V::CH);
    for (int r = 0; r < RT; ++r) {
      auto s = ia[r][0];
      if constexpr (CH == 2) s = V::add(s, ia[r][1]);
#ifdef MOASPEC_VNNI
      const int32_t* s2 = a.s.data() + ((r0 + r) * nb + b) * 2;
      s = V::sub(s, V::set1i(128 * (s2[0] + s2[1])));  // the w + 128 correction, in integers
#endif
      acc[r] = V::fma(V::cvt(s), V::mul(dw, V::set1(a.d[(r0 + r) * nb + b])), acc[r]);
    }
  }
  for (int r = 0; r < RT; ++r) res[r] = acc[r];
}

template <int F, int RT>
void block_tile(const QuantRows& a, int64_t r0, const BlockGroup& w, int64_t K, Lanes::F* res) {
  if constexpr (F == kQ8_0)
    q8_0_group<RT>(a, r0, w, K, res);
  else
    block_group<F, RT>(a, r0, w, K, res);
}

template <int F>
void block_tiles(int rt, const QuantRows& a, int64_t r0, const BlockGroup& w, int64_t K, Lanes::F* res) {
#define BT(RT) block_tile<F, RT>(a, r0, w, K, res)
  MOASPEC_TILES(rt, BT)
#undef BT
}

using BlockTiles = void (*)(int, const QuantRows&, int64_t, const BlockGroup&, int64_t, Lanes::F*);
constexpr BlockTiles BLOCK_TILES[kBlockFormats] = {block_tiles<kQ4_0>, block_tiles<kQ4_1>, block_tiles<kQ5_0>,
                                                   block_tiles<kQ5_1>, block_tiles<kQ8_0>, block_tiles<kQ4_K>,
                                                   block_tiles<kQ5_K>, block_tiles<kQ6_K>};
constexpr const char* BLOCK_NAMES[kBlockFormats] = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"};

// Checks a format's tensors (blocks.pack's layout, above) and returns (N, K).
std::pair<int64_t, int64_t> check_blocks(int f, const std::vector<torch::Tensor>& t) {
  TORCH_CHECK(f >= 0 && f < kBlockFormats, "unknown block format ", f);
  const char* name = BLOCK_NAMES[f];
  TORCH_CHECK(!t.empty() && t[0].dim() == 5, name, ": qs must be [out / channels, in / 32, chunks, channels, 4]");
  const int64_t C = NCH, G = t[0].size(0), B = t[0].size(1), S = B / 8;
  const bool kq = f >= kQ4_K;
  TORCH_CHECK(!kq || B % 8 == 0, name, ": in_features must be a multiple of 256");
  using Shape = std::vector<int64_t>;
  const Shape qs = {G, B, f == kQ8_0 ? 8 : 4, C, 4}, q5 = {G, B, C, 4}, q6 = {G, B, 2, C, 4}, d = {G, B, C},
              dm = {G, B, 2, C}, kdm = {G, S, 2, C}, scm = {G, S, 2, 8, C};
  const auto u8 = torch::kUInt8, i8 = torch::kInt8, f16 = torch::kFloat16;
  std::vector<std::pair<Shape, c10::ScalarType>> want;
  switch (f) {
    case kQ4_0: want = {{qs, u8}, {d, f16}}; break;
    case kQ4_1: want = {{qs, u8}, {dm, f16}}; break;
    case kQ5_0: want = {{qs, u8}, {q5, u8}, {d, f16}}; break;
    case kQ5_1: want = {{qs, u8}, {q5, u8}, {dm, f16}}; break;
    case kQ8_0: want = {{qs, i8}, {d, f16}}; break;
    case kQ4_K: want = {{qs, u8}, {kdm, f16}, {scm, u8}}; break;
    case kQ5_K: want = {{qs, u8}, {q5, u8}, {kdm, f16}, {scm, u8}}; break;
    default: want = {{qs, u8}, {q6, u8}, {{G, S, C}, f16}, {{G, S, 16, C}, i8}};
  }
  TORCH_CHECK(t.size() == want.size(), name, " takes ", want.size(), " tensors, not ", t.size(), " (blocks.pack)");
  for (size_t i = 0; i < want.size(); ++i)
    TORCH_CHECK(t[i].sizes() == c10::IntArrayRef(want[i].first) && t[i].scalar_type() == want[i].second &&
                    t[i].is_contiguous(),
                name, ": tensor ", i, " must be contiguous ", c10::toString(want[i].second), " ",
                c10::IntArrayRef(want[i].first), ", not ", t[i].scalar_type(), " ", t[i].sizes(),
                " (blocks.pack for ", NCH, " channels)");
  return {G * C, B * QK};
}

void blocks_into(int f, const std::vector<torch::Tensor>& t, const torch::Tensor& x, const float* bp, float* y,
                 int64_t ld) {
  const int64_t N = t[0].size(0) * NCH, K = t[0].size(1) * QK, R = x.size(0);
  const QuantRows a = quantize_rows(x.data_ptr<float>(), R, K, QK);
  const bool hb = f == kQ5_0 || f == kQ5_1 || f == kQ5_K || f == kQ6_K;
  const torch::Tensor* h = &t[hb ? 2 : 1];
  const torch::Tensor* sc = f >= kQ4_K ? &t[hb ? 3 : 2] : nullptr;
  const uint8_t *qs = static_cast<const uint8_t*>(t[0].data_ptr()), *qh = hb ? t[1].data_ptr<uint8_t>() : nullptr;
  const uint16_t* hp = reinterpret_cast<const uint16_t*>(h->data_ptr<at::Half>());
  const uint8_t* scp = sc ? static_cast<const uint8_t*>(sc->data_ptr()) : nullptr;
  // each tensor's first dimension is the channel group
  const int64_t qs_g = t[0].stride(0), qh_g = hb ? t[1].stride(0) : 0, h_g = h->stride(0), sc_g = sc ? sc->stride(0) : 0;
  const BlockTiles tiles = BLOCK_TILES[f];
  run_groups_into(R, N, bp, nullptr, [&](int rt, int64_t g, int64_t r0, Lanes::F* res) {
    const BlockGroup w{qs + g * qs_g, qh ? qh + g * qh_g : nullptr, hp + g * h_g, scp ? scp + g * sc_g : nullptr};
    tiles(rt, a, r0, w, K, res);
  }, y, ld);
}

// One linear layer (or one part of a `Stack` slot): kind 0 int8 [q, scale], 1 int4 [q, scale, offset] with
// `group` inputs a scale, 2 + f the GGUF block format f (blocks.FORMATS) with blocks.pack's tensors; bias
// float32 [N] or empty.
struct Part {
  int64_t kind = 0, group = 0, N = 0, K = 0;
  std::vector<torch::Tensor> t;
  torch::Tensor bias;
};

Part make_part(int64_t kind, std::vector<torch::Tensor> t, torch::Tensor bias, int64_t group) {
  Part p{kind, group, 0, 0, std::move(t), bias.defined() ? bias : torch::empty({0})};
  if (kind == 0) {
    TORCH_CHECK(p.t.size() == 2, "an int8 part is [q, scale]");
    check_q8(p.t[0], p.t[1]);
    p.N = p.t[0].size(0) * NCH, p.K = p.t[0].size(1) * 4;
  } else if (kind == 1) {
    TORCH_CHECK(p.t.size() == 3, "an int4 part is [q, scale, offset]");
    check_q4(p.t[0], p.t[1], p.t[2], group);
    p.N = p.t[0].size(0) * NCH, p.K = p.t[0].size(1) * QK;
  } else {
    std::tie(p.N, p.K) = check_blocks(static_cast<int>(kind - 2), p.t);
  }
  TORCH_CHECK(p.bias.numel() == 0 || (p.bias.numel() == p.N && p.bias.scalar_type() == torch::kFloat32 &&
                                       p.bias.is_contiguous()), "bias must be a contiguous float32 [out] tensor or empty");
  return p;
}

// y[r, :N] (row stride ld) = x @ W.T + b
void part_into(const Part& p, const torch::Tensor& x, float* y, int64_t ld) {
  const float* bp = p.bias.numel() ? p.bias.data_ptr<float>() : nullptr;
  if (p.kind == 0)
    q8_into(x, p.t[0], p.t[1], bp, y, ld);
  else if (p.kind == 1)
    q4_into(x, p.t[0], p.t[1], p.t[2], p.group, bp, y, ld);
  else
    blocks_into(static_cast<int>(p.kind - 2), p.t, x, bp, y, ld);
}

torch::Tensor linear_part(const torch::Tensor& x, int64_t kind, const std::vector<torch::Tensor>& tensors,
                          const c10::optional<torch::Tensor>& bias, int64_t group) {
  const Part p = make_part(kind, tensors, bias.has_value() ? *bias : torch::Tensor(), group);
  check_input(x, p.K);
  auto y = torch::empty({x.size(0), p.N}, torch::kFloat32);
  part_into(p, x, y.data_ptr<float>(), p.N);
  return y;
}

struct AttendArgs {
  const float *q, *k, *v;  // one query row; its KV head's keys and values
  int64_t ks, vs, T, T8;   // slot strides; slots read; T rounded up to 8
  const bool* row;         // the row's mask over T slots, or null: causal, slots 0..last
  int64_t last;
  __m256 scale;
  const float* zeros;      // a zero key for the padding
  float* out;
  int64_t nv;              // head_dim / 8
};

// One (head, row) of `attention`. NV: head_dim / 8 when it is known at compile time (else the upper
// bound of a run-time `a.nv`).
template <int NV>
void attend_row(const AttendArgs& a, float* scores, int32_t* visible) {
  const int64_t nv = NV == 32 ? a.nv : NV;
  __m256 qr[NV], acc[NV];
  for (int64_t j = 0; j < nv; ++j) qr[j] = _mm256_loadu_ps(a.q + 8 * j);
  // scores of 8 slots at once (8 independent sums, reduced together), blocks aligned at slot 0 and
  // the last one padded with zero keys: a slot's score never depends on T, n or the mask
  for (int64_t t0 = 0; t0 < a.T; t0 += 8) {
    __m256 s8[8];
    for (int s = 0; s < 8; ++s) {
      const float* kt = t0 + s < a.T ? a.k + (t0 + s) * a.ks : a.zeros;
      s8[s] = _mm256_setzero_ps();
      for (int64_t j = 0; j < nv; ++j) s8[s] = _mm256_fmadd_ps(qr[j], _mm256_loadu_ps(kt + 8 * j), s8[s]);
    }
    _mm256_storeu_ps(scores + t0, _mm256_mul_ps(hsum8(s8), a.scale));
  }
  float mx = -INFINITY;
  for (int64_t t = 0; t < a.T8; ++t) {
    const bool on = t < a.T && (a.row ? a.row[t] : t <= a.last);
    visible[t] = on ? -1 : 0;
    if (on) mx = std::max(mx, scores[t]);
  }
  // exp of 8 slots at once; invisible slots (and the padding) get exactly 0
  const __m256 mxv = _mm256_set1_ps(mx);
  for (int64_t t0 = 0; t0 < a.T8; t0 += 8) {
    const __m256 on = _mm256_castsi256_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(visible + t0)));
    _mm256_storeu_ps(scores + t0, _mm256_and_ps(on, exp256(_mm256_sub_ps(_mm256_loadu_ps(scores + t0), mxv))));
  }
  // the sums run over the visible slots in ascending order: a draft's row in a tree (its ancestors at
  // other slots than after commit) sums exactly as the decode step that would follow them
  float sum = 0.f;
  for (int64_t j = 0; j < nv; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t t = 0; t < a.T; ++t) {
    if (scores[t] == 0.f) continue;
    sum += scores[t];
    const __m256 ev = _mm256_set1_ps(scores[t]);
    const float* vt = a.v + t * a.vs;
    for (int64_t j = 0; j < nv; ++j) acc[j] = _mm256_fmadd_ps(ev, _mm256_loadu_ps(vt + 8 * j), acc[j]);
  }
  const __m256 inv = _mm256_set1_ps(sum > 0.f ? 1.f / sum : 0.f);
  for (int64_t j = 0; j < nv; ++j) _mm256_storeu_ps(a.out + 8 * j, _mm256_mul_ps(acc[j], inv));
}

// Attention whose result for a row does not depend on the other rows of the call. The int8 activation
// blocks round to the nearest step, so a difference in the last bit of an attention output (which
// SDPA has between a 1-row decode step and a k-row verification) becomes a different token now and
// then. Here each (head, row) sums over its visible slots in ascending order with a fixed vector
// order, whatever the row count, mask or thread split: a token verified in a tree gets the logits
// that plain decoding computes for it.
// q [H, n, d]; k, v [Hkv, S, d] (one layer of the cache); the first T slots are read; mask [n, T]
// (true = visible) or causal over the last n slots when absent.
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t T,
                        const c10::optional<torch::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32, "q must be float32 [heads, rows, head_dim]");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.scalar_type() == torch::kFloat32 && v.scalar_type() == torch::kFloat32,
              "k and v must be float32 [kv_heads, slots, head_dim]");
  const auto qc = q.contiguous();
  const int64_t H = q.size(0), n = q.size(1), d = q.size(2), Hkv = k.size(0);
  TORCH_CHECK(d % 8 == 0 && d <= 256 && k.size(2) == d && v.size(2) == d, "head_dim must match, be a multiple of 8 and at most 256");
  TORCH_CHECK(H % Hkv == 0 && T <= k.size(1) && T >= n, "bad head or slot counts");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k and v need contiguous head_dim");
  const bool* mp = nullptr;
  torch::Tensor mc;
  if (mask.has_value() && mask->defined()) {
    mc = mask->to(torch::kBool).contiguous();
    TORCH_CHECK(mc.dim() == 2 && mc.size(0) == n && mc.size(1) == T, "mask must be bool [rows, slots]");
    mp = mc.data_ptr<bool>();
  }
  auto out = torch::empty({H, n, d}, torch::kFloat32);
  const float* qp = qc.data_ptr<float>();
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  float* op = out.data_ptr<float>();
  const int64_t group = H / Hkv, nv = d / 8;
  const std::vector<float> zeros(d, 0.f);
  const int64_t T8 = (T + 7) / 8 * 8;
  const __m256 scale8 = _mm256_set1_ps(static_cast<float>(scale));
  at::parallel_for(0, H * n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(T8);
    std::vector<int32_t> visible(T8);
    for (int64_t hi = begin; hi < end; ++hi) {
      const int64_t h = hi / n, i = hi % n, kvh = h / group;
      const AttendArgs a{qp + (h * n + i) * d, kp + kvh * ks0, vp + kvh * vs0, ks1, vs1, T, T8, mp ? mp + i * T : nullptr,
                         T - n + i, scale8, zeros.data(), op + (h * n + i) * d, nv};
      switch (nv) {  // the common head sizes with their accumulators in registers
        case 8: attend_row<8>(a, scores.data(), visible.data()); break;
        case 16: attend_row<16>(a, scores.data(), visible.data()); break;
        default: attend_row<32>(a, scores.data(), visible.data());
      }
    }
  });
  return out;
}


// ---- the decoder layers of a pass in one call ----
// A layer's four linear slots (qkv, o, gate_up, down) are each a list of parts (`Part`: int8, int4 or a GGUF
// block format) whose outputs lie side by side: a GGUF may keep q, k and v, or gate and up, in different
// formats. A part is (kind, tensors, bias (None or empty: none), group) as `make_part` takes it.
using PartSpec = std::tuple<int64_t, std::vector<torch::Tensor>, c10::optional<torch::Tensor>, int64_t>;
// A layer: ln1, ln2, its 4 slots, its optional norms [q_norm, k_norm, post_attention, post_ffn] (undefined: none),
// which RoPE table and which mask it takes (0 the model's global one, 1 the sliding-window layers').
using LayerSpec = std::tuple<torch::Tensor, torch::Tensor, std::vector<std::vector<PartSpec>>,
                             std::vector<c10::optional<torch::Tensor>>, int64_t, int64_t>;

// Every decoder layer of a model with quantised weights, run over one sequence's new rows without
// returning to Python between layers (a 28-layer decode step made ~20 torch calls a layer). The steps
// are the functions the layer-by-layer path (`Transformer.layer_forward`) calls, in the same order, so
// both give the same bits.
class Stack {
 public:
  Stack(std::vector<LayerSpec> layers, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale,
        int64_t activation)
      : H_(heads), Hkv_(kv_heads), d_(head_dim), eps_(eps), scale_(scale), gelu_(activation == 1) {
    TORCH_CHECK(activation == 0 || activation == 1, "activation: 0 silu, 1 gelu (tanh)");
    for (auto& [ln1, ln2, slots, norms, rope_i, mask_i] : layers) {
      TORCH_CHECK(slots.size() == 4, "a layer is ln1, ln2 and 4 slots (qkv, o, gate_up, down) of parts");
      const int64_t D = ln1.numel(), qd = H_ * d_, kvd = Hkv_ * d_;
      TORCH_CHECK(ln1.scalar_type() == torch::kFloat32 && ln1.is_contiguous() && ln2.sizes() == ln1.sizes() &&
                      ln2.scalar_type() == torch::kFloat32 && ln2.is_contiguous(), "ln1 and ln2 must be contiguous float32 [hidden]");
      TORCH_CHECK(norms.size() == 4 && (rope_i == 0 || rope_i == 1) && (mask_i == 0 || mask_i == 1),
                  "a layer's extras are 4 optional norms, a RoPE table index and a mask index (0 or 1)");
      Layer l{ln1, ln2, {}, {}, rope_i, mask_i};
      for (int j = 0; j < 4; ++j) {
        if (norms[j].has_value() && norms[j]->defined()) {
          TORCH_CHECK(norms[j]->scalar_type() == torch::kFloat32 && norms[j]->is_contiguous() &&
                          norms[j]->numel() == (j < 2 ? head_dim : D), "norm ", j, " must be contiguous float32 of its size");
          l.norm[j] = *norms[j];
        }
      }
      int64_t K[4], N[4];
      for (int j = 0; j < 4; ++j) {
        TORCH_CHECK(!slots[j].empty(), "slot ", j, " has no parts");
        N[j] = 0;
        for (auto& [kind, tensors, bias, group] : slots[j]) {
          l.slot[j].push_back(make_part(kind, std::move(tensors), bias.has_value() ? *bias : torch::Tensor(), group));
          K[j] = l.slot[j][0].K;
          TORCH_CHECK(l.slot[j].back().K == K[j], "the parts of slot ", j, " take different input sizes");
          N[j] += l.slot[j].back().N;
        }
      }
      TORCH_CHECK(K[0] == D && N[0] == qd + 2 * kvd && K[1] == qd && N[1] == D && K[2] == D && N[2] % 2 == 0 &&
                      K[3] == N[2] / 2 && N[3] == D, "the slots' shapes do not chain: qkv ", K[0], "->", N[0], ", o ", K[1],
                  "->", N[1], ", gate_up ", K[2], "->", N[2], ", down ", K[3], "->", N[3], " for hidden size ", D);
      layers_.push_back(std::move(l));
    }
  }

  // x [n, D] the rows' inputs; kc, vc [L, Hkv, S, d] the sequence's cache, the rows written at slots
  // start..start+n; cos, sin_signed [n, d]; mask [n, start + n] or causal. Returns the last layer's output
  // and the inputs of the layers in `hidden`.
  std::vector<torch::Tensor> forward(torch::Tensor x, const torch::Tensor& kc, const torch::Tensor& vc, int64_t start,
                                     const std::vector<torch::Tensor>& cos, const std::vector<torch::Tensor>& sin_signed,
                                     const std::vector<c10::optional<torch::Tensor>>& masks,
                                     const std::vector<int64_t>& hidden) {
    const int64_t n = x.size(0), d = d_, qd = H_ * d, kvd = Hkv_ * d, L = static_cast<int64_t>(layers_.size());
    TORCH_CHECK(kc.dim() == 4 && kc.size(0) == L && kc.size(1) == Hkv_ && kc.size(3) == d && kc.is_contiguous() &&
                    vc.sizes() == kc.sizes() && vc.is_contiguous() && kc.scalar_type() == torch::kFloat32 &&
                    vc.scalar_type() == torch::kFloat32, "kc and vc must be contiguous float32 [layers, kv_heads, slots, head_dim]");
    TORCH_CHECK(start + n <= kc.size(2), "the cache has no room for these rows");
    TORCH_CHECK(!cos.empty() && cos.size() == sin_signed.size() && !masks.empty(), "one RoPE table at least, and one mask");
    for (const auto& c : cos) TORCH_CHECK(c.size(0) == n, "one rope row a new row");
    std::vector<torch::Tensor> out(1);
    const int64_t S = kc.size(2);
    for (int64_t i = 0; i < L; ++i) {
      if (std::find(hidden.begin(), hidden.end(), i) != hidden.end()) out.push_back(x);
      const Layer& l = layers_[i];
      TORCH_CHECK(l.rope < static_cast<int64_t>(cos.size()) && l.mask < static_cast<int64_t>(masks.size()),
                  "layer ", i, " asks for a RoPE table or mask not given");
      auto qkv = run(l.slot[0], rms_rows(x, l.ln1, eps_));
      if (l.norm[0].defined()) rms_heads_(qkv, l.norm[0], eps_, 0, H_);
      if (l.norm[1].defined()) rms_heads_(qkv, l.norm[1], eps_, qd, Hkv_);
      rope_(qkv, cos[l.rope], sin_signed[l.rope], qd + kvd);
      const float* src = qkv.data_ptr<float>();
      const int64_t N = qkv.size(1);
      float *kp = kc.data_ptr<float>() + i * Hkv_ * S * d, *vp = vc.data_ptr<float>() + i * Hkv_ * S * d;
      auto q = torch::empty({H_, n, d}, torch::kFloat32);
      float* qp = q.data_ptr<float>();
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t h = 0; h < H_; ++h) std::memcpy(qp + (h * n + r) * d, src + r * N + h * d, d * sizeof(float));
        for (int64_t h = 0; h < Hkv_; ++h) {
          std::memcpy(kp + (h * S + start + r) * d, src + r * N + qd + h * d, d * sizeof(float));
          std::memcpy(vp + (h * S + start + r) * d, src + r * N + qd + kvd + h * d, d * sizeof(float));
        }
      }
      const auto att = attention(q, kc.select(0, i), vc.select(0, i), start + n, masks[l.mask], scale_);
      auto rows = torch::empty({n, qd}, torch::kFloat32);
      const float* ap = att.data_ptr<float>();
      float* rp = rows.data_ptr<float>();
      for (int64_t h = 0; h < H_; ++h)
        for (int64_t r = 0; r < n; ++r) std::memcpy(rp + r * qd + h * d, ap + (h * n + r) * d, d * sizeof(float));
      auto o = run(l.slot[1], rows);
      x = add(x, l.norm[2].defined() ? rms_rows(o, l.norm[2], eps_) : o);
      const auto gu = run(l.slot[2], rms_rows(x, l.ln2, eps_));
      auto down = run(l.slot[3], gelu_ ? gelu_mul(gu) : silu_mul(gu));
      x = add(x, l.norm[3].defined() ? rms_rows(down, l.norm[3], eps_) : down);
    }
    out[0] = x;
    return out;
  }

 private:
  struct Layer {
    torch::Tensor ln1, ln2;
    std::vector<Part> slot[4];  // qkv, o, gate_up, down
    torch::Tensor norm[4];      // q, k (per head), after attention, after the MLP; undefined: none
    int64_t rope, mask;
  };
  static torch::Tensor run(const std::vector<Part>& parts, const torch::Tensor& x) {  // the parts side by side
    int64_t N = 0;
    for (const auto& p : parts) N += p.N;
    auto y = torch::empty({x.size(0), N}, torch::kFloat32);
    float* yp = y.data_ptr<float>();
    for (const auto& p : parts) {
      part_into(p, x, yp, N);
      yp += p.N;
    }
    return y;
  }
  static torch::Tensor add(const torch::Tensor& x, torch::Tensor y) {  // x + y, into y
    float* yp = y.data_ptr<float>();
    const float* xp = x.data_ptr<float>();
    for (int64_t i = 0; i < y.numel(); ++i) yp[i] = xp[i] + yp[i];
    return y;
  }
  std::vector<Layer> layers_;
  int64_t H_, Hkv_, d_;
  double eps_, scale_;
  bool gelu_;
};

}  // namespace

int64_t channels() { return NCH; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the compute functions let go of the GIL: a server's other threads run while a pass computes
  m.def("channels", &channels, "output channels the integer kernels interleave (quant.interleave_int8/int4)");
  m.doc() = "weight-only int8/int4 and GGUF block-format linear layers with block-quantised activations, few-row fp16 "
            "layers (AVX2)";
  m.def("linear_q8", &linear_q8, py::call_guard<py::gil_scoped_release>(), "y = x @ (q * s).T + b", py::arg("x"), py::arg("qw"), py::arg("scale"),
        py::arg("bias") = py::none());
  m.def("linear_f16", &linear_f16, py::call_guard<py::gil_scoped_release>(), "y = x @ w.T + b, fp16 weights, fp32 sums", py::arg("x"), py::arg("w"),
        py::arg("bias") = py::none());
  m.def("norm_linear_rope_f16", &norm_linear_rope_f16, "RoPE(rms_norm(x) @ w.T) on the first rope_cols columns",
        py::arg("x"), py::arg("ln"), py::arg("eps"), py::arg("w"), py::arg("cos"), py::arg("sin_signed"),
        py::arg("rope_cols"));
  m.def("block_tail_f16", &block_tail_f16, "y = x + att @ o.T; y + down(silu(g) * u), [g|u] = rms_norm(y) @ gate_up.T",
        py::arg("x"), py::arg("att"), py::arg("o"), py::arg("ln2"), py::arg("eps"), py::arg("gate_up"), py::arg("down"));
  m.def("attention", &attention, py::call_guard<py::gil_scoped_release>(), "row-invariant attention over the first T cache slots", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("T"), py::arg("mask") = py::none(), py::arg("scale"));
  m.def("rms_norm", &rms_rows, py::call_guard<py::gil_scoped_release>(), "x * rsqrt(mean(x^2) + eps) * w, row by row", py::arg("x"), py::arg("w"), py::arg("eps"));
  m.def("rope_", &rope_, "RoPE in place on the first cols columns of y", py::arg("y"), py::arg("cos"),
        py::arg("sin_signed"), py::arg("cols"));
  m.def("gelu_mul", &gelu_mul, py::call_guard<py::gil_scoped_release>(), "gelu_tanh(g) * u of [g | u]", py::arg("gate_up"));
  m.def("rms_heads_", &rms_heads_, py::call_guard<py::gil_scoped_release>(), "RMS norm in place over heads of y's columns",
        py::arg("y"), py::arg("w"), py::arg("eps"), py::arg("col0"), py::arg("heads"));
  m.def("silu_mul", &silu_mul, py::call_guard<py::gil_scoped_release>(), "silu(g) * u of [g | u]", py::arg("gate_up"));
  py::class_<Stack>(m, "Stack")
      .def(py::init<std::vector<LayerSpec>, int64_t, int64_t, int64_t, double, double, int64_t>(), py::arg("layers"),
           py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("eps"), py::arg("scale"),
           py::arg("activation") = 0)
      .def("forward", &Stack::forward, py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("k"), py::arg("v"), py::arg("start"), py::arg("cos"),
           py::arg("sin_signed"), py::arg("masks"), py::arg("hidden"));
  m.def("linear_part", &linear_part, py::call_guard<py::gil_scoped_release>(),
        "y = x @ W.T + b for one part: kind 0 int8 [q, scale], 1 int4 [q, scale, offset] (group), 2 + f GGUF block "
        "format f (blocks.pack's tensors)", py::arg("x"), py::arg("kind"), py::arg("tensors"), py::arg("bias") = py::none(),
        py::arg("group") = 0);
  m.def("linear_q4", &linear_q4, py::call_guard<py::gil_scoped_release>(), "y = x @ (q * s + m).T + b, groups of G inputs", py::arg("x"), py::arg("qw"),
        py::arg("scale"), py::arg("offset"), py::arg("group"), py::arg("bias") = py::none());
}
