/* Products with int8 activations: of the K-quant kinds whose codes are at most 6 bits, and of
 * gguf_cpu.c's Q8_0 blocks (KIND_Q8, decision 48; their section is at the end). The K-quants:
 * llama.cpp's arithmetic on the files made for it: per 256 inputs for the super-block kinds
 * (every part Q4_K, Q5_K or Q6_K: kquant_cpu.c's KQ_SUPER layout; llama.cpp's Q8_K, decision
 * 46), per 32 for the per-block kinds (Q5_0, Q5_1 and their fusions with K-quant parts; its
 * Q8_0 / Q8_1, decision 47). An activation group is what one weight header covers: G = 8
 * blocks of 32 (a super-block) or G = 1. kquant_cpu.c's `nls_kq_matmul_shared` hands these
 * kinds here; a kind with 7- or 8-bit codes (a fused legacy Q8_0 part) keeps its int16
 * kernel.
 *
 * Activations. Each row arrives as the decode step quantizes it: int16 codes per block of 32
 * with a scale dx (kquant_cpu.c's kq_quantize_row). Per activation group the row is
 * requantized from those numbers to int8:
 *     d8 = max |dx_b q| / 127,   q8 = round(dx_b q / d8) (to nearest even),
 * and X_bh, the sum of q8 over each half h of block b, is kept as an int16 pair. The PyTorch
 * path goes through the same int16 rows (`nls_kq_matmul`), so the forward and the step
 * compute the same numbers. A row's numbers depend only on that row, not on the batch it ran
 * in.
 *
 * Products. With w = d sc_h (q - off) + dm mn (kquant_cpu.c's header), a row's group product
 * for output o is
 *     d d8 (sum_b sum_h sc_bh A_bh - off sum_b sum_h sc_bh X_bh) + dm d8 sum_b mn_b X_b,
 * with A_bh = sum over half h of block b of q q8 (the raw codes, 0..63) and X_b = X_b0 + X_b1.
 * The offset term is kept where a part may have an offset (a Q6_K part's 32, Q5_0's 16: every
 * per-block kind), and the min term where a part has a min. Both take the int8 sums, as
 * llama.cpp's bsums and Q8_1 sums do, and not the exact float sums the int16 kernel uses. A
 * Q4_K weight is d sc q less a min of about the same size, so its products cancel. With the
 * exact sums on the min term and the rounded activations on the codes, the rounding does not
 * cancel. Measured on the bundled Q4_K_M file's Q4_K down projection: the product's error
 * went from 5.2e-2 to the int8 rounding's own 1.7e-2.
 * Every integer sum is exact in int32: |sc A| <= 128 * 63 * 127 * 16 per half, over 16
 * halves < 2^31, and |mn X| <= 63 * 127 * 32 a block. d, dm and off are constant over a group
 * in this layout. The float steps, per group:
 *     acc = fma(S, d d8, acc), then acc = fma(M, dm d8, acc),
 * with S and M the two integer sums. The C twin takes the same integers and the same float
 * steps (fmaf). Per block (G = 1) the float steps come after every 32 inputs, which is why
 * int8 per 32 gains less than per 256 (the probe: 1.2-1.4x against 1.6-1.7x on Q4_K).
 *
 * Kernels.
 * - AVX-512 VNNI: vpdpbusd multiplies 4 code bytes by 4 activation bytes per output lane. A
 *   tile-block's nibble bytes give each output's quads with one word permutation per 64 bytes,
 *   and the higher code bits go in per byte through a byte mask made by pdep (BMI2, which
 *   every AVX-512 CPU has; the build requires it). Rows run in register groups of up to 4,
 *   with the group size and the flags (two sub-scale rows; an offset; a min) constant at each
 *   call, so that the sums stay in registers.
 * - AVX2: vpmaddubsw and vpmaddwd. The same quads come from 16-bit unpacks, in the output
 *   order 0-3, 8-11 | 4-7, 12-15, set right once per group. A group is decoded once into an
 *   array, then each row runs its blocks with its sums in registers. vpmaddubsw adds pairs of
 *   products in int16, which holds for codes of at most 6 bits (4 * 63 * 127 < 2^15), hence
 *   the 7- and 8-bit kinds' int16 kernel.
 * Measured before it was taken (scripts/kquant_int8_probe.py at 3551471, docs/benchmarks.md
 * "int8 activations at the K-quant kernel"): Q4_K 1.56-1.72x the int16 kernel at 8-32 rows,
 * 1.3-1.6x at one row; Q6_K 1.2-1.5x. Per 32, measured after it was taken (docs/benchmarks.md
 * "int8 per 32 for Q5_0 and Q5_1"): Q5_0 1.2-1.5x at 8 and 32 rows on both ISA levels.
 */

#include <stdlib.h>

#include <omp.h>

#include "kquant_layout.h"
#include "native.h"


bool kq8_runs(const kq_layout *L) { return L->bits <= 6; }

/* Whether a part may have a code offset: Q6_K (two sub-scale rows) or any per-block kind
 * (Q5_0, Q4_0: off 16, 8); Q4_K and Q5_K have none. */
static inline bool kq8_has_off(const kq_layout *L) { return L->sc1 != L->sc0 || L->shift == 0; }

/* One activation group of a row (G blocks of 32 int16 codes with their dx: a super-block, or
 * one block) -> its int8 codes `q8`, their scale `*d8` and the int16 pairs of their half sums
 * `xs` (X_b0 low, X_b1 high) per block, in AVX2 (both builds have it), rounding to nearest
 * even. */
static void kq8_requantize(const int16_t *xq, const float *dx, int G, int8_t *q8, float *d8, int32_t *xs) {
    float amax = 0.0f;
    for (int b = 0; b < G; b++) {
        const __m256i m = _mm256_max_epi16(_mm256_abs_epi16(_mm256_loadu_si256((const __m256i *)(xq + b * QK))),
                                           _mm256_abs_epi16(_mm256_loadu_si256((const __m256i *)(xq + b * QK + 16))));
        __m128i v = _mm_max_epi16(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
        v = _mm_max_epi16(v, _mm_srli_si128(v, 8));
        v = _mm_max_epi16(v, _mm_srli_si128(v, 4));
        v = _mm_max_epi16(v, _mm_srli_si128(v, 2));
        amax = fmaxf(amax, dx[b] * (float)(int16_t)_mm_extract_epi16(v, 0)); /* |code| <= 32767 */
    }
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    *d8 = amax / 127.0f;
    const __m256i lim = _mm256_set1_epi32(127), order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int b = 0; b < G; b++) {
        const __m256 scale = _mm256_set1_ps(dx[b] * id);
        __m256i q[4];
        for (int g = 0; g < 4; g++) {
            const __m256i x = _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(xq + b * QK + 8 * g)));
            const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(x), scale),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q[g] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(r), lim), _mm256_sub_epi32(_mm256_setzero_si256(), lim));
        }
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(q8 + b * QK), _mm256_permutevar8x32_epi32(packed, order));
        int32_t h[2];
        for (int half = 0; half < 2; half++) {
            const __m256i s = _mm256_add_epi32(q[2 * half], q[2 * half + 1]);
            __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            t = _mm_add_epi32(t, _mm_srli_si128(t, 8));
            t = _mm_add_epi32(t, _mm_srli_si128(t, 4));
            h[half] = _mm_cvtsi128_si32(t);
        }
        xs[b] = (int32_t)(((uint32_t)(uint16_t)h[1] << 16) | (uint16_t)h[0]);
    }
}

static inline int kq8_half_sum(int32_t pair, int h) { return h ? (int16_t)((uint32_t)pair >> 16) : (int16_t)pair; }

/* The two higher-bit words (plane `p`) that cover quad k of half h: pairs 8 h + 2 k (low
 * 32 bits: inputs 16 h + 4 k, +1) and 8 h + 2 k + 1 (high: +2, +3). */
static inline uint64_t kq8_hi_words(const uint8_t *tb, int p, int h, int k) {
    const uint32_t *hi = (const uint32_t *)(tb + 256 + 64 * p);
    return hi[8 * h + 2 * k] | (uint64_t)hi[8 * h + 2 * k + 1] << 32;
}

/* ------------------------------------------------------------ the reference twin (C) -- */

int kq8_ref_rows(const kq_layout *L, const uint8_t *w, int64_t out, int64_t in, const int16_t *xq,
                 const float *dx, int64_t rows, float *y) {
    const int G = 1 << L->shift;
    const int64_t nb = in / QK, nsb = nb / G, tb_bytes = L->block + (L->header >> L->shift);
    int8_t *q8 = malloc((size_t)in);
    float *d8 = malloc(sizeof(float) * (size_t)nsb);
    int32_t *xs = malloc(sizeof(int32_t) * (size_t)nb);
    if (!q8 || !d8 || !xs) {
        free(q8), free(d8), free(xs);
        return NLS_NO_MEMORY;
    }
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t sb = 0; sb < nsb; sb++)
            kq8_requantize(xq + r * in + sb * G * QK, dx + r * nb + sb * G, G, q8 + sb * G * QK, d8 + sb, xs + sb * G);
        for (int64_t o = 0; o < out; o++) {
            const uint8_t *tile = w + (o / TILE) * nb * tb_bytes;
            const int ot = (int)(o % TILE);
            float acc = 0.0f;
            for (int64_t s = 0; s < nsb; s++) {
                int32_t sum = 0, corr = 0, mins = 0;
                const kq_block k0 = kq_block_at(L, tile, s * G);
                for (int64_t b = s * G; b < s * G + G; b++) {
                    const kq_block k = kq_block_at(L, tile, b);
                    for (int h = 0; h < 2; h++) {
                        int32_t a = 0;
                        for (int j = 16 * h; j < 16 * h + 16; j++) a += kq_code(k.codes, L->bits, ot, j) * q8[b * QK + j];
                        const int sc = (int8_t)(h ? k.sc1 : k.sc0)[ot];
                        sum += sc * a;
                        corr += sc * kq8_half_sum(xs[b], h);
                    }
                    mins += (int32_t)k.mn[ot] * (kq8_half_sum(xs[b], 0) + kq8_half_sum(xs[b], 1));
                }
                sum -= (int32_t)k0.off[ot] * corr;
                acc = fmaf((float)sum, half_to_float(k0.d + 2 * ot) * d8[s], acc);
                acc = fmaf((float)mins, half_to_float(k0.dm + 2 * ot) * d8[s], acc);
            }
            y[r * out + o] = acc;
        }
    }
    free(q8), free(d8), free(xs);
    return 0;
}

/* ------------------------------------------------------------------- vector kernels -- */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* A tile-block's codes as 8 vectors of 16 output lanes x 4 bytes: q[4 h + k] holds inputs
 * 16 h + 4 k .. 16 h + 4 k + 3 of each output, raw. Words o and 16 + o of a 64-byte load are
 * output o's inputs 4k, 4k + 1 (byte 32 g + 2 o + i, g = 2k) and 4k + 2, 4k + 3 (g = 2k + 1).
 * Higher bit p of output o, input 4k + j is bit 2 o + (j & 1) of hi word 8 h + 2 k + (j >> 1):
 * byte 4 o + j of the quad tests it in byte (j >> 1) 4 + o / 4 of the two words. */
static inline __attribute__((always_inline)) void kq8_decode(const uint8_t *tb, int bits, __m512i q[8]) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int k = 0; k < 4; k++) {
        const __m512i c = _mm512_permutexvar_epi16(idx, _mm512_loadu_si512((const void *)(tb + 64 * k)));
        q[k] = _mm512_and_si512(c, low);
        q[4 + k] = _mm512_and_si512(_mm512_srli_epi16(c, 4), low);
    }
    if (bits == 4) return;
    /* The byte mask of quad k: bit 4 o + j is bit 2 o + (j & 1) of word j >> 1, the two words'
     * bit pairs interleaved. pdep does that in the integer units; the vector shuffle and byte
     * test it replaced took two more vector ops a quad (docs/benchmarks.md "Fewer vector ops
     * in the int8 tile loop"). */
    for (int p = 0; p < bits - 4; p++) {
        const __m512i bit = _mm512_set1_epi8((char)(16 << p));
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < 4; k++) {
                const uint64_t w = kq8_hi_words(tb, p, h, k);
                const __mmask64 m = _pdep_u64(w, 0x3333333333333333ull) | _pdep_u64(w >> 32, 0xCCCCCCCCCCCCCCCCull);
                q[4 * h + k] = _mm512_mask_add_epi8(q[4 * h + k], m, q[4 * h + k], bit);
            }
    }
}

/* ROWS rows of one tile. G (blocks per activation scale: 8 or 1), TWO (a Q6_K part: two
 * sub-scale rows), OFF (a part with a code offset: kq8_has_off) and MIN (a part with a min) are
 * constants at each call, so every row's sums stay in registers. */
static inline __attribute__((always_inline)) void kq8_tile_rows(const uint8_t *tile, int64_t nb, const kq_layout *L,
                                                                int64_t in, const int8_t *xq, const float *d8,
                                                                const int32_t *xs, const int ROWS, const int G,
                                                                const bool TWO, const bool OFF, const bool MIN,
                                                                float *y, int64_t ldy, int valid) {
    const int64_t nsb = nb / G;
    __m512 accf[4];
    for (int r = 0; r < ROWS; r++) accf[r] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const kq_block k0 = kq_block_at(L, tile, sb * G);
        __m512i acci[4], corr[4], mins[4];
        for (int r = 0; r < ROWS; r++) {
            acci[r] = _mm512_setzero_si512();
            if (OFF) corr[r] = _mm512_setzero_si512();
            if (MIN) mins[r] = _mm512_setzero_si512();
        }
        __m512i mn_lo = _mm512_setzero_si512();
        for (int j = 0; j < G; j++) {
            const int64_t b = sb * G + j;
            const kq_block k = kq_block_at(L, tile, b);
            _mm_prefetch((const char *)(k.codes + 2 * L->block), _MM_HINT_T0);
            __m512i q[8];
            kq8_decode(k.codes, L->bits, q);
            const __m512i sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)k.sc0));
            const __m512i sc1 = TWO ? _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)k.sc1)) : sc0;
            /* lane o: sc_0 (low int16), sc_1 (high: sc_0 again without a second row), against a
             * row's X_0, X_1 pair */
            const __m512i scpair = _mm512_or_si512(_mm512_and_si512(sc0, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(sc1, 16));
            const __m512i mn = MIN ? _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)k.mn)) : _mm512_setzero_si512();
            /* lane o: mn in both int16 halves, against a row's X_0, X_1 pair: mn (X_0 + X_1); in a
             * super-block, mn of blocks b - 1 and b, against a row's X_{b-1}, X_b (taken at odd
             * b): half the broadcasts and multiply-adds, the same integer sum (|X_b| <= 32 * 127
             * fits int16) */
            if (G == 1 || !(j & 1)) mn_lo = mn;
            const __m512i mnpair = _mm512_or_si512(mn_lo, _mm512_slli_epi32(mn, 16));
            for (int r = 0; r < ROWS; r++) {
                const int32_t *xp = (const int32_t *)(xq + r * in + b * QK);
                if (TWO) {
                    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
                    for (int kq = 0; kq < 4; kq++) {
                        a0 = _mm512_dpbusd_epi32(a0, q[kq], _mm512_set1_epi32(xp[kq]));
                        a1 = _mm512_dpbusd_epi32(a1, q[4 + kq], _mm512_set1_epi32(xp[4 + kq]));
                    }
                    acci[r] = _mm512_add_epi32(acci[r], _mm512_add_epi32(_mm512_mullo_epi32(a0, sc0), _mm512_mullo_epi32(a1, sc1)));
                } else {
                    __m512i a = _mm512_setzero_si512();
                    for (int kq = 0; kq < 8; kq++) a = _mm512_dpbusd_epi32(a, q[kq], _mm512_set1_epi32(xp[kq]));
                    acci[r] = _mm512_add_epi32(acci[r], _mm512_mullo_epi32(a, sc0));
                }
                if (OFF) corr[r] = _mm512_dpwssd_epi32(corr[r], scpair, _mm512_set1_epi32(xs[r * nb + b]));
                if (MIN && G == 8 && (j & 1)) {
                    const int32_t e = xs[r * nb + b - 1], o = xs[r * nb + b];
                    const int xe = kq8_half_sum(e, 0) + kq8_half_sum(e, 1), xo = kq8_half_sum(o, 0) + kq8_half_sum(o, 1);
                    mins[r] = _mm512_dpwssd_epi32(mins[r], mnpair, _mm512_set1_epi32((int32_t)((uint32_t)(uint16_t)xo << 16 | (uint16_t)xe)));
                } else if (MIN && G == 1)
                    mins[r] = _mm512_dpwssd_epi32(mins[r], mnpair, _mm512_set1_epi32(xs[r * nb + b]));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)k0.d));
        for (int r = 0; r < ROWS; r++) {
            __m512i s = acci[r];
            if (OFF) s = _mm512_sub_epi32(s, _mm512_mullo_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)k0.off)), corr[r]));
            const __m512 scale = _mm512_set1_ps(d8[r * nsb + sb]);
            accf[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, scale), accf[r]);
            if (MIN)
                accf[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mins[r]),
                                          _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)k0.dm)), scale), accf[r]);
        }
    }
    for (int r = 0; r < ROWS; r++) {
        float total[TILE];
        _mm512_storeu_ps(total, accf[r]);
        for (int j = 0; j < valid; j++) y[r * ldy + j] = total[j];
    }
}

#define KQ8_ROWS(G, TWO, OFF, MIN)                                                                                 \
    switch (group) {                                                                                              \
    case 1: kq8_tile_rows(tile, nb, L, in, x, d, h, 1, G, TWO, OFF, MIN, yt, out, valid); break;              \
    case 2: kq8_tile_rows(tile, nb, L, in, x, d, h, 2, G, TWO, OFF, MIN, yt, out, valid); break;              \
    case 3: kq8_tile_rows(tile, nb, L, in, x, d, h, 3, G, TWO, OFF, MIN, yt, out, valid); break;              \
    default: kq8_tile_rows(tile, nb, L, in, x, d, h, 4, G, TWO, OFF, MIN, yt, out, valid); break;             \
    }

/* Tile `t` against every row, in groups of up to 4 (two balanced groups where 5 to 7 remain). */
static void kq8_tile(const kq_layout *L, const uint8_t *w, int64_t t, int64_t out, int64_t in, const int8_t *q8,
                     const float *d8, const int32_t *xs, int64_t rows, float *acc, float *y) {
    (void)acc;
    const int64_t nb = in / QK, nsb = nb >> L->shift, tb_bytes = L->block + (L->header >> L->shift);
    const uint8_t *tile = w + t * nb * tb_bytes;
    const int valid = out - t * TILE < TILE ? (int)(out - t * TILE) : TILE;
    const bool two = L->sc1 != L->sc0, min = L->mn >= 0;
    for (int64_t r0 = 0; r0 < rows;) {
        const int64_t left = rows - r0, group = left <= 4 ? left : left < 8 ? (left + 1) / 2 : 4;
        const int8_t *x = q8 + r0 * in;
        const float *d = d8 + r0 * nsb;
        const int32_t *h = xs + r0 * nb;
        float *yt = y + r0 * out + t * TILE;
        if (L->shift) { /* a super-block: Q4_K, Q5_K (no offset) or with a Q6_K part */
            if (two && min) KQ8_ROWS(8, true, true, true)
            else if (two) KQ8_ROWS(8, true, true, false)
            else if (min) KQ8_ROWS(8, false, false, true)
            else KQ8_ROWS(8, false, false, false)
        } else { /* a block: Q5_0, Q5_1 and their fusions, an offset per output */
            if (two && min) KQ8_ROWS(1, true, true, true)
            else if (two) KQ8_ROWS(1, true, true, false)
            else if (min) KQ8_ROWS(1, false, true, true)
            else KQ8_ROWS(1, false, true, false)
        }
        r0 += group;
    }
}
#else
/* AVX2. A quad vector covers 8 outputs x 4 inputs: half 0 of a pair holds outputs 0-3 and
 * 8-11, half 1 outputs 4-7 and 12-15 (the lanes of a 16-bit unpack). */
static const int8_t kq8_order[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};

/* A group's tile-blocks (8, or 1 per block) decoded: q[b][4 h + k][i], and per block the sub-scales
 * (int32), their int16 pairs and the mins (float) in the same output order. */
typedef struct {
    __m256i q[8][8][2];
    __m256i sc0[8][2], sc1[8][2], scpair[8][2], mnpair[8][2];
} kq8_super;

static inline __attribute__((always_inline)) void kq8_decode(const uint8_t *tb, int bits, __m256i q[8][2]) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int k = 0; k < 4; k++) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(tb + 64 * k));      /* g = 2k: inputs 4k, 4k+1 */
        const __m256i b = _mm256_loadu_si256((const __m256i *)(tb + 64 * k + 32)); /* g = 2k+1: 4k+2, 4k+3 */
        const __m256i c[2] = {_mm256_unpacklo_epi16(a, b), _mm256_unpackhi_epi16(a, b)};
        for (int i = 0; i < 2; i++) {
            q[k][i] = _mm256_and_si256(c[i], low);
            q[4 + k][i] = _mm256_and_si256(_mm256_srli_epi16(c[i], 4), low);
        }
    }
    if (bits == 4) return;
    /* byte 16 L + 4 o' + j of half i (o = o' + 4 i + 8 L): source byte (j >> 1) 4 + i + 2 L,
     * bit 2 o' + (j & 1) */
    const __m256i pick[2] = {
        _mm256_setr_epi8(0, 0, 4, 4, 0, 0, 4, 4, 0, 0, 4, 4, 0, 0, 4, 4, 2, 2, 6, 6, 2, 2, 6, 6, 2, 2, 6, 6, 2, 2, 6, 6),
        _mm256_setr_epi8(1, 1, 5, 5, 1, 1, 5, 5, 1, 1, 5, 5, 1, 1, 5, 5, 3, 3, 7, 7, 3, 3, 7, 7, 3, 3, 7, 7, 3, 3, 7, 7)};
    const __m256i bit_of = _mm256_setr_epi8(0x01, 0x02, 0x01, 0x02, 0x04, 0x08, 0x04, 0x08, 0x10, 0x20, 0x10, 0x20, 0x40,
                                            (char)0x80, 0x40, (char)0x80, 0x01, 0x02, 0x01, 0x02, 0x04, 0x08, 0x04, 0x08,
                                            0x10, 0x20, 0x10, 0x20, 0x40, (char)0x80, 0x40, (char)0x80);
    for (int p = 0; p < bits - 4; p++) {
        const __m256i bit = _mm256_set1_epi8((char)(16 << p));
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < 4; k++) {
                const __m256i v = _mm256_set1_epi64x((long long)kq8_hi_words(tb, p, h, k));
                for (int i = 0; i < 2; i++) {
                    const __m256i m = _mm256_and_si256(_mm256_shuffle_epi8(v, pick[i]), bit_of);
                    q[4 * h + k][i] = _mm256_or_si256(q[4 * h + k][i], _mm256_and_si256(_mm256_cmpeq_epi8(m, bit_of), bit));
                }
            }
    }
}

/* 16 bytes of per-output numbers -> the two halves' 8 lanes (signed or unsigned bytes). */
static inline void kq8_lanes_i8(const uint8_t *p, __m256i out[2]) {
    const __m128i v = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)p), _mm_loadu_si128((const __m128i *)kq8_order));
    out[0] = _mm256_cvtepi8_epi32(v);
    out[1] = _mm256_cvtepi8_epi32(_mm_srli_si128(v, 8));
}

static inline void kq8_lanes_u8(const uint8_t *p, __m256i out[2]) {
    const __m128i v = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)p), _mm_loadu_si128((const __m128i *)kq8_order));
    out[0] = _mm256_cvtepu8_epi32(v);
    out[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(v, 8));
}

/* Half i's 8 lanes of a row's block sum over input half h: the products of 4 quads, paired in
 * int16 (|.| <= 2 * 2 * 63 * 127 < 2^15) before they widen. */
static inline __m256i kq8_half(const __m256i q[8][2], const int32_t *xp, int h, int i) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(q[4 * h][i], _mm256_set1_epi32(xp[4 * h])),
                                        _mm256_maddubs_epi16(q[4 * h + 1][i], _mm256_set1_epi32(xp[4 * h + 1])));
    const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(q[4 * h + 2][i], _mm256_set1_epi32(xp[4 * h + 2])),
                                        _mm256_maddubs_epi16(q[4 * h + 3][i], _mm256_set1_epi32(xp[4 * h + 3])));
    return _mm256_add_epi32(_mm256_madd_epi16(p0, ones), _mm256_madd_epi16(p1, ones));
}

/* Natural output order (0-7, 8-15) from the halves' (0-3 8-11, 4-7 12-15). */
static inline void kq8_natural(const __m256i v[2], __m256i out[2]) {
    out[0] = _mm256_permute2x128_si256(v[0], v[1], 0x20);
    out[1] = _mm256_permute2x128_si256(v[0], v[1], 0x31);
}

static void kq8_tile(const kq_layout *L, const uint8_t *w, int64_t t, int64_t out, int64_t in, const int8_t *q8,
                     const float *d8, const int32_t *xs, int64_t rows, float *acc, float *y) {
    const int G = 1 << L->shift;
    const int64_t nb = in / QK, nsb = nb / G, tb_bytes = L->block + (L->header >> L->shift);
    const uint8_t *tile = w + t * nb * tb_bytes;
    const int valid = out - t * TILE < TILE ? (int)(out - t * TILE) : TILE;
    const bool two = L->sc1 != L->sc0, has_off = kq8_has_off(L), min = L->mn >= 0;
    kq8_super S;
    memset(acc, 0, sizeof(float) * 16 * (size_t)rows);
    for (int64_t sb = 0; sb < nsb; sb++) {
        for (int j = 0; j < G; j++) {
            const kq_block k = kq_block_at(L, tile, sb * G + j);
            kq8_decode(k.codes, L->bits, S.q[j]);
            kq8_lanes_i8(k.sc0, S.sc0[j]);
            kq8_lanes_i8(k.sc1, S.sc1[j]);
            __m256i mn[2];
            kq8_lanes_u8(k.mn, mn);
            for (int i = 0; i < 2; i++) {
                S.scpair[j][i] = _mm256_or_si256(_mm256_and_si256(S.sc0[j][i], _mm256_set1_epi32(0xFFFF)),
                                                 _mm256_slli_epi32(S.sc1[j][i], 16));
                S.mnpair[j][i] = _mm256_or_si256(mn[i], _mm256_slli_epi32(mn[i], 16));
            }
        }
        const kq_block k0 = kq_block_at(L, tile, sb * G);
        const __m256 d[2] = {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)k0.d)),
                             _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(k0.d + 16)))};
        const __m256 dm[2] = {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)k0.dm)),
                              _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(k0.dm + 16)))};
        const __m256i off[2] = {_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)k0.off)),
                                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(k0.off + 8)))};
        for (int64_t r = 0; r < rows; r++) {
            __m256i acci[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, corr[2] = {acci[0], acci[0]};
            __m256i mins[2] = {acci[0], acci[0]};
            for (int j = 0; j < G; j++) {
                const int64_t b = sb * G + j;
                const int32_t *xp = (const int32_t *)(q8 + r * in + b * QK);
                for (int i = 0; i < 2; i++) {
                    const __m256i a0 = kq8_half(S.q[j], xp, 0, i), a1 = kq8_half(S.q[j], xp, 1, i);
                    if (two) {
                        acci[i] = _mm256_add_epi32(acci[i], _mm256_add_epi32(_mm256_mullo_epi32(a0, S.sc0[j][i]),
                                                                             _mm256_mullo_epi32(a1, S.sc1[j][i])));
                    } else {
                        acci[i] = _mm256_add_epi32(acci[i], _mm256_mullo_epi32(_mm256_add_epi32(a0, a1), S.sc0[j][i]));
                    }
                    if (has_off) corr[i] = _mm256_add_epi32(corr[i], _mm256_madd_epi16(S.scpair[j][i], _mm256_set1_epi32(xs[r * nb + b])));
                    if (min) mins[i] = _mm256_add_epi32(mins[i], _mm256_madd_epi16(S.mnpair[j][i], _mm256_set1_epi32(xs[r * nb + b])));
                }
            }
            __m256i sum[2], cor[2], mc[2];
            kq8_natural(acci, sum);
            kq8_natural(corr, cor);
            kq8_natural(mins, mc);
            const __m256 scale = _mm256_set1_ps(d8[r * nsb + sb]);
            for (int i = 0; i < 2; i++) {
                const __m256i s = has_off ? _mm256_sub_epi32(sum[i], _mm256_mullo_epi32(off[i], cor[i])) : sum[i];
                float *a = acc + 16 * r + 8 * i;
                __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d[i], scale), _mm256_loadu_ps(a));
                if (min) v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mc[i]), _mm256_mul_ps(dm[i], scale), v);
                _mm256_storeu_ps(a, v);
            }
        }
    }
    for (int64_t r = 0; r < rows; r++)
        for (int j = 0; j < valid; j++) y[r * out + t * TILE + j] = acc[16 * r + j];
}
#endif

/* The rows requantized per activation group of G blocks into a buffer the threads of the
 * enclosing parallel region share (q8, d8, xs, and where `q16` is not NULL the q8 codes again
 * as int16). Returns NULL, every thread alike, where that buffer cannot be had; else the
 * buffer, which the caller frees in one thread. */
static uint8_t *kq8_requantize_shared(int G, int64_t in, const int16_t *xq, const float *dx, int64_t rows,
                                      int8_t **q8, float **d8, int32_t **xs, int16_t **q16) {
    const int64_t nb = in / QK, nsb = nb / G;
    const int64_t q8_bytes = kq_round_up_64(rows * in), d8_bytes = kq_round_up_64(rows * nsb * (int64_t)sizeof(float));
    const int64_t xs_bytes = kq_round_up_64(rows * nb * (int64_t)sizeof(int32_t));
    const int64_t q16_bytes = q16 ? rows * in * (int64_t)sizeof(int16_t) : 0;
    uint8_t *buffer = NULL;
#pragma omp single copyprivate(buffer)
    buffer = malloc((size_t)(q8_bytes + d8_bytes + xs_bytes + q16_bytes));
    if (!buffer) return NULL;
    *q8 = (int8_t *)buffer;
    *d8 = (float *)(buffer + q8_bytes);
    *xs = (int32_t *)(buffer + q8_bytes + d8_bytes);
    if (q16) *q16 = (int16_t *)(buffer + q8_bytes + d8_bytes + xs_bytes);
#pragma omp for schedule(static)
    for (int64_t u = 0; u < rows * nsb; u++) { /* activation groups, so that one row is shared too */
        kq8_requantize(xq + u * G * QK, dx + u * G, G, *q8 + u * G * QK, *d8 + u, *xs + u * G);
        if (q16)
            for (int64_t j = 0; j < G * QK; j += 16)
                _mm256_storeu_si256((__m256i *)(*q16 + u * G * QK + j),
                                    _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(*q8 + u * G * QK + j))));
    }
    return buffer;
}

/* The tiles of a K-quant kind of at most 6-bit codes (kq8_runs) shared among the threads of
 * the enclosing parallel region (kquant_cpu.c's nls_kq_matmul_shared hands them here): the rows
 * requantized once into a buffer the threads share, then the tiles. Returns false, every thread
 * alike, where that buffer cannot be had; the caller then runs its int16 kernel. */
bool kq8_matmul_shared(const kq_layout *L, const uint8_t *w, int64_t out, int64_t in, const int16_t *xq,
                       const float *dx, int64_t rows, float *acc, float *y) {
    const int64_t tiles = (out + TILE - 1) / TILE;
    int8_t *q8;
    float *d8;
    int32_t *xs;
    uint8_t *buffer = kq8_requantize_shared(1 << L->shift, in, xq, dx, rows, &q8, &d8, &xs, NULL);
    if (!buffer) return false;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) kq8_tile(L, w, t, out, in, q8, d8, xs, rows, acc, y);
#pragma omp single
    free(buffer);
    return true;
}

/* ------------------------------------------------- Q8_0 blocks with int8 activations -- */

/* gguf_cpu.c's Q8 tile-blocks (544 bytes: codes int8[16][32], byte 32 p + 2 o + i output o's
 * code for input 2 p + i, then d f16[16]) against rows requantized per block of 32, llama.cpp's
 * Q8_0 x Q8_0 arithmetic (decision 48). A block's integer sum S = sum_j q_j q8_j is exact in
 * int32 (|S| <= 32 * 128 * 127), and the float step per block is acc = fma(S, d d8, acc), the
 * same in the C twin and both vector kernels, so every ISA level gives the same bits.
 * - AVX-512 VNNI: vpdpbusd multiplies unsigned bytes by signed ones, so the codes go in with
 *   their sign bit flipped (q + 128) and 128 X, X the row's block sum of q8 (the requantized
 *   rows' half sums), comes off: S = sum (q + 128) q8 - 128 X.
 * - AVX2: the int8 rows, widened back to int16, through gguf_cpu.c's int16 kernel
 *   (nls_q8i8_matmul_shared below): the same S and the same float step. */

/* The C twin: output o, row r, one block at a time. */
int q8i8_ref_rows(const uint8_t *w, int64_t out, int64_t in, const int16_t *xq, const float *dx, int64_t rows,
                  float *y) {
    const int64_t nb = in / QK, tb_bytes = tile_block_bytes(KIND_Q8);
    int8_t *q8 = malloc((size_t)in);
    float *d8 = malloc(sizeof(float) * (size_t)nb);
    int32_t *xs = malloc(sizeof(int32_t) * (size_t)nb);
    if (!q8 || !d8 || !xs) {
        free(q8), free(d8), free(xs);
        return NLS_NO_MEMORY;
    }
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t b = 0; b < nb; b++) kq8_requantize(xq + r * in + b * QK, dx + r * nb + b, 1, q8 + b * QK, d8 + b, xs + b);
        for (int64_t o = 0; o < out; o++) {
            const uint8_t *tile = w + (o / TILE) * nb * tb_bytes;
            const int ot = (int)(o % TILE);
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *tb = tile + b * tb_bytes;
                int32_t sum = 0;
                for (int j = 0; j < QK; j++) sum += (int8_t)tb[32 * (j / 2) + 2 * ot + (j & 1)] * q8[b * QK + j];
                acc = fmaf((float)sum, half_to_float(tb + 512 + 2 * ot) * d8[b], acc);
            }
            y[r * out + o] = acc;
        }
    }
    free(q8), free(d8), free(xs);
    return 0;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* ROWS (a constant at each call) rows of one tile, their sums in registers across the blocks. */
static inline __attribute__((always_inline)) void q8i8_tile_rows(const uint8_t *tile, int64_t nb, int64_t in,
                                                                 const int8_t *xq, const float *d8, const int32_t *xs,
                                                                 const int ROWS, float *y, int64_t ldy, int valid) {
    const int64_t tb_bytes = tile_block_bytes(KIND_Q8);
    /* words o and 16 + o of 64 code bytes (pairs 2k, 2k + 1) -> dword o: inputs 4k .. 4k + 3 */
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 accf[4];
    for (int r = 0; r < ROWS; r++) accf[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *tb = tile + b * tb_bytes;
        for (int64_t line = 0; line < tb_bytes; line += 64) _mm_prefetch((const char *)(tb + 2 * tb_bytes + line), _MM_HINT_T0);
        __m512i q[8];
        for (int k = 0; k < 8; k++)
            q[k] = _mm512_xor_si512(_mm512_permutexvar_epi16(idx, _mm512_loadu_si512((const void *)(tb + 64 * k))), flip);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tb + 512)));
        for (int r = 0; r < ROWS; r++) {
            const int32_t *xp = (const int32_t *)(xq + r * in + b * QK);
            __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
            for (int k = 0; k < 8; k += 2) {
                a0 = _mm512_dpbusd_epi32(a0, q[k], _mm512_set1_epi32(xp[k]));
                a1 = _mm512_dpbusd_epi32(a1, q[k + 1], _mm512_set1_epi32(xp[k + 1]));
            }
            const int32_t pair = xs[r * nb + b];
            const int32_t shift = 128 * (kq8_half_sum(pair, 0) + kq8_half_sum(pair, 1));
            const __m512i s = _mm512_sub_epi32(_mm512_add_epi32(a0, a1), _mm512_set1_epi32(shift));
            accf[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(d8[r * nb + b])), accf[r]);
        }
    }
    for (int r = 0; r < ROWS; r++) {
        float total[TILE];
        _mm512_storeu_ps(total, accf[r]);
        for (int j = 0; j < valid; j++) y[r * ldy + j] = total[j];
    }
}

/* Tile `t` against every row, in register groups of up to 4 (two balanced groups where 5 to 7
 * remain). */
static void q8i8_tile(const uint8_t *w, int64_t t, int64_t out, int64_t in, const int8_t *q8, const float *d8,
                      const int32_t *xs, int64_t rows, float *acc, float *y) {
    (void)acc;
    const int64_t nb = in / QK;
    const uint8_t *tile = w + t * nb * tile_block_bytes(KIND_Q8);
    const int valid = out - t * TILE < TILE ? (int)(out - t * TILE) : TILE;
    for (int64_t r0 = 0; r0 < rows;) {
        const int64_t left = rows - r0, group = left <= 4 ? left : left < 8 ? (left + 1) / 2 : 4;
        const int8_t *x = q8 + r0 * in;
        const float *d = d8 + r0 * nb;
        const int32_t *h = xs + r0 * nb;
        float *yt = y + r0 * out + t * TILE;
        switch (group) {
        case 1: q8i8_tile_rows(tile, nb, in, x, d, h, 1, yt, out, valid); break;
        case 2: q8i8_tile_rows(tile, nb, in, x, d, h, 2, yt, out, valid); break;
        case 3: q8i8_tile_rows(tile, nb, in, x, d, h, 3, yt, out, valid); break;
        default: q8i8_tile_rows(tile, nb, in, x, d, h, 4, yt, out, valid); break;
        }
        r0 += group;
    }
}
#endif

/* Q8_0 blocks (KIND_Q8) with int8 activations, the tiles shared among the threads of the
 * enclosing parallel region (gguf_cpu.c's matmul_shared and nls_gguf_matmul hand them here):
 * the rows requantized per block of 32 as in kq8_matmul_shared, then the tiles. At AVX2 the
 * int8 rows go, widened back to int16, through gguf_cpu.c's int16 kernel with d8 for dx:
 * the same integer sums and the same float step per block, so the same bits, and the int16
 * kernel's speed (vpmaddubsw with the sign trick runs as many instructions as the widened
 * vpmaddwd for 8-bit codes, and the int16 kernel keeps its register row groups). `acc`: this
 * thread's room for 32 floats a row. */
int nls_q8i8_matmul_shared(const uint8_t *w, int64_t out, int64_t in, const int16_t *xq, const float *dx,
                           int64_t rows, float *acc, float *y) {
    int8_t *q8;
    float *d8;
    int32_t *xs;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    const int64_t tiles = (out + TILE - 1) / TILE;
    uint8_t *buffer = kq8_requantize_shared(1, in, xq, dx, rows, &q8, &d8, &xs, NULL);
    if (!buffer) return false;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) q8i8_tile(w, t, out, in, q8, d8, xs, rows, acc, y);
#else
    int16_t *q16;
    uint8_t *buffer = kq8_requantize_shared(1, in, xq, dx, rows, &q8, &d8, &xs, &q16);
    if (!buffer) return false;
    nls_block_tiles_shared(KIND_Q8, w, out, in, q16, d8, d8, rows, acc, y);
#endif
#pragma omp single
    free(buffer);
    return true;
}
