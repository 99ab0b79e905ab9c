"""A torch-free stand-in for the model runner that simulates the paged KV cache exactly.

It stores, per cache slot, the (token, position) written there, and its "model" reads the whole
context back through the block table. The next token is a hash of that context, so any bug in
block tables, sharing or copy-on-write changes the output, while a correct engine gives every
request the same tokens it would get alone.
"""

from __future__ import annotations

import hashlib

from loraplex.engine.records import RunnerOutput, ScheduledRequest, SchedulerOutput

VOCAB = 1000


def next_token(context: list[int], seed: int = 0) -> int:
    digest = hashlib.sha256(repr((seed, context)).encode()).digest()
    return int.from_bytes(digest[:4], "little") % VOCAB


def reference_generate(prompt: list[int], max_tokens: int, seed: int = 0) -> list[int]:
    tokens = list(prompt)
    out: list[int] = []
    for _ in range(max_tokens):
        t = next_token(tokens, seed)
        out.append(t)
        tokens.append(t)
    return out


class FakeRunner:
    """``tokens_per_step`` > 1 returns that many tokens per sampling row, each the "model's"
    next token after the ones before it (as a speculative step whose drafts were all accepted),
    so the outputs stay those of ``reference_generate``. A request scheduled with draft tokens
    is verified as the real runner does: the drafts the "model" agrees with, then its token."""

    def __init__(self, num_blocks: int, block_size: int, tokens_per_step: int = 1):
        self.block_size = block_size
        self.tokens_per_step = tokens_per_step
        # request id -> the token its next sample returns instead of the model's (a grammar
        # forcing a token after a rollback); the tokens after it follow the model again
        self.forced: dict[str, int] = {}
        self.slots: dict[int, tuple[int, int]] = {}  # slot -> (token, position)
        self.num_blocks = num_blocks
        self.steps = 0

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        bs = self.block_size
        for src, dst in out.blocks_to_copy:
            for off in range(bs):
                if src * bs + off in self.slots:
                    self.slots[dst * bs + off] = self.slots[src * bs + off]
                else:
                    self.slots.pop(dst * bs + off, None)
        last_context: dict[str, list[int]] = {}
        for s in out.requests:
            assert 0 not in s.block_table, "null block handed to a request"
            end = s.start_pos + len(s.token_ids)
            assert len(s.block_table) * bs >= end, "block table too short"
            for i, tok in enumerate(s.token_ids):
                pos = s.start_pos + i
                self.slots[s.block_table[pos // bs] * bs + pos % bs] = (tok, pos)
        for s in out.requests:
            end = s.start_pos + len(s.token_ids)
            context = []
            for pos in range(end):
                tok, stored_pos = self.slots[s.block_table[pos // bs] * bs + pos % bs]
                assert stored_pos == pos, (
                    f"{s.request_id}: slot of position {pos} holds {stored_pos}"
                )
                context.append(tok)
            known = s.prompt_token_ids + s.output_token_ids + s.draft_token_ids
            assert context == known[:end], f"{s.request_id}: the KV read back is not its tokens"
            last_context[s.request_id] = context
        sampled: dict[str, list[int]] = {}
        for s in out.requests:
            if s.sample and s.draft_token_ids:
                sampled[s.request_id] = self._verify(s, last_context[s.request_id])
            elif s.sample:
                context = last_context[s.request_id]
                sampled[s.request_id] = self._tokens(s.request_id, context, s.params.seed)
        for f in out.forks:
            context = last_context[f.parent_id]
            sampled[f.request_id] = self._tokens(f.request_id, context, f.params.seed)
        self.steps += 1
        return RunnerOutput(sampled=sampled)

    def _verify(self, s: ScheduledRequest, context: list[int]) -> list[int]:
        """The drafts at the end of ``context`` the model agrees with, then its next token."""
        k = len(s.draft_token_ids)
        known = context[: len(context) - k]
        new: list[int] = []
        for draft in [*s.draft_token_ids, None]:
            new.append(next_token(known + new, s.params.seed or 0))
            if new[-1] != draft:
                break
        return new

    def _tokens(self, request_id: str, context: list[int], seed: int | None) -> list[int]:
        context = list(context)
        new: list[int] = []
        for _ in range(self.tokens_per_step):
            forced = self.forced.pop(request_id, None)
            new.append(next_token(context, seed or 0) if forced is None else forced)
            context.append(new[-1])
        return new
