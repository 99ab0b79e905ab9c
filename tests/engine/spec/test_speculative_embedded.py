"""The embedded SmolLM2-135M-Instruct with ngram speculation: base and adapter requests (the demo
adapters) in one batch give the tokens they give without speculation, and copy-heavy prompts
accept most drafts."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from loraplex import LoRARequest, SamplingParams
from loraplex.bench.workload import random_text
from loraplex.llm import LLM

DEMO = Path(__file__).resolve().parents[3] / "loraplex" / "platform" / "demo_adapters"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}  # fmt: skip


@pytest.mark.slow
def test_base_and_adapter_requests_mixed_are_token_for_token() -> None:
    rng = random.Random(0)
    plain = LLM(None, max_model_len=1024)
    tok = plain.get_tokenizer()
    prompts = []
    for i in range(6):
        passage = random_text(rng, 50 + 10 * i)
        ask = f"Repeat the following passage exactly:\n\n{passage}"
        prompts.append(
            tok.apply_chat_template(
                [{"role": "user", "content": ask}], tokenize=False, add_generation_prompt=True
            )
        )
    loras = [
        None,
        LoRARequest("caps", str(DEMO / "caps")),
        LoRARequest("pirate", str(DEMO / "pirate")),
    ]
    per_prompt = [loras[i % 3] for i in range(len(prompts))]
    params = SamplingParams(max_tokens=48, temperature=0.0)
    want = plain.generate(prompts, params, lora_request=per_prompt, use_tqdm=False)
    spec = LLM(None, max_model_len=1024, speculative_config=NGRAM)
    got = spec.generate(prompts, params, lora_request=per_prompt, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stats = spec.engine_stats().speculative
    assert stats is not None and stats.num_draft_tokens > 0
    assert stats.acceptance_rate > 0.3, stats
