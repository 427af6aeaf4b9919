/* y = x W^T (+ bias) for the few rows of a decode step, with W block-scaled FP8: e4m3 bytes [N, K] and one fp32
 * scale per (block_n x block_k) block, [ceil(N / block_n), ceil(K / block_k)] (Qwen3's and DeepSeek's FP8
 * release layout, kept as the checkpoint has it).
 *
 * Decode is bound by reading W, and W is one byte a weight here: a quarter of fp32's traffic. Each weight row is
 * read once and multiplied with every row of x (fp32, in L1), two W rows and four x rows a tile like
 * skinny_linear. A byte widens to fp32 by bits alone: its 7 magnitude bits shifted to fp32's exponent and
 * mantissa fields give the weight times 2^-120 (the exponent-bias difference), exactly, for normal and subnormal
 * e4m3 alike. Products are summed per block of block_k columns and each block's sum is multiplied by its scale,
 * so the scale costs one multiply per block, not per weight. The 2^120 is not paid per weight either: x is
 * scaled by 2^e (e = 120 unless x is large enough for that to overflow) and each block's scale by 2^(120 - e).
 * Powers of two scale exactly, so every product and sum rounds as the unscaled one would; only a product
 * below 2^-106 in size (a subnormal once scaled) could round differently. The e4m3 NaN byte (0x7F, 0xFF) reads
 * as 480: a checkpoint's weights never hold it.
 *
 * x [M, K], y [M, N] and bias [N] (or NULL): fp32, or bf16 when is_bf16. Work is split over W's rows.
 */
#include <math.h>
#include <stdlib.h>

#include "common.h"

/* the e4m3 byte's value times 2^-120 */
static inline float e4m3_raw(uint8_t b) {
    uint32_t u = ((uint32_t)(b & 0x80u) << 24) | ((uint32_t)(b & 0x7fu) << 20);
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float e4m3_to_f32(uint8_t b) { return e4m3_raw(b) * 0x1p120f; }

#if LADLE_AVX2
/* Sign-extended, a byte shifted left by 20 has its magnitude in bits 20-26 and copies of its sign in 27-31:
 * keeping bit 31 and 20-26 gives the fp32 bits in three integer operations. */
static inline __m256 e4m3x8_raw(const uint8_t *p) {
    const __m256i b = _mm256_slli_epi32(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)), 20);
    return _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32((int)0x87f00000u)));
}

static inline __m256 e4m3x8(const uint8_t *p) { return _mm256_mul_ps(e4m3x8_raw(p), _mm256_set1_ps(0x1p120f)); }

/* One x row (a batch-1 decode): out[r] = x . W row r for W rows w0, w1; no work on padding rows. */
static void tile2x1(float out[2], const float *xs, int64_t k, const uint8_t *w, int64_t w0, int64_t w1,
                    const float *scale0, const float *scale1, int64_t block_k, float unscale) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t c0 = 0, blk = 0; c0 < k; c0 += block_k, blk++) {
        const int64_t c1 = c0 + block_k < k ? c0 + block_k : k;
        /* two chains a row: an fma's latency, not its throughput, bounds one chain */
        __m256 p0 = _mm256_setzero_ps(), p1 = _mm256_setzero_ps(), q0 = _mm256_setzero_ps(), q1 = _mm256_setzero_ps();
        int64_t c = c0;
        for (; c + 16 <= c1; c += 16) {
            _mm_prefetch((const char *)w + w1 + k + c * 2, _MM_HINT_T0);
            const __m256 xa = _mm256_loadu_ps(xs + c), xb = _mm256_loadu_ps(xs + c + 8);
            p0 = _mm256_fmadd_ps(xa, e4m3x8_raw(w + w0 + c), p0);
            p1 = _mm256_fmadd_ps(xa, e4m3x8_raw(w + w1 + c), p1);
            q0 = _mm256_fmadd_ps(xb, e4m3x8_raw(w + w0 + c + 8), q0);
            q1 = _mm256_fmadd_ps(xb, e4m3x8_raw(w + w1 + c + 8), q1);
        }
        for (; c < c1; c += 8) {
            const __m256 xi = _mm256_loadu_ps(xs + c);
            p0 = _mm256_fmadd_ps(xi, e4m3x8_raw(w + w0 + c), p0);
            p1 = _mm256_fmadd_ps(xi, e4m3x8_raw(w + w1 + c), p1);
        }
        acc0 = _mm256_fmadd_ps(_mm256_add_ps(p0, q0), _mm256_set1_ps(scale0[blk] * unscale), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_add_ps(p1, q1), _mm256_set1_ps(scale1[blk] * unscale), acc1);
    }
    __m256 sums[8] = {acc0, acc1, acc0, acc1, acc0, acc1, acc0, acc1};
    float all[8];
    _mm256_storeu_ps(all, sum8x8(sums));
    out[0] = all[0];
    out[1] = all[1];
}

/* out[r * 4 + i] = x row i . W row r for W rows w0, w1 (byte offsets) and the 4 fp32 rows of xs (stride k). */
static void tile2x4(float out[8], const float *xs, int64_t k, const uint8_t *w, int64_t w0, int64_t w1,
                    const float *scale0, const float *scale1, int64_t block_k, float unscale) {
    __m256 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t c0 = 0, blk = 0; c0 < k; c0 += block_k, blk++) {
        const int64_t c1 = c0 + block_k < k ? c0 + block_k : k;
        __m256 part[8];
        for (int i = 0; i < 8; i++) part[i] = _mm256_setzero_ps();
        for (int64_t c = c0; c < c1; c += 8) {
            _mm_prefetch((const char *)w + w1 + k + c * 2, _MM_HINT_T0); /* the next tile's rows */
            const __m256 a = e4m3x8_raw(w + w0 + c), b = e4m3x8_raw(w + w1 + c);
            for (int i = 0; i < 4; i++) {
                const __m256 xi = _mm256_loadu_ps(xs + i * k + c);
                part[i] = _mm256_fmadd_ps(xi, a, part[i]);
                part[4 + i] = _mm256_fmadd_ps(xi, b, part[4 + i]);
            }
        }
        const __m256 s0 = _mm256_set1_ps(scale0[blk] * unscale), s1 = _mm256_set1_ps(scale1[blk] * unscale);
        for (int i = 0; i < 4; i++) {
            acc[i] = _mm256_fmadd_ps(part[i], s0, acc[i]);
            acc[4 + i] = _mm256_fmadd_ps(part[4 + i], s1, acc[4 + i]);
        }
    }
    _mm256_storeu_ps(out, sum8x8(acc));
}
#endif

#if LADLE_AVX512
/* e4m3x8_raw, 16 bytes at once */
static inline __m512 e4m3x16_raw(const uint8_t *p) {
    const __m512i b = _mm512_slli_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)), 20);
    return _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32((int)0x87f00000u)));
}

/* tile2x1, 16 lanes wide: k and block_k multiples of 16. */
static void tile2x1_512(float out[2], const float *xs, int64_t k, const uint8_t *w, int64_t w0, int64_t w1,
                        const float *scale0, const float *scale1, int64_t block_k, float unscale) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (int64_t c0 = 0, blk = 0; c0 < k; c0 += block_k, blk++) {
        const int64_t c1 = c0 + block_k < k ? c0 + block_k : k;
        __m512 p0 = _mm512_setzero_ps(), p1 = _mm512_setzero_ps(), q0 = _mm512_setzero_ps(), q1 = _mm512_setzero_ps();
        int64_t c = c0;
        for (; c + 32 <= c1; c += 32) {
            _mm_prefetch((const char *)w + w1 + k + c * 2, _MM_HINT_T0);
            const __m512 xa = _mm512_loadu_ps(xs + c), xb = _mm512_loadu_ps(xs + c + 16);
            p0 = _mm512_fmadd_ps(xa, e4m3x16_raw(w + w0 + c), p0);
            p1 = _mm512_fmadd_ps(xa, e4m3x16_raw(w + w1 + c), p1);
            q0 = _mm512_fmadd_ps(xb, e4m3x16_raw(w + w0 + c + 16), q0);
            q1 = _mm512_fmadd_ps(xb, e4m3x16_raw(w + w1 + c + 16), q1);
        }
        for (; c < c1; c += 16) {
            const __m512 xi = _mm512_loadu_ps(xs + c);
            p0 = _mm512_fmadd_ps(xi, e4m3x16_raw(w + w0 + c), p0);
            p1 = _mm512_fmadd_ps(xi, e4m3x16_raw(w + w1 + c), p1);
        }
        acc0 = _mm512_fmadd_ps(_mm512_add_ps(p0, q0), _mm512_set1_ps(scale0[blk] * unscale), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_add_ps(p1, q1), _mm512_set1_ps(scale1[blk] * unscale), acc1);
    }
    __m512 sums[8] = {acc0, acc1, acc0, acc1, acc0, acc1, acc0, acc1};
    float all[8];
    _mm256_storeu_ps(all, sum8x16(sums));
    out[0] = all[0];
    out[1] = all[1];
}

/* tile2x4, 16 lanes wide: k and block_k multiples of 16. */
static void tile2x4_512(float out[8], const float *xs, int64_t k, const uint8_t *w, int64_t w0, int64_t w1,
                        const float *scale0, const float *scale1, int64_t block_k, float unscale) {
    __m512 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t c0 = 0, blk = 0; c0 < k; c0 += block_k, blk++) {
        const int64_t c1 = c0 + block_k < k ? c0 + block_k : k;
        __m512 part[8];
        for (int i = 0; i < 8; i++) part[i] = _mm512_setzero_ps();
        for (int64_t c = c0; c < c1; c += 16) {
            _mm_prefetch((const char *)w + w1 + k + c * 2, _MM_HINT_T0);
            const __m512 a = e4m3x16_raw(w + w0 + c), b = e4m3x16_raw(w + w1 + c);
            for (int i = 0; i < 4; i++) {
                const __m512 xi = _mm512_loadu_ps(xs + i * k + c);
                part[i] = _mm512_fmadd_ps(xi, a, part[i]);
                part[4 + i] = _mm512_fmadd_ps(xi, b, part[4 + i]);
            }
        }
        const __m512 s0 = _mm512_set1_ps(scale0[blk] * unscale), s1 = _mm512_set1_ps(scale1[blk] * unscale);
        for (int i = 0; i < 4; i++) {
            acc[i] = _mm512_fmadd_ps(part[i], s0, acc[i]);
            acc[4 + i] = _mm512_fmadd_ps(part[4 + i], s1, acc[4 + i]);
        }
    }
    _mm256_storeu_ps(out, sum8x16(acc));
}
#endif

static void tile_scalar(float out[8], const float *xs, int64_t k, const uint8_t *w, int64_t w0, int64_t w1,
                        const float *scale0, const float *scale1, int64_t block_k, float unscale) {
    for (int r = 0; r < 2; r++)
        for (int i = 0; i < 4; i++) {
            float acc = 0.f;
            for (int64_t c0 = 0, blk = 0; c0 < k; c0 += block_k, blk++) {
                float part = 0.f;
                for (int64_t c = c0; c < c0 + block_k && c < k; c++)
                    part += xs[i * k + c] * e4m3_raw(w[(r ? w1 : w0) + c]);
                acc += part * ((r ? scale1 : scale0)[blk] * unscale);
            }
            out[r * 4 + i] = acc;
        }
}

/* Returns 0, or -1 when the fp32 copy of x could not be allocated. */
int fp8_linear(const void *x, const uint8_t *w, const float *scales, const void *bias, void *y, int64_t m,
               int64_t n, int64_t k, int64_t block_n, int64_t block_k, int is_bf16, int num_threads) {
    const int64_t m4 = (m + 3) / 4 * 4, grid_k = (k + block_k - 1) / block_k;
    const int vector = LADLE_AVX2 && k % 8 == 0 && block_k % 8 == 0;
    const int wide = LADLE_AVX512 && k % 16 == 0 && block_k % 16 == 0; /* the AVX-512 tiles */
    float *xs = malloc(sizeof(float) * (size_t)(m4 * k));
    if (xs == NULL) return -1;
    if (!(vector && m == 1)) memset(xs + m * k, 0, sizeof(float) * (size_t)((m4 - m) * k)); /* tile rows past m */
    /* Separate loops per dtype, and the largest |x| as integer bits, so the compiler vectorizes them: this is a
     * decode call's fixed cost. A NaN's bits exceed infinity's and keep e at 120 below. */
    if (is_bf16)
        for (int64_t i = 0; i < m * k; i++) {
            const uint32_t u = (uint32_t)((const uint16_t *)x)[i] << 16;
            memcpy(xs + i, &u, sizeof u);
        }
    else memcpy(xs, x, sizeof(float) * (size_t)(m * k));
    uint32_t largest = 0;
    for (int64_t i = 0; i < m * k; i++) {
        uint32_t u;
        memcpy(&u, xs + i, sizeof u);
        u &= 0x7fffffffu;
        largest = u > largest ? u : largest;
    }
    /* x * 2^e must stay below 2^128: e = 120 for |x| < 2^7, less for larger x (a non-finite x keeps 120) */
    int top = 0;
    if (largest < 0x7f800000u && largest > 0) {
        float f;
        memcpy(&f, &largest, sizeof f);
        frexpf(f, &top);
    }
    const int e = top > 7 ? 127 - top : 120;
    const float up = ldexpf(1.f, e), unscale = ldexpf(1.f, 120 - e);
    for (int64_t i = 0; i < m * k; i++) xs[i] *= up;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < (n + 1) / 2; r++) {
        const int64_t r0 = 2 * r, r1 = r0 + 1 < n ? r0 + 1 : r0;
        const float *s0 = scales + (r0 / block_n) * grid_k, *s1 = scales + (r1 / block_n) * grid_k;
        float out[8];
#if LADLE_AVX2
        if (vector && m == 1) {
#if LADLE_AVX512
            if (wide) tile2x1_512(out, xs, k, w, r0 * k, r1 * k, s0, s1, block_k, unscale);
            else
#endif
                tile2x1(out, xs, k, w, r0 * k, r1 * k, s0, s1, block_k, unscale);
            for (int64_t t = 0; t < 2 && r0 + t < n; t++)
                put(y, r0 + t, out[t] + (bias == NULL ? 0.f : get(bias, r0 + t, is_bf16)), is_bf16);
            continue;
        }
#endif
        for (int64_t i0 = 0; i0 < m4; i0 += 4) {
#if LADLE_AVX512
            if (wide) tile2x4_512(out, xs + i0 * k, k, w, r0 * k, r1 * k, s0, s1, block_k, unscale);
            else
#endif
#if LADLE_AVX2
            if (vector) tile2x4(out, xs + i0 * k, k, w, r0 * k, r1 * k, s0, s1, block_k, unscale);
            else
#endif
                tile_scalar(out, xs + i0 * k, k, w, r0 * k, r1 * k, s0, s1, block_k, unscale);
            for (int64_t t = 0; t < 2 && r0 + t < n; t++) {
                const float b = bias == NULL ? 0.f : get(bias, r0 + t, is_bf16);
                for (int64_t i = i0; i < i0 + 4 && i < m; i++) put(y, i * n + r0 + t, out[t * 4 + i - i0] + b, is_bf16);
            }
        }
    }
    free(xs);
    return 0;
}

/* out [N, K] = W (e4m3 bytes) times each entry's block scale, in fp32 or bf16 (is_bf16): a prefill's weight
 * tile widened once, for a GEMM to reuse over all its rows. Rounded once from the fp32 product, as torch's
 * (values.float() * scale).to(bf16) does. */
void fp8_dequantize(const uint8_t *w, const float *scales, void *out, int64_t n, int64_t k, int64_t block_n,
                    int64_t block_k, int is_bf16, int num_threads) {
    const int64_t grid_k = (k + block_k - 1) / block_k;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < n; r++) {
        const float *s = scales + (r / block_n) * grid_k;
        int64_t c = 0;
#if LADLE_AVX2
        if (block_k % 8 == 0)
            for (; c + 8 <= k; c += 8) {
                const __m256 v = _mm256_mul_ps(e4m3x8(w + r * k + c), _mm256_set1_ps(s[c / block_k]));
                if (!is_bf16) {
                    _mm256_storeu_ps((float *)out + r * k + c, v);
                    continue;
                }
                /* round to nearest even, as f32_to_bf16 (a weight is never NaN), then 8 x 16 bits */
                const __m256i u = _mm256_castps_si256(v);
                const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
                const __m256i b = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
                _mm_storeu_si128((__m128i *)((uint16_t *)out + r * k + c),
                                 _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
            }
#endif
        for (; c < k; c++) put(out, r * k + c, e4m3_to_f32(w[r * k + c]) * s[c / block_k], is_bf16);
    }
}
