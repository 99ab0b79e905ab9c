"""A really trained adapter (loraplex.tools.train_adapter, short run) on the embedded SmolLM2: loraplex's
greedy text with it equals PEFT's ``generate(do_sample=False)`` text, and it differs from the base
model's. Where the texts differ, the float-noise rule of tests/utils/reference.py decides.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from loraplex import LoRARequest, SamplingParams
from loraplex.tools.train_adapter import (
    TrainConfig,
    TrainResult,
    chat_prompt,
    make_questions,
    train_adapter,
)
from tests.utils.reference import TOP, assert_close, greedy_reference, traces

MAX_TOKENS = 16
SEED = 0
NUM_QUESTIONS = 8  # the short run: a handful of questions, short answers, few steps


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread: on a shared, oversubscribed machine two OpenMP threads spin-wait for a
    core and run many times slower (see TrainConfig.threads); restored afterwards."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, TrainResult]:
    from loraplex.engine.default_model import resolve_model_dir

    out = tmp_path_factory.mktemp("trained") / "pirate"
    config = TrainConfig(
        output=str(out),
        behaviour="pirate",
        steps=12,
        seed=SEED,
        num_questions=NUM_QUESTIONS,
        max_answer_tokens=16,
        batch_size=4,
        lr=2e-3,
    )
    return resolve_model_dir(None), train_adapter(config, progress=False)


def _peft_model(model_dir: str, adapter_dir: str) -> Any:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()


@pytest.mark.slow
def test_trained_adapter_matches_peft_and_changes_output(trained: tuple[str, TrainResult]) -> None:
    from loraplex.llm import LLM

    model_dir, result = trained
    assert (Path(result.output) / "adapter_model.safetensors").is_file()
    assert result.final_loss < result.first_loss, result

    llm = LLM(model_dir, max_loras=2, max_cpu_loras=2, max_lora_rank=8)
    tok = llm.get_tokenizer()
    # two training questions and one the adapter never saw
    questions = [*make_questions(NUM_QUESTIONS, SEED)[:2], "What is your favourite colour?"]
    prompts = [chat_prompt(tok, q) for q in questions]
    lora = LoRARequest("pirate", result.output)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=TOP)
    base = llm.generate(prompts, params, use_tqdm=False)
    ours = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)

    model = _peft_model(model_dir, result.output)
    mismatched = []
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            ids = torch.tensor([tok(prompt).input_ids])  # [1, prompt_len]
            gen = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                pad_token_id=tok.eos_token_id,
            )
            ref_text = tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True)
            if ours[i].outputs[0].text != ref_text:
                mismatched.append(i)

    if mismatched:  # a near-tie in float noise: same length, ignore EOS, compare with top-5 rule
        sub = [tok(prompts[i]).input_ids for i in mismatched]
        fixed = SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.0, logprobs=TOP, ignore_eos=True
        )
        again = traces(llm.generate(sub, fixed, lora_request=lora, use_tqdm=False))
        ref = greedy_reference(model, sub, [MAX_TOKENS] * len(sub))
        assert_close(again, ref, [questions[i] for i in mismatched])
        assert len(mismatched) <= 1, f"{len(mismatched)} of {len(prompts)} texts diverged"

    for b, o, q in zip(base, ours, questions, strict=True):
        text = o.outputs[0].text
        assert text != b.outputs[0].text, q
        assert text.startswith("Arr"), (q, text)
    assert llm.engine_stats().kv_blocks_used == 0
