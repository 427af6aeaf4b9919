/* RMSNorm, residual add + RMSNorm, and q/k RMSNorm + rotary embedding, one pass per row, for CPU.
 *
 * torch runs each of these as five to ten small ops per call, which on a decode step's few rows costs more in
 * dispatch than in arithmetic. The math is TorchOps' (ladle/models/layers/ops.py, written to match HF): normalise in
 * fp32, round to the model dtype, multiply by the weight in that dtype; rope as x * cos + rotate_half(x) * sin,
 * each product and the sum rounded to the dtype. Built with -ffp-contract=off, so products and sums round as
 * torch's separate ops do; only the order of the sum of squares differs from torch's.
 *
 * All tensors are of one dtype (fp32, or bf16 when is_bf16), rows of d values; a source row may sit at any
 * stride (q and k are views into the fused qkv projection's output); outputs are contiguous.
 */
#include <math.h>

#include "common.h"

/* v as the dtype holds it */
static inline float rnd(float v, int is_bf16) { return is_bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

#define MAX_DIM 16384 /* the caller falls back to torch for wider rows */
#define PARALLEL_MIN 65536 /* values in a call below which one thread does it all */

/* h (fp32, d values) -> out[0..d) = weight * (h * rsqrt(mean(h^2) + eps) in the dtype), in the dtype. */
static inline void normalise(float *h, const void *weight, int64_t d, float eps, int is_bf16) {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < d; i++) sum += h[i] * h[i];
    const float r = 1.0f / sqrtf(sum / (float)d + eps);
    for (int64_t i = 0; i < d; i++) h[i] = rnd(get(weight, i, is_bf16) * rnd(h[i] * r, is_bf16), is_bf16);
}

void rms_norm(const void *x, int64_t x_stride, const void *weight, void *out, int64_t n, int64_t d, float eps,
              int is_bf16, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (n * d >= PARALLEL_MIN)
    for (int64_t r = 0; r < n; r++) {
        float h[MAX_DIM];
        for (int64_t i = 0; i < d; i++) h[i] = get(x, r * x_stride + i, is_bf16);
        normalise(h, weight, d, eps, is_bf16);
        for (int64_t i = 0; i < d; i++) put(out, r * d + i, h[i], is_bf16);
    }
}

/* total = residual + x (in the dtype), out = rms_norm(total); x, residual contiguous [n, d]. */
void add_rms_norm(const void *x, const void *residual, const void *weight, void *out, void *total, int64_t n,
                  int64_t d, float eps, int is_bf16, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (n * d >= PARALLEL_MIN)
    for (int64_t r = 0; r < n; r++) {
        float h[MAX_DIM];
        for (int64_t i = 0; i < d; i++) {
            h[i] = rnd(get(residual, r * d + i, is_bf16) + get(x, r * d + i, is_bf16), is_bf16);
            put(total, r * d + i, h[i], is_bf16);
        }
        normalise(h, weight, d, eps, is_bf16);
        for (int64_t i = 0; i < d; i++) put(out, r * d + i, h[i], is_bf16);
    }
}

/* src: n tokens x heads rows of d (token stride src_stride, heads adjacent) -> out [n, heads, d]: each row
 * RMS-normalised with weight (skipped when weight is NULL), then rotated by cos/sin [n, d]. */
void norm_rope(const void *src, int64_t src_stride, const void *weight, const void *cos, const void *sin,
               void *out, int64_t n, int64_t heads, int64_t d, float eps, int is_bf16, int num_threads) {
    const int64_t half = d / 2;
#pragma omp parallel for num_threads(num_threads) if (n * heads * d >= PARALLEL_MIN)
    for (int64_t row = 0; row < n * heads; row++) {
        const int64_t t = row / heads, at = t * src_stride + row % heads * d;
        float h[MAX_DIM];
        for (int64_t i = 0; i < d; i++) h[i] = get(src, at + i, is_bf16);
        if (weight != NULL) normalise(h, weight, d, eps, is_bf16);
        for (int64_t i = 0; i < d; i++) {
            const float rotated = i < half ? -h[i + half] : h[i - half];
            const float a = rnd(h[i] * get(cos, t * d + i, is_bf16), is_bf16);
            const float b = rnd(rotated * get(sin, t * d + i, is_bf16), is_bf16);
            put(out, row * d + i, a + b, is_bf16);
        }
    }
}
