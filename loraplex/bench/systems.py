"""The systems under test, each timed on the same token-id prompts.

* loraplex: the offline ``LLM`` API, one ``generate`` call for the whole workload (continuous
  batching decides the batches), with or without a LoRA adapter per request.
* Hugging Face: the "traditional path": ``AutoModelForCausalLM.generate`` over static batches with
  left padding, where every batch runs until its longest request is done. Only each request's own
  tokens count as output. (The PEFT baselines of the multi-adapter mode: ``peft_baselines``.)

Model loading and warm-up are never inside the timed region.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from loraplex.config import DType, EngineConfig
from loraplex.engine_args import engine_config, knobs_of

System = Literal["loraplex", "loraplex_base", "hf", "peft_static", "peft_mixed"]
# The multi-adapter mode's systems, in run order.
ADAPTER_SYSTEMS: tuple[System, ...] = ("loraplex", "loraplex_base", "peft_static", "peft_mixed")
PEFT_SYSTEMS: tuple[System, ...] = ("peft_static", "peft_mixed")
# Engine counters that only grow; a run reports how much each grew during it.
ENGINE_COUNTERS = (
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
    "num_steps",
    "num_prompt_tokens_computed",
    "num_generated_tokens",
    "lora_disk_loads",
    "lora_host_hits",
    "lora_host_evictions",
    "lora_slot_loads",
    "lora_slot_hits",
    "lora_slot_evictions",
    "lora_load_waits",
    "lora_loads_deferred",
    "lora_load_bytes",
)


@dataclass
class RunResult:
    system: System
    repeat: int
    seconds: float
    output_tokens: int
    num_requests: int
    outputs: list[list[int]] = field(repr=False)
    engine: dict[str, float] = field(default_factory=dict)  # counter deltas (loraplex only)
    # Workload index of each output (a baseline may run a subset that is not a prefix); empty:
    # outputs[i] is request i.
    indices: list[int] = field(default_factory=list, repr=False)
    failures: int = 0  # requests that ended in "abort" or "error" (loraplex only)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "repeat": self.repeat,
            "seconds": round(self.seconds, 4),
            "num_requests": self.num_requests,
            "output_tokens": self.output_tokens,
            "output_tokens_per_s": round(self.tokens_per_s, 3),
            "failures": self.failures,
            "engine": self.engine,
        }


# The engine knobs ``loraplex bench`` exposes (``loraplex.engine_args``; their defaults are
# ``EngineConfig``'s).
BENCH_KNOBS = (
    "block_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "num_blocks",
    "enable_prefix_caching",
    "dtype",
    "lora_dtype",
    "attention_backend",
    "enforce_eager",
    "tensor_parallel_size",
)


@dataclass(frozen=True)
class EngineArgs:
    """The engine knobs one benchmark run sets; every other keeps ``EngineConfig``'s default."""

    overrides: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.overrides) - set(BENCH_KNOBS))
        if unknown:
            raise ValueError(f"not benchmark engine knobs: {', '.join(unknown)}")
        engine_config(**self.overrides)  # validates

    @property
    def config(self) -> EngineConfig:
        return engine_config(**self.overrides)

    def kwargs(self, **overrides: Any) -> dict[str, Any]:
        """The exposed knobs' values for ``LLM(...)``, then ``overrides``."""
        knobs = knobs_of(self.config)
        return {k: knobs[k] for k in BENCH_KNOBS} | overrides

    @property
    def dtype(self) -> DType:
        return self.config.model.dtype

    @property
    def lora_dtype(self) -> DType:
        """The adapter pool's storage type (``auto``: the model's)."""
        lora = self.config.lora.lora_dtype
        return self.dtype if lora == "auto" else lora

    @property
    def enable_prefix_caching(self) -> bool:
        return self.config.cache.enable_prefix_caching


def build_llm(model_dir: str, args: EngineArgs, **overrides: Any) -> Any:
    from loraplex import LLM

    return LLM(model=model_dir, **args.kwargs(**overrides))


def greedy_params(output_lens: Sequence[int]) -> list[Any]:
    from loraplex import SamplingParams

    return [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in output_lens]


def counters(llm: Any) -> dict[str, float]:
    return {k: v for k, v in flat_stats(llm.engine_stats()).items() if k in ENGINE_COUNTERS}


def flat_stats(stats: Any) -> dict[str, float]:
    """An ``EngineStats`` as the report's flat numbers (``lora_<field>`` for its LoRA part)."""
    out = {
        f.name: float(getattr(stats, f.name))
        for f in dataclasses.fields(stats)
        if isinstance(getattr(stats, f.name), int | float)
    }
    if stats.lora is not None:
        for f in dataclasses.fields(stats.lora):
            value = getattr(stats.lora, f.name)
            if isinstance(value, int | float):
                out[f"lora_{f.name}"] = float(value)
    return out


def warm_up_loraplex(llm: Any, prompts: Sequence[list[int]]) -> None:
    """A few short requests (never the timed prompts: they would be cached) so that first-call
    allocations and lazy inits stay out of the timing."""
    sample = [list(p) for p in prompts[:4]]
    llm.generate(sample, greedy_params([4] * len(sample)), use_tqdm=False)


def reset_prefix_cache(llm: Any) -> bool:
    """Forget cached prefixes so a repeat cannot reuse the previous repeat's KV.

    Returns False when this ``LLM`` has no ``reset_prefix_cache()``; the caller then needs a fresh
    instance for the next repeat.
    """
    reset = getattr(llm, "reset_prefix_cache", None)
    if not callable(reset):
        return False
    reset()
    return True


def run_loraplex(
    llm: Any,
    prompts: Sequence[list[int]],
    output_lens: Sequence[int],
    repeat: int,
    *,
    lora_requests: Sequence[Any] | None = None,
    system: System = "loraplex",
) -> RunResult:
    """One timed ``generate`` over the workload; ``lora_requests``: one ``LoRARequest`` (or None)
    per prompt."""
    params = greedy_params(output_lens)
    extra = {} if lora_requests is None else {"lora_request": list(lora_requests)}
    before = counters(llm)
    start = time.perf_counter()
    outs = llm.generate([list(p) for p in prompts], params, use_tqdm=False, **extra)
    seconds = time.perf_counter() - start
    after = counters(llm)
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    ends = [getattr(o.outputs[0], "finish_reason", None) for o in outs]
    failed = sum(1 for end in ends if end in ("abort", "error"))
    return RunResult(
        system=system,
        repeat=repeat,
        seconds=seconds,
        output_tokens=sum(len(o) for o in outputs),
        num_requests=len(outputs),
        outputs=outputs,
        engine={k: after[k] - before.get(k, 0) for k in after},
        failures=failed,
    )


class HFBaseline:
    """``AutoModelForCausalLM`` + ``generate()`` over static, left-padded batches."""

    def __init__(self, model_dir: str, dtype: DType, batch_size: int) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype(dtype))
        self.model.eval()
        self.pad_id = pad_token_id(self.model)
        self.batch_size = batch_size

    def warm_up(self, prompts: Sequence[list[int]]) -> None:
        self._generate_batch([list(p) for p in prompts[:2]], 4)

    def run(
        self, prompts: Sequence[list[int]], output_lens: Sequence[int], repeat: int
    ) -> RunResult:
        outputs: list[list[int]] = []
        start = time.perf_counter()
        for i in range(0, len(prompts), self.batch_size):
            lens = list(output_lens[i : i + self.batch_size])
            rows = self._generate_batch(list(prompts[i : i + self.batch_size]), max(lens))
            outputs.extend(row[:n] for row, n in zip(rows, lens, strict=True))
        seconds = time.perf_counter() - start
        return RunResult(
            system="hf",
            repeat=repeat,
            seconds=seconds,
            output_tokens=sum(len(o) for o in outputs),
            num_requests=len(outputs),
            outputs=outputs,
        )

    def _generate_batch(self, prompts: list[list[int]], num_new: int) -> list[list[int]]:
        return generate_padded(self.model, self.pad_id, prompts, num_new)


def torch_dtype(dtype: DType) -> Any:
    """The baselines' weight dtype: ``auto`` is float32, as loraplex resolves it on CPU."""
    import torch

    return torch.float32 if dtype in ("auto", "float32") else getattr(torch, dtype)


def pad_token_id(model: Any) -> int:
    config = model.generation_config
    pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    return int(pad[0] if isinstance(pad, list) else (pad or 0))


def generate_padded(
    model: Any, pad_id: int, prompts: list[list[int]], num_new: int, **kwargs: Any
) -> list[list[int]]:
    """One static batch through ``model.generate``: left-padded, greedy, exactly ``num_new`` new
    tokens for every row (the batch runs to its longest request; EOS cannot stop it early)."""
    import torch

    width = max(len(p) for p in prompts)
    # Left padding: every row's last prompt token sits in the last column.
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # [B, width]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=num_new,
            min_new_tokens=num_new,
            do_sample=False,
            pad_token_id=pad_id,
            **kwargs,
        )  # [B, width + num_new]
    return [[int(t) for t in row] for row in out[:, width:]]


def check_lengths(run: RunResult, lens: Sequence[int]) -> str | None:
    idx = run.indices or range(run.num_requests)
    expected = sum(lens[i] for i in idx)
    if run.output_tokens == expected:
        return None
    return (
        f"{run.system} repeat {run.repeat + 1} produced {run.output_tokens} output tokens, "
        f"expected {expected} (fixed lengths, EOS ignored): the comparison is not like for like"
    )


def greedy_agreement(a: Sequence[list[int]], b: Sequence[list[int]]) -> dict[str, float]:
    """How alike two systems' greedy outputs are: identical requests and matching prefix share."""
    pairs = list(zip(a, b, strict=False))  # a subset run compares its prefix
    if not pairs:
        return {"requests_compared": 0, "identical_fraction": 0.0, "prefix_match_fraction": 0.0}
    identical = sum(1 for x, y in pairs if x == y)
    matched = total = 0
    for x, y in pairs:
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        matched += n
        total += max(len(x), len(y))
    return {
        "requests_compared": len(pairs),
        "identical_fraction": identical / len(pairs),
        "prefix_match_fraction": matched / total if total else 0.0,
    }
