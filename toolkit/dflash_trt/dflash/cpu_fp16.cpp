// y[M, N] = x[M, K] @ W.T * g for float16 weights W, float32 x and y, on AVX2 + FMA + F16C.
//
// W is stored in blocks of 8 outputs: [N/8][K/8][8 outputs][8 inputs], so that one block streams
// from memory in order. Each (row, output) is one float32 sum, 8 lanes wide, over k in steps of 8,
// then the same horizontal add and one multiply by g: whatever the tile it is computed in, a row's
// result is the same, so it never depends on the other rows of the call (dflash/cpu_fp16.py).
#include <immintrin.h>
#include <stdint.h>

static inline float hsum(__m256 a) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// R rows by C outputs of one block: R*C accumulators, each weight vector converted once per tile.
template <int R, int C>
static inline void tile(const float* x, int64_t K, const uint16_t* w, float g, float* y,
                        int64_t N) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    const uint16_t* wk = w + k * 8;  // this block's 8 x 8 weights at inputs k..k+7
    _mm_prefetch((const char*)(wk + 512), _MM_HINT_T0);
    __m256 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x + r * K + k);
    for (int c = 0; c < C; ++c) {
      __m256 wv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(wk + c * 8)));
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * N + c] = hsum(acc[r][c]) * g;
}

// All 8 outputs of a block for R rows, C outputs at a time.
template <int R, int C>
static inline void block(const float* x, int64_t K, const uint16_t* w, float g, float* y,
                         int64_t N) {
  for (int c = 0; c < 8; c += C) tile<R, C>(x, K, w + c * 8, g, y + c, N);
}

// N and K multiples of 8; rows in tiles of 4 (8 accumulators), the rest in one smaller tile.
extern "C" void fp16_linear(const float* x, const uint16_t* w, float g, float* y, int64_t M,
                            int64_t K, int64_t N, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t n = 0; n < N; n += 8) {
    const uint16_t* wb = w + n * K;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) block<4, 2>(x + m * K, K, wb, g, y + m * N + n, N);
    switch (M - m) {
      case 3: block<3, 2>(x + m * K, K, wb, g, y + m * N + n, N); break;
      case 2: block<2, 4>(x + m * K, K, wb, g, y + m * N + n, N); break;
      case 1: block<1, 8>(x + m * K, K, wb, g, y + m * N + n, N); break;
    }
  }
}
