/* The multiply-add peaks scripts/kernel_peak.py compares the block kernels with: one thread,
 * independent multiply-adds of the instruction a build's vector kernel uses (vpmaddwd +
 * vpaddd on ymm for AVX2, vpdpwssd on zmm with AVX-512 VNNI) and, built with AMX, tdpbssd.
 * Prints one JSON object (GMAC/s). */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
#define LOOPS 50000000L
/* Inline assembly, so that the compiler can neither fold the equal products of one pass into
 * one nor keep the accumulators in memory: 10 independent accumulators (registers 0-9), the
 * operands in registers 14 and 15. */
#define MADD(j, t) "vpmaddwd %%ymm14, %%ymm15, %%ymm1" #t "\n\tvpaddd %%ymm1" #t ", %%ymm" #j ", %%ymm" #j "\n\t"
#define DPWSSD(j) "vpdpwssd %%zmm14, %%zmm15, %%zmm" #j "\n\t"
int main(void) {
    double start, seconds;
    start = now();
    for (long i = 0; i < LOOPS; i++) {
#if defined(__AVX512VNNI__)
        __asm__ volatile(DPWSSD(0) DPWSSD(1) DPWSSD(2) DPWSSD(3) DPWSSD(4) DPWSSD(5) DPWSSD(6) DPWSSD(7)
                         DPWSSD(8) DPWSSD(9) ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6",
                         "xmm7", "xmm8", "xmm9");
#else
        __asm__ volatile(MADD(0, 0) MADD(1, 1) MADD(2, 2) MADD(3, 3) MADD(4, 0) MADD(5, 1) MADD(6, 2)
                         MADD(7, 3) MADD(8, 0) MADD(9, 1) ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5",
                         "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13");
#endif
    }
    seconds = now() - start;
#if defined(__AVX512VNNI__)
    printf("{\"instruction\": \"vpdpwssd zmm\", \"gmac_s\": %.2f", 10 * LOOPS * 32.0 / seconds / 1e9);
#else
    printf("{\"instruction\": \"vpmaddwd + vpaddd ymm\", \"gmac_s\": %.2f", 10 * LOOPS * 16.0 / seconds / 1e9);
#endif
#if defined(__AMX_INT8__)
    if (syscall(SYS_arch_prctl, 0x1023, 18) == 0) {
        struct { unsigned char palette, start_row, reserved[14]; unsigned short colsb[16]; unsigned char rows[16]; } cfg = {0};
        cfg.palette = 1;
        for (int t = 0; t < 6; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
        _tile_loadconfig(&cfg);
        static signed char a[16 * 64], b[16 * 64];
        _tile_loadd(4, a, 64);
        _tile_loadd(5, b, 64);
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        const long tiles = LOOPS / 4;
        start = now();
        for (long i = 0; i < tiles; i++) {
            _tile_dpbssd(0, 4, 5); _tile_dpbssd(1, 4, 5); _tile_dpbssd(2, 4, 5); _tile_dpbssd(3, 4, 5);
        }
        seconds = now() - start;
        _tile_release();
        printf(", \"amx_instruction\": \"tdpbssd\", \"amx_gmac_s\": %.2f", tiles * 4 * 16384.0 / seconds / 1e9);
    }
#endif
    printf("}\n");
    return 0;
}
