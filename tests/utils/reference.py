"""Reference generation with Hugging Face / PEFT, and the float-noise-tolerant comparison.

Comparison rule (as vLLM's ``check_logprobs_close``): walk both sequences; where the tokens
differ, the two candidates must be within float noise of each other, i.e. each side's token is
among the other side's top-5 logprobs, and the comparison stops there (the sequences diverge).
"""

from __future__ import annotations

from typing import Any

import torch

TOP = 5
Trace = tuple[list[int], list[dict[int, float]]]  # tokens, top-5 logprobs per position


def greedy_reference(model: Any, prompts: list[list[int]], max_tokens: list[int]) -> list[Trace]:
    """Each prompt alone through ``model`` with its KV cache, greedy, top-5 logprobs."""
    model.eval()
    results = []
    with torch.inference_mode():
        for prompt, n in zip(prompts, max_tokens, strict=True):
            ids, past = torch.tensor([prompt]), None
            tokens, tops = [], []
            for _ in range(n):
                out = model(input_ids=ids, past_key_values=past, use_cache=True)
                past = out.past_key_values
                lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
                v, i = lp.topk(TOP)
                tops.append(dict(zip(i.tolist(), v.tolist(), strict=True)))
                tokens.append(int(i[0]))
                ids = i[:1].view(1, 1)
            results.append((tokens, tops))
    return results


def hf_greedy(model_dir: str, prompts: list[list[int]], max_tokens: list[int]) -> list[Trace]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return greedy_reference(model, prompts, max_tokens)


def assert_close(ours: list[Trace], ref: list[Trace], labels: list[str] | None = None) -> int:
    """Returns how many sequences diverged within float noise; fails on a real mismatch."""
    diverged = 0
    for i, ((a_tok, a_top), (b_tok, b_top)) in enumerate(zip(ours, ref, strict=True)):
        label = labels[i] if labels else f"prompt {i}"
        assert len(a_tok) == len(b_tok), f"{label}: {len(a_tok)} vs {len(b_tok)} tokens"
        for pos, (a, b) in enumerate(zip(a_tok, b_tok, strict=True)):
            if a == b:
                continue
            assert a in b_top[pos] and b in a_top[pos], (
                f"{label} position {pos}: loraplex {a} vs reference {b} "
                f"(loraplex top-5 {a_top[pos]}, reference top-5 {b_top[pos]})"
            )
            diverged += 1
            break
    return diverged


def traces(outs: list[Any]) -> list[Trace]:
    """Tokens and top-5 logprobs of loraplex RequestOutputs (run with logprobs=TOP)."""
    result = []
    for o in outs:
        c = o.outputs[0]
        assert c.logprobs is not None
        result.append((c.token_ids, [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs]))
    return result
