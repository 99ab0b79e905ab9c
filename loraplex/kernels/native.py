"""loraplex's native CPU kernels: ``csrc/*.c`` built once per machine and loaded with ctypes.

The sources are compiled with the system C compiler (``$CC``, else ``cc``/``gcc``/``clang``) at the
first use, ``-O3 -march=native -fopenmp``, into ``$LORAPLEX_CACHE_DIR/native/<key>/`` where the key
hashes the sources, the compiler's version and the CPU's model and flags; later processes load the
cached library in milliseconds. Building is atomic (a temporary file renamed into place), so
processes that race to build it are safe.

Without a compiler, or when the build fails, ``library()`` returns None once and logs one warning
saying why; the callers then run their pure-torch paths, which compute the same results.
``LORAPLEX_NATIVE=0`` turns the native kernels off, ``LORAPLEX_NATIVE=1`` makes a failed build an
error instead of a warning.

No torch headers are involved (plain C and ctypes), so the build takes about a second.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from importlib import resources
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

NATIVE_ENV = "LORAPLEX_NATIVE"
_SOURCES = ("cpu_kernels.c", "gemm.c", "gemm_bf16.c")  # compiled into one library
_HEADERS = ("lp_simd.h", "lp_lora.h")
_LIB = "libloraplex_cpu.so"

_c_int64 = ctypes.c_int64
_c_ptr = ctypes.c_void_p


class NativeBuildError(RuntimeError):
    """The native kernels could not be built or loaded (the message says why)."""


def _mode() -> str:
    value = os.environ.get(NATIVE_ENV, "").strip().lower()
    if value in ("", "auto"):
        return "auto"
    if value in ("0", "off", "false", "no"):
        return "off"
    if value in ("1", "on", "true", "yes"):
        return "on"
    raise ValueError(f"{NATIVE_ENV}={value!r}: use 0 (off), 1 (required) or auto")


def _compiler() -> str | None:
    for name in (os.environ.get("CC", ""), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_signature() -> str:
    """CPU model and feature flags (``-march=native`` code runs only where they match)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [
        line for line in text.splitlines() if line.startswith(("model name", "flags", "Features"))
    ]
    return "\n".join(sorted(set(keep)))


def _cache_root() -> Path:
    from loraplex.paths import cache_dir

    return cache_dir() / "native"


def _build(compiler: str, sources: dict[str, bytes], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        for name, text in sources.items():
            (Path(tmp) / name).write_bytes(text)
        out = Path(tmp) / _LIB
        cmd = [
            compiler, "-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fPIC", "-shared",
            "-std=gnu11",
            "-o", str(out), *(str(Path(tmp) / name) for name in _SOURCES), "-lm",
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            detail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            shown = " ".join(cmd[: -2 - len(_SOURCES)])
            raise NativeBuildError(f"`{shown} ...` failed: " + " | ".join(detail)[:600])
        os.replace(out, target)  # atomic: a racing process sees the old file or the new one


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    i64, ptr, c_int, c_float = _c_int64, _c_ptr, ctypes.c_int, ctypes.c_float
    lib.lp_paged_decode_attention.restype = c_int
    lib.lp_paged_decode_attention.argtypes = [
        ptr, i64, ptr, i64,  # q, q_row_stride, rows, n
        ptr, ptr, c_int,  # k_cache, v_cache, kv_dtype (0 fp32, 2 bf16)
        ptr, i64, ptr,  # block_tables, width, seq_lens
        i64, i64, i64, i64, c_float,  # block_size, num_heads, num_kv_heads, head_dim, scale
        ptr, i64, c_int,  # out, out_row_stride, num_threads
    ]  # fmt: skip
    lib.lp_lora_add.restype = c_int
    lib.lp_lora_add.argtypes = [
        ptr, i64, ptr, i64, i64,  # y, y_stride, x, x_stride, num_tokens
        i64, ptr, i64, i64,  # in_features, slots, max_loras, max_rank
        ptr, i64, i64,  # pages, p_slice_stride, p_slot_stride
        ptr, i64, i64,  # ranks, r_slice_stride, num_slices
        ptr, ptr, c_int,  # a_pools, b_pools, pool_dtype (0 fp32, 1 fp16, 2 bf16)
        ptr, ptr, ptr, c_int,  # pool_rows, widths, offsets, num_threads
    ]  # fmt: skip
    lib.lp_lora_add_call.restype = c_int
    lib.lp_lora_add_call.argtypes = [ptr]  # const lp_lora_call * (lora_native.LoRACall)
    lib.lp_add_rms_norm.restype = c_int
    lib.lp_add_rms_norm.argtypes = [
        ptr, i64, ptr, i64,  # residual, r_stride, delta (or None), d_stride
        ptr, c_float, ptr, i64,  # weight, eps, out, o_stride
        i64, i64, c_int,  # rows, dim, num_threads
    ]  # fmt: skip
    lib.lp_rope_neox.restype = c_int
    lib.lp_rope_neox.argtypes = [
        ptr, i64, i64, i64, i64,  # x, row_stride, rows, heads, head_dim
        ptr, ptr, ptr, i64, c_int,  # positions, cos, sin, max_pos, num_threads
    ]  # fmt: skip
    lib.lp_silu_mul.restype = c_int
    lib.lp_silu_mul.argtypes = [ptr, i64, i64, i64, ptr, i64, c_int]
    lib.lp_argmax_rows.restype = c_int
    lib.lp_argmax_rows.argtypes = [ptr, i64, i64, i64, ptr, c_int]
    lib.lp_sample_rows.restype = c_int
    lib.lp_sample_rows.argtypes = [
        ptr, i64, i64, i64,  # x, stride, rows, cols
        ptr, ptr, ptr, c_int,  # inv_temp (fp32), u (fp64), out (int64), num_threads
    ]  # fmt: skip
    lib.lp_gemm_panel_width.restype = c_int
    lib.lp_gemm_panel_width.argtypes = []
    lib.lp_gemm_packed.restype = c_int
    lib.lp_gemm_packed.argtypes = [
        i64, i64, i64, ptr, i64,  # m, n, k, x, ldx
        ptr, ptr, ptr, i64, c_int,  # packed, bias (or None), y, ldy, num_threads
    ]  # fmt: skip
    lib.lp_gemm_bf16_supported.restype = c_int
    lib.lp_gemm_bf16_supported.argtypes = []
    lib.lp_gemm_bf16_panel_width.restype = c_int
    lib.lp_gemm_bf16_panel_width.argtypes = []
    lib.lp_gemm_packed_bf16.restype = c_int
    lib.lp_gemm_packed_bf16.argtypes = [
        i64, i64, i64, ptr, i64,  # m, n, k, x (fp32), ldx
        ptr, ptr, ptr, i64, c_int,  # packed (bf16 pairs), bias (fp32 or None), y, ldy, threads
    ]  # fmt: skip
    lib.lp_gemm_packed_lora.restype = c_int
    lib.lp_gemm_packed_lora.argtypes = [
        i64, i64, i64, ptr, i64,  # m, n, k, x, ldx
        ptr, ptr, ptr, i64, c_int,  # packed, bias (or None), y, ldy, num_threads
        ptr,  # const lp_lora_call * (its y is this y)
    ]  # fmt: skip
    return lib


def build_library() -> ctypes.CDLL:
    """Build (or reuse the cached build of) the native kernels and load them; raises on failure."""
    compiler = _compiler()
    if compiler is None:
        raise NativeBuildError(
            "no C compiler found (set $CC, or install one: apt-get install -y gcc)"
        )
    csrc = resources.files("loraplex.kernels").joinpath("csrc")
    sources = {name: csrc.joinpath(name).read_bytes() for name in (*_SOURCES, *_HEADERS)}
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=60
    ).stdout
    key = hashlib.sha256(
        b"\0".join([*sources.values(), version.encode(), _cpu_signature().encode()])
    ).hexdigest()[:16]
    target = _cache_root() / key / _LIB
    if not target.exists():
        logger.info("building loraplex's native CPU kernels with %s into %s", compiler, target)
        _build(compiler, sources, target)
    try:
        return _load(target)
    except OSError as exc:
        raise NativeBuildError(f"cannot load {target}: {exc}") from exc


@cache
def library() -> ctypes.CDLL | None:
    """The loaded native kernels, or None (off, or unavailable: warned once)."""
    mode = _mode()
    if mode == "off":
        return None
    try:
        return build_library()
    except (NativeBuildError, OSError, subprocess.SubprocessError) as exc:
        if mode == "on":
            raise NativeBuildError(f"{NATIVE_ENV}=1 but the native kernels failed: {exc}") from exc
        logger.warning("native CPU kernels unavailable, using the torch paths: %s", exc)
        return None


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the native kernels apply: loaded, and every tensor fp32 on the CPU."""
    for t in tensors:  # a plain loop: this runs for every op of every decode step
        if t.dtype != torch.float32 or not t.is_cpu:
            return False
    return library() is not None


def num_threads() -> int:
    return max(1, torch.get_num_threads())


def ptr(t: torch.Tensor) -> int:
    return int(t.data_ptr())
