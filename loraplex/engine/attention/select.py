"""Which attention backend serves a model: ``ModelConfig.attention_backend`` -> a backend.

* ``torch``: plain torch (any device and dtype);
* ``native``: the C decode kernel (CPU, fp32, native kernels built, at most ``MAX_GROUP`` query
  heads per KV head); asking for it where it cannot run is an error that says why;
* ``triton``: the Triton paged kernel (``triton_backend.py``; CUDA, or the CPU under
  ``TRITON_INTERPRET=1``); asking for it where it cannot run is an error that says why;
* ``auto``: ``native`` where it can run, else ``torch`` (on CUDA too: ``triton`` becomes the CUDA
  default once it has been measured on a GPU).

Callers get the protocol, never a concrete class: the runner and the model use only
``AttentionBackend``'s methods.
"""

from __future__ import annotations

import torch

from loraplex.config import AttentionBackendName
from loraplex.engine.attention.base import AttentionBackend
from loraplex.engine.attention.native import MAX_GROUP, NativePagedAttention
from loraplex.engine.attention.torch_backend import TorchPagedAttention
from loraplex.engine.attention.triton_backend import TritonPagedAttention, triton_unavailable
from loraplex.kernels import native


def native_unavailable(
    device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int
) -> str | None:
    """Why the native backend cannot serve this model here; None when it can."""
    if device.type != "cpu" or dtype != torch.float32:
        return f"it runs on the CPU in float32 only, not {device.type} {dtype}"
    group = num_heads // max(num_kv_heads, 1)
    if group > MAX_GROUP:
        return f"{group} query heads per KV head is more than its kernel takes ({MAX_GROUP})"
    if native.library() is None:
        return f"the native CPU kernels are not available (not built, or {native.NATIVE_ENV}=0)"
    return None


def select_backend(
    name: AttentionBackendName,
    device: torch.device,
    dtype: torch.dtype,
    num_heads: int = 1,
    num_kv_heads: int = 1,
) -> AttentionBackend:
    """The attention backend ``name`` for a model with these heads on ``device``/``dtype``."""
    if name == "torch":
        return TorchPagedAttention(device, dtype)
    if name == "triton":
        why = triton_unavailable(device)
        if why is not None:
            raise ValueError(f"attention_backend 'triton' cannot serve this model: {why}")
        return TritonPagedAttention(device, dtype, num_kv_heads)
    if name not in ("auto", "native"):
        raise ValueError(f"attention_backend must be auto, torch, native or triton; got {name!r}")
    why = native_unavailable(device, dtype, num_heads, num_kv_heads)
    if why is None:
        return NativePagedAttention(device, dtype)
    if name == "native":
        raise ValueError(f"attention_backend 'native' cannot serve this model: {why}; use auto")
    return TorchPagedAttention(device, dtype)
