/* loraplex's native CPU kernels (fp32; LoRA pools also fp16 / bf16), built at run time by
 * loraplex/kernels/native.py.
 *
 * Each kernel has a pure-torch reference in the package and is tested against it. They exist
 * because on the CPU the torch path pays per-op costs that dominate at decode-sized batches:
 * a paged gather of every sequence's keys padded to the longest one, a masked SDPA call, and
 * about twenty small matmuls and copies per layer for batched LoRA. Here each is one pass.
 *
 * Threads: OpenMP, the same runtime torch uses (libgomp.so.1 is loaded once per process).
 */
#include <math.h>
#include <stdint.h>
#include <omp.h>
#include <stdlib.h>

#include "lp_lora.h"
#include "lp_simd.h"

#define LP_MAX_GROUP 64   /* query heads per KV head */
#define LP_TASKS_PER_THREAD 4 /* decode attention: fewer, and a task is split by KV heads */
#define LP_MAX_RANK 1024  /* LoRA rank */

/* exp on LP_VL lanes: Cephes' range reduction x = n ln2 + r, |r| <= ln2 / 2, a degree-7
 * polynomial for e^r, and 2^n built in the exponent bits. Relative error within ~2 ulp over
 * [-87, 88]; NaN stays NaN. Written on vectors, not as a scalar function for the compiler to
 * vectorize: GCC did that only with AVX-512's masks, and on an AVX2 machine the softmax and
 * SiLU loops that called it ran one element at a time. */
static inline lp_vf lp_exp_v(lp_vf x) {
    const lp_vf hi = lp_splat(88.0f), lo = lp_splat(-87.0f);
    x = lp_sel(x > hi, hi, x);
    x = lp_sel(x < lo, lo, x);
    /* round to nearest: adding 1.5 * 2^23 leaves no fraction bits */
    const lp_vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    lp_vf r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    lp_vf p = lp_splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const lp_vi e = (__builtin_convertvector(n, lp_vi) + 127) << 23;
    return p * (lp_vf)e;
}

/* the same exp for one value (vector tails, the softmax's rescale factor) */
static inline float lp_exp(float x) { return lp_exp_v(lp_splat(x))[0]; }

static inline float lp_dot(const float *restrict a, const float *restrict b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

static inline void lp_axpy(float *restrict y, float alpha, const float *restrict x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += alpha * x[i];
}

/* Decode attention over a paged KV cache: one query token per sequence.
 *
 * q, out      row r of the flat batch at q + r * q_row_stride: [num_heads, head_dim] contiguous
 * rows        [n] the flat-batch row of sequence i
 * k/v_cache   [num_blocks, block_size, num_kv_heads, head_dim] contiguous, elements of
 *             kv_dtype (LP_F32, or LP_BF16: half the bytes read, widened to fp32 as read)
 * block_tables [n, width] the blocks of sequence i; seq_lens [n] its keys (all visible)
 * Query head h reads KV head h / (num_heads / num_kv_heads), as Hugging Face's repeat_kv does.
 * A task is one sequence: every KV head with its group of query heads, over the sequence's
 * blocks in one pass with an online softmax, fetching the next block spread over this one's
 * heads (lp_fetch_share). With fewer than LP_TASKS_PER_THREAD sequences a thread, a task takes
 * fewer KV heads (faster at 1 to 64 sequences, the same results to the bit: `python -m
 * benchmarks.ab_trees --old REV` against a tree without it). When head_dim is 1 to 8 vectors (up to 128
 * with AVX-512), the scores of LP_VL keys come out of one transpose tree and the weighted
 * values are summed in registers. The online softmax's max and exp run on vectors
 * (lp_max, lp_exp_v): GCC leaves them scalar on AVX2 builds (measured as above, A/B of the
 * builds; the figures are in docs/benchmarks.md).
 * Returns 0, or -1 when an argument is out of range (nothing written).
 */
#define LP_MAX_ND 8 /* head_dim / LP_VL held in registers: up to 128 with AVX-512 */

/* scores[o] = scale * q . k_o for the m keys of a block, k_o at element ko + o * tok_stride of
 * kc (type dt: LP_F32 or LP_BF16, a constant once inlined, widened to fp32 as it is read).
 * nd > 0: head_dim = nd * LP_VL (a constant once inlined); nd == 0: any head_dim. */
static inline __attribute__((always_inline)) void lp_block_scores(
    const int nd, const int dt, const float *q, const void *kc, int64_t ko, int64_t tok_stride,
    int64_t m, int64_t head_dim, float scale, float *scores) {
    if (nd == 0) {
        for (int64_t o = 0; o < m; o++) {
            const int64_t e = ko + o * tok_stride;
            float s = 0.0f;
            if (dt == LP_F32) {
                s = lp_dot(q, (const float *)kc + e, head_dim);
            } else {
                for (int64_t d = 0; d < head_dim; d++) s += q[d] * lp_at(dt, kc, e + d);
            }
            scores[o] = scale * s;
        }
        return;
    }
    lp_vf qv[LP_MAX_ND];
    for (int d = 0; d < nd; d++) qv[d] = lp_ld(q + d * LP_VL);
    int64_t o = 0;
    for (; o + LP_VL <= m; o += LP_VL) {
        lp_vf part[LP_VL]; /* part[j]: lane-wise products for key o + LP_BITREV[j] */
        for (int j = 0; j < LP_VL; j++) {
            const int64_t e = ko + (o + LP_BITREV[j]) * tok_stride;
            lp_vf acc = qv[0] * lp_ldt(dt, kc, e);
            for (int d = 1; d < nd; d++) acc += qv[d] * lp_ldt(dt, kc, e + d * LP_VL);
            part[j] = acc;
        }
        lp_st(scores + o, lp_transpose_sum(part) * scale);
    }
    for (; o < m; o++) {
        const int64_t e = ko + o * tok_stride;
        lp_vf acc = qv[0] * lp_ldt(dt, kc, e);
        for (int d = 1; d < nd; d++) acc += qv[d] * lp_ldt(dt, kc, e + d * LP_VL);
        scores[o] = scale * lp_hsum(acc);
    }
}

/* acc = acc * corr + sum_o p[o] * v_o over the m values of a block, v_o at element
 * vo + o * tok_stride of vc (type dt; nd as above) */
static inline __attribute__((always_inline)) void lp_block_values(
    const int nd, const int dt, float *acc, float corr, const float *p, const void *vc,
    int64_t vo, int64_t tok_stride, int64_t m, int64_t head_dim) {
    if (nd == 0) {
        if (corr != 1.0f) {
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) acc[d] *= corr;
        }
        for (int64_t o = 0; o < m; o++) {
            const int64_t e = vo + o * tok_stride;
            if (dt == LP_F32) {
                lp_axpy(acc, p[o], (const float *)vc + e, head_dim);
            } else {
                for (int64_t d = 0; d < head_dim; d++) acc[d] += p[o] * lp_at(dt, vc, e + d);
            }
        }
        return;
    }
    lp_vf a[LP_MAX_ND];
    for (int d = 0; d < nd; d++) a[d] = lp_ld(acc + d * LP_VL) * corr;
    for (int64_t o = 0; o < m; o++) {
        const float w = p[o];
        const int64_t e = vo + o * tok_stride;
        for (int d = 0; d < nd; d++) a[d] += w * lp_ldt(dt, vc, e + d * LP_VL);
    }
    for (int d = 0; d < nd; d++) lp_st(acc + d * LP_VL, a[d]);
}

/* Fetch share `share` of `shares` of a block's key or value slots ahead of their use: lines
 * [share * per, (share + 1) * per) of the `lines` a task reads there, `lps` 64-byte lines per
 * slot starting at `base` (slots slot_bytes apart). Spreading a block's fetch over the heads
 * of the block before it keeps the fetch beside the arithmetic: issued all at once, it stalled
 * the loads behind it until it was served (A/B of the builds, as above). */
static inline void lp_fetch_share(const char *base, int64_t lines, int64_t lps,
                                  int64_t slot_bytes, int64_t share, int64_t shares) {
    if (base == NULL) return;
    const int64_t per = (lines + shares - 1) / shares;
    const int64_t u0 = share * per, u1 = u0 + per < lines ? u0 + per : lines;
    if (u0 >= u1) return;
    int64_t slot = u0 / lps, line = u0 % lps; /* one division per share, not per line */
    for (int64_t u = u0; u < u1; u++) {
        __builtin_prefetch(base + slot * slot_bytes + line * 64, 0, 2);
        if (++line == lps) {
            line = 0;
            slot++;
        }
    }
}

/* One task: KV heads [g0, g1) of one sequence, each with its group of query heads, over the
 * sequence's blocks in one pass with an online softmax per query head. q and out at the
 * sequence's row (head 0); table, len: its blocks and keys. With every KV head, a block's keys
 * are one contiguous run. The caches hold elements of type dt (fp32 or bf16); every sum is
 * fp32. scores [num_heads * block_size], acc [num_heads * head_dim] and stats [3 * num_heads]
 * (running max, sum and correction per query head) are the thread's scratch. */
static inline __attribute__((always_inline)) void lp_decode_task(
    const int nd, const int dt, const float *q, float *out, const int64_t *table, int64_t len,
    const void *k_cache, const void *v_cache, int64_t g0, int64_t g1, int64_t block_size,
    int64_t tok_stride, int64_t group, int64_t head_dim, float scale, float *scores, float *acc,
    float *stats) {
    const int64_t es = lp_esize(dt);
    const int64_t blk_stride = block_size * tok_stride; /* elements */
    const int64_t h0 = g0 * group, h1 = g1 * group, heads = h1 - h0; /* query heads */
    const int64_t num_heads = tok_stride / head_dim * group;
    float *mx = stats, *sum = stats + num_heads, *corr = stats + 2 * num_heads;
    const int64_t kv_off = g0 * head_dim;
    const int64_t lps = ((g1 - g0) * head_dim * es + 63) / 64; /* cache lines per slot read */
    for (int64_t h = h0; h < h1; h++) {
        mx[h] = -INFINITY;
        sum[h] = 0.0f;
    }
    for (int64_t e = h0 * head_dim; e < h1 * head_dim; e++) acc[e] = 0.0f;
    for (int64_t p0 = 0; p0 < len; p0 += block_size) {
        const int64_t off = table[p0 / block_size] * blk_stride;
        const int64_t m = len - p0 < block_size ? len - p0 : block_size;
        const char *nk = NULL, *nv = NULL; /* the next block, fetched while this one computes */
        int64_t lines = 0;
        if (p0 + block_size < len) {
            const int64_t next = (table[p0 / block_size + 1] * blk_stride + kv_off) * es;
            const int64_t rest = len - p0 - block_size;
            nk = (const char *)k_cache + next;
            nv = (const char *)v_cache + next;
            lines = (rest < block_size ? rest : block_size) * lps;
        }
        for (int64_t h = h0; h < h1; h++) {
            lp_fetch_share(nk, lines, lps, tok_stride * es, h - h0, heads);
            lp_block_scores(nd, dt, q + h * head_dim, k_cache, off + (h / group) * head_dim,
                            tok_stride, m, head_dim, scale, scores + h * block_size);
        }
        for (int64_t h = h0; h < h1; h++) { /* online softmax: exp against the running max */
            float *sh = scores + h * block_size;
            int64_t o = 0;
            lp_vf vm = lp_splat(mx[h]); /* a NaN score never becomes the max */
            for (; o + LP_VL <= m; o += LP_VL) vm = lp_max(lp_ld(sh + o), vm);
            float bm = lp_hmax(vm);
            for (; o < m; o++) bm = sh[o] > bm ? sh[o] : bm;
            /* rescales the earlier blocks (on the first block, everything is still zero) */
            corr[h] = bm > mx[h] ? lp_exp(mx[h] - bm) : 1.0f;
            mx[h] = bm;
            lp_vf vs = {0};
            for (o = 0; o + LP_VL <= m; o += LP_VL) {
                const lp_vf e = lp_exp_v(lp_ld(sh + o) - bm);
                lp_st(sh + o, e);
                vs += e;
            }
            float s = lp_hsum(vs);
            for (; o < m; o++) {
                sh[o] = lp_exp(sh[o] - bm);
                s += sh[o];
            }
            sum[h] = sum[h] * corr[h] + s;
        }
        for (int64_t h = h0; h < h1; h++) {
            lp_fetch_share(nv, lines, lps, tok_stride * es, h - h0, heads);
            lp_block_values(nd, dt, acc + h * head_dim, corr[h], scores + h * block_size,
                            v_cache, off + (h / group) * head_dim, tok_stride, m, head_dim);
        }
    }
    for (int64_t h = h0; h < h1; h++) {
        const float inv = 1.0f / sum[h];
#pragma omp simd
        for (int64_t d = 0; d < head_dim; d++) out[h * head_dim + d] = acc[h * head_dim + d] * inv;
    }
}

int lp_paged_decode_attention(const float *q, int64_t q_row_stride, const int64_t *rows, int64_t n,
                              const void *k_cache, const void *v_cache, int kv_dtype,
                              const int64_t *block_tables, int64_t width, const int64_t *seq_lens,
                              int64_t block_size, int64_t num_heads, int64_t num_kv_heads,
                              int64_t head_dim, float scale, float *out, int64_t out_row_stride,
                              int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return -1;
    if (kv_dtype != LP_F32 && kv_dtype != LP_BF16) return -1;
    const int64_t group = num_heads / num_kv_heads;
    if (group > LP_MAX_GROUP || block_size <= 0 || head_dim <= 0) return -1;
    for (int64_t i = 0; i < n; i++)
        if (seq_lens[i] < 1 || seq_lens[i] > width * block_size) return -1;
    const int64_t tok_stride = num_kv_heads * head_dim; /* one slot of one block */
    const int64_t nd = head_dim % LP_VL == 0 ? head_dim / LP_VL : 0;
    /* KV heads per task: all of them (each block read front to back) when there are sequences
     * enough for LP_TASKS_PER_THREAD tasks a thread, else fewer (a divisor), down to one */
    int64_t per = num_kv_heads;
    while (per > 1 && n * (num_kv_heads / per) < LP_TASKS_PER_THREAD * (int64_t)num_threads) {
        per--;
        while (num_kv_heads % per != 0) per--;
    }
    const int64_t parts = num_kv_heads / per;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(num_heads * block_size));
        float *acc = (float *)malloc(sizeof(float) * (size_t)(num_heads * head_dim));
        float *stats = (float *)malloc(sizeof(float) * (size_t)(3 * num_heads));
        if (scores == NULL || acc == NULL || stats == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t i = 0; i < n; i++) {
            for (int64_t part = 0; part < parts; part++) {
                if (scores == NULL || acc == NULL || stats == NULL) continue;
                const float *qi = q + rows[i] * q_row_stride;
                float *oi = out + rows[i] * out_row_stride;
                const int64_t *table = block_tables + i * width;
                const int64_t g0 = part * per, g1 = g0 + per;
#define LP_TASK(c, t)                                                                        \
    lp_decode_task(c, t, qi, oi, table, seq_lens[i], k_cache, v_cache, g0, g1, block_size,   \
                   tok_stride, group, head_dim, scale, scores, acc, stats)
#define LP_TASKS(t)                                                                          \
    switch (nd) {                                                                            \
        case 1: LP_TASK(1, t); break;                                                        \
        case 2: LP_TASK(2, t); break;                                                        \
        case 3: LP_TASK(3, t); break;                                                        \
        case 4: LP_TASK(4, t); break;                                                        \
        case 5: LP_TASK(5, t); break;                                                        \
        case 6: LP_TASK(6, t); break;                                                        \
        case 7: LP_TASK(7, t); break;                                                        \
        case 8: LP_TASK(8, t); break;                                                        \
        default: LP_TASK(0, t); break;                                                       \
    }
                if (kv_dtype == LP_BF16) {
                    LP_TASKS(LP_BF16);
                } else {
                    LP_TASKS(LP_F32);
                }
#undef LP_TASKS
#undef LP_TASK
            }
        }
        free(scores);
        free(acc);
        free(stats);
    }
    return failed ? -1 : 0;
}

/* Batched multi-LoRA over a page pool, on a flat batch, every token with its own adapter slot
 * (-1: none):
 *
 *   y[t, off_j : off_j + n_j] += (x[t] @ A.T) @ B       s = slots[t], r = ranks[j, s],
 *   A = a_pools[j][pages[j, s, :r]]  [r, in]            B = b_pools[j][pages[j, s, :r]]  [r, n_j]
 *
 * for every slice j (one for a plain projection, 3 for q|k|v, 2 for gate|up), each at the slot's
 * own rank in that slice (0: nothing to add). PEFT scaling is folded into B.
 * x [T, in] rows x_stride apart; y [T, *] rows y_stride apart; both fp32.
 * a_pools[j] [pool_rows[j], in] and b_pools[j] [pool_rows[j], n_j], contiguous, elements of
 * pool_dtype (LP_F32, LP_F16 or LP_BF16; widened to fp32 as they are read, sums in fp32): one
 * page is one rank-row, anywhere in its pool. pages [num_slices, max_loras, max_rank] int32,
 * element (j, s, k) at j * p_slice_stride + s * p_slot_stride + k; ranks [num_slices, max_loras]
 * int32, element (j, s) at j * r_slice_stride + s.
 *
 * Before anything is written, every slot the batch uses is checked: -1 (y untouched) for a slot
 * >= max_loras, a rank outside [0, max_rank] or a page below the rank outside its pool (or an
 * unknown pool_dtype). Pages at k >= rank are never read.
 * Runs of up to LP_LORA_TILE consecutive tokens of one slot form a tile, so that each row of A
 * and B is read once per tile (from L1) rather than once per token; tiles are split between
 * threads. Base-model tokens are never read or written.
 */
#define LP_LORA_TILE 8
#define LP_COLS 64 /* output columns kept in registers while the rank rows are summed */

/* Fetch [p, p + bytes) into the cache ahead of its use. Rows sit at scattered pages, so the
 * hardware prefetcher starts late on each; fetching a slice's A rows all at once (they are
 * latency-bound one at a time) and the next panel of B while this one computes makes fp16 /
 * bf16 pools faster, fp32 less (`loraplex bench throughput --num-adapters 8 --lora-dtype
 * bfloat16`, A/B of the builds). */
static inline void lp_prefetch(const void *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)p + b, 0, 3);
}

/* h[u][i] = A[i] . x_u for the tile's m tokens, A[i] = pool row pg[i] (type dt): four, then two
 * tokens per pass over a row of A, independent vector accumulators, each row element widened once
 * per pass. */
static inline __attribute__((always_inline)) void lp_lora_shrink_tile(
    const int dt, const void *a_pool, const int32_t *pg, int64_t r, int64_t k, const float *x,
    int64_t x_stride, int64_t m, float h[LP_LORA_TILE][LP_MAX_RANK]) {
    const int64_t kv = k - k % LP_VL; /* columns [kv, k): scalar */
    const int64_t row_bytes = k * lp_esize(dt);
    for (int64_t i = 0; i < r; i++) lp_prefetch(lp_row(dt, a_pool, pg[i], k), row_bytes);
    for (int64_t i = 0; i < r; i++) {
        const void *ai = lp_row(dt, a_pool, pg[i], k);
        int64_t u = 0;
        for (; u + 4 <= m; u += 4) {
            const float *x0 = x + u * x_stride, *x1 = x0 + x_stride, *x2 = x1 + x_stride,
                        *x3 = x2 + x_stride;
            lp_vf v0 = {0}, v1 = {0}, v2 = {0}, v3 = {0};
            for (int64_t c = 0; c < kv; c += LP_VL) {
                const lp_vf a = lp_ldt(dt, ai, c);
                v0 += a * lp_ld(x0 + c);
                v1 += a * lp_ld(x1 + c);
                v2 += a * lp_ld(x2 + c);
                v3 += a * lp_ld(x3 + c);
            }
            float s0 = lp_hsum(v0), s1 = lp_hsum(v1), s2 = lp_hsum(v2), s3 = lp_hsum(v3);
            for (int64_t c = kv; c < k; c++) {
                const float a = lp_at(dt, ai, c);
                s0 += a * x0[c];
                s1 += a * x1[c];
                s2 += a * x2[c];
                s3 += a * x3[c];
            }
            h[u][i] = s0;
            h[u + 1][i] = s1;
            h[u + 2][i] = s2;
            h[u + 3][i] = s3;
        }
        for (; u + 2 <= m; u += 2) { /* two tokens: each element of A loaded (widened) once */
            const float *x0 = x + u * x_stride, *x1 = x0 + x_stride;
            lp_vf v0 = {0}, w0 = {0}, v1 = {0}, w1 = {0};
            int64_t c = 0;
            for (; c + 2 * LP_VL <= kv; c += 2 * LP_VL) {
                const lp_vf a0 = lp_ldt(dt, ai, c), a1 = lp_ldt(dt, ai, c + LP_VL);
                v0 += a0 * lp_ld(x0 + c);
                w0 += a1 * lp_ld(x0 + c + LP_VL);
                v1 += a0 * lp_ld(x1 + c);
                w1 += a1 * lp_ld(x1 + c + LP_VL);
            }
            if (c < kv) {
                const lp_vf a0 = lp_ldt(dt, ai, c);
                v0 += a0 * lp_ld(x0 + c);
                v1 += a0 * lp_ld(x1 + c);
            }
            float s0 = lp_hsum(v0 + w0), s1 = lp_hsum(v1 + w1);
            for (c = kv; c < k; c++) {
                const float a = lp_at(dt, ai, c);
                s0 += a * x0[c];
                s1 += a * x1[c];
            }
            h[u][i] = s0;
            h[u + 1][i] = s1;
        }
        for (; u < m; u++) { /* two accumulator chains for the one token */
            const float *xu = x + u * x_stride;
            lp_vf v0 = {0}, v1 = {0};
            int64_t c = 0;
            for (; c + 2 * LP_VL <= kv; c += 2 * LP_VL) {
                v0 += lp_ldt(dt, ai, c) * lp_ld(xu + c);
                v1 += lp_ldt(dt, ai, c + LP_VL) * lp_ld(xu + c + LP_VL);
            }
            if (c < kv) v0 += lp_ldt(dt, ai, c) * lp_ld(xu + c);
            float s = lp_hsum(v0 + v1);
            for (c = kv; c < k; c++) s += lp_at(dt, ai, c) * xu[c];
            h[u][i] = s;
        }
    }
}

/* y_u[c] += sum_i h[u][i] * B[i][c], B[i] = pool row pg[i] (type dt): LP_COLS columns at a time,
 * accumulated in vector registers over the rank rows (y read and written once), the B panel
 * reused from L1 by the tile's tokens. Explicit vectors: with the rows read through pg, GCC 12
 * no longer keeps a plain float accumulator array in registers (several times slower at rank
 * 8: `loraplex bench throughput --num-adapters 8`, A/B of the builds). */
#define LP_COL_VECS (LP_COLS / LP_VL)
static inline __attribute__((always_inline)) void lp_lora_expand_tile(
    const int dt, const void *b_pool, const int32_t *pg, int64_t r, int64_t n, float *y,
    int64_t y_stride, int64_t m, float h[LP_LORA_TILE][LP_MAX_RANK]) {
    const int64_t esize = lp_esize(dt);
    int64_t c0 = 0;
    for (; c0 + LP_COLS <= n; c0 += LP_COLS) {
        int64_t u = 0;
        for (; u + 2 <= m; u += 2) { /* two tokens: each B element loaded (widened) once */
            float *y0 = y + u * y_stride + c0, *y1 = y0 + y_stride;
            lp_vf acc0[LP_COL_VECS], acc1[LP_COL_VECS];
            for (int q = 0; q < LP_COL_VECS; q++) {
                acc0[q] = lp_ld(y0 + q * LP_VL);
                acc1[q] = lp_ld(y1 + q * LP_VL);
            }
            for (int64_t i = 0; i < r; i++) {
                const lp_vf h0 = (lp_vf){0} + h[u][i], h1 = (lp_vf){0} + h[u + 1][i];
                const void *bi = lp_row(dt, b_pool, pg[i], n);
                if (u == 0 && c0 + 2 * LP_COLS <= n) /* the row's next panel */
                    lp_prefetch((const char *)bi + (c0 + LP_COLS) * esize, LP_COLS * esize);
                for (int q = 0; q < LP_COL_VECS; q++) {
                    const lp_vf b = lp_ldt(dt, bi, c0 + q * LP_VL);
                    acc0[q] += h0 * b;
                    acc1[q] += h1 * b;
                }
            }
            for (int q = 0; q < LP_COL_VECS; q++) {
                lp_st(y0 + q * LP_VL, acc0[q]);
                lp_st(y1 + q * LP_VL, acc1[q]);
            }
        }
        for (; u < m; u++) {
            float *yu = y + u * y_stride + c0;
            lp_vf acc[LP_COL_VECS];
            for (int q = 0; q < LP_COL_VECS; q++) acc[q] = lp_ld(yu + q * LP_VL);
            for (int64_t i = 0; i < r; i++) {
                const lp_vf hi = (lp_vf){0} + h[u][i];
                const void *bi = lp_row(dt, b_pool, pg[i], n);
                if (u == 0 && c0 + 2 * LP_COLS <= n) /* the row's next panel */
                    lp_prefetch((const char *)bi + (c0 + LP_COLS) * esize, LP_COLS * esize);
                for (int q = 0; q < LP_COL_VECS; q++) acc[q] += hi * lp_ldt(dt, bi, c0 + q * LP_VL);
            }
            for (int q = 0; q < LP_COL_VECS; q++) lp_st(yu + q * LP_VL, acc[q]);
        }
    }
    if (c0 < n) { /* the last n - c0 < LP_COLS columns: a vector at a time, then scalars */
        for (int64_t u = 0; u < m; u++) {
            float *yu = y + u * y_stride;
            for (int64_t i = 0; i < r; i++) {
                const void *bi = lp_row(dt, b_pool, pg[i], n);
                const float hi = h[u][i];
                int64_t c = c0;
                for (; c + LP_VL <= n; c += LP_VL)
                    lp_st(yu + c, lp_ld(yu + c) + hi * lp_ldt(dt, bi, c));
                for (; c < n; c++) yu[c] += hi * lp_at(dt, bi, c);
            }
        }
    }
}

/* Fetch the whole working set of a tile of slot s (every slice's A rows and B rows) into L2,
 * ahead of the thread's next tile: decode tiles are a few KB to tens of KB at scattered pages,
 * latency-bound when fetched as they are needed. */
static inline void lp_lora_prefetch_slot(int dt, int32_t s, int64_t in_features,
                                         const int32_t *pages, int64_t p_slice_stride,
                                         int64_t p_slot_stride, const int32_t *ranks,
                                         int64_t r_slice_stride, int64_t num_slices,
                                         const void *const *a_pools, const void *const *b_pools,
                                         const int64_t *widths) {
    const int64_t es = lp_esize(dt);
    for (int64_t j = 0; j < num_slices; j++) {
        const int64_t r = ranks[j * r_slice_stride + s], n = widths[j];
        const int32_t *pg = pages + j * p_slice_stride + s * p_slot_stride;
        for (int64_t i = 0; i < r; i++) {
            const char *a = (const char *)lp_row(dt, a_pools[j], pg[i], in_features);
            const char *b = (const char *)lp_row(dt, b_pools[j], pg[i], n);
            for (int64_t o = 0; o < in_features * es; o += 64) __builtin_prefetch(a + o, 0, 2);
            for (int64_t o = 0; o < n * es; o += 64) __builtin_prefetch(b + o, 0, 2);
        }
    }
}

/* Every slice of one tile: the m tokens from t0, all of slot s. */
static inline __attribute__((always_inline)) void lp_lora_tile(
    const int dt, float *y, int64_t y_stride, const float *x, int64_t x_stride, int64_t m,
    int64_t in_features, int32_t s, const int32_t *pages, int64_t p_slice_stride,
    int64_t p_slot_stride, const int32_t *ranks, int64_t r_slice_stride, int64_t num_slices,
    const void *const *a_pools, const void *const *b_pools, const int64_t *widths,
    const int64_t *offsets) {
    float h[LP_LORA_TILE][LP_MAX_RANK];
    for (int64_t j = 0; j < num_slices; j++) {
        const int64_t r = ranks[j * r_slice_stride + s];
        if (r == 0) continue;
        const int32_t *pg = pages + j * p_slice_stride + s * p_slot_stride;
        const int64_t n = widths[j], panel = (n < LP_COLS ? n : LP_COLS) * lp_esize(dt);
        for (int64_t i = 0; i < r; i++) lp_prefetch(lp_row(dt, b_pools[j], pg[i], n), panel);
        lp_lora_shrink_tile(dt, a_pools[j], pg, r, in_features, x, x_stride, m, h);
        lp_lora_expand_tile(dt, b_pools[j], pg, r, widths[j], y + offsets[j], y_stride, m, h);
    }
}

/* 1: slot s adds something, 0: rank 0 in every slice, -1: a rank or a page out of range. */
static int lp_lora_check_slot(int32_t s, int64_t max_rank, const int32_t *pages,
                              int64_t p_slice_stride, int64_t p_slot_stride, const int32_t *ranks,
                              int64_t r_slice_stride, int64_t num_slices,
                              const int64_t *pool_rows) {
    int live = 0;
    for (int64_t j = 0; j < num_slices; j++) {
        const int32_t r = ranks[j * r_slice_stride + s];
        if (r < 0 || r > max_rank) return -1;
        const int32_t *pg = pages + j * p_slice_stride + s * p_slot_stride;
        for (int32_t i = 0; i < r; i++)
            if (pg[i] < 0 || pg[i] >= pool_rows[j]) return -1;
        live |= r > 0;
    }
    return live;
}

int64_t lp_lora_plan(const lp_lora_call *c, int64_t **tiles_out) {
    *tiles_out = NULL;
    if (c->max_rank > LP_MAX_RANK || c->max_rank < 0 || c->max_loras <= 0) return -1;
    if (c->pool_dtype != LP_F32 && c->pool_dtype != LP_F16 && c->pool_dtype != LP_BF16)
        return -1;
    if (c->num_tokens <= 0) return 0;
    int64_t *tiles = (int64_t *)malloc(sizeof(int64_t) * (size_t)c->num_tokens); /* tile starts */
    /* per slot: 0 unchecked, 1 adds something, 2 rank 0 in every slice */
    int8_t *state = (int8_t *)calloc((size_t)c->max_loras, 1);
    if (tiles == NULL || state == NULL) goto reject;
    int64_t num_tiles = 0;
    for (int64_t t = 0; t < c->num_tokens;) {
        const int32_t s = c->slots[t];
        if (s >= c->max_loras) goto reject;
        int64_t e = t + 1;
        while (e < c->num_tokens && e - t < LP_LORA_TILE && c->slots[e] == s) e++;
        if (s >= 0) {
            if (state[s] == 0) {
                const int live = lp_lora_check_slot(
                    s, c->max_rank, c->pages, c->p_slice_stride, c->p_slot_stride, c->ranks,
                    c->r_slice_stride, c->num_slices, c->pool_rows);
                if (live < 0) goto reject;
                state[s] = live ? 1 : 2;
            }
            if (state[s] == 1) tiles[num_tiles++] = t;
        }
        t = e;
    }
    free(state);
    *tiles_out = tiles;
    return num_tiles;
reject:
    free(tiles);
    free(state);
    return -1;
}

void lp_lora_fetch_tile(const lp_lora_call *c, const int64_t *tiles, int64_t q) {
    lp_lora_prefetch_slot((int)c->pool_dtype, c->slots[tiles[q]], c->in_features, c->pages,
                          c->p_slice_stride, c->p_slot_stride, c->ranks, c->r_slice_stride,
                          c->num_slices, c->a_pools, c->b_pools, c->widths);
}

void lp_lora_do_tile(const lp_lora_call *c, const int64_t *tiles, int64_t q) {
    const int64_t t0 = tiles[q];
    const int32_t s = c->slots[t0];
    int64_t m = 1;
    while (m < LP_LORA_TILE && t0 + m < c->num_tokens && c->slots[t0 + m] == s) m++;
#define LP_TILE(dt)                                                                          \
    lp_lora_tile(dt, c->y + t0 * c->y_stride, c->y_stride, c->x + t0 * c->x_stride,          \
                 c->x_stride, m, c->in_features, s, c->pages, c->p_slice_stride,             \
                 c->p_slot_stride, c->ranks, c->r_slice_stride, c->num_slices, c->a_pools,   \
                 c->b_pools, c->widths, c->offsets)
    switch (c->pool_dtype) { /* one copy of the tile loop per element type */
        case LP_F16: LP_TILE(LP_F16); break;
        case LP_BF16: LP_TILE(LP_BF16); break;
        default: LP_TILE(LP_F32); break;
    }
#undef LP_TILE
}

int lp_lora_add_call(const lp_lora_call *c) {
    if (c == NULL) return -1;
    int64_t *tiles = NULL;
    const int64_t num_tiles = lp_lora_plan(c, &tiles);
    if (num_tiles < 0) return -1;
    /* Tiles dealt round robin (thread k takes k, k + nt, ...), so that each thread knows its
     * next tile and fetches it while computing this one. */
#pragma omp parallel num_threads((int)c->num_threads) if (num_tiles > 1)
    {
        const int64_t nt = omp_get_num_threads();
        for (int64_t q = omp_get_thread_num(); q < num_tiles; q += nt) {
            if (q + nt < num_tiles && c->slots[tiles[q + nt]] != c->slots[tiles[q]])
                lp_lora_fetch_tile(c, tiles, q + nt);
            lp_lora_do_tile(c, tiles, q);
        }
    }
    free(tiles);
    return 0;
}

int lp_lora_add(float *y, int64_t y_stride, const float *x, int64_t x_stride, int64_t num_tokens,
                int64_t in_features, const int32_t *slots, int64_t max_loras, int64_t max_rank,
                const int32_t *pages, int64_t p_slice_stride, int64_t p_slot_stride,
                const int32_t *ranks, int64_t r_slice_stride, int64_t num_slices,
                const void *const *a_pools, const void *const *b_pools, int pool_dtype,
                const int64_t *pool_rows, const int64_t *widths, const int64_t *offsets,
                int num_threads) {
    const lp_lora_call c = {y,          y_stride,       x,           x_stride,      num_tokens,
                            in_features, slots,         max_loras,   max_rank,      pages,
                            p_slice_stride, p_slot_stride, ranks,    r_slice_stride, num_slices,
                            a_pools,    b_pools,        pool_dtype,  pool_rows,     widths,
                            offsets,    num_threads};
    return lp_lora_add_call(&c);
}

/* ---- elementwise kernels of the decoder layer ---------------------------------------------- */

#define LP_PAR_MIN 32768 /* elements below which a kernel runs on one thread (fork cost) */

/* residual += delta (when delta != NULL), then out = residual * rsqrt(mean(residual^2) + eps) * w
 * over rows of width dim; every pointer addresses row 0 and rows are *_stride floats apart. */
int lp_add_rms_norm(float *residual, int64_t r_stride, const float *delta, int64_t d_stride,
                    const float *weight, float eps, float *out, int64_t o_stride, int64_t rows,
                    int64_t dim, int num_threads) {
    if (dim <= 0) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * dim >= LP_PAR_MIN)
    for (int64_t t = 0; t < rows; t++) {
        float *h = residual + t * r_stride;
        if (delta != NULL) {
            const float *d = delta + t * d_stride;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) h[i] += d[i];
        }
        const float ms = lp_dot(h, h, dim) / (float)dim;
        const float rstd = 1.0f / sqrtf(ms + eps);
        float *o = out + t * o_stride;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = (h[i] * rstd) * weight[i];
    }
    return 0;
}

/* Rotate-half (NeoX / Hugging Face) rotary embedding, in place, on the first `heads` heads of each
 * row: x [rows, heads, head_dim] with rows `row_stride` floats apart, heads contiguous.
 * cos/sin [max_pos, head_dim / 2]; positions [rows]. */
int lp_rope_neox(float *x, int64_t row_stride, int64_t rows, int64_t heads, int64_t head_dim,
                 const int64_t *positions, const float *cos_t, const float *sin_t, int64_t max_pos,
                 int num_threads) {
    const int64_t half = head_dim / 2;
    if (head_dim % 2 != 0) return -1;
    for (int64_t t = 0; t < rows; t++)
        if (positions[t] < 0 || positions[t] >= max_pos) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (rows * heads * head_dim >= LP_PAR_MIN)
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos_t + positions[t] * half;
        const float *s = sin_t + positions[t] * half;
        for (int64_t h = 0; h < heads; h++) {
            float *x1 = x + t * row_stride + h * head_dim;
            float *x2 = x1 + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
    return 0;
}

/* out[t, i] = silu(gu[t, i]) * gu[t, inter + i]: the gated MLP's activation on gate|up rows. */
int lp_silu_mul(const float *gate_up, int64_t gu_stride, int64_t rows, int64_t inter, float *out,
                int64_t o_stride, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * inter >= LP_PAR_MIN)
    for (int64_t t = 0; t < rows; t++) {
        const float *g = gate_up + t * gu_stride;
        const float *u = g + inter;
        float *o = out + t * o_stride;
        int64_t i = 0;
        for (; i + LP_VL <= inter; i += LP_VL) {
            const lp_vf gv = lp_ld(g + i);
            lp_st(o + i, gv / (1.0f + lp_exp_v(-gv)) * lp_ld(u + i));
        }
        for (; i < inter; i++) o[i] = g[i] / (1.0f + lp_exp(-g[i])) * u[i];
    }
    return 0;
}

/* out[t] = the first index of the largest value of row t (the first NaN, if any, like torch). */
int lp_argmax_rows(const float *x, int64_t stride, int64_t rows, int64_t cols, int64_t *out,
                   int num_threads) {
    if (cols <= 0) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * cols >= LP_PAR_MIN)
    for (int64_t t = 0; t < rows; t++) {
        const float *r = x + t * stride;
        int64_t best = 0;
        float bv = r[0];
        if (bv == bv) {
            for (int64_t i = 1; i < cols; i++) {
                const float v = r[i];
                if (v > bv) {
                    bv = v;
                    best = i;
                } else if (v != v) {
                    best = i;
                    break;
                }
            }
        }
        out[t] = best;
    }
    return 0;
}

/* ---- random sampling ------------------------------------------------------------------------ */

#define LP_SAMPLE_BLOCK 256 /* values per partial sum of the inverse-CDF walk */
#define LP_SAMPLE_MAX_COLS (1 << 22) /* vocabulary size (the partial sums live on the stack) */

/* exp(z) for z <= 0, and exactly 0 below -87: a token masked to -inf (or this far below the
 * largest) gets no probability at all, never lp_exp_v's clamped e^-87. */
static inline lp_vf lp_exp_nonpos_v(lp_vf z) {
    return lp_sel(z < -87.0f, lp_splat(0.0f), lp_exp_v(z));
}

static inline float lp_exp_nonpos(float z) { return z < -87.0f ? 0.0f : lp_exp(z); }

/* e^((r[i] - mx) * it) summed over r[i0, i1): one partial sum of the walk */
static float lp_block_sum(const float *r, int64_t i0, int64_t i1, float mx, float it) {
    lp_vf acc = lp_splat(0.0f);
    int64_t i = i0;
    for (; i + LP_VL <= i1; i += LP_VL) acc += lp_exp_nonpos_v((lp_ld(r + i) - mx) * it);
    float s = 0.0f;
    for (int j = 0; j < LP_VL; j++) s += acc[j];
    for (; i < i1; i++) s += lp_exp_nonpos((r[i] - mx) * it);
    return s;
}

/* One row: the first index whose cumulative probability exceeds u (inverse-CDF sampling), or
 * -1 when the row has no finite largest value (the caller then takes its argmax). */
static int64_t lp_sample_row(const float *r, int64_t cols, float it, double u) {
    lp_vf vmx = lp_splat(-INFINITY);
    lp_vi nan = (lp_vi){0};
    int64_t i = 0;
    for (; i + LP_VL <= cols; i += LP_VL) {
        const lp_vf v = lp_ld(r + i);
        nan |= v != v;
        vmx = lp_max(vmx, v);
    }
    float mx = -INFINITY;
    int has_nan = 0;
    for (int j = 0; j < LP_VL; j++) {
        mx = vmx[j] > mx ? vmx[j] : mx;
        has_nan |= nan[j] != 0;
    }
    for (; i < cols; i++) {
        mx = r[i] > mx ? r[i] : mx;
        has_nan |= r[i] != r[i];
    }
    /* a NaN anywhere, or no finite largest value: the argmax rule decides (the caller) */
    if (has_nan || !(mx > -INFINITY && mx < INFINITY)) return -1;
    const int64_t nb = (cols + LP_SAMPLE_BLOCK - 1) / LP_SAMPLE_BLOCK;
    float bsum[nb]; /* nb <= LP_SAMPLE_MAX_COLS / LP_SAMPLE_BLOCK: 64 KB at most */
    double total = 0.0;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t i1 = (b + 1) * LP_SAMPLE_BLOCK < cols ? (b + 1) * LP_SAMPLE_BLOCK : cols;
        bsum[b] = lp_block_sum(r, b * LP_SAMPLE_BLOCK, i1, mx, it);
        total += bsum[b];
    }
    /* total >= 1: the largest value contributes e^0 */
    const double target = u * total;
    double cum = 0.0;
    int64_t b = 0, last_b = -1;
    for (; b < nb; b++) {
        if (bsum[b] > 0.0f) last_b = b;
        if (cum + bsum[b] > target) break;
        cum += bsum[b];
    }
    if (b == nb) { /* rounding carried the walk past the end: the last block with mass */
        b = last_b;
        cum = total - bsum[b];
    }
    const int64_t i1 = (b + 1) * LP_SAMPLE_BLOCK < cols ? (b + 1) * LP_SAMPLE_BLOCK : cols;
    int64_t last = -1;
    for (int64_t i = b * LP_SAMPLE_BLOCK; i < i1; i++) {
        const float e = lp_exp_nonpos((r[i] - mx) * it);
        if (e <= 0.0f) continue; /* no mass: never drawn */
        last = i;
        cum += e;
        if (cum > target) return i;
    }
    return last; /* the block's sum in another order reached target, this walk did not */
}

/* out[t] = a token drawn from softmax(x[t] * inv_temp[t]) at the uniform u[t] in [0, 1): the
 * first token whose cumulative probability exceeds u[t], so a token's chance is its
 * probability (up to fp32 rounding of its e^z) and a token at -inf is never drawn. A row with a
 * NaN, or with no finite value, gets its argmax (lp_argmax_rows's rule). Rows are spread over
 * the threads one at a time, so a thread descheduled by a neighbour holds up one row only.
 * Returns -1 when an argument is out of range. */
int lp_sample_rows(const float *x, int64_t stride, int64_t rows, int64_t cols,
                   const float *inv_temp, const double *u, int64_t *out, int num_threads) {
    if (cols <= 0 || cols > LP_SAMPLE_MAX_COLS || rows < 0) return -1;
    for (int64_t t = 0; t < rows; t++)
        if (!(inv_temp[t] > 0.0f && inv_temp[t] < INFINITY) || !(u[t] >= 0.0 && u[t] < 1.0))
            return -1;
    int bad = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) \
    if (rows * cols >= LP_PAR_MIN && rows > 1)
    for (int64_t t = 0; t < rows; t++) {
        out[t] = lp_sample_row(x + t * stride, cols, inv_temp[t], u[t]);
        if (out[t] < 0) {
#pragma omp atomic write
            bad = 1;
        }
    }
    if (bad) {
        for (int64_t t = 0; t < rows; t++)
            if (out[t] < 0) lp_argmax_rows(x + t * stride, stride, 1, cols, out + t, 1);
    }
    return 0;
}
