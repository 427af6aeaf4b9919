/* A structured-output grammar's bitmask applied to the logits, for CPU.
 *
 * Each constrained row's grammar allows a set of next tokens, given as int32 words: bit t % 32 of word t / 32
 * set when token t is allowed. Every other token's logit becomes -inf. torch's masked_fill over an unpacked
 * bool mask touches every logit through a data-dependent branch (about 2 ns a value here: 1 ms for 16 rows of a
 * 32K vocabulary); a grammar's mask is mostly whole words allowed (inside a JSON string) or whole words
 * forbidden (between JSON tokens), so this loop skips or fills 32 logits per word and tests bits only in the
 * few mixed words.
 */
#include <math.h>
#include <stdint.h>

/* logits: fp32 rows of `stride` values; rows[i] is the logits row of the i-th mask, words + i * num_words
 * its mask. Tokens at or past num_words * 32 (none when the mask covers the vocabulary) are forbidden too. */
void apply_bitmask(float *logits, int64_t stride, int64_t vocab, const int32_t *words, int64_t num_words,
                   const int64_t *rows, int64_t num_rows) {
    for (int64_t i = 0; i < num_rows; i++) {
        float *x = logits + rows[i] * stride;
        const uint32_t *w = (const uint32_t *)(words + i * num_words);
        for (int64_t j = 0; j < num_words && j * 32 < vocab; j++) {
            const uint32_t m = w[j];
            if (m == 0xffffffffu) continue;
            const int64_t base = j * 32, n = vocab - base < 32 ? vocab - base : 32;
            if (m == 0) {
                for (int64_t k = 0; k < n; k++) x[base + k] = -INFINITY;
                continue;
            }
            for (int64_t k = 0; k < n; k++)
                if (!((m >> k) & 1u)) x[base + k] = -INFINITY;
        }
        for (int64_t t = num_words * 32; t < vocab; t++) x[t] = -INFINITY;
    }
}
