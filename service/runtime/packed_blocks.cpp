// Packed decode's kernel (service/runtime/packed.py): y = x W^T with W held as its GGUF blocks, float32 arithmetic.
//
//   blocks_mm(x [M, K] float32, q, d [N, K/32] float32, m [N, K/32] float32, q4) -> y [M, N] float32
//   W[n, k] = q[n, k] * d[n, k/32] + m[n, k/32]
//   q4 (Q4_1): q in 0..15, two to a byte, q [N, K/2] uint8: byte j of a block holds value j (low nibble) and
//              value j + 16 (high nibble), as GGUF stores them
//   else (Q8_0): q [N, K] int8 in -127..127, m = 0
//
// A weight row is read once per pass of up to ROWS input rows: each block of 32 is decoded into registers and
// multiplied into every row of the pass, so a step reads 0.75 (Q4_1) or 1.25 (Q8_0) bytes a weight instead of
// float32's 4, and the weight is never written out (but for AVX2's tiles of more than 3 rows, below). The output
// rows split across the calling thread's torch threads.
// Every (row, output) sums in the same order whatever M is (32 lane sums over the blocks, then a fixed halving tree),
// so a request's numbers do not depend on what else is in its batch.
//
// Three builds of the same sums, by what -march=native offers: AVX-512 (the rows' sums in 32 registers of 16 lanes);
// AVX2 with FMA (16 registers of 8 lanes: up to 3 rows in registers, more rows in tiles of one lane group at a
// time over weights decoded once into a buffer); and portable code, which states the order plainly but which the
// service does not run (slower than torch's float32 matmul on an AVX2 CPU; service/runtime/native.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {
constexpr int G = 32;     // values per block
constexpr int ROWS = 8;   // input rows per pass over a weight row (their partial sums stay in registers / L1)

#if defined(__AVX512F__)
// w = q * d + m for block b, the block's 32 weights left in two registers (lanes 0-15, 16-31), rounded as float32
// does it in two steps (built with -ffp-contract=off, so no fused multiply-add merges them): exactly the float32
// weight the model was loaded with
template <bool Q4>
inline void decode_regs(const uint8_t* __restrict q, int64_t b, float d, float m, __m512& w0, __m512& w1) {
  const __m512 vd = _mm512_set1_ps(d), vm = _mm512_set1_ps(m);
  __m512 lo, hi;
  if constexpr (Q4) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * (G / 2)));
    const __m128i mask = _mm_set1_epi8(15);
    lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, mask)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), mask)));
  } else {
    const int8_t* qb = reinterpret_cast<const int8_t*>(q) + b * G;
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb))));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + 16))));
  }
  w0 = _mm512_add_ps(_mm512_mul_ps(lo, vd), vm);
  w1 = _mm512_add_ps(_mm512_mul_ps(hi, vd), vm);
}

// The 32 lanes' sums of one row, in the portable code's order: lanes j + 16, then j + 8, + 4, + 2, + 1
inline float halving_sum(__m512 a0, __m512 a1) {
  const __m512 s = _mm512_add_ps(a0, a1);
  const __m256 t = _mm256_add_ps(_mm512_castps512_ps256(s),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
  const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  const __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_shuffle_ps(v, v, 1)));
}

// The R rows' 32 lane sums in registers (2R of the 32 vector registers), the block decoded once for all of them
template <int R, bool Q4>
inline void pass(const float* __restrict x, int64_t K, const uint8_t* __restrict q, const float* __restrict d,
                 const float* __restrict m, float* __restrict out) {
  __m512 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K / G; ++b) {
    __m512 w0, w1;
    decode_regs<Q4>(q, b, d[b], m[b], w0, w1);
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * K + b * G;
      a0[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), a0[r]);
      a1[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + G / 2), a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = halving_sum(a0[r], a1[r]);
}
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 (16 vector registers of 8 lanes): a row's 32 lane sums take 4 registers, so at most 3 rows stay in registers
// with the block's weights (pass); more rows run in tiles (blocks_mm_tiled). The same sums in the same order as the
// AVX-512 and portable code.
constexpr int REG_ROWS = 3;

template <bool Q4>
inline void decode_regs(const uint8_t* __restrict q, int64_t b, float d, float m, __m256 (&w)[4]) {
  const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
  __m128i part[4];  // 8 levels each, in the low 8 bytes: values 0-7, 8-15, 16-23, 24-31
  if constexpr (Q4) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * (G / 2)));
    const __m128i mask = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    part[0] = lo, part[1] = _mm_srli_si128(lo, 8), part[2] = hi, part[3] = _mm_srli_si128(hi, 8);
    for (int j = 0; j < 4; ++j)
      w[j] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part[j])), vd), vm);
  } else {
    const int8_t* qb = reinterpret_cast<const int8_t*>(q) + b * G;
    for (int j = 0; j < 4; ++j) {
      part[j] = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + 8 * j));
      w[j] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part[j])), vd), vm);
    }
  }
}

// The 32 lanes' sums of one row (lanes 0-7, 8-15, 16-23, 24-31 in a[0..3]): lanes j + 16, then j + 8, + 4, + 2, + 1
inline float halving_sum(const __m256 (&a)[4]) {
  const __m256 t = _mm256_add_ps(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[1], a[3]));
  const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  const __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_shuffle_ps(v, v, 1)));
}

// R <= 3 rows, the block decoded in registers
template <int R, bool Q4>
inline void pass(const float* __restrict x, int64_t K, const uint8_t* __restrict q, const float* __restrict d,
                 const float* __restrict m, float* __restrict out) {
  __m256 a[R][4];
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = a[r][2] = a[r][3] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / G; ++b) {
    __m256 wb[4];
    decode_regs<Q4>(q, b, d[b], m[b], wb);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) a[r][j] = _mm256_fmadd_ps(wb[j], _mm256_loadu_ps(x + r * K + b * G + 8 * j), a[r][j]);
  }
  for (int r = 0; r < R; ++r) out[r] = halving_sum(a[r]);
}

// More than 3 rows: tiles. A row's 32 lane sums are four independent sums of 8 lanes (lanes 0-7, 8-15, 16-23,
// 24-31), so they can run one lane group at a time, each still over the blocks in order: the same sums as `pass`,
// bitwise. One lane group of a tile of TILE_R input rows x TILE_N output rows is 12 sums in 12 registers beside the
// tile's 3 weights, where 3 rows' 32 lanes fill 12 registers with one output row. The weights of TILE_N output
// rows are decoded once into a buffer and the input copied once, both laid out by lane group (group j of a row: its
// values 32b + 8j .. 32b + 8j + 7, b = 0, 1, ...), so a lane group's pass reads them contiguously. The linears of a
// step of the embedded model, weights from memory (bench/kernels.py --before): 8 rows 1.1-1.2x, 16 rows 1.4x the
// decoded-row passes this replaced (docs/BENCHMARKS.md, "Packed decode").
constexpr int TILE_R = 4, TILE_N = 3;

// row [K] -> out [4][K/4]: lane group j, block b at out[j * K/4 + 8b]
inline void by_lane_group(const float* __restrict row, int64_t K, float* __restrict out) {
  for (int64_t b = 0; b < K / G; ++b)
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + j * (K / 4) + b * 8, _mm256_loadu_ps(row + b * G + 8 * j));
}

template <bool Q4>
inline void decode_by_lane_group(const uint8_t* __restrict q, const float* __restrict d, const float* __restrict m,
                                 int64_t K, float* __restrict out) {
  for (int64_t b = 0; b < K / G; ++b) {
    __m256 wb[4];
    decode_regs<Q4>(q, b, d[b], m[b], wb);
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + j * (K / 4) + b * 8, wb[j]);
  }
}

// y[r, n] (y [., N] from the tile's first row and output) for R input rows (xg [R][4][K/4], rows K apart) x NN
// output rows (wg [NN][4][K/4]): each lane group's sums over the blocks in order, then the 32 lanes' halving sum
template <int R, int NN>
inline void tile(const float* __restrict xg, const float* __restrict wg, int64_t K, int64_t N, float* __restrict y) {
  __m256 sums[R][NN][4];
  for (int j = 0; j < 4; ++j) {
    const float* xj = xg + j * (K / 4);
    const float* wj = wg + j * (K / 4);
    __m256 acc[R][NN];
    for (int r = 0; r < R; ++r)
      for (int n = 0; n < NN; ++n) acc[r][n] = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / G; ++b) {
      __m256 w[NN];
      for (int n = 0; n < NN; ++n) w[n] = _mm256_loadu_ps(wj + n * K + b * 8);
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_loadu_ps(xj + r * K + b * 8);
        for (int n = 0; n < NN; ++n) acc[r][n] = _mm256_fmadd_ps(w[n], xv, acc[r][n]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int n = 0; n < NN; ++n) sums[r][n][j] = acc[r][n];
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NN; ++n) y[r * N + n] = halving_sum(sums[r][n]);
}

template <int NN>
void tiles(const float* __restrict xg, int64_t M, int64_t K, const float* __restrict wg, int64_t N,
           float* __restrict y) {
  int64_t r0 = 0;
  for (; r0 + TILE_R <= M; r0 += TILE_R) tile<TILE_R, NN>(xg + r0 * K, wg, K, N, y + r0 * N);
  switch (M - r0) {
    case 3: tile<3, NN>(xg + r0 * K, wg, K, N, y + r0 * N); break;
    case 2: tile<2, NN>(xg + r0 * K, wg, K, N, y + r0 * N); break;
    case 1: tile<1, NN>(xg + r0 * K, wg, K, N, y + r0 * N); break;
  }
}

template <bool Q4>
void blocks_mm_tiled(const float* __restrict x, int64_t M, int64_t K, int64_t N, const uint8_t* __restrict q,
                     int64_t row_bytes, const float* __restrict d, const float* __restrict m, float* __restrict y,
                     int threads) {
  std::vector<float> xg(M * K);
  for (int64_t r = 0; r < M; ++r) by_lane_group(x + r * K, K, xg.data() + r * K);
  const int64_t groups = (N + TILE_N - 1) / TILE_N;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t g = 0; g < groups; ++g) {
    thread_local std::vector<float> wg;
    if (int64_t(wg.size()) < TILE_N * K) wg.resize(TILE_N * K);
    const int64_t n0 = g * TILE_N, nn = std::min<int64_t>(TILE_N, N - n0);
    for (int64_t n = 0; n < nn; ++n)
      decode_by_lane_group<Q4>(q + (n0 + n) * row_bytes, d + (n0 + n) * (K / G), m + (n0 + n) * (K / G), K,
                               wg.data() + n * K);
    if (nn == 3) tiles<3>(xg.data(), M, K, wg.data(), N, y + n0);
    else if (nn == 2) tiles<2>(xg.data(), M, K, wg.data(), N, y + n0);
    else tiles<1>(xg.data(), M, K, wg.data(), N, y + n0);
  }
}
#else
// w = q * d + m for block b, rounded as float32 does it in two steps (built with -ffp-contract=off, so no fused
// multiply-add merges them): exactly the float32 weight the model was loaded with.
template <bool Q4>
inline void decode(const uint8_t* __restrict q, int64_t b, float d, float m, float* __restrict w) {
  if constexpr (Q4) {
    const uint8_t* qb = q + b * (G / 2);
    for (int j = 0; j < G / 2; ++j) {
      w[j] = float(qb[j] & 15) * d + m;
      w[j + G / 2] = float(qb[j] >> 4) * d + m;
    }
  } else {
    const int8_t* qb = reinterpret_cast<const int8_t*>(q) + b * G;
    for (int j = 0; j < G; ++j) w[j] = float(qb[j]) * d + m;
  }
}

template <int R, bool Q4>
inline void pass(const float* __restrict x, int64_t K, const uint8_t* __restrict q, const float* __restrict d,
                 const float* __restrict m, float* __restrict out) {
  float acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < G; ++j) acc[r][j] = 0.f;
  for (int64_t b = 0; b < K / G; ++b) {
    float w[G];
    decode<Q4>(q, b, d[b], m[b], w);
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * K + b * G;
      for (int j = 0; j < G; ++j) acc[r][j] = std::fma(w[j], xr[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int h = G / 2; h > 0; h /= 2)
      for (int j = 0; j < h; ++j) acc[r][j] += acc[r][j + h];
    out[r] = acc[r][0];
  }
}
#endif

using PassFn = void (*)(const float*, int64_t, const uint8_t*, const float*, const float*, float*);
template <bool Q4>
constexpr PassFn PASSES[ROWS] = {pass<1, Q4>, pass<2, Q4>, pass<3, Q4>, pass<4, Q4>,
                                 pass<5, Q4>, pass<6, Q4>, pass<7, Q4>, pass<8, Q4>};
}  // namespace

at::Tensor blocks_mm(at::Tensor x, at::Tensor q, at::Tensor d, at::Tensor m, bool q4) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x: [M, K] float32");
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == (q4 ? at::kByte : at::kChar),
              "q: [N, K/2] uint8 (q4) or [N, K] int8, contiguous");
  TORCH_CHECK(d.scalar_type() == at::kFloat && m.scalar_type() == at::kFloat && d.is_contiguous() &&
              m.is_contiguous(), "d, m: [N, K/32] float32, contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(q.size(1) == (q4 ? K / 2 : K) && K % G == 0 && d.numel() == N * (K / G) && m.numel() == N * (K / G),
              "shapes: x [M, K], q [N, K/2] or [N, K], d and m [N, K/32]");
  x = x.contiguous();
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = static_cast<const uint8_t*>(q.data_ptr());
  const int64_t row_bytes = q4 ? K / 2 : K;
  const PassFn* passes = q4 ? PASSES<true> : PASSES<false>;
  const float* dp = d.data_ptr<float>();
  const float* mp = m.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // OpenMP directly, on the calling thread's count from libtorch: at::parallel_for's header code would start this
  // library's own copy of ATen's per-thread setup, which resets the thread to torch's process-wide count (the
  // serving engine's thread keeps its own; service/runtime/threads.py)
  const int threads = at::get_num_threads();
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  if (M > REG_ROWS) {
    (q4 ? blocks_mm_tiled<true> : blocks_mm_tiled<false>)(xp, M, K, N, qp, row_bytes, dp, mp, yp, threads);
    return y;
  }
#endif
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    float out[ROWS];
    for (int64_t r0 = 0; r0 < M; r0 += ROWS) {
      const int64_t r = std::min<int64_t>(ROWS, M - r0);
      passes[r - 1](xp + r0 * K, K, qp + n * row_bytes, dp + n * (K / G), mp + n * (K / G), out);
      for (int64_t i = 0; i < r; ++i) yp[(r0 + i) * N + n] = out[i];
    }
  }
  return y;
}
