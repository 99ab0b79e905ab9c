"""The native CPU LoRA backend: ``lp_lora_add`` (``csrc/cpu_kernels.c``) over the page pool.

One call per layer for all of the step's tokens, each at its own slot and, per slice, its own
rank, A and B rows read through the page index; tiles of up to 8 consecutive tokens of one slot
share each row read. On the CPU only, x and y fp32, the pools fp32, fp16 or bf16
(``native_fits``): half-precision rows are widened to fp32 as they are read and every sum is fp32,
so a half pool halves the bytes a decode step reads and gives what ``add_lora_reference`` gives on
the same pool (it upcasts with ``.float()``) up to fp32 rounding. The kernel checks every page the
batch's slots name against its pool, every slot against ``max_loras`` and every rank against
``max_rank`` before it writes anything, and fails the call (``RuntimeError``) otherwise.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from loraplex.kernels import native
from loraplex.kernels.lora_weights import LoRALayerWeights
from loraplex.kernels.meta import LoRAKernelMeta

CACHE_KEY = "native"  # in LoRALayerWeights.caches

# Pool element types lp_lora_add reads, as its pool_dtype argument (LP_F32, LP_F16, LP_BF16)
POOL_DTYPES: dict[torch.dtype, int] = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


class LoRACall(ctypes.Structure):
    """``lp_lora_call`` (``csrc/cpu_kernels.c``): every argument of ``lp_lora_add`` in one struct,
    the layer's constant ones set once, the per-call ones (``y``, ``x``, strides, ``num_tokens``,
    ``slots``, ``num_threads``) before each call. Field order and types are the C struct's."""

    _fields_ = [
        ("y", ctypes.c_void_p),
        ("y_stride", ctypes.c_int64),
        ("x", ctypes.c_void_p),
        ("x_stride", ctypes.c_int64),
        ("num_tokens", ctypes.c_int64),
        ("in_features", ctypes.c_int64),
        ("slots", ctypes.c_void_p),
        ("max_loras", ctypes.c_int64),
        ("max_rank", ctypes.c_int64),
        ("pages", ctypes.c_void_p),
        ("p_slice_stride", ctypes.c_int64),
        ("p_slot_stride", ctypes.c_int64),
        ("ranks", ctypes.c_void_p),
        ("r_slice_stride", ctypes.c_int64),
        ("num_slices", ctypes.c_int64),
        ("a_pools", ctypes.c_void_p),
        ("b_pools", ctypes.c_void_p),
        ("pool_dtype", ctypes.c_int64),
        ("pool_rows", ctypes.c_void_p),
        ("widths", ctypes.c_void_p),
        ("offsets", ctypes.c_void_p),
        ("num_threads", ctypes.c_int64),
    ]


@dataclass(frozen=True)
class NativeLoRAArgs:
    """A layer's pointer arrays for ``lp_lora_add``, built once per layer: the pools and the page
    tables are never reallocated (loads write into them), and pages and ranks are read through
    their pointers at every call, so nothing here goes stale."""

    a_ptrs: ctypes.Array[ctypes.c_void_p]  # per slice: lora_a[j] [num_pages_j, in]
    b_ptrs: ctypes.Array[ctypes.c_void_p]  # per slice: lora_b[j] [num_pages_j, n_j]
    pool_dtype: int  # POOL_DTYPES[weights.dtype]
    pool_rows: ctypes.Array[ctypes.c_int64]  # per slice: num_pages_j
    widths: ctypes.Array[ctypes.c_int64]
    offsets: ctypes.Array[ctypes.c_int64]
    pages: int  # pointer to pages [num_slices, max_loras, max_rank] int32
    pages_strides: tuple[int, int]  # slice and slot strides (the rank stride is 1)
    ranks: int  # pointer to ranks [num_slices, max_loras] int32
    ranks_stride: int  # slice stride (the slot stride is 1)
    out_end: int  # y needs at least this many columns
    call: LoRACall  # the constant fields filled in; the per-call ones set by add_lora_native
    call_ptr: int  # its address (it lives as long as this object)

    @classmethod
    def of(cls, weights: LoRALayerWeights) -> NativeLoRAArgs:
        if weights.dtype not in POOL_DTYPES or weights.device.type != "cpu":
            raise ValueError(
                f"the native LoRA kernel needs fp32, fp16 or bf16 pools on the CPU, got "
                f"{weights.dtype} on {weights.device}"
            )
        if weights.pages.stride(2) != 1 or weights.ranks.stride(1) != 1:
            raise ValueError("the native LoRA kernel needs pages and ranks contiguous in k / slot")
        n = weights.num_slices
        a_ptrs = (ctypes.c_void_p * n)(*(a.data_ptr() for a in weights.lora_a))
        b_ptrs = (ctypes.c_void_p * n)(*(b.data_ptr() for b in weights.lora_b))
        pool_rows = (ctypes.c_int64 * n)(*weights.num_pages)
        widths = (ctypes.c_int64 * n)(*weights.widths)
        offsets = (ctypes.c_int64 * n)(*weights.slice_offsets)
        pages, ranks = weights.pages, weights.ranks
        call = LoRACall(
            in_features=weights.in_features,
            max_loras=weights.max_loras,
            max_rank=weights.max_rank,
            pages=pages.data_ptr(),
            p_slice_stride=pages.stride(0),
            p_slot_stride=pages.stride(1),
            ranks=ranks.data_ptr(),
            r_slice_stride=ranks.stride(0),
            num_slices=n,
            a_pools=ctypes.addressof(a_ptrs),
            b_pools=ctypes.addressof(b_ptrs),
            pool_dtype=POOL_DTYPES[weights.dtype],
            pool_rows=ctypes.addressof(pool_rows),
            widths=ctypes.addressof(widths),
            offsets=ctypes.addressof(offsets),
        )
        return cls(
            a_ptrs=a_ptrs,
            b_ptrs=b_ptrs,
            pool_dtype=POOL_DTYPES[weights.dtype],
            pool_rows=pool_rows,
            widths=widths,
            offsets=offsets,
            pages=pages.data_ptr(),
            pages_strides=(pages.stride(0), pages.stride(1)),
            ranks=ranks.data_ptr(),
            ranks_stride=ranks.stride(0),
            out_end=max(o + w for o, w in zip(weights.slice_offsets, weights.widths, strict=True)),
            call=call,
            call_ptr=ctypes.addressof(call),
        )

    def invalidate(self, slot: int | None) -> None:
        """Nothing to drop: pool and table pointers never move, contents are read per call."""


def native_args(weights: LoRALayerWeights) -> NativeLoRAArgs:
    """The layer's cached ``NativeLoRAArgs`` (built on first use)."""
    args = weights.caches.get(CACHE_KEY)
    if not isinstance(args, NativeLoRAArgs):
        args = NativeLoRAArgs.of(weights)
        weights.caches[CACHE_KEY] = args
    return args


def native_fits(y: torch.Tensor, x: torch.Tensor, weights: LoRALayerWeights) -> bool:
    """Whether ``add_lora_native`` takes this call: the kernels are built, x and y are fp32 and
    the pools fp32, fp16 or bf16, all on the CPU, x and y 2-D with unit column stride (the pools
    are contiguous by construction), and the page tables contiguous along their last dimension."""
    return (
        x.dtype == y.dtype == torch.float32
        and weights.dtype in POOL_DTYPES
        and x.is_cpu
        and y.is_cpu
        and weights.device.type == "cpu"
        and x.dim() == y.dim() == 2
        and x.stride(1) == 1
        and y.stride(1) == 1
        and weights.pages.stride(2) == 1
        and weights.ranks.stride(1) == 1
        and native.library() is not None
    )


def add_lora_native(
    y: torch.Tensor, x: torch.Tensor, weights: LoRALayerWeights, meta: LoRAKernelMeta
) -> None:
    """``add_lora_reference`` in one ``lp_lora_add`` call: x [T, in], y [T, out] updated in place
    (fp32, CPU; pools fp32, fp16 or bf16). Raises ``RuntimeError`` when the kernel rejects the
    page index or the slots."""
    if not native_fits(y, x, weights):
        raise ValueError(
            "the native LoRA kernel needs fp32 CPU x [T, in] and y [T, out] with unit column "
            "stride and fp32, fp16 or bf16 CPU pools (built kernels), got x "
            f"{x.dtype} {tuple(x.shape)}, y {y.dtype} {tuple(y.shape)}, pools {weights.dtype} on "
            f"{weights.device}"
        )
    try_native(y, x, weights, meta)


_F32 = torch.float32
_I32 = torch.int32


def prepare_call(
    y: torch.Tensor, x: torch.Tensor, weights: LoRALayerWeights, meta: LoRAKernelMeta
) -> int | None:
    """The address of the layer's ``lp_lora_call`` set up for this x and y, or None when
    ``native_fits`` does not hold (then nothing is set).

    This runs for every LoRA layer of every step, so it does the least per call: what belongs to
    the layer (the pools' type, device and layout, the kernels being built) is checked once,
    when its ``NativeLoRAArgs`` are made; per call only x and y (type, device, 2-D, unit column
    stride, shapes against the step and the pool) are, in a few attribute reads, and 7 fields of
    the preset struct are set. The kernel itself checks every slot, rank and page the batch
    names before it writes.
    """
    args = weights.caches.get(CACHE_KEY)
    if not isinstance(args, NativeLoRAArgs):
        if not native_fits(y, x, weights):
            return None
        args = native_args(weights)
    if x.dtype is not _F32 or y.dtype is not _F32 or not (x.is_cpu and y.is_cpu):
        return None
    xs, ys = x.stride(), y.stride()
    if len(xs) != 2 or len(ys) != 2 or xs[1] != 1 or ys[1] != 1:
        return None
    T = meta.num_tokens
    (xt, xin), (yt, yout) = x.shape, y.shape
    if xt != T or yt != T:
        raise ValueError(f"x has {xt} rows, y {yt}, meta was prepared for {T}")
    if weights.max_loras != meta.max_loras:
        raise ValueError(
            f"the page index has {weights.max_loras} slots, meta max_loras={meta.max_loras}"
        )
    if xin != weights.in_features:
        raise ValueError(f"lora_a has in_features {weights.in_features}, x has {xin}")
    if args.out_end > yout:
        raise ValueError(f"the slices need {args.out_end} columns, y has {yout}")
    slots = meta.token_slots
    if slots.dtype is not _I32 or not slots.is_cpu:
        raise ValueError("meta.token_slots must be int32 on the CPU for the native backend")
    call = args.call
    call.y, call.y_stride = y.data_ptr(), ys[0]
    call.x, call.x_stride = x.data_ptr(), xs[0]
    call.num_tokens, call.slots = T, slots.data_ptr()
    call.num_threads = native.num_threads()
    return args.call_ptr


def rejected(weights: LoRALayerWeights) -> RuntimeError:
    """What a call the kernel refused raises."""
    return RuntimeError(
        f"lp_lora_add rejected its arguments: a slot >= max_loras ({weights.max_loras}), a "
        f"rank outside [0, {weights.max_rank}] or a page outside its pool "
        f"({weights.num_pages} rows); check_page_index says which"
    )


def try_native(
    y: torch.Tensor, x: torch.Tensor, weights: LoRALayerWeights, meta: LoRAKernelMeta
) -> bool:
    """``add_lora_native`` when ``native_fits`` holds (True), else nothing (False)."""
    call = prepare_call(y, x, weights, meta)
    if call is None:
        return False
    if not meta.has_lora:
        return True
    lib = native.library()
    assert lib is not None  # a call exists only where the kernels are built
    if lib.lp_lora_add_call(call) != 0:
        raise rejected(weights)
    return True
