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

#endif
