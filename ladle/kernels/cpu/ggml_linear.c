/* y = x W^T (+ bias) for the few rows of a decode step, with W in a GGUF file's block format, kept as the file
 * has it: each weight row is row_bytes of consecutive blocks of one type,
 *   Q8_0 (type 8):   32 weights: fp16 d, 32 int8 q                       weight = d * q             34 bytes
 *   Q4_0 (type 2):   32 weights: fp16 d, 16 bytes of nibbles             weight = d * (q - 8)       18 bytes
 *   Q4_1 (type 3):   32 weights: fp16 d, fp16 m, 16 bytes of nibbles     weight = d * q + m         20 bytes
 * where byte j of a 4-bit block holds weight j in its low nibble and weight j + 16 in its high one (ggml's
 * block_q8_0 / block_q4_0 / block_q4_1), or the K-quants' super-blocks of 256 weights (block_q4_K / q5_K / q6_K):
 *   Q4_K (type 12):  fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales sc and mins mn (one each per 32
 *                    weights), 128 bytes of nibbles: bytes 32c..32c+31 hold sub-block 2c in their low nibbles and
 *                    2c + 1 in their high ones                 weight = (d * sc) * q - dmin * mn    144 bytes
 *   Q5_K (type 13):  as Q4_K with 32 bytes qh between the scales and the nibbles: bit s of qh[i] is the fifth
 *                    bit (16) of weight i of sub-block s                                              176 bytes
 *   Q6_K (type 14):  128 bytes ql of low nibbles, 64 bytes qh of 2-bit high parts, 16 int8 scales (one per 16
 *                    weights), fp16 d; weight 128h + r has low nibble (ql[64h + r % 64] >> 4 (r / 64)) and high
 *                    bits (qh[32h + r % 32] >> 2 (r / 32)) & 3      weight = (d * scale) * (q - 32)  210 bytes
 *
 * Every type is read as units of 32 weights: weight i of a unit is s[i / 16] * q_i (+ off), q_i a small integer,
 * s one scale per 16 weights (the same twice but in Q6_K) and off a per-unit offset (Q4_1's m, the K-quants'
 * -dmin * mn; none for the others). The K-quants' 6-bit scales are unpacked once a super-block.
 *
 * Decode is bound by reading W: Q4_K moves 0.5625 bytes a weight, a seventh of fp32's. Each unit's integers are
 * widened to fp32 once and multiplied with every x row; a row's sum over the unit (over each half, in Q6_K) is
 * scaled once, and the offset adds off times the x row's sum over the unit, so scales cost a multiply a unit,
 * not a weight. The activations are never quantized (llama.cpp's own kernels round them to 8 bits): a row's
 * result is the fp32 dot of x with the weights gguf's dequantize defines, summed in another order.
 *
 * ggml_dequantize widens rows to fp32 (or bf16) for a prefill's GEMM: each weight computed as gguf's own
 * dequantize computes it (d * q, d * (q - 8), d * q + m, (d * sc) * q - dmin * mn, (d * scale) * (q - 32), in
 * fp32, no fused multiply-add: the library is built with -ffp-contract=off; bf16 rounded once from that value),
 * so a widened tile holds exactly the values of a model widened at load.
 *
 * x [M, K], y [M, N] and bias [N] (or NULL): fp32, or bf16 when is_bf16. Work is split over W's rows.
 */
#include <stdlib.h>

#include "common.h"

enum {
    GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q8_0 = 8, GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14,
    UNIT = 32,  /* weights a unit: every type's block is one or eight of them */
    QK_K = 256, /* weights a K-quant super-block */
};

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

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if LADLE_AVX2 && defined(__F16C__)
    return _cvtsh_ss(h); /* exact, as f16_to_f32 */
#else
    return f16_to_f32(h);
#endif
}

static inline int known_type(int type) {
    return type == GGML_Q8_0 || type == GGML_Q4_0 || type == GGML_Q4_1 || type == GGML_Q4_K || type == GGML_Q5_K
           || type == GGML_Q6_K;
}

static inline int block_weights(int type) { return type >= GGML_Q4_K ? QK_K : UNIT; }

static inline int block_bytes(int type) {
    switch (type) {
    case GGML_Q8_0: return 34;
    case GGML_Q4_0: return 18;
    case GGML_Q4_1: return 20;
    case GGML_Q4_K: return 144;
    case GGML_Q5_K: return 176;
    default: return 210; /* Q6_K */
    }
}

/* Whether weights carry an offset (d * q + m, or - dmin * mn): the others' values are products alone. */
static inline int has_offset(int type) { return type == GGML_Q4_1 || type == GGML_Q4_K || type == GGML_Q5_K; }

/* A block's unit scales: weights 0-15 of unit j times s[0][j], 16-31 times s[1][j] (the same but in Q6_K), plus
 * off[j] where the type has an offset. */
typedef struct {
    float s[2][8], off[8];
} block_scale;

/* The scales of block b's units (one for the 32-weight types, eight for a K-quant super-block), computed as
 * gguf's dequantize computes them (d * sc and dmin * mn in fp32: both exact, 11-bit by 6- or 8-bit integers). */
static inline void block_scales(const uint8_t *b, int type, block_scale *u) {
    if (type == GGML_Q6_K) { /* 16 int8 scales: unit j's halves are scales 2j and 2j + 1 */
        const float d = half_at(b + 208);
#if LADLE_AVX2
        const __m128i raw = _mm_loadu_si128((const __m128i *)(b + 192));
        const __m128i evens_odds = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
        const __m128i split = _mm_shuffle_epi8(raw, evens_odds);
        _mm256_storeu_ps(u->s[0], _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(split))));
        _mm256_storeu_ps(u->s[1], _mm256_mul_ps(_mm256_set1_ps(d),
                                                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(split, 8)))));
#else
        for (int j = 0; j < 8; j++) {
            u->s[0][j] = d * (float)(int8_t)b[192 + 2 * j];
            u->s[1][j] = d * (float)(int8_t)b[193 + 2 * j];
        }
#endif
        return;
    }
    const float d = half_at(b);
    if (type == GGML_Q4_K || type == GGML_Q5_K) {
        /* 12 bytes: sc[0..3] and mn[0..3] in the low 6 bits of bytes 0-3 and 4-7; sc[4..7] and mn[4..7] in the
         * low and high nibbles of bytes 8-11, their top 2 bits in the top bits of bytes 0-3 and 4-7. Unpacked
         * four bytes at a time (ggml's kmask trick): no bit crosses a byte after its mask. */
        const float dmin = half_at(b + 2);
        uint32_t w[3], packed[4];
        memcpy(w, b + 4, sizeof w);
        packed[0] = w[0] & 0x3f3f3f3fu;                                                  /* sc 0-3 */
        packed[1] = (w[2] & 0x0f0f0f0fu) | (((w[0] >> 6) & 0x03030303u) << 4);           /* sc 4-7 */
        packed[2] = w[1] & 0x3f3f3f3fu;                                                  /* mn 0-3 */
        packed[3] = ((w[2] >> 4) & 0x0f0f0f0fu) | (((w[1] >> 6) & 0x03030303u) << 4);    /* mn 4-7 */
        uint8_t sc[16];
        memcpy(sc, packed, sizeof sc);
#if LADLE_AVX2
        const __m256 ds = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                                                                 (const __m128i *)sc))));
        const __m256 dm = _mm256_mul_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                                                                   (const __m128i *)(sc + 8)))));
        _mm256_storeu_ps(u->s[0], ds);
        _mm256_storeu_ps(u->s[1], ds);
        _mm256_storeu_ps(u->off, _mm256_xor_ps(dm, _mm256_set1_ps(-0.f))); /* d*q + (-M) is d*q - M, bit for bit */
#else
        for (int j = 0; j < 8; j++) {
            u->s[0][j] = u->s[1][j] = d * (float)sc[j];
            u->off[j] = -(dmin * (float)sc[8 + j]); /* d*q + (-M) is d*q - M, bit for bit */
        }
#endif
        return;
    }
    u->s[0][0] = u->s[1][0] = d;
    u->off[0] = type == GGML_Q4_1 ? half_at(b + 2) : 0.f;
}

/* Unit j of block b: its 32 integers (q, q - 8 for Q4_0, q - 32 for Q6_K) as floats. */
static inline void unit_ints(const uint8_t *b, int type, int j, float q[UNIT]) {
    switch (type) {
    case GGML_Q8_0:
        for (int i = 0; i < UNIT; i++) q[i] = (float)(int8_t)b[2 + i];
        return;
    case GGML_Q4_0:
    case GGML_Q4_1: {
        const uint8_t *nib = b + (type == GGML_Q4_1 ? 4 : 2);
        const int off = type == GGML_Q4_0 ? 8 : 0;
        for (int i = 0; i < UNIT / 2; i++) {
            q[i] = (float)((nib[i] & 0x0f) - off);
            q[i + UNIT / 2] = (float)((nib[i] >> 4) - off);
        }
        return;
    }
    case GGML_Q4_K:
    case GGML_Q5_K: {
        const uint8_t *qs = b + (type == GGML_Q4_K ? 16 : 48) + 32 * (j >> 1), *qh = b + 16;
        const int shift = 4 * (j & 1);
        for (int i = 0; i < UNIT; i++)
            q[i] = (float)(((qs[i] >> shift) & 0x0f) | (type == GGML_Q5_K ? ((qh[i] >> j) & 1) << 4 : 0));
        return;
    }
    default: { /* Q6_K: unit j is weights 32j..32j+31, in half h = j / 4 */
        const uint8_t *ql = b + 64 * (j >> 2) + 32 * (j & 1), *qh = b + 128 + 32 * (j >> 2);
        const int lo_shift = 4 * ((j >> 1) & 1), hi_shift = 2 * (j & 3);
        for (int i = 0; i < UNIT; i++)
            q[i] = (float)((((ql[i] >> lo_shift) & 0x0f) | (((qh[i] >> hi_shift) & 3) << 4)) - 32);
        return;
    }
    }
}

#if LADLE_AVX2
/* 32 unsigned bytes (weights 0-15 in lo, 16-31 in hi) as four vectors of 8 floats. */
static inline void widen_u8(__m128i lo, __m128i hi, __m256 q[4]) {
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

/* The integers of unit_ints as four vectors of 8 floats (weights 0-7, 8-15, 16-23, 24-31). */
static inline void unit_ints8(const uint8_t *b, int type, int j, __m256 q[4]) {
    const __m128i mask = _mm_set1_epi8(0x0f);
    switch (type) {
    case GGML_Q8_0:
        for (int t = 0; t < 4; t++)
            q[t] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * t))));
        return;
    case GGML_Q4_0:
    case GGML_Q4_1: {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(b + (type == GGML_Q4_1 ? 4 : 2)));
        widen_u8(_mm_and_si128(raw, mask), _mm_and_si128(_mm_srli_epi16(raw, 4), mask), q);
        if (type == GGML_Q4_0)
            for (int t = 0; t < 4; t++) q[t] = _mm256_sub_ps(q[t], _mm256_set1_ps(8.f)); /* small integers: exact */
        return;
    }
    case GGML_Q4_K:
    case GGML_Q5_K: {
        const uint8_t *qs = b + (type == GGML_Q4_K ? 16 : 48) + 32 * (j >> 1);
        const __m128i shift = _mm_cvtsi32_si128(4 * (j & 1));
        __m128i lo = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)qs), shift), mask);
        __m128i hi = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(qs + 16)), shift), mask);
        if (type == GGML_Q5_K) { /* bit j of each qh byte, moved to bit 4 (within the byte: no lane crosses) */
            const __m128i bit = _mm_cvtsi32_si128(j), one = _mm_set1_epi8(1);
            const __m128i h0 = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(b + 16)), bit), one);
            const __m128i h1 = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(b + 32)), bit), one);
            lo = _mm_or_si128(lo, _mm_slli_epi16(h0, 4));
            hi = _mm_or_si128(hi, _mm_slli_epi16(h1, 4));
        }
        widen_u8(lo, hi, q);
        return;
    }
    default: { /* Q6_K, as unit_ints */
        const uint8_t *ql = b + 64 * (j >> 2) + 32 * (j & 1), *qh = b + 128 + 32 * (j >> 2);
        const __m128i lo_shift = _mm_cvtsi32_si128(4 * ((j >> 1) & 1)), hi_shift = _mm_cvtsi32_si128(2 * (j & 3));
        const __m128i three = _mm_set1_epi8(3);
        __m128i v[2];
        for (int h = 0; h < 2; h++) {
            const __m128i l = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(ql + 16 * h)), lo_shift),
                                            mask);
            const __m128i u = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(qh + 16 * h)), hi_shift),
                                            three);
            v[h] = _mm_or_si128(l, _mm_slli_epi16(u, 4));
        }
        widen_u8(v[0], v[1], q);
        for (int t = 0; t < 4; t++) q[t] = _mm256_sub_ps(q[t], _mm256_set1_ps(32.f)); /* small integers: exact */
        return;
    }
    }
}
#endif

/* The kernels below take the type as a compile-time constant: each is forced inline into a dispatch with one
 * case a type (BY_TYPE), so every type gets its own loop with the unpacking and scales specialised (as one
 * generic loop, Q8_0's one-row dot ran at half speed). */
#define INLINE static inline __attribute__((always_inline))
#define BY_TYPE(fn, ...)                                                                                        \
    switch (type) {                                                                                              \
    case GGML_Q8_0: fn(__VA_ARGS__, GGML_Q8_0); break;                                                           \
    case GGML_Q4_0: fn(__VA_ARGS__, GGML_Q4_0); break;                                                           \
    case GGML_Q4_1: fn(__VA_ARGS__, GGML_Q4_1); break;                                                           \
    case GGML_Q4_K: fn(__VA_ARGS__, GGML_Q4_K); break;                                                           \
    case GGML_Q5_K: fn(__VA_ARGS__, GGML_Q5_K); break;                                                           \
    default: fn(__VA_ARGS__, GGML_Q6_K); break;                                                                  \
    }

#if LADLE_AVX2
/* One x row (a batch-1 decode): the dot of x with W row `row`; xsum the row's sums over each unit. */
INLINE float row_dot1_t(const float *xs, const float *xsum, const uint8_t *row, int64_t blocks, const int type) {
    const int bytes = block_bytes(type), units = block_weights(type) / UNIT;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    __m256 tails = _mm256_setzero_ps(); /* a K-quant's off * xsum terms, eight units at once */
    float tail = 0.f;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = row + b * bytes;
        block_scale u;
        block_scales(blk, type, &u);
        if (has_offset(type) && units == 8)
            tails = _mm256_fmadd_ps(_mm256_loadu_ps(u.off), _mm256_loadu_ps(xsum + b * units), tails);
        /* unit j a constant: shifts by immediates, no reloads (a K-quant's batch-1 dot 20-30% faster; in the
         * other loops it gained nothing measurable and tripled the compile time) */
#pragma GCC unroll 8
        for (int j = 0; j < units; j++) {
            __m256 q[4];
            if (64 * j < bytes) _mm_prefetch((const char *)blk + 4 * bytes + 64 * j, _MM_HINT_T0); /* blocks ahead */
            unit_ints8(blk, type, j, q);
            const float *xb = xs + (b * units + j) * UNIT;
            const __m256 p = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), q[1], _mm256_mul_ps(_mm256_loadu_ps(xb), q[0]));
            const __m256 p2 = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), q[3],
                                              _mm256_mul_ps(_mm256_loadu_ps(xb + 16), q[2]));
            if (type == GGML_Q6_K) { /* a scale per 16 weights */
                acc0 = _mm256_fmadd_ps(p, _mm256_set1_ps(u.s[0][j]), acc0);
                acc1 = _mm256_fmadd_ps(p2, _mm256_set1_ps(u.s[1][j]), acc1);
            } else { /* one per unit: alternate the chains by unit */
                const __m256 s = _mm256_add_ps(p, p2);
                if ((b * units + j) & 1) acc1 = _mm256_fmadd_ps(s, _mm256_set1_ps(u.s[0][j]), acc1);
                else acc0 = _mm256_fmadd_ps(s, _mm256_set1_ps(u.s[0][j]), acc0);
            }
            if (has_offset(type) && units == 1) tail += u.off[j] * xsum[b];
        }
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_add_ps(_mm256_add_ps(acc0, acc1), tails));
    return tail + (((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7])));
}

INLINE void row_dot1_into(float *out, const float *xs, const float *xsum, const uint8_t *row, int64_t blocks,
                          const int type) {
    *out = row_dot1_t(xs, xsum, row, blocks, type);
}

/* The 4-bit 32-weight types (Q4_0, Q4_1) at batch 1, with x in LANE_ORDER. Widening a unit's nibbles by in-lane
 * unpacks (two of bytes to words, four of words to ints) costs less than four cross-lane vpmovzxbd, but yields the
 * weights in another order: vector v, element e holds weight LANE_ORDER[8v + e]. x is shared by every W row, so
 * it is put in that order once a call (lane_order_x) and the products pair up again. The result is the same dot,
 * summed in another order. One thread, SmolLM2's shapes, A/B in one process on a busy 2-core EPYC (AVX2): Q4_1
 * 1.13-1.29x, Q4_0 0.88-1.31x; Q8_0's signed unpack made it 0.70-0.95x, so it keeps vpmovsxbd (row_dot1_t). */
static const int LANE_ORDER[UNIT] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23,
                                     8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};

static void lane_order_x(float *xp, const float *xs, int64_t k) {
    for (int64_t c = 0; c < k; c += UNIT)
        for (int j = 0; j < UNIT; j++) xp[c + j] = xs[c + LANE_ORDER[j]];
}

/* A unit's 32 integers as one vector of bytes (weights 0-15 in the low lane, 16-31 in the high one), widened to
 * four vectors of floats in LANE_ORDER; is_signed: the bytes are int8 (else uint8). */
INLINE void lanes_to_floats(__m256i v, int is_signed, __m256 q[4]) {
    const __m256i zero = _mm256_setzero_si256();
    const __m256i sign8 = is_signed ? _mm256_cmpgt_epi8(zero, v) : zero;
    const __m256i w0 = _mm256_unpacklo_epi8(v, sign8), w1 = _mm256_unpackhi_epi8(v, sign8);
    const __m256i s0 = is_signed ? _mm256_srai_epi16(w0, 15) : zero, s1 = is_signed ? _mm256_srai_epi16(w1, 15) : zero;
    q[0] = _mm256_cvtepi32_ps(_mm256_unpacklo_epi16(w0, s0));
    q[1] = _mm256_cvtepi32_ps(_mm256_unpackhi_epi16(w0, s0));
    q[2] = _mm256_cvtepi32_ps(_mm256_unpacklo_epi16(w1, s1));
    q[3] = _mm256_cvtepi32_ps(_mm256_unpackhi_epi16(w1, s1));
}

INLINE float row_dot1_lanes_t(const float *xp, const float *xsum, const uint8_t *row, int64_t blocks, const int type) {
    const int bytes = block_bytes(type);
    const __m256i mask = _mm256_set1_epi8(0x0f), nibble_shift = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float tail = 0.f;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = row + b * bytes;
        _mm_prefetch((const char *)blk + 4 * bytes, _MM_HINT_T0);
        __m256i v;
        /* byte j: weight j low, j + 16 high: the low lane keeps the low nibbles, the high lane the high */
        v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(blk + (type == GGML_Q4_1 ? 4 : 2))));
        v = _mm256_and_si256(_mm256_srlv_epi32(v, nibble_shift), mask);
        if (type == GGML_Q4_0) v = _mm256_sub_epi8(v, _mm256_set1_epi8(8)); /* q - 8, exact in int8 */
        __m256 q[4];
        lanes_to_floats(v, type != GGML_Q4_1, q);
        const float *xb = xp + b * UNIT;
        const __m256 p = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), q[1], _mm256_mul_ps(_mm256_loadu_ps(xb), q[0]));
        const __m256 p2 = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), q[3], _mm256_mul_ps(_mm256_loadu_ps(xb + 16), q[2]));
        const __m256 d = _mm256_set1_ps(half_at(blk));
        if (b & 1) acc1 = _mm256_fmadd_ps(_mm256_add_ps(p, p2), d, acc1);
        else acc0 = _mm256_fmadd_ps(_mm256_add_ps(p, p2), d, acc0);
        if (type == GGML_Q4_1) tail += half_at(blk + 2) * xsum[b];
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_add_ps(acc0, acc1));
    return tail + (((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7])));
}
#endif

#if LADLE_AVX512
/* The 32-weight types (Q4_0, Q4_1, Q8_0) at batch 1, 16 lanes wide: a unit's weights widen in input order (a
 * 16-byte vector to 16 ints, one instruction), so x needs no reordering. Two chains, alternating by block.
 * SmolLM2's Q4_1 file, batch-1 decode, 2 threads, Zen 4 EPYC: 87-88 tok/s at avx512-bf16 against 76-83 at avx2
 * (without this path the two levels ran alike: 77-83). */
INLINE float row_dot1_512_t(const float *xs, const float *xsum, const uint8_t *row, int64_t blocks, const int type) {
    const int bytes = block_bytes(type);
    const __m128i mask = _mm_set1_epi8(0x0f);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    float tail = 0.f;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = row + b * bytes;
        _mm_prefetch((const char *)blk + 4 * bytes, _MM_HINT_T0);
        __m512 q0, q1;
        if (type == GGML_Q8_0) {
            q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2))));
            q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18))));
        } else {
            const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + (type == GGML_Q4_1 ? 4 : 2)));
            __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
            if (type == GGML_Q4_0) { /* q - 8, exact in int8 */
                lo = _mm_sub_epi8(lo, _mm_set1_epi8(8));
                hi = _mm_sub_epi8(hi, _mm_set1_epi8(8));
            }
            q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo));
            q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi));
        }
        const float *xb = xs + b * UNIT;
        const __m512 p = _mm512_fmadd_ps(_mm512_loadu_ps(xb + 16), q1, _mm512_mul_ps(_mm512_loadu_ps(xb), q0));
        const __m512 d = _mm512_set1_ps(half_at(blk));
        if (b & 1) acc1 = _mm512_fmadd_ps(p, d, acc1);
        else acc0 = _mm512_fmadd_ps(p, d, acc0);
        if (type == GGML_Q4_1) tail += half_at(blk + 2) * xsum[b];
    }
    return tail + _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}
#endif

#if LADLE_AVX512
/* A 32-weight block (Q4_0, Q4_1, Q8_0) as two 16-float vectors, weights 0-15 and 16-31, each times the block's d:
 * what the block adds to a dot is x . (d q), plus Q4_1's m times the x row's sum over the unit (added apart). */
INLINE void unit512_scaled(const uint8_t *blk, const int type, __m512 *q0, __m512 *q1) {
    if (type == GGML_Q8_0) {
        *q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2))));
        *q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18))));
    } else {
        const __m128i mask = _mm_set1_epi8(0x0f);
        const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + (type == GGML_Q4_1 ? 4 : 2)));
        __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
        if (type == GGML_Q4_0) { /* q - 8, exact in int8 */
            lo = _mm_sub_epi8(lo, _mm_set1_epi8(8));
            hi = _mm_sub_epi8(hi, _mm_set1_epi8(8));
        }
        *q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo));
        *q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi));
    }
    const __m512 d = _mm512_set1_ps(half_at(blk));
    *q0 = _mm512_mul_ps(*q0, d);
    *q1 = _mm512_mul_ps(*q1, d);
}

enum { PAIR_ROWS = 8 }; /* x rows a pass of rows_pair_512 takes: 2 x 8 accumulators, 4 weight and 2 x registers */

/* W rows w0 and w1 against x rows i0 .. i0 + mi (mi <= PAIR_ROWS, a constant where it is inlined): y0[i], y1[i]
 * their dots. A few decode rows are bound by arithmetic, not by reading W: the rows-at-a-time loop (rows_dot_t)
 * loads two x vectors for every two multiply-adds and widens each unit once a W row; here each unit is widened and
 * scaled once for up to eight x rows, and each x load feeds both W rows, so the multiply-adds, not the loads, set
 * the pace. Sixteen independent accumulators keep both FMA ports busy. */
INLINE void rows_pair_512(float *y0, float *y1, const float *xs, const float *xsum, const uint8_t *w0,
                          const uint8_t *w1, int64_t blocks, int64_t k, int64_t i0, const int mi, const int type) {
    const int bytes = block_bytes(type);
    __m512 a0[PAIR_ROWS], a1[PAIR_ROWS];
    float t0[PAIR_ROWS], t1[PAIR_ROWS];
    for (int i = 0; i < mi; i++) {
        a0[i] = a1[i] = _mm512_setzero_ps();
        t0[i] = t1[i] = 0.f;
    }
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *b0 = w0 + b * bytes, *b1 = w1 + b * bytes;
        _mm_prefetch((const char *)b0 + 4 * bytes, _MM_HINT_T0);
        _mm_prefetch((const char *)b1 + 4 * bytes, _MM_HINT_T0);
        __m512 p0, p1, q0, q1;
        unit512_scaled(b0, type, &p0, &p1);
        unit512_scaled(b1, type, &q0, &q1);
        for (int i = 0; i < mi; i++) {
            const float *xb = xs + (i0 + i) * k + b * UNIT;
            const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
            a0[i] = _mm512_fmadd_ps(x1, p1, _mm512_fmadd_ps(x0, p0, a0[i]));
            a1[i] = _mm512_fmadd_ps(x1, q1, _mm512_fmadd_ps(x0, q0, a1[i]));
        }
        if (type == GGML_Q4_1) {
            const float m0 = half_at(b0 + 2), m1 = half_at(b1 + 2);
            for (int i = 0; i < mi; i++) {
                const float s = xsum[(i0 + i) * (k / UNIT) + b];
                t0[i] += m0 * s;
                t1[i] += m1 * s;
            }
        }
    }
    for (int i = 0; i < mi; i++) {
        y0[i] = t0[i] + _mm512_reduce_add_ps(a0[i]);
        y1[i] = t1[i] + _mm512_reduce_add_ps(a1[i]);
    }
}

#define PAIR_MI(T, MI)                                                                                           \
    case MI: rows_pair_512(y0, y1, xs, xsum, w0, w1, blocks, k, i0, MI, T); break;
#define PAIR_T(T)                                                                                                \
    switch (mi) {                                                                                                \
        PAIR_MI(T, 1) PAIR_MI(T, 2) PAIR_MI(T, 3) PAIR_MI(T, 4) PAIR_MI(T, 5) PAIR_MI(T, 6) PAIR_MI(T, 7)        \
        default: rows_pair_512(y0, y1, xs, xsum, w0, w1, blocks, k, i0, PAIR_ROWS, T); break;                   \
    }

/* rows_pair_512 with the type and the row count made constants, so each case gets its own unrolled loop. */
static void rows_pair(float *y0, float *y1, const float *xs, const float *xsum, const uint8_t *w0, const uint8_t *w1,
                      int64_t blocks, int64_t k, int64_t i0, int mi, int type) {
    if (type == GGML_Q4_0) {
        PAIR_T(GGML_Q4_0)
    } else if (type == GGML_Q4_1) {
        PAIR_T(GGML_Q4_1)
    } else {
        PAIR_T(GGML_Q8_0)
    }
}
#endif

/* W row `row` against x rows i0 .. i0 + mi: out[i] = their dots. */
INLINE void rows_dot_t(float *out, const float *xs, const float *xsum, const uint8_t *row, int64_t blocks, int64_t k,
                       int64_t i0, int64_t mi, const int type) {
    const int units = block_weights(type) / UNIT, bytes = block_bytes(type);
    const int64_t kunits = k / UNIT;
#if LADLE_AVX2
    __m256 acc[64];
    for (int64_t i = 0; i < mi; i++) acc[i] = _mm256_setzero_ps();
#endif
    for (int64_t i = 0; i < mi; i++) out[i] = 0.f;
    for (int64_t b = 0; b < blocks; b++) {
        block_scale u;
        block_scales(row + b * bytes, type, &u);
        for (int j = 0; j < units; j++) {
            const int64_t c = b * units + j;
#if LADLE_AVX2
            __m256 qv[4];
            unit_ints8(row + b * bytes, type, j, qv);
            const __m256 s0 = _mm256_set1_ps(u.s[0][j]), s1 = _mm256_set1_ps(u.s[1][j]);
            for (int64_t i = 0; i < mi; i++) {
                const float *xb = xs + (i0 + i) * k + c * UNIT;
                const __m256 p = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), qv[1],
                                                 _mm256_mul_ps(_mm256_loadu_ps(xb), qv[0]));
                const __m256 p2 = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), qv[3],
                                                  _mm256_mul_ps(_mm256_loadu_ps(xb + 16), qv[2]));
                if (type == GGML_Q6_K) acc[i] = _mm256_fmadd_ps(p2, s1, _mm256_fmadd_ps(p, s0, acc[i]));
                else acc[i] = _mm256_fmadd_ps(_mm256_add_ps(p, p2), s0, acc[i]);
                if (has_offset(type)) out[i] += u.off[j] * xsum[(i0 + i) * kunits + c];
            }
#else
            float q[UNIT];
            unit_ints(row + b * bytes, type, j, q);
            for (int64_t i = 0; i < mi; i++) {
                const float *xb = xs + (i0 + i) * k + c * UNIT;
                float p = 0.f, p2 = 0.f;
                for (int t = 0; t < UNIT / 2; t++) {
                    p += xb[t] * q[t];
                    p2 += xb[t + UNIT / 2] * q[t + UNIT / 2];
                }
                out[i] += p * u.s[0][j] + p2 * u.s[1][j];
                if (has_offset(type)) out[i] += u.off[j] * xsum[(i0 + i) * kunits + c];
            }
#endif
        }
    }
#if LADLE_AVX2
    for (int64_t i = 0; i < mi; i++) {
        float lanes[8];
        _mm256_storeu_ps(lanes, acc[i]);
        out[i] += ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    }
#endif
}

/* Returns 0, or -1 when the fp32 copy of x could not be allocated, the type is not one of the six, or k is not
 * a whole number of its blocks. */
int ggml_linear(const void *x, const uint8_t *w, const void *bias, void *y, int64_t m, int64_t n, int64_t k,
                int type, int is_bf16, int num_threads) {
    if (!known_type(type) || k % block_weights(type)) return -1;
    const int64_t blocks = k / block_weights(type), row_bytes = blocks * block_bytes(type), kunits = k / UNIT;
    /* x in fp32, and each x row's sum over each unit, for the offset's off * sum(x) term */
    float *xs = malloc(sizeof(float) * (size_t)(m * k + m * kunits));
    if (xs == NULL) return -1;
    float *xsum = xs + m * k;
    for (int64_t i = 0; i < m * k; i++) xs[i] = get(x, i, is_bf16);
    for (int64_t i = 0; i < m; i++)
        for (int64_t c = 0; c < kunits; c++) {
            float s = 0.f;
            for (int j = 0; j < UNIT; j++) s += xs[i * k + c * UNIT + j];
            xsum[i * kunits + c] = s;
        }
#if LADLE_AVX512
    if (m == 1 && (type == GGML_Q4_0 || type == GGML_Q4_1 || type == GGML_Q8_0)) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t r = 0; r < n; r++) {
            const uint8_t *row = w + r * row_bytes;
            const float dot = type == GGML_Q4_0   ? row_dot1_512_t(xs, xsum, row, blocks, GGML_Q4_0)
                              : type == GGML_Q4_1 ? row_dot1_512_t(xs, xsum, row, blocks, GGML_Q4_1)
                                                  : row_dot1_512_t(xs, xsum, row, blocks, GGML_Q8_0);
            put(y, r, dot + (bias == NULL ? 0.f : get(bias, r, is_bf16)), is_bf16);
        }
        free(xs);
        return 0;
    }
#endif
#if LADLE_AVX512
    if (m > 1 && (type == GGML_Q4_0 || type == GGML_Q4_1 || type == GGML_Q8_0)) {
        const int64_t pairs = (n + 1) / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t p = 0; p < pairs; p++) {
            const int64_t r0 = 2 * p, r1 = r0 + 1 < n ? r0 + 1 : r0; /* an odd last row pairs with itself */
            const float b0 = bias == NULL ? 0.f : get(bias, r0, is_bf16), b1 = bias == NULL ? 0.f : get(bias, r1, is_bf16);
            for (int64_t i0 = 0; i0 < m; i0 += PAIR_ROWS) {
                const int mi = (int)(m - i0 < PAIR_ROWS ? m - i0 : PAIR_ROWS);
                float y0[PAIR_ROWS], y1[PAIR_ROWS];
                rows_pair(y0, y1, xs, xsum, w + r0 * row_bytes, w + r1 * row_bytes, blocks, k, i0, mi, type);
                for (int i = 0; i < mi; i++) {
                    put(y, (i0 + i) * n + r0, y0[i] + b0, is_bf16);
                    if (r1 != r0) put(y, (i0 + i) * n + r1, y1[i] + b1, is_bf16);
                }
            }
        }
        free(xs);
        return 0;
    }
#endif
#if LADLE_AVX2
    if (m == 1 && (type == GGML_Q4_0 || type == GGML_Q4_1)) {
        float *xp = malloc(sizeof(float) * (size_t)k);
        if (xp == NULL) {
            free(xs);
            return -1;
        }
        lane_order_x(xp, xs, k);
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t r = 0; r < n; r++) {
            const uint8_t *row = w + r * row_bytes;
            const float dot = type == GGML_Q4_0 ? row_dot1_lanes_t(xp, xsum, row, blocks, GGML_Q4_0)
                                                : row_dot1_lanes_t(xp, xsum, row, blocks, GGML_Q4_1);
            put(y, r, dot + (bias == NULL ? 0.f : get(bias, r, is_bf16)), is_bf16);
        }
        free(xp);
        free(xs);
        return 0;
    }
    if (m == 1) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t r = 0; r < n; r++) {
            float dot;
            BY_TYPE(row_dot1_into, &dot, xs, xsum, w + r * row_bytes, blocks)
            put(y, r, dot + (bias == NULL ? 0.f : get(bias, r, is_bf16)), is_bf16);
        }
        free(xs);
        return 0;
    }
#endif
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < n; r++) {
        float dots[64];
        for (int64_t i0 = 0; i0 < m; i0 += 64) { /* x rows in groups of 64 (a decode step has at most a few) */
            const int64_t mi = m - i0 < 64 ? m - i0 : 64;
            BY_TYPE(rows_dot_t, dots, xs, xsum, w + r * row_bytes, blocks, k, i0, mi)
            for (int64_t i = 0; i < mi; i++)
                put(y, (i0 + i) * n + r, dots[i] + (bias == NULL ? 0.f : get(bias, r, is_bf16)), is_bf16);
        }
    }
    free(xs);
    return 0;
}

#if LADLE_AVX2
/* 8 floats -> bf16 at p, each as f32_to_bf16 rounds it (to nearest even; a NaN stays a NaN). */
static inline void store8_bf16(uint16_t *p, __m256 v) {
    const __m256i u = _mm256_castps_si256(v), low16 = _mm256_set1_epi32(1);
    const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(_mm256_srli_epi32(u, 16), low16));
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i r = _mm256_blendv_epi8(_mm256_srli_epi32(_mm256_add_epi32(u, bias), 16),
                                         _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
#endif

/* One W row widened into out at at0 (k weights, fp32 or bf16). */
INLINE void dequant_row_t(const uint8_t *row, void *out, int64_t at0, int64_t blocks, int is_bf16, const int type) {
    const int units = block_weights(type) / UNIT, bytes = block_bytes(type);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = row + b * bytes;
        block_scale u;
        block_scales(blk, type, &u);
        for (int j = 0; j < units; j++) {
            const int64_t at = at0 + (b * units + j) * UNIT;
#if LADLE_AVX2
            __m256 qv[4];
            unit_ints8(blk, type, j, qv);
            for (int t = 0; t < 4; t++) { /* s * q (+ off), two roundings as gguf's numpy: no fma here */
                __m256 v = _mm256_mul_ps(qv[t], _mm256_set1_ps(u.s[t >> 1][j]));
                if (has_offset(type)) v = _mm256_add_ps(v, _mm256_set1_ps(u.off[j]));
                if (is_bf16) store8_bf16((uint16_t *)out + at + 8 * t, v);
                else _mm256_storeu_ps((float *)out + at + 8 * t, v);
            }
#else
            float q[UNIT];
            unit_ints(blk, type, j, q);
            for (int i = 0; i < UNIT; i++) {
                const float v = u.s[i >> 4][j] * q[i];
                put(out, at + i, has_offset(type) ? v + u.off[j] : v, is_bf16);
            }
#endif
        }
    }
}

/* out [N, K] = W's rows widened, in fp32 or bf16 (is_bf16; rounded once from the fp32 value). The caller
 * passes a type ggml_linear knows and k a whole number of its blocks (GgmlLinear checks both). */
void ggml_dequantize(const uint8_t *w, void *out, int64_t n, int64_t k, int type, int is_bf16, int num_threads) {
    const int64_t blocks = k / block_weights(type), row_bytes = blocks * block_bytes(type);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < n; r++) {
        BY_TYPE(dequant_row_t, w + r * row_bytes, out, r * k, blocks, is_bf16)
    }
}
