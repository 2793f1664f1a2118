/* Matrix products with weights in the GGUF file's K-quant and 5-bit blocks (Q4_K, Q5_K, Q6_K,
 * Q5_0, Q5_1), `y[M, out] = x[M, in] @ W^T`, built into the native library with gguf_cpu.c
 * (nanollmserve/native/build.py) and called through native/ops.py (`kquant_matmul`).
 *
 * Every one of these types stands for its weights, per block of 32 inputs and per output, as
 *     w = d * sc_h * (q - off) + dm * mn
 * with q an unsigned 4-, 5- or 6-bit code, sc_h a small integer scale of the block's first or
 * second 16 inputs (h), d and dm float16 and mn a small unsigned integer (model/gguf_kquants.py
 * takes the file's bytes apart into exactly these numbers, no rounding):
 *     Q4_K, Q5_K: d, sc = the super-block's d and the 32-block's 6-bit scale, dm = -dmin,
 *                 mn = the 32-block's 6-bit min, off 0;
 *     Q6_K:       d, sc = the super-block's d and the 16-block's int8 scale, off 32, no m;
 *     Q5_0:       d, sc 1, off 16, no m;            Q5_1: d, sc 1, m = dm, mn 1, off 0.
 * So one kernel runs them all (`bits` of the widest code, `off` per output), with the
 * activations of today's block kernels (gguf_cpu.c): each row quantized per block of 32 to
 * int16 with one float scale dx and its exact sum sx. The kinds of at most 6-bit codes take
 * those rows on to int8 in kquant_int8_cpu.c, llama.cpp's arithmetic: per 256 inputs for the
 * super-block kinds (KQ_SUPER below: every part Q4_K, Q5_K or Q6_K; its Q8_K, decision 46) and
 * per 32 for the others (Q5_0, Q5_1 and their fusions; its Q8_0 / Q8_1, decision 47). What
 * follows is the int16 kernel the 7- and 8-bit kinds run (fusions with a legacy Q8_0 part),
 * and any kind where the int8 rows' buffer cannot be allocated.
 * A block's product for output o is dx (S_0 d sc_0 + S_1 d sc_1) + dm mn sx, with
 * S_h = sum (q - off) xq over the block's half h (inputs 16 h .. 16 h + 15), an integer exact
 * in int32 (|S_h| <= 255 * 32767 * 16 < 2^31); d sc_h is exact in float (11 times 8 bits), so
 * the roundings are: each S_h to float (exact below 2^24, as every type's own codes give),
 * S_0 d sc_0, then the fused multiply-adds t = fma(S_1, d sc_1, S_0 d sc_0),
 * acc = fma(t, dx, acc) and acc = fma(dm mn, sx, acc) (dm mn rounded once). The sub-scales
 * never meet the codes: the vector kernels widen the codes to int16 and take S_h either from
 * the codes less their offset (all rows of a tile-block share the subtraction) or, for one or
 * two rows, from the raw codes as A_h - off X_h (X_h: the row's sum of xq over the half,
 * `kq_half_sums`), skipping the 16 subtractions a block for the integers; the same integers,
 * then the same float steps, so a row's numbers do not depend on how many rows ran with it.
 * The C twin sums S_h the same way and the float steps in plain C (maybe not fused).
 *
 * Weights are tiled as today's: 16 outputs at a time, each tile's blocks of 32 inputs in order.
 * A weight's kind (native.h) is KIND_KQ4 + (bits - 4) + 8 * layout, the layout's flags chosen
 * per weight from its parts' types (model/gguf_kquants.py, `kquant_layout`), so that what is
 * constant is stored once and what varies per block of 32 is kept:
 *   KQ_SUPER   every part a K-quant (d, dm per 256 inputs): a header per 8 tile-blocks (a tile's
 *              super-block), else (a Q5_0 / Q5_1 / legacy part: d per 32) one per tile-block;
 *   KQ_TWO_SC  a Q6_K part (a sub-scale per 16 inputs): two sub-scale rows, else one row serving
 *              both halves (sc_1 = sc_0: the same numbers the kernel multiplied before);
 *   KQ_MIN     a part with a min (Q4_K, Q5_K, Q5_1, Q4_1): dm and mn stored, else neither (read
 *              as zeros, dm mn = +0 as the stored zeros gave).
 * A tile is nb / G groups (G = 8 with KQ_SUPER, else 1; nb % G == 0) of a header then G
 * tile-blocks:
 *   header     d[16] float16; dm[16] float16 (KQ_MIN); off[16] uint8: output o's code offset;
 *              with KQ_SUPER zeros to a multiple of 32 bytes (64 or 96), so that the codes of
 *              Q4_K, Q5_K and Q6_K tile-blocks (288, 352, 416 bytes) stay 32-byte aligned
 *              (measured: the 32-row AVX-512 products 1.08x the old layout's time unpadded,
 *              1.05x padded); the header first, where the stream reads it;
 *   tile-block nib[256]   byte 32 g + 2 o + i: output o's code for input 2 g + i in its low
 *                         nibble and for input 16 + 2 g + i in its high one (low 4 bits of each
 *                         code; gguf_cpu.c's Q4);
 *              hi[bits-4][16] uint32: bit 2 o + i of word p is bit 4 + k of output o's code for
 *                         input 2 p + i (p < 8) or 16 + 2 (p - 8) + i: the lanes of the widened
 *                         pair p;
 *              sc[1 or 2][16] int8: sc[h][o] = output o's sub-scale of inputs 16 h .. 16 h + 15
 *                         (times d, in float, per output lane in registers);
 *              mn[16] uint8 (KQ_MIN).
 * `nls_kq_tile_block_bytes(kind)` is a tile-block with its share of the header: 300 bytes per
 * 512 weights for Q4_K (4.69 bits a weight; the file 4.5; the layout before this one 6.0),
 * Q5_K 364 (5.69; 5.5), Q6_K 424 (6.63; 6.56), Q5_0 384 (6.0; 5.5), Q5_1 432 (6.75; 6.0), a
 * Q4_K + Q6_K weight 444 (6.94). The numbers the kernels multiply are the same as before, so
 * are their outputs, bit for bit.
 * The offset is per output so that one weight may fuse rows of different types (a Q4_K_M
 * file's Q4_K attn_q and Q6_K attn_v), the codes at the widest part's bits.
 * Three ISA levels: plain C (`nls_kq_matmul_ref`, the reference twin the vector kernels are
 * tested against, every build has it), AVX2 and AVX-512 VNNI (`nls_kq_matmul`, by the build's
 * flags, as gguf_cpu.c picks its inner loop).
 */

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "kquant_layout.h"
#include "native.h"

/* Bytes of a tile-block with its share of its header (so a tile of nb blocks is nb times
 * this: 8 x 48 and 8 x 80 header bytes divide by 8), or -1 for a kind not of this layout. */
int64_t nls_kq_tile_block_bytes(int kind) {
    kq_layout L;
    return kq_layout_of(kind, &L) ? L.block + (L.header >> L.shift) : -1;
}

/* One row of `n` floats (n % 32 == 0) -> int16 codes, a scale and the exact float sum per
 * block of 32: x ~= dx * qx, rounded to nearest even (gguf_cpu.c's quantize_row, in C). */
static void kq_quantize_row(const float *x, int64_t n, int16_t *qx, float *dx, float *sx) {
    for (int64_t b = 0; b < n / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.0f, sum = 0.0f;
        for (int j = 0; j < QK; j++) {
            amax = fmaxf(amax, fabsf(xb[j]));
            sum += xb[j];
        }
        const float id = amax > 0.0f ? 32767.0f / amax : 0.0f;
        for (int j = 0; j < QK; j++) qx[b * QK + j] = (int16_t)nearbyintf(xb[j] * id);
        dx[b] = amax / 32767.0f;
        sx[b] = sum;
    }
}

/* ------------------------------------------------------------ the reference twin (C) -- */

/* gguf_cpu.c's Q8 blocks (KIND_Q8) with int8 activations per block of 32 (decision 48), one
 * output and one row at a time: kquant_int8_cpu.c's twin from the same int16 rows. */
int nls_q8_matmul_ref(const uint8_t *w, int64_t out, int64_t in, const float *x, int64_t rows, float *y) {
    if (in <= 0 || in % QK || out < 0 || rows < 0) return NLS_BAD_SHAPE;
    const int64_t nb = in / QK;
    int16_t *xq = malloc(sizeof(int16_t) * (size_t)in);
    float *dx = malloc(sizeof(float) * (size_t)nb), *sx = malloc(sizeof(float) * (size_t)nb);
    int status = xq && dx && sx ? 0 : NLS_NO_MEMORY;
    for (int64_t r = 0; r < rows && !status; r++) {
        kq_quantize_row(x + r * in, in, xq, dx, sx);
        status = q8i8_ref_rows(w, out, in, xq, dx, 1, y + r * out);
    }
    free(xq), free(dx), free(sx);
    return status;
}

/* The same products as the vector kernels, one output and one row at a time. */
int nls_kq_matmul_ref(int kind, const uint8_t *w, int64_t out, int64_t in, const float *x,
                      int64_t rows, int int16, float *y) {
    kq_layout L;
    if (!kq_layout_of(kind, &L) || !kq_shape_ok(&L, in) || out < 0 || rows < 0) return NLS_BAD_SHAPE;
    const int64_t tb_bytes = nls_kq_tile_block_bytes(kind), nb = in / QK;
    int16_t *xq = malloc(sizeof(int16_t) * (size_t)in);
    float *dx = malloc(sizeof(float) * (size_t)nb), *sx = malloc(sizeof(float) * (size_t)nb);
    if (!xq || !dx || !sx) {
        free(xq), free(dx), free(sx);
        return NLS_NO_MEMORY;
    }
    for (int64_t r = 0; r < rows; r++) {
        kq_quantize_row(x + r * in, in, xq, dx, sx);
        if (!int16 && kq8_runs(&L)) { /* int8 per 256 or 32 (kquant_int8_cpu.c), from the same int16 row */
            const int status = kq8_ref_rows(&L, w, out, in, xq, dx, 1, y + r * out);
            if (status) {
                free(xq), free(dx), free(sx);
                return status;
            }
            continue;
        }
        for (int64_t o = 0; o < out; o++) {
            const uint8_t *tile = w + (o / TILE) * nb * tb_bytes;
            const int ot = (int)(o % TILE);
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const kq_block k = kq_block_at(&L, tile, b);
                int32_t s[2] = {0, 0};
                const int off = k.off[ot];
                for (int j = 0; j < QK; j++) s[j >= 16] += (kq_code(k.codes, L.bits, ot, j) - off) * xq[b * QK + j];
                const float d = half_to_float(k.d + 2 * ot), dm = half_to_float(k.dm + 2 * ot);
                const float t = (float)s[0] * (d * (float)(int8_t)k.sc0[ot]) + (float)s[1] * (d * (float)(int8_t)k.sc1[ot]);
                acc += t * dx[b] + dm * (float)k.mn[ot] * sx[b];
            }
            y[r * out + o] = acc;
        }
    }
    free(xq), free(dx), free(sx);
    return 0;
}

/* ------------------------------------------------------------------- vector kernels -- */

/* Each row's sums of its int16 codes over each half of each block, xs[2 (r nb + b) + h]:
 * what a block's raw-code products need to take the offset out, S_h = A_h - off X_h. */
static void kq_half_sums(const int16_t *xq, int64_t in, int64_t rows, int32_t *xs) {
    for (int64_t h = 0; h < rows * in / 16; h++) {
        int32_t s = 0;
        for (int j = 0; j < 16; j++) s += xq[16 * h + j];
        xs[h] = s;
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* A tile-block's codes as 16 vectors of 32 int16 lanes (lane 2 o + i: output o, input i of
 * pair p): raw, or less each output's offset when `sub_off`. */
static inline __attribute__((always_inline)) void kq_widen(const uint8_t *tb, int bits, const uint8_t *offs,
                                                           bool sub_off, __m512i w[16]) {
    const __m512i low = _mm512_set1_epi16(0x0F);
    for (int g = 0; g < 8; g++) {
        const __m512i c = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(tb + 32 * g)));
        w[g] = _mm512_and_si512(c, low);
        w[g + 8] = _mm512_srli_epi16(c, 4);
    }
    for (int k = 0; k < bits - 4; k++) {
        const uint32_t *hi = (const uint32_t *)(tb + 256 + 64 * k);
        const __m512i bit = _mm512_set1_epi16((int16_t)(16 << k));
        for (int p = 0; p < 16; p++) w[p] = _mm512_mask_add_epi16(w[p], hi[p], w[p], bit);
    }
    if (sub_off) {
        const __m128i off = _mm_loadu_si128((const __m128i *)offs); /* lane 2 o + i: off[o] */
        const __m512i offset = _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(off, off), _mm_unpacklo_epi8(off, off)));
        for (int p = 0; p < 16; p++) w[p] = _mm512_sub_epi16(w[p], offset);
    }
}

/* A tile-block's per-output numbers (lanes 0..15): d sc_0, d sc_1 (exact in float: an 11-bit
 * times an 8-bit integer), dm mn, and off. */
typedef struct {
    __m512 ds0, ds1, mw;
    __m512i off;
} kq_scales;

static inline __attribute__((always_inline)) kq_scales kq_block_scales(const kq_layout *L, const kq_block *k) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)k->d));
    kq_scales s;
    s.ds0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)k->sc0))));
    /* one sub-scale row: d sc_1 is d sc_0; no min: dm mn is +0 (the same numbers, not reloaded) */
    s.ds1 = L->sc1 == L->sc0 ? s.ds0
                             : _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)k->sc1))));
    s.mw = L->mn < 0 ? _mm512_setzero_ps()
                     : _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)k->dm)),
                                     _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)k->mn))));
    s.off = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)k->off));
    return s;
}

/* One row's block product added to its 16 sums `acc`: S_h = sum over half h of (q - off) xq,
 * exact in int32, from codes less their offset (`raw` false) or from raw codes and the half
 * sums `xs` (A_h - off X_h, `raw`), the same integers either way; then
 * acc + dx (S_0 d sc_0 + S_1 d sc_1) + dm mn sx in float. So a row's numbers do not depend
 * on which kernel (or how many rows) ran it. */
static inline __attribute__((always_inline)) __m512 kq_row_block(const __m512i w[16], const kq_scales *s, bool raw,
                                                                  const int32_t *xp, const int32_t *xs, float dxb,
                                                                  float sxb, __m512 acc) {
    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
    for (int p = 0; p < 8; p++) {
        a0 = _mm512_dpwssd_epi32(a0, w[p], _mm512_set1_epi32(xp[p]));
        a1 = _mm512_dpwssd_epi32(a1, w[p + 8], _mm512_set1_epi32(xp[p + 8]));
    }
    if (raw) {
        a0 = _mm512_sub_epi32(a0, _mm512_mullo_epi32(s->off, _mm512_set1_epi32(xs[0])));
        a1 = _mm512_sub_epi32(a1, _mm512_mullo_epi32(s->off, _mm512_set1_epi32(xs[1])));
    }
    const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1), s->ds1, _mm512_mul_ps(_mm512_cvtepi32_ps(a0), s->ds0));
    return _mm512_fmadd_ps(s->mw, _mm512_set1_ps(sxb), _mm512_fmadd_ps(t, _mm512_set1_ps(dxb), acc));
}

static void kq_tile_rows(const uint8_t *tile, int64_t nb, const kq_layout *L, int64_t in,
                         const int16_t *xq, const float *dx, const float *sx, int64_t rows, float *acc) {
    for (int64_t r = 0; r < rows; r++) _mm512_storeu_ps(acc + 16 * r, _mm512_setzero_ps());
    for (int64_t b = 0; b < nb; b++) {
        const kq_block k = kq_block_at(L, tile, b);
        _mm_prefetch((const char *)(k.codes + 2 * L->block), _MM_HINT_T0);
        __m512i w[16];
        kq_widen(k.codes, L->bits, k.off, true, w);
        const kq_scales s = kq_block_scales(L, &k);
        for (int64_t r = 0; r < rows; r++) {
            const int32_t *xp = (const int32_t *)(xq + r * in + b * QK);
            _mm512_storeu_ps(acc + 16 * r, kq_row_block(w, &s, false, xp, NULL, dx[r * nb + b], sx[r * nb + b],
                                                        _mm512_loadu_ps(acc + 16 * r)));
        }
    }
}

/* A few rows against one tile with every row's 16 sums in registers across the blocks (the
 * tile-block widened once per block for them all): each row through kq_row_block as in
 * kq_tile_rows, so the same numbers, without its accumulator loads and stores (gguf_cpu.c's
 * tile_times_few_rows does the same for the legacy kinds). `RAW` (up to KQ_RAW_ROWS rows,
 * `xs` given): the codes are not offset, each row takes the offset out of its two sums
 * instead (cheaper than 16 subtractions a block for one or two rows). `ROWS` and `RAW` are
 * compile-time constants at each call, so the row loops unroll. */
#define KQ_FEW_ROWS 5
#define KQ_RAW_ROWS 2
#define KQ_HAS_FEW_ROWS 1
static inline __attribute__((always_inline)) void kq_tile_few_rows(
    const uint8_t *tile, int64_t nb, const kq_layout *L, int64_t in, const int16_t *xq,
    const float *dx, const float *sx, const int32_t *xs, const int ROWS, const bool RAW, float *y, int64_t ldy,
    int valid) {
    __m512 acc[KQ_FEW_ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const kq_block k = kq_block_at(L, tile, b);
        _mm_prefetch((const char *)(k.codes + 2 * L->block), _MM_HINT_T0);
        __m512i w[16];
        kq_widen(k.codes, L->bits, k.off, !RAW, w);
        const kq_scales s = kq_block_scales(L, &k);
        for (int r = 0; r < ROWS; r++)
            acc[r] = kq_row_block(w, &s, RAW, (const int32_t *)(xq + r * in + b * QK), RAW ? xs + 2 * (r * nb + b) : NULL,
                                  dx[r * nb + b], sx[r * nb + b], acc[r]);
    }
    for (int r = 0; r < ROWS; r++) {
        float total[TILE];
        _mm512_storeu_ps(total, acc[r]);
        for (int j = 0; j < valid; j++) y[r * ldy + j] = total[j];
    }
}
#else
/* AVX2: outputs 0..7 and 8..15 of pair p in w[p][0] and w[p][1] (lanes 2 o' + i): raw, or
 * less each output's offset when `sub_off`. The higher bits go in while the codes are still
 * bytes (byte 16 h + 2 o' + i of row g <-> bit 16 h + 2 o' + i of the mask word of pair g or
 * g + 8): each byte tests its bit of the word broadcast (one shuffle, and, compare for 32
 * lanes), then the bytes widen. 4-bit codes that lose their offset here (the rows that share
 * the subtraction) widen per 16-byte half instead: the same codes, faster there (measured). */
static inline __attribute__((always_inline)) void kq_widen(const uint8_t *tb, int bits, const uint8_t *offs,
                                                           bool sub_off, __m256i w[16][2]) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                                            3, 3, 3, 3, 3, 3, 3, 3); /* byte j <- the word's byte j / 8 */
    const __m256i bit_of = _mm256_set1_epi64x((int64_t)0x8040201008040201); /* byte j: 1 << j % 8 */
    if (bits == 4 && sub_off) {
        for (int g = 0; g < 8; g++)
            for (int h = 0; h < 2; h++) {
                const __m128i c = _mm_loadu_si128((const __m128i *)(tb + 32 * g + 16 * h));
                w[g][h] = _mm256_cvtepu8_epi16(_mm_and_si128(c, _mm256_castsi256_si128(low)));
                w[g + 8][h] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(c, 4), _mm256_castsi256_si128(low)));
            }
    } else
    for (int g = 0; g < 8; g++) {
        const __m256i c = _mm256_loadu_si256((const __m256i *)(tb + 32 * g));
        __m256i q[2] = {_mm256_and_si256(c, low), _mm256_and_si256(_mm256_srli_epi16(c, 4), low)}; /* pairs g, g + 8 */
        for (int k = 0; k < bits - 4; k++) {
            const __m256i bit = _mm256_set1_epi8((char)(16 << k));
            for (int s = 0; s < 2; s++) {
                uint32_t word;
                memcpy(&word, tb + 256 + 64 * k + 4 * (g + 8 * s), sizeof word);
                const __m256i m = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)word), spread), bit_of);
                q[s] = _mm256_or_si256(q[s], _mm256_and_si256(_mm256_cmpeq_epi8(m, bit_of), bit));
            }
        }
        for (int s = 0; s < 2; s++) {
            w[g + 8 * s][0] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(q[s]));
            w[g + 8 * s][1] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(q[s], 1));
        }
    }
    if (sub_off) {
        const __m128i off = _mm_loadu_si128((const __m128i *)offs); /* lane 2 o' + i: off[8 h + o'] */
        const __m256i offsets[2] = {_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(off, off)),
                                    _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(off, off))};
        for (int p = 0; p < 16; p++)
            for (int h = 0; h < 2; h++) w[p][h] = _mm256_sub_epi16(w[p][h], offsets[h]);
    }
}

/* Each row through the same steps whatever `raw` (as the AVX-512 kq_row_block: S_h exact
 * in int32 from offset codes, or from raw codes less off X_h, then the same float sums).
 * `raw` (a constant at each call) for the few rows nls_kq_matmul_shared gives `xs`. */
static inline __attribute__((always_inline)) void kq_tile_rows_with(
    const uint8_t *tile, int64_t nb, const kq_layout *L, int64_t in, const int16_t *xq, const float *dx,
    const float *sx, const int32_t *xs, const bool raw, int64_t rows, float *acc) {
    memset(acc, 0, sizeof(float) * 16 * (size_t)rows);
    for (int64_t b = 0; b < nb; b++) {
        const kq_block k = kq_block_at(L, tile, b);
        _mm_prefetch((const char *)(k.codes + 2 * L->block), _MM_HINT_T0);
        __m256i w[16][2];
        kq_widen(k.codes, L->bits, k.off, !raw, w);
        __m256 ds0[2], ds1[2], mw[2];
        __m256i off[2];
        for (int h = 0; h < 2; h++) {
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(k.d + 16 * h)));
            ds0[h] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(k.sc0 + 8 * h)))));
            /* as the AVX-512 kq_block_scales: the same numbers without the rows a layout lacks */
            ds1[h] = L->sc1 == L->sc0 ? ds0[h]
                                      : _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(k.sc1 + 8 * h)))));
            mw[h] = L->mn < 0 ? _mm256_setzero_ps()
                              : _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(k.dm + 16 * h))),
                                              _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(k.mn + 8 * h)))));
            off[h] = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(k.off + 8 * h)));
        }
        for (int64_t r = 0; r < rows; r++) {
            const int32_t *xp = (const int32_t *)(xq + r * in + b * QK);
            for (int h = 0; h < 2; h++) {
                __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
                for (int p = 0; p < 8; p++) {
                    a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(w[p][h], _mm256_set1_epi32(xp[p])));
                    a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(w[p + 8][h], _mm256_set1_epi32(xp[p + 8])));
                }
                if (raw) {
                    const int32_t *x2 = xs + 2 * (r * nb + b);
                    a0 = _mm256_sub_epi32(a0, _mm256_mullo_epi32(off[h], _mm256_set1_epi32(x2[0])));
                    a1 = _mm256_sub_epi32(a1, _mm256_mullo_epi32(off[h], _mm256_set1_epi32(x2[1])));
                }
                const __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a1), ds1[h], _mm256_mul_ps(_mm256_cvtepi32_ps(a0), ds0[h]));
                float *a = acc + 16 * r + 8 * h;
                const __m256 y = _mm256_fmadd_ps(t, _mm256_set1_ps(dx[r * nb + b]), _mm256_loadu_ps(a));
                _mm256_storeu_ps(a, _mm256_fmadd_ps(mw[h], _mm256_set1_ps(sx[r * nb + b]), y));
            }
        }
    }
}

#define KQ_RAW_ROWS 2
static void kq_tile_rows(const uint8_t *tile, int64_t nb, const kq_layout *L, int64_t in,
                         const int16_t *xq, const float *dx, const float *sx, int64_t rows, float *acc) {
    kq_tile_rows_with(tile, nb, L, in, xq, dx, sx, NULL, false, rows, acc);
}

static void kq_tile_rows_raw(const uint8_t *tile, int64_t nb, const kq_layout *L, int64_t in,
                             const int16_t *xq, const float *dx, const float *sx, const int32_t *xs, int64_t rows,
                             float *acc) {
    kq_tile_rows_with(tile, nb, L, in, xq, dx, sx, xs, true, rows, acc);
}
#define KQ_HAS_FEW_ROWS 0
#endif

static inline int64_t kq_activation_bytes(int64_t in, int64_t rows) {
    return kq_round_up_64(rows * in * (int64_t)sizeof(int16_t) + 2 * rows * (in / QK) * (int64_t)sizeof(float));
}

/* Bytes of the workspace `nls_kq_matmul` needs for `rows` rows of `in` inputs on `num_threads`
 * threads: the quantized rows, then each thread's accumulators on their own cache lines. */
int64_t nls_kq_matmul_workspace_bytes(int64_t in, int64_t rows, int num_threads) {
    return 64 + kq_activation_bytes(in, rows) + (int64_t)num_threads * kq_round_up_64(16 * rows * (int64_t)sizeof(float));
}

/* Tile `t` against `rows` quantized rows -> y[r * out + t * 16 + j], j < the tile's valid
 * outputs: up to 2 * KQ_FEW_ROWS rows in register groups (AVX-512), more through `acc`
 * (16 floats a row); `xs` (the rows' half sums, or NULL) lets up to KQ_RAW_ROWS rows skip
 * the offset codes. */
static void kq_tile(const kq_layout *L, const uint8_t *w, int64_t t, int64_t out, int64_t in, const int16_t *xq,
                    const float *dx, const float *sx, const int32_t *xs, int64_t rows, float *acc, float *y) {
    const int64_t tb_bytes = L->block + (L->header >> L->shift), nb = in / QK;
    const uint8_t *tile = w + t * nb * tb_bytes;
    const int valid = out - t * TILE < TILE ? (int)(out - t * TILE) : TILE;
#if KQ_HAS_FEW_ROWS
    if (rows <= 2 * KQ_FEW_ROWS) {
        for (int64_t r0 = 0; r0 < rows;) {
            const int64_t left = rows - r0, group = left > KQ_FEW_ROWS ? (left + 1) / 2 : left;
            const int16_t *x = xq + r0 * in;
            const float *d = dx + r0 * nb, *s = sx + r0 * nb;
            const int32_t *h = xs ? xs + 2 * r0 * nb : NULL;
            float *yt = y + r0 * out + t * TILE;
            if (h && group <= KQ_RAW_ROWS) {
                if (group == 1) kq_tile_few_rows(tile, nb, L, in, x, d, s, h, 1, true, yt, out, valid);
                else kq_tile_few_rows(tile, nb, L, in, x, d, s, h, 2, true, yt, out, valid);
            } else {
                switch (group) {
                case 1: kq_tile_few_rows(tile, nb, L, in, x, d, s, NULL, 1, false, yt, out, valid); break;
                case 2: kq_tile_few_rows(tile, nb, L, in, x, d, s, NULL, 2, false, yt, out, valid); break;
                case 3: kq_tile_few_rows(tile, nb, L, in, x, d, s, NULL, 3, false, yt, out, valid); break;
                case 4: kq_tile_few_rows(tile, nb, L, in, x, d, s, NULL, 4, false, yt, out, valid); break;
                default: kq_tile_few_rows(tile, nb, L, in, x, d, s, NULL, 5, false, yt, out, valid); break;
                }
            }
            r0 += group;
        }
        return;
    }
#else
    if (xs && rows <= KQ_RAW_ROWS) kq_tile_rows_raw(tile, nb, L, in, xq, dx, sx, xs, rows, acc);
    else
#endif
    kq_tile_rows(tile, nb, L, in, xq, dx, sx, rows, acc);
    for (int64_t r = 0; r < rows; r++)
        for (int j = 0; j < valid; j++) y[r * out + t * TILE + j] = acc[16 * r + j];
}

/* The tiles shared among the threads of the enclosing parallel region (an orphaned
 * work-sharing loop, ending in a barrier). Up to KQ_RAW_ROWS rows, each thread first sums
 * the rows' halves for itself (a few microseconds; without memory it runs the offset codes,
 * the same numbers). */
void nls_kq_matmul_shared(int kind, const uint8_t *w, int64_t out, int64_t in, const int16_t *xq,
                          const float *dx, const float *sx, int64_t rows, int int16, float *acc, float *y) {
    kq_layout L;
    if (!kq_layout_of(kind, &L) || !kq_shape_ok(&L, in)) return; /* every thread alike: callers check */
    if (!int16 && kq8_runs(&L) && kq8_matmul_shared(&L, w, out, in, xq, dx, rows, acc, y)) return;
    const int64_t tiles = (out + TILE - 1) / TILE;
    int32_t *xs = rows <= KQ_RAW_ROWS ? malloc(sizeof(int32_t) * (size_t)(rows * in / 16)) : NULL;
    if (xs) kq_half_sums(xq, in, rows, xs);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) kq_tile(&L, w, t, out, in, xq, dx, sx, xs, rows, acc, y);
    free(xs);
}

/* y[M, out] = x[M, in] @ W^T with W tiled as above (`kind`: the codes' bits and the layout).
 * Returns 0, or NLS_BAD_SHAPE for a bad size, kind or workspace. */
int nls_kq_matmul(int kind, const uint8_t *w, int64_t out, int64_t in, const float *x, int64_t rows,
                  int int16, float *y, void *workspace, int64_t workspace_bytes, int num_threads) {
    kq_layout L;
    if (!kq_layout_of(kind, &L) || !kq_shape_ok(&L, in) || out < 0 || rows < 0 || num_threads < 1 ||
        workspace_bytes < nls_kq_matmul_workspace_bytes(in, rows, num_threads))
        return NLS_BAD_SHAPE;
    const int64_t nb = in / QK;
    uint8_t *base = (uint8_t *)(((uintptr_t)workspace + 63) / 64 * 64);
    int16_t *xq = (int16_t *)base;
    float *dx = (float *)(xq + rows * in), *sx = dx + rows * nb;
    uint8_t *accs = base + kq_activation_bytes(in, rows);
    const int64_t acc_bytes = kq_round_up_64(16 * rows * (int64_t)sizeof(float));
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) kq_quantize_row(x + r * in, in, xq + r * in, dx + r * nb, sx + r * nb);
        float *acc = (float *)(accs + (int64_t)omp_get_thread_num() * acc_bytes);
        nls_kq_matmul_shared(kind, w, out, in, xq, dx, sx, rows, int16, acc, y);
    }
    return 0;
}

/* ------------------------------------------------ one row dequantized (the embedding) -- */

/* Row `row` of W (of `kind`, the layout above) as floats: d * (sc_h (q - off)) + dm mn
 * per weight, the decode step's embedding lookup in a table of these types (gguf_cpu.c's
 * embed_row). sc_h (q - off) is an integer below 2^13 and d a float16, so the first product
 * is exact in float32, as is dm mn: the one rounding is the add, as in the gguf package's
 * dequantization of the file's blocks (the oracle), so the row is the dequantized table's. */
void nls_kq_dequant_row(int kind, const uint8_t *w, int64_t in, int64_t row, float *out) {
    kq_layout L;
    if (!kq_layout_of(kind, &L) || !kq_shape_ok(&L, in)) return; /* the step checks the table's kind */
    const int64_t tb_bytes = nls_kq_tile_block_bytes(kind), nb = in / QK;
    const uint8_t *tile = w + (row / TILE) * nb * tb_bytes;
    const int o = (int)(row % TILE);
    for (int64_t b = 0; b < nb; b++) {
        const kq_block k = kq_block_at(&L, tile, b);
        const int off = k.off[o];
        const float d = half_to_float(k.d + 2 * o);
        const float m = half_to_float(k.dm + 2 * o) * (float)k.mn[o];
        for (int j = 0; j < QK; j++) {
            const int sc = (int8_t)(j >= 16 ? k.sc1 : k.sc0)[o];
            out[b * QK + j] = d * (float)(sc * (kq_code(k.codes, L.bits, o, j) - off)) + m;
        }
    }
}
