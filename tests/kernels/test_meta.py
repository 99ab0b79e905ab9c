"""LoRAKernelMeta: per-step grouping of tokens by adapter slot in preallocated buffers."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.meta import GROUP_COST_ROWS, LoRAKernelMeta, group_segments


def _ptrs(meta: LoRAKernelMeta) -> list[int]:
    return [
        t.data_ptr()
        for t in (
            meta.token_slots,
            meta.sorted_token_indices,
            meta.active_slots,
            meta.seg_lens,
            meta.seg_starts,
        )
    ]


def test_sorts_stably_groups_and_offsets() -> None:
    meta = LoRAKernelMeta(max_num_tokens=16, max_loras=4)
    meta.prepare(torch.tensor([2, -1, 0, 2, 0, -1, 2, 3]))
    assert meta.has_lora
    assert meta.num_tokens == 8 and meta.num_lora_tokens == 6 and meta.num_segments == 3
    # slot 0: tokens 2, 4; slot 2: 0, 3, 6; slot 3: 7; then the base tokens 1, 5
    assert meta.sorted_token_indices[:8].tolist() == [2, 4, 0, 3, 6, 7, 1, 5]
    assert meta.active_slots.tolist() == [0, 2, 3, -1]
    assert meta.seg_lens.tolist() == [2, 3, 1, 0]
    assert meta.seg_starts[:3].tolist() == [0, 2, 5]
    assert meta.active_slot_list == [0, 2, 3]
    assert meta.seg_len_list == [2, 3, 1]
    assert meta.seg_start_list == [0, 2, 5]
    assert meta.max_seg_len == 3


def test_all_base_tokens_has_no_lora() -> None:
    meta = LoRAKernelMeta(max_num_tokens=8, max_loras=2)
    meta.prepare(torch.tensor([0, 1, 1]))
    meta.prepare(torch.full((5,), -1))
    assert not meta.has_lora
    assert meta.num_segments == 0 and meta.num_lora_tokens == 0
    assert meta.active_slots.tolist() == [-1, -1]
    assert meta.seg_lens.tolist() == [0, 0]
    meta.prepare(torch.empty(0, dtype=torch.int64))
    assert not meta.has_lora and meta.num_tokens == 0


def test_buffers_reused_across_steps_of_different_sizes() -> None:
    meta = LoRAKernelMeta(max_num_tokens=64, max_loras=4)
    ptrs = _ptrs(meta)
    meta.prepare(torch.randint(-1, 4, (64,)))
    big_ws = meta.workspace(3, 8)
    meta.prepare(torch.tensor([1, 1, -1], dtype=torch.int32))
    assert _ptrs(meta) == ptrs
    assert meta.active_slots.tolist() == [1, -1, -1, -1]  # nothing stale from the big step
    assert meta.seg_lens.tolist() == [2, 0, 0, 0]
    assert meta.sorted_token_indices[:3].tolist() == [0, 1, 2]
    small_ws = meta.workspace(3, 8)
    assert small_ws.shape == (3, 3, 8) and small_ws.data_ptr() == big_ws.data_ptr()
    plan = meta.torch_plan()
    meta.prepare(torch.tensor([3, 0]))
    assert _ptrs(meta) == ptrs
    assert meta.torch_plan() is not plan  # rebuilt for the new step ...
    assert meta.torch_plan() is meta.torch_plan()  # ... and once per step
    assert meta.torch_plan().groups[0].pad_index.data_ptr() == plan.groups[0].pad_index.data_ptr()


def test_torch_plan_padded_layout() -> None:
    meta = LoRAKernelMeta(max_num_tokens=16, max_loras=4)
    meta.prepare(torch.tensor([1, -1, 3, 1, 1, 3]))
    (group,) = meta.torch_plan().groups
    assert group.slots == (1, 3)
    assert group.seg_len == 3 and group.row_start is None
    # slot 1: tokens 0, 3, 4; slot 3: tokens 2, 5, then a pad repeating its first row
    assert group.pad_index.tolist() == [0, 3, 4, 2, 5, 2]
    assert group.real_pos is not None and group.real_pos.tolist() == [0, 1, 2, 3, 4]
    assert group.real_rows.tolist() == [0, 3, 4, 2, 5] and group.real_row_start is None


def test_torch_plan_row_slices() -> None:
    meta = LoRAKernelMeta(max_num_tokens=512, max_loras=4)
    meta.prepare(torch.tensor([0, 0, 2, 2, 3, 3]))
    assert meta.torch_plan().groups[0].row_start == 0
    meta.prepare(torch.tensor([0, 2, 0, 2]))  # equal segments but interleaved
    assert meta.torch_plan().groups[0].row_start is None
    meta.prepare(torch.tensor([-1, 0, 0, 2, 2, -1]))  # base tokens around a sorted block
    assert meta.torch_plan().groups[0].row_start == 1
    meta.prepare(torch.tensor([-1, 0, 0, 2, 2, 2]))  # unequal segments: pads
    (group,) = meta.torch_plan().groups
    assert group.row_start is None
    # the real rows, pads dropped, are still a slice of the batch
    assert group.real_pos is not None and group.real_pos.tolist() == [0, 1, 3, 4, 5]
    assert group.real_row_start == 1 and group.real_rows.tolist() == [1, 2, 3, 4, 5]


def test_long_prefill_gets_its_own_group() -> None:
    meta = LoRAKernelMeta(max_num_tokens=512, max_loras=4)
    # one 300-token prefill (slot 2) beside three decodes: one block would pad 3 rows to 300
    meta.prepare(torch.tensor([1, 3] + [2] * 300 + [0]))
    groups = meta.torch_plan().groups
    assert [g.slots for g in groups] == [(0, 1, 3), (2,)]
    assert groups[0].pad_index.tolist() == [302, 0, 1]
    assert groups[1].pad_index.tolist() == list(range(2, 302))
    assert [g.row_start for g in groups] == [None, 2]
    assert groups[1].pad_index.data_ptr() == groups[0].pad_index.data_ptr() + 3 * 8


@pytest.mark.parametrize(
    ("lens", "want"),
    [
        ([8] * 8, [list(range(8))]),  # decode: one block, no padding
        ([1, 3, 2, 1], [[0, 1, 2, 3]]),  # a little padding beats another block
        ([300, 1, 1, 1], [[1, 2, 3], [0]]),  # the prefill alone, the decodes together
        ([100, 90, 2, 1], [[2, 3], [0, 1]]),
        ([5], [[0]]),
    ],
)
def test_group_segments_least_padding(lens: list[int], want: list[list[int]]) -> None:
    groups = group_segments(lens)
    assert groups == want
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    padded = sum(len(g) * max(lens[i] for i in g) for g in groups)
    assert padded <= sum(lens) + GROUP_COST_ROWS * len(lens)


@pytest.mark.parametrize(
    ("slots", "match"),
    [
        (torch.tensor([0, 4]), r"\[-1, 3\]"),
        (torch.tensor([-2, 0]), r"\[-1, 3\]"),
        (torch.zeros(9, dtype=torch.int64), "max_num_tokens"),
        (torch.zeros(2, 2, dtype=torch.int64), "1-D"),
        (torch.zeros(2), "integer"),
    ],
)
def test_prepare_rejects_bad_input(slots: torch.Tensor, match: str) -> None:
    meta = LoRAKernelMeta(max_num_tokens=8, max_loras=4)
    meta.prepare(torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=match):
        meta.prepare(slots)
    assert not meta.has_lora  # a failed step never leaves the previous step's segments


def test_constructor_validates() -> None:
    with pytest.raises(ValueError, match="max_loras"):
        LoRAKernelMeta(max_num_tokens=8, max_loras=0)
    with pytest.raises(ValueError, match="max_num_tokens"):
        LoRAKernelMeta(max_num_tokens=0, max_loras=2)


def test_segment_rows_when_tokens_are_grouped() -> None:
    meta = LoRAKernelMeta(max_num_tokens=16, max_loras=4)
    meta.prepare(torch.tensor([-1, 0, 0, 2, 2, 2, -1]))  # runs of rows, base rows around them
    assert meta.seg_row_list == [1, 3]
    meta.prepare(torch.tensor([0, 2, 0, 3]))  # slot 0 is split by a slot-2 row
    assert meta.seg_row_list == [None, 1, 3]
    meta.prepare(torch.tensor([3, 3, 3, 1]))  # not in slot order, each slot still one run
    assert meta.active_slot_list == [1, 3] and meta.seg_row_list == [3, 0]
    meta.prepare(torch.tensor([1] * 16))  # the whole batch, at max_num_tokens
    assert meta.seg_row_list == [0]
    meta.prepare(torch.full((3,), -1))
    assert meta.seg_row_list == []
