/* The filtered draw of layers/sampler.py (top-k, then top-p, then min-p; an inverse-CDF draw
 * from one uniform number) for rows of the CPU sampler, without sorting the vocabulary.
 *
 * PyTorch's path looks for each row's kept set among its `topk` candidates (64, 256, ...),
 * and a `topk` of a 49152-entry row costs 0.17 ms at 64 and 0.66 ms at 4096 on one core:
 * after a flat distribution a row needed several rounds, ~2 ms a token, a quarter of a
 * single-stream decode step. Here the candidates are the tokens whose logit is within a
 * margin of the row's largest (one pass, then a radix sort of those), widened until they
 * cover the kept set.
 *
 * The result is the token PyTorch's path draws for the same uniform, bit for bit: the same
 * threshold rule over the candidates sorted by logit (`_threshold`: float32 probabilities
 * summed in double and rounded to float32 at each step, as PyTorch's CPU `cumsum` does), and
 * the same draw (the kept probabilities summed in double in token-id order, the first token
 * whose running sum exceeds `u` times the total). Candidates are a value threshold, so they
 * are a top-k set with ties whole, which leaves the kept set unchanged.
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <omp.h>

#include "native.h"

/* A candidate is one uint64: a key that orders logits descending in its high 32 bits, the
 * token id in its low 32, so a radix sort on the high half sorts by logit (ties by id). */
typedef uint64_t candidate;

static inline uint32_t descending_key(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    const uint32_t ascending = bits & 0x80000000u ? ~bits : bits | 0x80000000u;
    return ~ascending;
}

static inline int32_t id_of(candidate c) { return (int32_t)(c & 0xFFFFFFFFu); }

/* LSD radix sort of `n` candidates on their keys, 8 bits a pass, `tmp` as room for n. */
static void sort_candidates(candidate *c, candidate *tmp, int64_t n) {
    for (int shift = 32; shift < 64; shift += 8) {
        int64_t count[257] = {0};
        for (int64_t i = 0; i < n; i++) count[((c[i] >> shift) & 0xFF) + 1]++;
        for (int b = 0; b < 256; b++) count[b + 1] += count[b];
        for (int64_t i = 0; i < n; i++) tmp[count[(c[i] >> shift) & 0xFF]++] = c[i];
        memcpy(c, tmp, sizeof(candidate) * (size_t)n);
    }
}

/* The smallest kept logit among `n` candidates sorted by value (descending); `*covered`:
 * the candidates hold the whole kept set. Mirrors `_threshold` in layers/sampler.py step for
 * step (each candidate's keep flag, then their count), so rounding ties the same way. */
static float kept_threshold(const candidate *c, int64_t n, const float *x, const float *probs,
                            int64_t top_k, float top_p, float min_p, int *covered) {
    const float kth_value = top_k > 0 ? x[id_of(c[(top_k < n ? top_k : n) - 1])] : 0.0f;
    float mass = 1.0f;
    if (top_p < 1.0f && top_k > 0) { /* top-p renormalizes over what top-k kept */
        double sum = 0.0;
        for (int64_t j = 0; j < n; j++)
            if (x[id_of(c[j])] >= kth_value) sum += (double)probs[id_of(c[j])];
        mass = (float)sum;
    }
    const float limit = top_p * mass, floor = min_p * probs[id_of(c[0])];
    double sum = 0.0;
    int64_t num_kept = 0;
    for (int64_t j = 0; j < n; j++) {
        const float p = probs[id_of(c[j])];
        int keep = top_k <= 0 || x[id_of(c[j])] >= kth_value;
        if (top_p < 1.0f) {
            const float kept_p = keep ? p : 0.0f;
            sum += (double)kept_p;
            keep = keep && (float)sum - kept_p <= limit;
        }
        if (min_p > 0.0f) keep = keep && p >= floor;
        num_kept += keep;
    }
    const float threshold = x[id_of(c[(num_kept > 0 ? num_kept : 1) - 1])];
    const int known = top_k <= n;
    const int32_t last = id_of(c[n - 1]);
    *covered = known && (x[last] < threshold || probs[last] == 0.0f);
    return threshold;
}

/* One row: x (temperature-scaled logits) and probs (softmax(x)), both [vocab] float32, the
 * row's filters (top_k 0 = off, top_p 1 = off, min_p 0 = off) and uniform u in [0, 1) ->
 * the token id. `scratch`: room for 2 x `vocab` candidates. */
static int64_t filtered_draw(const float *x, const float *probs, int64_t vocab, int64_t top_k,
                             float top_p, float min_p, double u, candidate *scratch) {
    float largest = -INFINITY;
    for (int64_t i = 0; i < vocab; i++) largest = x[i] > largest ? x[i] : largest;
    /* Widening margins (in units of the scaled logits): 8 keeps tokens down to e^-8 of the
     * most likely one, which covers the kept set of almost every row at once. */
    static const float margins[] = {8.0f, 16.0f, 32.0f, INFINITY};
    float threshold = largest;
    for (int m = 0; m < 4; m++) {
        const float floor = largest - margins[m];
        int64_t n = 0;
        for (int64_t i = 0; i < vocab; i++)
            if (x[i] >= floor || isinf(margins[m]))
                scratch[n++] = (uint64_t)descending_key(x[i]) << 32 | (uint32_t)i;
        if (n == 0) continue; /* a row of NaNs: no candidate to index until the last margin */
        sort_candidates(scratch, scratch + vocab, n);
        int covered;
        threshold = kept_threshold(scratch, n, x, probs, top_k, top_p, min_p, &covered);
        if (covered || n == vocab) break;
    }
    double total = 0.0;
    for (int64_t i = 0; i < vocab; i++)
        if (x[i] >= threshold) total += (double)probs[i];
    if (!(total > 0.0)) return -1; /* no mass, or NaN from an infinite logit: no draw */
    double target = u * total;
    const double below_total = nextafter(total, 0.0);
    if (target > below_total) target = below_total;
    double cdf = 0.0;
    int64_t last = -1;
    for (int64_t i = 0; i < vocab; i++) {
        if (x[i] < threshold) continue;
        cdf += (double)probs[i];
        last = i;
        if (cdf > target) return i;
    }
    return last;
}

/* One thread's candidates: 2 x `vocab`, rounded to whole cache lines. */
static inline int64_t draw_scratch_bytes(int64_t vocab) {
    return (2 * vocab * (int64_t)sizeof(candidate) + 63) / 64 * 64;
}

/* Bytes of the workspace `nls_filtered_draw` needs for rows of `vocab` on `num_threads`
 * threads; 0 for sizes it cannot run. */
int64_t nls_filtered_draw_workspace_bytes(int64_t vocab, int num_threads) {
    if (vocab <= 0 || vocab > INT32_MAX || num_threads < 1) return 0;
    return 64 + (int64_t)num_threads * draw_scratch_bytes(vocab);
}

/* Rows [rows, vocab] of `x` and `probs`, one filter set and uniform per row -> `tokens`
 * (-1 for a row whose kept tokens have no mass, or NaN mass: the caller's fallback picks).
 * `workspace`: at least nls_filtered_draw_workspace_bytes(vocab, num_threads) bytes, reused
 * across calls (each thread sorts its rows' candidates in its own slice). Returns 0, or
 * NLS_BAD_SHAPE when `rows` or `vocab` is out of range (ids are kept in 32 bits) or the
 * workspace too small. */
int nls_filtered_draw(const float *x, const float *probs, int64_t rows, int64_t vocab,
                      const int64_t *top_k, const float *top_p, const float *min_p,
                      const double *u, int64_t *tokens, void *workspace, int64_t workspace_bytes,
                      int num_threads) {
    if (rows < 0 || vocab <= 0 || vocab > INT32_MAX || num_threads < 1 || workspace == NULL ||
        workspace_bytes < nls_filtered_draw_workspace_bytes(vocab, num_threads))
        return NLS_BAD_SHAPE;
    uint8_t *base = (uint8_t *)(((uintptr_t)workspace + 63) / 64 * 64);
#pragma omp parallel num_threads(num_threads)
    {
        candidate *scratch = (candidate *)(base + (int64_t)omp_get_thread_num() * draw_scratch_bytes(vocab));
#pragma omp for schedule(dynamic)
        for (int64_t r = 0; r < rows; r++)
            tokens[r] = filtered_draw(x + r * vocab, probs + r * vocab, vocab, top_k[r], top_p[r],
                                      min_p[r], u[r], scratch);
    }
    return 0;
}
