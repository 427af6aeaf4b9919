/* What every CPU kernel of ladle shares: fp32 <-> bf16, element access in either dtype, and the AVX2 and AVX-512
 * pieces. Which vector paths a build has is decided by its compiler flags (ladle/kernels/cpu_isa.py builds one
 * library per instruction-set level): LADLE_AVX2, LADLE_AVX512 (F, BW, VL, DQ) and LADLE_AVX512_BF16. */
#ifndef LADLE_CPU_COMMON_H
#define LADLE_CPU_COMMON_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                              /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* base[at] of a tensor of fp32, or of bf16 when is_bf16, as fp32 */
static inline float get(const void *base, int64_t at, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)base)[at]) : ((const float *)base)[at];
}

static inline void put(void *base, int64_t at, float v, int is_bf16) {
    if (is_bf16) ((uint16_t *)base)[at] = f32_to_bf16(v);
    else ((float *)base)[at] = v;
}

#if defined(__AVX2__) && defined(__FMA__)
#define LADLE_AVX2 1
#include <immintrin.h>

/* base[at .. at + 8) as fp32 */
static inline __m256 load8(const void *base, int64_t at, int is_bf16) {
    if (!is_bf16) return _mm256_loadu_ps((const float *)base + at);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + at));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* Eight vectors -> one vector of their eight horizontal sums. */
static inline __m256 sum8x8(const __m256 a[8]) {
    __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}
#else
#define LADLE_AVX2 0
#endif

#if LADLE_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define LADLE_AVX512 1

/* base[at .. at + 16) as fp32 */
static inline __m512 load16(const void *base, int64_t at, int is_bf16) {
    if (!is_bf16) return _mm512_loadu_ps((const float *)base + at);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + at));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Eight 16-lane vectors -> one 8-lane vector of their eight horizontal sums. */
static inline __m256 sum8x16(const __m512 a[8]) {
    __m256 halves[8];
    for (int i = 0; i < 8; i++)
        halves[i] = _mm256_add_ps(_mm512_castps512_ps256(a[i]), _mm512_extractf32x8_ps(a[i], 1));
    return sum8x8(halves);
}
#else
#define LADLE_AVX512 0
#endif

#if LADLE_AVX512 && defined(__AVX512BF16__)
#define LADLE_AVX512_BF16 1
#else
#define LADLE_AVX512_BF16 0
#endif

#endif
