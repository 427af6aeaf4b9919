/* Paged decode attention on CPU: one query row per request, reading K and V in place from the block pool.
 *
 * Built at first use by ladle/kernels/cpu_kernels.py (gcc -O3 -march=native -fopenmp) and called through
 * ctypes. The OpenMP team is torch's own: the library names libgomp.so.1, which torch has already loaded.
 *
 * Layouts (all contiguous): q, out [T, H, D]; pools [num_blocks, block_size, KVH, D]; block_tables [B, stride]
 * int32; context_lens [B] int32 (tokens in the cache, this step's included). One work item per split of a
 * request's context (see SPLIT_TOKENS), one pass over it with an online softmax.
 */
#include <math.h>
#include <stdlib.h>

#include "common.h"


static inline float dot(const float *q, const void *base, int64_t at, int64_t d, int is_bf16) {
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < d; i++) acc += q[i] * get(base, at + i, is_bf16);
    return acc;
}

static inline void axpy(float *y, float a, const void *base, int64_t at, int64_t d, int is_bf16) {
#pragma omp simd
    for (int64_t i = 0; i < d; i++) y[i] += a * get(base, at + i, is_bf16);
}

#if LADLE_AVX2
/* out[t] = scale * q . row t, for the 8 rows at `at`, `at + stride`, ... (elements) of base; d a multiple of 8. One
 * horizontal reduction for all eight (sum8x8). */
static inline void dots8_strided(float *out, const float *q, const void *base, int64_t at, int64_t stride, int64_t d,
                                 float scale, int is_bf16) {
    __m256 acc[8];
    for (int t = 0; t < 8; t++) acc[t] = _mm256_setzero_ps();
    if (!is_bf16) {
        const float *k = (const float *)base + at;
        for (int64_t c = 0; c < d; c += 8) {
            const __m256 qc = _mm256_loadu_ps(q + c);
            const float *kc = k + c;
            for (int t = 0; t < 8; t++, kc += stride) acc[t] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kc), acc[t]);
        }
    } else {
        for (int64_t c = 0; c < d; c += 8) {
            const __m256 qc = _mm256_loadu_ps(q + c);
            for (int t = 0; t < 8; t++) acc[t] = _mm256_fmadd_ps(qc, load8(base, at + t * stride + c, 1), acc[t]);
        }
    }
    _mm256_storeu_ps(out, _mm256_mul_ps(sum8x8(acc), _mm256_set1_ps(scale)));
}

#if LADLE_AVX512
/* dots8_strided, 16 lanes wide: d a multiple of 16. */
static inline void dots8_strided_512(float *out, const float *q, const void *base, int64_t at, int64_t stride,
                                     int64_t d, float scale, int is_bf16) {
    __m512 acc[8];
    for (int t = 0; t < 8; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += 16) {
        const __m512 qc = _mm512_loadu_ps(q + c);
        for (int t = 0; t < 8; t++) acc[t] = _mm512_fmadd_ps(qc, load16(base, at + t * stride + c, is_bf16), acc[t]);
    }
    _mm256_storeu_ps(out, _mm256_mul_ps(sum8x16(acc), _mm256_set1_ps(scale)));
}
#endif

/* exp(x) for eight floats (Cephes' expf: x = n ln2 + r, a degree-5 polynomial in r, times 2^n), within 2 ulp of
 * expf over the range softmax meets; exp(-inf) is 0. */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.33654f), hi = _mm256_set1_ps(88.72283f);
    const __m256 zero_below = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(zero_below, _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n)));
}
#endif

#define RUN 16 /* tokens a step of the online softmax takes at most (within one block, so their rows are adjacent) */

/* One query row over context tokens [lo, hi) of one request, for the query heads of kv heads [g0, g1),
 * unnormalized: part holds per head its largest score m[h], then the sum l[h] of exp(score - m[h]), then
 * acc[h][d] the exp-weighted sum of V rows (this call writes only its own heads' entries).
 * One pass, in runs of up to RUN tokens of one block (an online softmax: a run's scores, their exponentials
 * against the running maximum, the V rows, the sums rescaled when the maximum grows), so each K and V row is read
 * from memory once and used while it is in cache by every head of its group.
 *
 * With `copy`, each run's K and V rows (every kv head's: a run is contiguous in its block) are first copied front
 * to back into a local buffer and read from there. A head's share of a token row is a strided read, which memory
 * serves at half the rate of reading the block in order (measured: 6.4 against 13.6 GB/s a core, and prefetching
 * does not close it); the copy costs its time again when the rows are in cache, so the caller asks for it where
 * they are not. The arithmetic is the same either way. Returns 0, or -1 when its scratch could not be allocated. */
static int attend_range(const void *q, const void *pool_k, const void *pool_v, const int32_t *table, int64_t lo,
                        int64_t hi, int64_t row, int64_t g0, int64_t g1, int64_t num_heads, int64_t num_kv_heads,
                        int64_t d, int64_t block_size, float scale, int is_bf16, int copy, float *part) {
    const int64_t group = num_heads / num_kv_heads, hd = num_heads * d, token_stride = num_kv_heads * d;
    const int64_t h0 = g0 * group, h1 = g1 * group, elem = is_bf16 ? 2 : 4, run_bytes = RUN * token_stride * elem;
    float *qf = malloc(sizeof(float) * (size_t)hd + (copy ? (size_t)(2 * run_bytes + 64) : 0));
    if (qf == NULL) return -1;
    char *k_copy = (char *)(((uintptr_t)(qf + hd) + 63) & ~(uintptr_t)63), *v_copy = k_copy + run_bytes;
    float *maxes = part, *total = part + num_heads, *acc = part + 2 * num_heads;
    for (int64_t i = h0 * d; i < h1 * d; i++) qf[i] = get(q, row * hd + i, is_bf16);
    memset(acc + h0 * d, 0, sizeof(float) * (size_t)((h1 - h0) * d));
    for (int64_t h = h0; h < h1; h++) maxes[h] = -INFINITY, total[h] = 0.f;
    float s[RUN] __attribute__((aligned(32)));
    for (int64_t p = lo; p < hi;) {
        const int64_t in_block = block_size - p % block_size, left = hi - p;
        const int64_t n = in_block < left ? (in_block < RUN ? in_block : RUN) : (left < RUN ? left : RUN);
        const int64_t pooled = ((int64_t)table[p / block_size] * block_size + p % block_size) * token_stride;
        if (copy) {
            memcpy(k_copy, (const char *)pool_k + pooled * elem, (size_t)(n * token_stride * elem));
            memcpy(v_copy, (const char *)pool_v + pooled * elem, (size_t)(n * token_stride * elem));
        }
        const void *k_pool = copy ? (const void *)k_copy : pool_k, *v_pool = copy ? (const void *)v_copy : pool_v;
        const int64_t first = copy ? 0 : pooled;
        for (int64_t h = h0; h < h1; h++) {
            const int64_t at = first + h / group * d; /* token t's row of this head's kv head: at + t * stride */
            const float *qh = qf + h * d;
            float m = maxes[h];
            int64_t t = 0;
#if LADLE_AVX512
            if (d % 16 == 0)
                for (; t + 8 <= n; t += 8) dots8_strided_512(s + t, qh, k_pool, at + t * token_stride, token_stride,
                                                              d, scale, is_bf16);
#endif
#if LADLE_AVX2
            if (d % 8 == 0)
                for (; t + 8 <= n; t += 8) dots8_strided(s + t, qh, k_pool, at + t * token_stride, token_stride, d,
                                                          scale, is_bf16);
#endif
            for (; t < n; t++) s[t] = scale * dot(qh, k_pool, at + t * token_stride, d, is_bf16);
            for (t = 0; t < n; t++) m = s[t] > m ? s[t] : m;
            const float grow = expf(maxes[h] - m); /* the earlier sums, rescaled to the new maximum */
            float *ah = acc + h * d, sum = 0.f;
            t = 0;
#if LADLE_AVX2
            for (; t + 8 <= n; t += 8) {
                const __m256 e = exp8(_mm256_sub_ps(_mm256_load_ps(s + t), _mm256_set1_ps(m)));
                _mm256_store_ps(s + t, e);
            }
#endif
            for (; t < n; t++) s[t] = expf(s[t] - m);
            for (t = 0; t < n; t++) sum += s[t];
            int64_t j = 0;
#if LADLE_AVX512
            for (; j + 16 <= d; j += 16) {
                __m512 a = _mm512_mul_ps(_mm512_loadu_ps(ah + j), _mm512_set1_ps(grow));
                for (t = 0; t < n; t++)
                    a = _mm512_fmadd_ps(_mm512_set1_ps(s[t]), load16(v_pool, at + t * token_stride + j, is_bf16), a);
                _mm512_storeu_ps(ah + j, a);
            }
#endif
#if LADLE_AVX2
            /* Eight columns of the accumulator stay in a register across the run's V rows. */
            for (; j + 8 <= d; j += 8) {
                __m256 a = _mm256_mul_ps(_mm256_loadu_ps(ah + j), _mm256_set1_ps(grow));
                for (t = 0; t < n; t++)
                    a = _mm256_fmadd_ps(_mm256_set1_ps(s[t]), load8(v_pool, at + t * token_stride + j, is_bf16), a);
                _mm256_storeu_ps(ah + j, a);
            }
#endif
            for (; j < d; j++) {
                float a = ah[j] * grow;
                for (t = 0; t < n; t++) a += s[t] * get(v_pool, at + t * token_stride + j, is_bf16);
                ah[j] = a;
            }
            maxes[h] = m;
            total[h] = total[h] * grow + sum;
        }
        p += n;
    }
    free(qf);
    return 0;
}

/* A context longer than this is attended in splits of this many tokens, each a work item of its own, merged
 * through their maxima (flash-decoding): one long request's decode runs on every thread. The split depends on
 * the request alone, never on the batch, so a request's output does not change with what runs beside it. */
#define SPLIT_TOKENS 1024

/* Requests seqs[0..num] (indices into block_tables / context_lens), each with its query row rows[i]. Returns 0,
 * or -1 when scratch memory ran out (the caller raises MemoryError). */
int paged_decode_attention(const void *q, void *out, const void *k_pool, const void *v_pool,
                           const int32_t *block_tables, int64_t table_stride, const int32_t *context_lens,
                           const int64_t *seqs, const int64_t *rows, int64_t num, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t window,
                           int is_bf16, int num_threads) {
    const int64_t d = head_dim, part_size = num_heads * (d + 2);
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(2 * num + 1));
    if (first == NULL) return -1;
    int64_t *lows = first + num + 1, items = 0;
    for (int64_t i = 0; i < num; i++) {
        const int64_t ctx = context_lens[seqs[i]];
        lows[i] = window > 0 && ctx > window ? ctx - window : 0;
        first[i] = items;
        items += (ctx - lows[i] + SPLIT_TOKENS - 1) / SPLIT_TOKENS;
    }
    first[num] = items;
    float *parts = malloc(sizeof(float) * (size_t)(items * part_size));
    int64_t *owner = malloc(sizeof(int64_t) * (size_t)items);
    if (parts == NULL || owner == NULL) {
        free(parts), free(owner), free(first);
        return -1;
    }
    for (int64_t i = 0; i < num; i++)
        for (int64_t k = first[i]; k < first[i + 1]; k++) owner[k] = i;
    int failed = 0;
    /* With fewer splits than threads to share them (a short decode alone), a work item is one kv head's group of
     * query heads in a split, so the threads share even one request. Otherwise an item takes every head, which
     * reads each token's K and V rows whole (measured at 32K: per-group items read them in pieces, 30% slower).
     * Each head computes the same either way. */
    const int64_t per_item = items < 2 * num_threads ? 1 : num_kv_heads, groups = num_kv_heads / per_item;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : failed)
    for (int64_t kg = 0; kg < items * groups; kg++) {
        const int64_t k = kg / groups, g = kg % groups * per_item;
        const int64_t i = owner[k], s = seqs[i], lo = lows[i] + (k - first[i]) * SPLIT_TOKENS;
        const int64_t hi = lo + SPLIT_TOKENS < context_lens[s] ? lo + SPLIT_TOKENS : context_lens[s];
        /* A context past one split is taken to be out of cache: a decode step reads every layer's KV, so beyond
         * a thousand tokens or so of a model's layers the rows come from memory (measured at 32K: 5.1 -> 4.4 ms a
         * layer on 2 threads; at 8K with one layer's rows kept hot, 0.52-0.61 -> 0.69 ms). */
        const int copy = per_item == num_kv_heads && context_lens[s] - lows[i] > SPLIT_TOKENS;
        failed |= attend_range(q, k_pool, v_pool, block_tables + s * table_stride, lo, hi, rows[i], g, g + per_item,
                               num_heads, num_kv_heads, d, block_size, scale, is_bf16, copy,
                               parts + k * part_size) != 0;
    }
    /* Merge each request's splits in order: rescaled to the largest maximum, summed, normalized once (a lone
     * split is its own result: acc / l, as without splitting). */
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t i = 0; i < num; i++) {
        const int64_t hd = num_heads * d, single = first[i + 1] - first[i] == 1;
        for (int64_t h = 0; h < num_heads; h++) {
            float m = -INFINITY, l = 0.f, merged[d];
            for (int64_t k = first[i]; k < first[i + 1]; k++) m = fmaxf(m, parts[k * part_size + h]);
            memset(merged, 0, sizeof merged);
            for (int64_t k = first[i]; k < first[i + 1]; k++) {
                const float *p = parts + k * part_size, w = single ? 1.f : expf(p[h] - m);
                l += w * p[num_heads + h];
                for (int64_t j = 0; j < d; j++) merged[j] += w * p[2 * num_heads + h * d + j];
            }
            for (int64_t j = 0; j < d; j++) put(out, rows[i] * hd + h * d + j, merged[j] / l, is_bf16);
        }
    }
    free(parts), free(owner), free(first);
    return failed ? -1 : 0;
}

/* The step's new K and V rows into their pool slots: row t of k (and v), row_elems elements of elem_size bytes at
 * k + t * k_stride (elements), goes to slot slots[t] of a cache of num_slots rows. One call instead of two
 * index_copy_ calls, which cost more than the copy on a decode step's row. Returns 0, or -1 for a slot out of
 * range (nothing written). */
int paged_write_kv(const void *k, const void *v, void *k_cache, void *v_cache, const int64_t *slots, int64_t t,
                   int64_t k_stride, int64_t v_stride, int64_t row_elems, int64_t elem_size, int64_t num_slots) {
    for (int64_t i = 0; i < t; i++)
        if (slots[i] < 0 || slots[i] >= num_slots) return -1;
    const size_t row = (size_t)(row_elems * elem_size);
    for (int64_t i = 0; i < t; i++) {
        memcpy((char *)k_cache + slots[i] * row, (const char *)k + i * k_stride * elem_size, row);
        memcpy((char *)v_cache + slots[i] * row, (const char *)v + i * v_stride * elem_size, row);
    }
    return 0;
}
