/* A measurement, not a served kernel: the K-quant tile-blocks (native/kquant_cpu.c, included
 * whole below, so both kernels read the same bytes through the same layout code and are built
 * with the same flags) multiplied by int8 activations instead of int16, to time what decision
 * 35 / 40's int8 would buy at the kernel (milestones/m31-kquants.md). Driven by
 * scripts/kquant_int8_probe.py, which builds this file with the library's AVX-512 flags plus
 * BMI2.
 *
 * Activations: per block of 32, int8 codes qx = round(x / dx), dx = amax / 127 (llama.cpp's
 * Q8_0 activations), the exact float sum sx, and the int32 sums X_h of the codes over each
 * half of 16. The weight codes stay unsigned bytes (raw, the offset taken out as
 * S_h = A_h - off X_h, as the int16 kernel's raw path does), so one vpdpbusd multiplies 4
 * code bytes by 4 activation bytes per output lane, twice the int16 kernel's 2 per vpdpwssd:
 * a tile-block's 32 inputs x 16 outputs is 8 instructions a row instead of 16. The float
 * steps after the integers are the int16 kernel's.
 *
 * The tile-block's nibble bytes (byte 32 g + 2 o + i: output o, input 2 g + i low, 16 + 2 g + i
 * high) give a quad per output with one word permutation per 64 bytes (AVX-512 BW's vpermw:
 * words o and 16 + o of the load are inputs 4k, 4k + 1 and 4k + 2, 4k + 3 of output o); the
 * higher code bits (bit 2 o + i of word p) go in per byte with a mask from two PDEPs.
 */
#include "kquant_cpu.c"

#include <immintrin.h>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__BMI2__)

/* One row of n floats -> int8 codes, a scale, the float sum per 32 and the code sums per 16. */
static void q8_quantize_row(const float *x, int64_t n, int8_t *qx, float *dx, float *sx, int32_t *xs) {
    for (int64_t b = 0; b < n / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.0f, sum = 0.0f;
        for (int j = 0; j < QK; j++) {
            amax = fmaxf(amax, fabsf(xb[j]));
            sum += xb[j];
        }
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t h[2] = {0, 0};
        for (int j = 0; j < QK; j++) {
            const int q = (int)nearbyintf(xb[j] * id);
            qx[b * QK + j] = (int8_t)q;
            h[j >= 16] += q;
        }
        dx[b] = amax / 127.0f;
        sx[b] = sum;
        xs[2 * b] = h[0];
        xs[2 * b + 1] = h[1];
    }
}

/* A tile-block's codes as 8 vectors of 16 output lanes x 4 bytes: q[4 h + k] holds inputs
 * 16 h + 4 k .. 16 h + 4 k + 3 of each output, raw (not less the offset). */
static inline __attribute__((always_inline)) void q8_decode(const uint8_t *tb, int bits, __m512i q[8]) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int k = 0; k < 4; k++) {
        const __m512i c = _mm512_permutexvar_epi16(idx, _mm512_loadu_si512((const void *)(tb + 64 * k)));
        q[k] = _mm512_and_si512(c, low);
        q[4 + k] = _mm512_and_si512(_mm512_srli_epi16(c, 4), low);
    }
    for (int p = 0; p < bits - 4; p++) {
        const uint32_t *hi = (const uint32_t *)(tb + 256 + 64 * p);
        const __m512i bit = _mm512_set1_epi8((char)(16 << p));
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < 4; k++) {
                const uint64_t m = _pdep_u64(hi[8 * h + 2 * k], 0x3333333333333333ull) |
                                   _pdep_u64(hi[8 * h + 2 * k + 1], 0xCCCCCCCCCCCCCCCCull);
                q[4 * h + k] = _mm512_mask_add_epi8(q[4 * h + k], m, q[4 * h + k], bit); /* the bit is 0 there */
            }
    }
}

static inline __attribute__((always_inline)) __m512 q8_row_block(const __m512i q[8], const kq_scales *s, bool has_off,
                                                                  const int32_t *xp, const int32_t *xs, float dxb,
                                                                  float sxb, __m512 acc) {
    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
    for (int k = 0; k < 4; k++) {
        a0 = _mm512_dpbusd_epi32(a0, q[k], _mm512_set1_epi32(xp[k]));
        a1 = _mm512_dpbusd_epi32(a1, q[4 + k], _mm512_set1_epi32(xp[4 + k]));
    }
    if (has_off) {
        a0 = _mm512_sub_epi32(a0, _mm512_mullo_epi32(s->off, _mm512_set1_epi32(xs[0])));
        a1 = _mm512_sub_epi32(a1, _mm512_mullo_epi32(s->off, _mm512_set1_epi32(xs[1])));
    }
    const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1), s->ds1, _mm512_mul_ps(_mm512_cvtepi32_ps(a0), s->ds0));
    return _mm512_fmadd_ps(s->mw, _mm512_set1_ps(sxb), _mm512_fmadd_ps(t, _mm512_set1_ps(dxb), acc));
}

static inline bool q8_block_has_off(const kq_block *k) {
    return _mm_test_all_zeros(_mm_loadu_si128((const __m128i *)k->off), _mm_set1_epi8(-1)) == 0;
}

/* Up to 4 rows with their sums in registers (the int16 kernel's kq_tile_few_rows). */
static inline __attribute__((always_inline)) void q8_tile_few_rows(const uint8_t *tile, int64_t nb, const kq_layout *L,
                                                                   int64_t in, const int8_t *xq, const float *dx,
                                                                   const float *sx, const int32_t *xs, const int ROWS,
                                                                   float *y, int64_t ldy, int valid) {
    __m512 acc[4];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const kq_block k = kq_block_at(L, tile, b);
        _mm_prefetch((const char *)(k.codes + 2 * L->block), _MM_HINT_T0);
        __m512i q[8];
        q8_decode(k.codes, L->bits, q);
        const kq_scales s = kq_block_scales(L, &k);
        const bool has_off = q8_block_has_off(&k);
        for (int r = 0; r < ROWS; r++)
            acc[r] = q8_row_block(q, &s, has_off, (const int32_t *)(xq + r * in + b * QK), xs + 2 * (r * nb + b),
                                  dx[r * nb + b], sx[r * nb + b], acc[r]);
    }
    for (int r = 0; r < ROWS; r++) {
        float total[TILE];
        _mm512_storeu_ps(total, acc[r]);
        for (int j = 0; j < valid; j++) y[r * ldy + j] = total[j];
    }
}

/* Any number of rows, their sums in `acc` (the int16 kernel's kq_tile_rows). */
static void q8_tile_rows(const uint8_t *tile, int64_t nb, const kq_layout *L, int64_t in, const int8_t *xq,
                         const float *dx, const float *sx, const int32_t *xs, int64_t rows, float *acc) {
    for (int64_t r = 0; r < rows; r++) _mm512_storeu_ps(acc + 16 * r, _mm512_setzero_ps());
    for (int64_t b = 0; b < nb; b++) {
        const kq_block k = kq_block_at(L, tile, b);
        _mm_prefetch((const char *)(k.codes + 2 * L->block), _MM_HINT_T0);
        __m512i q[8];
        q8_decode(k.codes, L->bits, q);
        const kq_scales s = kq_block_scales(L, &k);
        const bool has_off = q8_block_has_off(&k);
        for (int64_t r = 0; r < rows; r++)
            _mm512_storeu_ps(acc + 16 * r, q8_row_block(q, &s, has_off, (const int32_t *)(xq + r * in + b * QK),
                                                        xs + 2 * (r * nb + b), dx[r * nb + b], sx[r * nb + b],
                                                        _mm512_loadu_ps(acc + 16 * r)));
    }
}

/* ---- per 256 inputs (llama.cpp's Q8_K activations), the sub-scales merged in integers ----
 * For the kinds whose d, dm and off are constant over a super-block (KQ_SUPER: Q4_K, Q5_K,
 * Q6_K parts): one activation scale per 256 inputs, so a row's super-block product is
 *     d dx (sum_b sum_h sc_bh A_bh - off sum_b sum_h sc_bh X_bh) + dm sum_b mn_b sx_b
 * with every sum over b and h an exact int32 (|sc A| <= 128 * 63 * 127 * 16 per half, 16
 * halves), one float fold per row and super-block instead of per block. The offset term
 * takes one vpdpwssd a block and row for both halves (int16 pairs sc_b0, sc_b1 against the
 * row's X_b0, X_b1, |X| <= 127 * 16). */
static void q8k_quantize_row(const float *x, int64_t n, int8_t *qx, float *dx, float *sx, int32_t *xs) {
    for (int64_t s = 0; s < n / 256; s++) {
        const float *xb = x + s * 256;
        float amax = 0.0f;
        for (int j = 0; j < 256; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        dx[s] = amax / 127.0f;
        for (int b = 0; b < 8; b++) {
            float sum = 0.0f;
            int32_t h[2] = {0, 0};
            for (int j = 0; j < QK; j++) {
                const float v = xb[b * QK + j];
                const int q = (int)nearbyintf(v * id);
                qx[s * 256 + b * QK + j] = (int8_t)q;
                h[j >= 16] += q;
                sum += v;
            }
            sx[s * 8 + b] = sum;
            /* int16 pairs for the vpdpwssd (X_0 low, X_1 high) */
            xs[s * 8 + b] = (int32_t)(((uint32_t)(uint16_t)h[1] << 16) | (uint16_t)h[0]);
        }
    }
}


/* acc + (4 code bytes x 4 activation bytes) per lane, the activations' 4 bytes broadcast from
 * memory inside the instruction ({1to16}): GCC 12 loads them into a register with a separate
 * vpbroadcastd otherwise. */
static inline __attribute__((always_inline)) __m512i dpbusd_bcst(__m512i acc, __m512i codes, const int32_t *x4) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(codes), "m"(*x4));
    return acc;
}

#define Q8K_GROUP 4
/* ROWS rows of one tile; TWO (a Q6_K part: two sub-scale rows and an offset) and MIN (a part
 * with a min) are compile-time constants at each call, so that every row's three sums stay in
 * registers (with them read at run time, GCC 12 spilled 418 vector moves into this loop). */
static inline __attribute__((always_inline)) void q8k_tile_rows(const uint8_t *tile, int64_t nb, const kq_layout *L,
                                                                int64_t in, const int8_t *xq, const float *dx,
                                                                const float *sx, const int32_t *xs, const int ROWS,
                                                                const bool TWO, const bool MIN, float *y, int64_t ldy,
                                                                int valid) {
    const int64_t nsb = nb / 8;
    __m512 accf[Q8K_GROUP];
    for (int r = 0; r < ROWS; r++) accf[r] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const kq_block k0 = kq_block_at(L, tile, sb * 8);
        __m512i acci[Q8K_GROUP], corr[Q8K_GROUP];
        __m512 macc[Q8K_GROUP];
        for (int r = 0; r < ROWS; r++) {
            acci[r] = _mm512_setzero_si512();
            if (TWO) corr[r] = _mm512_setzero_si512();
            if (MIN) macc[r] = _mm512_setzero_ps();
        }
        for (int j = 0; j < 8; j++) {
            const int64_t b = sb * 8 + j;
            const kq_block k = kq_block_at(L, tile, b);
            _mm_prefetch((const char *)(k.codes + 2 * L->block), _MM_HINT_T0);
            __m512i q[8];
            q8_decode(k.codes, L->bits, q);
            const __m512i sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)k.sc0));
            const __m512i sc1 = TWO ? _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)k.sc1)) : sc0;
            /* lane o: sc_0 (low int16), sc_1 (high), against a row's X_0, X_1 pair */
            const __m512i scpair = TWO ? _mm512_or_si512(_mm512_and_si512(sc0, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(sc1, 16))
                                       : sc0;
            const __m512 mnf = MIN ? _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)k.mn)))
                                   : _mm512_setzero_ps();
            for (int r = 0; r < ROWS; r++) {
                const int32_t *xp = (const int32_t *)(xq + r * in + b * QK);
                if (TWO) {
                    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
                    for (int kq = 0; kq < 4; kq++) {
                        a0 = dpbusd_bcst(a0, q[kq], xp + kq);
                        a1 = dpbusd_bcst(a1, q[4 + kq], xp + 4 + kq);
                    }
                    acci[r] = _mm512_add_epi32(acci[r], _mm512_add_epi32(_mm512_mullo_epi32(a0, sc0), _mm512_mullo_epi32(a1, sc1)));
                    corr[r] = _mm512_dpwssd_epi32(corr[r], scpair, _mm512_set1_epi32(xs[r * nb + b]));
                } else {
                    __m512i a = _mm512_setzero_si512();
                    for (int kq = 0; kq < 8; kq++) a = dpbusd_bcst(a, q[kq], xp + kq);
                    acci[r] = _mm512_add_epi32(acci[r], _mm512_mullo_epi32(a, sc0));
                }
                if (MIN) macc[r] = _mm512_fmadd_ps(mnf, _mm512_set1_ps(sx[r * nb + b]), macc[r]);
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)k0.d));
        for (int r = 0; r < ROWS; r++) {
            __m512i s = acci[r];
            if (TWO) s = _mm512_sub_epi32(s, _mm512_mullo_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)k0.off)), corr[r]));
            accf[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(dx[r * nsb + sb])), accf[r]);
            if (MIN) accf[r] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)k0.dm)), macc[r], accf[r]);
        }
    }
    for (int r = 0; r < ROWS; r++) {
        float total[TILE];
        _mm512_storeu_ps(total, accf[r]);
        for (int j = 0; j < valid; j++) y[r * ldy + j] = total[j];
    }
}

#define Q8K_ROWS(TWO, MIN)                                                                                          \
    switch (group) {                                                                                               \
    case 1: q8k_tile_rows(tile, nb, &L, in, xr, dr, sr, hr, 1, TWO, MIN, yt, out, valid); break;                   \
    case 2: q8k_tile_rows(tile, nb, &L, in, xr, dr, sr, hr, 2, TWO, MIN, yt, out, valid); break;                   \
    case 3: q8k_tile_rows(tile, nb, &L, in, xr, dr, sr, hr, 3, TWO, MIN, yt, out, valid); break;                   \
    default: q8k_tile_rows(tile, nb, &L, in, xr, dr, sr, hr, 4, TWO, MIN, yt, out, valid); break;                  \
    }

int64_t probe_q8k_workspace_bytes(int64_t in, int64_t rows, int num_threads) {
    (void)num_threads;
    return 64 + kq_round_up_64(rows * in) + kq_round_up_64(rows * (in / 256) * 4) + 2 * kq_round_up_64(rows * (in / QK) * 4);
}

/* y[rows, out] = x @ W^T, int8 activations per 256 inputs; KQ_SUPER kinds only. */
int probe_q8k_matmul(int kind, const uint8_t *w, int64_t out, int64_t in, const float *x, int64_t rows, float *y,
                     void *workspace, int64_t workspace_bytes, int num_threads) {
    kq_layout L;
    if (!kq_layout_of(kind, &L) || !L.shift || !kq_shape_ok(&L, in) || rows < 1 || num_threads < 1 ||
        workspace_bytes < probe_q8k_workspace_bytes(in, rows, num_threads))
        return NLS_BAD_SHAPE;
    const int64_t nb = in / QK, nsb = in / 256, tiles = (out + TILE - 1) / TILE;
    const int64_t tb_bytes = L.block + (L.header >> L.shift);
    uint8_t *base = (uint8_t *)(((uintptr_t)workspace + 63) / 64 * 64);
    int8_t *xq = (int8_t *)base;
    float *dx = (float *)(base + kq_round_up_64(rows * in));
    float *sx = (float *)((uint8_t *)dx + kq_round_up_64(rows * nsb * 4));
    int32_t *xs = (int32_t *)((uint8_t *)sx + kq_round_up_64(rows * nb * 4));
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            q8k_quantize_row(x + r * in, in, xq + r * in, dx + r * nsb, sx + r * nb, xs + r * nb);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const uint8_t *tile = w + t * nb * tb_bytes;
            const int valid = out - t * TILE < TILE ? (int)(out - t * TILE) : TILE;
            for (int64_t r0 = 0; r0 < rows;) {
                const int64_t left = rows - r0;
                const int64_t group = left <= Q8K_GROUP ? left : left < 2 * Q8K_GROUP ? (left + 1) / 2 : Q8K_GROUP;
                const int8_t *xr = xq + r0 * in;
                const float *dr = dx + r0 * nsb, *sr = sx + r0 * nb;
                const int32_t *hr = xs + r0 * nb;
                float *yt = y + r0 * out + t * TILE;
                const bool two = L.sc1 != L.sc0, min = L.mn >= 0;
                if (two && min) Q8K_ROWS(true, true)
                else if (two) Q8K_ROWS(true, false)
                else if (min) Q8K_ROWS(false, true)
                else Q8K_ROWS(false, false)
                r0 += group;
            }
        }
    }
    return 0;
}

/* y[rows, out] = x @ W^T with int8 activations; workspace: probe_q8_workspace_bytes. */
int64_t probe_q8_workspace_bytes(int64_t in, int64_t rows, int num_threads) {
    const int64_t nb = in / QK;
    return 64 + kq_round_up_64(rows * in) + kq_round_up_64(rows * nb * 16) +
           (int64_t)num_threads * kq_round_up_64(16 * rows * (int64_t)sizeof(float));
}

int probe_q8_matmul(int kind, const uint8_t *w, int64_t out, int64_t in, const float *x, int64_t rows, float *y,
                    void *workspace, int64_t workspace_bytes, int num_threads) {
    kq_layout L;
    if (!kq_layout_of(kind, &L) || !kq_shape_ok(&L, in) || rows < 1 || num_threads < 1 ||
        workspace_bytes < probe_q8_workspace_bytes(in, rows, num_threads))
        return NLS_BAD_SHAPE;
    const int64_t nb = in / QK, tiles = (out + TILE - 1) / TILE;
    const int64_t tb_bytes = L.block + (L.header >> L.shift);
    uint8_t *base = (uint8_t *)(((uintptr_t)workspace + 63) / 64 * 64);
    int8_t *xq = (int8_t *)base;
    float *dx = (float *)(base + kq_round_up_64(rows * in)), *sx = dx + rows * nb;
    int32_t *xs = (int32_t *)(sx + rows * nb);
    uint8_t *accs = base + kq_round_up_64(rows * in) + kq_round_up_64(rows * nb * 16);
    const int64_t acc_bytes = kq_round_up_64(16 * rows * (int64_t)sizeof(float));
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            q8_quantize_row(x + r * in, in, xq + r * in, dx + r * nb, sx + r * nb, xs + 2 * r * nb);
        float *acc = (float *)(accs + (int64_t)omp_get_thread_num() * acc_bytes);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const uint8_t *tile = w + t * nb * tb_bytes;
            const int valid = out - t * TILE < TILE ? (int)(out - t * TILE) : TILE;
            if (rows <= 8) {
                for (int64_t r0 = 0; r0 < rows;) {
                    const int64_t left = rows - r0, group = left > 4 ? (left + 1) / 2 : left;
                    const int8_t *xr = xq + r0 * in;
                    const float *d = dx + r0 * nb, *s = sx + r0 * nb;
                    const int32_t *h = xs + 2 * r0 * nb;
                    float *yt = y + r0 * out + t * TILE;
                    switch (group) {
                    case 1: q8_tile_few_rows(tile, nb, &L, in, xr, d, s, h, 1, yt, out, valid); break;
                    case 2: q8_tile_few_rows(tile, nb, &L, in, xr, d, s, h, 2, yt, out, valid); break;
                    case 3: q8_tile_few_rows(tile, nb, &L, in, xr, d, s, h, 3, yt, out, valid); break;
                    default: q8_tile_few_rows(tile, nb, &L, in, xr, d, s, h, 4, yt, out, valid); break;
                    }
                    r0 += group;
                }
            } else {
                q8_tile_rows(tile, nb, &L, in, xq, dx, sx, xs, rows, acc);
                for (int64_t r = 0; r < rows; r++)
                    for (int j = 0; j < valid; j++) y[r * out + t * TILE + j] = acc[16 * r + j];
            }
        }
    }
    return 0;
}
#endif
