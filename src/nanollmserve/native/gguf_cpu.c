/* CPU kernels for GGUF block weights (x86-64 with AVX2, FMA and F16C; the block products use
 * AVX-512 VNNI where the build has it), built and loaded by nanollmserve/native/build.py.
 * Two things live here:
 *
 * 1. Matrix products with weights kept in the GGUF file's own blocks of 32 (Q4_0, Q4_1, Q8_0),
 *    `y[M, out] = x[M, in] @ W^T`, at every row count. Each activation row is quantized per
 *    block of 32 to int16 with one float scale (and its exact float sum, for Q4_1's `m` term);
 *    the weights are tiled 16 outputs at a time (layout below), decoded once per block for
 *    all rows of the step, and a block's products are 16-bit multiply-adds with the outputs in
 *    the vector lanes. (llama.cpp quantizes activations to int8: on the bundled model that
 *    moved the next-token distribution 45x further from float32, KL 0.046 against 0.0010.)
 *    Q8_0 weights in the layers multiply int8 activations per block of 32 since decision 48
 *    (kquant_int8_cpu.c, its rows requantized from these int16 ones); the output projection
 *    keeps int16 whatever its type (`int16`: the logits tokens are chosen from).
 *
 * 2. `nls_decode_step`: the whole forward pass of a Llama-family decoder for the T tokens of
 *    a step of one or several sequences (one decode token per sequence; a speculative verify
 *    step: the last token and its drafts; a short prefill chunk), from token ids to logits, in
 *    one call and one OpenMP parallel region: RMSNorm, fused q/k/v, rotary embedding, the K/V
 *    write into the paged cache (float32, or int8 codes and a scale per token and KV head,
 *    quantized as they are written), causal attention over the sequence's blocks, the output
 *    projection, the gated MLP (biases where the model has them), the final norm and the output projection to the vocabulary.
 *    Gemma 3's options too: GeGLU, the embedding scale, the sandwich norms, a sliding window
 *    and a cos/sin table per layer, and the final logit soft-cap.
 *    The T rows go through each matrix together (a tile's weights decoded once for all of
 *    them). PyTorch runs the same step as ~1000 operator calls, whose dispatch alone costs
 *    more than the arithmetic at a few tokens.
 */

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "native.h"



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

/* ------------------------------------------------------------------ tiled block kernel -- */

/* How far ahead (in tile-blocks) the one-row kernel and the accumulator kernel ask for their
 * weights: a step of one or a few rows streams every weight once and waits on memory, not on
 * arithmetic (stop 34, scripts/profile_breakdown.py: a single-stream step's products 4.2 ->
 * 3.4 ms on the amx build, 6.6 -> 4.7 ms on avx2; an 8-row avx2 step's 16.1-16.4 -> 14.9-15.4;
 * 32 rows unchanged; the few-row kernel of a verify step gained nothing; 2 blocks ahead
 * measured best of 2, 4, 8). A tile's last blocks prefetch the next tile's first, which this
 * thread runs next (static schedule). */
#define WEIGHT_PREFETCH_BLOCKS 2
static inline void prefetch_block(const uint8_t *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch((const char *)p + off, _MM_HINT_T0);
}

/* Weights are tiled by model/gguf_blocks.py: 16 outputs at a time, and for each tile its
 * blocks of 32 inputs in order, each tile-block laid out so that one 32-byte load widens into
 * the 16 outputs' weights for two inputs (the pairs a 16-bit multiply-add sums):
 *   Q4 (320 bytes): codes[8][32] | d f16[16] | m f16[16]   byte 2o+i of group g holds output
 *                   o's code for input 2g+i in its low nibble and for input 16+2g+i in its high
 *                   one; w = d q + m (Q4_0 stored with m = -8 d).
 *   Q8 (544 bytes): codes int8[16][32] | d f16[16]          byte 2o+i of pair p is output o's
 *                   code for input 2p+i; w = d q.
 * So a block's products for one activation row are 16 multiply-adds with the row's 16 input
 * pairs broadcast, the 16 outputs in the lanes (no horizontal sums); the integer sums are
 * scaled by d_w d_x and, for Q4, m_w times the row's block sum is added. A tile's weights are
 * decoded once per block and reused for every row of the step. */

/* Accumulates one tile against rows [0, rows): acc[r][0..15] += scaled block sums (and, for
 * Q4, acc[r][16..31] += the m terms). */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* A tile-block's codes widened to 16-bit: w[p] holds the 16 outputs' codes for inputs 2p, 2p+1. */
static inline __attribute__((always_inline)) void widen_tile_block(int kind, const uint8_t *tb, __m512i w[16]) {
    if (kind == KIND_Q4) {
        /* widen the bytes once, then split the nibbles in 16-bit lanes: one cross-lane
         * widening per 32 bytes instead of two */
        const __m512i low = _mm512_set1_epi16(0x0F);
        for (int g = 0; g < 8; g++) {
            const __m512i c = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(tb + 32 * g)));
            w[g] = _mm512_and_si512(c, low);
            w[g + 8] = _mm512_srli_epi16(c, 4);
        }
    } else {
        for (int p = 0; p < 16; p++)
            w[p] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(tb + 32 * p)));
    }
}

static inline void tile_block_rows(int kind, const uint8_t *tb, int64_t b, int64_t nb, int64_t in,
                                   const int16_t *xq, const float *dx, const float *sx,
                                   int64_t rows, float *acc) {
    __m512i w[16];
    widen_tile_block(kind, tb, w);
    const int code_bytes = kind == KIND_Q4 ? 256 : 512;
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tb + code_bytes)));
    const __m512 mw = kind == KIND_Q4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tb + code_bytes + 32)))
                                      : _mm512_setzero_ps();
    int64_t r = 0;
    for (; r + 2 <= rows; r += 2) {
        const int32_t *x0 = (const int32_t *)(xq + r * in + b * QK), *x1 = (const int32_t *)(xq + (r + 1) * in + b * QK);
        __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
        __m512i c0 = _mm512_setzero_si512(), c1 = _mm512_setzero_si512();
        for (int p = 0; p < 16; p += 2) {
            a0 = _mm512_dpwssd_epi32(a0, w[p], _mm512_set1_epi32(x0[p]));
            a1 = _mm512_dpwssd_epi32(a1, w[p + 1], _mm512_set1_epi32(x0[p + 1]));
            c0 = _mm512_dpwssd_epi32(c0, w[p], _mm512_set1_epi32(x1[p]));
            c1 = _mm512_dpwssd_epi32(c1, w[p + 1], _mm512_set1_epi32(x1[p + 1]));
        }
        float *y0 = acc + 32 * r, *y1 = y0 + 32;
        _mm512_storeu_ps(y0, _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(dx[r * nb + b])),
                                             _mm512_cvtepi32_ps(_mm512_add_epi32(a0, a1)), _mm512_loadu_ps(y0)));
        _mm512_storeu_ps(y1, _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(dx[(r + 1) * nb + b])),
                                             _mm512_cvtepi32_ps(_mm512_add_epi32(c0, c1)), _mm512_loadu_ps(y1)));
        if (kind == KIND_Q4) {
            _mm512_storeu_ps(y0 + 16, _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[r * nb + b]), _mm512_loadu_ps(y0 + 16)));
            _mm512_storeu_ps(y1 + 16, _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[(r + 1) * nb + b]), _mm512_loadu_ps(y1 + 16)));
        }
    }
    for (; r < rows; r++) {
        const int32_t *x0 = (const int32_t *)(xq + r * in + b * QK);
        __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
        for (int p = 0; p < 16; p += 2) {
            a0 = _mm512_dpwssd_epi32(a0, w[p], _mm512_set1_epi32(x0[p]));
            a1 = _mm512_dpwssd_epi32(a1, w[p + 1], _mm512_set1_epi32(x0[p + 1]));
        }
        float *y0 = acc + 32 * r;
        _mm512_storeu_ps(y0, _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(dx[r * nb + b])),
                                             _mm512_cvtepi32_ps(_mm512_add_epi32(a0, a1)), _mm512_loadu_ps(y0)));
        if (kind == KIND_Q4)
            _mm512_storeu_ps(y0 + 16, _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[r * nb + b]), _mm512_loadu_ps(y0 + 16)));
    }
}
#else
/* AVX2: ROWS rows (a compile-time constant at each call, so the loops unroll) against one
 * decoded tile-block, each row's 16 integer sums in two registers across the block's 16 input
 * pairs (a pair's weights loaded once for all the rows), then scaled into the row's
 * accumulators as the other kernels do. Rows one at a time kept the sums of 16 pairs in
 * flight at once, more than the 16 registers hold: the spills, and every weight reloaded for
 * every row, held the kernel to about half of what `vpmaddwd` + `vpaddd` sustain (stop 35,
 * scripts/kernel_peak.py). */
#define AVX2_ROW_GROUP 4
static inline __attribute__((always_inline)) void row_group_block(
    int kind, const __m256i wbuf[16][2], __m256 dw0, __m256 dw1, __m256 mw0, __m256 mw1, int64_t b,
    int64_t nb, int64_t in, const int16_t *xq, const float *dx, const float *sx, const int ROWS, float *acc) {
    __m256i lo[AVX2_ROW_GROUP], hi[AVX2_ROW_GROUP];
    for (int r = 0; r < ROWS; r++) lo[r] = hi[r] = _mm256_setzero_si256();
    /* one pair a pass: unrolled over the pairs, the compiler interleaves them and spills */
#pragma GCC unroll 1
    for (int p = 0; p < 16; p++) {
        const __m256i w0 = _mm256_load_si256(&wbuf[p][0]), w1 = _mm256_load_si256(&wbuf[p][1]);
        __m256i t0, t1;
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; r++) {
            const __m256i x = _mm256_set1_epi32(((const int32_t *)(xq + r * in + b * QK))[p]);
            /* in place (the compiler otherwise adds into a fresh register and copies it back) */
            __asm__("vpmaddwd %[w], %[x], %[t]\n\tvpaddd %[t], %[acc], %[acc]"
                    : [acc] "+x"(lo[r]), [t] "=&x"(t0) : [w] "x"(w0), [x] "x"(x));
            __asm__("vpmaddwd %[w], %[x], %[t]\n\tvpaddd %[t], %[acc], %[acc]"
                    : [acc] "+x"(hi[r]), [t] "=&x"(t1) : [w] "x"(w1), [x] "x"(x));
        }
    }
    for (int r = 0; r < ROWS; r++) {
        float *y = acc + 32 * r;
        const __m256 sd = _mm256_set1_ps(dx[r * nb + b]);
        _mm256_storeu_ps(y, _mm256_fmadd_ps(_mm256_mul_ps(dw0, sd), _mm256_cvtepi32_ps(lo[r]), _mm256_loadu_ps(y)));
        _mm256_storeu_ps(y + 8, _mm256_fmadd_ps(_mm256_mul_ps(dw1, sd), _mm256_cvtepi32_ps(hi[r]), _mm256_loadu_ps(y + 8)));
        if (kind == KIND_Q4) {
            const __m256 ss = _mm256_set1_ps(sx[r * nb + b]);
            _mm256_storeu_ps(y + 16, _mm256_fmadd_ps(mw0, ss, _mm256_loadu_ps(y + 16)));
            _mm256_storeu_ps(y + 24, _mm256_fmadd_ps(mw1, ss, _mm256_loadu_ps(y + 24)));
        }
    }
}

static inline void tile_block_rows(int kind, const uint8_t *tb, int64_t b, int64_t nb, int64_t in,
                                   const int16_t *xq, const float *dx, const float *sx,
                                   int64_t rows, float *acc) {
    /* pair p: outputs 0..7 in wbuf[p][0], 8..15 in wbuf[p][1] */
    __m256i wbuf[16][2];
    if (kind == KIND_Q4) {
        const __m128i low = _mm_set1_epi8(0x0F);
        for (int g = 0; g < 8; g++)
            for (int h = 0; h < 2; h++) {
                const __m128i c = _mm_loadu_si128((const __m128i *)(tb + 32 * g + 16 * h));
                wbuf[g][h] = _mm256_cvtepu8_epi16(_mm_and_si128(c, low));
                wbuf[g + 8][h] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(c, 4), low));
            }
    } else {
        for (int p = 0; p < 16; p++)
            for (int h = 0; h < 2; h++)
                wbuf[p][h] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(tb + 32 * p + 16 * h)));
    }
    const int code_bytes = kind == KIND_Q4 ? 256 : 512;
    const uint16_t *d = (const uint16_t *)(tb + code_bytes);
    const __m256 dw0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)d));
    const __m256 dw1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + 8)));
    __m256 mw0 = _mm256_setzero_ps(), mw1 = _mm256_setzero_ps();
    if (kind == KIND_Q4) {
        mw0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + 16)));
        mw1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + 24)));
    }
    for (int64_t r0 = 0; r0 < rows; r0 += AVX2_ROW_GROUP) {
        const int64_t left = rows - r0;
        const int16_t *x = xq + r0 * in;
        const float *d0 = dx + r0 * nb, *s0 = sx + r0 * nb;
        float *a = acc + 32 * r0;
        switch (left < AVX2_ROW_GROUP ? left : AVX2_ROW_GROUP) {
        case 1: row_group_block(kind, wbuf, dw0, dw1, mw0, mw1, b, nb, in, x, d0, s0, 1, a); break;
        case 2: row_group_block(kind, wbuf, dw0, dw1, mw0, mw1, b, nb, in, x, d0, s0, 2, a); break;
        case 3: row_group_block(kind, wbuf, dw0, dw1, mw0, mw1, b, nb, in, x, d0, s0, 3, a); break;
        default: row_group_block(kind, wbuf, dw0, dw1, mw0, mw1, b, nb, in, x, d0, s0, 4, a); break;
        }
    }
}
#endif

/* One tile against one activation row, the accumulators in registers (the single-stream
 * step's case: no other row shares the decoded weights, so the block loop must not wait on
 * memory): -> the tile's 16 sums. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
static inline __m512i q4_pairs(const uint8_t *tb, int g, int high) {
    const __m256i c = _mm256_loadu_si256((const __m256i *)(tb + 32 * g));
    const __m256i low = _mm256_set1_epi8(0x0F);
    return _mm512_cvtepu8_epi16(_mm256_and_si256(high ? _mm256_srli_epi16(c, 4) : c, low));
}

static void tile_times_row(int kind, const uint8_t *tile, int64_t nb, const int16_t *xq,
                           const float *dx, const float *sx, float *sums) {
    const int64_t tb_bytes = tile_block_bytes(kind);
    const int code_bytes = kind == KIND_Q4 ? 256 : 512;
    __m512 acc = _mm512_setzero_ps(), macc = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *tb = tile + b * tb_bytes;
        prefetch_block(tb + WEIGHT_PREFETCH_BLOCKS * tb_bytes, tb_bytes);
        const int32_t *x = (const int32_t *)(xq + b * QK);
        __m512i a[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
        if (kind == KIND_Q4) {
            for (int g = 0; g < 8; g++) {
                a[g & 1] = _mm512_dpwssd_epi32(a[g & 1], q4_pairs(tb, g, 0), _mm512_set1_epi32(x[g]));
                a[2 + (g & 1)] = _mm512_dpwssd_epi32(a[2 + (g & 1)], q4_pairs(tb, g, 1), _mm512_set1_epi32(x[g + 8]));
            }
        } else {
            for (int p = 0; p < 16; p++)
                a[p & 3] = _mm512_dpwssd_epi32(
                    a[p & 3], _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(tb + 32 * p))),
                    _mm512_set1_epi32(x[p]));
        }
        const __m512i s = _mm512_add_epi32(_mm512_add_epi32(a[0], a[1]), _mm512_add_epi32(a[2], a[3]));
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tb + code_bytes)));
        acc = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(dx[b])), _mm512_cvtepi32_ps(s), acc);
        if (kind == KIND_Q4)
            macc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tb + code_bytes + 32))),
                                   _mm512_set1_ps(sx[b]), macc);
    }
    _mm512_storeu_ps(sums, _mm512_add_ps(acc, macc));
}
#else
static void tile_times_row(int kind, const uint8_t *tile, int64_t nb, const int16_t *xq,
                           const float *dx, const float *sx, float *sums) {
    const int64_t tb_bytes = tile_block_bytes(kind);
    const int code_bytes = kind == KIND_Q4 ? 256 : 512;
    const __m128i low = _mm_set1_epi8(0x0F);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    __m256 macc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *tb = tile + b * tb_bytes;
        prefetch_block(tb + WEIGHT_PREFETCH_BLOCKS * tb_bytes, tb_bytes);
        const int32_t *x = (const int32_t *)(xq + b * QK);
        const uint16_t *d = (const uint16_t *)(tb + code_bytes);
        for (int h = 0; h < 2; h++) {
            __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
            if (kind == KIND_Q4) {
                for (int g = 0; g < 8; g++) {
                    const __m128i c = _mm_loadu_si128((const __m128i *)(tb + 32 * g + 16 * h));
                    a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_and_si128(c, low)),
                                                                _mm256_set1_epi32(x[g])));
                    a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(
                                                  _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(c, 4), low)),
                                                  _mm256_set1_epi32(x[g + 8])));
                }
            } else {
                for (int p = 0; p < 16; p += 2) {
                    a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(tb + 32 * p + 16 * h))),
                                                                _mm256_set1_epi32(x[p])));
                    a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(tb + 32 * p + 32 + 16 * h))),
                                                                _mm256_set1_epi32(x[p + 1])));
                }
            }
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + 8 * h)));
            acc[h] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(dx[b])),
                                     _mm256_cvtepi32_ps(_mm256_add_epi32(a0, a1)), acc[h]);
            if (kind == KIND_Q4)
                macc[h] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + 16 + 8 * h))),
                                          _mm256_set1_ps(sx[b]), macc[h]);
        }
    }
    _mm256_storeu_ps(sums, _mm256_add_ps(acc[0], macc[0]));
    _mm256_storeu_ps(sums + 8, _mm256_add_ps(acc[1], macc[1]));
}
#endif

/* Tile `t` of W against `rows` quantized activation rows -> y[r * ldy + t * 16 + j] for the
 * tile's first `valid` outputs (+ bias when not NULL). `acc`: room for 32 floats a row. */
static void tile_times_rows(int kind, const uint8_t *w, int64_t t, int64_t nb, int64_t in,
                            const int16_t *xq, const float *dx, const float *sx, int64_t rows,
                            float *acc, const float *bias, float *y, int64_t ldy, int valid) {
    const int64_t tb_bytes = tile_block_bytes(kind);
    const uint8_t *tile = w + t * nb * tb_bytes;
    if (rows == 1) {
        float sums[TILE];
        tile_times_row(kind, tile, nb, xq, dx, sx, sums);
        for (int j = 0; j < valid; j++) y[t * TILE + j] = sums[j] + (bias ? bias[t * TILE + j] : 0.0f);
        return;
    }
    memset(acc, 0, sizeof(float) * 32 * (size_t)rows);
    for (int64_t b = 0; b < nb; b++) {
        prefetch_block(tile + (b + WEIGHT_PREFETCH_BLOCKS) * tb_bytes, tb_bytes);
        tile_block_rows(kind, tile + b * tb_bytes, b, nb, in, xq, dx, sx, rows, acc);
    }
    for (int64_t r = 0; r < rows; r++)
        for (int j = 0; j < valid; j++)
            y[r * ldy + t * TILE + j] = acc[32 * r + j] + acc[32 * r + 16 + j] + (bias ? bias[t * TILE + j] : 0.0f);
}

/* A few rows (a verify step's k + 1) against one tile with every row's accumulators in
 * registers across the blocks, the tile's weights decoded once per block for them all: the
 * same operations in the same order as tile_block_rows (so the same numbers), without its
 * accumulator loads and stores, which cost a verify step of 5 rows ~20% (measured).
 * `ROWS` is a compile-time constant at each call, so the row loops unroll. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define FEW_ROWS 5
static inline __attribute__((always_inline)) void tile_times_few_rows(
    int kind, const uint8_t *tile, int64_t nb, int64_t in, const int16_t *xq, const float *dx,
    const float *sx, const int ROWS, float *y, int64_t ldy, int64_t t, int valid) {
    const int64_t tb_bytes = tile_block_bytes(kind);
    const int code_bytes = kind == KIND_Q4 ? 256 : 512;
    __m512 acc[FEW_ROWS], macc[FEW_ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = macc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *tb = tile + b * tb_bytes;
        __m512i w[16];
        widen_tile_block(kind, tb, w);
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tb + code_bytes)));
        for (int r = 0; r < ROWS; r++) {
            const int32_t *x = (const int32_t *)(xq + r * in + b * QK);
            __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
            for (int p = 0; p < 16; p += 2) {
                a0 = _mm512_dpwssd_epi32(a0, w[p], _mm512_set1_epi32(x[p]));
                a1 = _mm512_dpwssd_epi32(a1, w[p + 1], _mm512_set1_epi32(x[p + 1]));
            }
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(dx[r * nb + b])),
                                     _mm512_cvtepi32_ps(_mm512_add_epi32(a0, a1)), acc[r]);
        }
        if (kind == KIND_Q4) {
            const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tb + code_bytes + 32)));
            for (int r = 0; r < ROWS; r++) macc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[r * nb + b]), macc[r]);
        }
    }
    for (int r = 0; r < ROWS; r++) {
        float total[TILE];
        _mm512_storeu_ps(total, _mm512_add_ps(acc[r], macc[r]));
        for (int j = 0; j < valid; j++) y[r * ldy + t * TILE + j] = total[j];
    }
}

/* Rows [0, rows) of the tile in groups of at most FEW_ROWS; false (nothing done) for more
 * than 2 * FEW_ROWS rows, which the accumulator kernel runs. */
static bool tile_times_row_groups(int kind, const uint8_t *tile, int64_t nb, int64_t in, const int16_t *xq,
                                  const float *dx, const float *sx, int64_t rows, float *y, int64_t ldy,
                                  int64_t t, int valid) {
    if (rows > 2 * FEW_ROWS) return false;
    for (int64_t r0 = 0; r0 < rows;) {
        const int64_t left = rows - r0, group = left > FEW_ROWS ? (left + 1) / 2 : left;
        const int64_t nbr = r0 * nb;
        switch (group) {
        case 1: tile_times_few_rows(kind, tile, nb, in, xq + r0 * in, dx + nbr, sx + nbr, 1, y + r0 * ldy, ldy, t, valid); break;
        case 2: tile_times_few_rows(kind, tile, nb, in, xq + r0 * in, dx + nbr, sx + nbr, 2, y + r0 * ldy, ldy, t, valid); break;
        case 3: tile_times_few_rows(kind, tile, nb, in, xq + r0 * in, dx + nbr, sx + nbr, 3, y + r0 * ldy, ldy, t, valid); break;
        case 4: tile_times_few_rows(kind, tile, nb, in, xq + r0 * in, dx + nbr, sx + nbr, 4, y + r0 * ldy, ldy, t, valid); break;
        default: tile_times_few_rows(kind, tile, nb, in, xq + r0 * in, dx + nbr, sx + nbr, 5, y + r0 * ldy, ldy, t, valid); break;
        }
        r0 += group;
    }
    return true;
}
#else
static bool tile_times_row_groups(int kind, const uint8_t *tile, int64_t nb, int64_t in, const int16_t *xq,
                                  const float *dx, const float *sx, int64_t rows, float *y, int64_t ldy,
                                  int64_t t, int valid) {
    (void)kind, (void)tile, (void)nb, (void)in, (void)xq, (void)dx, (void)sx, (void)rows, (void)y, (void)ldy,
        (void)t, (void)valid;
    return false;
}
#endif

/* y[r * out + o] = (W x_r)[o] for `rows` quantized activation rows (row r at xq + r * in), the
 * tiles shared among the threads of the enclosing parallel region (an orphaned work-sharing
 * loop; it ends in a barrier). `int16`: keep the int16 activations where the kind's kernel
 * would requantize them to int8 (Q8_0, the K-quant kinds of at most 6-bit codes): the output
 * projection (decision 48). `acc`: this thread's room for 32 floats a row. */
static void matmul_shared(int kind, const uint8_t *w, int64_t out, int64_t in, const int16_t *xq,
                          const float *dx, const float *sx, int64_t rows, bool int16, float *acc, float *y,
                          uint8_t *amx_work) {
    if (kq_kind_bits(kind)) {
        nls_kq_matmul_shared(kind, w, out, in, xq, dx, sx, rows, int16, acc, y);
        return;
    }
    if (kind == KIND_Q8 && !int16 && nls_q8i8_matmul_shared(w, out, in, xq, dx, rows, acc, y)) return;
#if NLS_HAS_AMX
    if (amx_work != NULL && rows >= AMX_STEP_MIN_ROWS) {
        nls_amx_matmul_shared(kind, w, out, in, xq, dx, sx, rows, NULL, y, amx_work);
        return;
    }
#else
    (void)amx_work;
#endif
    nls_block_tiles_shared(kind, w, out, in, xq, dx, sx, rows, acc, y);
}

/* The vector kernels' tiles of KIND_Q4 or KIND_Q8 against `rows` int16 rows, shared among the
 * threads of the enclosing parallel region (an orphaned loop ending in a barrier). */
void nls_block_tiles_shared(int kind, const uint8_t *w, int64_t out, int64_t in, const int16_t *xq,
                            const float *dx, const float *sx, int64_t rows, float *acc, float *y) {
    const int64_t nb = in / QK, tiles = (out + TILE - 1) / TILE;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int valid = out - t * TILE < TILE ? (int)(out - t * TILE) : TILE;
        if (rows == 1 || !tile_times_row_groups(kind, w + t * nb * tile_block_bytes(kind), nb, in, xq, dx, sx,
                                                rows, y, out, t, valid))
            tile_times_rows(kind, w, t, nb, in, xq, dx, sx, rows, acc, NULL, y, out, valid);
    }
}

/* ------------------------------------------------------------- public: matrix product -- */

/* Bytes of the workspace `nls_gguf_matmul` needs for `rows` rows of `in` inputs on
 * `num_threads` threads. */
/* Each thread's accumulators start on their own cache line, past the shared activations:
 * a line written by one thread and read by another bounces between cores on every block. */
static inline int64_t round_up_64(int64_t n) { return (n + 63) / 64 * 64; }

static inline int64_t activation_bytes(int64_t in, int64_t rows) {
    return round_up_64(rows * in * (int64_t)sizeof(int16_t) + 2 * rows * (in / QK) * (int64_t)sizeof(float));
}

static inline int64_t accumulator_bytes(int64_t rows) { return round_up_64(32 * rows * (int64_t)sizeof(float)) + 4096; }

int64_t nls_gguf_matmul_workspace_bytes(int64_t in, int64_t rows, int num_threads) {
    int64_t bytes = 64 + activation_bytes(in, rows) + (int64_t)num_threads * accumulator_bytes(rows);
#if NLS_HAS_AMX
    if (rows >= AMX_MIN_ROWS) bytes += nls_amx_workspace_bytes(in, rows, num_threads);
#endif
    return bytes;
}

/* y[M, out] = x[M, in] @ W^T (+ bias when not NULL) with W tiled as above (out rounded up to
 * whole tiles); `int16` as matmul_shared's (the PyTorch path's output projection). `workspace`: at least nls_gguf_matmul_workspace_bytes(in, rows, num_threads)
 * bytes, reused across calls. Returns 0, or NLS_BAD_SHAPE when `in` is not a positive
 * multiple of 32, a size is negative, `kind` unknown or the workspace too small. */
int nls_gguf_matmul(int kind, const uint8_t *w, int64_t out, int64_t in, const float *x, int64_t rows,
                    const float *bias, int int16, float *y, void *workspace, int64_t workspace_bytes,
                    int num_threads) {
    if (in <= 0 || in % QK || out < 0 || rows < 0 || num_threads < 1 || (kind != KIND_Q4 && kind != KIND_Q8) ||
        workspace_bytes < nls_gguf_matmul_workspace_bytes(in, rows, num_threads))
        return NLS_BAD_SHAPE;
    const int64_t nb = in / QK, tiles = (out + TILE - 1) / TILE;
    uint8_t *base = (uint8_t *)(((uintptr_t)workspace + 63) / 64 * 64);
    int16_t *xq = (int16_t *)base;
    float *dx = (float *)(xq + rows * in), *sx = dx + rows * nb;
    uint8_t *accs = base + activation_bytes(in, rows);
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) quantize_row(x + r * in, in, xq + r * in, dx + r * nb, sx + r * nb);
        float *acc = (float *)(accs + (int64_t)omp_get_thread_num() * accumulator_bytes(rows));
        if (kind == KIND_Q8 && !int16 && nls_q8i8_matmul_shared(w, out, in, xq, dx, rows, acc, y)) {
            if (bias) {
#pragma omp for schedule(static)
                for (int64_t r = 0; r < rows; r++)
                    for (int64_t o = 0; o < out; o++) y[r * out + o] += bias[o];
            }
            goto done;
        }
#if NLS_HAS_AMX
        if (rows >= AMX_MIN_ROWS) {
            uint8_t *amx_work = accs + (int64_t)num_threads * accumulator_bytes(rows);
            nls_amx_matmul_shared(kind, w, out, in, xq, dx, sx, rows, bias, y, amx_work);
            goto done;
        }
#endif
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int valid = out - t * TILE < TILE ? (int)(out - t * TILE) : TILE;
            tile_times_rows(kind, w, t, nb, in, xq, dx, sx, rows, acc, bias, y, out, valid);
        }
    done:;
    }
    return 0;
}

/* ---------------------------------------------------------- public: one decode step -- */

/* nls_layer and nls_model: native.h */

/* Whether an embedding table of `kind` with rows of `hidden` can be looked up: float32 (0), or
 * the tiled blocks of a kind the kernels run (KIND_Q4, KIND_Q8, a K-quant kind). */
static bool embed_kind_ok(int kind, int64_t hidden) {
    const int64_t block = kq_kind_bits(kind) && (kq_kind_layout(kind) & KQ_SUPER) ? 8 * QK : QK; /* a super-block */
    return kind == 0 || ((kind == KIND_Q4 || kind == KIND_Q8 || kq_kind_bits(kind)) && hidden > 0 && hidden % block == 0);
}

/* Row `token` of an embedding table of `kind` into `out` [hidden]. A table in blocks is read
 * in the tiled layout of the kernels (token = output o of tile token / TILE) and only this row
 * is dequantized: KIND_Q8 (in each block of 32, byte 32 p + 2 o + i is the code of input
 * 2 p + i, then the tile's 16 `d`): w = d * code; KIND_Q4 (byte 32 g + 2 o + i holds input
 * 2 g + i in its low nibble and 16 + 2 g + i in its high one, then 16 `d` and 16 `m`):
 * w = d * code + m; the K-quant kinds: `nls_kq_dequant_row` (kquant_cpu.c). Each product is
 * exact in float32, so each row is the float the dequantized table held (one rounding at
 * most, the add, as the gguf package's dequantization rounds it): no float32 copy of the
 * table is kept. */
static void embed_table_row(int kind, const void *table, int64_t H, int64_t token, float *out) {
    if (kind == 0) {
        memcpy(out, (const float *)table + token * H, sizeof(float) * (size_t)H);
        return;
    }
    if (kq_kind_bits(kind)) {
        nls_kq_dequant_row(kind, (const uint8_t *)table, H, token, out);
        return;
    }
    const int64_t nb = H / QK, tile_bytes = tile_block_bytes(kind);
    const int o = (int)(token % TILE);
    const uint8_t *tile = (const uint8_t *)table + (token / TILE) * nb * tile_bytes;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *tb = tile + b * tile_bytes;
        float *row = out + b * QK;
        uint16_t half;
        if (kind == KIND_Q8) {
            memcpy(&half, tb + 512 + 2 * o, sizeof half);
            const float d = _cvtsh_ss(half);
            for (int p = 0; p < QK / 2; p++)
                for (int i = 0; i < 2; i++) row[2 * p + i] = d * (float)(int8_t)tb[32 * p + 2 * o + i];
            continue;
        }
        memcpy(&half, tb + 256 + 2 * o, sizeof half);
        const float d = _cvtsh_ss(half);
        memcpy(&half, tb + 288 + 2 * o, sizeof half);
        const float mq = _cvtsh_ss(half);
        for (int g = 0; g < QK / 4; g++)
            for (int i = 0; i < 2; i++) {
                const uint8_t byte = tb[32 * g + 2 * o + i];
                row[2 * g + i] = d * (float)(byte & 15) + mq;
                row[16 + 2 * g + i] = d * (float)(byte >> 4) + mq;
            }
    }
}

static void embed_row(const nls_model *m, int64_t token, float *out) {
    embed_table_row(m->embed_kind, m->embed, m->hidden, token, out);
}

/* out[t * hidden ..] = row tokens[t] of an embedding table of `kind` [vocab, hidden] (the
 * decode step's lookup, for the tests and any caller that wants rows without a step): 0, or
 * NLS_BAD_SHAPE (a kind or width it cannot read), NLS_BAD_TOKEN (a token not in [0, vocab)). */
int nls_embed_rows(int kind, const void *table, int64_t vocab, int64_t hidden, const int64_t *tokens,
                   int64_t num_tokens, float *out) {
    if (!embed_kind_ok(kind, hidden) || vocab < 0 || num_tokens < 0) return NLS_BAD_SHAPE;
    for (int64_t t = 0; t < num_tokens; t++)
        if (tokens[t] < 0 || tokens[t] >= vocab) return NLS_BAD_TOKEN;
    for (int64_t t = 0; t < num_tokens; t++) embed_table_row(kind, table, hidden, tokens[t], out + t * hidden);
    return 0;
}

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

/* GeGLU: gelu_tanh(gate) * up, gelu_tanh(x) = 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x +
 * 0.044715 x^3), computed as x / (1 + exp(-2u)) (the same function: 0.5 (1 + tanh(u)) is
 * sigmoid(2u)), PyTorch's `gelu(approximate="tanh")`. */
static void gelu_tanh_and_mul(const float *gate_up, int n, float *out) {
    const float k2 = -2.0f * 0.7978845608028654f, c = 0.044715f;
    int i = 0;
    const __m256 one = _mm256_set1_ps(1.0f), vk2 = _mm256_set1_ps(k2), vc = _mm256_set1_ps(c);
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate_up + i), u = _mm256_loadu_ps(gate_up + n + i);
        const __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(vc, g), _mm256_mul_ps(g, g), g); /* x + c x^3 */
        const __m256 gelu = _mm256_div_ps(g, _mm256_add_ps(one, exp256_ps(_mm256_mul_ps(vk2, inner))));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(gelu, u));
    }
    for (; i < n; i++) {
        const float g = gate_up[i];
        out[i] = g / (1.0f + expf(k2 * (g + c * g * g * g))) * gate_up[n + i];
    }
}

/* One token's K or V row of one KV head (`hd` floats) -> int8 codes and its scale, x ~= scale
 * code: scale = max |x| / 127, codes rounded to nearest (ties to even), the bytes the PyTorch
 * path (layers/kv_quant.py) writes for the same row. */
static void quantize_kv_head(const float *x, int hd, int8_t *codes, float *scale) {
    float amax = 0.0f;
    for (int i = 0; i < hd; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int i = 0; i < hd; i++) codes[i] = (int8_t)nearbyintf(x[i] * inv);
    *scale = amax / 127.0f;
}

/* Token row `k`, `v` ([kv_heads * head_dim] each) into cache slot `slot` of layer L. */
static void store_kv(const nls_model *m, const nls_layer *L, int64_t slot, const float *k, const float *v) {
    const int kvh = m->num_kv_heads, hd = m->head_dim;
    const int64_t kv_size = (int64_t)kvh * hd;
    if (m->kv_dtype == NLS_KV_INT8) {
        for (int g = 0; g < kvh; g++) {
            const int64_t row = slot * kvh + g;
            quantize_kv_head(k + g * hd, hd, (int8_t *)L->k_cache + row * hd, L->k_scale + row);
            quantize_kv_head(v + g * hd, hd, (int8_t *)L->v_cache + row * hd, L->v_scale + row);
        }
        return;
    }
    if (m->kv_dtype == NLS_KV_F16) { /* kv_size is a multiple of 8: head_dim is */
        uint16_t *kh = (uint16_t *)L->k_cache + slot * kv_size, *vh = (uint16_t *)L->v_cache + slot * kv_size;
        for (int64_t i = 0; i < kv_size; i += 8) {
            _mm_storeu_si128((__m128i *)(kh + i), _mm256_cvtps_ph(_mm256_loadu_ps(k + i), _MM_FROUND_TO_NEAREST_INT));
            _mm_storeu_si128((__m128i *)(vh + i), _mm256_cvtps_ph(_mm256_loadu_ps(v + i), _MM_FROUND_TO_NEAREST_INT));
        }
        return;
    }
    memcpy((float *)L->k_cache + slot * kv_size, k, sizeof(float) * (size_t)kv_size);
    memcpy((float *)L->v_cache + slot * kv_size, v, sizeof(float) * (size_t)kv_size);
}

/* The longest row the step quantizes: the hidden state, the attention output or the MLP's
 * activation. */
static int64_t widest_input(const nls_model *m) {
    const int64_t q = (int64_t)m->num_heads * m->head_dim;
    int64_t widest = m->hidden > q ? m->hidden : q;
    return m->intermediate > widest ? m->intermediate : widest;
}

/* Each thread's own scratch (block-product accumulators, attention scores) starts on its own
 * cache line. */
static int64_t thread_scores_floats(const nls_model *m) {
    const int64_t chunk = ATTEND_ROWS * attend_chunk_keys(m->max_context);
    const int64_t span = span_scores_floats(m->max_context);
    return chunk > span ? chunk : span;
}

/* The attention's work units, in token order: a tile (a piece of a run of at least
 * SPAN_TILE_MIN_RUN consecutive positions of one sequence: `nls_attend_span`, one item per KV
 * head) or the query rows of fewer consecutive tokens of one sequence (a decode token, a verify
 * span) whose keys split into the same chunks: one item per chunk, for every KV head
 * (`nls_attend_chunk`), their partials merged after. */
typedef struct {
    int64_t first_token, first_item, part; /* part: the unit's partials, in floats */
    int32_t tokens, chunks;                /* chunks: 0 for a tile */
} attend_unit;

/* Partial floats of the attention's chunked units for `T` tokens. */
static int64_t attend_part_floats(const nls_model *m, int64_t T) {
    return T * m->num_heads * (int64_t)ATTEND_MAX_CHUNKS * (m->head_dim + 2);
}

/* The step's units (at most T + 1 with the sentinel) -> how many; units[count].first_item is
 * the number of items. */
static int64_t attend_units(const nls_model *m, const int64_t *positions, const int64_t *seq_of_token, int64_t T,
                            attend_unit *units) {
    const int group = m->num_heads / m->num_kv_heads;
    const int64_t rows_part = (int64_t)m->num_heads * (m->head_dim + 2);
    int64_t count = 0, items = 0, part = 0;
    for (int64_t t = 0; t < T;) {
        int64_t end = t + 1;
        while (end < T && seq_of_token[end] == seq_of_token[t] && positions[end] == positions[end - 1] + 1) end++;
        const int tiled = end - t >= SPAN_TILE_MIN_RUN;
        for (int64_t u = t; u < end;) {
            int64_t n = 1;
            if (tiled)
                n = end - u < span_tile_tokens(group) ? end - u : span_tile_tokens(group);
            else /* one unit while the tokens' keys split alike */
                while (u + n < end && attend_chunk_keys(positions[u + n] + 1) == attend_chunk_keys(positions[u] + 1)) n++;
            const int32_t chunks = tiled ? 0 : (int32_t)attend_chunks(positions[u + n - 1] + 1);
            units[count++] = (attend_unit){u, items, part, (int32_t)n, chunks};
            items += tiled ? m->num_kv_heads : chunks;
            part += tiled ? 0 : n * chunks * rows_part;
            u += n;
        }
        t = end;
    }
    units[count] = (attend_unit){T, items, part, 0, 0};
    return count;
}

/* The K and V rows of keys [k0, k1) of one sequence (every KV head: a token's rows are
 * contiguous), asked of memory before a work item reads them. A batch's K/V do not fit in the
 * caches (64 sequences of ~190 keys: 566 MB a step) and the attention loops alone pulled
 * them at a third of the memory's bandwidth: with this, that run's attention took 5.6 s
 * instead of 7.9-8.4 (stop 34). */
static void prefetch_keys(const nls_model *m, const nls_layer *L, const int64_t *table, int64_t k0, int64_t k1) {
    const int64_t row_bytes = (int64_t)m->num_kv_heads * m->head_dim * kv_element_bytes(m->kv_dtype);
    for (int64_t t0 = k0; t0 < k1;) {
        const int64_t in_block = m->block_size - t0 % m->block_size;
        const int64_t n = k1 - t0 < in_block ? k1 - t0 : in_block;
        const int64_t first = table[t0 / m->block_size] * m->block_size + t0 % m->block_size;
        const char *kb = (const char *)L->k_cache + first * row_bytes, *vb = (const char *)L->v_cache + first * row_bytes;
        for (int64_t off = 0; off < n * row_bytes; off += 64) {
            _mm_prefetch(kb + off, _MM_HINT_T0);
            _mm_prefetch(vb + off, _MM_HINT_T1);
        }
        t0 += n;
    }
}

static int64_t thread_scratch_bytes(const nls_model *m, int64_t num_tokens) {
    const int64_t floats = 32 * num_tokens + thread_scores_floats(m) + 8 * (int64_t)m->head_dim;
    return round_up_64(floats * (int64_t)sizeof(float));
}

/* The AMX kernel's room (its split activations and weight tiles) when the step's rows use it. */
static int64_t amx_scratch_bytes(int64_t widest, int64_t num_tokens, int num_threads) {
#if NLS_HAS_AMX
    if (num_tokens >= AMX_STEP_MIN_ROWS) return 64 + round_up_64(nls_amx_workspace_bytes(widest, num_tokens, num_threads));
#endif
    (void)widest, (void)num_tokens, (void)num_threads;
    return 0;
}

/* Bytes of scratch memory `nls_decode_step` needs for `num_tokens` tokens on `num_threads`
 * threads (0 for a count it cannot run). */
int64_t nls_decode_scratch_bytes(const nls_model *m, int64_t num_tokens, int num_threads) {
    if (num_tokens < 1 || num_threads < 1 || m->num_kv_heads < 1) return 0;
    const int64_t T = num_tokens;
    const int64_t q = (int64_t)m->num_heads * m->head_dim, kv = (int64_t)m->num_kv_heads * m->head_dim;
    const int64_t widest = widest_input(m);
    const int64_t floats = T * (2 * (int64_t)m->hidden          /* residual stream, normed input */
                                + q + 2 * kv                    /* q, k, v */
                                + q                             /* attention output */
                                + 2 * (int64_t)m->intermediate  /* gate, up */
                                + m->intermediate               /* activation */
                                + m->hidden                     /* projection output */
                                + 2 * (widest / QK));           /* activation block scales and sums */
    return 64 +
           round_up_64(floats * (int64_t)sizeof(float) + T * widest * (int64_t)sizeof(int16_t)) +
           round_up_64((T + 1) * (int64_t)sizeof(attend_unit)) +
           round_up_64(attend_part_floats(m, T) * (int64_t)sizeof(float)) +
           (int64_t)num_threads * thread_scratch_bytes(m, T) + amx_scratch_bytes(widest, T, num_threads);
}

/* RMSNorm of row t of x[T, n] into out, then its int16 blocks into row t of the quantized
 * activations (row stride n). */
static void norm_and_quantize(const float *x, const float *weight, int64_t t, int n, float eps, float *out,
                              int16_t *xq, float *dx, float *sx) {
    rms_norm(x + t * n, weight, n, eps, out + t * n);
    quantize_row(out + t * n, n, xq + t * n, dx + t * (n / QK), sx + t * (n / QK));
}

/* Where a step's time goes, when asked (`nls_decode_profile`): the calling thread's wall time
 * between the step's barriers, summed per phase over steps. Off, it costs a branch a phase. */
enum { PHASE_OTHER, PHASE_QKV, PHASE_ROPE_KV, PHASE_ATTENTION, PHASE_O, PHASE_GATE_UP, PHASE_DOWN, PHASE_LM_HEAD, NLS_PHASES };
static double phase_seconds[NLS_PHASES];
static int profiling;

#define PHASE(k)                                            \
    do {                                                    \
        if (profiling) {                                    \
            _Pragma("omp master") {                         \
                const double now_ = omp_get_wtime();        \
                phase_seconds[k] += now_ - mark;            \
                mark = now_;                                \
            }                                               \
        }                                                   \
    } while (0)

/* Turns the per-phase timing of nls_decode_step on (enable != 0) or off, copies the seconds
 * summed since the last call into `seconds` ([NLS_PHASES] in the enum's order, or NULL) and
 * resets them. One engine thread calls the step, so the sums need no lock. */
void nls_decode_profile(int enable, double *seconds) {
    for (int k = 0; k < NLS_PHASES; k++) {
        if (seconds) seconds[k] = phase_seconds[k];
        phase_seconds[k] = 0.0;
    }
    profiling = enable != 0;
}

/* The forward pass of one step's `num_tokens` tokens, from one or several sequences: token t
 * is `tokens[t]` at position `positions[t]` of sequence `seq_of_token[t]`, whose K/V live in
 * the blocks of row seq_of_token[t] of `block_tables` ([num_seqs, table_width]). Every
 * token's K/V is written at its position first; then token t attends to its sequence's
 * positions <= positions[t] (earlier steps' keys and this step's). A sequence's tokens in one
 * step are a single-stream decode step (one token), a speculative verify step (the last token
 * and its drafts) or a short prefill chunk; a batched decode step is one token from each of
 * several sequences. -> `out`: one row for each of the `num_logits` tokens `logit_rows[r]`,
 * the logits [vocab] or, with no lm_head, the final normed hidden state [hidden].
 * `scratch`: nls_decode_scratch_bytes(m, num_tokens, num_threads) bytes. Returns 0, or before
 * touching anything NLS_BAD_SHAPE (a count, a sequence index, a logit row or scratch it cannot
 * run), NLS_BAD_POSITION (a position not in [0, max_context) or beyond the table),
 * NLS_BAD_TOKEN (not in [0, vocab)) or NLS_BAD_BLOCK (a block id a token uses is not in
 * [0, num_blocks)); NLS_BAD_SHAPE also for a kv_dtype it cannot read (or int8 without the
 * scales). */
int nls_decode_step(const nls_model *m, const int64_t *tokens, const int64_t *positions,
                    const int64_t *seq_of_token, int64_t num_tokens, const int64_t *block_tables,
                    int64_t num_seqs, int64_t table_width, const int64_t *logit_rows, int64_t num_logits,
                    void *scratch, int64_t scratch_bytes, float *out, int num_threads) {
    const int64_t T = num_tokens;
    if (T < 1 || num_seqs < 1 || table_width < 1 || num_logits < 0 || num_logits > T || num_threads < 1 ||
        scratch == NULL || scratch_bytes < nls_decode_scratch_bytes(m, T, num_threads))
        return NLS_BAD_SHAPE;
    for (int64_t r = 0; r < num_logits; r++)
        if (logit_rows[r] < 0 || logit_rows[r] >= T) return NLS_BAD_SHAPE;
    if (m->kv_dtype != NLS_KV_F32 && m->kv_dtype != NLS_KV_F16 && m->kv_dtype != NLS_KV_INT8) return NLS_BAD_SHAPE;
    if (!embed_kind_ok(m->embed_kind, m->hidden)) return NLS_BAD_SHAPE;
    if (m->activation != NLS_ACT_SILU && m->activation != NLS_ACT_GELU_TANH) return NLS_BAD_SHAPE;
    for (int l = 0; l < m->num_layers; l++)
        if (m->layers[l].window < 0 || (m->layers[l].attn_out_norm == NULL) != (m->layers[l].mlp_out_norm == NULL))
            return NLS_BAD_SHAPE;
    for (int l = 0; l < m->num_layers && m->kv_dtype == NLS_KV_INT8; l++)
        if (m->layers[l].k_scale == NULL || m->layers[l].v_scale == NULL) return NLS_BAD_SHAPE;
    for (int64_t t = 0; t < T; t++) {
        if (seq_of_token[t] < 0 || seq_of_token[t] >= num_seqs) return NLS_BAD_SHAPE;
        if (positions[t] < 0 || positions[t] >= m->max_context || positions[t] / m->block_size >= table_width)
            return NLS_BAD_POSITION;
        if (tokens[t] < 0 || tokens[t] >= m->vocab) return NLS_BAD_TOKEN;
        const int64_t *table = block_tables + seq_of_token[t] * table_width;
        for (int64_t b = 0; b <= positions[t] / m->block_size; b++)
            if (table[b] < 0 || table[b] >= m->num_blocks) return NLS_BAD_BLOCK;
    }
    const int H = m->hidden, I = m->intermediate, hd = m->head_dim;
    const int nh = m->num_heads, kvh = m->num_kv_heads, q_size = nh * hd, kv_size = kvh * hd;
    const int qkv_size = q_size + 2 * kv_size, group = nh / kvh;
    const int64_t widest = widest_input(m);
    float *h = (float *)(((uintptr_t)scratch + 63) / 64 * 64);
    float *xn = h + T * H, *qkv = xn + T * H, *attn = qkv + T * qkv_size;
    float *gate_up = attn + T * q_size, *act = gate_up + T * 2 * I, *proj = act + T * I;
    float *dx = proj + T * H, *sx = dx + T * (widest / QK);
    int16_t *xq = (int16_t *)(sx + T * (widest / QK));
    attend_unit *units = (attend_unit *)((uint8_t *)h + round_up_64((int64_t)((uint8_t *)(xq + T * widest) - (uint8_t *)h)));
    float *parts = (float *)((uint8_t *)units + round_up_64((T + 1) * (int64_t)sizeof(attend_unit)));
    uint8_t *per_thread = (uint8_t *)parts + round_up_64(attend_part_floats(m, T) * (int64_t)sizeof(float));
    uint8_t *amx = amx_scratch_bytes(widest, T, num_threads)
                       ? per_thread + (int64_t)num_threads * thread_scratch_bytes(m, T)
                       : NULL;

    double mark = profiling ? omp_get_wtime() : 0.0;
    const int64_t num_units = attend_units(m, positions, seq_of_token, T, units);
    const int64_t num_items = units[num_units].first_item;
    for (int64_t t = 0; t < T; t++) {
        embed_row(m, tokens[t], h + t * H);
        if (m->embed_scale != 1.0f) /* Gemma's sqrt(hidden), after the lookup as PyTorch does */
            for (int i = 0; i < H; i++) h[t * H + i] *= m->embed_scale;
    }
#pragma omp parallel num_threads(num_threads)
    {
        float *own = (float *)(per_thread + (int64_t)omp_get_thread_num() * thread_scratch_bytes(m, T));
        float *acc = own, *scores = own + 32 * T, *kt = scores + thread_scores_floats(m);
        for (int l = 0; l < m->num_layers; l++) {
            const nls_layer *L = &m->layers[l];
            const nls_kv_cache kv = {L->k_cache, L->v_cache, L->k_scale, L->v_scale, m->kv_dtype};
            const float *rope = L->rope ? L->rope : m->rope; /* a sliding layer's own base (Gemma 3) */
            const int64_t window = L->window;
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) norm_and_quantize(h, L->input_norm, t, H, m->eps, xn, xq, dx, sx);
            PHASE(PHASE_OTHER);
            matmul_shared(L->qkv_kind, L->qkv, qkv_size, H, xq, dx, sx, T, false, acc, qkv, amx);
            PHASE(PHASE_QKV);
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) {
                float *q = qkv + t * qkv_size, *k = q + q_size, *v = k + kv_size;
                const int64_t p = positions[t];
                const float *cos_sin = rope + p * hd;
                if (L->qkv_bias)
                    for (int i = 0; i < qkv_size; i++) q[i] += L->qkv_bias[i];
                for (int head = 0; head < nh + kvh; head++) {
                    float *x = head < nh ? q + head * hd : k + (head - nh) * hd;
                    const float *norm = head < nh ? L->q_norm : L->k_norm;
                    if (norm) rms_norm(x, norm, hd, m->eps, x);
                    rope_head(x, cos_sin, hd);
                }
                const int64_t *table = block_tables + seq_of_token[t] * table_width;
                store_kv(m, L, table[p / m->block_size] * m->block_size + p % m->block_size, k, v);
            }
            PHASE(PHASE_ROPE_KV);
            /* every token's K/V is in the cache (the loop's barrier): token t sees keys <= its own;
             * the items' lengths differ, hence dynamic */
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < num_items; item++) {
                int64_t lo = 0, hi = num_units - 1; /* the unit holding the item */
                while (lo < hi) {
                    const int64_t mid = (lo + hi + 1) / 2;
                    if (units[mid].first_item <= item) lo = mid;
                    else hi = mid - 1;
                }
                const attend_unit *u = &units[lo];
                const int64_t t = u->first_token, k = item - u->first_item;
                const int64_t *table = block_tables + seq_of_token[t] * table_width;
                if (u->chunks == 0) {
                    const int64_t head = (int64_t)k * group * hd;
                    nls_attend_span(qkv + t * qkv_size + head, qkv_size, &kv, kvh, (int)k, group, hd, m->block_size,
                                    m->attn_scale, table, positions[t], u->tokens, window, scores, kt,
                                    attn + t * q_size + head, q_size);
                    continue;
                }
                /* a chunk of keys for every KV head: each token's K/V row of all heads is one
                 * contiguous read */
                const int64_t rows = (int64_t)u->tokens * group;
                const int64_t keys = attend_chunk_keys(positions[t] + 1), ctx = positions[t] + u->tokens;
                const int64_t k1 = (k + 1) * keys < ctx ? (k + 1) * keys : ctx;
                /* a sliding layer's keys before the unit's first window are not read */
                const int64_t k0 = window && positions[t] + 1 - window > k * keys ? positions[t] + 1 - window : k * keys;
                prefetch_keys(m, L, table, k0, k1);
                for (int g = 0; g < kvh; g++)
                    nls_attend_chunk(qkv + t * qkv_size + (int64_t)g * group * hd, qkv_size, &kv, kvh, g, group, hd,
                                     m->block_size, m->attn_scale, table, positions[t], u->tokens, k * keys, k1, window,
                                     scores, parts + u->part + (g * u->chunks + k) * rows * (hd + 2));
            }
            /* each chunked row's partials -> its output */
#pragma omp for schedule(static)
            for (int64_t x = 0; x < num_units * kvh; x++) {
                const attend_unit *u = &units[x / kvh];
                const int g = (int)(x % kvh);
                if (u->chunks == 0) continue;
                const int64_t rows = (int64_t)u->tokens * group;
                for (int64_t r = 0; r < rows; r++)
                    nls_merge_chunks(parts + u->part + (g * u->chunks * rows + r) * (hd + 2), rows * (hd + 2),
                                     u->chunks, hd,
                                     attn + (u->first_token + r / group) * q_size + ((int64_t)g * group + r % group) * hd);
            }
            PHASE(PHASE_ATTENTION);
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++)
                quantize_row(attn + t * q_size, q_size, xq + t * q_size, dx + t * (q_size / QK), sx + t * (q_size / QK));
            PHASE(PHASE_OTHER);
            matmul_shared(L->o_kind, L->o, H, q_size, xq, dx, sx, T, false, acc, proj, amx);
            PHASE(PHASE_O);
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) {
                float *ht = h + t * H, *pt = proj + t * H;
                if (L->attn_out_norm) { /* sandwich: the attention output normalized, then added */
                    if (L->o_bias)
                        for (int i = 0; i < H; i++) pt[i] += L->o_bias[i];
                    rms_norm(pt, L->attn_out_norm, H, m->eps, pt);
                    for (int i = 0; i < H; i++) ht[i] += pt[i];
                } else {
                    for (int i = 0; i < H; i++) ht[i] += pt[i] + (L->o_bias ? L->o_bias[i] : 0.0f);
                }
                norm_and_quantize(h, L->post_norm, t, H, m->eps, xn, xq, dx, sx);
            }
            PHASE(PHASE_OTHER);
            matmul_shared(L->gate_up_kind, L->gate_up, 2 * (int64_t)I, H, xq, dx, sx, T, false, acc, gate_up, amx);
            PHASE(PHASE_GATE_UP);
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) {
                if (L->gate_up_bias)
                    for (int i = 0; i < 2 * I; i++) gate_up[t * 2 * I + i] += L->gate_up_bias[i];
                if (m->activation == NLS_ACT_GELU_TANH) gelu_tanh_and_mul(gate_up + t * 2 * I, I, act + t * I);
                else silu_and_mul(gate_up + t * 2 * I, I, act + t * I);
                quantize_row(act + t * I, I, xq + t * I, dx + t * (I / QK), sx + t * (I / QK));
            }
            PHASE(PHASE_OTHER);
            matmul_shared(L->down_kind, L->down, H, I, xq, dx, sx, T, false, acc, proj, amx);
            PHASE(PHASE_DOWN);
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) {
                if (L->mlp_out_norm) { /* sandwich: the MLP output normalized, then added */
                    float *pt = proj + t * H;
                    if (L->down_bias)
                        for (int i = 0; i < H; i++) pt[i] += L->down_bias[i];
                    rms_norm(pt, L->mlp_out_norm, H, m->eps, pt);
                    for (int i = 0; i < H; i++) h[t * H + i] += pt[i];
                } else if (L->down_bias)
                    for (int i = 0; i < H; i++) h[t * H + i] += proj[t * H + i] + L->down_bias[i];
                else
                    for (int i = 0; i < H; i++) h[t * H + i] += proj[t * H + i];
            }
        }
        /* the final norm of the rows that give logits, as rows 0.. of xn and xq */
#pragma omp for schedule(static)
        for (int64_t r = 0; r < num_logits; r++) {
            float *row = m->lm_head_kind ? xn : out;
            rms_norm(h + logit_rows[r] * H, m->final_norm, H, m->eps, row + r * H);
            if (m->lm_head_kind) quantize_row(xn + r * H, H, xq + r * H, dx + r * (H / QK), sx + r * (H / QK));
        }
        PHASE(PHASE_OTHER);
        if (m->lm_head_kind && num_logits > 0)
            matmul_shared(m->lm_head_kind, m->lm_head, m->vocab, H, xq, dx, sx, num_logits, true, acc, out, amx);
        if (m->lm_head_kind && m->logit_softcap > 0.0f) { /* cap * tanh(logits / cap) (Gemma 2) */
            const float cap = m->logit_softcap;
#pragma omp for schedule(static)
            for (int64_t i = 0; i < num_logits * (int64_t)m->vocab; i++) out[i] = cap * tanhf(out[i] / cap);
        }
        PHASE(PHASE_LM_HEAD); /* after the product's barrier */
    }
    return 0;
}

/* ------------------------------------------------ public: the ABI Python checks at load -- */

#include <stddef.h>

typedef struct {
    const char *name;
    int64_t value;
} nls_abi_entry;

#define ABI_CONSTANT(name) {#name, (int64_t)(name)}
#define ABI_OFFSET(type, field) {#type "." #field, (int64_t)offsetof(type, field)}

/* The constants, statuses and structure layouts native/ops.py mirrors: up to `capacity`
 * (name, value) pairs into `names` / `values` (names are static strings); returns how many
 * there are. Python refuses a library whose numbers differ from its own. */
int64_t nls_abi_info(const char **names, int64_t *values, int64_t capacity) {
    const nls_abi_entry entries[] = {
        ABI_CONSTANT(QK), ABI_CONSTANT(TILE), ABI_CONSTANT(KIND_Q4), ABI_CONSTANT(KIND_Q8),
        ABI_CONSTANT(KIND_KQ4), ABI_CONSTANT(KIND_KQ8), ABI_CONSTANT(KQ_SUPER), ABI_CONSTANT(KQ_TWO_SC),
        ABI_CONSTANT(KQ_MIN),
        {"TILE_BLOCK_BYTES_Q4", tile_block_bytes(KIND_Q4)}, {"TILE_BLOCK_BYTES_Q8", tile_block_bytes(KIND_Q8)},
        ABI_CONSTANT(MAX_HEAD_DIM), ABI_CONSTANT(NLS_PHASES),
        ABI_CONSTANT(NLS_NO_MEMORY), ABI_CONSTANT(NLS_BAD_POSITION), ABI_CONSTANT(NLS_BAD_TOKEN),
        ABI_CONSTANT(NLS_BAD_BLOCK), ABI_CONSTANT(NLS_BAD_SHAPE), ABI_CONSTANT(NLS_KV_F32), ABI_CONSTANT(NLS_KV_INT8),
        ABI_CONSTANT(NLS_KV_F16), ABI_CONSTANT(NLS_ACT_SILU), ABI_CONSTANT(NLS_ACT_GELU_TANH),
        {"sizeof(nls_layer)", (int64_t)sizeof(nls_layer)},
        ABI_OFFSET(nls_layer, qkv_kind), ABI_OFFSET(nls_layer, o_kind), ABI_OFFSET(nls_layer, gate_up_kind),
        ABI_OFFSET(nls_layer, down_kind), ABI_OFFSET(nls_layer, qkv), ABI_OFFSET(nls_layer, o),
        ABI_OFFSET(nls_layer, gate_up), ABI_OFFSET(nls_layer, down), ABI_OFFSET(nls_layer, qkv_bias),
        ABI_OFFSET(nls_layer, o_bias), ABI_OFFSET(nls_layer, gate_up_bias), ABI_OFFSET(nls_layer, down_bias),
        ABI_OFFSET(nls_layer, input_norm), ABI_OFFSET(nls_layer, post_norm),
        ABI_OFFSET(nls_layer, q_norm), ABI_OFFSET(nls_layer, k_norm), ABI_OFFSET(nls_layer, k_cache),
        ABI_OFFSET(nls_layer, v_cache), ABI_OFFSET(nls_layer, k_scale), ABI_OFFSET(nls_layer, v_scale),
        ABI_OFFSET(nls_layer, attn_out_norm), ABI_OFFSET(nls_layer, mlp_out_norm), ABI_OFFSET(nls_layer, rope),
        ABI_OFFSET(nls_layer, window), ABI_OFFSET(nls_layer, reserved),
        {"sizeof(nls_model)", (int64_t)sizeof(nls_model)},
        ABI_OFFSET(nls_model, hidden), ABI_OFFSET(nls_model, intermediate), ABI_OFFSET(nls_model, num_heads),
        ABI_OFFSET(nls_model, num_kv_heads), ABI_OFFSET(nls_model, head_dim), ABI_OFFSET(nls_model, num_layers),
        ABI_OFFSET(nls_model, vocab), ABI_OFFSET(nls_model, block_size), ABI_OFFSET(nls_model, lm_head_kind),
        ABI_OFFSET(nls_model, max_context), ABI_OFFSET(nls_model, num_blocks), ABI_OFFSET(nls_model, kv_dtype),
        ABI_OFFSET(nls_model, embed_kind), ABI_OFFSET(nls_model, activation), ABI_OFFSET(nls_model, eps),
        ABI_OFFSET(nls_model, attn_scale), ABI_OFFSET(nls_model, embed_scale), ABI_OFFSET(nls_model, logit_softcap), ABI_OFFSET(nls_model, embed), ABI_OFFSET(nls_model, final_norm),
        ABI_OFFSET(nls_model, rope), ABI_OFFSET(nls_model, lm_head), ABI_OFFSET(nls_model, layers),
    };
    const int64_t count = (int64_t)(sizeof entries / sizeof entries[0]);
    for (int64_t i = 0; i < count && i < capacity; i++) {
        names[i] = entries[i].name;
        values[i] = entries[i].value;
    }
    return count;
}
