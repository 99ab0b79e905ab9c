"""The embedded SmolLM2-135M-Instruct: loraplex's greedy text equals Hugging Face's, on chat
prompts through the model's own chat template (batched in loraplex, one by one in HF)."""

from __future__ import annotations

import pytest
import torch

from loraplex import SamplingParams
from loraplex.engine.default_model import resolve_model_dir
from loraplex.llm import LLM

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Write a haiku about autumn leaves.",
]
MAX_TOKENS = 32


@pytest.mark.slow
def test_embedded_model_matches_hf_text() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model_dir(None)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in QUESTIONS
    ]
    llm = LLM(None)
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False
    )

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.eval()
    for prompt, out in zip(prompts, outs, strict=True):
        ids = tok(prompt, return_tensors="pt")
        assert out.prompt_token_ids == ids.input_ids[0].tolist()
        with torch.inference_mode():
            gen = hf.generate(**ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        ref_ids = gen[0, ids.input_ids.shape[1] :].tolist()
        ref_text = tok.decode(ref_ids, skip_special_tokens=True)
        assert out.outputs[0].text == ref_text, (prompt, out.outputs[0].text, ref_text)
        assert out.outputs[0].text.strip(), "empty answer"
    assert "Paris" in outs[0].outputs[0].text
