"""select_backend: ``auto`` picks the native CPU backend exactly where it runs (CPU, fp32, kernels
built, at most MAX_GROUP query heads per KV head) and torch elsewhere; ``torch`` and ``native``
are honoured or refused with the reason."""

from __future__ import annotations

import os

import pytest
import torch

from loraplex.config import ModelConfig
from loraplex.engine.attention.native import MAX_GROUP, NativePagedAttention
from loraplex.engine.attention.select import native_unavailable, select_backend
from loraplex.engine.attention.torch_backend import TorchPagedAttention
from loraplex.kernels import native

CPU = torch.device("cpu")
HAVE_NATIVE = native.library() is not None
# On CI the compiler is part of the image: a missing library fails test_native_backend_is_chosen.
needs_native = pytest.mark.skipif(
    not HAVE_NATIVE and not os.environ.get("CI"), reason="native CPU kernels unavailable"
)


@needs_native
def test_native_backend_is_chosen() -> None:
    assert native.library() is not None
    assert isinstance(select_backend("auto", CPU, torch.float32), NativePagedAttention)


@pytest.mark.parametrize(
    ("device", "dtype"),
    [(CPU, torch.bfloat16), (CPU, torch.float16), (torch.device("meta"), torch.float32)],
)
def test_torch_backend_outside_cpu_fp32(device: torch.device, dtype: torch.dtype) -> None:
    assert type(select_backend("auto", device, dtype)) is TorchPagedAttention
    with pytest.raises(ValueError, match="CPU fp32 only"):
        NativePagedAttention(device, dtype)


@needs_native
def test_more_query_heads_per_kv_head_than_the_kernel_takes_chooses_torch() -> None:
    assert type(select_backend("auto", CPU, torch.float32, 130, 2)) is TorchPagedAttention
    assert isinstance(select_backend("auto", CPU, torch.float32, 128, 2), NativePagedAttention)


@needs_native
def test_native_off_chooses_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as env:
        env.setenv(native.NATIVE_ENV, "0")
        native.library.cache_clear()
        try:
            assert type(select_backend("auto", CPU, torch.float32)) is TorchPagedAttention
            with pytest.raises(RuntimeError, match="not available"):
                NativePagedAttention(CPU, torch.float32)
        finally:
            native.library.cache_clear()
    assert isinstance(select_backend("auto", CPU, torch.float32), NativePagedAttention)


def test_torch_is_torch_everywhere() -> None:
    for device, dtype in (
        (CPU, torch.float32),
        (CPU, torch.bfloat16),
        (torch.device("meta"), torch.float32),
    ):
        assert type(select_backend("torch", device, dtype)) is TorchPagedAttention


@pytest.mark.parametrize(
    ("device", "dtype", "heads", "why"),
    [
        (CPU, torch.bfloat16, (1, 1), "float32 only"),
        (torch.device("meta"), torch.float32, (1, 1), "float32 only"),
        (CPU, torch.float32, (MAX_GROUP * 2 + 2, 2), "more than its kernel takes"),
    ],
)
def test_native_where_it_cannot_run_says_why(
    device: torch.device, dtype: torch.dtype, heads: tuple[int, int], why: str
) -> None:
    assert why in (native_unavailable(device, dtype, *heads) or "")
    with pytest.raises(ValueError, match=f"'native' cannot serve this model: .*{why}"):
        select_backend("native", device, dtype, *heads)


@needs_native
def test_native_where_it_runs() -> None:
    assert native_unavailable(CPU, torch.float32, 9, 3) is None
    assert isinstance(select_backend("native", CPU, torch.float32, 9, 3), NativePagedAttention)


def test_unknown_names_are_refused() -> None:
    with pytest.raises(ValueError, match="auto, torch, native or triton"):
        select_backend("flash", CPU, torch.float32)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="attention_backend must be one of auto, torch, native"):
        ModelConfig(attention_backend="flash")  # type: ignore[arg-type]
    assert ModelConfig().attention_backend == "auto"
