/* y = x @ W (+ bias) with W packed once as bf16 pairs for AVX512-BF16, fp32 accumulation.
 *
 * The structure of gemm.c (read that first): column panels of LB_NR columns, register tiles of
 * LB_MR rows x LB_NR columns summed over all of K, the panel prefetched ahead, OpenMP over
 * panels, and at 1 to LB_FEW_ROWS rows several panels streamed at once. What differs is the
 * layout. vdpbf16ps (_mm512_dpbf16_ps) multiplies 16 bf16 pairs by 16 pairs and adds each
 * pair's two products into one fp32 lane, so a panel holds K in pairs:
 *
 *   panel p, columns [p*NR, p*NR + NR):  [K2][NR][2] bf16, K2 = ceil(K / 2)
 *   pair row kk:  W[2kk][c] W[2kk+1][c] W[2kk][c+1] W[2kk+1][c+1] ...  (NR pairs, 128 bytes)
 *   an odd K gets a zero row 2*K2-1; the last panel's columns past N are zeros.
 *
 * x (fp32) is rounded to bf16 once per call, to nearest even as torch's .bfloat16() does
 * (vcvtne2ps2bf16), into pairs (x[i][2kk], x[i][2kk+1]) of one 32-bit word each, which a tile
 * broadcasts to all 16 lanes; an odd K's last pair ends in a zero. A pair row is 128 bytes like
 * a row of an fp32 panel in gemm.c but covers two values of K: a call reads half the bytes,
 * and batch-1 decode, bound by reading the weights, can approach twice the fp32 kernel.
 *
 * Numerics: a product of two bf16 is exact in fp32 and every lane accumulates in fp32, so the
 * result is torch's F.linear(x.bfloat16().float(), W.bfloat16().float()) summed in another
 * order. Both instructions treat denormal inputs as zero and flush denormal results (magnitudes
 * below 2^-126), where torch keeps them.
 *
 * Without AVX512-BF16 in the build (-march=native on a CPU without it) only the queries are
 * compiled: lp_gemm_bf16_supported() is 0 and lp_gemm_packed_bf16 returns -1.
 * AMX-BF16 (Intel Sapphire Rapids on) is a later path, not built: it needs a machine to test
 * on. It could read these same panels: a tdpbf16ps B tile is 16 pair rows x 16 columns' pairs
 * (64 bytes a row), one half of a pair row here, loaded with a 128-byte stride.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef __AVX512BF16__
#include <immintrin.h>

#define LB_NR 32  /* columns per panel: two vectors of 16 fp32 accumulators */
#define LB_ROW 64 /* bf16 per pair row of a panel: LB_NR pairs, 128 bytes */
#define LB_MR 14  /* 28 accumulators + 2 panel vectors + 1 broadcast of 32 registers */
#define LB_PREFETCH 32 /* pair rows: 4 KB ahead */
#define LB_PAR_MIN 65536 /* multiply-adds below which one thread does it all */

int lp_gemm_bf16_supported(void) { return 1; }

int lp_gemm_bf16_panel_width(void) { return LB_NR; }

/* The first `cols` lanes of a vector (none for cols <= 0, all 16 from 16 on) */
static inline __mmask16 lb_mask(int64_t cols) {
    return cols >= 16 ? (__mmask16)0xFFFF : cols <= 0 ? 0 : (__mmask16)((1u << cols) - 1);
}

/* The two vectors a tile's accumulators start from: bias[0, ncols), zeros after */
static inline void lb_tile_bias(const float *bias, int64_t ncols, __m512 *init0, __m512 *init1) {
    if (bias == NULL) {
        *init0 = *init1 = _mm512_setzero_ps();
        return;
    }
    *init0 = _mm512_maskz_loadu_ps(lb_mask(ncols), bias); /* masked lanes are never read */
    *init1 = _mm512_maskz_loadu_ps(lb_mask(ncols - 16), bias + 16);
}

/* Columns [0, ncols) of one accumulator pair into the row at y */
static inline void lb_tile_store(float *y, __m512 c0, __m512 c1, int64_t ncols) {
    if (ncols == LB_NR) {
        _mm512_storeu_ps(y, c0);
        _mm512_storeu_ps(y + 16, c1);
        return;
    }
    _mm512_mask_storeu_ps(y, lb_mask(ncols), c0);
    _mm512_mask_storeu_ps(y + 16, lb_mask(ncols - 16), c1);
}

/* acc + the pair `x2` (two bf16 in one word) times each of w's 16 pairs, lane by lane */
static inline __attribute__((always_inline)) __m512 lb_dot(__m512 acc, uint32_t x2, __m512bh w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32((int)x2), w);
}

static inline __attribute__((always_inline)) __m512bh lb_ld(const uint16_t *p) {
    return (__m512bh)_mm512_loadu_si512(p);
}

/* ---- x to bf16 pairs ---- */

/* The k floats at src rounded to bf16 (nearest even) as ceil(k / 2) pairs into dst[kk * stride]:
 * stride 1 a row of pairs, LB_MR a column of a packed tile. */
static void lb_convert_row(const float *src, int64_t k, uint32_t *dst, int64_t stride) {
    const int64_t k2 = (k + 1) / 2;
    for (int64_t j = 0; j < k; j += 32) {
        const __m512 lo = _mm512_maskz_loadu_ps(lb_mask(k - j), src + j);
        const __m512 hi = _mm512_maskz_loadu_ps(lb_mask(k - j - 16), src + j + 16);
        /* bf16 of elements j .. j+31 (zeros past k), the low half from `lo`: 16 pairs */
        const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
        const int64_t kk = j / 2, pairs = k2 - kk < 16 ? k2 - kk : 16;
        if (stride == 1) {
            _mm512_mask_storeu_epi32(dst + kk, lb_mask(pairs), h);
            continue;
        }
        uint32_t t[16];
        _mm512_storeu_si512(t, h);
        for (int64_t q = 0; q < pairs; q++) dst[(kk + q) * stride] = t[q];
    }
}

/* The calling thread's buffer of at least `words` pairs (grown, never shrunk), or NULL when out
 * of memory */
static uint32_t *lb_x_buffer(int64_t words) {
    static __thread uint32_t *buffer = NULL;
    static __thread int64_t capacity = 0;
    if (words < 16) words = 16;
    if (words > capacity) {
        free(buffer);
        const size_t bytes = ((size_t)words * sizeof(uint32_t) + 63) / 64 * 64;
        buffer = aligned_alloc(64, bytes);
        capacity = buffer != NULL ? words : 0;
    }
    return buffer;
}

/* ---- LB_FEW_ROWS + 1 rows and more: register tiles ---- */

/* rows [0, mr) of y[:, cols) = x @ panel (+ bias), ncols <= LB_NR valid columns; xt a packed
 * tile: pair (i, kk) at xt[kk * LB_MR + i]. pf / spread / spread_rows as in gemm.c's tile. */
static inline __attribute__((always_inline)) void lb_tile(
    const int mr, int64_t k2, const uint32_t *restrict xt, const uint16_t *restrict panel,
    const uint16_t *pf, const uint16_t *spread, int64_t spread_rows, const float *restrict bias,
    float *restrict y, int64_t ldy, int64_t ncols) {
    __m512 c0[LB_MR], c1[LB_MR], init0, init1;
    lb_tile_bias(bias, ncols, &init0, &init1);
#pragma GCC unroll 16
    for (int i = 0; i < mr; i++) {
        c0[i] = init0;
        c1[i] = init1;
    }
    int64_t due = 0; /* spread: rows [0, spread_rows) fetched evenly over the kk loop */
    for (int64_t kk = 0; kk < k2; kk++) {
        const uint16_t *row = panel + kk * LB_ROW;
        if (pf != NULL) {
            __builtin_prefetch(pf + kk * LB_ROW, 0, 3);
            __builtin_prefetch(pf + kk * LB_ROW + 32, 0, 3);
        }
        due += spread_rows;
        if (spread != NULL && due >= k2) {
            due -= k2;
            __builtin_prefetch(spread, 0, 2);
            __builtin_prefetch(spread + 32, 0, 2);
            spread += LB_ROW;
        }
        const __m512bh b0 = lb_ld(row), b1 = lb_ld(row + 32);
#pragma GCC unroll 16
        for (int i = 0; i < mr; i++) {
            const uint32_t a = xt[kk * LB_MR + i];
            c0[i] = lb_dot(c0[i], a, b0);
            c1[i] = lb_dot(c1[i], a, b1);
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < mr; i++) lb_tile_store(y + i * ldy, c0[i], c1[i], ncols);
}

/* one tile with mr a compile-time constant, so that the accumulators live in registers */
static void lb_tile_rows(int mr, int64_t k2, const uint32_t *xt, const uint16_t *panel,
                         const uint16_t *pf, const uint16_t *spread, int64_t spread_rows,
                         const float *bias, float *y, int64_t ldy, int64_t ncols) {
    switch (mr) {
#define LB_TILE_CASE(m)                                                                       \
    case m:                                                                                   \
        lb_tile(m, k2, xt, panel, pf, spread, spread_rows, bias, y, ldy, ncols);              \
        break;
        LB_TILE_CASE(1) LB_TILE_CASE(2) LB_TILE_CASE(3) LB_TILE_CASE(4) LB_TILE_CASE(5)
        LB_TILE_CASE(6) LB_TILE_CASE(7) LB_TILE_CASE(8) LB_TILE_CASE(9) LB_TILE_CASE(10)
        LB_TILE_CASE(11) LB_TILE_CASE(12) LB_TILE_CASE(13) LB_TILE_CASE(14)
#undef LB_TILE_CASE
        default:
            break;
    }
}

/* Panel p, every row tile (gemm.c's lp_gemm_panel): one tile streams the panel from memory;
 * with several, each fetches its share of the `next` panel into L2 while the panel itself comes
 * from L2, except on a thread's `first` panel, streamed by its first tile. */
static void lb_panel(int64_t p, int64_t m, int64_t n, int64_t k2, const uint32_t *xt,
                     const uint16_t *packed, const float *bias, float *y, int64_t ldy,
                     int first, const uint16_t *next) {
    const int64_t tiles = (m + LB_MR - 1) / LB_MR;
    const int64_t col = p * LB_NR;
    const int64_t ncols = n - col < LB_NR ? n - col : LB_NR;
    const uint16_t *panel = packed + p * k2 * LB_ROW;
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t r0 = t * m / tiles, r1 = (t + 1) * m / tiles;
        const int stream = tiles == 1 || (first && t == 0);
        const uint16_t *pf = stream ? panel + LB_PREFETCH * LB_ROW : NULL;
        const int64_t s0 = t * k2 / tiles, s1 = (t + 1) * k2 / tiles;
        const uint16_t *spread = stream || next == NULL ? NULL : next + s0 * LB_ROW;
        lb_tile_rows((int)(r1 - r0), k2, xt + t * k2 * LB_MR, panel, pf, spread, s1 - s0,
                     bias != NULL ? bias + col : NULL, y + r0 * ldy + col, ldy, ncols);
    }
}

/* Row tile t of x [m, k] (rows ldx apart) as pairs into xt + t * k2 * LB_MR, pair (i, kk) at
 * [kk * LB_MR + i]: the layout lb_tile reads. Every panel reuses it. */
static void lb_pack_x(int64_t t, int64_t m, int64_t k, const float *x, int64_t ldx,
                      uint32_t *xt) {
    const int64_t tiles = (m + LB_MR - 1) / LB_MR, k2 = (k + 1) / 2;
    const int64_t r0 = t * m / tiles, r1 = (t + 1) * m / tiles;
    for (int64_t i = r0; i < r1; i++)
        lb_convert_row(x + i * ldx, k, xt + t * k2 * LB_MR + (i - r0), LB_MR);
}

/* ---- 1 to LB_FEW_ROWS rows: several panels at once ----
 * As in gemm.c: one tile streaming one panel keeps too few reads in flight to use the memory's
 * bandwidth, so a few-row tile takes g consecutive panels at once (g read streams,
 * 2 * rows * g independent accumulators, each stream prefetched LB_FEW_PREFETCH pair rows
 * ahead). With 32 vector registers that pays up to 6 rows here (gemm.c: 3): 1 row takes
 * 4 panels, 2 rows 3, 3 rows 4, 4 rows 3, 5-6 rows 2, chosen with paired single-thread runs of
 * build variants on SmolLM2's shapes, weights cold, on a 2-core AMD EPYC Zen 4. */
#define LB_FEW_ROWS 6
#define LB_FEW_PAIRS 12   /* rows * panels: 24 accumulators */
#define LB_FEW_PREFETCH 8 /* pair rows ahead in each stream */

/* Panels per few-row group at mr rows */
static inline int64_t lb_few_group_panels(int64_t mr) {
    static const int64_t panels[7] = {0, 4, 3, 4, 3, 2, 2};
    return panels[mr];
}

/* Rows [0, mr) of y for the g panels from `panel` on (pstride bf16 apart), columns from col of
 * n; xb rows of k2 pairs. mr and g are compile-time constants at every call (lb_few_group). */
static inline __attribute__((always_inline)) void lb_few_tile(
    const int mr, const int g, int64_t k2, const uint32_t *restrict xb,
    const uint16_t *restrict panel, int64_t pstride, const float *restrict bias,
    float *restrict y, int64_t ldy, int64_t col, int64_t n) {
    __m512 c0[LB_FEW_PAIRS], c1[LB_FEW_PAIRS]; /* [s * mr + i]: panel s, row i */
#pragma GCC unroll 8
    for (int s = 0; s < g; s++) {
        const int64_t c = col + s * LB_NR, ncols = n - c < LB_NR ? n - c : LB_NR;
        __m512 init0, init1;
        lb_tile_bias(bias != NULL ? bias + c : NULL, ncols, &init0, &init1);
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++) {
            c0[s * mr + i] = init0;
            c1[s * mr + i] = init1;
        }
    }
    for (int64_t kk = 0; kk < k2; kk++) {
#pragma GCC unroll 8
        for (int s = 0; s < g; s++) {
            const uint16_t *row = panel + s * pstride + kk * LB_ROW;
            __builtin_prefetch(row + LB_FEW_PREFETCH * LB_ROW, 0, 3);
            __builtin_prefetch(row + LB_FEW_PREFETCH * LB_ROW + 32, 0, 3);
            const __m512bh b0 = lb_ld(row), b1 = lb_ld(row + 32);
#pragma GCC unroll 8
            for (int i = 0; i < mr; i++) {
                const uint32_t a = xb[i * k2 + kk];
                c0[s * mr + i] = lb_dot(c0[s * mr + i], a, b0);
                c1[s * mr + i] = lb_dot(c1[s * mr + i], a, b1);
            }
        }
    }
#pragma GCC unroll 8
    for (int s = 0; s < g; s++) {
        const int64_t c = col + s * LB_NR, ncols = n - c < LB_NR ? n - c : LB_NR;
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++)
            lb_tile_store(y + i * ldy + c, c0[s * mr + i], c1[s * mr + i], ncols);
    }
}

/* Panels [p, p + g) of y at mr <= LB_FEW_ROWS rows, g <= lb_few_group_panels(mr) */
static void lb_few_group(int64_t p, int64_t g, int64_t mr, int64_t n, int64_t k2,
                         const uint32_t *xb, const uint16_t *packed, const float *bias, float *y,
                         int64_t ldy) {
    const int64_t pstride = k2 * LB_ROW, col = p * LB_NR;
    const uint16_t *panel = packed + p * pstride;
    switch (mr * 16 + g) {
#define LB_FEW_CASE(rows, panels)                                                             \
    case rows * 16 + panels:                                                                  \
        lb_few_tile(rows, panels, k2, xb, panel, pstride, bias, y, ldy, col, n);              \
        break;
        LB_FEW_CASE(1, 1) LB_FEW_CASE(1, 2) LB_FEW_CASE(1, 3) LB_FEW_CASE(1, 4)
        LB_FEW_CASE(2, 1) LB_FEW_CASE(2, 2) LB_FEW_CASE(2, 3)
        LB_FEW_CASE(3, 1) LB_FEW_CASE(3, 2) LB_FEW_CASE(3, 3) LB_FEW_CASE(3, 4)
        LB_FEW_CASE(4, 1) LB_FEW_CASE(4, 2) LB_FEW_CASE(4, 3)
        LB_FEW_CASE(5, 1) LB_FEW_CASE(5, 2)
        LB_FEW_CASE(6, 1) LB_FEW_CASE(6, 2)
#undef LB_FEW_CASE
        default:
            break;
    }
}

/* Panels [p0, p1) of y, one thread's share; xb: rows of pairs (few rows) or packed tiles */
static void lb_panels(int64_t p0, int64_t p1, int64_t m, int64_t n, int64_t k2,
                      const uint32_t *xb, const uint16_t *packed, const float *bias, float *y,
                      int64_t ldy) {
    if (m <= LB_FEW_ROWS) {
        const int64_t group = lb_few_group_panels(m);
        for (int64_t p = p0; p < p1; p += group) {
            const int64_t g = p1 - p < group ? p1 - p : group;
            lb_few_group(p, g, m, n, k2, xb, packed, bias, y, ldy);
        }
        return;
    }
    for (int64_t p = p0; p < p1; p++) {
        const uint16_t *next = p + 1 < p1 ? packed + (p + 1) * k2 * LB_ROW : NULL;
        lb_panel(p, m, n, k2, xb, packed, bias, y, ldy, p == p0, next);
    }
}

/* y[m, n] = bf16(x[m, k]) @ W + bias, W packed as described above (panel width
 * lp_gemm_bf16_panel_width(), `packed` ceil(n / 32) * ceil(k / 2) * 64 bf16 as uint16), x rows
 * ldx apart (fp32), y rows ldy apart, bias [n] fp32 or NULL. Each thread takes a contiguous
 * range of panels. Up to LB_FEW_ROWS rows each thread converts all of x into its own slice of
 * the buffer (a few microseconds at most) and no thread waits for another; past that the
 * threads share the conversion into row tiles, then meet at a barrier (gemm.c's pack_x).
 * Returns 0, -1 when an argument is out of range, -2 when out of memory (nothing written
 * either way). */
int lp_gemm_packed_bf16(int64_t m, int64_t n, int64_t k, const float *x, int64_t ldx,
                        const uint16_t *packed, const float *bias, float *y, int64_t ldy,
                        int num_threads) {
    if (m < 0 || n < 0 || k < 0 || ldx < k || ldy < n || num_threads < 1) return -1;
    if (m == 0 || n == 0) return 0;
    const int64_t k2 = (k + 1) / 2, panels = (n + LB_NR - 1) / LB_NR;
    const int few = m <= LB_FEW_ROWS;
    const int64_t tiles = (m + LB_MR - 1) / LB_MR;
    const int threads = m * n * k < LB_PAR_MIN ? 1 : num_threads;
    uint32_t *xb = lb_x_buffer(few ? threads * m * k2 : tiles * k2 * LB_MR);
    if (xb == NULL) return -2;
#pragma omp parallel num_threads(threads)
    {
        const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t p0 = id * panels / nt, p1 = (id + 1) * panels / nt;
        if (few) {
            uint32_t *mine = xb + id * m * k2; /* nt <= threads slices */
            for (int64_t i = 0; i < m; i++) lb_convert_row(x + i * ldx, k, mine + i * k2, 1);
            lb_panels(p0, p1, m, n, k2, mine, packed, bias, y, ldy);
        } else {
            for (int64_t t = id; t < tiles; t += nt) lb_pack_x(t, m, k, x, ldx, xb);
#pragma omp barrier
            lb_panels(p0, p1, m, n, k2, xb, packed, bias, y, ldy);
        }
    }
    return 0;
}

#else /* no AVX512-BF16 in this build */

int lp_gemm_bf16_supported(void) { return 0; }

int lp_gemm_bf16_panel_width(void) { return 0; }

int lp_gemm_packed_bf16(int64_t m, int64_t n, int64_t k, const float *x, int64_t ldx,
                        const uint16_t *packed, const float *bias, float *y, int64_t ldy,
                        int num_threads) {
    (void)m, (void)n, (void)k, (void)x, (void)ldx, (void)packed, (void)bias, (void)y, (void)ldy,
        (void)num_threads;
    return -1;
}

#endif
