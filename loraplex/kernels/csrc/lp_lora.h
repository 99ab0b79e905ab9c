/* The batched multi-LoRA kernel's arguments and its steps, shared by cpu_kernels.c (lp_lora_add)
 * and gemm.c (lp_gemm_packed_lora, which runs the step beside a projection's GEMM). */
#ifndef LP_LORA_H
#define LP_LORA_H

#include <stdint.h>

/* lp_lora_add's arguments as one struct, so that a caller that keeps one per layer (the Python
 * side: the pools, page tables and shapes never change) sets only the per-call fields (y, x,
 * their strides, num_tokens, slots, num_threads) and passes one pointer: with ctypes that costs
 * a fraction of converting 21 arguments on every call. Field order is the ABI of
 * loraplex.kernels.lora_native.LoRACall; every integer is int64. */
typedef struct {
    float *y;
    int64_t y_stride;
    const float *x;
    int64_t x_stride, num_tokens, in_features;
    const int32_t *slots;
    int64_t max_loras, max_rank;
    const int32_t *pages;
    int64_t p_slice_stride, p_slot_stride;
    const int32_t *ranks;
    int64_t r_slice_stride, num_slices;
    const void *const *a_pools;
    const void *const *b_pools;
    int64_t pool_dtype;
    const int64_t *pool_rows, *widths, *offsets;
    int64_t num_threads;
} lp_lora_call;

/* Check every slot, rank and page the batch names (nothing is written) and list the tiles:
 * *tiles (malloc'd, freed by the caller; NULL when there are none) gets the first token of each
 * run of up to 8 tokens of one slot that adds something. Returns their number, or -1. */
int64_t lp_lora_plan(const lp_lora_call *c, int64_t **tiles);
/* Fetch tile q's A and B rows into L2. */
void lp_lora_fetch_tile(const lp_lora_call *c, const int64_t *tiles, int64_t q);
/* y[tile q's tokens] += the tile's delta, every slice. */
void lp_lora_do_tile(const lp_lora_call *c, const int64_t *tiles, int64_t q);
/* All of it: plan, then the tiles on c->num_threads threads. 0, or -1 (y untouched). */
int lp_lora_add_call(const lp_lora_call *c);

#endif
