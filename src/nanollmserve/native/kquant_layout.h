/* The K-quant tile layout (kquant_cpu.c's header comment has the byte map), shared by the
 * two sources that multiply it: kquant_cpu.c (int16 activations) and kquant_int8_cpu.c (int8
 * activations for the kinds of at most 6-bit codes, per 256 inputs for the super-block kinds
 * and per 32 for the others). Static inline helpers only. */
#ifndef NLS_KQUANT_LAYOUT_H
#define NLS_KQUANT_LAYOUT_H

#include <stdbool.h>
#include <string.h>

#include "native.h"

/* A kind's layout (the header comment): byte offsets and sizes. */
typedef struct {
    int bits;            /* of the widest code */
    int shift;           /* log2 of the tile-blocks per header: 3 with KQ_SUPER, else 0 */
    int64_t block;       /* bytes of a tile-block */
    int64_t header;      /* bytes of a header */
    int sc0, sc1, mn;    /* in a tile-block: the sub-scale rows of halves 0 and 1, mn (-1: none) */
    int dm, off;         /* in a header: dm (-1: none), off (d at 0) */
} kq_layout;

static inline bool kq_layout_of(int kind, kq_layout *L) {
    const int bits = kq_kind_bits(kind), flags = kq_kind_layout(kind);
    if (!bits) return false;
    const int two = (flags & KQ_TWO_SC) != 0, min = (flags & KQ_MIN) != 0;
    L->bits = bits;
    L->shift = flags & KQ_SUPER ? 3 : 0;
    L->sc0 = 256 + 64 * (bits - 4);
    L->sc1 = L->sc0 + 16 * two;
    L->mn = min ? L->sc1 + 16 : -1;
    L->block = L->sc1 + 16 + 16 * min;
    L->dm = min ? 32 : -1;
    L->off = 32 + 32 * min;
    L->header = L->shift ? (L->off + 16 + 31) / 32 * 32 : L->off + 16; /* a group's bytes a multiple of 32 */
    return true;
}

static inline bool kq_shape_ok(const kq_layout *L, int64_t in) {
    return in > 0 && in % QK == 0 && (in / QK) % ((int64_t)1 << L->shift) == 0;
}

/* What a layout without dm and mn reads for them: zeros (dm mn = +0). */
static const uint8_t kq_zeros[64] __attribute__((aligned(64))) = {0};

/* Where block b of a tile keeps its numbers. */
typedef struct {
    const uint8_t *codes, *sc0, *sc1, *mn, *d, *dm, *off;
} kq_block;

static inline __attribute__((always_inline)) kq_block kq_block_at(const kq_layout *L, const uint8_t *tile, int64_t b) {
    const int64_t g = b >> L->shift;
    const uint8_t *head = tile + g * (L->header + (L->block << L->shift));
    const uint8_t *tb = head + L->header + (b - (g << L->shift)) * L->block;
    const kq_block k = {tb, tb + L->sc0, tb + L->sc1, L->mn < 0 ? kq_zeros : tb + L->mn,
                        head, L->dm < 0 ? kq_zeros : head + L->dm, head + L->off};
    return k;
}

static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}

/* Output o's code for input j (0..31) of a tile-block, all its bits. */
static inline int kq_code(const uint8_t *tb, int bits, int o, int j) {
    const int half = j >= 16, jj = j - 16 * half, g = jj / 2, i = jj % 2;
    const uint8_t byte = tb[32 * g + 2 * o + i];
    int q = half ? byte >> 4 : byte & 15;
    const int p = g + 8 * half;
    for (int k = 0; k < bits - 4; k++) {
        uint32_t word;
        memcpy(&word, tb + 256 + 64 * k + 4 * p, sizeof word);
        q |= (int)((word >> (2 * o + i)) & 1u) << (4 + k);
    }
    return q;
}

static inline int64_t kq_round_up_64(int64_t n) { return (n + 63) / 64 * 64; }

/* kquant_int8_cpu.c: the kinds of at most 6-bit codes with int8 activations per 256 or 32
 * inputs, and the C twin of its Q8_0 (KIND_Q8) products. */
bool kq8_runs(const kq_layout *L);
int kq8_ref_rows(const kq_layout *L, const uint8_t *w, int64_t out, int64_t in, const int16_t *xq, const float *dx,
                 int64_t rows, float *y);
bool kq8_matmul_shared(const kq_layout *L, const uint8_t *w, int64_t out, int64_t in, const int16_t *xq,
                       const float *dx, int64_t rows, float *acc, float *y);
int q8i8_ref_rows(const uint8_t *w, int64_t out, int64_t in, const int16_t *xq, const float *dx, int64_t rows,
                  float *y);

#endif
