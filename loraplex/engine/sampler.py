"""Sampler: one step's logits -> the next token of every sampling request (vLLM semantics).

Order per row: token mask (if given) -> raw logprobs (if asked) -> penalties -> greedy argmax ->
temperature -> top-k -> top-p -> min-p -> sample. The mask comes first, as vLLM applies a
grammar's bitmask before its sampler: a masked token is never sampled, and logprobs describe the
distribution the token was drawn from. Sampling inverts each row's cumulative distribution at
one uniform ``u`` per row (``cpu_ops.sample_rows``: one pass and one exp per value on the CPU;
the exponential race ``argmax(probs / q)``, ``q ~ Exp(1)``, that this replaced drew a log and a
random number per value on one thread: docs/benchmarks.md has what that cost). A seeded
row takes its ``u`` from its own generator, so its tokens do not depend on its batch neighbours
or its row. That generator is seeded from the request's seed and the output position the row
samples, so a seeded request's token at a position depends on nothing else: not on how many
rows it sampled before (speculative decoding verifies several positions in one step and
discards the rows after a rejection, ``engine/spec/``), so its tokens are the same with
speculation and without.

Every branch is decided from the Python-side params, never from tensor values, so the device
is only waited on by the ``tolist`` calls at the end.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from loraplex.engine.records import TokenLogprobs
from loraplex.kernels.cpu_ops import argmax_rows, sample_rows
from loraplex.sampling_params import SamplingParams


@dataclass
class SampleRow:
    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens generated so far (before this step's)


# Below this temperature a row is sampled greedily (as vLLM does): logits / T would overflow.
_GREEDY_BELOW = 1e-5


def _uses_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


class Sampler:
    """Samples one token per row. Keeps per-request state (seeded generator, prompt token set)
    from a request's first step until ``forget``."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._generators: dict[str, torch.Generator] = {}
        self._prompt_ids: dict[str, torch.Tensor] = {}  # distinct in-vocab prompt token ids

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._generators.pop(rid, None)
            self._prompt_ids.pop(rid, None)

    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[SampleRow],
        token_masks: Mapping[int, np.ndarray] | None = None,
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """One token per row. ``token_masks``: row index -> the packed bitmask of the tokens
        that row may sample (``records.token_bitmask``), for the rows that have one; each mask
        allows at least one token."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"Sampler needs logits [num_rows, vocab] with one row per SampleRow; got "
                f"{tuple(logits.shape)} for {len(rows)} rows"
            )
        if logits.shape[1] < self.vocab_size:
            raise ValueError(
                f"logits have {logits.shape[1]} columns < vocab_size {self.vocab_size}"
            )
        # Padded vocab columns (beyond the tokenizer's) can never be sampled.
        # The input is never written to: every transform below is out-of-place first.
        logits = logits[:, : self.vocab_size].float()  # [S, V]
        if token_masks:
            logits = self._apply_token_masks(logits, token_masks)
        params = [r.params for r in rows]

        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = None
        if lp_rows:
            lp_logits = logits if len(lp_rows) == len(rows) else logits[lp_rows]  # [L, V]
            raw_logprobs = torch.log_softmax(lp_logits, dim=-1)  # [L, V]

        pen_rows = [i for i, p in enumerate(params) if _uses_penalties(p)]
        if pen_rows:
            logits = self._apply_penalties(logits, rows, pen_rows)

        greedy = [p.temperature < _GREEDY_BELOW for p in params]
        # All greedy: a single argmax, no softmax, no sort, no noise.
        sampled = argmax_rows(logits) if all(greedy) else self._sample(logits, rows, greedy)  # [S]

        packed = None
        if raw_logprobs is not None:
            packed = _gather_logprobs(raw_logprobs, sampled, [params[i] for i in lp_rows], lp_rows)
        token_ids: list[int] = sampled.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(rows)
        if packed is not None:
            for i, lp in zip(lp_rows, packed(), strict=True):
                logprobs[i] = lp
        return token_ids, logprobs

    # -- token masks -----------------------------------------------------------------------

    def _apply_token_masks(
        self, logits: torch.Tensor, masks: Mapping[int, np.ndarray]
    ) -> torch.Tensor:
        """Returns a new tensor: -inf where a masked row may not sample; other rows unchanged."""
        dev, V = logits.device, self.vocab_size
        idx = list(masks)
        words = np.stack([masks[i] for i in idx])  # [M, W] int32
        if words.dtype != np.int32 or words.shape[1] * 32 < V:
            raise ValueError(
                f"token masks must be int32 bitmasks of at least {-(-V // 32)} words (vocab "
                f"{V}); got {words.dtype} of {words.shape[1]} words"
            )
        if dev.type == "cpu":
            # numpy, one thread: a handful of C loops over [M, V]; torch's intra-op threads cost
            # more to wake than this work takes on a busy CPU.
            # bit b of byte k of a row (little-endian words) = token 8k + b
            bits = np.unpackbits(words.view(np.uint8), axis=1, count=V, bitorder="little")
            out = logits.numpy().copy()  # [S, V]
            if idx == list(range(len(out))):
                np.putmask(out, bits == 0, -np.inf)
            else:
                sub = out[idx]  # [M, V]
                np.putmask(sub, bits == 0, -np.inf)
                out[idx] = sub
            return torch.from_numpy(out)
        packed = torch.from_numpy(words).to(dev)  # [M, W]
        shifts = torch.arange(32, dtype=torch.int32, device=dev)  # [32]
        bits_t = (packed.unsqueeze(-1) >> shifts) & 1  # [M, W, 32]: bit b of word w = token 32w + b
        allowed = bits_t.flatten(1)[:, :V].bool()  # [M, V]
        idx_t = torch.tensor(idx, device=dev)  # [M]
        sub_t = logits.index_select(0, idx_t).masked_fill_(~allowed, -math.inf)  # [M, V]
        return logits.index_copy(0, idx_t, sub_t)  # [S, V]

    # -- penalties -------------------------------------------------------------------------

    def _apply_penalties(
        self, logits: torch.Tensor, rows: list[SampleRow], idx: list[int]
    ) -> torch.Tensor:
        """Returns a new tensor; rows outside ``idx`` are copied unchanged."""
        dev, V, P = logits.device, self.vocab_size, len(idx)
        sub_rows = [rows[i] for i in idx]
        idx_t = torch.tensor(idx, device=dev)  # [P]
        sub = logits.index_select(0, idx_t)  # [P, V]

        out_lens = torch.tensor([len(r.output_token_ids) for r in sub_rows], device=dev)  # [P]
        out_ids = torch.tensor(
            list(itertools.chain.from_iterable(r.output_token_ids for r in sub_rows)),
            dtype=torch.long,
            device=dev,
        )  # [T]
        out_row = torch.repeat_interleave(torch.arange(P, device=dev), out_lens)  # [T]
        counts = torch.zeros(P, V, device=dev)  # [P, V]
        counts.index_put_(
            (out_row, out_ids), torch.ones_like(out_ids, dtype=counts.dtype), accumulate=True
        )

        reps = [r.params.repetition_penalty for r in sub_rows]
        if any(rp != 1.0 for rp in reps):
            prompt_ids = [self._prompt_ids_of(r) for r in sub_rows]
            prompt_lens = torch.tensor([len(t) for t in prompt_ids], device=dev)  # [P]
            prompt_row = torch.repeat_interleave(torch.arange(P, device=dev), prompt_lens)
            seen = counts > 0  # [P, V]
            seen[prompt_row, torch.cat(prompt_ids)] = True
            rep = torch.tensor(reps, device=dev).unsqueeze(1)  # [P, 1]
            # HF/vLLM: a seen token's logit moves toward "less likely" whatever its sign.
            penalized = torch.where(sub > 0, sub / rep, sub * rep)  # [P, V]
            sub = torch.where(seen, penalized, sub)  # [P, V]

        pres = [r.params.presence_penalty for r in sub_rows]
        freq = [r.params.frequency_penalty for r in sub_rows]
        if any(pres) or any(freq):
            pres_t = torch.tensor(pres, device=dev).unsqueeze(1)  # [P, 1]
            freq_t = torch.tensor(freq, device=dev).unsqueeze(1)  # [P, 1]
            sub = sub - freq_t * counts - pres_t * (counts > 0)  # [P, V]
        return logits.index_copy(0, idx_t, sub)  # [S, V]

    def _prompt_ids_of(self, row: SampleRow) -> torch.Tensor:
        ids = self._prompt_ids.get(row.request_id)
        if ids is None:
            distinct = sorted({t for t in row.prompt_token_ids if 0 <= t < self.vocab_size})
            ids = torch.tensor(distinct, dtype=torch.long, device=self.device)  # [U]
            self._prompt_ids[row.request_id] = ids
        return ids

    # -- random sampling -------------------------------------------------------------------

    def _sample(
        self, logits: torch.Tensor, rows: list[SampleRow], greedy: list[bool]
    ) -> torch.Tensor:
        dev, V, S = logits.device, self.vocab_size, len(rows)
        params = [r.params for r in rows]
        greedy_tokens = argmax_rows(logits) if any(greedy) else None  # [S]

        # Greedy rows get neutral settings so they never trigger a sort; their draw is discarded.
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        top_k = [
            V if g or p.top_k <= 0 else min(p.top_k, V) for p, g in zip(params, greedy, strict=True)
        ]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy, strict=True)]
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy, strict=True)]

        use_top_p = any(p < 1.0 for p in top_p)
        use_top_k = any(k < V for k in top_k)
        use_min_p = any(m > 0.0 for m in min_p)
        # 1 / T held inside fp32's normal range: a huge temperature is a uniform draw, not 0
        inv = [min(max(1.0 / t, 1e-30), 1e30) for t in temps]
        inv_temp = torch.tensor(inv, dtype=torch.float32, device=dev)  # [S]
        if use_top_p or use_top_k or use_min_p:  # truncation reads the tempered logits
            logits = logits * inv_temp.unsqueeze(1)  # [S, V], owned from here
            inv_temp = torch.ones_like(inv_temp)
            if use_top_p:
                logits = _top_k_top_p_sorted(logits, top_k, top_p)
            elif use_top_k:
                _top_k_only(logits, top_k)
            if use_min_p:
                # p_i < min_p * p_max <=> logit_i < logit_max + log(min_p)  (log(0) = -inf: no-op)
                log_min_p = torch.tensor(
                    [math.log(m) if m > 0 else -math.inf for m in min_p], device=dev
                )
                floor = logits.amax(dim=-1) + log_min_p  # [S]
                logits.masked_fill_(logits < floor.unsqueeze(1), -math.inf)

        seeded = [i for i, p in enumerate(params) if p.seed is not None and not greedy[i]]
        f64 = torch.float64
        u = (
            torch.rand(S, dtype=f64, device=dev)
            if len(seeded) < S
            else torch.empty(S, dtype=f64, device=dev)
        )
        for i in seeded:  # the row's generator lives on the device, as its draw does
            u[i] = torch.rand(1, dtype=f64, device=dev, generator=self._generator(rows[i]))
        sampled = sample_rows(logits, inv_temp, u)  # [S]
        if greedy_tokens is not None:
            sampled = torch.where(torch.tensor(greedy, device=dev), greedy_tokens, sampled)  # [S]
        return sampled

    def _generator(self, row: SampleRow) -> torch.Generator:
        """The row's generator, seeded for the output position it samples."""
        gen = self._generators.get(row.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            self._generators[row.request_id] = gen
        assert row.params.seed is not None
        gen.manual_seed(position_seed(row.params.seed, len(row.output_token_ids)))
        return gen


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_seed(seed: int, position: int) -> int:
    """The generator seed of output position ``position`` of a request seeded ``seed``: well
    mixed, so that (seed, position + 1) and (seed + 1, position), the next position and the
    next sample of an n > 1 request, draw unrelated noise."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ position) >> 1  # torch takes < 2**63


def _gather_logprobs(
    raw: torch.Tensor, sampled: torch.Tensor, params: list[SamplingParams], lp_rows: list[int]
) -> _PackedLogprobs:
    """``raw``: log_softmax of the unprocessed logits of the rows in ``lp_rows``."""
    chosen = sampled.index_select(0, torch.tensor(lp_rows, device=raw.device))  # [L]
    chosen_lp = raw.gather(1, chosen.unsqueeze(1))  # [L, 1]
    rank = (raw > chosen_lp).sum(dim=-1, keepdim=True) + 1  # [L, 1]
    n_top = [p.logprobs or 0 for p in params]
    top_lp, top_ids = raw.topk(max(n_top), dim=-1)  # [L, N], [L, N], most likely first
    floats = torch.cat([chosen_lp, top_lp], dim=1)  # [L, 1 + N]
    ints = torch.cat([chosen.unsqueeze(1), rank, top_ids], dim=1)  # [L, 2 + N]
    return _PackedLogprobs(floats, ints, n_top)


@dataclass
class _PackedLogprobs:
    """Logprob tensors still on the device; calling it copies them to the host (two syncs)."""

    floats: torch.Tensor  # [L, 1 + N]: the chosen token's logprob, then the top-N logprobs
    ints: torch.Tensor  # [L, 2 + N]: the chosen token, its rank, then the top-N token ids
    n_top: list[int]

    def __call__(self) -> list[TokenLogprobs]:
        out = []
        for f, i, n in zip(self.floats.tolist(), self.ints.tolist(), self.n_top, strict=True):
            top = list(zip(i[2 : 2 + n], f[1 : 1 + n], strict=True))
            out.append(TokenLogprobs(token_id=i[0], logprob=f[0], rank=i[1], top=top))
        return out


def _top_k_top_p_sorted(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Masks to -inf what top-k and then top-p drop; one ascending sort per row."""
    dev, V = logits.device, logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1)  # [S, V] ascending, [S, V]
    if any(k < V for k in top_k):
        k = torch.tensor(top_k, device=dev)  # [S]
        kth = sorted_logits.gather(1, (V - k).unsqueeze(1))  # [S, 1] the k-th largest
        sorted_logits.masked_fill_(sorted_logits < kth, -math.inf)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [S, V]
    drop = cum <= (1.0 - torch.tensor(top_p, device=dev)).unsqueeze(1)  # [S, V]
    drop[:, -1] = False  # the most likely token always survives
    sorted_logits.masked_fill_(drop, -math.inf)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)  # [S, V]


def _top_k_only(logits: torch.Tensor, top_k: list[int]) -> None:
    """In place: masks to -inf every token below a row's k-th largest logit (ties kept)."""
    dev, V = logits.device, logits.shape[1]
    k_max = max(k for k in top_k if k < V)
    k = torch.tensor([min(k, k_max) for k in top_k], device=dev)  # [S]
    kth = logits.topk(k_max, dim=-1).values.gather(1, (k - 1).unsqueeze(1))  # [S, 1]
    kth.masked_fill_(torch.tensor([k >= V for k in top_k], device=dev).unsqueeze(1), -math.inf)
    logits.masked_fill_(logits < kth, -math.inf)
