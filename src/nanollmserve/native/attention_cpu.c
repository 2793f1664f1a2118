/* Attention over the paged KV cache on the CPU (K/V laid out [blocks, block_size, kv_heads,
 * head_dim], float32 or int8 codes with a float scale per token and KV head: `nls_kv_cache` in
 * native.h), read in place through block tables: one query KV head's group of query heads at a
 * time (`nls_attend_group`, also used by the decode step in gguf_cpu.c) and the decode tokens
 * of a batched step (`nls_paged_decode_attention`, `nls_paged_decode_attention_int8`). An int8
 * row is dequantized in registers (8 codes widened to floats, times the row's scale), never
 * copied out as floats. */

#include <string.h>

#include <omp.h>

#include "native.h"

/* The `group` query heads that share KV head `g` (grouped-query attention: their queries and
 * outputs are `group` consecutive heads of `hd` floats) over a sequence's first `ctx` keys,
 * read in place from the paged cache through the sequence's block table: softmax of the
 * scaled dot products, then the weighted sum of the values. Each key and value row is read
 * once for all the group's heads (up to 8 at a time); an int8 row's scale multiplies its
 * dot product (keys) or its softmax weight (values). `scores`: room for group * ctx floats. */
#define ATTEND_HEADS 8

/* `int8` is a constant at each call: the compiler makes one copy per cache type, without the
 * test in the loops. */
static inline __attribute__((always_inline)) void attend_group(const float *q, const nls_kv_cache *kv, int kvh,
                                                               int g, int group, int hd, int bs, float scale,
                                                               const int64_t *block_table, int64_t ctx,
                                                               float *scores, float *out, const int int8) {
    for (int j0 = 0; j0 < group; j0 += ATTEND_HEADS) {
        const int heads = group - j0 < ATTEND_HEADS ? group - j0 : ATTEND_HEADS;
        const float *qg = q + (int64_t)j0 * hd;
        float max_score[ATTEND_HEADS], sum[ATTEND_HEADS];
        for (int j = 0; j < heads; j++) max_score[j] = -INFINITY;
        for (int64_t t = 0; t < ctx; t++) {
            const int64_t row = (block_table[t / bs] * bs + t % bs) * kvh + g;
            for (int j = 0; j < heads; j++) {
                const float *qj = qg + (int64_t)j * hd;
                const float s = int8 ? dot_f32_i8(qj, (const int8_t *)kv->k + row * hd, hd) * (kv->k_scale[row] * scale)
                                     : dot_f32(qj, (const float *)kv->k + row * hd, hd) * scale;
                scores[j * ctx + t] = s;
                max_score[j] = s > max_score[j] ? s : max_score[j];
            }
        }
        for (int j = 0; j < heads; j++) {
            float *row = scores + j * ctx;
            __m256 sum8 = _mm256_setzero_ps();
            const __m256 mx = _mm256_set1_ps(max_score[j]);
            int64_t t = 0;
            for (; t + 8 <= ctx; t += 8) {
                __m256 e = exp256_ps(_mm256_sub_ps(_mm256_loadu_ps(row + t), mx));
                _mm256_storeu_ps(row + t, e);
                sum8 = _mm256_add_ps(sum8, e);
            }
            sum[j] = hsum_ps(sum8);
            for (; t < ctx; t++) {
                row[t] = expf(row[t] - max_score[j]);
                sum[j] += row[t];
            }
        }
        float acc[ATTEND_HEADS][MAX_HEAD_DIM];
        for (int j = 0; j < heads; j++) memset(acc[j], 0, sizeof(float) * (size_t)hd);
        for (int64_t t = 0; t < ctx; t++) {
            const int64_t row = (block_table[t / bs] * bs + t % bs) * kvh + g;
            const float row_scale = int8 ? kv->v_scale[row] : 1.0f;
            __m256 weight[ATTEND_HEADS];
            for (int j = 0; j < heads; j++) weight[j] = _mm256_set1_ps(scores[j * ctx + t] * row_scale);
            for (int i = 0; i < hd; i += 8) {
                const __m256 vi = int8 ? load_i8x8((const int8_t *)kv->v + row * hd + i)
                                       : _mm256_loadu_ps((const float *)kv->v + row * hd + i);
                for (int j = 0; j < heads; j++)
                    _mm256_storeu_ps(acc[j] + i, _mm256_fmadd_ps(weight[j], vi, _mm256_loadu_ps(acc[j] + i)));
            }
        }
        for (int j = 0; j < heads; j++) {
            const float inv = 1.0f / sum[j];
            float *o = out + (int64_t)(j0 + j) * hd;
            for (int i = 0; i < hd; i++) o[i] = acc[j][i] * inv;
        }
    }
}

void nls_attend_group(const float *q, const nls_kv_cache *kv, int kvh, int g, int group, int hd, int bs,
                      float scale, const int64_t *block_table, int64_t ctx, float *scores, float *out) {
    if (kv->dtype == NLS_KV_INT8)
        attend_group(q, kv, kvh, g, group, hd, bs, scale, block_table, ctx, scores, out, 1);
    else
        attend_group(q, kv, kvh, g, group, hd, bs, scale, block_table, ctx, scores, out, 0);
}

/* ------------------------------------- attention of a span of one sequence's tokens -- */

/* `n` consecutive tokens of one sequence at positions p0 .. p0 + n - 1 (a prefill chunk or a
 * speculative verify span) over KV head `g`: their `group` query heads each are a row, n *
 * group rows in all (query row i * group + j is token i's head j, at q + i * q_stride + j *
 * hd; its output at out + i * out_stride + j * hd), and row i sees keys < p0 + i + 1
 * (causal). The products run as small matrix products, which a per-token loop cannot: 8 keys
 * at a time are transposed (an int8 row dequantized) into `kt` [hd][8], and 8 rows at a time
 * take their 8 scores as one vector (8 accumulators, no horizontal sum per key); the values
 * are weighted for 6 rows at a time, 16 of their dimensions per pass, each value row read
 * once for 6 rows. `scores`: TILE_ROWS(group) * (p0 + n rounded up to 8) floats; `kt`: hd * 8
 * floats. */
static inline __attribute__((always_inline)) void attend_span(const float *q, int64_t q_stride, const nls_kv_cache *kv,
                                                              int kvh, int g, int group, int hd, int bs, float scale,
                                                              const int64_t *block_table, int64_t p0, int n,
                                                              float *scores, float *kt, float *out, int64_t out_stride,
                                                              const int int8) {
    const int rows = n * group, padded_rows = (rows + 7) / 8 * 8;
    const int64_t ctx = p0 + n, width = (ctx + 7) / 8 * 8;
    const float *qr[SPAN_TILE_ROWS_MAX];
    for (int r = 0; r < padded_rows; r++) {
        const int row = r < rows ? r : 0; /* padding rows repeat row 0; their scores are unused */
        qr[r] = q + (row / group) * q_stride + (int64_t)(row % group) * hd;
    }
    /* scores: 8 keys x 8 rows per pass */
    for (int64_t k0 = 0; k0 < ctx; k0 += 8) {
        const int keys = ctx - k0 < 8 ? (int)(ctx - k0) : 8;
        for (int c = 0; c < 8; c++) {
            if (c >= keys) {
                for (int d = 0; d < hd; d++) kt[d * 8 + c] = 0.0f;
                continue;
            }
            const int64_t t = k0 + c, row = (block_table[t / bs] * bs + t % bs) * kvh + g;
            if (int8) {
                const int8_t *k = (const int8_t *)kv->k + row * hd;
                const float ks = kv->k_scale[row] * scale;
                for (int d = 0; d < hd; d++) kt[d * 8 + c] = (float)k[d] * ks;
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
        float *row = scores + (int64_t)r * width;
        const int64_t own = p0 + r / group + 1;
        float mx = -INFINITY;
        for (int64_t t = 0; t < own; t++) mx = row[t] > mx ? row[t] : mx;
        const __m256 mx8 = _mm256_set1_ps(mx);
        __m256 sum8 = _mm256_setzero_ps();
        int64_t t = 0;
        for (; t + 8 <= own; t += 8) {
            const __m256 e = exp256_ps(_mm256_sub_ps(_mm256_loadu_ps(row + t), mx8));
            _mm256_storeu_ps(row + t, e);
            sum8 = _mm256_add_ps(sum8, e);
        }
        float sum = hsum_ps(sum8);
        for (; t < own; t++) {
            row[t] = expf(row[t] - mx);
            sum += row[t];
        }
        for (; t < width; t++) row[t] = 0.0f;
        inv_sum[r] = 1.0f / sum;
        if (int8)
            for (int64_t u = 0; u < own; u++)
                row[u] *= kv->v_scale[(block_table[u / bs] * bs + u % bs) * kvh + g];
    }
    /* the weighted values: 6 rows x 16 dimensions per pass */
    for (int r0 = 0; r0 < rows; r0 += 6) {
        const int rr = rows - r0 < 6 ? rows - r0 : 6;
        const int64_t last = p0 + (r0 + rr - 1) / group + 1; /* the keys the pass's last row sees */
        for (int d0 = 0; d0 < hd; d0 += 16) {
            __m256 acc[6][2];
            for (int x = 0; x < 6; x++) acc[x][0] = acc[x][1] = _mm256_setzero_ps();
            for (int64_t t = 0; t < last; t++) {
                const int64_t row = (block_table[t / bs] * bs + t % bs) * kvh + g;
                __m256 v0, v1;
                if (int8) {
                    const int8_t *v = (const int8_t *)kv->v + row * hd + d0;
                    v0 = load_i8x8(v);
                    v1 = hd - d0 >= 16 ? load_i8x8(v + 8) : _mm256_setzero_ps();
                } else {
                    const float *v = (const float *)kv->v + row * hd + d0;
                    v0 = _mm256_loadu_ps(v);
                    v1 = hd - d0 >= 16 ? _mm256_loadu_ps(v + 8) : _mm256_setzero_ps();
                }
                for (int x = 0; x < 6; x++) {
                    if (x >= rr) break;
                    const __m256 w = _mm256_broadcast_ss(scores + (int64_t)(r0 + x) * width + t);
                    acc[x][0] = _mm256_fmadd_ps(w, v0, acc[x][0]);
                    acc[x][1] = _mm256_fmadd_ps(w, v1, acc[x][1]);
                }
            }
            for (int x = 0; x < rr; x++) {
                const int r = r0 + x;
                float *o = out + (r / group) * out_stride + (int64_t)(r % group) * hd + d0;
                const __m256 inv = _mm256_set1_ps(inv_sum[r]);
                _mm256_storeu_ps(o, _mm256_mul_ps(acc[x][0], inv));
                if (hd - d0 >= 16) _mm256_storeu_ps(o + 8, _mm256_mul_ps(acc[x][1], inv));
            }
        }
    }
}

void nls_attend_span(const float *q, int64_t q_stride, const nls_kv_cache *kv, int kvh, int g, int group, int hd,
                     int bs, float scale, const int64_t *block_table, int64_t p0, int n, float *scores, float *kt,
                     float *out, int64_t out_stride) {
    if (kv->dtype == NLS_KV_INT8)
        attend_span(q, q_stride, kv, kvh, g, group, hd, bs, scale, block_table, p0, n, scores, kt, out, out_stride, 1);
    else
        attend_span(q, q_stride, kv, kvh, g, group, hd, bs, scale, block_table, p0, n, scores, kt, out, out_stride, 0);
}

/* ------------------------------------------------ public: attention of decode tokens -- */

/* One thread's attention scores: a KV head's group of query heads over up to `max_context`
 * keys, rounded to whole cache lines so no two threads write the same line. */
static inline int64_t scores_bytes(int32_t num_heads, int32_t num_kv_heads, int64_t max_context) {
    return ((int64_t)(num_heads / num_kv_heads) * max_context * (int64_t)sizeof(float) + 63) / 64 * 64;
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

/* `paged_decode_attention` over float32 K/V [blocks, block_size, kv_heads, head_dim]. */
int nls_paged_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                               int64_t num_seqs, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,
                               int32_t block_size, int64_t num_blocks, float scale, const int64_t *block_tables,
                               int64_t table_width, const int64_t *context_lens, float *out,
                               void *workspace, int64_t workspace_bytes, int num_threads) {
    const nls_kv_cache kv = {k_cache, v_cache, NULL, NULL, NLS_KV_F32};
    return paged_decode_attention(q, &kv, num_seqs, num_heads, num_kv_heads, head_dim, block_size, num_blocks, scale,
                                  block_tables, table_width, context_lens, out, workspace, workspace_bytes, num_threads);
}

/* `paged_decode_attention` over int8 K/V codes [blocks, block_size, kv_heads, head_dim] and
 * their float scales [blocks, block_size, kv_heads]; NLS_BAD_SHAPE without the scales. */
int nls_paged_decode_attention_int8(const float *q, const int8_t *k_cache, const int8_t *v_cache,
                                    const float *k_scale, const float *v_scale, int64_t num_seqs, int32_t num_heads,
                                    int32_t num_kv_heads, int32_t head_dim, int32_t block_size, int64_t num_blocks,
                                    float scale, const int64_t *block_tables, int64_t table_width,
                                    const int64_t *context_lens, float *out, void *workspace, int64_t workspace_bytes,
                                    int num_threads) {
    if (k_scale == NULL || v_scale == NULL) return NLS_BAD_SHAPE;
    const nls_kv_cache kv = {k_cache, v_cache, k_scale, v_scale, NLS_KV_INT8};
    return paged_decode_attention(q, &kv, num_seqs, num_heads, num_kv_heads, head_dim, block_size, num_blocks, scale,
                                  block_tables, table_width, context_lens, out, workspace, workspace_bytes, num_threads);
}
