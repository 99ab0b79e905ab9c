"""LoRALayerWeights: the pooled layout's validation, the page-index check, the reference loop."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from loraplex.kernels.lora_weights import LoRALayerWeights, check_page_index
from tests.utils.lora_pool import dense_reference, make_case, make_pooled_weights, reference


def weights(ranks: Sequence[Sequence[int]] | Sequence[int] = (4, 8, 0)) -> LoRALayerWeights:
    """Two slices (widths 16 and 8, in_features 16), pages scattered, garbage rows between."""
    return make_pooled_weights(ranks, 16, [16, 8], gen=torch.Generator().manual_seed(0)).weights


def test_a_scattered_valid_index_passes() -> None:
    w = weights([[4, 8, 0], [0, 8, 2]])
    rows = w.slot_rows(0, 1).tolist()
    assert len(rows) == 8 and rows != sorted(rows)
    check_page_index(w)


def test_entries_past_the_rank_are_not_checked() -> None:
    w = weights()
    w.pages[0, 0, 4:] = -1  # slot 0 has rank 4
    w.pages[1, 2, :] = 10**6  # slot 2 has rank 0
    check_page_index(w)


@pytest.mark.parametrize("page", [-1, "pool_rows"])
def test_a_page_outside_its_pool_is_caught(page: int | str) -> None:
    w = weights()
    w.pages[1, 1, 7] = w.num_pages[1] if page == "pool_rows" else page
    with pytest.raises(ValueError, match=r"slice 1 slot 1: page .* outside \[0, "):
        check_page_index(w)


def test_a_row_named_by_two_slots_is_caught() -> None:
    """The corruption the kernel tests inject: one rank-row pointed at another adapter's row."""
    w = weights()
    w.pages[0, 1, 3] = w.pages[0, 0, 2]
    with pytest.raises(ValueError, match=r"slice 0: page \d+ is named by slots 0 and 1"):
        check_page_index(w)


def test_the_same_row_number_in_two_slices_is_fine() -> None:
    w = weights([[2, 0], [2, 0]])
    w.pages[1, 0, :2] = w.pages[0, 0, :2]  # different pools: no clash
    check_page_index(w)


def test_a_rank_out_of_range_is_caught() -> None:
    w = weights()
    w.ranks[1, 0] = w.max_rank + 1
    with pytest.raises(ValueError, match="slice 1 slot 0: rank 9 outside"):
        check_page_index(w)
    w.ranks[1, 0] = -1
    with pytest.raises(ValueError, match="rank -1 outside"):
        check_page_index(w)


def test_reference_loop_reads_through_the_index() -> None:
    case = make_case([1, -1, 0, 1, 2], [[4, 8, 0], [0, 8, 2]], 16, [16, 8])
    torch.testing.assert_close(reference(case), dense_reference(case))


def test_layer_weights_validate_shapes() -> None:
    w = weights()
    a, b, p, r = w.lora_a, w.lora_b, w.pages, w.ranks
    with pytest.raises(ValueError, match="one entry per slice"):
        LoRALayerWeights(a, b, p, r, (0,))
    with pytest.raises(ValueError, match="slice 1"):
        LoRALayerWeights(a, (b[0], b[1][:-1].contiguous()), p, r, (0, 16))
    with pytest.raises(ValueError, match="contiguous"):
        LoRALayerWeights((a[0], a[1].t().contiguous().t()), b, p, r, (0, 16))
    with pytest.raises(ValueError, match="pages must be int32"):
        LoRALayerWeights(a, b, p.long(), r, (0, 16))
    with pytest.raises(ValueError, match="ranks must be int32"):
        LoRALayerWeights(a, b, p, r[:, :2], (0, 16))
