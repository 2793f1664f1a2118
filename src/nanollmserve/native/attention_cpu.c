/* Attention over the paged KV cache on the CPU (K/V laid out [blocks, block_size, kv_heads,
 * head_dim], float32, float16, or int8 codes with a float scale per token and KV head:
 * `nls_kv_cache` in native.h), read in place through block tables: query rows over a chunk of keys, their partial
 * softmaxes merged after (`nls_attend_chunk`, `nls_merge_chunks`: the decode step's decode
 * tokens and verify spans in gguf_cpu.c), a run of a sequence's tokens as tiles
 * (`nls_attend_span`), and the decode tokens of the PyTorch path's batched step, a KV head's
 * query heads at a time (`nls_attend_group` inside `nls_paged_decode_attention`). An int8 row
 * is dequantized in registers (8 codes widened to floats, times the row's scale), a float16
 * row converted in registers (F16C), never copied out as floats. Each loop takes the cache's
 * type `kind` as a constant: the compiler makes one copy of it per type. The decode step's
 * kernels take a `window` (a sliding layer: a row at position p sees keys p - window + 1 ..
 * p): keys before a row's window weigh exactly 0, and those before every row's window of a
 * pass are not read; 0 is full attention, the same arithmetic as without the argument. */

#include <string.h>

#include <omp.h>

#include "native.h"

/* Six query rows' weighted values as named registers (X(0) .. X(5)): the ymm loops below
 * kept an array of their accumulators on the stack, a load and a store per row and key (gcc
 * scalarizes no array that large). ATTEND_ROWS and the span's pass are six rows. */
#define SIX_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
_Static_assert(ATTEND_ROWS == 6, "SIX_ROWS unrolls ATTEND_ROWS rows");
/* Row x's two accumulators (16 dimensions), zeroed. */
#define ZERO_ROW(x) __m256 lo##x = _mm256_setzero_ps(), hi##x = _mm256_setzero_ps();

/* The scaled dot products of query row `q` with 8 keys (`keys[c]`: hd floats each, their
 * scales in `key_scale`) as one vector: 8 accumulators, reduced together at the end (with
 * AVX-512 and hd a multiple of 16, 16 dimensions an instruction, each accumulator's halves
 * added before the reduction). */
static inline __m256 scores8(const float *q, const float *const keys[8], __m256 key_scale, int hd) {
    __m256 a[8];
#if defined(__AVX512F__)
    if (hd % 16 == 0) {
        __m512 w[8];
        for (int c = 0; c < 8; c++) w[c] = _mm512_setzero_ps();
        for (int i = 0; i < hd; i += 16) {
            const __m512 qi = _mm512_loadu_ps(q + i);
            for (int c = 0; c < 8; c++) w[c] = _mm512_fmadd_ps(qi, _mm512_loadu_ps(keys[c] + i), w[c]);
        }
        for (int c = 0; c < 8; c++)
            a[c] = _mm256_add_ps(_mm512_castps512_ps256(w[c]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w[c]), 1)));
    } else
#endif
    {
        for (int c = 0; c < 8; c++) a[c] = _mm256_setzero_ps();
        for (int i = 0; i < hd; i += 8) {
            const __m256 qi = _mm256_loadu_ps(q + i);
            for (int c = 0; c < 8; c++) a[c] = _mm256_fmadd_ps(qi, _mm256_loadu_ps(keys[c] + i), a[c]);
        }
    }
    const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 lo = _mm256_hadd_ps(h01, h23), hi = _mm256_hadd_ps(h45, h67);
    const __m256 dots = _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
    return _mm256_mul_ps(dots, key_scale);
}

#if defined(__AVX512F__)
/* The weighted values of a chunk with AVX-512, for head sizes that are a multiple of 64: each
 * value row read once (64 dimensions at a time) for all `nr` rows, whose accumulators stay in
 * registers; -> part rows r0.. as the vector loop below writes them. */
static inline __attribute__((always_inline)) void weighted_values_512(const nls_kv_cache *kv, int kvh, int g, int hd,
                                                                      int bs, const int64_t *block_table, int64_t k0,
                                                                      int64_t first, int64_t last, const float *scores,
                                                                      int64_t width,
                                                                      int nr, float *part, const int kind) {
    for (int d0 = 0; d0 < hd; d0 += 64) {
        __m512 acc[ATTEND_ROWS][4];
        for (int x = 0; x < ATTEND_ROWS; x++)
            for (int j = 0; j < 4; j++) acc[x][j] = _mm512_setzero_ps();
        int64_t block = first / bs, offset = first % bs;
        for (int64_t t = first; t < last; t++) {
            const int64_t row = (block_table[block] * bs + offset) * kvh + g;
            if (++offset == bs) offset = 0, block++;
            __m512 v[4];
            if (kind == NLS_KV_INT8) {
                const int8_t *src = (const int8_t *)kv->v + row * hd + d0;
                const __m512 vs = _mm512_set1_ps(kv->v_scale[row]);
                for (int j = 0; j < 4; j++)
                    v[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 16 * j)))), vs);
            } else if (kind == NLS_KV_F16) {
                const uint16_t *src = (const uint16_t *)kv->v + row * hd + d0;
                for (int j = 0; j < 4; j++) v[j] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + 16 * j)));
            } else {
                const float *src = (const float *)kv->v + row * hd + d0;
                for (int j = 0; j < 4; j++) v[j] = _mm512_loadu_ps(src + 16 * j);
            }
            for (int x = 0; x < ATTEND_ROWS; x++) {
                if (x >= nr) break;
                const __m512 w = _mm512_set1_ps(scores[x * width + (t - k0)]);
                for (int j = 0; j < 4; j++) acc[x][j] = _mm512_fmadd_ps(w, v[j], acc[x][j]);
            }
        }
        for (int x = 0; x < nr; x++)
            for (int j = 0; j < 4; j++) _mm512_storeu_ps(part + (int64_t)x * (hd + 2) + 2 + d0 + 16 * j, acc[x][j]);
    }
}
#endif

/* The largest of n scores, 8 lanes at a time (a serial scalar max waits on each compare: it
 * was a fifth of this file's samples in a speculative run). NaNs are skipped like the scalar compare skips
 * them: `max_ps` returns its second operand, the running maximum, when either is NaN. */
static inline float largest_of(const float *row, int64_t n) {
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) m8 = _mm256_max_ps(_mm256_loadu_ps(row + t), m8);
    float lanes[8], largest = -INFINITY;
    _mm256_storeu_ps(lanes, m8);
    for (int i = 0; i < 8; i++) largest = lanes[i] > largest ? lanes[i] : largest;
    for (; t < n; t++) largest = row[t] > largest ? row[t] : largest;
    return largest;
}

/* Query rows of one sequence over KV head `g`: the `group` query heads of each of `n`
 * consecutive tokens at positions p0 .. p0 + n - 1 (a decode token alone, n = 1, or a
 * speculative verify span), row i * group + j at q + i * q_stride + j * hd, over the keys
 * [k0, k1) each row sees (token i's keys are those < p0 + i + 1, and with a `window` those
 * >= p0 + i + 1 - window). -> `part`, hd + 2 floats per
 * row: the largest score (-inf for a row that sees none of these keys), the sum of
 * exp(score - largest) and the values weighted by those exponentials, not yet divided by the
 * sum (`nls_merge_chunks` joins a row's chunks). Up to ATTEND_ROWS rows at a time: the scores
 * 8 keys per row at a time, the weighted values 16 dimensions of every row at a time (64 with
 * AVX-512) from registers, each value row read once for all of them. An int8 row's scale
 * multiplies its dot product (keys) or its values; int8 and float16 keys are widened to floats
 * 8 at a time before their dot products. A row's arithmetic does not depend on which rows share its
 * pass (a key past a row's own gets weight 0), so a verify row gets the numbers its token
 * would get alone. `scores`: ATTEND_ROWS * (k1 - k0 rounded up to 8) floats. */
static inline __attribute__((always_inline)) void attend_chunk(const float *q, int64_t q_stride, const nls_kv_cache *kv,
                                                               int kvh, int g, int group, int hd, int bs, float scale,
                                                               const int64_t *block_table, int64_t p0, int n,
                                                               int64_t k0, int64_t k1, int64_t window, float *scores,
                                                               float *part, const int kind) {
    static const float zero_key[MAX_HEAD_DIM];
    float key_floats[8 * MAX_HEAD_DIM]; /* 8 int8 or float16 keys as floats */
    const int rows = n * group;
    const int64_t width = (k1 - k0 + 7) / 8 * 8;
    for (int r0 = 0; r0 < rows; r0 += ATTEND_ROWS) {
        const int nr = rows - r0 < ATTEND_ROWS ? rows - r0 : ATTEND_ROWS;
        const float *qr[ATTEND_ROWS];
        int64_t end[ATTEND_ROWS], begin[ATTEND_ROWS];
        for (int x = 0; x < nr; x++) {
            const int r = r0 + x;
            const int64_t own = p0 + r / group + 1;
            qr[x] = q + (r / group) * q_stride + (int64_t)(r % group) * hd;
            end[x] = own < k1 ? own : k1; /* rows in token order: end never decreases */
            /* a sliding layer's row sees keys from own - window on: neither does begin decrease */
            begin[x] = window && own - window > k0 ? own - window : k0;
        }
        const int64_t last = end[nr - 1];
        /* the keys no row of the pass sees (out of every row's window) are skipped, 8 at a time */
        const int64_t first = k0 + (begin[0] < last ? begin[0] - k0 : last - k0) / 8 * 8;
        /* key t's cache row: (block_table[t / bs] * bs + t % bs) * kvh + g, stepped without a
         * division per key */
        int64_t block = first / bs, offset = first % bs;
        for (int64_t t0 = first; t0 < last; t0 += 8) {
            const float *keys[8];
            float key_scale[8];
            for (int c = 0; c < 8; c++) {
                const int64_t t = t0 + c;
                if (t >= last) {
                    keys[c] = zero_key, key_scale[c] = 0.0f;
                    continue;
                }
                const int64_t row = (block_table[block] * bs + offset) * kvh + g;
                if (++offset == bs) offset = 0, block++;
                if (kind == NLS_KV_INT8) {
                    for (int i = 0; i < hd; i += 8)
                        _mm256_storeu_ps(key_floats + c * hd + i, load_i8x8((const int8_t *)kv->k + row * hd + i));
                    keys[c] = key_floats + c * hd, key_scale[c] = kv->k_scale[row] * scale;
                } else if (kind == NLS_KV_F16) {
                    for (int i = 0; i < hd; i += 8)
                        _mm256_storeu_ps(key_floats + c * hd + i, load_f16x8((const uint16_t *)kv->k + row * hd + i));
                    keys[c] = key_floats + c * hd, key_scale[c] = scale;
                } else {
                    keys[c] = (const float *)kv->k + row * hd, key_scale[c] = scale;
                }
            }
            const __m256 ks = _mm256_loadu_ps(key_scale);
            for (int x = 0; x < nr; x++)
                if (end[x] > t0) _mm256_storeu_ps(scores + x * width + (t0 - k0), scores8(qr[x], keys, ks, hd));
        }
        float largest[ATTEND_ROWS], sum[ATTEND_ROWS];
        for (int x = 0; x < nr; x++) {
            float *row = scores + x * width;
            const int64_t count = end[x] - k0, seen = last - k0;
            /* keys before the row's window (a sliding layer) weigh 0, like those past its own */
            const int64_t skip = begin[x] - k0 < count ? begin[x] - k0 : (count > 0 ? count : 0);
            for (int64_t t = first - k0; t < skip; t++) row[t] = 0.0f;
            row += skip;
            largest[x] = largest_of(row, count - skip);
            __m256 sum8 = _mm256_setzero_ps();
            const __m256 mx = _mm256_set1_ps(largest[x]);
            int64_t t = 0;
            for (; t + 8 <= count - skip; t += 8) {
                const __m256 e = exp256_ps(_mm256_sub_ps(_mm256_loadu_ps(row + t), mx));
                _mm256_storeu_ps(row + t, e);
                sum8 = _mm256_add_ps(sum8, e);
            }
            sum[x] = hsum_ps(sum8);
            for (; t < count - skip; t++) {
                row[t] = expf(row[t] - largest[x]);
                sum[x] += row[t];
            }
            for (t = count > 0 ? count - skip : 0; t < seen - skip; t++) row[t] = 0.0f; /* keys past the row's own */
        }
#if defined(__AVX512F__)
        if (hd % 64 == 0)
            weighted_values_512(kv, kvh, g, hd, bs, block_table, k0, first, last, scores, width, nr,
                                part + (int64_t)r0 * (hd + 2), kind);
        else
#endif
        for (int d0 = 0; d0 < hd; d0 += 16) {
            const int pair = hd - d0 >= 16;
            SIX_ROWS(ZERO_ROW)
            block = first / bs, offset = first % bs;
            for (int64_t t = first; t < last; t++) {
                const int64_t row = (block_table[block] * bs + offset) * kvh + g;
                if (++offset == bs) offset = 0, block++;
                __m256 v0, v1 = _mm256_setzero_ps();
                if (kind == NLS_KV_INT8) {
                    const int8_t *v = (const int8_t *)kv->v + row * hd + d0;
                    const __m256 vs = _mm256_set1_ps(kv->v_scale[row]);
                    v0 = _mm256_mul_ps(load_i8x8(v), vs);
                    if (pair) v1 = _mm256_mul_ps(load_i8x8(v + 8), vs);
                } else if (kind == NLS_KV_F16) {
                    const uint16_t *v = (const uint16_t *)kv->v + row * hd + d0;
                    v0 = load_f16x8(v);
                    if (pair) v1 = load_f16x8(v + 8);
                } else {
                    const float *v = (const float *)kv->v + row * hd + d0;
                    v0 = _mm256_loadu_ps(v);
                    if (pair) v1 = _mm256_loadu_ps(v + 8);
                }
#define WEIGH_ROW(x)                                                                  \
                if (x < nr) {                                                         \
                    const __m256 w = _mm256_broadcast_ss(scores + x * width + (t - k0)); \
                    lo##x = _mm256_fmadd_ps(w, v0, lo##x);                           \
                    hi##x = _mm256_fmadd_ps(w, v1, hi##x);                           \
                }
                SIX_ROWS(WEIGH_ROW)
            }
#define STORE_ROW(x)                                                     \
            if (x < nr) {                                                \
                float *p = part + (int64_t)(r0 + x) * (hd + 2);          \
                _mm256_storeu_ps(p + 2 + d0, lo##x);                     \
                if (pair) _mm256_storeu_ps(p + 2 + d0 + 8, hi##x);       \
            }
            SIX_ROWS(STORE_ROW)
        }
        for (int x = 0; x < nr; x++) {
            float *p = part + (int64_t)(r0 + x) * (hd + 2);
            p[0] = largest[x], p[1] = sum[x];
        }
    }
}

void nls_attend_chunk(const float *q, int64_t q_stride, const nls_kv_cache *kv, int kvh, int g, int group, int hd,
                      int bs, float scale, const int64_t *block_table, int64_t p0, int n, int64_t k0, int64_t k1,
                      int64_t window, float *scores, float *part) {
    if (kv->dtype == NLS_KV_INT8)
        attend_chunk(q, q_stride, kv, kvh, g, group, hd, bs, scale, block_table, p0, n, k0, k1, window, scores, part,
                     NLS_KV_INT8);
    else if (kv->dtype == NLS_KV_F16)
        attend_chunk(q, q_stride, kv, kvh, g, group, hd, bs, scale, block_table, p0, n, k0, k1, window, scores, part,
                     NLS_KV_F16);
    else
        attend_chunk(q, q_stride, kv, kvh, g, group, hd, bs, scale, block_table, p0, n, k0, k1, window, scores, part,
                     NLS_KV_F32);
}

/* One query row's output from its partials over `chunks` chunks (`nls_attend_chunk`'s, hd + 2
 * floats each, `part_stride` floats apart): each chunk's exponentials rescaled to the largest
 * score of all, summed in chunk order, divided by the total. A chunk the row sees no key of
 * adds exact zeros, so a row's bits depend only on its own context length. */
void nls_merge_chunks(const float *part, int64_t part_stride, int chunks, int hd, float *out) {
    float largest = -INFINITY, weight[ATTEND_MAX_CHUNKS], total = 0.0f;
    for (int c = 0; c < chunks; c++) largest = part[c * part_stride] > largest ? part[c * part_stride] : largest;
    for (int c = 0; c < chunks; c++) {
        weight[c] = part[c * part_stride + 1] > 0.0f ? expf(part[c * part_stride] - largest) : 0.0f;
        total += part[c * part_stride + 1] * weight[c];
    }
    const __m256 inv = _mm256_set1_ps(1.0f / total);
    for (int i = 0; i < hd; i += 8) {
        __m256 o = _mm256_setzero_ps();
        for (int c = 0; c < chunks; c++)
            o = _mm256_fmadd_ps(_mm256_set1_ps(weight[c]), _mm256_loadu_ps(part + c * part_stride + 2 + i), o);
        _mm256_storeu_ps(out + i, _mm256_mul_ps(o, inv));
    }
}

/* The `group` query heads that share KV head `g` (grouped-query attention: `group`
 * consecutive heads of `hd` floats) over a sequence's first `ctx` keys, read in place from the
 * paged cache through its block table: the chunks of `attend_chunks(ctx)` one after another,
 * then merged, the same numbers as a decode step's items. `scratch`: attend_scratch_floats. */
void nls_attend_group(const float *q, const nls_kv_cache *kv, int kvh, int g, int group, int hd, int bs,
                      float scale, const int64_t *block_table, int64_t ctx, float *scratch, float *out) {
    const int64_t keys = attend_chunk_keys(ctx), chunks = attend_chunks(ctx);
    float *part = scratch + ATTEND_ROWS * keys;
    const int64_t stride = (int64_t)group * (hd + 2);
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t k1 = (c + 1) * keys < ctx ? (c + 1) * keys : ctx;
        nls_attend_chunk(q, 0, kv, kvh, g, group, hd, bs, scale, block_table, ctx - 1, 1, c * keys, k1, 0, scratch,
                         part + c * stride);
    }
    for (int j = 0; j < group; j++)
        nls_merge_chunks(part + (int64_t)j * (hd + 2), stride, (int)chunks, hd, out + (int64_t)j * hd);
}

/* ------------------------------------- attention of a span of one sequence's tokens -- */

/* `n` consecutive tokens of one sequence at positions p0 .. p0 + n - 1 (a prefill chunk or a
 * speculative verify span) over KV head `g`: their `group` query heads each are a row, n *
 * group rows in all (query row i * group + j is token i's head j, at q + i * q_stride + j *
 * hd; its output at out + i * out_stride + j * hd), and row i sees keys < p0 + i + 1
 * (causal), and with a `window` only those from p0 + i + 1 - window on. The products run as small matrix products, which a per-token loop cannot: 8 keys
 * at a time are transposed (an int8 or float16 row widened to floats) into `kt` [hd][8], and 8 rows at a time
 * take their 8 scores as one vector (8 accumulators, no horizontal sum per key); the values
 * are weighted for 6 rows at a time, 16 of their dimensions per pass, each value row read
 * once for 6 rows. `scores`: TILE_ROWS(group) * (p0 + n rounded up to 8) floats; `kt`: hd * 8
 * floats. */
static inline __attribute__((always_inline)) void attend_span(const float *q, int64_t q_stride, const nls_kv_cache *kv,
                                                              int kvh, int g, int group, int hd, int bs, float scale,
                                                              const int64_t *block_table, int64_t p0, int n,
                                                              int64_t window, float *scores, float *kt, float *out,
                                                              int64_t out_stride, const int kind) {
    const int rows = n * group, padded_rows = (rows + 7) / 8 * 8;
    const int64_t ctx = p0 + n, width = (ctx + 7) / 8 * 8;
    /* A sliding layer's row sees keys from own - window on; the keys before the first row's
     * window are skipped, 8 at a time (their weights are 0 for every row). */
    const int64_t first = window && p0 + 1 - window > 0 ? (p0 + 1 - window) / 8 * 8 : 0;
    const float *qr[SPAN_TILE_ROWS_MAX];
    for (int r = 0; r < padded_rows; r++) {
        const int row = r < rows ? r : 0; /* padding rows repeat row 0; their scores are unused */
        qr[r] = q + (row / group) * q_stride + (int64_t)(row % group) * hd;
    }
    /* scores: 8 keys x 8 rows per pass */
    for (int64_t k0 = first; k0 < ctx; k0 += 8) {
        const int keys = ctx - k0 < 8 ? (int)(ctx - k0) : 8;
        for (int c = 0; c < 8; c++) {
            if (c >= keys) {
                for (int d = 0; d < hd; d++) kt[d * 8 + c] = 0.0f;
                continue;
            }
            const int64_t t = k0 + c, row = (block_table[t / bs] * bs + t % bs) * kvh + g;
            if (kind == NLS_KV_INT8) {
                const int8_t *k = (const int8_t *)kv->k + row * hd;
                const float ks = kv->k_scale[row] * scale;
                for (int d = 0; d < hd; d++) kt[d * 8 + c] = (float)k[d] * ks;
            } else if (kind == NLS_KV_F16) {
                const uint16_t *k = (const uint16_t *)kv->k + row * hd;
                for (int d = 0; d < hd; d++) kt[d * 8 + c] = _cvtsh_ss(k[d]) * scale;
            } else {
                const float *k = (const float *)kv->k + row * hd;
                for (int d = 0; d < hd; d++) kt[d * 8 + c] = k[d] * scale;
            }
        }
        for (int r0 = 0; r0 < padded_rows; r0 += 8) {
            __m256 acc[8];
            for (int x = 0; x < 8; x++) acc[x] = _mm256_setzero_ps();
            for (int d = 0; d < hd; d++) {
                const __m256 kd = _mm256_loadu_ps(kt + d * 8);
                for (int x = 0; x < 8; x++) acc[x] = _mm256_fmadd_ps(_mm256_broadcast_ss(qr[r0 + x] + d), kd, acc[x]);
            }
            for (int x = 0; x < 8; x++) _mm256_storeu_ps(scores + (int64_t)(r0 + x) * width + k0, acc[x]);
        }
    }
    /* softmax of each row over its own keys; the weights past them are 0; an int8 value row's
     * scale is folded into its weight after the sum */
    float inv_sum[SPAN_TILE_ROWS_MAX];
    for (int r = 0; r < rows; r++) {
        const int64_t own = p0 + r / group + 1, begin = window && own - window > 0 ? own - window : 0;
        for (int64_t u = first; u < begin; u++) scores[(int64_t)r * width + u] = 0.0f; /* out of the window */
        float *row = scores + (int64_t)r * width + begin; /* from the row's first key */
        const float mx = largest_of(row, own - begin);
        const __m256 mx8 = _mm256_set1_ps(mx);
        __m256 sum8 = _mm256_setzero_ps();
        int64_t t = 0;
        for (; t + 8 <= own - begin; t += 8) {
            const __m256 e = exp256_ps(_mm256_sub_ps(_mm256_loadu_ps(row + t), mx8));
            _mm256_storeu_ps(row + t, e);
            sum8 = _mm256_add_ps(sum8, e);
        }
        float sum = hsum_ps(sum8);
        for (; t < own - begin; t++) {
            row[t] = expf(row[t] - mx);
            sum += row[t];
        }
        for (; t < width - begin; t++) row[t] = 0.0f;
        inv_sum[r] = 1.0f / sum;
        if (kind == NLS_KV_INT8)
            for (int64_t u = begin; u < own; u++)
                row[u - begin] *= kv->v_scale[(block_table[u / bs] * bs + u % bs) * kvh + g];
    }
    /* the weighted values: 6 rows x 16 dimensions per pass */
    for (int r0 = 0; r0 < rows; r0 += 6) {
        const int rr = rows - r0 < 6 ? rows - r0 : 6;
        const int64_t last = p0 + (r0 + rr - 1) / group + 1; /* the keys the pass's last row sees */
        const int64_t own0 = p0 + r0 / group + 1; /* and the pass's first row's window */
        const int64_t begin0 = window && own0 - window > 0 ? own0 - window : 0;
        for (int d0 = 0; d0 < hd; d0 += 16) {
            SIX_ROWS(ZERO_ROW)
            for (int64_t t = begin0; t < last; t++) {
                const int64_t row = (block_table[t / bs] * bs + t % bs) * kvh + g;
                __m256 v0, v1;
                if (kind == NLS_KV_INT8) {
                    const int8_t *v = (const int8_t *)kv->v + row * hd + d0;
                    v0 = load_i8x8(v);
                    v1 = hd - d0 >= 16 ? load_i8x8(v + 8) : _mm256_setzero_ps();
                } else if (kind == NLS_KV_F16) {
                    const uint16_t *v = (const uint16_t *)kv->v + row * hd + d0;
                    v0 = load_f16x8(v);
                    v1 = hd - d0 >= 16 ? load_f16x8(v + 8) : _mm256_setzero_ps();
                } else {
                    const float *v = (const float *)kv->v + row * hd + d0;
                    v0 = _mm256_loadu_ps(v);
                    v1 = hd - d0 >= 16 ? _mm256_loadu_ps(v + 8) : _mm256_setzero_ps();
                }
#define SPAN_WEIGH_ROW(x)                                                                 \
                if (x < rr) {                                                             \
                    const __m256 w = _mm256_broadcast_ss(scores + (int64_t)(r0 + x) * width + t); \
                    lo##x = _mm256_fmadd_ps(w, v0, lo##x);                               \
                    hi##x = _mm256_fmadd_ps(w, v1, hi##x);                               \
                }
                SIX_ROWS(SPAN_WEIGH_ROW)
            }
#define SPAN_STORE_ROW(x)                                                                       \
            if (x < rr) {                                                                       \
                const int r = r0 + x;                                                           \
                float *o = out + (r / group) * out_stride + (int64_t)(r % group) * hd + d0;     \
                const __m256 inv = _mm256_set1_ps(inv_sum[r]);                                  \
                _mm256_storeu_ps(o, _mm256_mul_ps(lo##x, inv));                                 \
                if (hd - d0 >= 16) _mm256_storeu_ps(o + 8, _mm256_mul_ps(hi##x, inv));          \
            }
            SIX_ROWS(SPAN_STORE_ROW)
        }
    }
}

void nls_attend_span(const float *q, int64_t q_stride, const nls_kv_cache *kv, int kvh, int g, int group, int hd,
                     int bs, float scale, const int64_t *block_table, int64_t p0, int n, int64_t window,
                     float *scores, float *kt, float *out, int64_t out_stride) {
    if (kv->dtype == NLS_KV_INT8)
        attend_span(q, q_stride, kv, kvh, g, group, hd, bs, scale, block_table, p0, n, window, scores, kt, out,
                    out_stride, NLS_KV_INT8);
    else if (kv->dtype == NLS_KV_F16)
        attend_span(q, q_stride, kv, kvh, g, group, hd, bs, scale, block_table, p0, n, window, scores, kt, out,
                    out_stride, NLS_KV_F16);
    else
        attend_span(q, q_stride, kv, kvh, g, group, hd, bs, scale, block_table, p0, n, window, scores, kt, out,
                    out_stride, NLS_KV_F32);
}

/* ------------------------------------------------ public: attention of decode tokens -- */

/* One thread's scratch for `nls_attend_group` over up to `max_context` keys (a chunk's scores,
 * every chunk's partials), rounded to whole cache lines so no two threads write the same line. */
static inline int64_t scores_bytes(int32_t num_heads, int32_t num_kv_heads, int64_t max_context) {
    return (attend_scratch_floats(max_context, num_heads / num_kv_heads) * (int64_t)sizeof(float) + 63) / 64 * 64;
}

/* Bytes of the workspace `nls_paged_decode_attention` needs for block tables covering
 * `max_context` keys (table_width * block_size) on `num_threads` threads; 0 for sizes it
 * cannot run. */
int64_t nls_paged_decode_attention_workspace_bytes(int32_t num_heads, int32_t num_kv_heads, int64_t max_context,
                                                   int num_threads) {
    if (num_heads <= 0 || num_kv_heads <= 0 || num_heads % num_kv_heads || max_context < 0 || num_threads < 1)
        return 0;
    return 64 + (int64_t)num_threads * scores_bytes(num_heads, num_kv_heads, max_context);
}

/* The decode tokens of a batched step: q [seqs, heads, head_dim] -> out (same shape), each
 * sequence attending to its first context_lens[s] keys through its row of `block_tables`
 * ([seqs, table_width]), read in place from the layer's paged K/V `kv`. Every (sequence, KV
 * head) is one work item, its query heads attended together, their scores in the calling
 * thread's slice of `workspace` (at least nls_paged_decode_attention_workspace_bytes(num_heads,
 * num_kv_heads, table_width * block_size, num_threads) bytes, reused across calls). Returns 0,
 * NLS_BAD_SHAPE for heads, a head_dim or a workspace it cannot run, NLS_BAD_POSITION for a
 * context length not in [1, table_width * block_size], or NLS_BAD_BLOCK for a block id
 * outside [0, num_blocks) (the caches' first dimension). */
static int paged_decode_attention(const float *q, const nls_kv_cache *kv, int64_t num_seqs, int32_t num_heads,
                                  int32_t num_kv_heads, int32_t head_dim, int32_t block_size, int64_t num_blocks,
                                  float scale, const int64_t *block_tables, int64_t table_width,
                                  const int64_t *context_lens, float *out, void *workspace, int64_t workspace_bytes,
                                  int num_threads) {
    if (num_seqs < 0 || num_heads <= 0 || num_kv_heads <= 0 || num_heads % num_kv_heads || head_dim <= 0 ||
        head_dim > MAX_HEAD_DIM || head_dim % 8 || block_size <= 0 || table_width < 0 || num_threads < 1)
        return NLS_BAD_SHAPE;
    const int64_t max_context = table_width * block_size;
    if (workspace == NULL ||
        workspace_bytes < nls_paged_decode_attention_workspace_bytes(num_heads, num_kv_heads, max_context, num_threads))
        return NLS_BAD_SHAPE;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t ctx = context_lens[s];
        if (ctx < 1 || ctx > max_context) return NLS_BAD_POSITION;
        for (int64_t b = 0; b < (ctx + block_size - 1) / block_size; b++)
            if (block_tables[s * table_width + b] < 0 || block_tables[s * table_width + b] >= num_blocks)
                return NLS_BAD_BLOCK;
    }
    const int group = num_heads / num_kv_heads;
    uint8_t *base = (uint8_t *)(((uintptr_t)workspace + 63) / 64 * 64);
    const int64_t per_thread = scores_bytes(num_heads, num_kv_heads, max_context);
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = (float *)(base + (int64_t)omp_get_thread_num() * per_thread);
#pragma omp for schedule(dynamic, 4)
        for (int64_t item = 0; item < num_seqs * num_kv_heads; item++) {
            const int64_t s = item / num_kv_heads;
            const int g = (int)(item % num_kv_heads);
            const int64_t first = (s * num_heads + (int64_t)g * group) * head_dim;
            nls_attend_group(q + first, kv, num_kv_heads, g, group, head_dim, block_size, scale,
                             block_tables + s * table_width, context_lens[s], scores, out + first);
        }
    }
    return 0;
}

/* `paged_decode_attention` over one layer's K/V [blocks, block_size, kv_heads, head_dim] of
 * `kv_dtype` (NLS_KV_F32, NLS_KV_F16, or NLS_KV_INT8 with their float scales `k_scale` /
 * `v_scale` [blocks, block_size, kv_heads]); NLS_BAD_SHAPE for another type or int8 without
 * the scales. */
int nls_paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, const float *k_scale,
                               const float *v_scale, int32_t kv_dtype, int64_t num_seqs, int32_t num_heads,
                               int32_t num_kv_heads, int32_t head_dim, int32_t block_size, int64_t num_blocks,
                               float scale, const int64_t *block_tables, int64_t table_width,
                               const int64_t *context_lens, float *out, void *workspace, int64_t workspace_bytes,
                               int num_threads) {
    if (kv_dtype != NLS_KV_F32 && kv_dtype != NLS_KV_F16 && kv_dtype != NLS_KV_INT8) return NLS_BAD_SHAPE;
    if (kv_dtype == NLS_KV_INT8 && (k_scale == NULL || v_scale == NULL)) return NLS_BAD_SHAPE;
    const nls_kv_cache kv = {k_cache, v_cache, k_scale, v_scale, kv_dtype};
    return paged_decode_attention(q, &kv, num_seqs, num_heads, num_kv_heads, head_dim, block_size, num_blocks, scale,
                                  block_tables, table_width, context_lens, out, workspace, workspace_bytes, num_threads);
}
