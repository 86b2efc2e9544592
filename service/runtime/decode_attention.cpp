// A decode step's attention (service/runtime/attention.py): one query token per row, grouped-query heads, float32.
//
//   decode_attention(q [B, Hkv, G, Dk], k [B, Hkv, T, Dk], v [B, Hkv, T, Dv], mask [B, T] bool or None, scale,
//                    sources [B, C] int64 or None, chunk)
//     -> out [B, Hkv, G, Dv]     out[b, h, g] = softmax_t(scale * q[b, h, g] . k[b, h, t], t where mask[b, t]) . v
//
// sources: row b reads columns [c * CHUNK, (c + 1) * CHUNK) of its keys and values from row sources[b, c] (c < C;
// chunk must be CHUNK). The decode batch passes it for rows that hold the same K/V there, bitwise (a shared skill
// prefix, service/kv/batch.py), so those columns come from memory once for all of them: the tasks run chunk by
// chunk with the rows innermost, and a chunk another row just read is still in this core's cache. The same numbers
// as without it, bitwise: only where the (identical) values are read from changes.
//
// k and v may be views of a bigger buffer (the decode batch's rows, service/kv/batch.py): any strides but a
// contiguous last dimension. Each key and value is read once for the G query heads that share it (torch's CPU
// sdpa spent ~4x the time of reading K/V here: measured in docs/BENCHMARKS.md, "Decode attention"). The columns
// split into chunks of CHUNK, each an online-softmax partial (max, sum, P.V), merged in chunk order, so the work
// spreads over the threads even for one row, and a row's result depends only on its own q, K, V and mask, not on
// the other rows or how long they are (bitwise).
//
// Vector paths for AVX-512 (16 lanes, 32 registers) and AVX2 with FMA (8 lanes, 16 registers: the values' dimension
// in passes so a pass's sums stay in registers); the portable code is not run by the service (native.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {
constexpr int64_t CHUNK = 256;  // columns per partial
constexpr int64_t MAX_G = 16;   // query heads per key/value head
constexpr int64_t MAX_D = 256;  // head dimension (keys and values)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

#if defined(__AVX512F__)
inline __mmask16 tail(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

inline void axpy(float p, const float* x, float* y, int64_t n) {  // y += p * x
  const __m512 vp = _mm512_set1_ps(p);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail(n - i);
    _mm512_mask_storeu_ps(y + i, m, _mm512_fmadd_ps(vp, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i)));
  }
}

// e^x for x <= 0 (scores minus their maximum), Cephes' expf: a degree-6 polynomial on x - n ln 2, then 2^n;
// about 1 ulp. x = -inf (a masked column) gives exactly 0.
inline __m512 exp_neg(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(NEG_INF), _CMP_NEQ_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(y, n));
}

inline float max_of(const float* s, int64_t n) {
  __m512 top = _mm512_set1_ps(NEG_INF);
  for (int64_t i = 0; i < n; i += 16) top = _mm512_max_ps(top, _mm512_mask_loadu_ps(top, tail(n - i), s + i));
  return _mm512_reduce_max_ps(top);
}

// s[i] <- e^(s[i] - top) for i < n; returns their sum
inline float exp_shift(float* s, int64_t n, float top) {
  const __m512 vt = _mm512_set1_ps(top);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail(n - i);
    const __m512 e = _mm512_maskz_mov_ps(m, exp_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + i), vt)));
    _mm512_mask_storeu_ps(s + i, m, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2: the same steps on 8 lanes (16 vector registers)
inline __m256i tail(int64_t n) {  // lanes i < n
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(std::min<int64_t>(n, 8))), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline void axpy(float p, const float* x, float* y, int64_t n) {  // y += p * x
  const __m256 vp = _mm256_set1_ps(p);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i m = tail(n - i);
    _mm256_maskstore_ps(y + i, m, _mm256_fmadd_ps(vp, _mm256_maskload_ps(x + i, m), _mm256_maskload_ps(y + i, m)));
  }
}

// e^x for x <= 0, Cephes' expf as above; 2^n built in the exponent bits (n >= -126 after the clamp: a normal float)
inline __m256 exp_neg(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(NEG_INF), _CMP_NEQ_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), live);
}

inline float hsum(__m256 a) {  // lanes j + 4, then j + 2, j + 1
  const __m128 u = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_shuffle_ps(v, v, 1)));
}

inline float max_of(const float* s, int64_t n) {
  const __m256 none = _mm256_set1_ps(NEG_INF);
  __m256 top = none;
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i m = tail(n - i);
    top = _mm256_max_ps(top, _mm256_blendv_ps(none, _mm256_maskload_ps(s + i, m), _mm256_castsi256_ps(m)));
  }
  const __m128 u = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  const __m128 v = _mm_max_ps(u, _mm_movehl_ps(u, u));
  return _mm_cvtss_f32(_mm_max_ss(v, _mm_shuffle_ps(v, v, 1)));
}

// s[i] <- e^(s[i] - top) for i < n; returns their sum
inline float exp_shift(float* s, int64_t n, float top) {
  const __m256 vt = _mm256_set1_ps(top);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i m = tail(n - i);
    const __m256 e = _mm256_and_ps(exp_neg(_mm256_sub_ps(_mm256_maskload_ps(s + i, m), vt)), _mm256_castsi256_ps(m));
    _mm256_maskstore_ps(s + i, m, e);
    sum = _mm256_add_ps(sum, e);
  }
  return hsum(sum);
}
#else
inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
  for (int64_t i = 0; i < n; ++i) acc = std::fma(a[i], b[i], acc);
  return acc;
}

inline void axpy(float p, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = std::fma(p, x[i], y[i]);
}

inline float max_of(const float* s, int64_t n) { return *std::max_element(s, s + n); }

inline float exp_shift(float* s, int64_t n, float top) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += (s[i] = s[i] == NEG_INF ? 0.f : std::exp(s[i] - top));
  return sum;
}
#endif

struct Views {
  const float *q, *k, *v;
  const bool* mask;        // nullptr: every column
  const int64_t* sources;  // nullptr: every row its own; else [B, C_src], the row each chunk is read from
  int64_t C_src;
  int64_t H, G, T, Dk, Dv;
  int64_t kb, kh, kt, vb, vh, vt;  // strides in elements
  float scale;
};

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// dst[c] = scale * sums[c] for the c < live columns of a block of four
inline void put4(__m128 sums, float scale, float* dst, int64_t live) {
  alignas(16) float r[4];
  _mm_store_ps(r, _mm_mul_ps(sums, _mm_set1_ps(scale)));
  for (int64_t c = 0; c < live; ++c) dst[c] = r[c];
}
#endif

// acc[g] = sum over attended i of p[g][i] * v[t0 + i], any G and Dv, the sums in memory (each path's axpy)
inline void weighted_any(const Views& w, const float* v, const bool* mask, int64_t t0, int64_t n,
                         float (*p)[CHUNK], float* acc) {
  std::fill(acc, acc + w.G * w.Dv, 0.f);
  for (int64_t i = 0; i < n; ++i) {
    if (mask && !mask[t0 + i]) continue;
    for (int64_t g = 0; g < w.G; ++g) axpy(p[g][i], v + (t0 + i) * w.vt, acc + g * w.Dv, w.Dv);
  }
}

#if defined(__AVX512F__)
alignas(64) const float ZEROS[MAX_D] = {};  // the keys past the last column of a block of four

// Four dot products' 16-lane partial sums -> their four totals
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // a0+a2 b0+b2 a1+a3 b1+b3
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 x = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));  // a b c d per 128 bits
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// s[g][i] = scale * q[g] . k[t0 + i] for i < n, four columns at a time (the last four padded with zero keys); GG:
// the query heads, 0 = w.G at run time. A column's sum takes the same steps wherever it falls, so its score does not
// depend on n (how long the batch's longest row is).
// scores<GG> for keys of 64: the GG query heads' 4 slices held in registers for the whole chunk (GG <= 4: 16 of
// the 32 vector registers, with 4 x GG sums and 4 keys' slices), the same sums in the same order as below
template <int GG>
void scores64(const Views& w, const float* q, const float* k, int64_t t0, int64_t n, float (*s)[CHUNK]) {
  __m512 qr[GG][4];
  for (int g = 0; g < GG; ++g)
    for (int j = 0; j < 4; ++j) qr[g][j] = _mm512_loadu_ps(q + g * 64 + 16 * j);
  for (int64_t i = 0; i < n; i += 4) {
    const int64_t live = std::min<int64_t>(4, n - i);
    const float* rows[4];
    for (int c = 0; c < 4; ++c) rows[c] = c < live ? k + (t0 + i + c) * w.kt : ZEROS;
    __m512 a[GG][4];
    for (int g = 0; g < GG; ++g) a[g][0] = a[g][1] = a[g][2] = a[g][3] = _mm512_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      __m512 kc[4];
      for (int c = 0; c < 4; ++c) kc[c] = _mm512_loadu_ps(rows[c] + 16 * j);
      for (int g = 0; g < GG; ++g)
        for (int c = 0; c < 4; ++c) a[g][c] = _mm512_fmadd_ps(qr[g][j], kc[c], a[g][c]);
    }
    for (int g = 0; g < GG; ++g) put4(sum4(a[g][0], a[g][1], a[g][2], a[g][3]), w.scale, s[g] + i, live);
  }
}

template <int GG>
void scores(const Views& w, const float* q, const float* k, int64_t t0, int64_t n, float (*s)[CHUNK]) {
  if constexpr (GG >= 1 && GG <= 4) {
    if (w.Dk == 64) return scores64<GG>(w, q, k, t0, n, s);
  }
  constexpr int64_t GM = GG ? GG : MAX_G;
  const int64_t G = GG ? GG : w.G;
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 4) {
    const int64_t live = std::min<int64_t>(4, n - i);
    __m512 a[GM][4];
    for (int64_t g = 0; g < G; ++g) a[g][0] = a[g][1] = a[g][2] = a[g][3] = zero;
    const float* rows[4];
    for (int c = 0; c < 4; ++c) rows[c] = c < live ? k + (t0 + i + c) * w.kt : ZEROS;
    for (int64_t j = 0; j < w.Dk; j += 16) {
      const __mmask16 m = tail(w.Dk - j);
      __m512 kc[4];
      for (int c = 0; c < 4; ++c) kc[c] = _mm512_maskz_loadu_ps(m, rows[c] + j);
      for (int64_t g = 0; g < G; ++g) {
        const __m512 qg = _mm512_maskz_loadu_ps(m, q + g * w.Dk + j);
        for (int c = 0; c < 4; ++c) a[g][c] = _mm512_fmadd_ps(qg, kc[c], a[g][c]);
      }
    }
    for (int64_t g = 0; g < G; ++g) put4(sum4(a[g][0], a[g][1], a[g][2], a[g][3]), w.scale, s[g] + i, live);
  }
}

// acc[g] = sum over attended i of p[g][i] * v[t0 + i], the values read in order (one pass, as the hardware
// prefetcher likes it); GG query heads x NJ 16-lane slices of the values held in registers
template <int GG, int NJ>
void weighted(const Views& w, const float* v, const bool* mask, int64_t t0, int64_t n, float (*p)[CHUNK], float* acc) {
  __m512 r[GG][NJ];
  for (int g = 0; g < GG; ++g)
    for (int j = 0; j < NJ; ++j) r[g][j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    if (mask && !mask[t0 + i]) continue;
    const float* vt = v + (t0 + i) * w.vt;
    for (int j = 0; j < NJ; ++j) {
      const __m512 x = _mm512_loadu_ps(vt + 16 * j);
      for (int g = 0; g < GG; ++g) r[g][j] = _mm512_fmadd_ps(_mm512_set1_ps(p[g][i]), x, r[g][j]);
    }
  }
  for (int g = 0; g < GG; ++g)
    for (int j = 0; j < NJ; ++j) _mm512_storeu_ps(acc + g * w.Dv + 16 * j, r[g][j]);
}
#elif defined(__AVX2__) && defined(__FMA__)
alignas(32) const float ZEROS[MAX_D] = {};  // the keys past the last column of a block of four

// Four dot products' 8-lane partial sums -> their four totals (each: lanes j + 1 pairwise, then j + 2, then j + 4)
inline __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));  // a b c d per 128 bits
  return _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
}

// Keys of a multiple of 8: four columns' sums for NG <= 3 query heads in 12 of the 16 registers, each key slice
// loaded once into one and the query slices read from memory by the multiply-adds (the general code below holds four
// keys and a query slice besides all G x 4 sums, which spill to the stack: 2.5x slower per chunk for G = 3). More
// heads take groups of three over the same four keys (L1-resident). Each sum has the general code's steps, bitwise.
template <int NG>
inline void scores_of4(const float* q, int64_t Dk, const float* const* rows, float* const* s, int64_t live, float scale) {
  __m256 a[NG][4];
  for (int g = 0; g < NG; ++g) a[g][0] = a[g][1] = a[g][2] = a[g][3] = _mm256_setzero_ps();
  for (int64_t j = 0; j < Dk; j += 8) {
    for (int c = 0; c < 4; ++c) {
      const __m256 kc = _mm256_loadu_ps(rows[c] + j);
      for (int g = 0; g < NG; ++g) a[g][c] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * Dk + j), kc, a[g][c]);
    }
  }
  for (int g = 0; g < NG; ++g) put4(sum4(a[g][0], a[g][1], a[g][2], a[g][3]), scale, s[g], live);
}

template <int GG>
void scores8(const Views& w, const float* q, const float* k, int64_t t0, int64_t n, float (*s)[CHUNK]) {
  const int64_t G = GG ? GG : w.G;
  for (int64_t i = 0; i < n; i += 4) {
    const int64_t live = std::min<int64_t>(4, n - i);
    const float* rows[4];
    for (int c = 0; c < 4; ++c) rows[c] = c < live ? k + (t0 + i + c) * w.kt : ZEROS;
    for (int64_t g0 = 0; g0 < G; g0 += 3) {
      float* dst[3] = {s[g0] + i, s[std::min(g0 + 1, G - 1)] + i, s[std::min(g0 + 2, G - 1)] + i};
      const float* qg = q + g0 * w.Dk;
      switch (std::min<int64_t>(3, G - g0)) {
        case 3: scores_of4<3>(qg, w.Dk, rows, dst, live, w.scale); break;
        case 2: scores_of4<2>(qg, w.Dk, rows, dst, live, w.scale); break;
        default: scores_of4<1>(qg, w.Dk, rows, dst, live, w.scale);
      }
    }
  }
}

// s[g][i] = scale * q[g] . k[t0 + i] for i < n, four columns at a time (the last four padded with zero keys); GG:
// the query heads, 0 = w.G at run time. A column's sum takes the same steps wherever it falls.
template <int GG>
void scores(const Views& w, const float* q, const float* k, int64_t t0, int64_t n, float (*s)[CHUNK]) {
  if (w.Dk % 8 == 0) return scores8<GG>(w, q, k, t0, n, s);
  constexpr int64_t GM = GG ? GG : MAX_G;
  const int64_t G = GG ? GG : w.G;
  for (int64_t i = 0; i < n; i += 4) {
    const int64_t live = std::min<int64_t>(4, n - i);
    __m256 a[GM][4];
    for (int64_t g = 0; g < G; ++g) a[g][0] = a[g][1] = a[g][2] = a[g][3] = _mm256_setzero_ps();
    const float* rows[4];
    for (int c = 0; c < 4; ++c) rows[c] = c < live ? k + (t0 + i + c) * w.kt : ZEROS;
    for (int64_t j = 0; j < w.Dk; j += 8) {
      const __m256i m = tail(w.Dk - j);
      __m256 kc[4];
      for (int c = 0; c < 4; ++c) kc[c] = _mm256_maskload_ps(rows[c] + j, m);
      for (int64_t g = 0; g < G; ++g) {
        const __m256 qg = _mm256_maskload_ps(q + g * w.Dk + j, m);
        for (int c = 0; c < 4; ++c) a[g][c] = _mm256_fmadd_ps(qg, kc[c], a[g][c]);
      }
    }
    for (int64_t g = 0; g < G; ++g) put4(sum4(a[g][0], a[g][1], a[g][2], a[g][3]), w.scale, s[g] + i, live);
  }
}

// acc[g] = sum over attended i of p[g][i] * v[t0 + i], in order; GG query heads x NJ 8-lane slices in registers,
// the value dimension in passes of 8 * NJ. Each sum takes the same steps whatever the pass split.
template <int GG, int NJ>
void weighted(const Views& w, const float* v, const bool* mask, int64_t t0, int64_t n, float (*p)[CHUNK], float* acc) {
  for (int64_t d0 = 0; d0 < w.Dv; d0 += 8 * NJ) {
    __m256 r[GG][NJ];
    for (int g = 0; g < GG; ++g)
      for (int j = 0; j < NJ; ++j) r[g][j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      if (mask && !mask[t0 + i]) continue;
      const float* vt = v + (t0 + i) * w.vt + d0;
      for (int j = 0; j < NJ; ++j) {
        const __m256 x = _mm256_loadu_ps(vt + 8 * j);
        for (int g = 0; g < GG; ++g) r[g][j] = _mm256_fmadd_ps(_mm256_set1_ps(p[g][i]), x, r[g][j]);
      }
    }
    for (int g = 0; g < GG; ++g)
      for (int j = 0; j < NJ; ++j) _mm256_storeu_ps(acc + g * w.Dv + d0 + 8 * j, r[g][j]);
  }
}
#else
template <int GG>
void scores(const Views& w, const float* q, const float* k, int64_t t0, int64_t n, float (*s)[CHUNK]) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t g = 0; g < w.G; ++g) s[g][i] = dot(q + g * w.Dk, k + (t0 + i) * w.kt, w.Dk) * w.scale;
}

template <int GG, int NJ>
void weighted(const Views& w, const float* v, const bool* mask, int64_t t0, int64_t n, float (*p)[CHUNK], float* acc) {
  weighted_any(w, v, mask, t0, n, p, acc);
}
#endif

// One chunk of columns [t0, t1) for (b, h): its max, sum and unnormalised P.V per query head.
template <int GG, int NJ>
void partial(const Views& w, int64_t b, int64_t h, int64_t t0, int64_t t1, float* top, float* sum, float* acc) {
  const int64_t G = GG ? GG : w.G, n = t1 - t0;
  const bool* mask = w.mask ? w.mask + b * w.T : nullptr;
  std::fill(top, top + G, NEG_INF);
  std::fill(sum, sum + G, 0.f);
  const int64_t attended = mask ? std::count(mask + t0, mask + t1, true) : n;
  if (attended == 0) {  // a row shorter than the batch's longest
    std::fill(acc, acc + G * w.Dv, 0.f);
    return;
  }
  if (attended == n) mask = nullptr;  // the whole chunk: no column to skip
  float s[MAX_G][CHUNK];
  const int64_t c = t0 / CHUNK, src = w.sources && c < w.C_src ? w.sources[b * w.C_src + c] : b;
  scores<GG>(w, w.q + (b * w.H + h) * G * w.Dk, w.k + src * w.kb + h * w.kh, t0, n, s);
  for (int64_t g = 0; g < G; ++g) {
    if (mask) {
      for (int64_t i = 0; i < n; ++i) {
        if (!mask[t0 + i]) s[g][i] = NEG_INF;  // also drops whatever a masked column's key held
        top[g] = std::max(top[g], s[g][i]);
      }
    } else {
      top[g] = max_of(s[g], n);
    }
    sum[g] = exp_shift(s[g], n, top[g]);
  }
  if constexpr (GG == 0 || NJ == 0) {
    weighted_any(w, w.v + src * w.vb + h * w.vh, mask, t0, n, s, acc);
  } else {
    weighted<GG, NJ>(w, w.v + src * w.vb + h * w.vh, mask, t0, n, s, acc);
  }
}

using PartialFn = void (*)(const Views&, int64_t, int64_t, int64_t, int64_t, float*, float*, float*);

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// AVX2: query heads per key/value head 1..8, values in passes of 8 * NJ lanes with G * NJ <= 12 of the 16 vector
// registers; anything else runs the general code
template <int GG>
constexpr PartialFn BY_NJ[4] = {partial<GG, 1>, partial<GG, 2>, partial<GG, 4>, partial<GG, 8>};
constexpr const PartialFn* BY_G[9] = {nullptr, BY_NJ<1>, BY_NJ<2>, BY_NJ<3>, BY_NJ<4>,
                                      BY_NJ<5>, BY_NJ<6>, BY_NJ<7>, BY_NJ<8>};

PartialFn pick(int64_t G, int64_t Dv) {
  if (G < 1 || G > 8 || Dv % 8) return partial<0, 0>;
  int log_nj = 3;  // NJ = 8, 4, 2, 1
  while (log_nj > 0 && (G << log_nj > 12 || (Dv / 8) % (1 << log_nj))) --log_nj;
  return BY_G[G][log_nj];
}
#else

// The instantiations: query heads per key head 1..8 with value heads of 16, 32, 64 or 128 held in registers (at most
// 24 of the 32 vector registers); anything else runs the general code
template <int NJ>
constexpr PartialFn BY_G[9] = {partial<0, 0>,
                               partial<1, NJ>, partial<2, NJ>, partial<3, NJ>, partial<4, NJ>,
                               5 * NJ <= 24 ? partial<5, NJ> : partial<5, 0>, 6 * NJ <= 24 ? partial<6, NJ> : partial<6, 0>,
                               7 * NJ <= 24 ? partial<7, NJ> : partial<7, 0>, 8 * NJ <= 24 ? partial<8, NJ> : partial<8, 0>};

PartialFn pick(int64_t G, int64_t Dv) {
  if (G > 8) return partial<0, 0>;
  switch (Dv) {
    case 16: return BY_G<1>[G];
    case 32: return BY_G<2>[G];
    case 64: return BY_G<4>[G];
    case 128: return G <= 3 ? BY_G<8>[G] : partial<0, 0>;
    default: return partial<0, 0>;
  }
}
#endif
}  // namespace

at::Tensor decode_attention(at::Tensor q, at::Tensor k, at::Tensor v, const std::optional<at::Tensor>& mask_in,
                            double scale, const std::optional<at::Tensor>& sources_in, int64_t chunk) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q [B, Hkv, G, Dk], k [B, Hkv, T, Dk], v [B, Hkv, T, Dv]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "float32 q, k, v");
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), Dk = q.size(3), T = k.size(2), Dv = v.size(3);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && k.size(1) == H && v.size(1) == H && k.size(3) == Dk &&
              v.size(2) == T, "q, k, v shapes disagree");
  TORCH_CHECK(G <= MAX_G && Dk <= MAX_D && Dv <= MAX_D, "at most 16 query heads a key head, head size 256");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "k, v: contiguous last dimension");
  q = q.contiguous();
  at::Tensor mask = mask_in.has_value() ? *mask_in : at::Tensor();
  if (mask.defined()) {
    TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 2 && mask.size(0) == B && mask.size(1) == T,
                "mask: [B, T] bool");
    mask = mask.contiguous();
  }
  at::Tensor sources = sources_in.has_value() ? *sources_in : at::Tensor();
  if (sources.defined()) {
    TORCH_CHECK(chunk == CHUNK, "sources: chunks of ", CHUNK, " columns, not ", chunk);
    TORCH_CHECK(sources.scalar_type() == at::kLong && sources.dim() == 2 && sources.size(0) == B,
                "sources: [B, C] int64");
    sources = sources.contiguous();
    const int64_t* p = sources.data_ptr<int64_t>();
    TORCH_CHECK(std::all_of(p, p + sources.numel(), [B](int64_t r) { return r >= 0 && r < B; }),
                "sources: rows of this batch");
  }
  const Views w{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                mask.defined() ? mask.data_ptr<bool>() : nullptr,
                sources.defined() ? sources.data_ptr<int64_t>() : nullptr, sources.defined() ? sources.size(1) : 0,
                H, G, T, Dk, Dv,
                k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), float(scale)};
  const int64_t C = std::max<int64_t>(1, (T + CHUNK - 1) / CHUNK);
  std::vector<float> tops(B * H * C * G), sums(B * H * C * G), accs(B * H * C * G * Dv);
  auto out = at::empty({B, H, G, Dv}, q.options());
  float* o = out.data_ptr<float>();
  // OpenMP directly, on the calling thread's count from libtorch (as packed_blocks.cpp: at::parallel_for would
  // reset the serving engine's thread to the process-wide count)
  const int threads = at::get_num_threads();
  const PartialFn fn = pick(G, Dv);
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t job = 0; job < H * C * B; ++job) {  // (head, chunk, row): rows that share a chunk read it in turn
      const int64_t b = job % B, c = (job / B) % C, h = job / (B * C);
      const int64_t t0 = c * CHUNK, t1 = std::min(T, t0 + CHUNK), task = (b * H + h) * C + c;
      fn(w, b, h, t0, t1, &tops[task * G], &sums[task * G], &accs[task * G * Dv]);
    }
#pragma omp for schedule(static)
    for (int64_t bhg = 0; bhg < B * H * G; ++bhg) {  // merge the chunks in order
      const int64_t bh = bhg / G, g = bhg % G;
      float top = NEG_INF;
      for (int64_t c = 0; c < C; ++c) top = std::max(top, tops[(bh * C + c) * G + g]);
      float* dst = o + bhg * Dv;
      std::fill(dst, dst + Dv, 0.f);
      if (top == NEG_INF) continue;  // no column to attend: zeros
      float total = 0.f;
      for (int64_t c = 0; c < C; ++c) {
        const int64_t i = (bh * C + c) * G + g;
        if (tops[i] == NEG_INF) continue;
        const float f = std::exp(tops[i] - top);
        total += sums[i] * f;
        axpy(f, &accs[i * Dv], dst, Dv);
      }
      const float inv = 1.f / total;
      for (int64_t d = 0; d < Dv; ++d) dst[d] *= inv;
    }
  }
  return out;
}
