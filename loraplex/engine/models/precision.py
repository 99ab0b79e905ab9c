"""Which precision the model runs in: picked by device and CPU features for ``dtype="auto"``.

On the CPU, bf16 pays only where the CPU multiplies bf16 natively (AMX-BF16 tiles, or
AVX512-BF16's ``vdpbf16ps``): elsewhere torch emulates it, many times slower than fp32. There,
"bfloat16" means the matrix products read bf16 weights (packed once at load, half the bytes of
fp32) with fp32 accumulation (``kernels/csrc/gemm_bf16.c``); activations, norms, rope,
attention, the KV cache and the tied head stay fp32, where accuracy needs them. On a CPU without
bf16 units an explicit ``bfloat16`` is honoured as a torch bf16 model; ``auto`` picks float32.

``LORAPLEX_CPU_AUTO_DTYPE`` (``float32`` or ``bfloat16``) overrides what ``auto`` picks on the
CPU (the test suite pins fp32 for its comparisons against fp32 references).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.kernels import packed_gemm

AUTO_ENV = "LORAPLEX_CPU_AUTO_DTYPE"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo names of native bf16 arithmetic


@dataclass(frozen=True)
class Precision:
    """``dtype``: the model's activations; ``gemm_dtype``: the weights of the packed CPU matrix
    products; ``name`` and ``reason``: what to tell the operator; ``kv_dtype``: the KV cache's
    storage when it differs from ``dtype`` (``cache_dtype``)."""

    dtype: torch.dtype
    gemm_dtype: torch.dtype
    name: str
    reason: str
    kv_dtype: torch.dtype | None = None

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.dtype if self.kv_dtype is None else self.kv_dtype


def with_kv_cache(precision: Precision, kv_cache_dtype: str, device: torch.device) -> Precision:
    """``precision`` with the KV cache stored as ``kv_cache_dtype`` (``auto``: as the
    activations). A bf16 cache beside fp32 activations is a CPU feature: writes round to bf16,
    attention widens what it reads and sums in fp32 (``kernels/csrc/cpu_kernels.c``); other
    devices keep the cache in the activations' dtype."""
    if kv_cache_dtype == "auto":
        return precision
    if kv_cache_dtype not in ("float32", "bfloat16"):
        raise ValueError(
            f"kv_cache_dtype must be auto, float32 or bfloat16; got {kv_cache_dtype!r}"
        )
    wanted = _DTYPES[kv_cache_dtype]
    if wanted == precision.dtype:
        return precision
    if device.type != "cpu":
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype} differs from the activations' "
            f"{str(precision.dtype).removeprefix('torch.')}: only the CPU stores the KV cache in "
            "another dtype; use kv_cache_dtype auto"
        )
    return dataclasses.replace(precision, kv_dtype=wanted)


def cpu_bf16_flags(cpuinfo: str | None = None) -> tuple[str, ...]:
    """The native bf16 features this CPU lists (``BF16_FLAGS`` order)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return ()
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[-1].split())
    return tuple(f for f in BF16_FLAGS if f in flags)


def resolve_precision(
    dtype: str | torch.dtype,
    device: torch.device,
    *,
    bf16_flags: tuple[str, ...] | None = None,
    bf16_kernel: bool | None = None,
) -> Precision:
    """The precision for ``dtype`` on ``device`` (``bf16_flags`` / ``bf16_kernel``: this
    machine's, read when None)."""
    if isinstance(dtype, torch.dtype):
        name = next((n for n, d in _DTYPES.items() if d == dtype), str(dtype))
        dtype = name
    if dtype != "auto" and dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
    if device.type != "cpu":
        if dtype == "auto":
            return Precision(torch.bfloat16, torch.bfloat16, "bfloat16", "auto on a GPU")
        return Precision(_DTYPES[dtype], _DTYPES[dtype], dtype, "asked for")
    flags = cpu_bf16_flags() if bf16_flags is None else bf16_flags
    kernel = packed_gemm.bf16_supported() if bf16_kernel is None else bf16_kernel
    if dtype == "auto":
        override = os.environ.get(AUTO_ENV, "").strip()
        if override:
            if override not in ("float32", "bfloat16"):
                raise ValueError(f"{AUTO_ENV} must be float32 or bfloat16; got {override!r}")
            dtype = override
            why = f"{AUTO_ENV}={override}"
        elif flags and kernel:
            dtype, why = "bfloat16", f"auto: the CPU has {' and '.join(flags).upper()}"
        else:
            dtype = "float32"
            why = (
                "auto: the CPU has no bf16 units (AMX-BF16 or AVX512-BF16)"
                if not flags
                else "auto: the native bf16 kernel is not built (no C compiler?)"
            )
    else:
        why = "asked for"
    if dtype == "bfloat16" and kernel:
        return Precision(
            torch.float32,
            torch.bfloat16,
            "bfloat16",
            f"{why}; bf16 weights in the matrix products (fp32 accumulation), fp32 activations",
        )
    return Precision(_DTYPES[dtype], _DTYPES[dtype], dtype, why)
