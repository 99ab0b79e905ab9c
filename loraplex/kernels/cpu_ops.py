"""The decoder layer's small ops, each with the native CPU kernel and its pure-torch reference.

On a decode step every one of these works on a few dozen rows, where torch's per-op cost (RMSNorm
alone is pow, mean, add, rsqrt and two muls) outweighs the arithmetic; the native kernels in
``csrc/cpu_kernels.c`` do each in one pass. They run when ``native.usable`` says so (CPU, fp32,
kernels built) and the layout is what they read; otherwise the torch code below runs, which is
also what the tests compare the kernels against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex.kernels import native


def _rows_ok(t: torch.Tensor) -> bool:
    """2-D with contiguous rows (any row stride): what the row kernels read."""
    return t.dim() == 2 and t.stride(1) == 1


def _norm_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A row kernel's norm weight: one contiguous value per column of x."""
    return weight.dim() == 1 and weight.is_contiguous() and weight.shape[0] == x.shape[-1] > 0


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"native kernel {what} rejected its arguments")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x², -1) + eps) * weight`` over ``x [T, dim]`` (x is not modified)."""
    ok = native.usable(x, weight) and _rows_ok(x) and _norm_ok(x, weight)
    lib = native.library() if ok else None
    if lib is None:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype)
    rc = lib.lp_add_rms_norm(
        native.ptr(x), x.stride(0), None, 0, native.ptr(weight), eps,
        native.ptr(out), out.stride(0), x.shape[0], x.shape[1], native.num_threads(),
    )  # fmt: skip
    _check(rc, "lp_add_rms_norm")
    return out


def add_rms_norm(
    delta: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``residual += delta`` in place, then return ``rms_norm(residual)``: both ``[T, dim]``."""
    ok = (
        native.usable(delta, residual, weight)
        and _rows_ok(delta)
        and _rows_ok(residual)
        and delta.shape == residual.shape
        and _norm_ok(residual, weight)
    )
    lib = native.library() if ok else None
    if lib is None:
        residual.add_(delta)
        return F.rms_norm(residual, (residual.shape[-1],), weight, eps)
    out = torch.empty(residual.shape, dtype=residual.dtype)
    rc = lib.lp_add_rms_norm(
        native.ptr(residual), residual.stride(0), native.ptr(delta), delta.stride(0),
        native.ptr(weight), eps, native.ptr(out), out.stride(0),
        residual.shape[0], residual.shape[1], native.num_threads(),
    )  # fmt: skip
    _check(rc, "lp_add_rms_norm")
    return out


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope (Hugging Face / NeoX layout) on ``x [T, H, head_dim]``; cos/sin
    ``[T, 1, head_dim // 2]``. Returns a new tensor."""
    x1, x2 = x.chunk(2, dim=-1)  # [T, H, head_dim // 2] each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # [T, H, head_dim]


def rope_(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> torch.Tensor:
    """Rope on ``x [T, H, head_dim]`` at ``positions [T]`` with tables ``[max_pos, head_dim // 2]``.

    In place when the native kernel runs (x's heads contiguous within each row); the result is
    returned either way.
    """
    ok = (
        native.usable(x, cos_cache, sin_cache)
        and x.dim() == 3
        and x.stride(2) == 1
        and x.stride(1) == x.shape[2]
        and x.shape[2] % 2 == 0
        and positions.dtype == torch.int64
        and positions.is_contiguous()
        and tuple(positions.shape) == (x.shape[0],)
        and cos_cache.is_contiguous()
        and sin_cache.is_contiguous()
        and cos_cache.shape == sin_cache.shape
        and cos_cache.dim() == 2
        and cos_cache.shape[1] == x.shape[2] // 2
    )
    lib = native.library() if ok else None
    if lib is None:
        cos = cos_cache.index_select(0, positions).unsqueeze(1)  # [T, 1, head_dim // 2]
        sin = sin_cache.index_select(0, positions).unsqueeze(1)
        return rope_reference(x, cos, sin)
    rc = lib.lp_rope_neox(
        native.ptr(x), x.stride(0), x.shape[0], x.shape[1], x.shape[2],
        native.ptr(positions), native.ptr(cos_cache), native.ptr(sin_cache),
        cos_cache.shape[0], native.num_threads(),
    )  # fmt: skip
    _check(rc, "lp_rope_neox")
    return x


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [T, 2 * inter]`` = gate | up -> ``[T, inter]``."""
    ok = native.usable(gate_up) and _rows_ok(gate_up) and gate_up.shape[1] == 2 * inter
    lib = native.library() if ok else None
    if lib is None:
        gate, up = gate_up.split(inter, dim=-1)
        return F.silu(gate) * up
    out = torch.empty((gate_up.shape[0], inter), dtype=gate_up.dtype)
    rc = lib.lp_silu_mul(
        native.ptr(gate_up), gate_up.stride(0), gate_up.shape[0], inter,
        native.ptr(out), out.stride(0), native.num_threads(),
    )  # fmt: skip
    _check(rc, "lp_silu_mul")
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for ``x [S, V]`` (first maximum; the first NaN if there is one)."""
    ok = native.usable(x) and _rows_ok(x) and x.shape[0] > 0 and x.shape[1] > 0
    lib = native.library() if ok else None
    if lib is None:
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    rc = lib.lp_argmax_rows(
        native.ptr(x), x.stride(0), x.shape[0], x.shape[1], native.ptr(out), native.num_threads()
    )
    _check(rc, "lp_argmax_rows")
    return out


def sample_rows_reference(x: torch.Tensor, inv_temp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: per row, the first token whose cumulative probability under
    ``softmax(x * inv_temp)`` exceeds ``u`` (``x [S, V]``, ``inv_temp [S]`` fp32, ``u [S]`` fp64
    in [0, 1)). The cumulative sums are fp64; a token at -inf (probability 0) is never drawn."""
    probs = (x.float() * inv_temp.unsqueeze(1)).softmax(dim=-1)  # [S, V]
    cdf = probs.double().cumsum(dim=-1)  # [S, V]
    target = (u.to(cdf.device) * cdf[:, -1]).unsqueeze(1)  # [S, 1]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)  # [S]: first cdf > target
    # rounding can leave target at the total: the last token with probability
    last = (probs > 0).cumsum(dim=-1).argmax(dim=-1)  # [S]: the first index of the final count
    return torch.minimum(idx, last)


def sample_rows(x: torch.Tensor, inv_temp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``x [S, V]`` drawn from ``softmax(x * inv_temp)`` at the uniforms
    ``u [S]`` (fp64, [0, 1)): ``sample_rows_reference``'s rule in one pass per row on the CPU
    (one exp per value, no [S, V] temporaries). A row with a NaN or with no finite value gets its
    argmax in both."""
    ok = (
        native.usable(x, inv_temp)
        and _rows_ok(x)
        and x.shape[0] > 0
        and 0 < x.shape[1] <= 1 << 22
        and inv_temp.is_contiguous()
        and tuple(inv_temp.shape) == (x.shape[0],)
        and u.dtype == torch.float64
        and u.is_contiguous()
        and tuple(u.shape) == (x.shape[0],)
    )
    lib = native.library() if ok else None
    if lib is None:
        bad = ~torch.isfinite(x.amax(dim=-1))  # [S]: amax is NaN where the row has one
        # no branch on bad: on a GPU that would wait for the device
        return torch.where(bad, x.argmax(dim=-1), sample_rows_reference(x, inv_temp, u))
    out = torch.empty(x.shape[0], dtype=torch.int64)
    rc = lib.lp_sample_rows(
        native.ptr(x), x.stride(0), x.shape[0], x.shape[1],
        native.ptr(inv_temp), native.ptr(u), native.ptr(out), native.num_threads(),
    )  # fmt: skip
    _check(rc, "lp_sample_rows")
    return out
