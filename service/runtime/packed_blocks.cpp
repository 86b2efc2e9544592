// Packed linears' kernel (service/runtime/packed.py): y = x W^T with W held as its GGUF blocks, float32 arithmetic.
//
//   blocks_mm(x [M, K] float32, q, d [N/16, K/32, 16] float32, m [N/16, K/32, 16] float32, q4) -> y [M, N] float32
//   W[n, k] = level(n, k) * d[n/16, k/32, n%16] + m[n/16, k/32, n%16]
//
// The weight is stored in panels of P = 16 output rows, a panel's blocks in k order, and within a block the 16
// outputs' levels of one column side by side, so one column of a panel decodes into one vector register:
//   q4 (Q4_1): q [N/16, K/32, 16, 16] uint8, byte [p, b, j, i] = level(16p+i, 32b+j) | level(16p+i, 32b+j+16) << 4
//   else (Q8_0): q [N/16, K/32, 32, 16] int8, [p, b, j, i] = level(16p+i, 32b+j) in -127..127, m = 0
// 0.75 (Q4_1) or 1.125 (Q8_0) bytes a weight with the float32 scales, against float32's 4.
//
// Each column is decoded once into a register (q * d, then + m: two roundings, built with -ffp-contract=off, so the
// float32 weight the model was loaded with, bit for bit) and multiplied into up to RT input rows at once, x[r, k]
// broadcast (an outer product, as a float32 GEMM's inner kernel does it): RT rows cost RT fused multiply-adds a
// column, and the decode is paid once for them. Inputs of more than RT rows decode each panel once into a buffer
// (K x 16 floats, L1 / L2) that every tile of RT rows reads. The kernel before this layout (one output row at a
// time: 32 lane sums and a horizontal sum per row and output, the block decoded again for every output row) took
// 1.3x the time at 8 rows and 1.9x at 25 (docs/BENCHMARKS.md, "Packed decode"; bench/kernels.py --before).
//
// Every (row, output) sums in the same order whatever M is: two partial sums, the first 16 and the last 16 columns
// of each block, each over the blocks in k order, added at the end. So a request's numbers do not depend on what
// else is in its batch or chunk (bitwise, tests/runtime/test_packed.py). The panels split across the calling thread's
// torch threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {
constexpr int G = 32;   // values per block
constexpr int P = 16;   // output rows per panel (one float32 vector register)
constexpr int RT = 8;   // input rows per tile: 2 x RT accumulators + the decoded columns stay in registers

#if defined(__AVX512F__)
// NP panels' 16 outputs each for R input rows (x: row r at x + r * ldx), written to y + r * ldy; panel i's levels at
// q + i * panel_q, its scales at d, m + i * panel_s. Each output's sums are the same whatever R and NP are: NP > 1
// only gives a few rows more independent chains to overlap.
template <int R, int NP, bool Q4>
inline void tile(const float* __restrict x, int64_t ldx, int64_t K, const uint8_t* __restrict q, int64_t panel_q,
                 const float* __restrict d, const float* __restrict m, int64_t panel_s, float* __restrict y,
                 int64_t ldy) {
  __m512 a0[NP][R], a1[NP][R];  // columns 0-15 and 16-31 of every block
  for (int i = 0; i < NP; ++i)
    for (int r = 0; r < R; ++r) a0[i][r] = a1[i][r] = _mm512_setzero_ps();
  const __m128i low4 = _mm_set1_epi8(15);
  for (int64_t b = 0; b < K / G; ++b) {
    __m512 vd[NP], vm[NP];
    for (int i = 0; i < NP; ++i) {
      vd[i] = _mm512_loadu_ps(d + i * panel_s + b * P);
      vm[i] = _mm512_loadu_ps(m + i * panel_s + b * P);
    }
    const float* xb = x + b * G;
#pragma GCC unroll 2
    for (int j = 0; j < G / 2; ++j) {
      for (int i = 0; i < NP; ++i) {
        __m512 lo, hi;  // the levels of columns 32b+j and 32b+j+16, 16 outputs each
        if constexpr (Q4) {
          const __m128i raw =
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i * panel_q + (b * (G / 2) + j) * P));
          lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, low4)));
          hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low4)));
        } else {
          const int8_t* qb = reinterpret_cast<const int8_t*>(q + i * panel_q) + b * G * P;
          lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + j * P))));
          hi = _mm512_cvtepi32_ps(
              _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + (j + G / 2) * P))));
        }
        const __m512 w0 = _mm512_add_ps(_mm512_mul_ps(lo, vd[i]), vm[i]);
        const __m512 w1 = _mm512_add_ps(_mm512_mul_ps(hi, vd[i]), vm[i]);
        for (int r = 0; r < R; ++r) {
          a0[i][r] = _mm512_fmadd_ps(w0, _mm512_set1_ps(xb[r * ldx + j]), a0[i][r]);
          a1[i][r] = _mm512_fmadd_ps(w1, _mm512_set1_ps(xb[r * ldx + j + G / 2]), a1[i][r]);
        }
      }
    }
  }
  for (int i = 0; i < NP; ++i)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + i * P + r * ldy, _mm512_add_ps(a0[i][r], a1[i][r]));
}

// A panel decoded once into w [K, 16] (column k's 16 weights at w + 16k): the same two roundings as tile()
template <bool Q4>
inline void decode_panel(int64_t K, const uint8_t* __restrict q, const float* __restrict d,
                         const float* __restrict m, float* __restrict w) {
  const __m128i low4 = _mm_set1_epi8(15);
  for (int64_t b = 0; b < K / G; ++b) {
    const __m512 vd = _mm512_loadu_ps(d + b * P), vm = _mm512_loadu_ps(m + b * P);
    float* wb = w + b * G * P;
    for (int j = 0; j < G / 2; ++j) {
      __m512 lo, hi;
      if constexpr (Q4) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (b * (G / 2) + j) * P));
        lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, low4)));
        hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low4)));
      } else {
        const int8_t* qb = reinterpret_cast<const int8_t*>(q) + b * G * P;
        lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + j * P))));
        hi = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + (j + G / 2) * P))));
      }
      _mm512_storeu_ps(wb + j * P, _mm512_add_ps(_mm512_mul_ps(lo, vd), vm));
      _mm512_storeu_ps(wb + (j + G / 2) * P, _mm512_add_ps(_mm512_mul_ps(hi, vd), vm));
    }
  }
}

// tile() on a decoded panel: the same sums in the same order
template <int R>
inline void tile_decoded(const float* __restrict x, int64_t ldx, int64_t K, const float* __restrict w,
                         float* __restrict y, int64_t ldy) {
  __m512 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K / G; ++b) {
    const float* xb = x + b * G;
    const float* wb = w + b * G * P;
    for (int j = 0; j < G / 2; ++j) {
      const __m512 w0 = _mm512_loadu_ps(wb + j * P), w1 = _mm512_loadu_ps(wb + (j + G / 2) * P);
      for (int r = 0; r < R; ++r) {
        a0[r] = _mm512_fmadd_ps(w0, _mm512_set1_ps(xb[r * ldx + j]), a0[r]);
        a1[r] = _mm512_fmadd_ps(w1, _mm512_set1_ps(xb[r * ldx + j + G / 2]), a1[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, _mm512_add_ps(a0[r], a1[r]));
}
#else
template <int R, bool Q4>
inline void tile1(const float* __restrict x, int64_t ldx, int64_t K, const uint8_t* __restrict q,
                  const float* __restrict d, const float* __restrict m, float* __restrict y, int64_t ldy) {
  float a0[R][P] = {}, a1[R][P] = {};
  for (int64_t b = 0; b < K / G; ++b) {
    const float* xb = x + b * G;
    for (int j = 0; j < G / 2; ++j) {
      float w0[P], w1[P];
      for (int i = 0; i < P; ++i) {
        float lo, hi;
        if constexpr (Q4) {
          const uint8_t v = q[(b * (G / 2) + j) * P + i];
          lo = float(v & 15), hi = float(v >> 4);
        } else {
          const int8_t* qb = reinterpret_cast<const int8_t*>(q) + b * G * P;
          lo = float(qb[j * P + i]), hi = float(qb[(j + G / 2) * P + i]);
        }
        w0[i] = lo * d[b * P + i] + m[b * P + i];
        w1[i] = hi * d[b * P + i] + m[b * P + i];
      }
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < P; ++i) {
          a0[r][i] = std::fma(w0[i], xb[r * ldx + j], a0[r][i]);
          a1[r][i] = std::fma(w1[i], xb[r * ldx + j + G / 2], a1[r][i]);
        }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < P; ++i) y[r * ldy + i] = a0[r][i] + a1[r][i];
}

template <int R, int NP, bool Q4>
inline void tile(const float* __restrict x, int64_t ldx, int64_t K, const uint8_t* __restrict q, int64_t panel_q,
                 const float* __restrict d, const float* __restrict m, int64_t panel_s, float* __restrict y,
                 int64_t ldy) {
  for (int i = 0; i < NP; ++i)
    tile1<R, Q4>(x, ldx, K, q + i * panel_q, d + i * panel_s, m + i * panel_s, y + i * P, ldy);
}

template <bool Q4>
inline void decode_panel(int64_t K, const uint8_t* __restrict q, const float* __restrict d,
                         const float* __restrict m, float* __restrict w) {
  for (int64_t b = 0; b < K / G; ++b)
    for (int j = 0; j < G / 2; ++j)
      for (int i = 0; i < P; ++i) {
        float lo, hi;
        if constexpr (Q4) {
          const uint8_t v = q[(b * (G / 2) + j) * P + i];
          lo = float(v & 15), hi = float(v >> 4);
        } else {
          const int8_t* qb = reinterpret_cast<const int8_t*>(q) + b * G * P;
          lo = float(qb[j * P + i]), hi = float(qb[(j + G / 2) * P + i]);
        }
        w[(b * G + j) * P + i] = lo * d[b * P + i] + m[b * P + i];
        w[(b * G + j + G / 2) * P + i] = hi * d[b * P + i] + m[b * P + i];
      }
}

template <int R>
inline void tile_decoded(const float* __restrict x, int64_t ldx, int64_t K, const float* __restrict w,
                         float* __restrict y, int64_t ldy) {
  float a0[R][P] = {}, a1[R][P] = {};
  for (int64_t b = 0; b < K / G; ++b)
    for (int j = 0; j < G / 2; ++j)
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < P; ++i) {
          a0[r][i] = std::fma(w[(b * G + j) * P + i], x[r * ldx + b * G + j], a0[r][i]);
          a1[r][i] = std::fma(w[(b * G + j + G / 2) * P + i], x[r * ldx + b * G + j + G / 2], a1[r][i]);
        }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < P; ++i) y[r * ldy + i] = a0[r][i] + a1[r][i];
}
#endif

using TileFn = void (*)(const float*, int64_t, int64_t, const uint8_t*, int64_t, const float*, const float*, int64_t,
                       float*, int64_t);
// a decode step of R rows: R <= 4 take two panels at a time (more chains in flight), R > 4 one
template <bool Q4>
constexpr TileFn PAIRS[RT] = {tile<1, 2, Q4>, tile<2, 2, Q4>, tile<3, 2, Q4>, tile<4, 2, Q4>,
                              tile<5, 1, Q4>, tile<6, 1, Q4>, tile<7, 1, Q4>, tile<8, 1, Q4>};
template <bool Q4>
constexpr TileFn SINGLES[RT] = {tile<1, 1, Q4>, tile<2, 1, Q4>, tile<3, 1, Q4>, tile<4, 1, Q4>,
                                tile<5, 1, Q4>, tile<6, 1, Q4>, tile<7, 1, Q4>, tile<8, 1, Q4>};
using DecodedFn = void (*)(const float*, int64_t, int64_t, const float*, float*, int64_t);
constexpr DecodedFn DECODED[RT] = {tile_decoded<1>, tile_decoded<2>, tile_decoded<3>, tile_decoded<4>,
                                   tile_decoded<5>, tile_decoded<6>, tile_decoded<7>, tile_decoded<8>};
}  // namespace

at::Tensor blocks_mm(at::Tensor x, at::Tensor q, at::Tensor d, at::Tensor m, bool q4) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x: [M, K] float32");
  TORCH_CHECK(d.dim() == 3 && d.size(2) == P && d.scalar_type() == at::kFloat && m.scalar_type() == at::kFloat &&
              d.is_contiguous() && m.is_contiguous() && m.sizes() == d.sizes(), "d, m: [N/16, K/32, 16] float32");
  const int64_t M = x.size(0), K = x.size(1), panels = d.size(0), N = panels * P;
  TORCH_CHECK(K % G == 0 && d.size(1) == K / G, "x [M, K] with K = 32 x d.size(1)");
  TORCH_CHECK(q.is_contiguous() && q.scalar_type() == (q4 ? at::kByte : at::kChar) &&
              q.numel() == panels * K * P / (q4 ? 2 : 1), "q: [N/16, K/32, 16 or 32, 16] uint8 (q4) or int8");
  x = x.contiguous();
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = static_cast<const uint8_t*>(q.data_ptr());
  const float* dp = d.data_ptr<float>();
  const float* mp = m.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t panel_q = K * P / (q4 ? 2 : 1), panel_s = (K / G) * P;
  const TileFn* pairs = q4 ? PAIRS<true> : PAIRS<false>;
  const TileFn* singles = q4 ? SINGLES<true> : SINGLES<false>;
  // OpenMP directly, on the calling thread's count from libtorch: at::parallel_for's header code would start this
  // library's own copy of ATen's per-thread setup, which resets the thread to torch's process-wide count (the
  // serving engine's thread keeps its own; service/runtime/threads.py)
  const int threads = at::get_num_threads();
  if (M <= RT) {  // a decode step: each column decoded in registers, straight into the rows' sums
    const int np = M <= 4 ? 2 : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < (panels + np - 1) / np; ++g) {
      const int64_t p = g * np;
      (p + np <= panels ? pairs : singles)[M - 1](xp, K, K, qp + p * panel_q, panel_q, dp + p * panel_s,
                                                 mp + p * panel_s, panel_s, yp + p * P, N);
    }
    return y;
  }
  // more rows: each panel decoded once (K x 16 floats, in L1 / L2), then every tile of RT rows reads it
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> w(K * P);
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
      (q4 ? decode_panel<true> : decode_panel<false>)(K, qp + p * panel_q, dp + p * panel_s, mp + p * panel_s,
                                                       w.data());
      for (int64_t r0 = 0; r0 < M; r0 += RT) {
        const int64_t r = std::min<int64_t>(RT, M - r0);
        DECODED[r - 1](xp + r0 * K, K, K, w.data(), yp + r0 * N + p * P, N);
      }
    }
  }
  return y;
}
