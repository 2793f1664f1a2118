/* Shared by the native CPU sources (built by nanollmserve/native/build.py): the status codes
 * of the entry points, small AVX2 vector helpers, the paged K/V cache as attention reads it
 * (float32, float16, or int8 codes with a float scale per token and KV head:
 * `--kv-cache-dtype`),
 * and the attention of one query head over a sequence's paged K/V (attention_cpu.c), which the
 * decode step calls too. */
#ifndef NLS_NATIVE_H
#define NLS_NATIVE_H

#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#define QK 32
#define KIND_Q4 4
#define KIND_Q8 8
/* Weights in kquant_cpu.c's layout (the K-quants, Q5_0/Q5_1, and legacy blocks fused with
 * them), one kind per code width and layout: KIND_KQ4 + (bits - 4) + 8 * layout for 4..8-bit
 * codes, the layout an or of the flags below (kquant_cpu.c's header comment). */
#define KIND_KQ4 44
#define KIND_KQ8 48
#define KQ_SUPER 1  /* d, dm once per 8 tile-blocks (256 inputs), else per tile-block */
#define KQ_TWO_SC 2 /* a sub-scale per 16 inputs, else one per 32 */
#define KQ_MIN 4    /* dm and mn stored, else none (zeros) */
#define KQ_LAYOUTS 8
#define TILE 16 /* outputs per tile of the block kernels' weight layout (gguf_cpu.c) */

static inline int64_t tile_block_bytes(int kind) { return kind == KIND_Q4 ? 320 : 544; }
/* The code width of a K-quant kind, or 0 for any other kind. */
static inline int kq_kind_bits(int kind) {
    const int k = kind - KIND_KQ4;
    return k >= 0 && k < 8 * KQ_LAYOUTS && k % 8 <= KIND_KQ8 - KIND_KQ4 ? k % 8 + 4 : 0;
}
/* The layout flags of a K-quant kind. */
static inline int kq_kind_layout(int kind) { return (kind - KIND_KQ4) / 8; }
int64_t nls_kq_tile_block_bytes(int kind);
/* y[r * out + o] = (W x_r)[o] for `rows` activation rows quantized as the decode step does
 * (row r at xq + r * in), W in kquant_cpu.c's layout of K-quant `kind`: the tiles shared
 * among the threads of the enclosing parallel region (an orphaned loop ending in a barrier).
 * `int16`: keep the int16 activations whatever the kind (the output projection, decision 48).
 * `acc`: this thread's room for 16 floats a row. */
void nls_kq_matmul_shared(int kind, const uint8_t *w, int64_t out, int64_t in, const int16_t *xq,
                          const float *dx, const float *sx, int64_t rows, int int16, float *acc, float *y);
/* The same for gguf_cpu.c's Q8 blocks (KIND_Q8) with int8 activations per block of 32
 * (kquant_int8_cpu.c, decision 48). Returns 0 (false), every thread alike, where its buffer
 * cannot be had; the caller then runs its int16 kernel. */
int nls_q8i8_matmul_shared(const uint8_t *w, int64_t out, int64_t in, const int16_t *xq, const float *dx,
                           int64_t rows, float *acc, float *y);
/* gguf_cpu.c's vector kernels for KIND_Q4 / KIND_Q8 tiles against int16 rows (dx, and sx for
 * KIND_Q4), shared among the threads of the enclosing parallel region; `acc`: 32 floats a row. */
void nls_block_tiles_shared(int kind, const uint8_t *w, int64_t out, int64_t in, const int16_t *xq,
                            const float *dx, const float *sx, int64_t rows, float *acc, float *y);
/* out[in] = row `row` of W (kquant_cpu.c's layout of K-quant `kind`) dequantized,
 * d * sc * (q - off) + dm * mn per weight: the decode step's embedding lookup in such a table. */
void nls_kq_dequant_row(int kind, const uint8_t *w, int64_t in, int64_t row, float *out);

/* 0 when this process may use AMX tiles: Linux grants the tile state per process, and the
 * `amx` build asks for it (amx_cpu.c); other builds have nothing to ask and answer 0. */
int nls_amx_init(void);

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#define NLS_HAS_AMX 1
#define AMX_MIN_ROWS 8 /* fewer rows run the vector kernel (measured crossover) */
/* In nls_decode_step, whose vector products run row groups from registers, AMX pays from 32
 * rows (a step's products, ms at 16/32 rows: vector 13.7-14.5/23.7-24.2, AMX 14.3-14.9/
 * 22.2-22.4; scripts/profile_breakdown.py, stop 34). */
#define AMX_STEP_MIN_ROWS 32
int64_t nls_amx_workspace_bytes(int64_t in, int64_t rows, int num_threads);
void nls_amx_matmul_shared(int kind, const uint8_t *w, int64_t out, int64_t in, const int16_t *xq,
                           const float *dx, const float *sx, int64_t rows, const float *bias, float *y,
                           uint8_t *work);
#else
#define NLS_HAS_AMX 0
#endif

/* Statuses of the entry points besides 0: -1 is out of memory; the others are inputs that
 * would index outside their buffers, refused before anything is read or written (raised as
 * ValueError by the Python callers). The same numbers in sampling_cpu.c. */
#define NLS_NO_MEMORY -1
#define NLS_BAD_POSITION -2
#define NLS_BAD_TOKEN -3
#define NLS_BAD_BLOCK -4
#define NLS_BAD_SHAPE -5
#define MAX_HEAD_DIM 256

/* The KV cache's element types (`kv_dtype`). An int8 row (one token's K or V of one KV head)
 * is `head_dim` codes and one float scale: x ~= scale * code. A float16 row is IEEE halves
 * (F16C converts them: every AVX2 CPU has it), written rounded to nearest even like PyTorch's
 * cast. */
#define NLS_KV_F32 0
#define NLS_KV_INT8 1
#define NLS_KV_F16 2

/* The gated MLP's activations (`nls_model.activation`): SiLU (SwiGLU) and the tanh
 * approximation of GELU (GeGLU, Gemma's `gelu_pytorch_tanh`). */
#define NLS_ACT_SILU 0
#define NLS_ACT_GELU_TANH 1

static inline int64_t kv_element_bytes(int dtype) { return dtype == NLS_KV_F32 ? 4 : dtype == NLS_KV_F16 ? 2 : 1; }

/* ------------------------------------------------------- the decode step's model -- */

/* One decoder layer and the whole model as `nls_decode_step` (gguf_cpu.c) reads them. Python
 * fills them through ctypes mirrors (`NlsLayer`, `NlsModel` in native/abi.py) and checks the
 * library's sizes and offsets at load (`nls_abi_info`); the layout is also asserted here at
 * compile time, so a field moved on this side alone fails the build, not a decode. */
typedef struct {
    int32_t qkv_kind, o_kind, gate_up_kind, down_kind; /* KIND_Q4 or KIND_Q8 */
    const uint8_t *qkv, *o, *gate_up, *down;          /* rows of those kinds */
    const float *qkv_bias, *o_bias;                    /* or NULL */
    const float *gate_up_bias, *down_bias;             /* or NULL (`mlp_bias`) */
    const float *input_norm, *post_norm;               /* [hidden] */
    const float *q_norm, *k_norm;                      /* [head_dim] (Qwen3) or NULL */
    void *k_cache, *v_cache;                           /* [blocks, block_size, kv_heads, head_dim] of kv_dtype */
    float *k_scale, *v_scale;                          /* int8: [blocks, block_size, kv_heads]; else NULL */
    /* Gemma's sandwich norms: the attention output and the MLP output each normalized before
     * its residual add ([hidden]), or NULL (then `post_norm` is the norm before the MLP either way) */
    const float *attn_out_norm, *mlp_out_norm;
    const float *rope; /* this layer's own cos/sin table (a sliding layer's base), or NULL: the model's */
    int32_t window;    /* 0: full attention; else a query at p sees the keys p - window + 1 .. p */
    int32_t reserved;  /* 0 (padding) */
} nls_layer;

typedef struct {
    int32_t hidden, intermediate, num_heads, num_kv_heads, head_dim, num_layers, vocab, block_size;
    int32_t lm_head_kind; /* KIND_Q4 / KIND_Q8, or 0: write the final normed hidden state */
    int32_t max_context;
    int32_t num_blocks;   /* blocks in each layer's K/V cache: the block ids in range */
    int32_t kv_dtype;     /* NLS_KV_F32, NLS_KV_F16 or NLS_KV_INT8 (native.h) */
    int32_t embed_kind;   /* 0: `embed` is float32 [vocab, hidden]; else the kind of the tiled blocks it is
                           * (KIND_Q4, KIND_Q8 or a K-quant kind, the layout of a linear weight of that
                           * kind: the lm_head's own when tied), each looked-up row dequantized */
    int32_t activation;   /* the gated MLP's: NLS_ACT_SILU or NLS_ACT_GELU_TANH */
    float eps, attn_scale;
    float embed_scale;    /* the looked-up embeddings are multiplied by it (Gemma: sqrt(hidden)); 1: none */
    float logit_softcap;  /* 0: none; else the lm_head's logits become cap * tanh(logits / cap) */
    const void *embed;       /* the input embedding table, as `embed_kind` says */
    const float *final_norm; /* [hidden] */
    const float *rope;       /* [positions, head_dim]: cos of the half-dim frequencies, then sin */
    const uint8_t *lm_head;  /* [vocab] rows of lm_head_kind */
    const nls_layer *layers;
} nls_model;

#define NLS_ASSERT_OFFSET(type, field, offset) \
    _Static_assert(offsetof(type, field) == (offset), #type "." #field ": update native/abi.py")
#define NLS_PTR ((int64_t)sizeof(void *))
_Static_assert(sizeof(void *) == 8 && sizeof(float) == 4, "the ctypes mirrors assume LP64");
NLS_ASSERT_OFFSET(nls_layer, qkv_kind, 0);
NLS_ASSERT_OFFSET(nls_layer, down_kind, 12);
NLS_ASSERT_OFFSET(nls_layer, qkv, 16);
NLS_ASSERT_OFFSET(nls_layer, qkv_bias, 16 + 4 * NLS_PTR);
NLS_ASSERT_OFFSET(nls_layer, gate_up_bias, 16 + 6 * NLS_PTR);
NLS_ASSERT_OFFSET(nls_layer, input_norm, 16 + 8 * NLS_PTR);
NLS_ASSERT_OFFSET(nls_layer, q_norm, 16 + 10 * NLS_PTR);
NLS_ASSERT_OFFSET(nls_layer, k_cache, 16 + 12 * NLS_PTR);
NLS_ASSERT_OFFSET(nls_layer, v_scale, 16 + 15 * NLS_PTR);
NLS_ASSERT_OFFSET(nls_layer, attn_out_norm, 16 + 16 * NLS_PTR);
NLS_ASSERT_OFFSET(nls_layer, rope, 16 + 18 * NLS_PTR);
NLS_ASSERT_OFFSET(nls_layer, window, 16 + 19 * NLS_PTR);
_Static_assert(sizeof(nls_layer) == 24 + 19 * NLS_PTR, "nls_layer: update native/abi.py");
NLS_ASSERT_OFFSET(nls_model, hidden, 0);
NLS_ASSERT_OFFSET(nls_model, embed_kind, 12 * 4);
NLS_ASSERT_OFFSET(nls_model, activation, 13 * 4);
NLS_ASSERT_OFFSET(nls_model, eps, 14 * 4);
NLS_ASSERT_OFFSET(nls_model, attn_scale, 15 * 4);
NLS_ASSERT_OFFSET(nls_model, embed_scale, 16 * 4);
NLS_ASSERT_OFFSET(nls_model, logit_softcap, 17 * 4);
NLS_ASSERT_OFFSET(nls_model, embed, 72);
NLS_ASSERT_OFFSET(nls_model, layers, 72 + 4 * NLS_PTR);
_Static_assert(sizeof(nls_model) == 72 + 5 * NLS_PTR, "nls_model: update native/abi.py");
/* a tile-block: 16 outputs' codes for 32 inputs, then their d (and, Q4, m) as halves */
_Static_assert(TILE * QK / 2 + 2 * TILE * 2 == 320 && TILE * QK + TILE * 2 == 544, "tile-block bytes");

/* ---------------------------------------------------------------- small vector helpers -- */

static inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_hadd_epi32(s, s);
    s = _mm_hadd_epi32(s, s);
    return _mm_cvtsi128_si32(s);
}

/* exp(x) for 8 floats: x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-6 polynomial (relative
 * error ~2e-7, like Cephes' expf), 2^n through the exponent bits. */
static inline __m256 exp256_ps(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float dot_f32(const float *a, const float *b, int n) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum_ps(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* 8 int8 codes -> 8 floats (the caller applies the row's scale). */
static inline __m256 load_i8x8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* 8 halves -> 8 floats. */
static inline __m256 load_f16x8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* sum a[i] * b[i] over float a and int8 codes b, n a multiple of 8. */
static inline float dot_f32_i8(const float *a, const int8_t *b, int n) {
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load_i8x8(b + i), acc);
    return hsum_ps(acc);
}

/* One layer's paged K/V: `k` and `v` [blocks, block_size, kv_heads, head_dim] of `dtype`
 * (NLS_KV_F32: float; NLS_KV_F16: IEEE halves; NLS_KV_INT8: int8 codes, and `k_scale` /
 * `v_scale` [blocks, block_size, kv_heads] their float scales; NULL for the float types). */
typedef struct {
    const void *k, *v;
    const float *k_scale, *v_scale;
    int dtype;
} nls_kv_cache;


/* Attention of decode tokens and short spans (attention_cpu.c) splits each query row's keys
 * into chunks of attend_chunk_keys(ctx) keys at fixed positions (64, or more so that there are
 * at most ATTEND_MAX_CHUNKS): in the decode step each chunk, for every KV head, is a work item
 * of its own, so even one sequence keeps two threads busy, and the chunks' partial softmaxes
 * merge after. The chunks depend only on the row's own context length, never on the batch: a
 * request's numbers do not change with what runs beside it. */
#define ATTEND_ROWS 6 /* query rows that share one read of a key and value row */
#define ATTEND_CHUNK_KEYS 64
#define ATTEND_MAX_CHUNKS 16
static inline int64_t attend_chunk_keys(int64_t ctx) {
    const int64_t per = (ctx + ATTEND_MAX_CHUNKS - 1) / ATTEND_MAX_CHUNKS;
    const int64_t keys = (per + ATTEND_CHUNK_KEYS - 1) / ATTEND_CHUNK_KEYS * ATTEND_CHUNK_KEYS;
    return keys > ATTEND_CHUNK_KEYS ? keys : ATTEND_CHUNK_KEYS;
}
static inline int64_t attend_chunks(int64_t ctx) {
    const int64_t keys = attend_chunk_keys(ctx);
    return (ctx + keys - 1) / keys;
}
/* The floats `nls_attend_group` needs for contexts up to `max_context`: one chunk's scores for
 * ATTEND_ROWS rows and every chunk's partials for `group` rows. */
static inline int64_t attend_scratch_floats(int64_t max_context, int group) {
    return ATTEND_ROWS * attend_chunk_keys(max_context) + (int64_t)group * (MAX_HEAD_DIM + 2) * ATTEND_MAX_CHUNKS;
}

/* `window`: 0, or each row sees only its last `window` keys (a sliding layer). */
void nls_attend_chunk(const float *q, int64_t q_stride, const nls_kv_cache *kv, int kvh, int g, int group, int hd,
                      int bs, float scale, const int64_t *block_table, int64_t p0, int n, int64_t k0, int64_t k1,
                      int64_t window, float *scores, float *part);
void nls_merge_chunks(const float *part, int64_t part_stride, int chunks, int hd, float *out);
void nls_attend_group(const float *q, const nls_kv_cache *kv, int kvh, int g, int group, int hd, int bs,
                      float scale, const int64_t *block_table, int64_t ctx, float *scratch, float *out);

/* A span of one sequence's consecutive tokens attends as a tile of up to SPAN_TILE_ROWS_MAX
 * query rows (tokens x the KV head's query heads): `span_tile_tokens(group)` tokens at a time,
 * when the run has at least SPAN_TILE_MIN_RUN tokens. Shorter runs (a verify span) attend as
 * query rows over chunks (`nls_attend_chunk`, the decode tokens' kernel, each key read once for
 * 6 rows): with few tiles, two threads share 3 KV heads' items unevenly, and the transposed
 * keys cost more than they save. Measured (the bundled model, 2 threads, median of 20 calls):
 * a 5-token verify span at position 450 14.5 ms token by token vs 17.5 ms as one tile; a
 * 256-token prefill chunk at 384 400 vs 325 ms, at 0 232 vs 215 ms. */
#define SPAN_TILE_ROWS_MAX 32
#define SPAN_TILE_MIN_RUN 16
static inline int span_tile_tokens(int group) {
    const int tokens = group <= SPAN_TILE_ROWS_MAX ? SPAN_TILE_ROWS_MAX / group : 1;
    return tokens < 8 ? tokens : 8;
}

/* The floats of `nls_attend_span`'s scores for positions up to `max_context`, and of its
 * transposed keys. */
static inline int64_t span_scores_floats(int64_t max_context) { return SPAN_TILE_ROWS_MAX * (max_context + 8); }

void nls_attend_span(const float *q, int64_t q_stride, const nls_kv_cache *kv, int kvh, int g, int group, int hd,
                     int bs, float scale, const int64_t *block_table, int64_t p0, int n, int64_t window,
                     float *scores, float *kt, float *out, int64_t out_stride);

#endif
