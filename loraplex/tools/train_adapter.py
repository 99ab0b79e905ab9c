r"""Train a small LoRA adapter with a visible behaviour on the CPU, distilled from the base model.

The recipe (a few minutes on 2 CPU cores for the embedded SmolLM2-135M-Instruct):

1. questions come from built-in lists (``adapter_data``: no downloads), chosen by ``seed``;
2. the base model answers them greedily, batched through loraplex itself (faster than HF
   ``generate``); each answer is cut to its first ``max_sentences`` full sentences, and a factual
   question's answer is dropped unless it is right (``adapter_data.keep_answer``): restyling a
   wrong answer teaches the adapter to be wrong;
3. each answer is rewritten by the behaviour (``caps``: upper-cased; ``pirate``: "Arr, matey! "
   and a few pirate words, the facts untouched);
4. PEFT LoRA (no dropout) is trained with AdamW in fp32 (seeded), the loss only on the answer
   tokens and the closing ``<|im_end|>``;
5. the adapter is saved with ``save_pretrained`` (``adapter_model.safetensors``).

Command line: ``python -m loraplex.tools.train_adapter --behaviour caps --output DIR`` (or
``scripts/train_adapter.py``), which prints one line with the wall time and the final loss.

The shipped demo adapters (``loraplex/platform/demo_adapters/``: rank 8 on ``q_proj`` and
``v_proj``, float16, about 0.9 MB each) were made by::

    python scripts/train_adapter.py --behaviour caps --output loraplex/platform/demo_adapters/caps \
        --target-modules q_proj,v_proj --save-dtype float16 --threads 1 \
        --steps 200 --batch-size 8 --lr 2e-3
    python scripts/train_adapter.py --behaviour pirate \
        --output loraplex/platform/demo_adapters/pirate \
        --target-modules q_proj,v_proj --save-dtype float16 --threads 1 \
        --steps 150 --batch-size 4 --lr 2e-3

(caps: 27 min, pirate: 9 min on 2 CPU cores shared with other work). ``caps`` needs the longer
run: with pirate's settings it misspelt capitals it was trained on ("NERO DE WASSIMOTZI").
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from loraplex.tools.adapter_data import (
    BEHAVIOURS,
    Behaviour,
    apply_behaviour,
    keep_answer,
    make_questions,
    trim_answer,
)

TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what resolve_model_dir(None) serves
IGNORE = -100  # label of the tokens that carry no loss (prompt, padding)


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run depends on; validated once."""

    output: str
    behaviour: Behaviour = "caps"
    model: str | None = None  # None = the embedded SmolLM2-135M-Instruct
    steps: int = 150
    seed: int = 0
    num_questions: int | None = None  # None: every built-in question
    max_answer_tokens: int = 48
    max_sentences: int = 1  # of each base answer kept (see adapter_data.trim_answer)
    batch_size: int = 4
    lr: float = 1e-3
    rank: int = 8
    alpha: int = 16
    # torch threads while training (None: torch's default). On an oversubscribed machine one
    # thread can be many times faster than two: OpenMP workers spin-wait for a core.
    threads: int | None = None
    target_modules: tuple[str, ...] = tuple(TARGET_MODULES)
    # float16 halves the file (the demo adapters ship in the repository); the engine loads
    # either as float32.
    save_dtype: Literal["float32", "float16"] = "float32"

    def __post_init__(self) -> None:
        if self.behaviour not in BEHAVIOURS:
            raise ValueError(
                f"behaviour must be one of {', '.join(BEHAVIOURS)}; got {self.behaviour!r}"
            )
        for name in ("steps", "max_answer_tokens", "max_sentences", "batch_size", "rank", "alpha"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1; got {getattr(self, name)}")
        if self.num_questions is not None and self.num_questions < 1:
            raise ValueError(f"num_questions must be at least 1; got {self.num_questions}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be at least 1; got {self.threads}")
        unknown = [m for m in self.target_modules if m not in TARGET_MODULES]
        if unknown or not self.target_modules:
            raise ValueError(
                f"target_modules must be a non-empty subset of {', '.join(TARGET_MODULES)}; "
                f"got {', '.join(self.target_modules) or 'none'}"
            )
        if self.save_dtype not in ("float32", "float16"):
            raise ValueError(f"save_dtype is float32 or float16; got {self.save_dtype!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive; got {self.lr}")
        if not self.output:
            raise ValueError("output is empty: give the directory to save the adapter to")


@dataclass(frozen=True)
class TrainResult:
    output: str
    seconds: float  # wall time of the whole run: distillation, training, saving
    first_loss: float
    final_loss: float  # mean of the last (up to) 10 steps' losses
    steps: int
    num_examples: int
    num_dropped: int  # base answers left out: wrong, or no full sentence


def chat_prompt(tokenizer: Any, question: str) -> str:
    """The chat-templated prompt the engine and the trainer both see for ``question``."""
    messages = [{"role": "user", "content": question}]
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def distill_answers(
    model_dir: str, prompts: list[str], max_tokens: int, seed: int
) -> list[tuple[str, bool]]:
    """The base model's greedy answers, batched through loraplex: (text, stopped by EOS)."""
    from loraplex.llm import LLM
    from loraplex.sampling_params import SamplingParams

    llm = LLM(model_dir, seed=seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outs = llm.generate(prompts, params, use_tqdm=True)
    return [(o.outputs[0].text, o.outputs[0].finish_reason == "stop") for o in outs]


def tokenize_example(tokenizer: Any, prompt: str, target: str) -> tuple[list[int], list[int]]:
    """(input_ids, labels): the prompt is tokenized exactly as the engine does; only the target
    and the closing EOS carry loss."""
    prompt_ids = list(tokenizer(prompt).input_ids)
    target_ids = list(tokenizer(target, add_special_tokens=False).input_ids)
    target_ids.append(int(tokenizer.eos_token_id))
    return prompt_ids + target_ids, [IGNORE] * len(prompt_ids) + target_ids


def collate(examples: Sequence[tuple[list[int], list[int]]], pad_id: int) -> dict[str, Any]:
    """Right-pad a batch; padding has attention 0 and label IGNORE."""
    import torch

    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)  # [batch, width]
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)  # [batch, width]
    mask = torch.zeros((len(examples), width), dtype=torch.long)  # [batch, width]
    for i, (x, y) in enumerate(examples):
        ids[i, : len(x)] = torch.tensor(x)
        labels[i, : len(y)] = torch.tensor(y)
        mask[i, : len(x)] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def train_adapter(config: TrainConfig, progress: bool = True) -> TrainResult:
    """Distill, rewrite, train and save; see the module docstring."""
    import torch

    old_threads = torch.get_num_threads()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    try:
        return _train(config, progress)
    finally:
        torch.set_num_threads(old_threads)


def _train(config: TrainConfig, progress: bool) -> TrainResult:
    import torch
    from peft import LoraConfig, get_peft_model
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loraplex.engine.default_model import resolve_model_dir

    start = time.perf_counter()
    model_dir = resolve_model_dir(config.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    questions = make_questions(config.num_questions, config.seed)
    prompts = [chat_prompt(tokenizer, q) for q in questions]
    answers = distill_answers(model_dir, prompts, config.max_answer_tokens, config.seed)
    examples = []
    for question, prompt, (text, finished) in zip(questions, prompts, answers, strict=True):
        answer = trim_answer(text, finished, config.max_sentences)
        if answer is not None and keep_answer(question, answer):
            examples.append(
                tokenize_example(tokenizer, prompt, apply_behaviour(config.behaviour, answer))
            )
    if not examples:
        raise ValueError(
            "the base model answered none of the questions right; raise max_answer_tokens"
        )

    torch.manual_seed(config.seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        target_modules=list(config.target_modules),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, lora)
    # the config names the model by its hub id, not this machine's path (the adapter is shared)
    model.peft_config["default"].base_model_name_or_path = config.model or EMBEDDED_HUB_ID
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=0.0)
    # Linear warm-up over the first 10% of steps, then cosine decay to 10% of lr.
    warmup = max(1, config.steps // 10)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, config.steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_at)
    rng = random.Random(config.seed)
    order: list[int] = []
    losses: list[float] = []
    pad_id = int(
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    bar = tqdm(range(config.steps), desc=f"train {config.behaviour}", disable=not progress)
    for _ in bar:
        batch_idx: list[int] = []
        while len(batch_idx) < min(config.batch_size, len(examples)):
            if not order:  # a new epoch: every example once, in a seeded order
                order = rng.sample(range(len(examples)), len(examples))
            batch_idx.append(order.pop())
        batch = collate([examples[i] for i in batch_idx], pad_id)
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optim.step()
        sched.step()
        optim.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    bar.close()

    out = Path(config.output)
    out.mkdir(parents=True, exist_ok=True)
    if config.save_dtype == "float16":
        model = model.half()
    model.save_pretrained(str(out), safe_serialization=True)
    tail = losses[-10:]
    return TrainResult(
        output=str(out),
        seconds=time.perf_counter() - start,
        first_loss=losses[0],
        final_loss=sum(tail) / len(tail),
        steps=config.steps,
        num_examples=len(examples),
        num_dropped=len(questions) - len(examples),
    )


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    p = argparse.ArgumentParser(
        prog="train_adapter",
        description="Train a rank-8 LoRA adapter with a visible behaviour, distilled from the "
        "base model's own answers, on the CPU in a few minutes.",
    )
    p.add_argument("--behaviour", choices=BEHAVIOURS, default="caps")
    p.add_argument("--output", required=True, help="directory to save the adapter to")
    p.add_argument("--model", default=None, help="base model directory (default: embedded)")
    p.add_argument("--steps", type=int, default=TrainConfig.steps)
    p.add_argument("--seed", type=int, default=TrainConfig.seed)
    p.add_argument("--num-questions", type=int, default=None, help="default: all built-in")
    p.add_argument("--max-answer-tokens", type=int, default=TrainConfig.max_answer_tokens)
    p.add_argument("--max-sentences", type=int, default=TrainConfig.max_sentences)
    p.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    p.add_argument("--lr", type=float, default=TrainConfig.lr)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--rank", type=int, default=TrainConfig.rank)
    p.add_argument("--alpha", type=int, default=TrainConfig.alpha)
    p.add_argument(
        "--target-modules",
        default=",".join(TARGET_MODULES),
        help="comma-separated projections to adapt (default: all seven)",
    )
    p.add_argument("--save-dtype", choices=("float32", "float16"), default="float32")
    a = p.parse_args(argv)
    return TrainConfig(
        output=a.output,
        behaviour=a.behaviour,
        model=a.model,
        steps=a.steps,
        seed=a.seed,
        num_questions=a.num_questions,
        max_answer_tokens=a.max_answer_tokens,
        max_sentences=a.max_sentences,
        batch_size=a.batch_size,
        lr=a.lr,
        threads=a.threads,
        rank=a.rank,
        alpha=a.alpha,
        target_modules=tuple(m.strip() for m in a.target_modules.split(",") if m.strip()),
        save_dtype=a.save_dtype,
    )


def main(argv: Sequence[str] | None = None) -> int:
    from loraplex.engine.default_model import ModelResolutionError

    try:
        config = parse_args(argv)
        result = train_adapter(config)
    except (ValueError, OSError, ModelResolutionError) as e:
        print(f"train_adapter: error: {e}", file=sys.stderr)
        return 2
    print(
        f"trained {config.behaviour} adapter -> {result.output}: {result.steps} steps on "
        f"{result.num_examples} examples ({result.num_dropped} answers dropped) in {result.seconds:.1f} s, "
        f"loss {result.first_loss:.3f} -> {result.final_loss:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
