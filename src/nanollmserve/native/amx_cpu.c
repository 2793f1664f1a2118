#define _GNU_SOURCE /* syscall() */
/* The tiled block kernel on Intel AMX (built only into the `amx` library: -mamx-tile
 * -mamx-int8; other builds compile this file to nothing). Same inputs and the same numbers as
 * the vector kernels in gguf_cpu.c: activations quantized per block of 32 to int16, each
 * block's integer sums exact, then scaled and accumulated with the same float operations in
 * the same order, so a row's result does not depend on which kernel ran it.
 *
 * AMX multiplies int8 tiles, so each int16 activation x is split into x = 256 hi + lo (hi
 * signed, lo unsigned bytes) and a block's sums are 256 * (hi . w) + (lo . w): two tile
 * products (TDPBSSD, TDPBUSD) of 16 rows x 16 outputs x 32 inputs. The weight tile B (8 rows
 * of 16 outputs x 4 consecutive inputs) is built from the 16-output tile-blocks once per tile
 * and block, and reused for every group of 16 activation rows.
 *
 * Each block's scales differ, so its sums leave the tiles after every block; what is left to
 * make cheap is the scaling. A row group's 16 accumulators stay in registers across the
 * blocks (the scales come pre-arranged by group, block and row), the m terms run as a second
 * pass with 16 independent sums, and the next block's tile products are issued before this
 * block's sums are scaled, so the tile unit and the vector units overlap (1.4-1.5x the
 * kernel that stored every block's sums first, measured at 64 rows). */

#include "native.h"

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)

#include <omp.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define AMX_ROWS 16

/* 0 when this process may use AMX tiles (Linux asks each process to request them once). */
int nls_amx_init(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1; }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* tmm0, tmm1: the hi and lo sums (16 x 16 int32); tmm2, tmm3: hi and lo activations
 * (16 rows x 32 bytes); tmm4: the weights (8 rows x 16 outputs x 4 bytes). */
static void configure_tiles(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    cfg.rows[0] = cfg.rows[1] = AMX_ROWS, cfg.colsb[0] = cfg.colsb[1] = 64;
    cfg.rows[2] = cfg.rows[3] = AMX_ROWS, cfg.colsb[2] = cfg.colsb[3] = 32;
    cfg.rows[4] = 8, cfg.colsb[4] = 64;
    _tile_loadconfig(&cfg);
}

static inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

/* How many blocks' tile products are in flight ahead of the block being scaled (1: measured
 * best; more does not pay). */
#define AHEAD 1

/* Each thread's part of the workspace: the tile's B tiles (512 bytes a block), the integer
 * sums (hi and lo, 2 KB) of the blocks in flight and the 16 rows' accumulated sums (1 KB). */
static inline int64_t thread_bytes(int64_t nb) { return nb * 512 + (AHEAD + 1) * 2048 + 1024 + 4096; }

/* Shared: the activations' high and low bytes, and their block scales and block sums by row
 * group, block and row (16 floats a block each); then each thread's part. */
int64_t nls_amx_workspace_bytes(int64_t in, int64_t rows, int num_threads) {
    const int64_t padded = round_up(rows, AMX_ROWS);
    return 2 * padded * in + 2 * padded * (in / QK) * 4 + (int64_t)num_threads * thread_bytes(in / QK) + 192;
}

/* Interleave two 32-byte vectors of (output, input pair) bytes into a 64-byte tile row of
 * (output, 4 inputs): the first vector's pair then the second's, for outputs 0..15 in order. */
static inline __m512i quad_row(__m256i a, __m256i b) {
    const __m256i lo = _mm256_unpacklo_epi16(a, b), hi = _mm256_unpackhi_epi16(a, b);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_permute2x128_si256(lo, hi, 0x20)),
                              _mm256_permute2x128_si256(lo, hi, 0x31), 1);
}

/* One tile-block -> the B tile: row q holds each output's weights for inputs 4q..4q+3. */
static void weight_tile(int kind, const uint8_t *tb, int8_t *b) {
    __m256i pairs[16]; /* pair p: each output's weights for inputs 2p, 2p+1 */
    if (kind == KIND_Q4) {
        const __m256i low = _mm256_set1_epi8(0x0F);
        for (int g = 0; g < 8; g++) {
            const __m256i c = _mm256_loadu_si256((const __m256i *)(tb + 32 * g));
            pairs[g] = _mm256_and_si256(c, low);
            pairs[g + 8] = _mm256_and_si256(_mm256_srli_epi16(c, 4), low);
        }
    } else {
        for (int p = 0; p < 16; p++) pairs[p] = _mm256_loadu_si256((const __m256i *)(tb + 32 * p));
    }
    for (int q = 0; q < 8; q++) _mm512_storeu_si512(b + 64 * q, quad_row(pairs[2 * q], pairs[2 * q + 1]));
}

/* Block b's tile products for the 16 rows of a_hi / a_lo (row stride `in`) against B tile
 * `bt`: the hi sums into sums[0..255], the lo sums into sums[256..511] (row i at 16 i). */
static inline void block_sums(const int8_t *a_hi, const uint8_t *a_lo, int64_t in, const int8_t *bt, int32_t *sums) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(2, a_hi, in);
    _tile_loadd(3, a_lo, in);
    _tile_loadd(4, bt, 64);
    _tile_dpbssd(0, 2, 4);
    _tile_dpbusd(1, 3, 4);
    _tile_stored(0, sums, 64);
    _tile_stored(1, sums + 256, 64);
}

/* The 16 rows' accumulators are 16 named registers (EACH_ROW): as an array of 1 KB, the
 * compiler kept them on the stack (a load and a store per row and block), past what its
 * scalar replacement of aggregates takes on. */
#define EACH_ROW(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)

/* One group of 16 activation rows (rows past `group` are zeros) against tile `tile`, whose B
 * tiles are built -> y for the group's rows: each row's 16 sums accumulated across the blocks
 * in the vector kernel's order (acc = fma(d_w d_x, sum, acc) block by block; the m terms,
 * fma(m_w, s_x, macc) block by block, summed apart and added), so the numbers are the vector
 * kernel's. `scales`, `row_sums`: d_x and s_x by row group, block and row. */
static void row_group(int kind, const uint8_t *tile, const int8_t *btiles, int64_t nb, int64_t in,
                      const int8_t *a_hi, const uint8_t *a_lo, int64_t r0, int64_t group, int32_t *sums,
                      const float *scales, const float *row_sums, float *totals,
                      const float *bias, float *y, int64_t out, int64_t t, int valid) {
    const int64_t tb_bytes = tile_block_bytes(kind);
    const int code_bytes = kind == KIND_Q4 ? 256 : 512;
#define ZERO(i) __m512 acc##i = _mm512_setzero_ps();
    EACH_ROW(ZERO)
    const int8_t *hi = a_hi + r0 * in;
    const uint8_t *lo = a_lo + r0 * in;
    for (int64_t b = 0; b < AHEAD && b < nb; b++) block_sums(hi + b * QK, lo + b * QK, in, btiles + b * 512, sums + b * 512);
    for (int64_t b = 0; b < nb; b++) {
        const int64_t next = b + AHEAD;
        if (next < nb) block_sums(hi + next * QK, lo + next * QK, in, btiles + next * 512, sums + (next % (AHEAD + 1)) * 512);
        const int32_t *s = sums + (b % (AHEAD + 1)) * 512;
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tile + b * tb_bytes + code_bytes)));
        const float *sc = scales + (r0 / AMX_ROWS * nb + b) * AMX_ROWS;
#define SCALE(i)                                                                                          \
        acc##i = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(sc[i])),                               \
                                 _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(_mm512_loadu_si512(s + 16 * i), 8), \
                                                                     _mm512_loadu_si512(s + 256 + 16 * i))),      \
                                 acc##i);
        EACH_ROW(SCALE)
    }
    if (kind == KIND_Q4) { /* the m terms, apart: 16 more independent sums */
#define KEEP(i) _mm512_storeu_ps(totals + 16 * i, acc##i); acc##i = _mm512_setzero_ps();
        EACH_ROW(KEEP)
        for (int64_t b = 0; b < nb; b++) {
            const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tile + b * tb_bytes + code_bytes + 32)));
            const float *sb = row_sums + (r0 / AMX_ROWS * nb + b) * AMX_ROWS;
#define M_TERM(i) acc##i = _mm512_fmadd_ps(mw, _mm512_set1_ps(sb[i]), acc##i);
            EACH_ROW(M_TERM)
        }
#define JOIN(i) acc##i = _mm512_add_ps(_mm512_loadu_ps(totals + 16 * i), acc##i);
        EACH_ROW(JOIN)
    }
    float rows[AMX_ROWS][TILE];
#define OUT(i) _mm512_storeu_ps(rows[i], acc##i);
    EACH_ROW(OUT)
    for (int64_t i = 0; i < group; i++)
        for (int j = 0; j < valid; j++) y[(r0 + i) * out + t * TILE + j] = rows[i][j] + (bias ? bias[t * TILE + j] : 0.0f);
#undef ZERO
#undef SCALE
#undef KEEP
#undef M_TERM
#undef JOIN
#undef OUT
}

/* Called by every thread of an enclosing parallel region (work-sharing loops inside): y[rows,
 * out] for tiles w, activations already quantized (xq, dx, sx as in gguf_cpu.c). */
void nls_amx_matmul_shared(int kind, const uint8_t *w, int64_t out, int64_t in, const int16_t *xq,
                           const float *dx, const float *sx, int64_t rows, const float *bias, float *y,
                           uint8_t *work) {
    const int64_t nb = in / QK, tiles = (out + TILE - 1) / TILE, padded = round_up(rows, AMX_ROWS);
    const int64_t tb_bytes = tile_block_bytes(kind);
    int8_t *a_hi = (int8_t *)work;
    uint8_t *a_lo = (uint8_t *)(a_hi + padded * in);
    float *scales = (float *)round_up((intptr_t)(a_lo + padded * in), 64);
    float *row_sums = scales + padded * nb;
    uint8_t *mine = (uint8_t *)round_up((intptr_t)(row_sums + padded * nb), 64) +
                    (int64_t)omp_get_thread_num() * thread_bytes(nb);
    int8_t *btiles = (int8_t *)mine;
    int32_t *sums = (int32_t *)(mine + nb * 512);
    float *totals = (float *)(sums + (AHEAD + 1) * 512);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < padded; r++)
        for (int64_t i = 0; i < in; i++) {
            const int16_t v = r < rows ? xq[r * in + i] : 0;
            a_hi[r * in + i] = (int8_t)(v >> 8);
            a_lo[r * in + i] = (uint8_t)(v & 0xFF);
        }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < padded; r++)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t at = ((r / AMX_ROWS) * nb + b) * AMX_ROWS + r % AMX_ROWS;
            scales[at] = r < rows ? dx[r * nb + b] : 0.0f;
            row_sums[at] = r < rows ? sx[r * nb + b] : 0.0f;
        }
    configure_tiles();
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *tile = w + t * nb * tb_bytes;
        const int valid = out - t * TILE < TILE ? (int)(out - t * TILE) : TILE;
        for (int64_t b = 0; b < nb; b++) weight_tile(kind, tile + b * tb_bytes, btiles + b * 512);
        for (int64_t r0 = 0; r0 < rows; r0 += AMX_ROWS)
            row_group(kind, tile, btiles, nb, in, a_hi, a_lo, r0, rows - r0 < AMX_ROWS ? rows - r0 : AMX_ROWS,
                      sums, scales, row_sums, totals, bias, y, out, t, valid);
    }
    _tile_release();
}

#else

int nls_amx_init(void) { return 0; } /* nothing to ask for without AMX tiles */

#endif
