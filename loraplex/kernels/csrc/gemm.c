/* y = x @ W (+ bias) in fp32 with W pre-packed in column panels, for decode-sized batches.
 *
 * At 1 to ~100 rows a linear layer is bound by streaming its weight from memory, and a BLAS
 * sgemm pays there for packing W on every call and for prefetching too little of it: on the
 * 2-core CI machine MKL reaches 40-130 GFLOP/s at 8-32 rows where this kernel reaches 80-155.
 * loraplex packs each weight once at load time and calls this up to PACKED_MAX_ROWS rows
 * (loraplex/kernels/packed_gemm.py); larger batches (prefill chunks) go to torch.
 *
 * Packed layout: W [K, N] becomes [ceil(N / LP_NR)][K][LP_NR], column panels of LP_NR (two
 * vectors) with the rows of each panel contiguous; the last panel is zero-padded. One register
 * tile is LP_MR rows x LP_NR columns, summed over all of K (no K blocking: K * LP_NR floats of
 * a panel stay in L2), and the panel is prefetched LP_PREFETCH rows ahead.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "lp_lora.h"
#include "lp_simd.h"

#if LP_VL == 16
#define LP_MR 12 /* 24 accumulators + 2 panel vectors + 1 broadcast of 32 registers */
#else
#define LP_MR 6  /* 12 + 2 + 1 of 16 */
#endif
#define LP_NR (2 * LP_VL)
#define LP_PREFETCH 32 /* panel rows: 4 KB ahead with AVX-512 */
#define LP_GEMM_PAR_MIN 65536 /* multiply-adds below which one thread does it all */

int lp_gemm_panel_width(void) { return LP_NR; }

/* rows [0, mr) of y[:, cols) = x[0:mr] @ panel (+ bias) with ncols <= LP_NR valid columns */
static inline __attribute__((always_inline)) void lp_gemm_tile(
    const int mr, int64_t k_len, const float *restrict x, int64_t ldx, const float *restrict panel,
    const float *pf, const float *restrict bias, float *restrict y, int64_t ldy, int64_t ncols) {
    lp_vf c0[LP_MR], c1[LP_MR];
    lp_vf init0 = {0}, init1 = {0};
    if (bias != NULL) {
        float b[LP_NR] = {0};
        memcpy(b, bias, (size_t)ncols * sizeof(float));
        init0 = lp_ld(b);
        init1 = lp_ld(b + LP_VL);
    }
#pragma GCC unroll 16
    for (int i = 0; i < mr; i++) {
        c0[i] = init0;
        c1[i] = init1;
    }
    for (int64_t k = 0; k < k_len; k++) {
        const float *row = panel + k * LP_NR;
        if (pf != NULL) {
            __builtin_prefetch(pf + k * LP_NR, 0, 3);
            __builtin_prefetch(pf + k * LP_NR + LP_VL, 0, 3);
        }
        const lp_vf b0 = lp_ld(row), b1 = lp_ld(row + LP_VL);
#pragma GCC unroll 16
        for (int i = 0; i < mr; i++) {
            const float a = x[i * ldx + k];
            c0[i] += a * b0;
            c1[i] += a * b1;
        }
    }
    if (ncols == LP_NR) {
#pragma GCC unroll 16
        for (int i = 0; i < mr; i++) {
            lp_st(y + i * ldy, c0[i]);
            lp_st(y + i * ldy + LP_VL, c1[i]);
        }
    } else {
        for (int i = 0; i < mr; i++) {
            float t[LP_NR];
            lp_st(t, c0[i]);
            lp_st(t + LP_VL, c1[i]);
            memcpy(y + i * ldy, t, (size_t)ncols * sizeof(float));
        }
    }
}

/* one tile with mr a compile-time constant, so that the accumulators live in registers */
static void lp_gemm_tile_rows(int mr, int64_t k_len, const float *x, int64_t ldx,
                              const float *panel, const float *pf, const float *bias, float *y,
                              int64_t ldy, int64_t ncols) {
    switch (mr) {
#define LP_TILE_CASE(m)                                                      \
    case m:                                                                  \
        lp_gemm_tile(m, k_len, x, ldx, panel, pf, bias, y, ldy, ncols); \
        break;
        LP_TILE_CASE(1) LP_TILE_CASE(2) LP_TILE_CASE(3) LP_TILE_CASE(4) LP_TILE_CASE(5)
        LP_TILE_CASE(6)
#if LP_MR > 6
        LP_TILE_CASE(7) LP_TILE_CASE(8) LP_TILE_CASE(9) LP_TILE_CASE(10) LP_TILE_CASE(11)
        LP_TILE_CASE(12)
#endif
#undef LP_TILE_CASE
        default:
            break;
    }
}

/* y[m, n] = x[m, k] @ W + bias, W packed as described above (lp_gemm_panel_width() columns per
 * panel). x rows ldx apart, y rows ldy apart, bias [n] or NULL. Panels are split between
 * threads; the rows are cut into near-equal tiles of at most LP_MR.
 * Returns 0, or -1 when an argument is out of range (nothing written). */
/* Panel p of y = x @ W (+ bias): every row tile. */
static inline void lp_gemm_panel(int64_t p, int64_t m, int64_t n, int64_t k, const float *x,
                                 int64_t ldx, const float *packed, const float *bias, float *y,
                                 int64_t ldy) {
    const int64_t tiles = (m + LP_MR - 1) / LP_MR;
    const int64_t col = p * LP_NR;
    const int64_t ncols = n - col < LP_NR ? n - col : LP_NR;
    const float *panel = packed + p * k * LP_NR;
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t r0 = t * m / tiles, r1 = (t + 1) * m / tiles;
        /* the first tile streams the panel from memory, prefetching its rows ahead and on
         * into the next panel; the later tiles find it in L2. (Prefetching the next panel
         * from the second tile measured no faster.) */
        const float *pf = t == 0 ? panel + LP_PREFETCH * LP_NR : NULL;
        lp_gemm_tile_rows((int)(r1 - r0), k, x + r0 * ldx, ldx, panel, pf,
                          bias != NULL ? bias + col : NULL, y + r0 * ldy + col, ldy, ncols);
    }
}

int lp_gemm_packed(int64_t m, int64_t n, int64_t k, const float *x, int64_t ldx,
                   const float *packed, const float *bias, float *y, int64_t ldy,
                   int num_threads) {
    if (m < 0 || n < 0 || k < 0 || ldx < k || ldy < n) return -1;
    if (m == 0 || n == 0) return 0;
    const int64_t panels = (n + LP_NR - 1) / LP_NR;
    const int threads = m * n * k < LP_GEMM_PAR_MIN ? 1 : num_threads;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) lp_gemm_panel(p, m, n, k, x, ldx, packed, bias, y, ldy);
    return 0;
}

/* lp_gemm_packed, then lora's delta added to the same y (lp_lora_add_call(lora); lora->y must be
 * y), in one parallel region. At decode-sized batches the GEMM is compute-bound and leaves most
 * of the memory bandwidth idle, while the LoRA tiles, rows at scattered pages, are bound by
 * memory latency: so each thread fetches its share of the LoRA rows into L2 a few at a time
 * between its GEMM panels, and computes those tiles from cache after the barrier. Every slot,
 * rank and page is checked before anything is written: -1 leaves y untouched. */
int lp_gemm_packed_lora(int64_t m, int64_t n, int64_t k, const float *x, int64_t ldx,
                        const float *packed, const float *bias, float *y, int64_t ldy,
                        int num_threads, const lp_lora_call *lora) {
    if (lora == NULL) return lp_gemm_packed(m, n, k, x, ldx, packed, bias, y, ldy, num_threads);
    if (m < 0 || n < 0 || k < 0 || ldx < k || ldy < n || lora->y != y) return -1;
    if (lora->num_tokens != m) return -1;
    if (m == 0 || n == 0) return 0;
    int64_t *tiles = NULL;
    const int64_t num_tiles = lp_lora_plan(lora, &tiles);
    if (num_tiles < 0) return -1;
    const int64_t panels = (n + LP_NR - 1) / LP_NR;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t p0 = id * panels / nt, p1 = (id + 1) * panels / nt, mine_p = p1 - p0;
        const int64_t mine = num_tiles > id ? (num_tiles - id + nt - 1) / nt : 0;
        int64_t fetched = 0; /* this thread's tiles id, id + nt, ... fetched so far */
        for (int64_t p = p0; p < p1; p++) {
            lp_gemm_panel(p, m, n, k, x, ldx, packed, bias, y, ldy);
            const int64_t want = (mine * (p - p0 + 1) + mine_p - 1) / mine_p;
            for (; fetched < want; fetched++) lp_lora_fetch_tile(lora, tiles, id + fetched * nt);
        }
#pragma omp barrier
        for (int64_t q = id; q < num_tiles; q += nt) lp_lora_do_tile(lora, tiles, q);
    }
    free(tiles);
    return 0;
}
