"""Large CPU buffers in 2 MiB transparent huge pages: the packed weights and the KV cache.

A decode step streams every packed weight once and gathers KV blocks across the cache. With
4 KiB pages that is one TLB miss per 4 KiB, and inside a virtual machine each miss walks two
sets of page tables. Backed by huge pages, a thread reads a large buffer faster and the packed
decode GEMM over SmolLM2's linears and head takes less time, most at 1 row (``python -m
benchmarks.gemm --rows 1,28,64`` with and without ``LORAPLEX_HUGE_PAGES``; the figures measured
on an Intel Xeon VM are in docs/benchmarks.md).

Linux gives anonymous memory huge pages when transparent huge pages are ``always`` or, as on
most distributions, ``madvise`` and the range is advised ``MADV_HUGEPAGE``. torch's allocator
does not advise (only with ``THP_MEM_ALLOC_ENABLE=1``, for every allocation of 2 MiB or more,
the step's temporaries too), so these buffers are private anonymous mappings of their own,
aligned to 2 MiB and advised. The tensor keeps its mapping alive (``torch.frombuffer``); it is
unmapped with the last view. Anywhere else (another OS, THP ``never``, a buffer under 2 MiB,
a failed mapping) the buffer is a plain ``torch.empty`` / ``torch.zeros``.
``LORAPLEX_HUGE_PAGES=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os
import sys
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import torch

HUGE_PAGES_ENV = "LORAPLEX_HUGE_PAGES"
HUGE_PAGE = 2 << 20
_PAGE = 4096  # the smallest page: one byte written in each commits a mapping's every page
_MADV_POPULATE_WRITE = 23  # <linux/mman.h>; older kernels refuse it (EINVAL)
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _setting() -> bool:
    value = os.environ.get(HUGE_PAGES_ENV, "").strip().lower()
    if value in ("", "1", "on", "true", "yes", "auto"):
        return True
    if value in ("0", "off", "false", "no"):
        return False
    raise ValueError(f"{HUGE_PAGES_ENV}={value!r}: use 0 (off) or 1 (on, the default)")


@cache
def _kernel_allows() -> bool:
    """True when this kernel backs advised anonymous memory with huge pages."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        mode = _THP_ENABLED.read_text()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def available() -> bool:
    """Whether :func:`empty` hands out huge-page-backed buffers here (and is not turned off)."""
    return _setting() and _kernel_allows()


def empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor, backed by huge pages when :func:`available` and it is at
    least one huge page; else ``torch.empty``."""
    return _mapped(shape, dtype, zero=False)


def zeros(shape: Sequence[int], dtype: torch.dtype, *, commit: bool = False) -> torch.Tensor:
    """``torch.zeros`` on the CPU, backed by huge pages as :func:`empty`. A fresh mapping is
    zero already, and its pages are only committed as they are first written; ``commit`` faults
    them all in now, so that the memory is taken here (a host short of it fails now, not in the
    middle of serving) and no later write pays for faulting a page in and zeroing it."""
    return _mapped(shape, dtype, zero=True, commit=commit)


def is_huge_backed(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory is one of this module's mappings (its storage is 2 MiB aligned
    and owned by an mmap)."""
    mapping = getattr(t, "_loraplex_mapping", None)
    return isinstance(mapping, mmap.mmap) and t.untyped_storage().data_ptr() % HUGE_PAGE == 0


def _mapped(
    shape: Sequence[int], dtype: torch.dtype, *, zero: bool, commit: bool = False
) -> torch.Tensor:
    dims = tuple(int(d) for d in shape)
    numel = math.prod(dims)
    nbytes = numel * dtype.itemsize
    if nbytes < HUGE_PAGE or not available():
        return (torch.zeros if zero else torch.empty)(dims, dtype=dtype)
    try:
        mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError, OverflowError):
        return (torch.zeros if zero else torch.empty)(dims, dtype=dtype)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    offset = -address % HUGE_PAGE  # the first 2 MiB boundary inside the mapping
    with contextlib.suppress(OSError):  # without the advice it is still correct memory
        mapping.madvise(mmap.MADV_HUGEPAGE, offset, len(mapping) - offset)
    flat = torch.frombuffer(mapping, dtype=dtype, count=numel, offset=offset)
    if commit:  # torch.zeros above has written every page already
        try:  # Linux 5.14 on: the kernel zero-fills every page, without a fault per page
            mapping.madvise(_MADV_POPULATE_WRITE, offset, nbytes)
        except OSError:
            flat.view(torch.uint8)[::_PAGE].zero_()  # one byte per page, all zero
    tensor = flat.view(dims)
    tensor._loraplex_mapping = mapping  # type: ignore[attr-defined]  # for is_huge_backed
    return tensor
