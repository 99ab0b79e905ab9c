"""Batched multi-LoRA kernels (Punica-style SGMV shrink/expand) and the per-step metadata."""

from __future__ import annotations

from loraplex.kernels.lora_expand import lora_expand, lora_expand_torch
from loraplex.kernels.lora_ops import (
    BACKEND_ENV,
    LoRABackend,
    add_lora,
    add_lora_torch,
    select_backend,
)
from loraplex.kernels.lora_shrink import HAS_TRITON, lora_shrink, lora_shrink_torch
from loraplex.kernels.lora_weights import LoRALayerWeights, add_lora_reference, check_page_index
from loraplex.kernels.meta import LoRAKernelMeta, TorchPlan

__all__ = [
    "BACKEND_ENV",
    "HAS_TRITON",
    "LoRABackend",
    "LoRAKernelMeta",
    "LoRALayerWeights",
    "TorchPlan",
    "add_lora",
    "add_lora_reference",
    "add_lora_torch",
    "check_page_index",
    "lora_expand",
    "lora_expand_torch",
    "lora_shrink",
    "lora_shrink_torch",
    "select_backend",
]
