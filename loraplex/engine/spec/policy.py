"""How many draft tokens a request gets in the next step. Pure Python.

Per request: an estimate ``beta`` of the chance that one draft token is accepted, from its own
verifications (exponentially weighted: recent steps count more). The ``j``-th draft is accepted
only if the ``j - 1`` before it were, so it pays off with probability ``beta ** j``, while it
costs one more row in the step whatever happens. A request gets the largest ``k <=
num_speculative_tokens`` with ``beta ** k >= ROW_COST``: with ``beta`` 0.9 all 4 drafts, 0.5 three,
0.2 one, below ``ROW_COST`` none. A request at 0 drafts is probed with one every
``PROBE_EVERY`` steps, so a request that turns copy-heavy later is found again.

Per step: no request speculates when more than ``disable_by_batch_size`` requests are decoding,
because the step is compute-bound then and a draft row costs as much as a real one.
"""

from __future__ import annotations

from dataclasses import dataclass

# The cost of one verification row, as a fraction of the gain of one accepted token. At the
# batch sizes where speculation is on (below the threshold below) a decode step is bound by
# reading the weights, not by arithmetic, so an extra row costs little: 0.1 of a token.
ROW_COST = 0.1
PRIOR_BETA = 0.6  # before any verification: enough for 4 drafts (0.6 ** 4 = 0.13)
PRIOR_WEIGHT = 2.0  # the prior counts as this many draft positions
DECAY = 0.8  # each verification's weight relative to the next one's
PROBE_EVERY = 16  # steps between probes (one draft) of a request at 0 drafts

# Decoding requests above which no request speculates in a step, per device type, when the
# config leaves it unset. Reasoned from where a step stops being bound by weight reads: a step
# of T tokens reads every weight once and does 2 * params * T flops, so it turns compute-bound
# near T = (flops per second) / (bytes per second / 4 bytes per fp32 weight / 2 flops): about 10
# to 20 tokens on a CPU (tens of GFLOP/s against tens of GB/s), a few hundred on a datacenter
# GPU in bf16. With 4 drafts a decoding request brings 5 rows, so the CPU threshold is 4
# requests (20 rows) and the CUDA one 32 (160 rows, below the ridge with room for prefill
# chunks in the same step). ``loraplex bench speculative`` measures the ratio at batch 1 and at
# the 64-request workload, where this keeps speculation off until the batch drains.
DEFAULT_DISABLE_BY_BATCH_SIZE = {"cpu": 4, "cuda": 32}
FALLBACK_DISABLE_BY_BATCH_SIZE = 4  # any other device type


def default_disable_by_batch_size(device_type: str) -> int:
    return DEFAULT_DISABLE_BY_BATCH_SIZE.get(device_type, FALLBACK_DISABLE_BY_BATCH_SIZE)


@dataclass
class Acceptance:
    """One request's acceptance record: weighted accepted drafts over weighted trials (a draft
    accepted, or the rejection that ends a verification)."""

    accepted: float = PRIOR_BETA * PRIOR_WEIGHT
    trials: float = PRIOR_WEIGHT
    steps_off: int = 0  # steps since it last got a draft while at 0

    @property
    def beta(self) -> float:
        return self.accepted / self.trials

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        rejected = 1 if num_accepted < num_drafts else 0
        self.accepted = self.accepted * DECAY + num_accepted
        self.trials = self.trials * DECAY + num_accepted + rejected


class DraftPolicy:
    """Draft lengths per request (``adaptive``) or always the maximum, and the step rule."""

    def __init__(self, max_drafts: int, disable_by_batch_size: int, adaptive: bool = True):
        self.max_drafts = max_drafts
        self.disable_by_batch_size = disable_by_batch_size
        self.adaptive = adaptive
        self._records: dict[str, Acceptance] = {}

    def step_speculates(self, num_decoding: int) -> bool:
        return num_decoding <= self.disable_by_batch_size

    def num_drafts(self, request_id: str) -> int:
        """How many drafts to ask for (0: none this step)."""
        if not self.adaptive:
            return self.max_drafts
        record = self._records.get(request_id)
        if record is None:
            record = self._records[request_id] = Acceptance()
        k = 0
        beta = record.beta
        while k < self.max_drafts and beta ** (k + 1) >= ROW_COST:
            k += 1
        if k == 0:
            record.steps_off += 1
            if record.steps_off >= PROBE_EVERY:
                record.steps_off = 0
                return 1
        return k

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        record = self._records.get(request_id)
        if record is None:
            record = self._records[request_id] = Acceptance()
        record.observe(num_drafts, num_accepted)

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._records.pop(rid, None)
