/* y = x W^T (+ bias) for the few rows of a decode step, with W in a GGUF file's block format, kept as the file
 * has it: each weight row is row_bytes of consecutive 32-weight blocks, one of
 *   Q8_0 (type 8):  fp16 d, 32 int8 q            weight = d * q        34 bytes
 *   Q4_0 (type 2):  fp16 d, 16 bytes of nibbles  weight = d * (q - 8)  18 bytes
 *   Q4_1 (type 3):  fp16 d, fp16 m, 16 bytes     weight = d * q + m    20 bytes
 * where byte j of a 4-bit block holds weight j in its low nibble and weight j + 16 in its high one (ggml's
 * block_q8_0 / block_q4_0 / block_q4_1).
 *
 * Decode is bound by reading W: Q4_1 moves 0.625 bytes a weight, a sixth of fp32's. Each block's integers are
 * widened to fp32 once and multiplied with every x row; a row's sum over the block is scaled by d once (and
 * Q4_1 adds m times the x row's sum over the block), so d and m cost one multiply a block, not a weight.
 *
 * ggml_dequantize widens rows to fp32 (or bf16) for a prefill's GEMM: each weight computed as gguf's own
 * dequantize computes it (d * q, d * (q - 8), d * q + m, in fp32, no fused multiply-add: the library is built
 * with -ffp-contract=off), so a widened tile holds exactly the values of a model widened at load.
 *
 * x [M, K], y [M, N] and bias [N] (or NULL): fp32, or bf16 when is_bf16. Work is split over W's rows.
 */
#include <stdlib.h>

#include "common.h"

enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q8_0 = 8, BLOCK = 32 };

/* IEEE half to float, exactly (normal, subnormal, zero, inf, NaN). */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    uint32_t u;
    if (exp == 0x1f) u = sign | 0x7f800000u | (mant << 13);
    else if (exp != 0) u = sign | ((exp + 112) << 23) | (mant << 13);
    else if (mant == 0) u = sign;
    else { /* subnormal: mant * 2^-24, exact in fp32 */
        float f = (float)mant * 0x1p-24f;
        memcpy(&u, &f, sizeof u);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline int block_bytes(int type) { return type == GGML_Q8_0 ? 34 : type == GGML_Q4_0 ? 18 : 20; }

/* The block's 32 integers (q, or q - 8 for Q4_0) as floats; *d and *m its scale and (Q4_1) minimum. */
static inline void block_ints(const uint8_t *b, int type, float q[BLOCK], float *d, float *m) {
    uint16_t h;
    memcpy(&h, b, 2);
    *d = f16_to_f32(h);
    *m = 0.f;
    if (type == GGML_Q8_0) {
        for (int j = 0; j < BLOCK; j++) q[j] = (float)(int8_t)b[2 + j];
        return;
    }
    const uint8_t *nib = b + (type == GGML_Q4_1 ? 4 : 2);
    if (type == GGML_Q4_1) {
        memcpy(&h, b + 2, 2);
        *m = f16_to_f32(h);
    }
    const int off = type == GGML_Q4_0 ? 8 : 0;
    for (int j = 0; j < BLOCK / 2; j++) {
        q[j] = (float)((nib[j] & 0x0f) - off);
        q[j + BLOCK / 2] = (float)((nib[j] >> 4) - off);
    }
}

#if LADLE_AVX2
static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h); /* exact, as f16_to_f32 */
#else
    return f16_to_f32(h);
#endif
}

/* The block's 32 integers as four vectors of 8 floats (weights 0-7, 8-15, 16-23, 24-31), as block_ints. */
static inline void block_ints8(const uint8_t *b, int type, __m256 q[4], float *d, float *m) {
    *d = half_at(b);
    *m = 0.f;
    if (type == GGML_Q8_0) {
        for (int t = 0; t < 4; t++)
            q[t] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * t))));
        return;
    }
    if (type == GGML_Q4_1) *m = half_at(b + 2);
    const __m128i raw = _mm_loadu_si128((const __m128i *)(b + (type == GGML_Q4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    if (type == GGML_Q4_0)
        for (int t = 0; t < 4; t++) q[t] = _mm256_sub_ps(q[t], _mm256_set1_ps(8.f)); /* small integers: exact */
}

/* One x row (a batch-1 decode): the dot of x with W row `row`, blocks of the given type. */
static float row_dot1(const float *xs, const float *xsum, const uint8_t *row, int64_t blocks, int type, int bytes) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float tail = 0.f;
    for (int64_t b = 0; b < blocks; b++) {
        __m256 q[4];
        float d, mn;
        _mm_prefetch((const char *)row + (b + 4) * bytes, _MM_HINT_T0);
        block_ints8(row + b * bytes, type, q, &d, &mn);
        const float *xb = xs + b * BLOCK;
        __m256 p = _mm256_mul_ps(_mm256_loadu_ps(xb), q[0]);
        __m256 p2 = _mm256_mul_ps(_mm256_loadu_ps(xb + 8), q[1]);
        p = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), q[2], p);
        p2 = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), q[3], p2);
        if (b & 1) acc1 = _mm256_fmadd_ps(_mm256_add_ps(p, p2), _mm256_set1_ps(d), acc1);
        else acc0 = _mm256_fmadd_ps(_mm256_add_ps(p, p2), _mm256_set1_ps(d), acc0);
        tail += mn * xsum[b];
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_add_ps(acc0, acc1));
    return tail + (((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7])));
}
#endif

/* Returns 0, or -1 when the fp32 copy of x could not be allocated or the type is not one of the three. */
int ggml_linear(const void *x, const uint8_t *w, const void *bias, void *y, int64_t m, int64_t n, int64_t k,
                int type, int is_bf16, int num_threads) {
    if ((type != GGML_Q8_0 && type != GGML_Q4_0 && type != GGML_Q4_1) || k % BLOCK) return -1;
    const int64_t blocks = k / BLOCK, row_bytes = blocks * block_bytes(type);
    /* x in fp32, and (Q4_1) each x row's sum over each block, for the m * sum(x) term */
    float *xs = malloc(sizeof(float) * (size_t)(m * k + m * blocks));
    if (xs == NULL) return -1;
    float *xsum = xs + m * k;
    for (int64_t i = 0; i < m * k; i++) xs[i] = get(x, i, is_bf16);
    for (int64_t i = 0; i < m; i++)
        for (int64_t b = 0; b < blocks; b++) {
            float s = 0.f;
            for (int j = 0; j < BLOCK; j++) s += xs[i * k + b * BLOCK + j];
            xsum[i * blocks + b] = s;
        }
#if LADLE_AVX2
    if (m == 1) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t r = 0; r < n; r++)
            put(y, r, row_dot1(xs, xsum, w + r * row_bytes, blocks, type, block_bytes(type))
                          + (bias == NULL ? 0.f : get(bias, r, is_bf16)), is_bf16);
        free(xs);
        return 0;
    }
#endif
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *row = w + r * row_bytes;
        float acc_tail[64];
        for (int64_t i0 = 0; i0 < m; i0 += 64) { /* x rows in groups of 64 (a decode step has at most a few) */
            const int64_t mi = m - i0 < 64 ? m - i0 : 64;
#if LADLE_AVX2
            __m256 acc[64];
            for (int64_t i = 0; i < mi; i++) acc[i] = _mm256_setzero_ps();
#endif
            for (int64_t i = 0; i < mi; i++) acc_tail[i] = 0.f;
            for (int64_t b = 0; b < blocks; b++) {
                float d, mn;
#if LADLE_AVX2
                __m256 qv[4];
                block_ints8(row + b * block_bytes(type), type, qv, &d, &mn);
                const __m256 q0 = qv[0], q1 = qv[1], q2 = qv[2], q3 = qv[3], dv = _mm256_set1_ps(d);
                for (int64_t i = 0; i < mi; i++) {
                    const float *xb = xs + (i0 + i) * k + b * BLOCK;
                    __m256 p = _mm256_mul_ps(_mm256_loadu_ps(xb), q0);
                    __m256 p2 = _mm256_mul_ps(_mm256_loadu_ps(xb + 8), q1);
                    p = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), q2, p);
                    p2 = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), q3, p2);
                    acc[i] = _mm256_fmadd_ps(_mm256_add_ps(p, p2), dv, acc[i]);
                    acc_tail[i] += mn * xsum[(i0 + i) * blocks + b];
                }
#else
                float q[BLOCK];
                block_ints(row + b * block_bytes(type), type, q, &d, &mn);
                for (int64_t i = 0; i < mi; i++) {
                    const float *xb = xs + (i0 + i) * k + b * BLOCK;
                    float p = 0.f;
                    for (int j = 0; j < BLOCK; j++) p += xb[j] * q[j];
                    acc_tail[i] += p * d + mn * xsum[(i0 + i) * blocks + b];
                }
#endif
            }
            for (int64_t i = 0; i < mi; i++) {
                float total = acc_tail[i];
#if LADLE_AVX2
                float lanes[8];
                _mm256_storeu_ps(lanes, acc[i]);
                total += ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
#endif
                put(y, (i0 + i) * n + r, total + (bias == NULL ? 0.f : get(bias, r, is_bf16)), is_bf16);
            }
        }
    }
    free(xs);
    return 0;
}

/* out [N, K] = W's rows widened, in fp32 or bf16 (is_bf16; rounded once from the fp32 value). */
void ggml_dequantize(const uint8_t *w, void *out, int64_t n, int64_t k, int type, int is_bf16, int num_threads) {
    const int64_t blocks = k / BLOCK, row_bytes = blocks * block_bytes(type);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < n; r++)
        for (int64_t b = 0; b < blocks; b++) {
            float q[BLOCK], d, mn;
#if LADLE_AVX2
            __m256 qv[4];
            block_ints8(w + r * row_bytes + b * block_bytes(type), type, qv, &d, &mn);
            if (!is_bf16) { /* d * q (+ m), two roundings as gguf's numpy: no fma here */
                for (int t = 0; t < 4; t++) {
                    __m256 v = _mm256_mul_ps(qv[t], _mm256_set1_ps(d));
                    if (type == GGML_Q4_1) v = _mm256_add_ps(v, _mm256_set1_ps(mn));
                    _mm256_storeu_ps((float *)out + r * k + b * BLOCK + 8 * t, v);
                }
                continue;
            }
            for (int t = 0; t < 4; t++) _mm256_storeu_ps(q + 8 * t, qv[t]);
#else
            block_ints(w + r * row_bytes + b * block_bytes(type), type, q, &d, &mn);
#endif
            for (int j = 0; j < BLOCK; j++)
                put(out, r * k + b * BLOCK + j, type == GGML_Q4_1 ? d * q[j] + mn : d * q[j], is_bf16);
        }
}
