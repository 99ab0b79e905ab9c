"""The bytes the process has allocated, to weigh a compiled grammar for the byte-bounded caches.

llguidance reports no sizes; its Rust code allocates through the C library's ``malloc``, so
glibc's ``mallinfo2`` (bytes in use: arena chunks plus mmapped blocks) before and after a
compile gives what the compile kept. Process-wide: a concurrent allocation in another thread
shows in the difference, so a grammar's weight is an estimate with a floor (``grammar_bytes``).
Measured on SmolLM2's 49k vocabulary: a short regex about 45 KiB, a 20k-character form schema
1.2 MiB, 70 tools' grammar 2 MiB, ``a{10000}`` 4.4 MiB (``/proc`` RSS differences undercount:
freed pages are reused).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

_FIELDS = (
    "arena",
    "ordblks",
    "smblks",
    "hblks",
    "hblkhd",
    "usmblks",
    "fsmblks",
    "uordblks",
    "fordblks",
    "keepcost",
)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS]


def _mallinfo2() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        fn = libc.mallinfo2  # glibc 2.33 and later
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    fn.argtypes = []
    return fn


_MALLINFO2 = _mallinfo2()


def allocated_bytes() -> int | None:
    """Bytes in use by ``malloc`` now; None where the C library cannot say (not glibc)."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return int(info.uordblks) + int(info.hblkhd)
