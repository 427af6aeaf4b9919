/* y = x W^T (+ bias) for the few rows of a decode step, with W as nn.Linear keeps it ([N, K], row-major).
 *
 * A decode step multiplies a handful of rows by every weight of the model once, so it is bound by reading W:
 * this kernel reads each weight row once and multiplies it with every row of x (kept in L1), four rows of x and
 * two of W per tile, eight fp32 accumulators reduced together. BLAS and oneDNN reach a third to a half of the
 * memory bandwidth at these shapes here (benchmarks/cpu_linear.py). bf16 weights are widened on the fly, so a
 * bf16 model reads half the bytes; accumulation is fp32 and the result is rounded once, as torch's bf16 matmul
 * does. With AVX-512 BF16 a bf16 tile multiplies bf16 pairs directly (vdpbf16ps: each product of two bf16 values
 * is exact in fp32, summed in fp32), so nothing is widened. On a Zen 4 EPYC (benchmarks/cpu_isa.py and repeats of
 * its kernel table) it ran 1.5-1.9x the widening tile at 8-16 rows and 1.2-1.4x at one row (its own tile), but
 * 0.75-1.15x at 2-4 rows, unexplained yet; it runs at every row count, so a row's bits never depend on the batch. A 16-lane fp32 tile measured 1.1-1.2x slower there than this 8-lane one
 * (its 512-bit units are double-pumped 256-bit ones, and the read of W bounds the kernel), so fp32 keeps it.
 *
 * x [M, K], y [M, N]: both of the weight's dtype; bias [N] of that dtype or NULL. Work is split over W's rows.
 */
#include <stdlib.h>

#include "common.h"

#if LADLE_AVX2
/* out[r * 4 + i] = x row i . W row r, for W rows w0, w1 and the 4 fp32 rows of xs (stride k). */
static inline void tile2x4(float out[8], const float *xs, int64_t k, const void *w, int64_t w0, int64_t w1,
                           int is_bf16) {
    __m256 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    const int64_t size = is_bf16 ? 2 : 4;
    const char *ahead = (const char *)w + (w1 + k) * size; /* the next tile's two rows, adjacent in memory */
    for (int64_t c = 0; c < k; c += 8) {
        /* One tile's loads keep too little of memory's latency in flight for the hardware prefetcher alone:
         * ask for the next tile's rows now, a cache line (16 values of either row pair's 2k) per step. */
        _mm_prefetch(ahead + c * 2 * size, _MM_HINT_T0);
        const __m256 a = load8(w, w0 + c, is_bf16), b = load8(w, w1 + c, is_bf16);
        for (int i = 0; i < 4; i++) {
            const __m256 xi = _mm256_loadu_ps(xs + i * k + c);
            acc[i] = _mm256_fmadd_ps(xi, a, acc[i]);
            acc[4 + i] = _mm256_fmadd_ps(xi, b, acc[4 + i]);
        }
    }
    _mm256_storeu_ps(out, sum8x8(acc));
}
#endif

#if LADLE_AVX512_BF16
/* tile2x4 for bf16 rows of x (xb, stride k) and W, 32 values a step: k a multiple of 32. rows (a constant at
 * each call: 4, or 1 for a batch-1 decode, which skips the padding rows' work) of x are real; a row's chains and
 * their reduction are the same either way, so its result does not depend on the batch. */
static inline __attribute__((always_inline)) void tile2x4_bf16(float out[8], const uint16_t *xb, int64_t k,
                                                                 const uint16_t *w, int64_t w0, int64_t w1,
                                                                 const int rows) {
    __m512 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm512_setzero_ps();
    const char *ahead = (const char *)(w + w1 + k);
    for (int64_t c = 0; c < k; c += 32) {
        _mm_prefetch(ahead + c * 4, _MM_HINT_T0);
        _mm_prefetch(ahead + c * 4 + 64, _MM_HINT_T0);
        const __m512bh a = (__m512bh)_mm512_loadu_si512(w + w0 + c), b = (__m512bh)_mm512_loadu_si512(w + w1 + c);
        for (int i = 0; i < rows; i++) {
            const __m512bh xi = (__m512bh)_mm512_loadu_si512(xb + i * k + c);
            acc[i] = _mm512_dpbf16_ps(acc[i], xi, a);
            acc[4 + i] = _mm512_dpbf16_ps(acc[4 + i], xi, b);
        }
    }
    _mm256_storeu_ps(out, sum8x16(acc));
}
#endif

static inline void tile_scalar(float out[8], const float *xs, int64_t k, const void *w, int64_t w0, int64_t w1,
                               int is_bf16) {
    for (int r = 0; r < 2; r++)
        for (int i = 0; i < 4; i++) {
            float acc = 0.f;
            for (int64_t c = 0; c < k; c++) acc += xs[i * k + c] * get(w, (r ? w1 : w0) + c, is_bf16);
            out[r * 4 + i] = acc;
        }
}

/* rows: how many of the tile's 4 x rows are real (the rest pad) */
static inline void tile(float out[8], const float *xs, const uint16_t *xb, int64_t rows, int64_t k, const void *w,
                        int64_t w0, int64_t w1, int is_bf16) {
#if LADLE_AVX512_BF16
    if (xb != NULL) {
        if (rows == 1) tile2x4_bf16(out, xb, k, (const uint16_t *)w, w0, w1, 1);
        else tile2x4_bf16(out, xb, k, (const uint16_t *)w, w0, w1, 4);
        return;
    }
#else
    (void)rows;
#endif
#if LADLE_AVX2
    if (k % 8 == 0) {
        tile2x4(out, xs, k, w, w0, w1, is_bf16);
        return;
    }
#endif
    tile_scalar(out, xs, k, w, w0, w1, is_bf16);
}

/* Returns 0, or -1 when the copy of x could not be allocated. */
int skinny_linear(const void *x, const void *w, const void *bias, void *y, int64_t m, int64_t n, int64_t k,
                  int is_bf16, int num_threads) {
    const int64_t m4 = (m + 3) / 4 * 4;
    /* x's rows padded to a multiple of 4: as bf16 where the bf16 tile runs, else widened to fp32 */
    const int pairs = LADLE_AVX512_BF16 && is_bf16 && k % 32 == 0;
    float *xs = NULL;
    uint16_t *xb = NULL;
    if (pairs) {
        xb = calloc((size_t)(m4 * k), sizeof(uint16_t));
        if (xb == NULL) return -1;
        memcpy(xb, x, sizeof(uint16_t) * (size_t)(m * k));
    } else {
        xs = calloc((size_t)(m4 * k), sizeof(float));
        if (xs == NULL) return -1;
        for (int64_t i = 0; i < m * k; i++) xs[i] = get(x, i, is_bf16);
    }
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < (n + 1) / 2; r++) {
        const int64_t r0 = 2 * r, r1 = r0 + 1 < n ? r0 + 1 : r0; /* an odd last row pairs with itself */
        float out[8];
        for (int64_t i0 = 0; i0 < m4; i0 += 4) {
            tile(out, xs == NULL ? NULL : xs + i0 * k, xb == NULL ? NULL : xb + i0 * k, m - i0, k, w, r0 * k, r1 * k,
                 is_bf16);
            for (int64_t t = 0; t < 2 && r0 + t < n; t++) {
                const float b = bias == NULL ? 0.f : get(bias, r0 + t, is_bf16);
                for (int64_t i = i0; i < i0 + 4 && i < m; i++) put(y, i * n + r0 + t, out[t * 4 + i - i0] + b, is_bf16);
            }
        }
    }
    free(xs);
    free(xb);
    return 0;
}
