"""A scheduler on the fake runner driven by backlogged tenants (``Drive``), and the request
maker the scheduling-policy tests share."""

from __future__ import annotations

import random

from loraplex.config import SchedulerConfig
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.request import Request
from loraplex.engine.scheduler import Scheduler
from loraplex.engine.waiting_queue import WaitingQueue
from loraplex.sampling_params import SamplingParams
from tests.utils.fake_runner import FakeRunner, reference_generate

Tenant = str | None


def req(
    rid: str,
    tenant: Tenant,
    priority: int = 0,
    lora_key: str | None = None,
    prompt: int = 4,
    max_tokens: int = 4,
) -> Request:
    seed = sum(map(ord, rid)) * 31
    return Request(
        rid,
        [(seed + 7 * i) % 1000 for i in range(prompt)],
        SamplingParams(max_tokens=max_tokens),
        lora_key=lora_key,
        tenant=tenant,
        priority=priority,
    )


class Drive:
    """A scheduler on the fake runner whose ``backlogged`` tenants always have ``depth`` requests
    waiting (random sizes, the same for every tenant). Checks every output against the reference
    and records each request's wait (steps from arrival to its first token)."""

    def __init__(
        self,
        policy: str = "fair",
        *,
        seed: int = 0,
        max_num_seqs: int = 8,
        num_blocks: int = 400,
        max_loras: int = 4,
        queue: WaitingQueue | None = None,
    ) -> None:
        kv = KVCacheManager(num_blocks, 4)
        config = SchedulerConfig(max_num_seqs, 64, scheduling_policy=policy)  # type: ignore[arg-type]
        self.sched = Scheduler(config, kv, 512, max_loras=max_loras, waiting_queue=queue)
        self.runner = FakeRunner(num_blocks, 4)
        self.rng = random.Random(seed)
        self.backlogged: dict[Tenant, int] = {}
        self.lora_keys: dict[Tenant, list[str | None]] = {}
        self.steps = 0
        self.added: dict[str, int] = {}
        self.first_token: dict[str, int] = {}
        self.requests: list[Request] = []

    def add(
        self,
        tenant: Tenant,
        *,
        prompt: int | None = None,
        max_tokens: int | None = None,
        lora_key: str | None = None,
        priority: int = 0,
    ) -> Request:
        rid = f"{tenant}-{len(self.requests)}"
        keys = self.lora_keys.get(tenant, [None])
        r = req(
            rid,
            tenant,
            lora_key=lora_key or keys[len(self.requests) % len(keys)],
            prompt=prompt or self.rng.randint(4, 12),
            max_tokens=max_tokens or self.rng.randint(4, 16),
            priority=priority,
        )
        self.sched.add_request(r)
        self.added[rid] = self.steps
        self.requests.append(r)
        return r

    def step(self) -> set[str]:
        waiting = {t: 0 for t in self.backlogged}
        for r in self.sched.waiting_requests():
            if r.tenant in waiting:
                waiting[r.tenant] += 1
        for tenant, depth in self.backlogged.items():
            for _ in range(depth - waiting[tenant]):
                self.add(tenant)
        out = self.sched.schedule()
        for o in self.sched.update(out, self.runner.execute(out)):
            self.first_token.setdefault(o.request_id, self.steps)
        self.steps += 1
        return {s.request_id for s in out.requests}

    def run(self, steps: int) -> dict[Tenant, int]:
        """Steps; returns the tokens each tenant was given in them."""
        before = {t: u.num_generated_tokens for t, u in self.sched.stats.tenants.items()}
        for _ in range(steps):
            self.step()
        after = self.sched.stats.tenants
        return {t: u.num_generated_tokens - before.get(t, 0) for t, u in after.items()}

    def finish(self) -> None:
        self.backlogged.clear()
        while self.sched.has_unfinished_requests():
            self.step()
            assert self.steps < 100_000
        for r in self.requests:
            assert r.output_token_ids == reference_generate(r.prompt_token_ids, r.params.max_tokens)
        self.sched.kv.check_integrity()
        assert self.sched.kv.num_used_blocks == 0

    def wait(self, rid: str) -> int:
        return self.first_token[rid] - self.added[rid]
