"""The fused native projection + LoRA call (``lp_gemm_packed_lora`` through
``packed_gemm.linear_lora`` and ``lora_ops.fused_linear_lora``) against the two steps it
replaces: ``F.linear`` then ``add_lora_reference``, on pools with scattered pages."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from loraplex.engine.models.layers import Linear, PackedLinear
from loraplex.kernels import native, packed_gemm
from loraplex.kernels.lora_native import prepare_call
from loraplex.kernels.lora_ops import fused_linear_lora
from loraplex.lora.layers import LoRALinear, LoRAStep
from tests.utils.lora_pool import Case, make_case, reference

if native.library() is None and not os.environ.get("CI"):
    pytest.skip("native CPU kernels unavailable (no C compiler)", allow_module_level=True)

TOL = dict(atol=2e-4, rtol=1e-4)


def _layer(case: Case, widths: list[int], bias: bool, seed: int) -> Linear:
    gen = torch.Generator().manual_seed(seed)
    in_f = case.x.shape[1]
    shards = {f"s{j}": n for j, n in enumerate(widths)}
    layer: Linear = (
        PackedLinear(in_f, shards, bias, torch.float32, torch.device("cpu"))
        if len(widths) > 1
        else Linear(in_f, widths[0], bias, torch.float32, torch.device("cpu"))
    )
    layer.weight.data.copy_(torch.randn(sum(widths), in_f, generator=gen) * 0.1)
    if layer.bias is not None:
        layer.bias.data.copy_(torch.randn(sum(widths), generator=gen))
    layer.pack_weight()
    assert layer.packed is not None
    return layer


def _expected(case: Case, layer: Linear) -> torch.Tensor:
    """F.linear, then every token's delta by the per-token loop (the y0 of the case unused)."""
    base = F.linear(case.x, layer.weight, layer.bias)
    ref_case = Case(case.x, base, case.slots, case.pool, case.meta)
    return reference(ref_case)


@pytest.mark.parametrize(
    ("slots", "ranks", "widths"),
    [
        ([i // 2 for i in range(64)], [8] * 32, [48, 16, 16]),  # decode: 32 adapters, q|k|v
        ([0, -1, 1, 1, 2, -1, 3, 3, 3], [4, 1, 16, 8], [40]),  # base tokens between, mixed ranks
        ([5] * 12 + [0] * 3, [8, 0, 0, 0, 0, 12], [24, 24]),  # a slot with nothing to add
        ([-1, -1, -1], [8], [40]),  # no adapter token
        ([s % 7 for s in range(21)], [2, 4, 6, 8, 10, 12, 14], [33]),  # shuffled: 1-token tiles
        ([i % 32 for i in range(64)], [8] * 32, [96, 32, 160]),  # slices on vector blocks
    ],
)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])  # the pool's
def test_fused_call_matches_gemm_then_reference(
    slots: list[int], ranks: list[int], widths: list[int], bias: bool, dtype: torch.dtype
) -> None:
    case = make_case(slots, ranks, 32, widths, dtype, seed=len(slots), activations=torch.float32)
    layer = _layer(case, widths, bias, seed=3)
    y = packed_gemm.linear_lora(
        case.x,
        layer.weight,
        layer.packed,
        layer.bias,
        lambda y: prepare_call(y, case.x, case.weights, case.meta),
    )
    assert y is not None
    torch.testing.assert_close(y, _expected(case, layer), **TOL)


def test_lora_linear_takes_the_fused_call_and_agrees_with_the_two_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slots = [i // 3 for i in range(24)]
    case = make_case(slots, [8] * 8, 32, [40, 8, 8], seed=1)
    layer = _layer(case, [40, 8, 8], True, seed=4)
    step = LoRAStep()
    lora = LoRALinear(layer, ["s0", "s1", "s2"], step)
    lora.bind(case.weights)
    assert lora.backend == "native"
    fused_calls: list[int] = []
    real = native.library()
    assert real is not None

    class Spy:
        def __getattr__(self, name: str) -> object:
            if name == "lp_gemm_packed_lora":
                fused_calls.append(1)
            return getattr(real, name)

    monkeypatch.setattr(native, "library", lambda: Spy())
    with step.active(case.meta):
        got = lora(case.x)
    assert fused_calls == [1]  # one native call for the projection and its delta
    torch.testing.assert_close(got, _expected(case, layer), **TOL)


def test_fused_call_at_prefill_sized_batches() -> None:
    # a prefill chunk: runs of one adapter, base tokens, and 300 rows (past AVX-512's 128)
    slots = [0] * 100 + [-1] * 40 + [1] * 60 + [2] * 100
    case = make_case(slots, [8, 16, 4], 32, [40, 24], seed=8)
    layer = _layer(case, [40, 24], True, seed=9)
    got = fused_linear_lora(layer, case.x, case.weights, case.meta, "native")
    limit = packed_gemm.max_rows()
    if limit is not None and len(slots) > limit:
        assert got is None  # past this build's cap: the caller runs the two steps
        return
    assert got is not None
    torch.testing.assert_close(got, _expected(case, layer), **TOL)


def test_fused_call_does_not_apply_outside_the_packed_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    case = make_case([0, 0, 1], [8, 8], 32, [40], seed=2)
    layer = _layer(case, [40], False, seed=5)
    # beyond the packed kernel's rows, or an unpacked weight: the caller runs the two steps
    monkeypatch.setattr(packed_gemm, "max_rows", lambda: 2)
    assert fused_linear_lora(layer, case.x, case.weights, case.meta, "native") is None
    monkeypatch.undo()
    layer.packed = None
    assert fused_linear_lora(layer, case.x, case.weights, case.meta, "native") is None
    assert fused_linear_lora(layer, case.x, case.weights, case.meta, "torch") is None


def test_a_bad_page_is_refused_before_y_is_written() -> None:
    case = make_case([0, 0, 1, 1], [8, 8], 32, [40], seed=6)
    layer = _layer(case, [40], False, seed=7)
    case.weights.pages[0, 1, 0] = case.weights.num_pages[0]  # one page past the pool
    written: list[torch.Tensor] = []

    def call(y: torch.Tensor) -> int | None:
        y.fill_(123.0)
        written.append(y)
        return prepare_call(y, case.x, case.weights, case.meta)

    with pytest.raises(RuntimeError, match="check_page_index"):
        packed_gemm.linear_lora(case.x, layer.weight, layer.packed, None, call)
    assert torch.all(written[0] == 123.0)  # neither the GEMM nor any delta ran
