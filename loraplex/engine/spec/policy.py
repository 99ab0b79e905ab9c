"""How many draft tokens a request gets in the next step. Pure Python.

Per request: an estimate ``beta`` of the chance that one draft token is accepted, from its own
verifications (exponentially weighted: recent steps count more). The ``j``-th draft is accepted
only if the ``j - 1`` before it were, so it pays off with probability ``beta ** j``, while it
costs one more row in the step whatever happens: ``c``, a row's cost as a fraction of what one
accepted token saves. A request gets the largest ``k <= num_speculative_tokens`` with
``beta ** k >= c``. A request at 0 drafts is probed with one every ``PROBE_EVERY`` steps, so a
request that turns copy-heavy later is found again.

``c`` grows with the number of decoding requests ``B``: a step of a few tokens is bound by
reading the weights, so a row is nearly free; a large step is bound by arithmetic, and a row
costs about what a token does. For SmolLM2-135M in fp32 on a shared 2-core CPU, a step of ``B``
decodes with 4 drafts each against one without (``python -m benchmarks.speculative``; the table
is in docs/benchmarks.md) puts ``c`` (one row over a token) near 0.05 at ``B`` = 1, growing about
linearly to a plateau from ``B`` = 16 on, so on a CPU ``c = min(0.05 * B, 0.7)``: at batch 1 a request with ``beta`` 0.6 (the prior) gets
all 4 drafts, at 8 one, at 16 none; a copy-heavy one (``beta`` 0.9) 4, 4 and 3. No request
speculates when more than ``disable_by_batch_size`` are decoding: 16 on a CPU, where only the
requests accepting almost everything would still draft, and the lookups are not worth it.

On CUDA (not measured here) a step stays bound by weight reads up to a few hundred tokens (the
ridge point of a datacenter GPU in bf16), so a row costs little until then: ``c = min(0.003 *
B, 0.1)``, off above 32 decoding requests (160 rows with 4 drafts each, below the ridge with
room for the prefill chunks of the same step).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceCosts:
    """What a draft row costs on a kind of device, and where speculation stops."""

    row_cost_per_decode: float  # c per decoding request in the step
    row_cost_max: float
    disable_by_batch_size: int

    def row_cost(self, num_decoding: int) -> float:
        return min(self.row_cost_max, self.row_cost_per_decode * max(num_decoding, 1))


DEVICE_COSTS = {
    "cpu": DeviceCosts(0.05, 0.7, 16),  # measured: the table above
    "cuda": DeviceCosts(0.003, 0.1, 32),  # reasoned: the ridge point of a GPU step
}


def device_costs(device_type: str) -> DeviceCosts:
    """The costs of ``device_type`` ("cpu", "cuda"); any other device is costed as a CPU."""
    return DEVICE_COSTS.get(device_type, DEVICE_COSTS["cpu"])


PRIOR_BETA = 0.6  # before any verification
PRIOR_WEIGHT = 2.0  # the prior counts as this many draft positions
DECAY = 0.8  # each verification's weight relative to the next one's
PROBE_EVERY = 16  # steps between probes (one draft) of a request at 0 drafts


@dataclass
class Acceptance:
    """One request's acceptance record: weighted accepted drafts over weighted trials (a draft
    accepted, or the rejection that ends a verification)."""

    accepted: float = PRIOR_BETA * PRIOR_WEIGHT
    trials: float = PRIOR_WEIGHT
    steps_off: int = 0  # steps at 0 drafts since the last probe

    @property
    def beta(self) -> float:
        return self.accepted / self.trials

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        rejected = 1 if num_accepted < num_drafts else 0
        self.accepted = self.accepted * DECAY + num_accepted
        self.trials = self.trials * DECAY + num_accepted + rejected


class DraftPolicy:
    """Draft lengths per request (``adaptive``) or always the maximum, and the step rule."""

    def __init__(
        self,
        max_drafts: int,
        disable_by_batch_size: int,
        adaptive: bool = True,
        costs: DeviceCosts = DEVICE_COSTS["cpu"],
    ):
        self.max_drafts = max_drafts
        self.disable_by_batch_size = disable_by_batch_size
        self.adaptive = adaptive
        self.costs = costs
        self._records: dict[str, Acceptance] = {}

    def step_speculates(self, num_decoding: int) -> bool:
        return num_decoding <= self.disable_by_batch_size

    def num_drafts(self, request_id: str, num_decoding: int = 1) -> int:
        """How many drafts to ask for (0: none this step), in a step of ``num_decoding``."""
        if not self.adaptive:
            return self.max_drafts
        record = self._records.get(request_id)
        if record is None:
            record = self._records[request_id] = Acceptance()
        cost = self.costs.row_cost(num_decoding)
        beta = record.beta
        k = 0
        while k < self.max_drafts and beta ** (k + 1) >= cost:
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
