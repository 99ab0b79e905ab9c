"""LoRA over the page pool: Triton kernels (interpreted on the CPU), the native kernel and the torch
paths against the per-token loop ``add_lora_reference``.

Weights come from ``tests.utils.lora_pool``: pages shuffled and scattered over the pool, garbage
rows between them, so a wrong page read shows.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

from loraplex.kernels import lora_ops, native
from loraplex.kernels.lora_expand import lora_expand, lora_expand_torch
from loraplex.kernels.lora_native import add_lora_native, native_fits
from loraplex.kernels.lora_ops import (
    BACKEND_ENV,
    GROUP_CACHE_SIZE,
    LOOP_MAX_SEGMENTS,
    TorchLoRACache,
    add_lora,
    add_lora_torch,
    select_backend,
)
from loraplex.kernels.lora_shrink import HAS_TRITON, lora_shrink, lora_shrink_torch
from loraplex.kernels.lora_weights import LoRALayerWeights
from loraplex.kernels.meta import LoRAKernelMeta
from tests.utils.lora_pool import (
    Case,
    dense_reference,
    dense_shrink,
    make_case,
    reference,
)

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


needs_native = pytest.mark.skipif(
    native.library() is None and not os.environ.get("CI"),
    reason="loraplex's native CPU kernels are not built here (no C compiler)",
)


def run_triton(case: Case) -> torch.Tensor:
    w, meta = case.weights, case.meta
    buf = meta.workspace(w.num_slices, w.max_rank)  # [S, T, R] fp32
    y = case.y0.clone()
    lora_shrink(case.x, w, meta, buf)
    lora_expand(buf, w, meta, y)
    return y


def run_torch_reference(case: Case) -> torch.Tensor:
    w, meta = case.weights, case.meta
    buf = torch.zeros(w.num_slices, len(case.slots), w.max_rank)  # [S, T, R]
    y = case.y0.clone()
    lora_shrink_torch(case.x, w, meta, buf)
    lora_expand_torch(buf, w, meta, y)
    return y


def run_native(case: Case) -> torch.Tensor:
    if native.library() is None:
        pytest.skip("loraplex's native CPU kernels are not built here")
    y = case.y0.clone()
    add_lora_native(y, case.x, case.weights, case.meta)
    return y


def run_torch(case: Case) -> torch.Tensor:
    y = case.y0.clone()
    add_lora_torch(y, case.x, case.weights, case.meta)
    return y


def run_add_lora(case: Case) -> torch.Tensor:
    """The dispatcher's own choice on the CPU (native or torch, by its rules)."""
    y = case.y0.clone()
    add_lora(y, case.x, case.weights, case.meta)
    return y


BACKENDS: dict[str, Callable[[Case], torch.Tensor]] = {
    "triton": run_triton,
    "torch_reference": run_torch_reference,
    "native": run_native,
    "torch": run_torch,
    "add_lora": run_add_lora,
}


@pytest.fixture(params=list(BACKENDS))
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    name: str = request.param
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    if name == "triton":
        if not HAS_TRITON:
            pytest.skip("triton is not installed")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return name


def check_backend(name: str, case: Case) -> torch.Tensor:
    """Run ``name`` on ``case``; assert it matches the reference loop and leaves the rows of
    base-model tokens untouched."""
    want = reference(case)
    y = BACKENDS[name](case)
    torch.testing.assert_close(y.float(), want, **TOL[case.x.dtype])
    base = torch.tensor([s < 0 for s in case.slots], dtype=torch.bool)
    assert torch.equal(y[base], case.y0[base])
    return y


# Mixed ranks (1 to 128: one below a tile, tile-aligned, one past a tile, several tiles), an active
# slot with rank 0 in every slice, one that does not target k (rank 0 in slice 1 only), a loaded
# slot no token uses, base tokens interleaved, unsorted token order.
MIXED_SLOTS = [2, -1, 0, 3, 2, 0, -1, 1, 3, 3, 0, 2, -1, 1, 0, 4, 6, 7, 6]
MIXED_RANKS = [
    [1, 17, 16, 128, 0, 8, 3, 64],  # q
    [1, 17, 16, 128, 0, 8, 0, 64],  # k: slot 6 does not target k
    [1, 17, 16, 128, 0, 8, 3, 64],  # v
]
QKV_WIDTHS = [32, 16, 24]  # q | k | v at offsets 0, 32, 48


def test_pooled_weights_helper_scatters_pages_and_agrees_with_dense() -> None:
    case = make_case(MIXED_SLOTS, MIXED_RANKS, 48, QKV_WIDTHS)
    w = case.weights
    rows = w.slot_rows(0, 3).tolist()  # slot 3, rank 128
    assert rows != sorted(rows) and max(rows) - min(rows) > len(rows)  # shuffled, scattered
    torch.testing.assert_close(reference(case), dense_reference(case), **TOL[torch.float32])


# --- Triton kernels and their torch references ---


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_matches_torch_and_reference(interpret: None, dtype: torch.dtype) -> None:
    case = make_case(MIXED_SLOTS, MIXED_RANKS, 48, QKV_WIDTHS, dtype)
    w, meta, tol = case.weights, case.meta, TOL[dtype]
    T = len(MIXED_SLOTS)
    want_buf = dense_shrink(case)
    buf_tri = torch.zeros(3, T, w.max_rank)
    buf_ref = torch.zeros(3, T, w.max_rank)
    lora_shrink(case.x, w, meta, buf_tri)
    lora_shrink_torch(case.x, w, meta, buf_ref)
    torch.testing.assert_close(buf_tri, want_buf, **tol)
    torch.testing.assert_close(buf_ref, want_buf, **tol)

    want_y = reference(case)
    y_tri, y_ref = case.y0.clone(), case.y0.clone()
    lora_expand(buf_tri, w, meta, y_tri)
    lora_expand_torch(buf_ref, w, meta, y_ref)
    for y in (y_tri, y_ref):
        torch.testing.assert_close(y.float(), want_y, **tol)
    base = torch.tensor([s < 0 or s == 4 for s in MIXED_SLOTS])  # base and all-rank-0 tokens
    assert torch.equal(y_tri[base], case.y0[base])

    y_ops = case.y0.clone()
    add_lora(y_ops, case.x, w, meta, backend="triton")
    torch.testing.assert_close(y_ops.float(), want_y, **tol)


def test_expand_stops_at_each_slot_rank(interpret: None) -> None:
    """Columns of buf past a slot's rank in a slice are never read: NaN there must not leak."""
    case = make_case(MIXED_SLOTS, MIXED_RANKS, 48, QKV_WIDTHS)
    w, meta = case.weights, case.meta
    buf = torch.zeros(3, len(MIXED_SLOTS), w.max_rank)
    lora_shrink_torch(case.x, w, meta, buf)
    for t, s in enumerate(MIXED_SLOTS):
        for j in range(3):
            buf[j, t, MIXED_RANKS[j][s] if s >= 0 else 0 :] = float("nan")
    y_tri, y_ref = case.y0.clone(), case.y0.clone()
    lora_expand(buf, w, meta, y_tri)
    lora_expand_torch(buf, w, meta, y_ref)
    torch.testing.assert_close(y_tri, reference(case), **TOL[torch.float32])
    torch.testing.assert_close(y_ref, y_tri, **TOL[torch.float32])


def test_page_entries_past_the_rank_are_never_read(interpret: None) -> None:
    """Entries at k >= rank may hold anything, even rows outside the pool."""
    case = make_case(MIXED_SLOTS, MIXED_RANKS, 48, QKV_WIDTHS)
    w = case.weights
    want = reference(case)
    k = torch.arange(w.max_rank)  # [R]
    past = k.view(1, 1, -1) >= w.ranks.unsqueeze(2)  # [S, L, R]
    w.pages.masked_fill_(past, -(2**30))
    w.invalidate()
    for name in ("triton", "torch_reference", "native", "torch"):
        torch.testing.assert_close(BACKENDS[name](case), want, **TOL[torch.float32])


def test_triton_single_slice_and_meta_reuse(interpret: None) -> None:
    """A down_proj-like layer (one slice) over two steps of one meta: the smaller step must not
    see the bigger step's segments."""
    ranks = [8, 16, 4]
    case = make_case([1, 0, 1, 1, 0, -1, 2, 2, 2, 0] * 3, ranks, 64, [40], max_num_tokens=32)
    torch.testing.assert_close(run_triton(case), reference(case), **TOL[torch.float32])

    small = make_case([2, -1, 2], ranks, 64, [40], seed=1)
    small.pool = case.pool  # the first step's weights, meta and workspace
    small.meta = case.meta
    small.meta.prepare(torch.tensor(small.slots))
    y = small.y0.clone()
    add_lora(y, small.x, small.weights, small.meta, backend="triton")
    torch.testing.assert_close(y, reference(small), **TOL[torch.float32])


def test_triton_segments_over_several_row_tiles(interpret: None) -> None:
    """Segments of 33, 1, 65 and 32 rows (block_m 32): 7 row tiles, partial ones included, all
    found by the kernel's own segment lookup within its (cdiv(T, BM) + segments)-row grid."""
    slots = [0] * 33 + [1] + [2] * 65 + [3] * 32 + [-1] * 3
    order = torch.randperm(len(slots), generator=torch.Generator().manual_seed(2)).tolist()
    case = make_case([slots[i] for i in order], [2, 16, 5, 9], 32, [16, 8])
    check_backend("triton", case)


def test_all_base_tokens_is_a_no_op(interpret: None) -> None:
    case = make_case([-1] * 6, [8, 8], 32, [16, 16])
    w, meta = case.weights, case.meta
    assert not meta.has_lora
    buf = torch.full((2, 6, 8), 7.0)
    lora_shrink(case.x, w, meta, buf)
    lora_shrink_torch(case.x, w, meta, buf)
    assert bool((buf == 7.0).all())
    for run in (run_triton, run_torch_reference, run_native, run_torch, run_add_lora):
        assert torch.equal(run(case), case.y0)


def test_launcher_rejects_bad_arguments(interpret: None) -> None:
    case = make_case([0, 1, -1, 0], [4, 8], 32, [16, 8])
    w, meta, x, y = case.weights, case.meta, case.x, case.y0
    buf = torch.zeros(2, 4, 8)
    with pytest.raises(ValueError, match="x must be 2-D"):
        lora_shrink(x.half(), w, meta, buf)
    with pytest.raises(ValueError, match="x must be contiguous"):
        lora_shrink(x.t().contiguous().t(), w, meta, buf)
    with pytest.raises(ValueError, match="x has 31 features"):
        lora_shrink(x[:, :31], w, meta, buf)
    with pytest.raises(ValueError, match="buf must be"):
        lora_shrink(x, w, meta, buf[:1])
    with pytest.raises(ValueError, match="buf must be"):
        lora_shrink(x, w, meta, torch.zeros(2, 4, 16))  # not max_rank wide
    with pytest.raises(ValueError, match="buf must be contiguous"):
        lora_shrink(x, w, meta, torch.zeros(2, 8, 4).transpose(1, 2))
    with pytest.raises(ValueError, match="prepared for 4"):
        lora_shrink(x[:3], w, meta, buf[:, :3])
    other = LoRAKernelMeta(8, 3)
    other.prepare(torch.tensor([0, 1, -1, 0]))
    with pytest.raises(ValueError, match="max_loras=3"):
        lora_shrink(x, w, other, buf)
    four = LoRALayerWeights(
        w.lora_a * 2, w.lora_b * 2, w.pages.repeat(2, 1, 1), w.ranks.repeat(2, 1), (0, 16, 24, 32)
    )
    with pytest.raises(ValueError, match="1 to 3 slices"):
        lora_shrink(x, four, meta, torch.zeros(4, 4, 8))
    with pytest.raises(ValueError, match="does not fit"):
        lora_expand(buf, w, meta, y[:, :20])
    with pytest.raises(ValueError, match="y must be 2-D"):
        lora_expand(buf, w, meta, y.half())
    with pytest.raises(ValueError, match="buf must be"):
        lora_expand(buf.half(), w, meta, y)
    overlapping = LoRALayerWeights(w.lora_a, w.lora_b, w.pages, w.ranks, (0, 10))
    with pytest.raises(ValueError, match="must not overlap"):
        lora_expand(buf, overlapping, meta, y)


def test_triton_on_cpu_without_interpreter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    case = make_case([0, 1], [4, 8], 32, [16])
    buf = case.meta.workspace(1, 8)
    with pytest.raises(ValueError, match="CUDA tensor"):
        lora_shrink(case.x, case.weights, case.meta, buf)
    with pytest.raises(ValueError, match="CUDA tensor"):
        lora_expand(buf, case.weights, case.meta, case.y0.clone())


# --- every backend against the reference loop (issue 15) ---


MIXED_1_128 = [1, 2, 3, 7, 8, 15, 16, 17, 31, 33, 64, 100, 127, 128]


@pytest.mark.parametrize("widths", [[48], QKV_WIDTHS], ids=["1-slice", "3-slices"])
def test_mixed_ranks_1_to_128(backend: str, widths: list[int]) -> None:
    L = len(MIXED_1_128)
    slots = [int(s) for s in torch.randperm(3 * L, generator=torch.Generator().manual_seed(5))]
    slots = [s % (L + 1) - 1 for s in slots]  # each slot 2-3 tokens, base tokens among them
    per_slice = [[MIXED_1_128[(s + 3 * j) % L] for s in range(L)] for j in range(len(widths))]
    check_backend(backend, make_case(slots, per_slice, 32, widths))


def test_empty_adapters(backend: str) -> None:
    """Slot 1: rank 0 in every slice (an empty adapter); slot 2 targets only q; slot 3 q and v."""
    ranks = [[8, 0, 4, 16], [8, 0, 0, 0], [8, 0, 0, 16]]
    case = make_case([1, 0, 2, 3, 1, -1, 3, 2, 1], ranks, 32, QKV_WIDTHS)
    y = check_backend(backend, case)
    empty = torch.tensor([s == 1 for s in case.slots])
    assert torch.equal(y[empty], case.y0[empty])  # rank 0 everywhere: rows untouched
    k_cols = slice(32, 48)  # slots 2 and 3 do not target k
    rows = torch.tensor([s in (2, 3) for s in case.slots])
    assert torch.equal(y[rows, k_cols], case.y0[rows, k_cols])


def test_only_empty_adapters(backend: str) -> None:
    case = make_case([0, -1, 1, 0], [0, 0], 32, QKV_WIDTHS)
    assert torch.equal(check_backend(backend, case), case.y0)


@pytest.mark.parametrize("num_adapters", [1, 2, 64, 256])
@pytest.mark.parametrize("widths", [[40], QKV_WIDTHS], ids=["1-slice", "3-slices"])
def test_many_adapters_in_one_batch(backend: str, num_adapters: int, widths: list[int]) -> None:
    """1, 2, 64 and 256 distinct adapters in one batch (256: one token each), mixed ranks (up to
    64 with 64 adapters, 16 with 256; rank 128 is in test_mixed_ranks_1_to_128: a large max_rank
    multiplies the shrink programs the interpreter runs for 256 segments)."""
    ranks = [(1, 4, 8, 2, 16, 3, 5)[s % 7] for s in range(num_adapters)]
    if num_adapters == 64:
        ranks[num_adapters // 2] = 64  # one large rank
    if num_adapters == 256:
        slots = [int(s) for s in torch.randperm(256, generator=torch.Generator().manual_seed(9))]
    else:
        slots = [t % num_adapters for t in range(max(8, 2 * num_adapters))] + [-1]
    case = make_case(slots, ranks, 32, widths)
    assert case.meta.num_segments == num_adapters
    check_backend(backend, case)


def test_a_corrupted_page_index_is_caught(backend: str) -> None:
    """Point one rank-row of slot 2 (slice v) at a row of slot 0: every backend's output must then
    differ from the reference on slot 2's tokens (and only there), so a wrong index cannot pass."""
    case = make_case(MIXED_SLOTS, MIXED_RANKS, 48, QKV_WIDTHS)
    w = case.weights
    want = reference(case)
    victim, donor, j = 2, 0, 2
    w.pages[j, victim, 5] = w.pages[j, donor, 0]  # slot 2 has rank 16 in v, slot 0 rank 1
    w.invalidate(victim)
    y = BACKENDS[backend](case).float()
    rows = torch.tensor([s == victim for s in case.slots])
    v_cols = slice(48, 72)
    assert not torch.allclose(y[rows, v_cols], want[rows, v_cols], atol=1e-2)
    torch.testing.assert_close(y[~rows], want[~rows], **TOL[torch.float32])
    torch.testing.assert_close(y[:, :48], want[:, :48], **TOL[torch.float32])


# --- the native CPU kernel (lp_lora_add) ---


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
def test_add_lora_native_matches_reference(slots: list[int], widths: list[int]) -> None:
    # ranks up to 64 (the kernel has no rank limit of its own; the dispatcher has one), a rank-0
    # (empty) slot; widths that are and are not multiples of the kernel's 64-column panel
    ranks = [8, 16, 4, 64, 8, 32, 0, 8]
    case = make_case(slots, ranks, 96, widths, max_num_tokens=256)
    y = check_backend("native", case)
    untouched = [t for t, s in enumerate(slots) if s < 0 or ranks[s] == 0]
    assert torch.equal(y[untouched], case.y0[untouched])


def native_rejects(case: Case) -> None:
    y = case.y0.clone()
    with pytest.raises(RuntimeError, match="lp_lora_add rejected"):
        add_lora_native(y, case.x, case.weights, case.meta)
    assert torch.equal(y, case.y0)  # checked before anything is written


@needs_native
def test_add_lora_native_rejects_a_slot_beyond_max_loras() -> None:
    case = make_case([0, 1], [4, 8], 32, [16])
    case.meta.token_slots[1] = 5  # only 2 slots
    native_rejects(case)


@needs_native
@pytest.mark.parametrize("page", [-1, "pool_rows", 2**31 - 1])
def test_add_lora_native_rejects_a_page_outside_its_pool(page: int | str) -> None:
    case = make_case([0, 1, 0], [[4, 8], [4, 8]], 32, [16, 8])
    w = case.weights
    w.pages[1, 1, 7] = w.num_pages[1] if page == "pool_rows" else page  # the last rank-row
    native_rejects(case)


@needs_native
def test_add_lora_native_rejects_a_rank_above_max_rank() -> None:
    case = make_case([0, 1], [4, 8], 32, [16])
    case.weights.ranks[0, 0] = 9
    native_rejects(case)
    case.weights.ranks[0, 0] = -1
    native_rejects(case)


@needs_native
def test_add_lora_native_checks_only_the_slots_it_uses() -> None:
    case = make_case([0, 0, -1], [4, 8], 32, [16])
    case.weights.pages[0, 1, 0] = -5  # slot 1 is not in this batch
    check_backend("native", case)


@needs_native
def test_native_fits_and_its_cache() -> None:
    case = make_case([0, 1, 0], [4, 8], 32, [16, 8])
    w, x, y = case.weights, case.x, case.y0
    assert native_fits(y, x, w)
    assert not native_fits(y, x.double(), w)
    assert not native_fits(y.t().contiguous().t(), x, w)  # column stride != 1
    assert not native_fits(y, x[0], w)
    half = make_case([0], [4], 32, [16], torch.bfloat16)
    assert not native_fits(half.y0, half.x, half.weights)
    with pytest.raises(ValueError, match="native LoRA kernel needs"):
        add_lora_native(half.y0, half.x, half.weights, half.meta)

    check_backend("native", case)
    args = w.caches["native"]
    w.invalidate(0)  # pointers never move: the args stay
    assert w.caches["native"] is args
    # A rewritten slot (new rows at new pages, another rank) is read at the next call.
    spare = [p for p in range(w.num_pages[0]) if p not in w.pages[0, :, :8].flatten().tolist()]
    w.pages[0, 1, :2] = torch.tensor(spare[:2], dtype=torch.int32)
    w.lora_a[0][spare[:2]] = torch.randn(2, 32)
    w.lora_b[0][spare[:2]] = torch.randn(2, 16)
    w.ranks[0, 1] = 2
    w.invalidate(1)
    check_backend("native", case)


@needs_native
def test_native_dispatch_sends_only_high_ranks_to_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    calls: list[str] = []
    monkeypatch.setattr(lora_ops, "try_native", lambda *a: calls.append("native") or True)
    monkeypatch.setattr(lora_ops, "add_lora_torch", lambda *a: calls.append("torch"))
    many = [s for s in range(4) for _ in range(3)]  # 4 runs: more than LOOP_MAX_SEGMENTS
    for slots, ranks, expect in [
        (many, [8, 8, 8, 8], "native"),
        (many, [64, 64, 64, 64], "torch"),  # ranks above NATIVE_MAX_RANK, nothing padded
        (many, [64, 64, 64, 32], "torch"),  # padding wastes 256 / 224 rank-rows: < PAD_WASTE
        (many, [8, 8, 64, 8], "native"),  # padding to 64 would waste 256 / 88 rank-rows
        ([0] * 12, [8], "native"),  # one run at rank 8: as fast as a GEMM in place, or faster
        ([0] * 6 + [1] * 6, [8, 16], "native"),  # two runs (LOOP_MAX_SEGMENTS) at low ranks
        ([0] * 12, [64], "torch"),  # one run at rank 64: the GEMM in place
        ([0] * 6 + [1] * 6, [64, 8], "torch"),  # the per-segment loop, each at its own rank
    ]:
        case = make_case(slots, ranks, 32, [16, 8])
        calls.clear()
        add_lora(case.y0.clone(), case.x, case.weights, case.meta, backend="native")
        assert calls == [expect], (slots, ranks)


# --- the production CPU path (torch) against the reference loop; larger shapes are fine here ---


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
def test_add_lora_torch_matches_reference(
    slots: list[int] | torch.Tensor, num_groups: int, row_start: int | None, dtype: torch.dtype
) -> None:
    slot_list = [int(s) for s in slots]
    ranks = [8, 16, 4, 64, 8, 32, 12, 8]
    case = make_case(slot_list, ranks, 96, [96, 32, 32], dtype, max_num_tokens=256)
    groups = case.meta.torch_plan().groups
    assert (len(groups), groups[0].row_start) == (num_groups, row_start)
    if num_groups == 2:
        assert groups[1].row_start == 5  # the prefill chunk: a slice of the batch
    check_backend("torch", case)


def test_add_lora_on_cpu_matches_reference_whichever_path_it_takes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    check_backend("add_lora", make_case([1, -1, 0, 1], [4, 8], 32, [16, 8]))


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


@pytest.mark.parametrize("grouped", [False, True])
def test_add_lora_torch_slices_with_gaps(grouped: bool) -> None:
    """Slices that do not tile y (a gap, spare columns) take the per-slice scatter."""
    slots = [0, 0, 1, 1, 2, 2] if grouped else [2, -1, 0, 1, 0, 2, 1]
    case = make_case(slots, [4, 8, 16], 40, [24, 16], offsets=(8, 40), out_features=64)
    assert (case.meta.torch_plan().groups[0].row_start == 0) == grouped
    check_backend("torch", case)


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
        (grouped([2, 3]), [[8, 4], [0, 4], [8, 0]], QKV_WIDTHS),  # per-slice rank 0
        # more segments: the padded path, its pad rows dropped before adding to y
        (grouped([3, 5, 1, 0, 4], base=3), [8, 16, 4, 8, 0], QKV_WIDTHS),
        (grouped([3, 1, 40, 2], base=1), [8, 16, 4, 8], QKV_WIDTHS),  # a prefill's own group
        (grouped([2, 1, 3], base=1), [[8, 4, 2], [0, 4, 16], [8, 0, 2]], QKV_WIDTHS),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_runs_match_reference(
    slots: list[int], ranks: list[int] | list[list[int]], widths: list[int], dtype: torch.dtype
) -> None:
    case = make_case(slots, ranks, 48, widths, dtype, max_num_tokens=128)
    assert case.meta.row_runs is not None  # every segment is a run of rows
    check_backend("torch", case)


@pytest.mark.parametrize("counts", [[2, 3], [2, 3, 1]])
def test_row_runs_with_slices_that_do_not_tile(counts: list[int]) -> None:
    case = make_case(
        grouped(counts, base=1), [4, 8, 16], 40, [24, 16], offsets=(8, 40), out_features=64
    )
    check_backend("torch", case)


def test_many_segments_take_the_padded_path() -> None:
    counts = [1 + s % 3 for s in range(LOOP_MAX_SEGMENTS + 4)]
    ranks = [4 + 4 * (s % 3) for s in range(len(counts))]
    case = make_case(grouped(counts, base=2), ranks, 32, QKV_WIDTHS, max_num_tokens=64)
    assert case.meta.num_segments > LOOP_MAX_SEGMENTS
    check_backend("torch", case)


def rewrite_slot(case: Case, slot: int, rank: int, seed: int) -> None:
    """New rows for ``slot`` at ``rank`` in every slice, at pages no other slot uses (the
    garbage rows), written straight into the pool and the page index."""
    w = case.weights
    gen = torch.Generator().manual_seed(seed)
    for j, (a, b) in enumerate(zip(w.lora_a, w.lora_b, strict=True)):
        live = {p for s in range(w.max_loras) for p in w.slot_rows(j, s).tolist()}
        free = [p for p in range(a.shape[0]) if p not in live][:rank]
        assert len(free) == rank
        rows = torch.tensor(free)
        a[rows] = torch.randn(rank, a.shape[1], generator=gen).to(a.dtype)
        b[rows] = torch.randn(rank, b.shape[1], generator=gen).to(b.dtype)
        w.pages[j, slot, :rank] = rows.to(torch.int32)
        w.ranks[j, slot] = rank


@pytest.mark.parametrize("shuffled", [False, True])
def test_prepared_weights_are_reused_until_invalidated(shuffled: bool) -> None:
    """The torch path gathers rows once per slot (per group when shuffled) and reuses them;
    ``invalidate(slot)`` drops that slot's, and only that slot's, prepared rows."""
    slots = [2, 0, 1, 0, 2, 1, -1, 0] if shuffled else grouped([3, 2], base=1)
    case = make_case(slots, [8, 4, 12], 32, QKV_WIDTHS, max_rank=16)
    w = case.weights
    y = check_backend("torch", case)
    cache = TorchLoRACache.of(w)
    if shuffled:
        (group,) = case.meta.torch_plan().groups
        form = cache.group_form(group.slots)
        assert form is not None and form.rank == 12
        assert cache.group_form(group.slots) is form  # cached for the next step
    else:
        forms = [cache.slot_form(s) for s in range(3)]
        assert all(cache.slot_form(s) is forms[s] for s in range(3))

    # Writing the pool and the index without invalidate: the torch path still uses what it
    # prepared.
    rewrite_slot(case, 1, 16, seed=7)
    torch.testing.assert_close(run_torch(case), y)

    version = cache.version
    w.invalidate(1)
    assert cache.version == version + 1
    if shuffled:
        new_form = cache.group_form(group.slots)  # slot 1 is in the group: rebuilt
        assert new_form is not form and new_form is not None and new_form.rank == 16
    else:
        assert cache.slot_form(0) is forms[0] and cache.slot_form(2) is forms[2]
        assert cache.slot_form(1) is not forms[1]
    y_new = check_backend("torch", case)  # the reference reads the new slot 1
    assert not torch.allclose(y_new, y)


def test_group_cache_is_bounded() -> None:
    case = make_case([0, 1, 0, 2, 3, 1], [4, 4, 4, 4], 16, [16])
    cache = TorchLoRACache.of(case.weights)
    for key in [(0, 1), (1, 2), (2, 3), (0, 3)]:
        cache.group_form(key)
    assert len(cache._groups) == GROUP_CACHE_SIZE
    assert list(cache._groups) == [(2, 3), (0, 3)]  # least recently used dropped
