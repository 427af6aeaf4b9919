/* y = x W^T for the few rows of a decode step, with W in MXFP4 as DeepSeek-V4's routed experts ship it: two e2m1
 * values a byte, the even input in the low nibble, [N, K / 2], and one E8M0 scale byte per 32 inputs, [N, K / 32].
 *
 * Decode is bound by reading W, here half a byte a weight (plus a byte per 32): an eighth of fp32's traffic. A
 * nibble widens by table: twice its e2m1 value is a small integer (0, 1, 2, 3, 4, 6, 8, 12, signed), looked up
 * 16 at a time with one byte shuffle, then widened to fp32. Products are summed per group of 32 inputs and each
 * group's sum multiplied by its scale over 2, exactly (a power of two), so the scale costs one multiply a group.
 * An E8M0 byte b is 2^(b - 127); 0xFF (NaN) is refused at load.
 *
 * x [M, K], y [M, N]: fp32, or bf16 when is_bf16; K a multiple of 32. Work is split over W's rows, each read
 * once for up to 4 x rows at a time.
 */
#include <math.h>
#include <stdlib.h>

#include "common.h"

static const int8_t TWICE_E2M1[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* 2^(b - 127) / 2: fp32 bits (b - 1) << 23 where that is a normal number, libm below. */
static inline float half_scale(uint8_t b) {
    if (b < 2) return ldexpf(0.5f, (int)b - 127);
    const uint32_t u = (uint32_t)(b - 1) << 23;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#if LADLE_AVX2
/* The 32 values of one group (16 bytes), twice their e2m1 values, as four vectors of 8 in input order. */
static inline void group32(const uint8_t *p, __m256 v[4]) {
    const __m128i lut = _mm_loadu_si128((const __m128i *)TWICE_E2M1), low = _mm_set1_epi8(0x0f);
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(b, low));
    const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(b, 4), low));
    const __m128i first = _mm_unpacklo_epi8(lo, hi), second = _mm_unpackhi_epi8(lo, hi);
    v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(first));
    v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(first, 8)));
    v[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(second));
    v[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(second, 8)));
}

#if !LADLE_AVX512
/* out[i] = x row i . W row r for the mi (<= 4) fp32 rows of xs (stride k). */
static void row_avx2(float *out, const float *xs, int64_t mi, int64_t k, const uint8_t *w, const uint8_t *scales) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t g = 0; g < k / 32; g++) {
        __m256 v[4];
        group32(w + g * 16, v);
        _mm_prefetch((const char *)w + k / 2 + g * 16, _MM_HINT_T0); /* the next row */
        const __m256 s = _mm256_set1_ps(half_scale(scales[g]));
        for (int64_t i = 0; i < mi; i++) {
            const float *x = xs + i * k + g * 32;
            __m256 part = _mm256_mul_ps(_mm256_loadu_ps(x), v[0]);
            part = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), v[1], part);
            part = _mm256_fmadd_ps(_mm256_loadu_ps(x + 16), v[2], part);
            part = _mm256_fmadd_ps(_mm256_loadu_ps(x + 24), v[3], part);
            acc[i] = _mm256_fmadd_ps(part, s, acc[i]);
        }
    }
    float lanes[8];
    for (int64_t i = 0; i < mi; i++) {
        _mm256_storeu_ps(lanes, acc[i]);
        out[i] = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    }
}
#endif
#endif

#if LADLE_AVX512
/* row_avx2, 16 lanes wide: a group's 32 values as two vectors of 16 in input order. */
static void row_512(float *out, const float *xs, int64_t mi, int64_t k, const uint8_t *w, const uint8_t *scales) {
    const __m128i lut = _mm_loadu_si128((const __m128i *)TWICE_E2M1), low = _mm_set1_epi8(0x0f);
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t g = 0; g < k / 32; g++) {
        const __m128i b = _mm_loadu_si128((const __m128i *)(w + g * 16));
        const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(b, low));
        const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(b, 4), low));
        const __m512 v0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi8(lo, hi)));
        const __m512 v1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpackhi_epi8(lo, hi)));
        _mm_prefetch((const char *)w + k / 2 + g * 16, _MM_HINT_T0); /* the next row */
        const __m512 s = _mm512_set1_ps(half_scale(scales[g]));
        for (int64_t i = 0; i < mi; i++) {
            const float *x = xs + i * k + g * 32;
            const __m512 part = _mm512_fmadd_ps(_mm512_loadu_ps(x + 16), v1, _mm512_mul_ps(_mm512_loadu_ps(x), v0));
            acc[i] = _mm512_fmadd_ps(part, s, acc[i]);
        }
    }
    for (int64_t i = 0; i < mi; i++) out[i] = _mm512_reduce_add_ps(acc[i]);
}
#endif

static void row_scalar(float *out, const float *xs, int64_t mi, int64_t k, const uint8_t *w, const uint8_t *scales) {
    for (int64_t i = 0; i < mi; i++) {
        float acc = 0.f;
        for (int64_t g = 0; g < k / 32; g++) {
            float part = 0.f;
            for (int64_t c = g * 32; c < g * 32 + 32; c++) {
                const uint8_t b = w[c / 2];
                part += xs[i * k + c] * (float)TWICE_E2M1[c % 2 ? b >> 4 : b & 0x0f];
            }
            acc += part * half_scale(scales[g]);
        }
        out[i] = acc;
    }
}

/* Returns 0, or -1 when the fp32 copy of x could not be allocated, -2 when K is not a multiple of 32. */
int mxfp4_linear(const void *x, const uint8_t *w, const uint8_t *scales, void *y, int64_t m, int64_t n, int64_t k,
                 int is_bf16, int num_threads) {
    if (k % 32) return -2;
    float *xs = malloc((size_t)(m * k) * sizeof(float));
    if (xs == NULL) return -1;
    for (int64_t i = 0; i < m * k; i++) xs[i] = get(x, i, is_bf16);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < n; r++) {
        for (int64_t i0 = 0; i0 < m; i0 += 4) {
            const int64_t mi = m - i0 < 4 ? m - i0 : 4;
            float out[4];
#if LADLE_AVX512
            row_512(out, xs + i0 * k, mi, k, w + r * (k / 2), scales + r * (k / 32));
#elif LADLE_AVX2
            row_avx2(out, xs + i0 * k, mi, k, w + r * (k / 2), scales + r * (k / 32));
#else
            row_scalar(out, xs + i0 * k, mi, k, w + r * (k / 2), scales + r * (k / 32));
#endif
            for (int64_t i = 0; i < mi; i++) put(y, (i0 + i) * n + r, out[i], is_bf16);
        }
    }
    free(xs);
    return 0;
}

/* out [N, K] = the MXFP4 weight widened, in fp32 or bf16 (is_bf16): a prefill's expert widened once for a GEMM. */
void mxfp4_dequantize(const uint8_t *w, const uint8_t *scales, void *out, int64_t n, int64_t k, int is_bf16,
                      int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < n; r++)
        for (int64_t g = 0; g < k / 32; g++) {
            const float s = half_scale(scales[r * (k / 32) + g]);
#if LADLE_AVX2
            { /* an e2m1 value times a power of two has 2 significant bits: exact in fp32 and in bf16, whose
               * bits are then the fp32 bits' top half, as the scalar path's rounding gives */
                __m256 v[4];
                group32(w + r * (k / 2) + g * 16, v);
                for (int j = 0; j < 4; j++) {
                    const __m256 y = _mm256_mul_ps(v[j], _mm256_set1_ps(s));
                    const int64_t at = r * k + g * 32 + 8 * j;
                    if (!is_bf16) {
                        _mm256_storeu_ps((float *)out + at, y);
                        continue;
                    }
                    const __m256i top = _mm256_srli_epi32(_mm256_castps_si256(y), 16);
                    _mm_storeu_si128((__m128i *)((uint16_t *)out + at),
                                     _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1)));
                }
                continue;
            }
#endif
            for (int64_t c = g * 32; c < g * 32 + 32; c++) {
                const uint8_t b = w[r * (k / 2) + c / 2];
                put(out, r * k + c, (float)TWICE_E2M1[c % 2 ? b >> 4 : b & 0x0f] * s, is_bf16);
            }
        }
}
