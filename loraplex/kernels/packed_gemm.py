"""Linear layers on the CPU with the weight packed once into column panels (``csrc/gemm.c``).

The packed kernel streams each weight exactly once per call with prefetching, where a BLAS
sgemm repacks it on every call: a few rows are bound by reading the weight, a few dozen by the
arithmetic, with the next panel's fetch overlapping it. Up to :func:`max_rows` rows (all of
them on AVX2 builds, decode-sized batches on AVX-512 ones) it takes the call; larger batches,
other dtypes and devices, and layouts the kernel cannot read go to ``F.linear``, the reference
the tests compare against. The packed copy is extra memory: one more copy of every packed
weight, fp32, in huge pages where the OS gives them (``host_memory``).

On CPUs with AVX512-BF16 (:func:`bf16_supported`), ``pack(w, dtype=torch.bfloat16)`` packs the
weight as bf16 pairs along K instead (``csrc/gemm_bf16.c``: half the bytes, fp32 accumulation,
x rounded to bf16 on the fly) and :func:`linear` dispatches on the packed copy's dtype; such a
call computes ``F.linear(x.bfloat16().float(), w.bfloat16().float(), bias)`` up to summation
order. The LoRA-fused call (:func:`linear_lora`) stays fp32-only. AMX-BF16 is not built yet.

``bench``: ``python -m benchmarks.gemm`` (from the repository) times this kernel against
``F.linear`` per row count on the embedded model's shapes; ``loraplex bench throughput`` compares
the whole engine
with Hugging Face; ``tests/kernels/test_packed_gemm.py`` compares this kernel with torch.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F

from loraplex.kernels import host_memory, native

# Rows up to which the packed kernel takes a call, by the build's panel width (None: any), as
# measured with ``python -m benchmarks.gemm --rows 8,16,32,64,128,256,1024,2048`` (2 threads,
# weights warm; the figures are in docs/benchmarks.md):
# - AVX-512 (32 columns), an Intel Xeon: ahead of MKL at 8-64 rows, about even at 128, so
#   prefill chunks go to the BLAS there.
# - AVX2 (16 columns), AMD EPYC (Zen 2): ahead of MKL at every row count, and prefill through
#   the packed kernel made the whole base workload faster (``loraplex bench throughput``).
# Other widths keep the decode-sized cap.
_MAX_ROWS_BY_PANEL_WIDTH: dict[int, int | None] = {32: 128, 16: None}
_DEFAULT_MAX_ROWS = 128

# Rows up to which bf16 panels take a call (None: any), as measured with ``python -m
# benchmarks.gemm --rows 1,4,16,64,128,256,512,1024,2048,4096`` (2 threads, weights warm) on AMD
# EPYC Zen 4: the bf16 kernel is ahead of fp32 F.linear at every row count, and of torch's own bf16
# GEMM (oneDNN, on x and W already in bf16) up to a few hundred rows, about even past that. A
# cap would only pay with a second (bf16) copy of every weight for F.linear, so there is none.
_BF16_MAX_ROWS: int | None = None


def max_rows() -> int | None:
    """Rows up to which :func:`linear` uses the packed kernel on this build (None: any number),
    or 0 without the native kernels."""
    width = panel_width()
    if width is None:
        return 0
    return _MAX_ROWS_BY_PANEL_WIDTH.get(width, _DEFAULT_MAX_ROWS)


def bf16_max_rows() -> int | None:
    """Rows up to which :func:`linear` uses the bf16 kernel for bf16 panels (None: any)."""
    return _BF16_MAX_ROWS


def panel_width() -> int | None:
    """Columns per packed panel of this machine's build, or None without the native kernels."""
    lib = native.library()
    return None if lib is None else _width_of(lib)


@cache
def _width_of(lib: ctypes.CDLL) -> int:
    """A loaded library's panel width: fixed by its build, asked once (``linear`` asks on every
    call, through :func:`max_rows`)."""
    return int(lib.lp_gemm_panel_width())


def packs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether :func:`pack` packs a 2-D weight of this dtype on this device (fp32 on the CPU,
    with the native kernels built)."""
    return dtype == torch.float32 and device.type == "cpu" and panel_width() is not None


def bf16_supported() -> bool:
    """Whether this machine's build has the bf16 kernel (the library says: built with
    AVX512-BF16, which ``-march=native`` enables where the CPU has it)."""
    lib = native.library()
    return lib is not None and _bf16_width_of(lib) > 0


@cache
def _bf16_width_of(lib: ctypes.CDLL) -> int:
    """A loaded library's bf16 panel width, 0 when it has no bf16 kernel (asked once)."""
    return int(lib.lp_gemm_bf16_panel_width()) if lib.lp_gemm_bf16_supported() else 0


def packs_bf16(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``pack(w, dtype=torch.bfloat16)`` packs a 2-D weight of this dtype (fp32 or
    bf16) on this device (the CPU, with :func:`bf16_supported`)."""
    return dtype in (torch.float32, torch.bfloat16) and device.type == "cpu" and bf16_supported()


def pack(weight_t: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """``weight_t [in, out]`` (``W.T``, any strides) -> panels for :func:`linear`.

    fp32: ``[ceil(out / w), in, w]``, None where :func:`packs` is false. bf16: ``weight_t``
    rounded to bf16 (nearest even, ``.to(torch.bfloat16)``) as pairs along ``in``,
    ``[ceil(out / w), ceil(in / 2), w, 2]`` (panel p, pair row kk, column c: ``W.T[2kk, pw + c]``
    and ``W.T[2kk + 1, pw + c]``), None where :func:`packs_bf16` is false. The last panel and an
    odd ``in``'s last pair are zero-padded; the result shares no memory with ``weight_t``.
    """
    if dtype == torch.bfloat16:
        return _pack_bf16(weight_t)
    if dtype != torch.float32:
        raise ValueError(f"pack: dtype must be torch.float32 or torch.bfloat16, not {dtype}")
    width = panel_width()
    if width is None or weight_t.dim() != 2 or not packs(weight_t.dtype, weight_t.device):
        return None
    k, n = weight_t.shape
    panels = -(-n // width)
    padded = torch.zeros(k, panels * width, dtype=weight_t.dtype)  # [in, panels * w]
    padded[:, :n] = weight_t
    out = host_memory.empty((panels, k, width), weight_t.dtype)  # huge pages where it can
    out.copy_(padded.view(k, panels, width).permute(1, 0, 2))  # [panels, in, w]
    return out


def _pack_bf16(weight_t: torch.Tensor) -> torch.Tensor | None:
    lib = native.library()
    if lib is None or weight_t.dim() != 2 or not packs_bf16(weight_t.dtype, weight_t.device):
        return None
    width = _bf16_width_of(lib)
    k, n = weight_t.shape
    k2, panels = -(-k // 2), -(-n // width)
    padded = torch.zeros(2 * k2, panels * width, dtype=torch.bfloat16)  # [2 * K2, panels * w]
    padded[:k, :n] = weight_t.to(torch.bfloat16)
    out = host_memory.empty((panels, k2, width, 2), torch.bfloat16)  # huge pages where it can
    out.copy_(padded.view(k2, 2, panels, width).permute(2, 0, 3, 1))  # [panels, K2, w, 2]
    return out


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    packed: torch.Tensor | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [T, in]``, ``weight [out, in]``; ``packed`` is
    ``pack(weight.t())`` (or ``pack(weight.t(), dtype=torch.bfloat16)``) or None. Uses the packed
    kernel its dtype names when it applies; else ``F.linear(x, weight, bias)`` as given."""
    y = _packed_call(x, weight, packed, bias, None) if _within_rows(x, packed) else None
    return F.linear(x, weight, bias) if y is None else y


def linear_any_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    packed: torch.Tensor | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The packed kernel's ``linear`` at any number of rows, past :func:`max_rows` too (what
    ``python -m benchmarks.gemm`` measures; either dtype), or None where its layout does not
    apply."""
    return _packed_call(x, weight, packed, bias, None)


def linear_lora(
    x: torch.Tensor,
    weight: torch.Tensor,
    packed: torch.Tensor | None,
    bias: torch.Tensor | None,
    lora_call: Callable[[torch.Tensor], int | None],
) -> torch.Tensor | None:
    """``linear`` with a LoRA delta added in the same native call (``lp_gemm_packed_lora``:
    the adapters' rows are fetched while the GEMM computes), or None where the packed kernel
    does not apply or ``lora_call(y)`` (the address of an ``lp_lora_call`` set up for this
    ``y`` and ``x``) gives None: then the caller runs the two steps itself. Always None for
    bf16 panels (the fused kernel is fp32-only)."""
    if packed is not None and packed.dtype == torch.bfloat16:
        return None
    return _packed_call(x, weight, packed, bias, lora_call) if _within_rows(x, packed) else None


def _packed_call(
    x: torch.Tensor,
    weight: torch.Tensor,
    packed: torch.Tensor | None,
    bias: torch.Tensor | None,
    lora_call: Callable[[torch.Tensor], int | None] | None,
) -> torch.Tensor | None:
    """The packed kernel's ``y`` (with the LoRA delta when ``lora_call`` is given), or None
    where it does not apply."""
    if packed is not None and packed.dtype == torch.bfloat16:
        return _bf16_call(x, weight, packed, bias)
    lib = native.library() if packed is not None and _applies(x, weight, bias) else None
    if lib is None or packed is None:
        return None
    rows, k = x.shape
    n = weight.shape[0]
    y = torch.empty(rows, n, dtype=x.dtype)  # [T, out]
    args = (
        rows, n, k, native.ptr(x), x.stride(0),
        native.ptr(packed), None if bias is None else native.ptr(bias),
        native.ptr(y), n, native.num_threads(),
    )  # fmt: skip
    if lora_call is None:
        if lib.lp_gemm_packed(*args) != 0:
            raise RuntimeError("native kernel lp_gemm_packed rejected its arguments")
        return y
    call = lora_call(y)
    if call is None:
        return None
    if lib.lp_gemm_packed_lora(*args, call) != 0:
        raise RuntimeError(
            "native kernel lp_gemm_packed_lora rejected its arguments: a LoRA slot, rank or page "
            "out of range (check_page_index says which), or shapes that do not match"
        )
    return y


def _bf16_call(
    x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """``lp_gemm_packed_bf16``'s ``y`` (fp32), or None where it does not apply. ``weight`` gives
    the shape only (any dtype): the kernel reads ``packed``, whose shape must match it."""
    lib = native.library() if _applies_bf16(x, weight, bias) else None
    width = 0 if lib is None else _bf16_width_of(lib)
    if lib is None or width == 0:
        return None
    rows, k = x.shape
    n = weight.shape[0]
    expected = (-(-n // width), -(-k // 2), width, 2)
    if tuple(packed.shape) != expected or not packed.is_contiguous() or not packed.is_cpu:
        raise ValueError(
            f"bf16 panels of shape {tuple(packed.shape)} do not fit a weight [{n}, {k}] (expected "
            f"{expected}, contiguous on the CPU): pack it with pack(weight.t(), torch.bfloat16)"
        )
    y = torch.empty(rows, n, dtype=torch.float32)  # [T, out]
    code = lib.lp_gemm_packed_bf16(
        rows, n, k, native.ptr(x), x.stride(0),
        native.ptr(packed), None if bias is None else native.ptr(bias),
        native.ptr(y), n, native.num_threads(),
    )  # fmt: skip
    if code == -2:
        raise MemoryError("native kernel lp_gemm_packed_bf16: out of memory converting x")
    if code != 0:
        raise RuntimeError("native kernel lp_gemm_packed_bf16 rejected its arguments")
    return y


def _applies_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[0] == 0 or x.shape[1] != weight.shape[1]:
        return False
    if x.stride(1) != 1 or x.stride(0) < x.shape[1]:
        return False
    if bias is not None and not (
        bias.dim() == 1 and bias.is_contiguous() and bias.shape[0] == weight.shape[0]
    ):
        return False
    return native.usable(x) if bias is None else native.usable(x, bias)


def _within_rows(x: torch.Tensor, packed: torch.Tensor | None) -> bool:
    bf16 = packed is not None and packed.dtype == torch.bfloat16
    limit = bf16_max_rows() if bf16 else max_rows()
    return limit is None or x.shape[0] <= limit


def _applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    if x.dim() != 2 or x.shape[0] == 0 or x.shape[1] != weight.shape[1]:
        return False
    if x.stride(1) != 1 or x.stride(0) < x.shape[1]:
        return False
    if bias is not None and not (bias.dim() == 1 and bias.is_contiguous()):
        return False
    tensors = (x, weight) if bias is None else (x, weight, bias)
    return native.usable(*tensors)
