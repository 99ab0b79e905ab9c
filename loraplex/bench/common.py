"""What the benchmarks share: their options (``ThroughputOptions``), loading the model's
tokenizer and config, and the JSON parts every report carries (options, workload, machine)."""

from __future__ import annotations

import platform
import shlex
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loraplex.bench.adapters import AdapterDist
from loraplex.bench.systems import EngineArgs
from loraplex.bench.workload import Workload
from loraplex.config import LoRAConfig

Log = Callable[[str], None]


@dataclass(frozen=True)
class ThroughputOptions:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    num_requests: int = 64
    min_output: int = 16
    max_output: int = 128
    min_prompt_words: int = 20
    max_prompt_words: int = 60
    chat: bool = False
    seed: int = 0
    repeats: int = 3
    hf_batch_size: int = 8
    hf_max_requests: int | None = None  # None: all requests
    skip_hf: bool = False
    engine: EngineArgs = field(default_factory=EngineArgs)
    profile: bool = False
    profile_requests: int = 16
    prefix_cache_test: bool = False
    prefix_len: int = 512
    prefix_repeats: int = 5
    num_adapters: int = 0  # 0: base model only, loraplex vs HF; N: N adapters, vs PEFT
    adapter_dist: AdapterDist = "uniform"
    powerlaw_alpha: float = 1.0
    adapter_rank: int = 8
    max_loras: int = 8  # the engine gets min(num_adapters, max_loras) device slots
    max_lora_rank: int = LoRAConfig.max_lora_rank
    peft_mixed_batch_size: int = 32
    output_dir: str = "bench-results"

    def __post_init__(self) -> None:
        checks = [
            (self.num_adapters >= 0, "--num-adapters must be 0 or more"),
            (
                self.adapter_dist in ("uniform", "powerlaw"),
                "--adapter-dist must be uniform or powerlaw",
            ),
            (self.powerlaw_alpha >= 0, "--powerlaw-alpha must be 0 or more"),
            (self.adapter_rank >= 1, "--adapter-rank must be at least 1"),
            (self.max_loras >= 1, "--max-loras must be at least 1"),
            (
                self.max_lora_rank >= self.adapter_rank,
                f"--max-lora-rank ({self.max_lora_rank}) must be at least --adapter-rank "
                f"({self.adapter_rank}): the engine rejects adapters above its maximum rank",
            ),
            (self.peft_mixed_batch_size >= 1, "--peft-mixed-batch-size must be at least 1"),
            (self.num_requests >= 1, "--num-requests must be at least 1"),
            (1 <= self.min_output <= self.max_output, "need 1 <= --min-output <= --max-output"),
            (
                1 <= self.min_prompt_words <= self.max_prompt_words,
                "need 1 <= --min-prompt-words <= --max-prompt-words",
            ),
            (self.repeats >= 1, "--repeats must be at least 1"),
            (self.hf_batch_size >= 1, "--hf-batch-size must be at least 1"),
            (
                self.hf_max_requests is None or self.hf_max_requests >= 1,
                "--hf-max-requests must be at least 1",
            ),
            (self.profile_requests >= 1, "--profile-requests must be at least 1"),
            (self.prefix_len >= 1, "--prefix-len must be at least 1"),
            (self.prefix_repeats >= 1, "--prefix-repeats must be at least 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def command_line(self) -> str:
        """The command that reproduces this run, every knob explicit."""
        knobs = self.engine.kwargs()
        argv = ["loraplex", "bench", "throughput"] + ([self.model] if self.model else [])
        argv += [
            f"--num-requests={self.num_requests}",
            f"--min-output={self.min_output}",
            f"--max-output={self.max_output}",
            f"--min-prompt-words={self.min_prompt_words}",
            f"--max-prompt-words={self.max_prompt_words}",
            f"--seed={self.seed}",
            f"--repeats={self.repeats}",
            f"--hf-batch-size={self.hf_batch_size}",
            f"--block-size={knobs['block_size']}",
            f"--max-num-seqs={knobs['max_num_seqs']}",
            f"--max-num-batched-tokens={knobs['max_num_batched_tokens']}",
            f"--dtype={knobs['dtype']}",
        ]
        argv += [f"--hf-max-requests={self.hf_max_requests}"] if self.hf_max_requests else []
        if self.num_adapters:
            argv += [
                f"--num-adapters={self.num_adapters}",
                f"--adapter-dist={self.adapter_dist}",
                f"--adapter-rank={self.adapter_rank}",
                f"--max-loras={self.max_loras}",
                f"--max-lora-rank={self.max_lora_rank}",
                f"--peft-mixed-batch-size={self.peft_mixed_batch_size}",
            ]
            argv += (
                [f"--powerlaw-alpha={self.powerlaw_alpha}"]
                if self.adapter_dist == "powerlaw"
                else []
            )
        argv += [f"--num-blocks={knobs['num_blocks']}"] if knobs["num_blocks"] else []
        argv += [] if knobs["enable_prefix_caching"] else ["--no-enable-prefix-caching"]
        argv += [f"--attention-backend={knobs['attention_backend']}"]
        argv += ["--enforce-eager"] if knobs["enforce_eager"] else []
        argv += ["--chat"] if self.chat else []
        argv += ["--skip-hf"] if self.skip_hf else []
        argv += ["--profile", f"--profile-requests={self.profile_requests}"] if self.profile else []
        if self.prefix_cache_test:
            argv += [
                "--prefix-cache-test",
                f"--prefix-len={self.prefix_len}",
                f"--prefix-repeats={self.prefix_repeats}",
            ]
        argv += [f"--output-dir={self.output_dir}"]
        return shlex.join(argv)


def load_tokenizer_and_config(model_dir: str) -> tuple[Any, dict[str, Any]]:
    import json

    from transformers import AutoTokenizer

    config = json.loads((Path(model_dir) / "config.json").read_text())
    return AutoTokenizer.from_pretrained(model_dir), config.get("text_config", config)


def reset_prefix_cache_for(llm: Any, opts: ThroughputOptions) -> bool:
    """True when ``llm`` holds no cached prefix of the timed prompts any more."""
    from loraplex.bench.systems import reset_prefix_cache

    return not opts.engine.enable_prefix_caching or reset_prefix_cache(llm)


def options_json(opts: ThroughputOptions) -> dict[str, Any]:
    data = asdict(opts)
    data["model"] = opts.model or "embedded:SmolLM2-135M-Instruct"
    return data


def workload_json(workload: Workload, prompts: list[list[int]]) -> dict[str, Any]:
    return {
        "num_requests": workload.num_requests,
        "seed": workload.seed,
        "prompt_tokens": [len(p) for p in prompts],
        "output_lens": workload.output_lens,
        "total_prompt_tokens": sum(map(len, prompts)),
        "total_output_tokens": sum(workload.output_lens),
    }


def machine() -> dict[str, Any]:
    import os

    import torch
    import transformers

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "cuda": torch.cuda.is_available(),
    }
