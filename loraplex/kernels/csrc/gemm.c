/* y = x @ W (+ bias) in fp32 with W pre-packed in column panels.
 *
 * At 1 to ~100 rows a linear layer is bound by streaming its weight from memory, and a BLAS
 * sgemm pays there for packing W on every call and for prefetching too little of it, and this
 * kernel is ahead of MKL there (`python -m benchmarks.gemm --rows 1,8,16,32`; figures in
 * docs/benchmarks.md).
 * loraplex packs each weight once at load time and calls this up to packed_gemm.max_rows()
 * rows (loraplex/kernels/packed_gemm.py: every batch on AVX2 builds, where it is ahead of MKL
 * at prefill sizes too; up to 128 rows on AVX-512 ones); larger batches go to torch.
 *
 * Packed layout: W [K, N] becomes [ceil(N / LP_NR)][K][LP_NR], column panels of LP_NR (two
 * vectors) with the rows of each panel contiguous; the last panel is zero-padded. One register
 * tile is LP_MR rows x LP_NR columns, summed over all of K (no K blocking: K * LP_NR floats of
 * a panel stay in L2). One tile streams its panel, prefetching LP_PREFETCH rows ahead; several
 * tiles compute from L2 while fetching the next panel (lp_gemm_panel), and read x packed into
 * tile order (lp_gemm_pack_x); both raise the kernel's GFLOP/s at 16-128 rows, weights cold
 * (`python -m benchmarks.gemm`, on builds with and without them).
 * With AVX-512 a tile has 14 rows (28 of the 32 vector registers accumulate): on an Intel Xeon
 * with 2 MB of L2 per core the base workload ran faster than with 12 (`python -m
 * benchmarks.ab_trees --old REV`, REV a tree with 12), from fewer tiles, each re-reading its
 * panel from L2, at 13-64 rows. There, reading the weights barely overlaps the arithmetic: a
 * call takes about the sum of the two, so fewer instructions per panel show up directly. 14 rows
 * are not measured on AMD EPYC.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "lp_lora.h"
#include "lp_simd.h"

#if LP_VL == 16
#define LP_MR 14 /* 28 accumulators + 2 panel vectors + 1 broadcast of 32 registers */
#else
#define LP_MR 6  /* 12 + 2 + 1 of 16 */
#endif
#define LP_NR (2 * LP_VL)
#define LP_PREFETCH 32 /* panel rows: 4 KB ahead with AVX-512 */
#define LP_GEMM_PAR_MIN 65536 /* multiply-adds below which one thread does it all */

int lp_gemm_panel_width(void) { return LP_NR; }

/* The first ncols <= LP_NR entries of bias (zeros after them; all zero without a bias) as the
 * two vectors a tile's accumulators start from */
static inline void lp_tile_bias(const float *bias, int64_t ncols, lp_vf *init0, lp_vf *init1) {
    float b[LP_NR] = {0};
    if (bias != NULL) memcpy(b, bias, (size_t)ncols * sizeof(float));
    *init0 = lp_ld(b);
    *init1 = lp_ld(b + LP_VL);
}

/* Columns [0, ncols) of one accumulator pair into the row at y */
static inline void lp_tile_store(float *y, lp_vf c0, lp_vf c1, int64_t ncols) {
    if (ncols == LP_NR) {
        lp_st(y, c0);
        lp_st(y + LP_VL, c1);
        return;
    }
    float t[LP_NR];
    lp_st(t, c0);
    lp_st(t + LP_VL, c1);
    memcpy(y, t, (size_t)ncols * sizeof(float));
}

/* rows [0, mr) of y[:, cols) = x[0:mr] @ panel (+ bias) with ncols <= LP_NR valid columns.
 * x is row-major with rows ldx apart, or with xt a packed tile: element (i, k) at
 * x[k * LP_MR + i], so that its broadcasts are one pointer and constant offsets (row pointers
 * need more registers than the 27 the tile's vectors leave free: the compiler spilled them). */
static inline __attribute__((always_inline)) void lp_gemm_tile(
    const int mr, const int xt, int64_t k_len, const float *restrict x, int64_t ldx,
    const float *restrict panel, const float *pf, const float *spread, int64_t spread_rows,
    const float *restrict bias, float *restrict y, int64_t ldy, int64_t ncols) {
    lp_vf c0[LP_MR], c1[LP_MR], init0, init1;
    lp_tile_bias(bias, ncols, &init0, &init1);
#pragma GCC unroll 16
    for (int i = 0; i < mr; i++) {
        c0[i] = init0;
        c1[i] = init1;
    }
    int64_t due = 0; /* spread: rows [0, spread_rows) fetched evenly over the k loop */
    for (int64_t k = 0; k < k_len; k++) {
        const float *row = panel + k * LP_NR;
        if (pf != NULL) {
            __builtin_prefetch(pf + k * LP_NR, 0, 3);
            __builtin_prefetch(pf + k * LP_NR + LP_VL, 0, 3);
        }
        due += spread_rows;
        if (spread != NULL && due >= k_len) {
            due -= k_len;
            __builtin_prefetch(spread, 0, 2);
            __builtin_prefetch(spread + LP_VL, 0, 2);
            spread += LP_NR;
        }
        const lp_vf b0 = lp_ld(row), b1 = lp_ld(row + LP_VL);
#pragma GCC unroll 16
        for (int i = 0; i < mr; i++) {
            const float a = xt ? x[k * LP_MR + i] : x[i * ldx + k];
            c0[i] += a * b0;
            c1[i] += a * b1;
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < mr; i++) lp_tile_store(y + i * ldy, c0[i], c1[i], ncols);
}

/* one tile with mr a compile-time constant, so that the accumulators live in registers */
static void lp_gemm_tile_rows(int mr, int xt, int64_t k_len, const float *x, int64_t ldx,
                              const float *panel, const float *pf, const float *spread,
                              int64_t spread_rows, const float *bias, float *y, int64_t ldy,
                              int64_t ncols) {
    switch (mr) {
#define LP_TILE_CASE(m)                                                                       \
    case m:                                                                                   \
        if (xt)                                                                               \
            lp_gemm_tile(m, 1, k_len, x, ldx, panel, pf, spread, spread_rows, bias, y, ldy,   \
                         ncols);                                                              \
        else                                                                                  \
            lp_gemm_tile(m, 0, k_len, x, ldx, panel, pf, spread, spread_rows, bias, y, ldy,   \
                         ncols);                                                              \
        break;
        LP_TILE_CASE(1) LP_TILE_CASE(2) LP_TILE_CASE(3) LP_TILE_CASE(4) LP_TILE_CASE(5)
        LP_TILE_CASE(6)
#if LP_MR > 6
        LP_TILE_CASE(7) LP_TILE_CASE(8) LP_TILE_CASE(9) LP_TILE_CASE(10) LP_TILE_CASE(11)
        LP_TILE_CASE(12) LP_TILE_CASE(13) LP_TILE_CASE(14)
#endif
#undef LP_TILE_CASE
        default:
            break;
    }
}

/* Panel p of y = x @ W (+ bias): every row tile. With one tile, the tile streams the panel from
 * memory, prefetching LP_PREFETCH rows ahead (and on into the next panel). With several, the
 * tiles find the panel in L2 and each fetches its share of the next panel's rows into L2 while
 * it computes, so that reading the weights overlaps the arithmetic across the whole panel
 * instead of stalling its first tile; only a thread's first panel (`first`) is streamed by its
 * first tile. `next` is the panel to fetch, NULL for none. `xt`: x packed by lp_gemm_pack_x,
 * or NULL to read x in place. */
static inline void lp_gemm_panel(int64_t p, int64_t m, int64_t n, int64_t k, const float *x,
                                 int64_t ldx, const float *xt, const float *packed,
                                 const float *bias, float *y, int64_t ldy, int first,
                                 const float *next) {
    const int64_t tiles = (m + LP_MR - 1) / LP_MR;
    const int64_t col = p * LP_NR;
    const int64_t ncols = n - col < LP_NR ? n - col : LP_NR;
    const float *panel = packed + p * k * LP_NR;
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t r0 = t * m / tiles, r1 = (t + 1) * m / tiles;
        const int stream = tiles == 1 || (first && t == 0);
        const float *pf = stream ? panel + LP_PREFETCH * LP_NR : NULL;
        /* rows [s0, s1) of the next panel are this tile's share */
        const int64_t s0 = t * k / tiles, s1 = (t + 1) * k / tiles;
        const float *spread = stream || next == NULL ? NULL : next + s0 * LP_NR;
        const float *xs = xt != NULL ? xt + t * k * LP_MR : x + r0 * ldx;
        lp_gemm_tile_rows((int)(r1 - r0), xt != NULL, k, xs, ldx, panel, pf, spread, s1 - s0,
                          bias != NULL ? bias + col : NULL, y + r0 * ldy + col, ldy, ncols);
    }
}

/* ---- 1 to LP_FEW_ROWS rows: several panels at once ----
 * A tile of one row that streams one panel keeps two accumulators, each a chain of dependent
 * FMAs, and one read stream per thread: on AMD EPYC (Zen 2, AVX2) that read SmolLM2's weights
 * well below a plain read's bandwidth. A few-row tile takes g consecutive
 * panels at once instead (g read streams, 2 * rows * g independent accumulators, each stream
 * prefetched LP_FEW_PREFETCH rows ahead): 1 row 4 panels, 2 rows 3, 3 rows 2, which reads
 * them close to that bandwidth (`python -m benchmarks.gemm --rows 1,2,3`, A/B of the builds). */
#define LP_FEW_ROWS 3
#define LP_FEW_PAIRS 6    /* rows * panels: 12 accumulators of the 16 AVX2 registers */
#define LP_FEW_PREFETCH 8 /* panel rows ahead in each stream */

/* Rows [0, mr) of y for the g panels from `panel` on (pstride floats apart); columns from col
 * of n. mr and g are compile-time constants at every call (lp_few_group). */
static inline __attribute__((always_inline)) void lp_few_tile(
    const int mr, const int g, int64_t k, const float *restrict x, int64_t ldx,
    const float *restrict panel, int64_t pstride, const float *restrict bias, float *restrict y,
    int64_t ldy, int64_t col, int64_t n) {
    lp_vf c0[LP_FEW_PAIRS], c1[LP_FEW_PAIRS]; /* [s * mr + i]: panel s, row i */
#pragma GCC unroll 8
    for (int s = 0; s < g; s++) {
        const int64_t c = col + s * LP_NR, ncols = n - c < LP_NR ? n - c : LP_NR;
        lp_vf init0, init1;
        lp_tile_bias(bias != NULL ? bias + c : NULL, ncols, &init0, &init1);
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++) {
            c0[s * mr + i] = init0;
            c1[s * mr + i] = init1;
        }
    }
    for (int64_t kk = 0; kk < k; kk++) {
#pragma GCC unroll 8
        for (int s = 0; s < g; s++) {
            const float *row = panel + s * pstride + kk * LP_NR;
            __builtin_prefetch(row + LP_FEW_PREFETCH * LP_NR, 0, 3);
#if LP_VL == 16 /* a panel row is two cache lines */
            __builtin_prefetch(row + LP_FEW_PREFETCH * LP_NR + LP_VL, 0, 3);
#endif
            const lp_vf b0 = lp_ld(row), b1 = lp_ld(row + LP_VL);
#pragma GCC unroll 8
            for (int i = 0; i < mr; i++) {
                const float a = x[i * ldx + kk];
                c0[s * mr + i] += a * b0;
                c1[s * mr + i] += a * b1;
            }
        }
    }
#pragma GCC unroll 8
    for (int s = 0; s < g; s++) {
        const int64_t c = col + s * LP_NR, ncols = n - c < LP_NR ? n - c : LP_NR;
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++)
            lp_tile_store(y + i * ldy + c, c0[s * mr + i], c1[s * mr + i], ncols);
    }
}

/* Panels per few-row group at mr rows */
static inline int64_t lp_few_group_panels(int64_t mr) { return mr == 1 ? 4 : mr == 2 ? 3 : 2; }

/* Panels [p, p + g) of y at mr <= LP_FEW_ROWS rows, g <= lp_few_group_panels(mr) */
static void lp_few_group(int64_t p, int64_t g, int64_t mr, int64_t n, int64_t k, const float *x,
                         int64_t ldx, const float *packed, const float *bias, float *y,
                         int64_t ldy) {
    const int64_t pstride = k * LP_NR, col = p * LP_NR;
    const float *panel = packed + p * pstride;
    switch (mr * 8 + g) {
#define LP_FEW_CASE(rows, panels)                                                             \
    case rows * 8 + panels:                                                                   \
        lp_few_tile(rows, panels, k, x, ldx, panel, pstride, bias, y, ldy, col, n);           \
        break;
        LP_FEW_CASE(1, 1) LP_FEW_CASE(1, 2) LP_FEW_CASE(1, 3) LP_FEW_CASE(1, 4)
        LP_FEW_CASE(2, 1) LP_FEW_CASE(2, 2) LP_FEW_CASE(2, 3)
        LP_FEW_CASE(3, 1) LP_FEW_CASE(3, 2)
#undef LP_FEW_CASE
        default:
            break;
    }
}

/* From panel p (of a thread's [p, p1)): one panel, or at m <= LP_FEW_ROWS one group of them.
 * Returns the number of panels done. */
static int64_t lp_gemm_step(int64_t p, int64_t p0, int64_t p1, int64_t m, int64_t n, int64_t k,
                            const float *x, int64_t ldx, const float *xt, const float *packed,
                            const float *bias, float *y, int64_t ldy) {
    if (m <= LP_FEW_ROWS) {
        const int64_t group = lp_few_group_panels(m), g = p1 - p < group ? p1 - p : group;
        lp_few_group(p, g, m, n, k, x, ldx, packed, bias, y, ldy);
        return g;
    }
    const float *next = p + 1 < p1 ? packed + (p + 1) * k * LP_NR : NULL;
    lp_gemm_panel(p, m, n, k, x, ldx, xt, packed, bias, y, ldy, p == p0, next);
    return 1;
}

/* Panels [p0, p1) of y, one thread's share. */
static void lp_gemm_panels(int64_t p0, int64_t p1, int64_t m, int64_t n, int64_t k,
                           const float *x, int64_t ldx, const float *xt, const float *packed,
                           const float *bias, float *y, int64_t ldy) {
    for (int64_t p = p0; p < p1;)
        p += lp_gemm_step(p, p0, p1, m, n, k, x, ldx, xt, packed, bias, y, ldy);
}

/* Row tile t of x [m, k] (rows ldx apart) into xt + t * k * LP_MR, element (i, k) at
 * [k * LP_MR + i]: the layout lp_gemm_tile reads with xt set. Every panel reuses it. */
static void lp_gemm_pack_x(int64_t t, int64_t m, int64_t k, const float *x, int64_t ldx,
                           float *xt) {
    const int64_t tiles = (m + LP_MR - 1) / LP_MR;
    const int64_t r0 = t * m / tiles, r1 = (t + 1) * m / tiles;
    float *dst = xt + t * k * LP_MR;
    for (int64_t i = r0; i < r1; i++) {
        const float *src = x + i * ldx;
        for (int64_t j = 0; j < k; j++) dst[j * LP_MR + (i - r0)] = src[j];
    }
}

/* The calling thread's buffer of at least `floats` floats for packed x (grown, never shrunk;
 * one per thread that calls in), or NULL when out of memory. */
static float *lp_gemm_x_buffer(int64_t floats) {
    static __thread float *buffer = NULL;
    static __thread int64_t capacity = 0;
    if (floats > capacity) {
        free(buffer);
        const size_t bytes = ((size_t)floats * sizeof(float) + 63) / 64 * 64;
        buffer = aligned_alloc(64, bytes);
        capacity = buffer != NULL ? floats : 0;
    }
    return buffer;
}

/* x packed (lp_gemm_pack_x) when it has more than one row tile, else NULL: one tile streams the
 * weights from memory and is bound by that, not by its broadcasts. */
static float *lp_gemm_x_packing(int64_t m, int64_t k) {
    const int64_t tiles = (m + LP_MR - 1) / LP_MR;
    return tiles > 1 ? lp_gemm_x_buffer(tiles * k * LP_MR) : NULL;
}

/* Inside a parallel region: this thread's share of packing x into xt (if xt), then a barrier. */
static void lp_gemm_pack_x_shared(int64_t m, int64_t k, const float *x, int64_t ldx, float *xt) {
    if (xt == NULL) return;
    const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t tiles = (m + LP_MR - 1) / LP_MR;
    for (int64_t t = id; t < tiles; t += nt) lp_gemm_pack_x(t, m, k, x, ldx, xt);
#pragma omp barrier
}

/* y[m, n] = x[m, k] @ W + bias, W packed as described above (lp_gemm_panel_width() columns per
 * panel). x rows ldx apart, y rows ldy apart, bias [n] or NULL. Each thread takes a contiguous
 * range of panels; the rows are cut into near-equal tiles of at most LP_MR.
 * Returns 0, or -1 when an argument is out of range (nothing written). */
int lp_gemm_packed(int64_t m, int64_t n, int64_t k, const float *x, int64_t ldx,
                   const float *packed, const float *bias, float *y, int64_t ldy,
                   int num_threads) {
    if (m < 0 || n < 0 || k < 0 || ldx < k || ldy < n) return -1;
    if (m == 0 || n == 0) return 0;
    const int64_t panels = (n + LP_NR - 1) / LP_NR;
    const int threads = m * n * k < LP_GEMM_PAR_MIN ? 1 : num_threads;
    float *xt = lp_gemm_x_packing(m, k);
#pragma omp parallel num_threads(threads)
    {
        lp_gemm_pack_x_shared(m, k, x, ldx, xt);
        const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
        lp_gemm_panels(id * panels / nt, (id + 1) * panels / nt, m, n, k, x, ldx, xt, packed,
                       bias, y, ldy);
    }
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
    float *xt = lp_gemm_x_packing(m, k);
#pragma omp parallel num_threads(num_threads)
    {
        lp_gemm_pack_x_shared(m, k, x, ldx, xt);
        const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t p0 = id * panels / nt, p1 = (id + 1) * panels / nt, mine_p = p1 - p0;
        const int64_t mine = num_tiles > id ? (num_tiles - id + nt - 1) / nt : 0;
        int64_t fetched = 0; /* this thread's tiles id, id + nt, ... fetched so far */
        for (int64_t p = p0; p < p1;) {
            p += lp_gemm_step(p, p0, p1, m, n, k, x, ldx, xt, packed, bias, y, ldy);
            const int64_t want = (mine * (p - p0) + mine_p - 1) / mine_p;
            for (; fetched < want; fetched++) lp_lora_fetch_tile(lora, tiles, id + fetched * nt);
        }
#pragma omp barrier
        for (int64_t q = id; q < num_tiles; q += nt) lp_lora_do_tile(lora, tiles, q);
    }
    free(tiles);
    return 0;
}
