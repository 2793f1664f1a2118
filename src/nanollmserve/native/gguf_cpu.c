/* CPU kernels for GGUF block weights (x86-64 with AVX2, FMA and F16C), built and loaded by
 * nanollmserve/native/build.py. Two things live here:
 *
 * 1. Matrix products with weights kept in the GGUF file's own blocks of 32 (Q4_0, Q4_1, Q8_0),
 *    `y[M, out] = x[M, in] @ W^T`. Each activation row is quantized per block of 32 to int16
 *    with one float scale (and its exact float sum, for Q4_1's `m` term), so a block's dot
 *    product is two `madd`s of 16-bit integers; eight blocks are reduced together and scaled
 *    by their eight `d` constants in one multiply-add. (llama.cpp quantizes activations to
 *    int8, one `maddubs` a block: ~25% faster here, but on the bundled model it moved the
 *    next-token distribution 45x further from float32: KL 0.046 against 0.0010.)
 *
 * 2. `nls_decode_step`: the whole forward pass of a Llama-family decoder for one token of one
 *    sequence (a single-stream decode step), from token id to logits, in one call and one
 *    OpenMP parallel region: RMSNorm, fused q/k/v, rotary embedding, the K/V write into the
 *    paged cache, attention over the sequence's blocks, the output projection, the gated MLP,
 *    the final norm and the output projection to the vocabulary. PyTorch runs the same step as
 *    ~1000 operator calls, whose dispatch alone costs more than the arithmetic at one token.
 *
 * Weight rows, as repacked once by model/gguf_blocks.py (byte sizes for `nb = in / 32` blocks):
 *   Q4 (kind 4): codes[nb * 16] | d f16[nb] | m f16[nb]   w = d * q + m, q in 0..15; a code
 *                byte holds input j of its block in the low nibble, j + 16 in the high one
 *                (Q4_0 is stored with m = -8 d).
 *   Q8 (kind 8): codes int8[nb * 32] | d f16[nb]           w = d * q
 */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32
#define KIND_Q4 4
#define KIND_Q8 8

/* Statuses of the entry points besides 0: -1 is out of memory; the others are inputs that
 * would index outside their buffers, refused before anything is read or written (raised as
 * ValueError by the Python callers). The same numbers in sampling_cpu.c. */
#define NLS_NO_MEMORY -1
#define NLS_BAD_POSITION -2
#define NLS_BAD_TOKEN -3
#define NLS_BAD_BLOCK -4
#define NLS_BAD_SHAPE -5
#define MAX_HEAD_DIM 256

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

/* ------------------------------------------------------------ activation quantization -- */

/* One row of `n` floats (n % 32 == 0) -> int16 codes, a scale and the exact float sum per
 * block: x ~= dx * qx, rounded to nearest. */
static void quantize_row(const float *x, int64_t n, int16_t *qx, float *dx, float *sx) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < n / QK; b++) {
        const float *xb = x + b * QK;
        __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
        __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
        __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                    _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float max_abs = _mm_cvtss_f32(m4);
        const float d = max_abs / 32767.0f;
        const __m256 id = _mm256_set1_ps(max_abs > 0.0f ? 32767.0f / max_abs : 0.0f);
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, id));
        __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, id));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, id));
        __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, id));
        /* packs work within 128-bit lanes: undo the interleave with one permute each */
        __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8);
        __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(i2, i3), 0xD8);
        _mm256_storeu_si256((__m256i *)(qx + b * QK), lo);
        _mm256_storeu_si256((__m256i *)(qx + b * QK + 16), hi);
        dx[b] = d;
        sx[b] = hsum_ps(_mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3)));
    }
}

/* ------------------------------------------------------------------------ row products -- */

/* A block's 32 products summed in 8 int32 lanes (|sum| < 2^31: 4 products of at most
 * 127 * 32767 per lane). */
static inline __m256i q4_block_dot(const uint8_t *codes, const int16_t *xq) {
    const __m128i low = _mm_set1_epi8(0x0F);
    __m128i q = _mm_loadu_si128((const __m128i *)codes);
    __m256i w0 = _mm256_cvtepu8_epi16(_mm_and_si128(q, low));                    /* inputs 0..15 */
    __m256i w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(q, 4), low)); /* 16..31 */
    return _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)xq)),
                            _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(xq + 16))));
}

static inline __m256i q8_block_dot(const int8_t *codes, const int16_t *xq) {
    __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)codes));
    __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(codes + 16)));
    return _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)xq)),
                            _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(xq + 16))));
}

/* Eight blocks' int32 partial sums (8 lanes each) -> one vector of their eight totals. */
static inline __m256 reduce8(__m256i p0, __m256i p1, __m256i p2, __m256i p3,
                             __m256i p4, __m256i p5, __m256i p6, __m256i p7) {
    __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(p0, p1), _mm256_hadd_epi32(p2, p3));
    __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(p4, p5), _mm256_hadd_epi32(p6, p7));
    __m256i s = _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20),
                                 _mm256_permute2x128_si256(h0, h1, 0x31));
    return _mm256_cvtepi32_ps(s);
}

static float q4_row_dot(const uint8_t *row, int64_t nb, const int16_t *xq, const float *dx, const float *sx) {
    const uint16_t *d = (const uint16_t *)(row + nb * 16), *m = d + nb;
    __m256 acc = _mm256_setzero_ps(), macc = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
        const uint8_t *c = row + b * 16;
        const int16_t *x = xq + b * QK;
        __m256 s = reduce8(q4_block_dot(c, x), q4_block_dot(c + 16, x + 32),
                           q4_block_dot(c + 32, x + 64), q4_block_dot(c + 48, x + 96),
                           q4_block_dot(c + 64, x + 128), q4_block_dot(c + 80, x + 160),
                           q4_block_dot(c + 96, x + 192), q4_block_dot(c + 112, x + 224));
        __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + b)));
        __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + b)));
        acc = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_loadu_ps(dx + b)), s, acc);
        macc = _mm256_fmadd_ps(mw, _mm256_loadu_ps(sx + b), macc);
    }
    float tail = 0.0f;
    for (; b < nb; b++) {
        int32_t s = hsum_epi32(q4_block_dot(row + b * 16, xq + b * QK));
        tail += _cvtsh_ss(d[b]) * dx[b] * (float)s + _cvtsh_ss(m[b]) * sx[b];
    }
    return hsum_ps(_mm256_add_ps(acc, macc)) + tail;
}

static float q8_row_dot(const uint8_t *row, int64_t nb, const int16_t *xq, const float *dx) {
    const int8_t *c = (const int8_t *)row;
    const uint16_t *d = (const uint16_t *)(row + nb * QK);
    __m256 acc = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
        const int8_t *w = c + b * QK;
        const int16_t *x = xq + b * QK;
        __m256 s = reduce8(q8_block_dot(w, x), q8_block_dot(w + 32, x + 32),
                           q8_block_dot(w + 64, x + 64), q8_block_dot(w + 96, x + 96),
                           q8_block_dot(w + 128, x + 128), q8_block_dot(w + 160, x + 160),
                           q8_block_dot(w + 192, x + 192), q8_block_dot(w + 224, x + 224));
        __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + b)));
        acc = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_loadu_ps(dx + b)), s, acc);
    }
    float tail = 0.0f;
    for (; b < nb; b++) tail += _cvtsh_ss(d[b]) * dx[b] * (float)hsum_epi32(q8_block_dot(c + b * QK, xq + b * QK));
    return hsum_ps(acc) + tail;
}

static inline int64_t row_bytes(int kind, int64_t in) {
    return kind == KIND_Q4 ? in / QK * 20 : in / QK * 34;
}

/* Rows [0, out) of y = W x for one quantized activation row, shared among the threads of the
 * enclosing parallel region (an orphaned work-sharing loop; it ends in a barrier). */
static void matvec_shared(int kind, const uint8_t *w, int64_t out, int64_t in,
                          const int16_t *xq, const float *dx, const float *sx, float *y) {
    const int64_t nb = in / QK, stride = row_bytes(kind, in);
#pragma omp for schedule(static)
    for (int64_t o = 0; o < out; o++)
        y[o] = kind == KIND_Q4 ? q4_row_dot(w + o * stride, nb, xq, dx, sx)
                               : q8_row_dot(w + o * stride, nb, xq, dx);
}

/* ------------------------------------------------------------- public: matrix product -- */

/* Several input rows against one weight row: each group of 8 blocks is decoded to int16 once
 * (into `wbuf`, zero past the row's last block) and multiplied with every input row, so the
 * unpacking is shared; per input row the group is reduced and scaled as in q4_row_dot.
 * `acc`: room for 16 floats per input row. The activation arrays must be readable 8 blocks
 * past the last row (the caller pads them; padded scales are 0). */
static void row_times_inputs(int kind, const uint8_t *row, int64_t nb, int64_t in, const int16_t *xq,
                             const float *dx, const float *sx, int64_t rows, float *acc, float *out) {
    const int code_bytes = kind == KIND_Q4 ? 16 : QK;
    const uint16_t *d = (const uint16_t *)(row + nb * code_bytes), *m = d + nb;
    int16_t wbuf[8 * QK] __attribute__((aligned(32)));
    const __m128i low = _mm_set1_epi8(0x0F);
    memset(acc, 0, sizeof(float) * 16 * (size_t)rows);
    for (int64_t b = 0; b < nb; b += 8) {
        const int count = nb - b < 8 ? (int)(nb - b) : 8;
        for (int j = 0; j < 8; j++) {
            __m256i w0 = _mm256_setzero_si256(), w1 = _mm256_setzero_si256();
            if (j < count && kind == KIND_Q4) {
                __m128i q = _mm_loadu_si128((const __m128i *)(row + (b + j) * 16));
                w0 = _mm256_cvtepu8_epi16(_mm_and_si128(q, low));
                w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(q, 4), low));
            } else if (j < count) {
                const int8_t *c = (const int8_t *)row + (b + j) * QK;
                w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)c));
                w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(c + 16)));
            }
            _mm256_store_si256((__m256i *)(wbuf + j * QK), w0);
            _mm256_store_si256((__m256i *)(wbuf + j * QK + 16), w1);
        }
        uint16_t dp[8] = {0}, mp[8] = {0};
        memcpy(dp, d + b, 2 * (size_t)count);
        if (kind == KIND_Q4) memcpy(mp, m + b, 2 * (size_t)count);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)dp));
        const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)mp));
        for (int64_t r = 0; r < rows; r++) {
            const int16_t *x = xq + r * in + b * QK;
            __m256i p[8];
            for (int j = 0; j < 8; j++)
                p[j] = _mm256_add_epi32(
                    _mm256_madd_epi16(_mm256_load_si256((const __m256i *)(wbuf + j * QK)),
                                      _mm256_loadu_si256((const __m256i *)(x + j * QK))),
                    _mm256_madd_epi16(_mm256_load_si256((const __m256i *)(wbuf + j * QK + 16)),
                                      _mm256_loadu_si256((const __m256i *)(x + j * QK + 16))));
            const __m256 s = reduce8(p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]);
            float *a = acc + 16 * r;
            const __m256 scale = _mm256_mul_ps(dw, _mm256_loadu_ps(dx + r * nb + b));
            _mm256_storeu_ps(a, _mm256_fmadd_ps(scale, s, _mm256_loadu_ps(a)));
            if (kind == KIND_Q4)
                _mm256_storeu_ps(a + 8, _mm256_fmadd_ps(mw, _mm256_loadu_ps(sx + r * nb + b), _mm256_loadu_ps(a + 8)));
        }
    }
    for (int64_t r = 0; r < rows; r++)
        out[r] = hsum_ps(_mm256_add_ps(_mm256_loadu_ps(acc + 16 * r), _mm256_loadu_ps(acc + 16 * r + 8)));
}

/* y[M, out] = x[M, in] @ W^T (+ bias when not NULL) with W in `kind` rows. Returns 0,
 * NLS_BAD_SHAPE when `in` is not a positive multiple of 32, a size is negative or `kind`
 * unknown, or NLS_NO_MEMORY. */
int nls_gguf_matmul(int kind, const uint8_t *w, int64_t out, int64_t in, const float *x, int64_t rows,
                    const float *bias, float *y, int num_threads) {
    if (in <= 0 || in % QK || out < 0 || rows < 0 || (kind != KIND_Q4 && kind != KIND_Q8))
        return NLS_BAD_SHAPE;
    const int64_t nb = in / QK, stride = row_bytes(kind, in);
    /* padded by 8 blocks: the multi-row kernel reads a whole group past the last block */
    int16_t *xq = calloc((size_t)(rows * in + 8 * QK), sizeof(int16_t));
    float *dx = calloc((size_t)(rows * nb + 8), sizeof(float)), *sx = calloc((size_t)(rows * nb + 8), sizeof(float));
    if (!xq || !dx || !sx) {
        free(xq), free(dx), free(sx);
        return NLS_NO_MEMORY;
    }
    for (int64_t r = 0; r < rows; r++) quantize_row(x + r * in, in, xq + r * in, dx + r * nb, sx + r * nb);
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *acc = rows > 1 ? malloc(sizeof(float) * 16 * (size_t)rows) : NULL;
        float *dots = rows > 1 ? malloc(sizeof(float) * (size_t)rows) : NULL;
        if (rows > 1 && (!acc || !dots)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t o = 0; o < out; o++) {
            const uint8_t *wr = w + o * stride;
            const float b = bias ? bias[o] : 0.0f;
            if (rows == 1) {
                y[o] = b + (kind == KIND_Q4 ? q4_row_dot(wr, nb, xq, dx, sx) : q8_row_dot(wr, nb, xq, dx));
            } else if (acc && dots) {
                row_times_inputs(kind, wr, nb, in, xq, dx, sx, rows, acc, dots);
                for (int64_t r = 0; r < rows; r++) y[r * out + o] = b + dots[r];
            }
        }
        free(acc), free(dots);
    }
    free(xq), free(dx), free(sx);
    return failed ? NLS_NO_MEMORY : 0;
}

/* ---------------------------------------------------------- public: one decode step -- */

typedef struct {
    int32_t qkv_kind, o_kind, gate_up_kind, down_kind; /* KIND_Q4 or KIND_Q8 */
    const uint8_t *qkv, *o, *gate_up, *down;          /* rows of those kinds */
    const float *qkv_bias, *o_bias;                    /* or NULL */
    const float *input_norm, *post_norm;               /* [hidden] */
    const float *q_norm, *k_norm;                      /* [head_dim] (Qwen3) or NULL */
    float *k_cache, *v_cache;                          /* [blocks, block_size, kv_heads, head_dim] */
} nls_layer;

typedef struct {
    int32_t hidden, intermediate, num_heads, num_kv_heads, head_dim, num_layers, vocab, block_size;
    int32_t lm_head_kind; /* KIND_Q4 / KIND_Q8, or 0: write the final normed hidden state */
    int32_t max_context;
    int32_t num_blocks;   /* blocks in each layer's K/V cache: the block ids in range */
    float eps, attn_scale;
    const float *embed;      /* [vocab, hidden] */
    const float *final_norm; /* [hidden] */
    const float *rope;       /* [positions, head_dim]: cos of the half-dim frequencies, then sin */
    const uint8_t *lm_head;  /* [vocab] rows of lm_head_kind */
    const nls_layer *layers;
} nls_model;

static void rms_norm(const float *x, const float *weight, int n, float eps, float *out) {
    float ss = dot_f32(x, x, n);
    float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = weight[i] * (x[i] * r);
}

/* Rotate-half RoPE of one head in place: x1' = x1 c - x2 s, x2' = x2 c + x1 s. */
static void rope_head(float *x, const float *cos_sin, int head_dim) {
    const int half = head_dim / 2;
    const float *c = cos_sin, *s = cos_sin + half;
    for (int i = 0; i < half; i++) {
        float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * c[i] - x2 * s[i];
        x[i + half] = x2 * c[i] + x1 * s[i];
    }
}

/* One query head over a sequence's first `ctx` keys, read in place from the paged cache
 * ([blocks, block_size, kv_heads, head_dim]) through the sequence's block table: softmax of
 * the scaled dot products, then the weighted sum of the values. `scores`: room for ctx. */
static void attend(const float *q, const float *k_cache, const float *v_cache, int kvh, int g, int hd,
                   int bs, float scale, const int64_t *block_table, int64_t ctx, float *scores,
                   float *out) {
    float max_score = -INFINITY;
    for (int64_t t = 0; t < ctx; t++) {
        const int64_t slot = block_table[t / bs] * bs + t % bs;
        const float s = dot_f32(q, k_cache + (slot * kvh + g) * hd, hd) * scale;
        scores[t] = s;
        max_score = s > max_score ? s : max_score;
    }
    __m256 sum8 = _mm256_setzero_ps();
    const __m256 mx = _mm256_set1_ps(max_score);
    int64_t t = 0;
    for (; t + 8 <= ctx; t += 8) {
        __m256 e = exp256_ps(_mm256_sub_ps(_mm256_loadu_ps(scores + t), mx));
        _mm256_storeu_ps(scores + t, e);
        sum8 = _mm256_add_ps(sum8, e);
    }
    float sum = hsum_ps(sum8);
    for (; t < ctx; t++) {
        scores[t] = expf(scores[t] - max_score);
        sum += scores[t];
    }
    float acc[256];
    memset(acc, 0, sizeof(float) * (size_t)hd);
    for (t = 0; t < ctx; t++) {
        const int64_t slot = block_table[t / bs] * bs + t % bs;
        const float *v = v_cache + (slot * kvh + g) * hd;
        const __m256 p = _mm256_set1_ps(scores[t]);
        for (int i = 0; i < hd; i += 8)
            _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(p, _mm256_loadu_ps(v + i), _mm256_loadu_ps(acc + i)));
    }
    const float inv = 1.0f / sum;
    for (int i = 0; i < hd; i++) out[i] = acc[i] * inv;
}

static void attend_head(const nls_model *m, const nls_layer *L, int head, const float *q,
                        const int64_t *block_table, int64_t ctx, float *scores, float *out) {
    const int g = head / (m->num_heads / m->num_kv_heads);
    attend(q, L->k_cache, L->v_cache, m->num_kv_heads, g, m->head_dim, m->block_size, m->attn_scale,
           block_table, ctx, scores, out);
}

static void silu_and_mul(const float *gate_up, int n, float *out) {
    int i = 0;
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate_up + i), u = _mm256_loadu_ps(gate_up + n + i);
        __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp256_ps(_mm256_sub_ps(zero, g))));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, u));
    }
    for (; i < n; i++) out[i] = gate_up[i] / (1.0f + expf(-gate_up[i])) * gate_up[n + i];
}

/* Bytes of scratch memory `nls_decode_step` needs for `m`. */
/* The longest row the step quantizes: the hidden state, the attention output or the MLP's
 * activation. */
static int64_t widest_input(const nls_model *m) {
    const int64_t q = (int64_t)m->num_heads * m->head_dim;
    int64_t widest = m->hidden > q ? m->hidden : q;
    return m->intermediate > widest ? m->intermediate : widest;
}

int64_t nls_decode_scratch_bytes(const nls_model *m) {
    const int64_t q = (int64_t)m->num_heads * m->head_dim, kv = (int64_t)m->num_kv_heads * m->head_dim;
    const int64_t widest = widest_input(m);
    const int64_t floats = 2 * (int64_t)m->hidden          /* residual stream, normed input */
                           + q + 2 * kv                    /* q, k, v */
                           + q                             /* attention output */
                           + 2 * (int64_t)m->intermediate  /* gate, up */
                           + m->intermediate               /* activation */
                           + m->hidden                     /* projection output */
                           + (int64_t)m->num_heads * m->max_context /* attention scores */
                           + 2 * (widest / QK);            /* activation block scales and sums */
    return floats * (int64_t)sizeof(float) + widest * (int64_t)sizeof(int16_t) + 64;
}

/* The forward pass of token `token` at `position` of a sequence whose K/V live in the blocks
 * `block_table` (the new token's K/V are written at `position`; the table has at least
 * position / block_size + 1 entries), -> `out`: the logits [vocab] or, with no lm_head, the
 * final normed hidden state [hidden]. Returns 0, or before touching anything
 * NLS_BAD_POSITION (not in [0, max_context)), NLS_BAD_TOKEN (not in [0, vocab)) or
 * NLS_BAD_BLOCK (a block id the sequence uses is not in [0, num_blocks)). */
int nls_decode_step(const nls_model *m, int64_t token, int64_t position, const int64_t *block_table,
                    void *scratch, float *out, int num_threads) {
    if (position < 0 || position >= m->max_context) return NLS_BAD_POSITION;
    if (token < 0 || token >= m->vocab) return NLS_BAD_TOKEN;
    for (int64_t b = 0; b <= position / m->block_size; b++)
        if (block_table[b] < 0 || block_table[b] >= m->num_blocks) return NLS_BAD_BLOCK;
    const int H = m->hidden, I = m->intermediate, hd = m->head_dim;
    const int nh = m->num_heads, kvh = m->num_kv_heads, q_size = nh * hd, kv_size = kvh * hd;
    const int64_t ctx = position + 1;
    float *h = scratch, *xn = h + H, *qkv = xn + H, *attn = qkv + q_size + 2 * kv_size;
    float *gate_up = attn + q_size, *act = gate_up + 2 * I, *proj = act + I;
    float *scores = proj + H, *dx = scores + (int64_t)nh * m->max_context;
    const int64_t widest = widest_input(m);
    float *sx = dx + widest / QK;
    int16_t *xq = (int16_t *)(sx + widest / QK);
    const float *cos_sin = m->rope + position * hd;
    const int64_t slot = block_table[position / m->block_size] * m->block_size + position % m->block_size;

    memcpy(h, m->embed + token * H, sizeof(float) * (size_t)H);
#pragma omp parallel num_threads(num_threads)
    for (int l = 0; l < m->num_layers; l++) {
        const nls_layer *L = &m->layers[l];
#pragma omp single
        {
            rms_norm(h, L->input_norm, H, m->eps, xn);
            quantize_row(xn, H, xq, dx, sx);
        }
        matvec_shared(L->qkv_kind, L->qkv, q_size + 2 * kv_size, H, xq, dx, sx, qkv);
#pragma omp single
        {
            float *q = qkv, *k = qkv + q_size, *v = k + kv_size;
            if (L->qkv_bias)
                for (int i = 0; i < q_size + 2 * kv_size; i++) qkv[i] += L->qkv_bias[i];
            for (int head = 0; head < nh + kvh; head++) {
                float *x = head < nh ? q + head * hd : k + (head - nh) * hd;
                const float *norm = head < nh ? L->q_norm : L->k_norm;
                if (norm) rms_norm(x, norm, hd, m->eps, x);
                rope_head(x, cos_sin, hd);
            }
            memcpy(L->k_cache + slot * kv_size, k, sizeof(float) * (size_t)kv_size);
            memcpy(L->v_cache + slot * kv_size, v, sizeof(float) * (size_t)kv_size);
        }
#pragma omp for schedule(static)
        for (int head = 0; head < nh; head++)
            attend_head(m, L, head, qkv + head * hd, block_table, ctx, scores + head * m->max_context,
                        attn + head * hd);
#pragma omp single
        quantize_row(attn, q_size, xq, dx, sx);
        matvec_shared(L->o_kind, L->o, H, q_size, xq, dx, sx, proj);
#pragma omp single
        {
            for (int i = 0; i < H; i++) h[i] += proj[i] + (L->o_bias ? L->o_bias[i] : 0.0f);
            rms_norm(h, L->post_norm, H, m->eps, xn);
            quantize_row(xn, H, xq, dx, sx);
        }
        matvec_shared(L->gate_up_kind, L->gate_up, 2 * (int64_t)I, H, xq, dx, sx, gate_up);
#pragma omp single
        {
            silu_and_mul(gate_up, I, act);
            quantize_row(act, I, xq, dx, sx);
        }
        matvec_shared(L->down_kind, L->down, H, I, xq, dx, sx, proj);
#pragma omp single
        for (int i = 0; i < H; i++) h[i] += proj[i];
    }
    if (!m->lm_head_kind) {
        rms_norm(h, m->final_norm, H, m->eps, out);
        return 0;
    }
    rms_norm(h, m->final_norm, H, m->eps, xn);
    quantize_row(xn, H, xq, dx, sx);
#pragma omp parallel num_threads(num_threads)
    matvec_shared(m->lm_head_kind, m->lm_head, m->vocab, H, xq, dx, sx, out);
    return 0;
}


/* ------------------------------------------------ public: attention of decode tokens -- */

/* The decode tokens of a batched step: q [seqs, heads, head_dim] -> out (same shape), each
 * sequence attending to its first context_lens[s] keys through its row of `block_tables`
 * ([seqs, table_width]), read in place from the layer's paged K/V. Every (sequence, head) is
 * one work item. Returns 0, NLS_NO_MEMORY, NLS_BAD_SHAPE for heads or a head_dim it
 * cannot run, NLS_BAD_POSITION for a context length not in [1, table_width * block_size],
 * or NLS_BAD_BLOCK for a block id outside [0, num_blocks) (the caches' first dimension). */
int nls_paged_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                               int64_t num_seqs, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,
                               int32_t block_size, int64_t num_blocks, float scale, const int64_t *block_tables,
                               int64_t table_width, const int64_t *context_lens, float *out,
                               int num_threads) {
    if (num_seqs < 0 || num_kv_heads <= 0 || num_heads % num_kv_heads || head_dim <= 0 ||
        head_dim > MAX_HEAD_DIM || head_dim % 8 || block_size <= 0 || table_width < 0)
        return NLS_BAD_SHAPE;
    int64_t longest = 1;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t ctx = context_lens[s];
        if (ctx < 1 || ctx > table_width * block_size) return NLS_BAD_POSITION;
        for (int64_t b = 0; b < (ctx + block_size - 1) / block_size; b++)
            if (block_tables[s * table_width + b] < 0 || block_tables[s * table_width + b] >= num_blocks)
                return NLS_BAD_BLOCK;
        longest = ctx > longest ? ctx : longest;
    }
    const int group = num_heads / num_kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)longest);
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 4)
        for (int64_t item = 0; item < num_seqs * num_heads; item++) {
            const int64_t s = item / num_heads;
            const int h = (int)(item % num_heads);
            if (scores)
                attend(q + item * head_dim, k_cache, v_cache, num_kv_heads, h / group, head_dim, block_size,
                       scale, block_tables + s * table_width, context_lens[s], scores, out + item * head_dim);
        }
        free(scores);
    }
    return failed ? NLS_NO_MEMORY : 0;
}
