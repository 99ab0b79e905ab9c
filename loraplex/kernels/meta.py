"""Per-step LoRA kernel metadata: tokens grouped into one segment per active adapter slot.

Prepared once per engine step, shared by every LoRA layer of that step. All device buffers are
allocated at construction (sized by ``max_num_tokens`` and ``max_loras``) and refilled in place by
``prepare`` so their addresses never change (a CUDA graph can capture kernels that read them).

Layout after ``prepare(token_slots)`` with ``token_slots = [1, -1, 0, 1, 0]``::

    sorted_token_indices  [2, 4, 0, 3, 1]   LoRA tokens grouped by slot (stable), base tokens last
    active_slots          [0, 1, -1, ...]    slot of segment i; -1 beyond num_segments
    seg_lens              [2, 2, 0, ...]
    seg_starts            [0, 2, 4, ...]     offset of segment i in sorted_token_indices
    seg_row_list          [None, None]       (host) first batch row of segment i when its tokens
                                             are consecutive rows, else None

The runner orders a step's requests by slot, so in the engine every segment is a run of rows
(``seg_row_list`` has no None, ``row_runs`` lists them) and the torch path adds each segment's
delta, or a padded group's real rows, to a slice of y instead of scattering it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The torch path batches segments into padded [G, L] blocks (G segments, L = the longest of
# them). One more block costs ~15 more torch ops, about as much as this many padded rows of
# gather + matmul at decode-sized shapes; the step's blocks minimise padded rows + this cost.
GROUP_COST_ROWS = 64


@dataclass(frozen=True)
class SegmentGroup:
    """Segments the torch path handles with one batched matmul per slice."""

    slots: tuple[int, ...]  # adapter slot of each segment, ascending
    seg_len: int  # L, the longest segment of the group
    pad_index: torch.Tensor  # [G * L] int64 token row per padded position (pads: a real row)
    row_start: int | None  # pad_index == row_start + arange(G * L): rows are a slice of the batch
    real_pos: torch.Tensor | None  # [n] padded positions of the real rows (None: no pads)
    real_rows: torch.Tensor  # [n] their batch rows, in segment order
    real_row_start: int | None  # real_rows == real_row_start + arange(n): a slice of the batch


@dataclass(frozen=True)
class TorchPlan:
    """What the torch LoRA path needs for one step, built once per step (not per layer)."""

    groups: tuple[SegmentGroup, ...]


def group_segments(lens: list[int]) -> list[list[int]]:
    """Partition segment ids (indices into ``lens``) into padded blocks of least cost.

    Cost of a block: its padded rows (segments × longest) + GROUP_COST_ROWS. With segments sorted
    by length the best blocks are runs of that order, found by an O(S²) dynamic program (S is at
    most max_loras). Decode steps give one block; a long prefill beside short decodes gets its
    own. The total padded rows never exceed sum(lens) + GROUP_COST_ROWS × len(lens).
    """
    order = sorted(range(len(lens)), key=lambda i: lens[i])
    S = len(order)
    best = [0] * (S + 1)  # best[j]: least cost of the j shortest segments
    cut = [0] * (S + 1)  # the last block of that solution starts at order[cut[j]]
    for j in range(1, S + 1):
        longest = lens[order[j - 1]]
        best[j], cut[j] = min((best[i] + (j - i) * longest + GROUP_COST_ROWS, i) for i in range(j))
    groups: list[list[int]] = []
    j = S
    while j > 0:
        groups.append(sorted(order[cut[j] : j]))  # segment ids ascend with slot ids
        j = cut[j]
    return groups[::-1]


class LoRAKernelMeta:
    """Token → adapter-slot grouping for one engine step, in preallocated buffers."""

    def __init__(
        self, max_num_tokens: int, max_loras: int, device: torch.device | str = "cpu"
    ) -> None:
        if max_num_tokens <= 0:
            raise ValueError(f"max_num_tokens must be positive, got {max_num_tokens}")
        if max_loras <= 0:
            raise ValueError(f"max_loras must be positive, got {max_loras}")
        self.max_num_tokens = max_num_tokens
        self.max_loras = max_loras
        self.device = torch.device(device)
        dev = self.device
        i32, i64 = torch.int32, torch.int64
        # --- read by the Triton kernels (int32) ---
        self.token_slots = torch.full((max_num_tokens,), -1, dtype=i32, device=dev)  # [max_T]
        self.sorted_token_indices = torch.zeros(max_num_tokens, dtype=i32, device=dev)  # [max_T]
        self.active_slots = torch.full((max_loras,), -1, dtype=i32, device=dev)  # [max_loras]
        self.seg_lens = torch.zeros(max_loras, dtype=i32, device=dev)  # [max_loras]
        self.seg_starts = torch.zeros(max_loras, dtype=i32, device=dev)  # [max_loras]
        # --- read by the torch path (int64 for indexing ops) ---
        self._sorted64 = torch.zeros(max_num_tokens, dtype=i64, device=dev)  # [max_T]
        # sort scratch
        self._sort_values = torch.zeros(max_num_tokens, dtype=i32, device=dev)  # [max_T]
        self._sort_order = torch.zeros(max_num_tokens, dtype=i64, device=dev)  # [max_T]
        self._arange = torch.arange(max_num_tokens, dtype=i64, device=dev)  # [max_T]
        pad_rows = max_num_tokens + GROUP_COST_ROWS * max_loras  # bound: see group_segments
        self._pad_index = torch.zeros(pad_rows, dtype=i64, device=dev)  # [pad_rows]
        self._workspaces: dict[tuple[int, int], torch.Tensor] = {}
        # --- host-side summary of the step ---
        self.has_lora = False
        self.num_tokens = 0
        self.num_lora_tokens = 0
        self.num_segments = 0
        self.max_seg_len = 0
        self.active_slot_list: list[int] = []
        self.seg_len_list: list[int] = []
        self.seg_start_list: list[int] = []
        self.seg_row_list: list[int | None] = []
        # (slot, first row, end row) per segment when every segment is a run of rows, else None
        self.row_runs: list[tuple[int, int, int]] | None = None
        self._plan: TorchPlan | None = None
        # What layers sharing one page index work out once per step (cleared by prepare)
        self.step_memo: dict[object, object] = {}

    def prepare(self, token_slots: torch.Tensor) -> None:
        """Fill the buffers for this step from ``token_slots [T]`` (-1 = base model)."""
        self.has_lora = False  # until this step is fully prepared
        self.step_memo.clear()
        self._plan = None
        if token_slots.dim() != 1:
            raise ValueError(f"token_slots must be 1-D [T], got shape {tuple(token_slots.shape)}")
        if token_slots.dtype.is_floating_point or token_slots.dtype == torch.bool:
            raise ValueError(f"token_slots must be an integer tensor, got {token_slots.dtype}")
        T = token_slots.numel()
        if self.max_num_tokens < T:
            raise ValueError(f"{T} tokens exceed max_num_tokens={self.max_num_tokens}")
        self.num_tokens = T
        n_slots = self.max_loras
        if T == 0:
            self._set_empty()
            return
        slots = self.token_slots[:T]  # [T]
        slots.copy_(token_slots)
        # Base tokens get key max_loras so they sort after every segment.
        key = torch.where(slots < 0, n_slots, slots)  # [T]
        torch.sort(
            key, stable=True, out=(self._sort_values[:T], self._sort_order[:T])
        )  # [T] token order by slot
        self._sorted64[:T].copy_(self._sort_order[:T])
        self.sorted_token_indices[:T].copy_(self._sort_order[:T])
        counts = torch.bincount(key.clamp(0, n_slots), minlength=n_slots + 1)  # [max_loras + 1]
        # Active slots first (ascending), then the unused ones: a stable sort on "is empty".
        seg_order = torch.sort((counts[:n_slots] == 0).to(torch.int32), stable=True)[1]
        seg_lens = counts[:n_slots].index_select(0, seg_order)  # [max_loras]
        self.seg_lens.copy_(seg_lens)
        self.active_slots.copy_(torch.where(seg_lens > 0, seg_order, -1))
        self.seg_starts.copy_(torch.cumsum(seg_lens, 0) - seg_lens)
        # First and last batch row of each slot's tokens: the stable sort keeps rows ascending
        # within a slot, so its tokens are consecutive rows iff last - first == count - 1.
        slot_counts = counts[:n_slots]  # [max_loras]
        first = (torch.cumsum(slot_counts, 0) - slot_counts).clamp_(max=T - 1)  # [max_loras]
        last = (first + slot_counts - 1).clamp_(0, T - 1)  # [max_loras]
        rows = self._sort_order[:T]  # [T]
        ends = torch.cat([rows.index_select(0, first), rows.index_select(0, last)])
        # One host sync for the whole step: per-slot counts, the range of slot ids, segment ends.
        host = torch.cat(
            [counts, torch.stack(torch.aminmax(slots)).to(counts.dtype), ends.to(counts.dtype)]
        ).tolist()
        lo, hi = host[n_slots + 1], host[n_slots + 2]
        if lo < -1 or hi >= n_slots:
            self._set_empty()
            raise ValueError(
                f"token slots must lie in [-1, {n_slots - 1}] (max_loras={n_slots}), "
                f"got values in [{lo}, {hi}]"
            )
        per_slot = host[:n_slots]
        first_rows = host[n_slots + 3 : 2 * n_slots + 3]
        last_rows = host[2 * n_slots + 3 :]
        self.active_slot_list = [s for s, c in enumerate(per_slot) if c > 0]
        self.seg_len_list = [per_slot[s] for s in self.active_slot_list]
        self.seg_row_list = [
            first_rows[s] if last_rows[s] - first_rows[s] == per_slot[s] - 1 else None
            for s in self.active_slot_list
        ]
        runs: list[tuple[int, int, int]] = []
        for slot, row, n in zip(
            self.active_slot_list, self.seg_row_list, self.seg_len_list, strict=True
        ):
            if row is not None:
                runs.append((slot, row, row + n))
        self.row_runs = runs if len(runs) == len(self.seg_row_list) else None
        starts, acc = [], 0
        for n in self.seg_len_list:
            starts.append(acc)
            acc += n
        self.seg_start_list = starts
        self.num_segments = len(self.active_slot_list)
        self.num_lora_tokens = acc
        self.max_seg_len = max(self.seg_len_list, default=0)
        self.has_lora = self.num_segments > 0

    def _set_empty(self) -> None:
        self.active_slots.fill_(-1)
        self.seg_lens.zero_()
        self.seg_starts.zero_()
        self.has_lora = False
        self.num_lora_tokens = self.num_segments = self.max_seg_len = 0
        self.active_slot_list, self.seg_len_list, self.seg_start_list = [], [], []
        self.seg_row_list = []
        self.row_runs = None

    def torch_plan(self) -> TorchPlan:
        """The padded gather layout for the torch path, built on first use in a step."""
        if not self.has_lora:
            raise RuntimeError("torch_plan() needs a step with LoRA tokens (check has_lora)")
        if self._plan is not None:
            return self._plan
        dev = self.device
        groups: list[SegmentGroup] = []
        row = 0
        for members in group_segments(self.seg_len_list):
            G = len(members)
            L = max(self.seg_len_list[i] for i in members)
            starts = torch.tensor([self.seg_start_list[i] for i in members], device=dev)  # [G]
            lens = torch.tensor([self.seg_len_list[i] for i in members], device=dev)  # [G]
            col = self._arange[:L].unsqueeze(0)  # [1, L]
            valid = col < lens.unsqueeze(1)  # [G, L]
            pos = torch.where(valid, starts.unsqueeze(1) + col, starts.unsqueeze(1))  # [G, L]
            pad_index = self._pad_index[row : row + G * L]  # [G*L], pads repeat a segment row
            row += G * L
            torch.index_select(self._sorted64, 0, pos.view(-1), out=pad_index)
            slots = tuple(self.active_slot_list[i] for i in members)
            # Tokens already in segment order with equal segments (a prefill chunk, a decode
            # batch sorted by adapter): the block is a slice of x and y, no gather or scatter.
            first = int(pad_index[0])
            row_start = (
                first
                if first + G * L <= self.num_tokens
                and torch.equal(pad_index, self._arange[first : first + G * L])
                else None
            )
            padded = any(self.seg_len_list[i] < L for i in members)
            real_pos = valid.view(-1).nonzero().view(-1) if padded else None  # [n], pads dropped
            real_rows = pad_index if real_pos is None else pad_index.index_select(0, real_pos)
            first_real, n_real = int(real_rows[0]), real_rows.shape[0]
            real_row_start = (
                first_real
                if first_real + n_real <= self.num_tokens
                and torch.equal(real_rows, self._arange[first_real : first_real + n_real])
                else None
            )
            groups.append(
                SegmentGroup(
                    slots=slots,
                    seg_len=L,
                    pad_index=pad_index,
                    row_start=row_start,
                    real_pos=real_pos,
                    real_rows=real_rows,
                    real_row_start=real_row_start,
                )
            )
        self._plan = TorchPlan(groups=tuple(groups))
        return self._plan

    def workspace(self, num_slices: int, max_rank: int) -> torch.Tensor:
        """Shrink→expand buffer ``[num_slices, T, max_rank]`` fp32, allocated once per shape.

        Zero-filled at allocation; afterwards every entry holds a finite value written by some
        earlier step, so the expand (which reads only each slot's own rank) never sees NaN junk.
        """
        key = (num_slices, max_rank)
        buf = self._workspaces.get(key)
        if buf is None:
            buf = torch.zeros(
                num_slices, self.max_num_tokens, max_rank, dtype=torch.float32, device=self.device
            )  # [num_slices, max_T, R]
            self._workspaces[key] = buf
        return buf[:, : self.num_tokens]  # [num_slices, T, R]
