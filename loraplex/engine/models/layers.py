"""Building blocks shared by the decoder models: linear layers, RMSNorm, rotary embeddings.

Parameters are created with ``torch.empty`` (no random init): the loader fills every one of them
and fails on any it did not fill.

Linear layers are small classes with a ``weight_loader`` so that (a) the loader copies checkpoint
shards into packed layers by name, and (b) a LoRA wrapper can later replace ``forward`` while
reading ``output_slices`` to add one delta per packed slice.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from loraplex.kernels import cpu_ops, native, packed_gemm


class Linear(nn.Module):
    """``y = x @ W.T (+ b)`` with ``W [out_features, in_features]`` (a view of ``W.T``'s storage),
    loaded from one tensor."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        # Stored transposed, ``[in, out]`` row-major, and exposed as the usual ``[out, in]`` view:
        # F.linear then runs ``x @ W.T`` as a plain GEMM over contiguous rows of W.T, which MKL
        # does faster than the transposed GEMM for decode-sized batches (python -m benchmarks.gemm).
        self.weight = nn.Parameter(
            torch.empty(in_features, out_features, dtype=dtype, device=device).t(),
            requires_grad=False,
        )
        self.packed: torch.Tensor | None = None  # pack_weight(): W.T in panels, CPU fp32 only
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(
                torch.empty(out_features, dtype=dtype, device=device), requires_grad=False
            )

    @property
    def output_slices(self) -> dict[str, tuple[int, int]]:
        """``{shard_name: (offset, size)}`` along the output dimension; one slice when unpacked."""
        return {"": (0, self.out_features)}

    def load_shard(self, param_name: str, shard: str, loaded: torch.Tensor) -> None:
        """Copy ``loaded`` into parameter ``param_name`` ("weight"/"bias"), slice ``shard``."""
        param: torch.Tensor | None = getattr(self, param_name)
        if param is None:
            raise KeyError(param_name)
        self.packed = None  # stale once the weight changes
        offset, size = self.output_slices[shard]
        target = param.data.narrow(0, offset, size)
        if tuple(target.shape) != tuple(loaded.shape):
            raise ValueError(
                f"shape mismatch: checkpoint has {tuple(loaded.shape)}, model expects "
                f"{tuple(target.shape)}"
            )
        target.copy_(loaded)

    def pack_weight(self, dtype: torch.dtype = torch.float32) -> None:
        """Keep a panel-packed copy of the (loaded) weight for the CPU GEMM, its values in
        ``dtype`` (float32, or bfloat16 on CPUs with bf16 units).

        A no-op where that kernel does not apply (see ``packed_gemm.pack``); loading a shard
        afterwards drops the copy.
        """
        self.packed = packed_gemm.pack(self.weight.t(), dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_gemm.linear(x, self.weight, self.packed, self.bias)  # [T, out_features]

    # Tensor parallelism (``models/parallel.py``): a LoRA wrapper adds its delta between
    # ``forward_local`` and ``reduce``, on the rank's share of the adapter (``shard_lora``).
    def forward_local(self, x: torch.Tensor) -> torch.Tensor:
        """The output before any cross-rank sum (here: the whole output)."""
        return self.forward(x)

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """The cross-rank sum of ``forward_local``'s output (here: none)."""
        return y

    def local_gemm(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``forward_local`` as ``packed_gemm.linear(x, *local_gemm())``: weight, packed copy,
        bias (a LoRA wrapper runs the same GEMM with its delta in one native call)."""
        return self.weight, self.packed, self.bias

    def shard_lora(
        self, shard: str, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of module ``shard``'s adapter A ``[r, in]``, B ``[out, r]``."""
        return a, b

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class PackedLinear(Linear):
    """Several projections of the same input fused along the output dimension.

    ``qkv_proj``: rows ``[0, q) | [q, q+k) | [q+k, q+k+v)`` hold ``q_proj | k_proj | v_proj``.
    """

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[str, int],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias, dtype, device)
        slices: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shard_sizes.items():
            slices[name] = (offset, size)
            offset += size
        self._slices = slices

    @property
    def output_slices(self) -> dict[str, tuple[int, int]]:
        return dict(self._slices)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in float32 like Hugging Face."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(
            torch.empty(dim, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return cpu_ops.rms_norm(x, self.weight, self.eps)
        return self._reduced_precision(x)

    def add_forward(self, delta: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual += delta`` (in place), then the norm of the sum: the fused residual add."""
        if residual.dtype == torch.float32:
            return cpu_ops.add_rms_norm(delta, residual, self.weight, self.eps)
        residual.add_(delta)
        return self._reduced_precision(residual)

    def _reduced_precision(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The rope settings of a config, whichever way transformers stored them.

    transformers 5 keeps them in ``rope_parameters`` (with ``rope_theta`` inside); older configs have
    ``rope_theta`` at the top level and an optional ``rope_scaling`` dict.
    """
    params: dict[str, Any] = {}
    scaling = getattr(hf_config, "rope_scaling", None)
    if isinstance(scaling, dict):
        params.update(scaling)
    new = getattr(hf_config, "rope_parameters", None)
    if isinstance(new, dict):
        params.update(new)
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", None) or 10000.0
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def rope_inv_freq(head_dim: int, params: dict[str, Any], max_position: int) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (float32) for rope types default and llama3."""
    base = float(params["rope_theta"])
    dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
    if dim != head_dim:
        raise ValueError("partial rotary embeddings are not supported")
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params.get("original_max_position_embeddings") or max_position)
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    raise ValueError(
        f"rope type {rope_type!r} is not supported (supported: default, linear, llama3)"
    )


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables; ``lookup`` indexes them once per step for all layers."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        params: dict[str, Any],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, params, max_position)  # [head_dim // 2]
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim // 2]
        self.cos_cache: torch.Tensor
        self.sin_cache: torch.Tensor
        self.register_buffer(
            "cos_cache", freqs.cos().to(dtype=dtype, device=device), persistent=False
        )
        self.register_buffer(
            "sin_cache", freqs.sin().to(dtype=dtype, device=device), persistent=False
        )

    def batch(self, positions: torch.Tensor) -> RopeBatch:
        """The rotation for one step's ``positions [T]``, shared by every layer."""
        return RopeBatch(self, positions)


class RopeBatch:
    """Applies rope at one step's positions: the native kernel in place where it runs, else torch
    with cos/sin gathered once per step (at the first layer that needs them)."""

    def __init__(self, emb: RotaryEmbedding, positions: torch.Tensor) -> None:
        self.emb = emb
        self.positions = positions  # [T] int64
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Rope on ``x [T, H, head_dim]``; may rotate x in place, returns the result."""
        emb = self.emb
        if native.usable(x, emb.cos_cache) and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
            return cpu_ops.rope_(x, self.positions, emb.cos_cache, emb.sin_cache)
        if self._cos_sin is None:
            cos = emb.cos_cache.index_select(0, self.positions).unsqueeze(1)  # [T, 1, Dh // 2]
            sin = emb.sin_cache.index_select(0, self.positions).unsqueeze(1)
            self._cos_sin = (cos, sin)
        return cpu_ops.rope_reference(x, *self._cos_sin)
