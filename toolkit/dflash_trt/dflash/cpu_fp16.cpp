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

// ---------------------------------------------------------------------------------------------
// `bf16_linear_amx` on AMX (AMX-TILE + AMX-BF16, with AVX-512BW): tile matrix multiplies.
//
// W16 has at most 6 significant bits (dflash/cpu_fp16.py), so it is exact in bfloat16 too. AMX
// multiplies bfloat16 pairs into float32 sums; x is float32, so it goes in as three bfloat16
// parts x = hi + mid + lo, each the top 16 bits of what the parts before it left (truncation: the
// split is exact, and each part has x's sign). Every product of a part and a weight (8 x 6 bits)
// is exact in float32, so y is a float32 sum of exact products, as in the kernels above, with
// three terms per weight. Each output keeps two sums in two tiles: the hi products, and the lo then
// mid products of each 32-input step; then hi + rest, times g. The order of those operations per
// (row, output) does not depend on the row count (tiles of up to 16 rows; a call's rows past the
// last full tile are zero rows of the split), so a row's result never depends on the other rows.
//
// W is stored as bfloat16 pairs: [N/16][Kp/2][16][2] with K padded to Kp, a multiple of 32, by
// zero weights (a zero product adds nothing), so that a 32-input step of one panel is one 1 KB
// tile (16 input pairs x 16 outputs). x's split is laid out tile by tile: [3][Mp/16][Kp/32][16][32].
// The process must have asked Linux for the tile state first (`amx_enable`).
#if defined(__clang__) || __GNUC__ >= 11
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMXFN __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw")))

extern "C" int amx_enable() {
  const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
}

struct TileConfig {
  uint8_t palette, start;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3: sums (panel a hi, panel b hi, panel a rest, panel b rest); 4-6: x's lo, mid, hi
// parts; 7: a weight tile. All 64 bytes wide; `rows` rows, 16 for the weights.
AMXFN static void configure(int rows) {
  TileConfig c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = t < 7 ? rows : 16;
  }
  _tile_loadconfig(&c);
}

// x [M][K] float32 -> parts (see above), `rb` rows per tile, zeros past row M and input K.
AMXFN static void split(const float* x, int64_t M, int64_t K, int64_t Kp, int64_t rb,
                        int64_t plane, uint16_t* parts) {
  memset(parts, 0, sizeof(uint16_t) * 3 * plane);
  const __m512i top = _mm512_set1_epi32((int)0xFFFF0000u);
  for (int64_t m = 0; m < M; ++m) {
    uint16_t* row = parts + (m / rb) * rb * Kp + (m % rb) * 32;
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 live = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
      __m512 v = _mm512_maskz_loadu_ps(live, x + m * K + k);
      uint16_t* at = row + (k / 32) * rb * 32 + k % 32;
      for (int p = 0; p < 3; ++p) {
        const __m512i bits = _mm512_and_si512(_mm512_castps_si512(v), top);
        _mm256_storeu_si256((__m256i*)(at + p * plane),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
        v = _mm512_sub_ps(v, _mm512_castsi512_ps(bits));
      }
    }
  }
}

// Panels `a` and `b` (b = a for a last odd panel) against the `rows` rows of one x tile.
AMXFN static void tile_pair(const uint16_t* xs, int64_t plane, int64_t Kp, int64_t rb,
                            const uint16_t* wa, const uint16_t* wb, bool two, float g, float* y,
                            int64_t N, int64_t rows) {
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t k = 0; k < Kp; k += 32) {
    const uint16_t* xk = xs + k * rb;
    _tile_loadd(4, xk + 2 * plane, 64);
    _tile_loadd(5, xk + plane, 64);
    _tile_loadd(6, xk, 64);
    _tile_loadd(7, wa + k * 16, 64);
    _tile_dpbf16ps(2, 4, 7); _tile_dpbf16ps(0, 6, 7); _tile_dpbf16ps(2, 5, 7);
    if (two) {
      _tile_loadd(7, wb + k * 16, 64);
      _tile_dpbf16ps(3, 4, 7); _tile_dpbf16ps(1, 6, 7); _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float hi[16][32], rest[16][32];
  _tile_stored(0, &hi[0][0], 128); _tile_stored(2, &rest[0][0], 128);
  if (two) { _tile_stored(1, &hi[0][16], 128); _tile_stored(3, &rest[0][16], 128); }
  const __m512 scale = _mm512_set1_ps(g);
  for (int64_t r = 0; r < rows; ++r)
    for (int h = 0; h < (two ? 2 : 1); ++h) {
      const __m512 sum = _mm512_add_ps(_mm512_load_ps(&hi[r][16 * h]),
                                       _mm512_load_ps(&rest[r][16 * h]));
      _mm512_storeu_ps(y + r * N + 16 * h, _mm512_mul_ps(sum, scale));
    }
}

// Returns 0, or -1 where its scratch (x split in three, about 6 x M x K bytes) cannot be had.
extern "C" AMXFN int bf16_linear_amx(const float* x, const uint16_t* w, float g, float* y,
                                     int64_t M, int64_t K, int64_t N, int threads) {
  const int64_t Kp = (K + 31) / 32 * 32, rb = M < 16 ? M : 16, Mp = (M + rb - 1) / rb * rb;
  const int64_t plane = Mp * Kp, panels = N / 16, pairs = (panels + 1) / 2;
  uint16_t* parts = (uint16_t*)aligned_alloc(64, (sizeof(uint16_t) * 3 * plane + 63) / 64 * 64);
  if (parts == nullptr) return -1;
  split(x, M, K, Kp, rb, plane, parts);
#pragma omp parallel num_threads(threads)
  {
    configure((int)rb);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < pairs; ++i) {
      const uint16_t* wa = w + 2 * i * 16 * Kp;
      const bool two = 2 * i + 1 < panels;
      for (int64_t m = 0; m < Mp; m += rb)
        tile_pair(parts + m * Kp, plane, Kp, rb, wa, wa + 16 * Kp, two, g, y + m * N + 32 * i,
                  N, M - m < rb ? M - m : rb);
    }
    _tile_release();
  }
  free(parts);
  return 0;
}
#endif
