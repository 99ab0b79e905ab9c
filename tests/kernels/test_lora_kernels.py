"""LoRA shrink/expand: Triton kernels (interpreted on the CPU) vs torch paths vs a per-token loop."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from loraplex.kernels import (
    BACKEND_ENV,
    HAS_TRITON,
    LoRAKernelMeta,
    LoRALayerWeights,
    add_lora,
    add_lora_torch,
    lora_expand,
    lora_expand_torch,
    lora_ops,
    lora_shrink,
    lora_shrink_torch,
    native,
    select_backend,
)
from loraplex.kernels.lora_ops import GROUP_CACHE_SIZE, LOOP_MAX_SEGMENTS, add_lora_native

TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=1e-1, rtol=2e-2),
}


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the Triton kernels on the CPU; the kernels are jitted at first launch, so this works
    even when another module imported triton first."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@dataclass
class Case:
    x: torch.Tensor  # [T, in]
    y0: torch.Tensor  # [T, total_out]
    slots: torch.Tensor  # [T]
    weights: LoRALayerWeights
    meta: LoRAKernelMeta


def make_weights(
    ranks: list[int],
    max_rank: int,
    in_features: int,
    widths: list[int],
    dtype: torch.dtype,
    gen: torch.Generator,
) -> LoRALayerWeights:
    """Stacks with random weights in each slot's first ``rank`` rows/cols, zeros beyond."""
    L = len(ranks)
    a_list, b_list = [], []
    for n in widths:
        a = torch.zeros(L, max_rank, in_features)  # [L, R, in]
        b = torch.zeros(L, max_rank, n)  # [L, R, n]
        for s, r in enumerate(ranks):
            a[s, :r] = torch.randn(r, in_features, generator=gen) / in_features**0.5
            b[s, :r] = torch.randn(r, n, generator=gen) / max(r, 1) ** 0.5
        a_list.append(a.to(dtype))
        b_list.append(b.to(dtype))
    offsets = [sum(widths[:j]) for j in range(len(widths))]
    scales = torch.tensor([2.0 / max(r, 1) ** 0.5 + 0.25 * s for s, r in enumerate(ranks)])
    return LoRALayerWeights(
        tuple(a_list),
        tuple(b_list),
        tuple(offsets),
        torch.tensor(ranks, dtype=torch.int32),
        scales,
    )


def make_case(
    slots: list[int],
    ranks: list[int],
    max_rank: int,
    in_features: int,
    widths: list[int],
    dtype: torch.dtype = torch.float32,
    max_num_tokens: int = 32,
    seed: int = 0,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    T = len(slots)
    weights = make_weights(ranks, max_rank, in_features, widths, dtype, gen)
    x = torch.randn(T, in_features, generator=gen).to(dtype)
    y0 = torch.randn(T, sum(widths), generator=gen).to(dtype)
    meta = LoRAKernelMeta(max_num_tokens, len(ranks))
    token_slots = torch.tensor(slots, dtype=torch.int64)
    meta.prepare(token_slots)
    return Case(x, y0, token_slots, weights, meta)


def naive_add_lora(case: Case) -> torch.Tensor:
    """One token at a time, in fp32, straight from the definition."""
    w = case.weights
    y = case.y0.float().clone()  # [T, total_out]
    for t, s in enumerate(case.slots.tolist()):
        if s < 0:
            continue
        r = int(w.ranks[s])
        for a, b, off in zip(w.lora_a, w.lora_b, w.slice_offsets, strict=True):
            h = w.scales[s] * (case.x[t].float() @ a[s, :r].float().T)  # [r]
            y[t, off : off + b.shape[2]] += h @ b[s, :r].float()
    return y


def naive_shrink(case: Case) -> torch.Tensor:
    w = case.weights
    out = torch.zeros(len(w.lora_a), case.x.shape[0], w.max_rank)  # [slices, T, R]
    for t, s in enumerate(case.slots.tolist()):
        if s >= 0:
            for j, a in enumerate(w.lora_a):
                out[j, t] = w.scales[s] * (case.x[t].float() @ a[s].float().T)
    return out


# Mixed ranks (one tile-aligned, one partial tile, one spanning four tiles), an active slot with
# rank 0, a loaded slot no token uses, base tokens interleaved, unsorted token order.
MIXED_SLOTS = [2, -1, 0, 3, 2, 0, -1, 1, 3, 3, 0, 2, -1, 1, 0, 4]
MIXED_RANKS = [4, 12, 16, 64, 0, 8]  # slot 5 (rank 8) is loaded but unused this step
QKV_WIDTHS = [32, 16, 16]  # q | k | v at offsets 0, 32, 48


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_matches_torch_and_naive(interpret: None, dtype: torch.dtype) -> None:
    case = make_case(MIXED_SLOTS, MIXED_RANKS, 64, 48, QKV_WIDTHS, dtype)
    w, meta, tol = case.weights, case.meta, TOL[dtype]
    want_buf = naive_shrink(case)
    buf_tri = torch.zeros(3, len(MIXED_SLOTS), 64)
    buf_ref = torch.zeros(3, len(MIXED_SLOTS), 64)
    lora_shrink(case.x, w.lora_a, meta, w.ranks, w.scales, buf_tri)
    lora_shrink_torch(case.x, w.lora_a, meta, w.ranks, w.scales, buf_ref)
    torch.testing.assert_close(buf_tri, want_buf, **tol)
    torch.testing.assert_close(buf_ref, want_buf, **tol)

    want_y = naive_add_lora(case)
    y_tri, y_ref = case.y0.clone(), case.y0.clone()
    lora_expand(buf_tri, w.lora_b, meta, w.ranks, y_tri, w.slice_offsets)
    lora_expand_torch(buf_ref, w.lora_b, meta, w.ranks, y_ref, w.slice_offsets)
    for y in (y_tri, y_ref):
        torch.testing.assert_close(y.float(), want_y, **tol)
    base = case.slots < 0
    assert torch.equal(y_tri[base], case.y0[base])  # base-model rows untouched

    y_ops = case.y0.clone()
    add_lora(y_ops, case.x, w, meta, backend="triton")
    torch.testing.assert_close(y_ops.float(), want_y, **tol)


def test_expand_stops_at_each_slot_rank(interpret: None) -> None:
    """Columns of buf past a slot's rank are never read: NaN there must not leak into y."""
    case = make_case(MIXED_SLOTS, MIXED_RANKS, 64, 48, QKV_WIDTHS)
    w, meta = case.weights, case.meta
    buf = torch.zeros(3, len(MIXED_SLOTS), 64)
    lora_shrink_torch(case.x, w.lora_a, meta, w.ranks, w.scales, buf)
    for t, s in enumerate(MIXED_SLOTS):
        buf[:, t, MIXED_RANKS[s] if s >= 0 else 0 :] = float("nan")
    y_tri, y_ref = case.y0.clone(), case.y0.clone()
    lora_expand(buf, w.lora_b, meta, w.ranks, y_tri, w.slice_offsets)
    lora_expand_torch(buf, w.lora_b, meta, w.ranks, y_ref, w.slice_offsets)
    torch.testing.assert_close(y_tri, naive_add_lora(case), **TOL[torch.float32])
    torch.testing.assert_close(y_ref, y_tri, **TOL[torch.float32])


def test_triton_single_slice_and_meta_reuse(interpret: None) -> None:
    """A down_proj-like layer (one slice) over two steps of one meta: the smaller step must not
    see the bigger step's segments."""
    case = make_case(
        [1, 0, 1, 1, 0, -1, 2, 2, 2, 0] * 3, [8, 16, 4], 16, 64, [40], max_num_tokens=32
    )
    w = case.weights
    y = case.y0.clone()
    add_lora(y, case.x, w, case.meta, backend="triton")
    torch.testing.assert_close(y, naive_add_lora(case), **TOL[torch.float32])

    small = make_case([2, -1, 2], [8, 16, 4], 16, 64, [40], seed=1)
    small.meta = case.meta  # reuse the first step's meta and workspace
    small.meta.prepare(small.slots)
    small.weights = w
    y = small.y0.clone()
    add_lora(y, small.x, w, small.meta, backend="triton")
    torch.testing.assert_close(y, naive_add_lora(small), **TOL[torch.float32])


def test_all_base_tokens_is_a_no_op(interpret: None) -> None:
    case = make_case([-1] * 6, [8, 8], 16, 32, [16, 16])
    w, meta = case.weights, case.meta
    assert not meta.has_lora
    buf = torch.full((2, 6, 16), 7.0)
    lora_shrink(case.x, w.lora_a, meta, w.ranks, w.scales, buf)
    assert bool((buf == 7.0).all())
    for backend in ("triton", "torch"):
        y = case.y0.clone()
        add_lora(y, case.x, w, meta, backend=backend)  # type: ignore[arg-type]
        assert torch.equal(y, case.y0)


def test_launcher_rejects_bad_arguments(interpret: None) -> None:
    case = make_case([0, 1, -1, 0], [4, 8], 16, 32, [16, 8])
    w, meta = case.weights, case.meta
    buf = torch.zeros(2, 4, 16)
    a = list(w.lora_a)
    with pytest.raises(ValueError, match=r"lora_a\[1\] is torch.float16"):
        lora_shrink(case.x, [a[0], a[1].half()], meta, w.ranks, w.scales, buf)
    with pytest.raises(ValueError, match="contiguous"):
        lora_shrink(
            case.x,
            [a[0], a[1].transpose(1, 2).contiguous().transpose(1, 2)],
            meta,
            w.ranks,
            w.scales,
            buf,
        )
    with pytest.raises(ValueError, match="out must be"):
        lora_shrink(case.x, a, meta, w.ranks, w.scales, buf[:1])
    with pytest.raises(ValueError, match="1 to 3 slices"):
        lora_shrink(case.x, a * 2, meta, w.ranks, w.scales, torch.zeros(4, 4, 16))
    with pytest.raises(ValueError, match="ranks must be int32"):
        lora_shrink(case.x, a, meta, w.ranks.long(), w.scales, buf)
    with pytest.raises(ValueError, match="prepared for 4"):
        lora_shrink(case.x[:3], a, meta, w.ranks, w.scales, buf[:, :3])
    with pytest.raises(ValueError, match="does not fit"):
        lora_expand(buf, w.lora_b, meta, w.ranks, case.y0[:, :20], w.slice_offsets)
    with pytest.raises(ValueError, match="buf must be"):
        lora_expand(buf.half(), w.lora_b, meta, w.ranks, case.y0, w.slice_offsets)


def test_triton_on_cpu_without_interpreter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    case = make_case([0, 1], [4, 8], 16, 32, [16])
    with pytest.raises(ValueError, match="CUDA tensor"):
        add_lora(case.y0.clone(), case.x, case.weights, case.meta, backend="triton")


# --- the production CPU path (torch) against the naive loop; larger shapes are fine here ---


@pytest.mark.parametrize(
    ("slots", "num_groups", "row_start"),
    [
        # decode: 72 tokens over 8 slots and the base model, shuffled
        (torch.randperm(72, generator=torch.Generator().manual_seed(3)).remainder(9) - 1, 1, None),
        ([s for s in range(8) for _ in range(8)], 1, 0),  # already grouped: no gather
        ([3, 5, -1, 7, 3] + [0] * 200, 2, None),  # long prefill beside decodes: two groups
        ([6, 6, 1, -1, 1, 6], 1, None),  # active slots 1 and 6: weights by index_select
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_lora_torch_matches_naive(
    slots: list[int] | torch.Tensor, num_groups: int, row_start: int | None, dtype: torch.dtype
) -> None:
    slots = [int(s) for s in slots]
    ranks = [8, 16, 4, 64, 8, 32, 12, 8]
    case = make_case(slots, ranks, 64, 96, [96, 32, 32], dtype, max_num_tokens=256)
    groups = case.meta.torch_plan().groups
    assert (len(groups), groups[0].row_start) == (num_groups, row_start)
    if num_groups == 2:
        assert groups[1].row_start == 5  # the prefill chunk: a slice of the batch
    y = case.y0.clone()
    add_lora_torch(y, case.x, case.weights, case.meta)
    torch.testing.assert_close(y.float(), naive_add_lora(case), **TOL[dtype])


def test_add_lora_on_cpu_matches_naive_whichever_path_it_takes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    case = make_case([1, -1, 0, 1], [4, 8], 8, 32, [16, 8])
    y = case.y0.clone()
    add_lora(y, case.x, case.weights, case.meta)  # no TRITON_INTERPRET needed: a CPU path
    torch.testing.assert_close(y, naive_add_lora(case))


def test_select_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    built = native.library() is not None
    assert select_backend(torch.device("cpu")) == ("native" if built else "torch")
    assert select_backend(torch.device("cpu"), torch.bfloat16) == "torch"
    if HAS_TRITON:
        assert select_backend(torch.device("cuda")) == "triton"
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert select_backend(torch.device("cuda")) == "torch"
    assert select_backend(torch.device("cpu")) == "torch"
    monkeypatch.setenv(BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match="torch, triton, native"):
        select_backend(torch.device("cpu"))


# --- the native CPU kernel (lp_lora_add) against the naive loop ---


needs_native = pytest.mark.skipif(
    native.library() is None and not os.environ.get("CI"),
    reason="loraplex's native CPU kernels are not built here (no C compiler)",
)


@needs_native
@pytest.mark.parametrize(
    "slots",
    [
        [int(s) for s in torch.randperm(72, generator=torch.Generator().manual_seed(3)) % 9 - 1],
        [s for s in range(8) for _ in range(8)],  # grouped: full tiles of 8
        [3, 5, -1, 7, 3] + [0] * 203,  # a long run: tiles of 8 and a partial one
        [6, 6, 1, -1, 1, 6],
        [-1, -1, -1],  # base only: nothing to do
    ],
)
@pytest.mark.parametrize("widths", [[96, 32, 32], [200], [64, 70]])
def test_add_lora_native_matches_naive(slots: list[int], widths: list[int]) -> None:
    # ranks up to 64 (the kernel has no rank limit of its own; the dispatcher has one) and a
    # rank-0 (empty) slot; widths that are and are not multiples of the kernel's 64-column panel
    ranks = [8, 16, 4, 64, 8, 32, 0, 8]
    case = make_case(slots, ranks, 64, 96, widths, max_num_tokens=256)
    y = case.y0.clone()
    add_lora_native(y, case.x, case.weights, case.meta)
    torch.testing.assert_close(y, naive_add_lora(case), **TOL[torch.float32])
    base = [t for t, s in enumerate(slots) if s < 0 or ranks[s] == 0]
    assert torch.equal(y[base], case.y0[base])  # base-model and empty-slot rows untouched


@needs_native
def test_add_lora_native_rejects_a_slot_beyond_the_stacks() -> None:
    case = make_case([0, 1], [4, 8], 8, 32, [16])
    case.meta.token_slots[1] = 5  # only 2 slots allocated
    with pytest.raises(RuntimeError, match="lp_lora_add rejected"):
        add_lora_native(case.y0.clone(), case.x, case.weights, case.meta)


@needs_native
def test_native_dispatch_sends_big_runs_and_high_ranks_to_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    calls: list[str] = []
    monkeypatch.setattr(lora_ops, "add_lora_native", lambda *a: calls.append("native"))
    monkeypatch.setattr(lora_ops, "add_lora_torch", lambda *a: calls.append("torch"))
    many = [s for s in range(4) for _ in range(3)]  # 4 runs: more than LOOP_MAX_SEGMENTS
    for slots, ranks, expect in [
        (many, [8, 8, 8, 8], "native"),
        (many, [8, 8, 64, 8], "torch"),  # a rank above NATIVE_MAX_RANK
        ([0] * 12, [8], "torch"),  # one run: a GEMM in place
    ]:
        case = make_case(slots, ranks, 64, 32, [16, 8])
        calls.clear()
        add_lora(case.y0.clone(), case.x, case.weights, case.meta, backend="native")
        assert calls == [expect], (slots, ranks)


def test_layer_weights_validate_shapes() -> None:
    gen = torch.Generator().manual_seed(0)
    w = make_weights([4, 8], 8, 16, [16, 8], torch.float32, gen)
    with pytest.raises(ValueError, match="one entry per slice"):
        LoRALayerWeights(w.lora_a, w.lora_b, (0,), w.ranks, w.scales)
    with pytest.raises(ValueError, match="slice 1"):
        LoRALayerWeights(
            w.lora_a, (w.lora_b[0], w.lora_b[1][:, :4].contiguous()), (0, 16), w.ranks, w.scales
        )


@pytest.mark.parametrize("grouped", [False, True])
def test_add_lora_torch_slices_with_gaps(grouped: bool) -> None:
    """Slices that do not tile y (a gap, spare columns) take the per-slice scatter."""
    slots = [0, 0, 1, 1, 2, 2] if grouped else [2, -1, 0, 1, 0, 2, 1]
    case = make_case(slots, [4, 8, 16], 16, 40, [24, 16])
    w = case.weights
    case.weights = LoRALayerWeights(w.lora_a, w.lora_b, (8, 40), w.ranks, w.scales)
    case.y0 = torch.randn(len(slots), 64)
    assert (case.meta.torch_plan().groups[0].row_start == 0) == grouped
    y = case.y0.clone()
    add_lora_torch(y, case.x, case.weights, case.meta)
    torch.testing.assert_close(y, naive_add_lora(case))


# --- the per-segment path (rows grouped by slot, as the runner orders them) and its cache ---


def grouped(counts: list[int], base: int = 0) -> list[int]:
    """Base rows first, then each slot's rows as one run (the runner's order)."""
    return [-1] * base + [s for s, c in enumerate(counts) for _ in range(c)]


@pytest.mark.parametrize(
    ("slots", "ranks", "widths"),
    [
        (grouped([3, 0, 5, 0], base=3), [8, 16, 4, 8], QKV_WIDTHS),  # decode: fused B
        (grouped([2, 70]), [8, 4], QKV_WIDTHS),  # a prefill run: slice by slice
        (grouped([4, 3]), [32, 12], [40, 24]),  # rank above FUSE_MAX_RANK: slice by slice
        (grouped([1, 0, 3]), [8, 4, 16], [40]),  # one slice
        (grouped([2, 2], base=2)[::-1], [4, 8], QKV_WIDTHS),  # runs in reverse slot order
        (grouped([0, 4, 3], base=1), [8, 0, 4], QKV_WIDTHS),  # a rank-0 slot: nothing added
        # more segments: the padded path, its pad rows dropped before adding to y
        (grouped([3, 5, 1, 0, 4], base=3), [8, 16, 4, 8, 0], QKV_WIDTHS),
        (grouped([3, 1, 40, 2], base=1), [8, 16, 4, 8], QKV_WIDTHS),  # a prefill's own group
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_runs_match_naive(
    slots: list[int], ranks: list[int], widths: list[int], dtype: torch.dtype
) -> None:
    case = make_case(slots, ranks, 32, 48, widths, dtype, max_num_tokens=128)
    assert case.meta.row_runs is not None  # every segment is a run of rows
    y = case.y0.clone()
    add_lora_torch(y, case.x, case.weights, case.meta)
    torch.testing.assert_close(y.float(), naive_add_lora(case), **TOL[dtype])
    base = case.slots < 0
    assert torch.equal(y[base], case.y0[base])  # base-model rows untouched


@pytest.mark.parametrize("counts", [[2, 3], [2, 3, 1]])
def test_row_runs_with_slices_that_do_not_tile(counts: list[int]) -> None:
    case = make_case(grouped(counts, base=1), [4, 8, 16], 16, 40, [24, 16])
    w = case.weights
    case.weights = LoRALayerWeights(w.lora_a, w.lora_b, (8, 40), w.ranks, w.scales)
    case.y0 = torch.randn(len(case.slots), 64)
    y = case.y0.clone()
    add_lora_torch(y, case.x, case.weights, case.meta)
    torch.testing.assert_close(y, naive_add_lora(case))


def test_many_segments_take_the_padded_path() -> None:
    counts = [1 + s % 3 for s in range(LOOP_MAX_SEGMENTS + 4)]
    ranks = [4 + 4 * (s % 3) for s in range(len(counts))]
    case = make_case(grouped(counts, base=2), ranks, 16, 32, QKV_WIDTHS, max_num_tokens=64)
    assert case.meta.num_segments > LOOP_MAX_SEGMENTS
    y = case.y0.clone()
    add_lora_torch(y, case.x, case.weights, case.meta)
    torch.testing.assert_close(y, naive_add_lora(case))


def rewrite_slot(w: LoRALayerWeights, slot: int, rank: int, seed: int) -> None:
    """New random weights (and rank) in ``slot``, written straight into the stacks."""
    gen = torch.Generator().manual_seed(seed)
    for a, b in zip(w.lora_a, w.lora_b, strict=True):
        a[slot].zero_()
        b[slot].zero_()
        a[slot, :rank] = torch.randn(rank, a.shape[2], generator=gen)
        b[slot, :rank] = torch.randn(rank, b.shape[2], generator=gen)
    w.ranks[slot] = rank


@pytest.mark.parametrize("shuffled", [False, True])
def test_prepared_weights_are_reused_until_invalidated(shuffled: bool) -> None:
    """The torch path prepares weights once per slot (per group when shuffled) and reuses
    them; ``invalidate(slot)`` drops that slot's, and only that slot's, prepared weights."""
    slots = [2, 0, 1, 0, 2, 1, -1, 0] if shuffled else grouped([3, 2], base=1)
    case = make_case(slots, [8, 4, 12], 16, 32, QKV_WIDTHS)
    w, cache = case.weights, case.weights.cache
    y = case.y0.clone()
    add_lora_torch(y, case.x, w, case.meta)
    torch.testing.assert_close(y, naive_add_lora(case))
    if shuffled:
        (group,) = case.meta.torch_plan().groups
        form = cache.group_form(group.slots)
        assert form is not None and form.rank == 12
        assert cache.group_form(group.slots) is form  # cached for the next step
    else:
        forms = [cache.slot_form(s) for s in range(3)]
        assert all(cache.slot_form(s) is forms[s] for s in range(3))

    # Writing the stacks without invalidate: the torch path still uses what it prepared.
    rewrite_slot(w, 1, 16, seed=7)
    y_stale = case.y0.clone()
    add_lora_torch(y_stale, case.x, w, case.meta)
    torch.testing.assert_close(y_stale, y)

    version = cache.version
    w.invalidate(1)
    assert cache.version == version + 1
    if shuffled:
        new_form = cache.group_form(group.slots)  # slot 1 is in the group: rebuilt
        assert new_form is not form and new_form is not None and new_form.rank == 16
    else:
        assert cache.slot_form(0) is forms[0] and cache.slot_form(2) is forms[2]
        assert cache.slot_form(1) is not forms[1]
    y_new = case.y0.clone()
    add_lora_torch(y_new, case.x, w, case.meta)
    torch.testing.assert_close(y_new, naive_add_lora(case))  # naive reads the new slot 1
    assert not torch.allclose(y_new, y)


def test_group_cache_is_bounded() -> None:
    case = make_case([0, 1, 0, 2, 3, 1], [4, 4, 4, 4], 8, 16, [16])
    cache = case.weights.cache
    for key in [(0, 1), (1, 2), (2, 3), (0, 3)]:
        cache.group_form(key)
    assert len(cache._groups) == GROUP_CACHE_SIZE
    assert list(cache._groups) == [(2, 3), (0, 3)]  # least recently used dropped
