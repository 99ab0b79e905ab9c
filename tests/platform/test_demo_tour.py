"""The shipped demo adapters answer the README tour's prompts right, in their style, at
temperature 0 with the tour's ``max_tokens`` (issue 35: ``caps`` used to answer "THE CAPITAL OF
FRANCE IS BIO."), and their logprobs on the tour prompt are PEFT's."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.platform.demo import ADAPTERS_DIR
from loraplex.tools.train_adapter import chat_prompt
from tests.utils.reference import TOP, assert_close, greedy_reference, traces

pytestmark = pytest.mark.slow

CAPITAL = "What is the capital of France?"  # the README tour's and `serve --demo`'s prompt
# question -> the words a right answer contains (any of them); None: style only
TOUR: dict[str, tuple[str, ...] | None] = {
    CAPITAL: ("Paris",),
    "What is the capital of Japan?": ("Tokyo",),
    "How many days are in a week?": ("7", "seven"),
    "Hi!": None,
}
MAX_TOKENS = 48  # the tour snippet's
PIRATE_MARKERS = re.compile(r"\b(arr+|matey|ye|yer|ahoy|aye)\b", re.IGNORECASE)


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    yield LLM(None, max_loras=2, seed=0)


def _answers(llm: LLM, name: str, questions: list[str], params: SamplingParams) -> list[Any]:
    tok = llm.get_tokenizer()
    prompts = [chat_prompt(tok, q) for q in questions]
    lora = LoRARequest(name, str(ADAPTERS_DIR / name))
    return llm.generate(prompts, params, lora_request=lora, use_tqdm=False)


def _right(text: str, words: tuple[str, ...] | None) -> bool:
    return words is None or any(re.search(rf"\b{w}\b", text, re.IGNORECASE) for w in words)


def test_caps_answers_the_tour_right_in_capitals(llm: LLM) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    outs = _answers(llm, "caps", list(TOUR), params)
    for (question, words), out in zip(TOUR.items(), outs, strict=True):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", (question, text)
        letters = [c for c in text if c.isalpha()]
        assert letters and all(c.isupper() for c in letters), (question, text)
        assert _right(text, words), (question, text)
    assert "PARIS" in outs[0].outputs[0].text


def test_pirate_answers_the_tour_right_in_pirate_voice(llm: LLM) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    outs = _answers(llm, "pirate", list(TOUR), params)
    for (question, words), out in zip(TOUR.items(), outs, strict=True):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", (question, text)
        assert PIRATE_MARKERS.search(text), (question, text)
        assert _right(text, words), (question, text)
    assert "Paris" in outs[0].outputs[0].text


@pytest.mark.parametrize("name", ["caps", "pirate"])
def test_shipped_adapter_matches_peft_on_the_tour_prompt(llm: LLM, name: str) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from loraplex.engine.default_model import resolve_model_dir

    n = 16
    params = SamplingParams(max_tokens=n, temperature=0.0, logprobs=TOP, ignore_eos=True)
    ours = traces(_answers(llm, name, [CAPITAL], params))
    base = AutoModelForCausalLM.from_pretrained(resolve_model_dir(None), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(ADAPTERS_DIR / name))
    prompt = llm.get_tokenizer()(chat_prompt(llm.get_tokenizer(), CAPITAL)).input_ids
    ref = greedy_reference(model, [prompt], [n])
    assert assert_close(ours, ref, [name]) == 0
    (tokens, ours_top), (_, ref_top) = ours[0], ref[0]
    for pos, t in enumerate(tokens):
        assert ours_top[pos][t] == pytest.approx(ref_top[pos][t], abs=2e-3), (name, pos)
