"""Builds the speculative-decoding component from ``SpeculativeConfig``."""

from __future__ import annotations

from loraplex.config import EngineConfig, SpeculativeConfig
from loraplex.engine.spec.decoder import SpecDecoder
from loraplex.engine.spec.ngram import NgramProposer
from loraplex.engine.spec.policy import DraftPolicy, device_costs
from loraplex.engine.spec.proposer import Proposer


def build_proposer(config: EngineConfig, vocab_size: int, max_model_len: int) -> Proposer:
    """The configured proposer. A draft model is loaded (and its KV allocated) here: call this
    before the served model's KV cache is sized, which takes what memory is left.
    ``max_model_len``: the served model's longest sequence (at most)."""
    spec = config.speculative_config
    if spec is None:
        raise ValueError("speculative decoding is not configured (speculative_config is None)")
    if spec.method == "ngram":
        return NgramProposer(spec.lookup_min, spec.lookup_max)
    from loraplex.engine.default_model import resolve_model_dir
    from loraplex.engine.spec.draft_model import DraftModelProposer

    assert spec.model is not None  # validated by SpeculativeConfig
    return DraftModelProposer(
        resolve_model_dir(spec.model),
        config.model,
        config.cache.block_size,
        config.scheduler,
        spec.num_speculative_tokens,
        vocab_size,
        max_model_len,
    )


def build_spec_decoder(
    spec: SpeculativeConfig, proposer: Proposer, device_type: str, max_model_len: int
) -> SpecDecoder:
    costs = device_costs(device_type)
    threshold = spec.disable_by_batch_size
    if threshold is None:
        threshold = costs.disable_by_batch_size
    policy = DraftPolicy(spec.num_speculative_tokens, threshold, spec.adaptive, costs)
    return SpecDecoder(proposer, policy, max_model_len)
