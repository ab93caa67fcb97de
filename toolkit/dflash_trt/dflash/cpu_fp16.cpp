// y[M, N] = x[M, K] @ W.T * g for float16 weights W, float32 x and y: `fp16_linear` on AVX2 + FMA
// + F16C, `fp16_linear_avx512` on AVX-512F (the caller picks by what the CPU has).
//
// W is stored in panels of 16 outputs: [N/16][K][16], so that one panel streams from memory in
// order. A tile of R rows keeps R x 16 sums in registers; each k converts the panel's 16 weights
// once and broadcasts each row's x[k] (the register-blocked outer product of GEMM kernels, so a
// weight read from memory serves every row of the call). Each (row, output) is one float32
// accumulator over k = 0 .. K-1 in order, then one multiply by g: whatever tile a row lands in,
// its result is the same, so it never depends on the other rows of the call (dflash/cpu_fp16.py).
// The AVX-512 kernel holds a panel's 16 outputs in one register and does the same float32
// operations in the same order per (row, output), so its results equal the AVX2 kernel's bit for
// bit; from 6 rows on each broadcast of x[k] serves two panels (32 outputs) of a tile of 8 rows.
#include <immintrin.h>
#include <stdint.h>

// R rows by the 16 outputs of one panel: 2R accumulators, 2 weight vectors, 1 broadcast.
template <int R>
__attribute__((always_inline)) static inline void tile(const float* x, int64_t K,
                                                       const uint16_t* w, float g, float* y,
                                                       int64_t N) {
  __m256 lo[R], hi[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    lo[r] = _mm256_setzero_ps();
    hi[r] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    const uint16_t* wk = w + k * 16;
    _mm_prefetch((const char*)(wk + 256), _MM_HINT_T0);
    __m256 w0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)wk));
    __m256 w1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(wk + 8)));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m256 xr = _mm256_broadcast_ss(x + r * K + k);
      lo[r] = _mm256_fmadd_ps(xr, w0, lo[r]);
      hi[r] = _mm256_fmadd_ps(xr, w1, hi[r]);
    }
  }
  __m256 scale = _mm256_set1_ps(g);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(y + r * N, _mm256_mul_ps(lo[r], scale));
    _mm256_storeu_ps(y + r * N + 8, _mm256_mul_ps(hi[r], scale));
  }
}

// The last `left` (< R) rows of a panel, in one tile of exactly that many rows.
template <int R>
static inline void rest(int64_t left, const float* x, int64_t K, const uint16_t* w, float g,
                        float* y, int64_t N) {
  if constexpr (R > 1) {
    if (left == R - 1) tile<R - 1>(x, K, w, g, y, N);
    else rest<R - 1>(left, x, K, w, g, y, N);
  }
}

// N a multiple of 16; the threads split the panels, and each panel serves all M rows in tiles of
// 6 (12 accumulators), the rest in one smaller tile, while its weights are still in cache.
extern "C" void fp16_linear(const float* x, const uint16_t* w, float g, float* y, int64_t M,
                            int64_t K, int64_t N, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t n = 0; n < N; n += 16) {
    const uint16_t* panel = w + n * K;
    int64_t m = 0;
    for (; m + 6 <= M; m += 6) tile<6>(x + m * K, K, panel, g, y + m * N + n, N);
    rest<6>(M - m, x + m * K, K, panel, g, y + m * N + n, N);
  }
}

#define AVX512 __attribute__((target("avx512f,fma,f16c")))

// R rows by P adjacent panels (16P outputs): R x P accumulators, P weight vectors; each row's
// x[k] is broadcast once and serves all P panels (two panels: one broadcast per two FMAs).
template <int R, int P>
AVX512 __attribute__((always_inline)) static inline void tile512(const float* x, int64_t K,
                                                                 const uint16_t* w, float g,
                                                                 float* y, int64_t N) {
  __m512 acc[P][R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[p][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[P];
    for (int p = 0; p < P; ++p) {
      const uint16_t* wk = w + p * 16 * K + k * 16;  // panel p is the next 16 outputs
      _mm_prefetch((const char*)(wk + 256), _MM_HINT_T0);
      wv[p] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)wk));
    }
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      __m512 xr = _mm512_set1_ps(x[r * K + k]);
      for (int p = 0; p < P; ++p) acc[p][r] = _mm512_fmadd_ps(xr, wv[p], acc[p][r]);
    }
  }
  __m512 scale = _mm512_set1_ps(g);
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p)
      _mm512_storeu_ps(y + r * N + p * 16, _mm512_mul_ps(acc[p][r], scale));
}

template <int R, int P>
AVX512 __attribute__((always_inline)) static inline void rest512(int64_t left, const float* x,
                                                                 int64_t K, const uint16_t* w,
                                                                 float g, float* y, int64_t N) {
  if constexpr (R > 1) {
    if (left == R - 1) tile512<R - 1, P>(x, K, w, g, y, N);
    else rest512<R - 1, P>(left, x, K, w, g, y, N);
  }
}

// All M rows against P panels from `panel` on: tiles of T rows, the rest in one smaller tile.
template <int P, int T>
AVX512 __attribute__((always_inline)) static inline void panels512(const float* x, int64_t M,
                                                                   int64_t K, const uint16_t* panel,
                                                                   float g, float* y, int64_t N) {
  int64_t m = 0;
  for (; m + T <= M; m += T) tile512<T, P>(x + m * K, K, panel, g, y + m * N, N);
  rest512<T, P>(M - m, x + m * K, K, panel, g, y + m * N, N);
}

static constexpr int64_t PAIR_ROWS = 6;

// As fp16_linear. From PAIR_ROWS rows on, two panels at a time (a last odd panel alone) in tiles
// of 8 rows (16 accumulators); below, one panel at a time in one tile. On a Zen 5, for a
// 576 -> 1536 layer from memory: 61 against 75 us at 8 rows, 143 against 167 at 32 for two
// panels against one; level below 6 rows.
extern "C" AVX512 void fp16_linear_avx512(const float* x, const uint16_t* w, float g, float* y,
                                          int64_t M, int64_t K, int64_t N, int threads) {
  if (M < PAIR_ROWS) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n += 16) panels512<1, 12>(x, M, K, w + n * K, g, y + n, N);
    return;
  }
  const int64_t pairs = N / 32;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < pairs; ++i) panels512<2, 8>(x, M, K, w + i * 32 * K, g, y + i * 32, N);
  if (N % 32) panels512<1, 8>(x, M, K, w + pairs * 32 * K, g, y + pairs * 32, N);
}
