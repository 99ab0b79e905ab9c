/* Explicit SIMD vectors for loraplex's native kernels (GCC/clang vector extensions).
 *
 * As wide as the target has: 16 floats with AVX-512, else 8 (AVX2, or whatever the compiler
 * lowers 32-byte vectors to). Loads and stores go through memcpy, so no alignment is assumed.
 */
#ifndef LP_SIMD_H
#define LP_SIMD_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define LP_VL 16
#else
#define LP_VL 8
#endif

typedef float lp_vf __attribute__((vector_size(LP_VL * sizeof(float))));
typedef int32_t lp_vi __attribute__((vector_size(LP_VL * sizeof(int32_t))));
typedef uint32_t lp_vu __attribute__((vector_size(LP_VL * sizeof(uint32_t))));
typedef uint16_t lp_vh __attribute__((vector_size(LP_VL * sizeof(uint16_t))));

static inline lp_vf lp_ld(const float *p) {
    lp_vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void lp_st(float *p, lp_vf v) { memcpy(p, &v, sizeof v); }

/* ---- half-precision storage, fp32 arithmetic ----
 * bf16 is the top half of an fp32: widening is a 16-bit left shift. fp16 (IEEE binary16) is
 * widened by vcvtph2ps (AVX-512F for 16 lanes, F16C for 8), else in portable C. Both are exact. */

static inline float lp_bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float lp_f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t em = h & 0x7fffu; /* exponent and mantissa */
    uint32_t u;
    if (em >= 0x7c00u) { /* inf, NaN (payload kept, quieted as vcvtph2ps does) */
        u = sign | 0x7f800000u | ((em & 0x3ffu) << 13) | (em > 0x7c00u ? 0x00400000u : 0);
    } else if (em >= 0x0400u) { /* normal: rebias the exponent by 127 - 15 */
        u = sign | ((em << 13) + (112u << 23));
    } else { /* zero or subnormal: em * 2^-24, exact in fp32 */
        const float f = (float)em * 5.9604644775390625e-8f;
        memcpy(&u, &f, sizeof u);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

/* LP_VL bf16 / fp16 values from p (no alignment assumed) widened to fp32 */
static inline lp_vf lp_ld_bf16(const uint16_t *p) {
#if LP_VL == 16 /* one vpmovzxwd: GCC splits __builtin_convertvector into 256-bit halves */
    const lp_vu u = (lp_vu)_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#elif defined(__AVX2__)
    const lp_vu u =
        (lp_vu)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    lp_vh h;
    memcpy(&h, p, sizeof h);
    const lp_vu u = __builtin_convertvector(h, lp_vu) << 16;
#endif
    lp_vf v;
    memcpy(&v, &u, sizeof v);
    return v;
}

static inline lp_vf lp_ld_f16(const uint16_t *p) {
#if LP_VL == 16
    return (lp_vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__)
    return (lp_vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    lp_vf v;
    for (int i = 0; i < LP_VL; i++) v[i] = lp_f16_to_f32(p[i]);
    return v;
#endif
}

/* Element types of a weight pool the kernels read (the pool_dtype argument) */
#define LP_F32 0
#define LP_F16 1
#define LP_BF16 2

/* Element i of row (type dt, a constant once inlined), and LP_VL of them from i, as fp32 */
static inline __attribute__((always_inline)) float lp_at(const int dt, const void *row,
                                                         int64_t i) {
    if (dt == LP_F16) return lp_f16_to_f32(((const uint16_t *)row)[i]);
    if (dt == LP_BF16) return lp_bf16_to_f32(((const uint16_t *)row)[i]);
    return ((const float *)row)[i];
}

static inline __attribute__((always_inline)) lp_vf lp_ldt(const int dt, const void *row,
                                                          int64_t i) {
    if (dt == LP_F16) return lp_ld_f16((const uint16_t *)row + i);
    if (dt == LP_BF16) return lp_ld_bf16((const uint16_t *)row + i);
    return lp_ld((const float *)row + i);
}

/* Bytes of one element of type dt, and row `row` of a [rows, width] pool of that type */
static inline int64_t lp_esize(const int dt) { return dt == LP_F32 ? 4 : 2; }

static inline __attribute__((always_inline)) const void *lp_row(const int dt, const void *pool,
                                                                int64_t row, int64_t width) {
    return (const char *)pool + row * width * lp_esize(dt);
}

static inline lp_vf lp_splat(float f) { return (lp_vf){0} + f; }

/* lane-wise m ? a : b, m from a vector comparison (all bits set or none) */
static inline lp_vf lp_sel(lp_vi m, lp_vf a, lp_vf b) {
    return (lp_vf)((m & (lp_vi)a) | (~m & (lp_vi)b));
}

/* lane-wise a > b ? a : b: a NaN in a never wins, as with the scalar comparison */
static inline lp_vf lp_max(lp_vf a, lp_vf b) { return lp_sel(a > b, a, b); }

/* The reduction trees of lp_hmax and lp_hsum: each level folds the upper half of every block
 * of lanes onto the lower half, until two lanes are left. */
#if LP_VL == 16
#define LP_FOLD(v, op)                                                                      \
    do {                                                                                    \
        v = op(v, __builtin_shuffle(v, (lp_vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, \
                                               5, 6, 7}));                                  \
        v = op(v, __builtin_shuffle(v, (lp_vi){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, \
                                               9, 10, 11}));                                \
        v = op(v, __builtin_shuffle(v, (lp_vi){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14,  \
                                               15, 12, 13}));                               \
    } while (0)
#else
#define LP_FOLD(v, op)                                                        \
    do {                                                                      \
        v = op(v, __builtin_shuffle(v, (lp_vi){4, 5, 6, 7, 0, 1, 2, 3}));     \
        v = op(v, __builtin_shuffle(v, (lp_vi){2, 3, 0, 1, 6, 7, 4, 5}));     \
    } while (0)
#endif

static inline lp_vf lp_add(lp_vf a, lp_vf b) { return a + b; }

/* the largest lane (NaN-free input) */
static inline float lp_hmax(lp_vf v) {
    LP_FOLD(v, lp_max);
    return v[0] > v[1] ? v[0] : v[1];
}

/* the sum of the lanes, as a tree */
static inline float lp_hsum(lp_vf v) {
    LP_FOLD(v, lp_add);
    return v[0] + v[1];
}

/* Lane j of the result is the sum of the lanes of v[LP_BITREV[j]]: LP_VL horizontal sums for
 * the price of about two shuffles and one add per input vector (a transpose tree: each level
 * halves the vectors, pairing lanes of one with lanes of the other). The tree leaves its results
 * in bit-reversed order, so callers fill v[j] with item LP_BITREV[j]. */
#define LP_PAIR(a, b, h) \
    (__builtin_shuffle(a, b, (lp_vi){LP_LO##h}) + __builtin_shuffle(a, b, (lp_vi){LP_HI##h}))
#if LP_VL == 16
static const int LP_BITREV[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
#define LP_LO8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define LP_HI8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define LP_LO4 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define LP_HI4 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define LP_LO2 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define LP_HI2 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define LP_LO1 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define LP_HI1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
static inline lp_vf lp_transpose_sum(const lp_vf v[16]) {
    lp_vf a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) a[i] = LP_PAIR(v[2 * i], v[2 * i + 1], 8);
    for (int i = 0; i < 4; i++) b[i] = LP_PAIR(a[2 * i], a[2 * i + 1], 4);
    for (int i = 0; i < 2; i++) c[i] = LP_PAIR(b[2 * i], b[2 * i + 1], 2);
    return LP_PAIR(c[0], c[1], 1);
}
#else
static const int LP_BITREV[8] = {0, 4, 2, 6, 1, 5, 3, 7};
#define LP_LO4 0, 1, 2, 3, 8, 9, 10, 11
#define LP_HI4 4, 5, 6, 7, 12, 13, 14, 15
#define LP_LO2 0, 1, 8, 9, 4, 5, 12, 13
#define LP_HI2 2, 3, 10, 11, 6, 7, 14, 15
#define LP_LO1 0, 8, 2, 10, 4, 12, 6, 14
#define LP_HI1 1, 9, 3, 11, 5, 13, 7, 15
static inline lp_vf lp_transpose_sum(const lp_vf v[8]) {
    lp_vf b[4], c[2];
    for (int i = 0; i < 4; i++) b[i] = LP_PAIR(v[2 * i], v[2 * i + 1], 4);
    for (int i = 0; i < 2; i++) c[i] = LP_PAIR(b[2 * i], b[2 * i + 1], 2);
    return LP_PAIR(c[0], c[1], 1);
}
#endif

#endif
