/* Paged decode attention on CPU: one query row per request, reading K and V in place from the block pool.
 *
 * Built at first use by ladle/kernels/cpu_kernels.py (gcc -O3 -march=native -fopenmp) and called through
 * ctypes. The OpenMP team is torch's own: the library names libgomp.so.1, which torch has already loaded.
 *
 * Layouts (all contiguous): q, out [T, H, D]; pools [num_blocks, block_size, KVH, D]; block_tables [B, stride]
 * int32; context_lens [B] int32 (tokens in the cache, this step's included). One work item per request. Scores
 * are exact fp32 (no online rescaling): one pass computes them, one takes the max and the exponentials, one
 * accumulates V.
 */
#include <math.h>
#include <stdlib.h>

#include "common.h"

#if LADLE_AVX2
/* out[t] = scale * q . row t, for 8 rows at offs[0..8] (elements) of base; d a multiple of 8. */
static inline void dots8(float *out, const float *q, const void *base, const int64_t *offs, int64_t d, float scale,
                         int is_bf16) {
    __m256 acc[8];
    for (int t = 0; t < 8; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c += 8) {
        const __m256 qc = _mm256_loadu_ps(q + c);
        for (int t = 0; t < 8; t++) acc[t] = _mm256_fmadd_ps(qc, load8(base, offs[t] + c, is_bf16), acc[t]);
    }
    _mm256_storeu_ps(out, _mm256_mul_ps(sum8x8(acc), _mm256_set1_ps(scale)));
}

#endif

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

/* One query row over context tokens [lo, hi) of one request, every head, unnormalized: part holds per head its
 * largest score m[h], then the sum l[h] of exp(score - m[h]), then acc[h][d] the exp-weighted sum of V rows. Each
 * token's K (then V) row for all kv heads is one contiguous run, so the pool streams block by block (per-head
 * passes would stride through it and miss the TLB every few tokens). Returns 0, or -1 when its scratch could not
 * be allocated. */
static int attend_range(const void *q, const void *k_pool, const void *v_pool, const int32_t *table, int64_t lo,
                        int64_t hi, int64_t row, int64_t num_heads, int64_t num_kv_heads, int64_t d,
                        int64_t block_size, float scale, int is_bf16, float *part) {
    const int64_t group = num_heads / num_kv_heads, n = hi - lo, hd = num_heads * d;
    float *qf = malloc(sizeof(float) * (size_t)(hd + num_heads * (n + 8)) + sizeof(int64_t) * (size_t)n);
    if (qf == NULL) return -1;
    float *maxes = part, *total = part + num_heads, *acc = part + 2 * num_heads;
    float *scores = qf + hd; /* [H][n + 8], 8 spare */
    int64_t *offs = (int64_t *)(scores + num_heads * (n + 8));
    const int64_t stride = n + 8;
    for (int64_t i = 0; i < hd; i++) qf[i] = get(q, row * hd + i, is_bf16);
    memset(acc, 0, sizeof(float) * (size_t)hd);
    for (int64_t p = lo; p < hi; p++)
        offs[p - lo] = ((int64_t)table[p / block_size] * block_size + p % block_size) * num_kv_heads * d;
    int64_t i = 0;
#if LADLE_AVX2
    if (d % 8 == 0)
        for (; i + 8 <= n; i += 8)
            for (int64_t h = 0; h < num_heads; h++) {
                int64_t at[8];
                for (int t = 0; t < 8; t++) at[t] = offs[i + t] + h / group * d;
                dots8(scores + h * stride + i, qf + h * d, k_pool, at, d, scale, is_bf16);
            }
#endif
    for (; i < n; i++)
        for (int64_t h = 0; h < num_heads; h++)
            scores[h * stride + i] = scale * dot(qf + h * d, k_pool, offs[i] + h / group * d, d, is_bf16);
    for (int64_t h = 0; h < num_heads; h++) {
        float *s = scores + h * stride, m = -INFINITY, sum = 0.f;
        for (int64_t j = 0; j < n; j++) m = s[j] > m ? s[j] : m;
        for (int64_t j = 0; j < n; j++) {
            s[j] = expf(s[j] - m);
            sum += s[j];
        }
        maxes[h] = m;
        total[h] = sum;
    }
    for (int64_t j = 0; j < n; j++)
        for (int64_t h = 0; h < num_heads; h++)
            axpy(acc + h * d, scores[h * stride + j], v_pool, offs[j] + h / group * d, d, is_bf16);
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
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : failed)
    for (int64_t k = 0; k < items; k++) {
        const int64_t i = owner[k], s = seqs[i], lo = lows[i] + (k - first[i]) * SPLIT_TOKENS;
        const int64_t hi = lo + SPLIT_TOKENS < context_lens[s] ? lo + SPLIT_TOKENS : context_lens[s];
        failed |= attend_range(q, k_pool, v_pool, block_tables + s * table_stride, lo, hi, rows[i], num_heads,
                               num_kv_heads, d, block_size, scale, is_bf16, parts + k * part_size) != 0;
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
