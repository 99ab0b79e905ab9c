"""ModelRunner: turns a ``SchedulerOutput`` into tensors, runs the model, samples.

One ``execute`` per engine step: copy-on-write block copies, flat batch construction (numpy, no
per-token Python), one forward pass, logits for the sampling rows only, the sampler. A request
with draft tokens (speculative decoding) has ``1 + k`` sampling rows, its last ones, and keeps
the tokens ``rejection_sampler.py`` accepts.

Tensor parallelism (``engine/tensor_parallel.py``): every rank has a runner over its share of
the model. Rank 0's ``execute`` sends each step's ``StepInputs`` to the other ranks (its
``Followers``) just before the forward pass; they run the same forward in ``follow`` and take
part in the logits gather; only rank 0 samples.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

import numpy as np
import torch

from loraplex.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig
from loraplex.engine.attention.base import AttentionBackend, BatchLayout
from loraplex.engine.attention.select import select_backend
from loraplex.engine.cuda_graphs import DecodeGraphRunner, build_decode_graphs
from loraplex.engine.models.llama import DecoderLayer, LlamaForCausalLM
from loraplex.engine.models.loader import (
    ModelSpec,
    build_spec,
    load_model,
    resolve_device,
)
from loraplex.engine.models.parallel import SINGLE, TPGroup
from loraplex.engine.models.precision import resolve_precision, with_kv_cache
from loraplex.engine.records import (
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)
from loraplex.engine.rejection_sampler import accept_drafts, verification_rows
from loraplex.engine.sampler import Sampler, SampleRow
from loraplex.engine.step_inputs import StepInputs, StepRequest
from loraplex.kernels import host_memory

logger = logging.getLogger(__name__)

_CPU_DEFAULT_KV_BYTES = 1 << 30  # 1 GiB
# An empty step (every waiting request waits for an adapter copy) waits this long for a copy to
# finish before it returns: the engine loop then sleeps instead of spinning, and still sees new
# requests within this time.
IDLE_LOAD_WAIT_S = 0.02


class Followers(Protocol):
    """Rank 0's handle on the other tensor-parallel ranks (``engine/tensor_parallel.py``)."""

    def init_kv_cache(self) -> None:
        """Tell every rank to size and allocate its KV cache (a collective)."""

    def step(self, inputs: StepInputs) -> None:
        """Send one step's inputs; every rank then runs its forward pass."""

    def check(self, exc: BaseException) -> None:
        """After ``exc`` in a step: raise a clear error when a rank died (else return)."""


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        model_dir: str,
        lora_config: LoRAConfig | None = None,
        tp: TPGroup = SINGLE,
        followers: Followers | None = None,
    ) -> None:
        """``tp``: this runner's rank (its share of the model); ``followers``: on rank 0 of a
        group of more than one, the other ranks."""
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.tp = tp
        self.followers = followers
        self.device = resolve_device(model_config.device)
        if tp.size > 1 and self.device.type == "cuda":
            self.device = torch.device("cuda", tp.rank)  # one GPU per rank
            torch.cuda.set_device(self.device)
        self.precision = with_kv_cache(
            resolve_precision(model_config.dtype, self.device),
            cache_config.kv_cache_dtype,
            self.device,
        )
        dtype = self.precision.dtype
        torch.manual_seed(model_config.seed)
        self.model: LlamaForCausalLM
        self.model, self.hf_config = load_model(
            model_dir, self.precision, self.device, model_config.max_model_len, tp
        )
        self._spec = build_spec(model_dir, self.hf_config, self.precision.cache_dtype)
        layer0 = self.model.model.layers[0]
        assert isinstance(layer0, DecoderLayer)
        attn0 = layer0.self_attn
        # this rank's heads: what its attention and its share of the KV cache hold
        self._kv_spec = dataclasses.replace(
            self._spec, num_heads=attn0.num_heads, num_kv_heads=attn0.num_kv_heads
        )
        self.max_model_len = model_config.max_model_len or self._spec.max_position_embeddings
        if self.max_model_len > self._spec.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's maximum context "
                f"({self._spec.max_position_embeddings})"
            )
        self.block_size = cache_config.block_size
        self.attn: AttentionBackend = select_backend(
            model_config.attention_backend,
            self.device,
            dtype,
            self._kv_spec.num_heads,
            self._kv_spec.num_kv_heads,
        )
        if self.precision.kv_dtype is not None and model_config.attention_backend == "triton":
            raise ValueError(
                "attention_backend triton reads a KV cache in the activations' dtype; use "
                "kv_cache_dtype auto with it"
            )
        self.sampler = Sampler(self._spec.vocab_size, self.device)
        self.kv_cache: torch.Tensor | None = None  # [layers, 2, num_blocks, block_size, H_kv, Dh]
        self.lora: LoRAManager | None = None
        if lora_config is not None:
            from loraplex.lora.manager import LoRAManager

            self.lora = LoRAManager(
                self.model,
                self.hf_config,
                lora_config,
                scheduler_config.max_num_batched_tokens,
                self.device,
            )
            if followers is not None:
                self.lora.events = []  # rank 0 records its pool decisions for the others
        self.num_blocks = 0
        self.graphs: DecodeGraphRunner | None = None  # decode CUDA graphs (init_kv_cache)

    @property
    def spec(self) -> ModelSpec:
        return self._spec

    # ---- KV cache -------------------------------------------------------------------------

    def _num_blocks(self) -> int:
        cc = self.cache_config
        per_block = self._kv_spec.kv_bytes_per_block(self.block_size)  # this rank's heads
        if cc.num_blocks is not None:
            return cc.num_blocks
        if cc.kv_cache_memory is not None:
            budget = cc.kv_cache_memory
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used_by_others = total - free
            budget = int(total * cc.gpu_memory_utilization) - used_by_others
            # leave room for activations of the largest step (rough: logits dominate)
            budget -= 4 * self.scheduler_config.max_num_batched_tokens * self._spec.vocab_size * 4
            if self.lora is not None:  # the adapter pool comes out of the same memory
                budget = self.lora.kv_share(budget)
        else:
            # enough for every sequence at full length, plus the null block, at most 1 GiB
            per_seq = -(-self.max_model_len // self.block_size)
            needed = (self.scheduler_config.max_num_seqs * per_seq + 1) * per_block
            budget = min(_CPU_DEFAULT_KV_BYTES, needed)
        num = budget // per_block
        if num < 2:
            raise ValueError(
                f"KV cache budget of {max(budget, 0)} bytes holds {max(num, 0)} blocks of "
                f"{per_block} bytes; need at least 2 (raise kv_cache_memory or num_blocks)"
            )
        return int(num)

    def init_kv_cache(self) -> int:
        """Allocate the KV cache (zeroed; block 0 is the null block) and return ``num_blocks``.
        On the CPU its memory is committed here, as vLLM's ``torch.zeros`` cache is: a host short
        of memory fails at start, and no step pays for faulting in the pages it writes first.

        Under tensor parallelism every rank calls it (rank 0 tells the others) and all take the
        smallest count any rank can hold: one block table serves every rank's share."""
        if self.followers is not None:
            self.followers.init_kv_cache()
        num_blocks = self.tp.min_int(self._num_blocks())
        s = self._kv_spec
        shape = self.attn.kv_cache_shape(num_blocks, self.block_size, s.num_kv_heads, s.head_dim)
        if self.device.type == "cpu":  # huge pages where the OS gives them, committed now
            self.kv_cache = host_memory.zeros((s.num_layers, *shape), s.dtype, commit=True)
        else:
            self.kv_cache = torch.zeros((s.num_layers, *shape), dtype=s.dtype, device=self.device)
        self.model.bind_attention(self.attn, list(self.kv_cache.unbind(0)))
        self.num_blocks = num_blocks
        if self.lora is not None and not self.lora.allocated:
            self.lora.allocate_pool(self.kv_cache.numel() * self.kv_cache.element_size())
        sched = self.scheduler_config
        self.graphs = build_decode_graphs(
            self.model,
            self.attn,
            self.lora,
            min(sched.max_num_seqs, sched.max_num_batched_tokens),
            self.max_model_len,
            self.block_size,
            self.device,
            self.model_config.enforce_eager or self.tp.size > 1,  # no graphs under TP
        )
        logger.info(
            "KV cache: %d blocks of %d tokens, %s (%.1f MiB)",
            num_blocks,
            self.block_size,
            str(self.kv_cache.dtype).removeprefix("torch."),
            self.kv_cache.numel() * self.kv_cache.element_size() / 2**20,
        )
        return num_blocks

    # ---- one step -------------------------------------------------------------------------

    def _layout(
        self, reqs: Sequence[ScheduledRequest | StepRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, BatchLayout]:
        bs = self.block_size
        qlens = np.fromiter((len(r.token_ids) for r in reqs), dtype=np.int64, count=len(reqs))
        starts = np.fromiter((r.start_pos for r in reqs), dtype=np.int64, count=len(reqs))
        token_ids: list[int] = []
        for r in reqs:
            token_ids.extend(r.token_ids)
        num_tokens = len(token_ids)
        qstart = np.cumsum(qlens) - qlens  # [B] first row of each request
        req_of_token = np.repeat(np.arange(len(reqs)), qlens)  # [T]
        positions = np.arange(num_tokens) - qstart[req_of_token] + starts[req_of_token]  # [T]
        # slot = block_table[pos // bs] * bs + pos % bs; gather from a padded table
        needed = (starts + qlens + bs - 1) // bs  # [B] blocks covering each request's keys
        width = int(needed.max())
        table = np.zeros((len(reqs), width), dtype=np.int64)  # padding: the null block
        for i, r in enumerate(reqs):
            bt = r.block_table[:width]
            if len(bt) < needed[i]:
                raise ValueError(
                    f"request {r.request_id}: block table of {len(r.block_table)} blocks cannot "
                    f"hold {int(starts[i] + qlens[i])} tokens of {bs}-token blocks"
                )
            table[i, : len(bt)] = bt
        slots = table[req_of_token, positions // bs] * bs + positions % bs  # [T]

        dev = self.device
        ids_t = torch.tensor(token_ids, dtype=torch.long, device=dev)  # [T]
        pos_t = torch.from_numpy(positions).to(dev)  # [T]
        slot_t = torch.from_numpy(slots).to(dev)  # [T]
        layout = BatchLayout(qlens, starts, table, slot_t, bs)
        return ids_t, pos_t, layout

    def _lora_step(
        self, reqs: Sequence[ScheduledRequest | StepRequest], layout: BatchLayout
    ) -> AbstractContextManager[None]:
        """Token -> slot metadata for this step (the slots are activated); nothing when no
        token needs it."""
        slots = np.fromiter((r.lora_slot for r in reqs), dtype=np.int64)  # [B]
        if self.lora is None or not (slots >= 0).any():
            return nullcontext()
        token_slots = torch.from_numpy(np.repeat(slots, layout.query_lens))  # [T]
        self.lora.meta.prepare(token_slots.to(self.device))
        return self.lora.step.active(self.lora.meta)

    def _graph_step(
        self,
        reqs: list[ScheduledRequest],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        layout: BatchLayout,
    ) -> torch.Tensor | None:  # [B, hidden]; None: run the step eagerly (capture failed)
        """A decode step through the captured graphs (adapters activated first), LoRA metadata
        refreshed by the graph runner (engine/cuda_graphs.py)."""
        assert self.graphs is not None
        slots = np.fromiter((r.lora_slot for r in reqs), dtype=np.int64, count=len(reqs))  # [B]
        return self.graphs.run(input_ids, positions, layout, slots)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        if self.followers is None:
            return self._execute(out)
        try:
            return self._execute(out)
        except Exception as exc:
            self.followers.check(exc)  # a rank died: say so
            raise

    def _execute(self, out: SchedulerOutput) -> RunnerOutput:
        lora = self.lora
        if lora is not None and out.lora_plan is not None:
            lora.apply(out.lora_plan)  # residency's decisions: copies start, slot rows point
        if out.is_empty:
            # an idle step while copies run: wait a little for one instead of spinning
            loads = lora.poll(IDLE_LOAD_WAIT_S) if lora is not None else []
            if out.finished_request_ids:
                self.sampler.forget(out.finished_request_ids)
            return RunnerOutput(sampled={}, lora_loads=loads)
        result = self._forward_and_sample(out)
        if lora is not None:
            result.lora_loads = lora.poll()
        return result

    def _forward_and_sample(self, out: SchedulerOutput) -> RunnerOutput:
        if out.finished_request_ids:
            self.sampler.forget(out.finished_request_ids)
        if self.kv_cache is None:
            raise RuntimeError("call init_kv_cache() before execute()")
        self.attn.copy_blocks(self.kv_cache, out.blocks_to_copy)

        reqs = out.requests
        if self.lora is not None and out.lora_slots:
            # Rows grouped by adapter slot: the LoRA kernels then see contiguous segments.
            reqs = sorted(reqs, key=lambda r: r.lora_slot)
        input_ids, positions, layout = self._layout(reqs)
        if self.followers is not None:  # the other ranks run this step's forward with us
            events = self.lora.take_events() if self.lora is not None else []
            self.followers.step(StepInputs.of(out, reqs, events))
        hidden = None
        if self.graphs is not None and self.graphs.can_run(layout):
            hidden = self._graph_step(reqs, input_ids, positions, layout)  # [B, hidden]
        if hidden is None:
            metadata = self.attn.build_metadata(layout)
            with self._lora_step(reqs, layout):
                hidden = self.model(input_ids, positions, metadata)  # [T, hidden]

        last_row = np.cumsum(layout.query_lens) - 1  # [B]
        row_of: dict[str, int] = {}
        rows: list[SampleRow] = []
        index: list[int] = []
        drafts: dict[str, list[int]] = {}
        for i, r in enumerate(reqs):
            last = int(last_row[i])
            row_of[r.request_id] = last
            if r.sample:
                rows.extend(verification_rows(r))  # 1 + k rows: the request's last ones
                index.extend(range(last - len(r.draft_token_ids), last + 1))
                if r.draft_token_ids:
                    drafts[r.request_id] = r.draft_token_ids
        for fork in out.forks:
            rows.append(
                SampleRow(
                    fork.request_id, fork.params, fork.prompt_token_ids, fork.output_token_ids
                )
            )
            index.append(row_of[fork.parent_id])  # a fork samples from its parent's last row
        if not rows:
            return RunnerOutput(sampled={})

        idx = torch.tensor(index, dtype=torch.long, device=self.device)  # [S]
        logits = self.model.compute_logits(hidden.index_select(0, idx)).float()  # [S, V]
        masks = None
        if out.token_masks:  # row index -> bitmask, for the rows whose request has one
            masks = {
                i: out.token_masks[row.request_id]
                for i, row in enumerate(rows)
                if row.request_id in out.token_masks
            }
        tokens, logprobs = self.sampler(logits, rows, masks)
        if drafts:
            return accept_drafts(rows, tokens, logprobs, drafts)
        sampled = {row.request_id: [tok] for row, tok in zip(rows, tokens, strict=True)}
        lps: dict[str, list[TokenLogprobs]] = {
            row.request_id: [lp] for row, lp in zip(rows, logprobs, strict=True) if lp is not None
        }
        return RunnerOutput(sampled=sampled, logprobs=lps)

    @torch.inference_mode()
    def follow(self, inputs: StepInputs) -> None:
        """A rank other than 0: rank 0's step on this rank's share (its pool decisions first),
        through the logits gather; nothing is sampled here."""
        if self.kv_cache is None:
            raise RuntimeError("call init_kv_cache() before follow()")
        if self.lora is not None:
            for event in inputs.lora_events:
                self.lora.replay(event)
        self.attn.copy_blocks(self.kv_cache, inputs.blocks_to_copy)
        reqs = inputs.requests
        input_ids, positions, layout = self._layout(reqs)
        metadata = self.attn.build_metadata(layout)
        with self._lora_step(reqs, layout):
            hidden = self.model(input_ids, positions, metadata)  # [T, hidden]
        last_rows = (np.cumsum(layout.query_lens) - 1).tolist()  # [B]
        index = inputs.sample_index(last_rows)
        if index:  # rank 0 computes logits exactly when some row samples
            idx = torch.tensor(index, dtype=torch.long, device=self.device)  # [S]
            self.model.compute_logits(hidden.index_select(0, idx))
