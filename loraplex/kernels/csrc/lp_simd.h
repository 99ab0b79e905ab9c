/* Explicit SIMD vectors for loraplex's native kernels (GCC/clang vector extensions).
 *
 * As wide as the target has: 16 floats with AVX-512, else 8 (AVX2, or whatever the compiler
 * lowers 32-byte vectors to). Loads and stores go through memcpy, so no alignment is assumed.
 */
#ifndef LP_SIMD_H
#define LP_SIMD_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define LP_VL 16
#else
#define LP_VL 8
#endif

typedef float lp_vf __attribute__((vector_size(LP_VL * sizeof(float))));
typedef int32_t lp_vi __attribute__((vector_size(LP_VL * sizeof(int32_t))));

static inline lp_vf lp_ld(const float *p) {
    lp_vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void lp_st(float *p, lp_vf v) { memcpy(p, &v, sizeof v); }

/* the sum of the lanes, as a tree */
static inline float lp_hsum(lp_vf v) {
#if LP_VL == 16
    v += __builtin_shuffle(v, (lp_vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (lp_vi){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v += __builtin_shuffle(v, (lp_vi){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
#else
    v += __builtin_shuffle(v, (lp_vi){4, 5, 6, 7, 0, 1, 2, 3});
    v += __builtin_shuffle(v, (lp_vi){2, 3, 0, 1, 6, 7, 4, 5});
#endif
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
