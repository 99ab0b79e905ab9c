"""What the benchmarks share: their options (``ThroughputOptions``), loading the model's
tokenizer and config, and the JSON parts every report carries (options, workload, machine)."""

from __future__ import annotations

import platform
import shlex
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from loraplex.argtypes import positive_int
from loraplex.bench.adapters import ADAPTER_DISTS, AdapterDist
from loraplex.bench.systems import ADAPTER_SYSTEMS, PEFT_SYSTEMS, EngineArgs, System
from loraplex.bench.workload import Workload
from loraplex.config import MAX_LORAS, LoRAConfig

Log = Callable[[str], None]


class WorkloadShape(Protocol):
    """The throughput workload's size, as every benchmark that runs it carries it."""

    @property
    def num_requests(self) -> int: ...
    @property
    def min_output(self) -> int: ...
    @property
    def max_output(self) -> int: ...
    @property
    def min_prompt_words(self) -> int: ...
    @property
    def max_prompt_words(self) -> int: ...


def add_workload_arguments(group: Any) -> None:
    """``--num-requests``, ``--min-output``, ``--max-output``, ``--min-prompt-words`` and
    ``--max-prompt-words``, with the throughput workload's defaults (64 requests, outputs of
    16-128 tokens, prompts of 20-60 words). ``group``: a parser or an argument group."""
    group.add_argument("--num-requests", type=positive_int, default=64)
    group.add_argument(
        "--min-output", type=positive_int, default=16, help="shortest output (tokens)"
    )
    group.add_argument(
        "--max-output", type=positive_int, default=128, help="longest output (tokens)"
    )
    group.add_argument("--min-prompt-words", type=positive_int, default=20)
    group.add_argument("--max-prompt-words", type=positive_int, default=60)


def workload_argv(opts: WorkloadShape) -> list[str]:
    """The flags of ``add_workload_arguments`` that reproduce ``opts``'s workload."""
    return [
        f"--num-requests={opts.num_requests}",
        f"--min-output={opts.min_output}",
        f"--max-output={opts.max_output}",
        f"--min-prompt-words={opts.min_prompt_words}",
        f"--max-prompt-words={opts.max_prompt_words}",
    ]


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
    # Several N: a sweep (``lora_scale``), one engine per N, loraplex with and without adapters.
    adapter_counts: tuple[int, ...] = ()
    adapter_dist: AdapterDist | None = None  # None: roundrobin (i % N), uniform with PEFT
    powerlaw_alpha: float = 1.0
    adapter_rank: int = 8
    adapter_ranks: tuple[int, ...] = ()  # cycled over the adapters; empty: adapter_rank
    max_loras: int | None = None  # None: N (at most MAX_LORAS and what the pool holds)
    max_lora_rank: int = LoRAConfig.max_lora_rank
    max_cpu_loras: int | None = None  # None: every registered adapter fits the host cache
    num_registered: int | None = None  # adapters added to each engine; None: that N
    lora_memory: int | float | None = None  # the pool: bytes or a fraction of the KV cache
    pool_adapters: int | None = None  # or: the real size of adapters 0 .. K-1; None: all N
    systems: tuple[System, ...] = ()  # empty: all four for one N (loraplex only with skip_hf)
    peft_mixed_batch_size: int = 32
    output_dir: str = "bench-results"

    def __post_init__(self) -> None:
        self._check_adapter_options()
        checks = [
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

    def _check_adapter_options(self) -> None:
        counts = self.adapter_counts
        if self.num_adapters < 0:
            raise ValueError("--num-adapters must be 0 or more")
        if counts and self.num_adapters:
            raise ValueError("give num_adapters (one N) or adapter_counts (a sweep), not both")
        if any(n < 1 for n in counts) or len(set(counts)) != len(counts):
            raise ValueError(
                f"--num-adapters: a sweep needs distinct counts of 1 or more: {counts}"
            )
        scale = {
            "--adapter-ranks": bool(self.adapter_ranks),
            "--max-cpu-loras": self.max_cpu_loras is not None,
            "--num-registered": self.num_registered is not None,
            "--lora-memory": self.lora_memory is not None,
            "--pool-adapters": self.pool_adapters is not None,
            "--systems": bool(self.systems),
        }
        if not self.adapter_mode:
            given = [flag for flag, on in scale.items() if on]
            if given:
                raise ValueError(f"{', '.join(given)} need --num-adapters N (1 or more)")
            return
        ranks = self.ranks
        n_max = max(self.counts)
        unknown = [s for s in self.systems if s not in ADAPTER_SYSTEMS]
        peft = [s for s in self.run_systems if s in PEFT_SYSTEMS]
        checks = [
            (self.adapter_dist is None or self.adapter_dist in ADAPTER_DISTS,
             f"--adapter-dist must be one of {', '.join(ADAPTER_DISTS)}"),
            (self.powerlaw_alpha >= 0, "--powerlaw-alpha must be 0 or more"),
            (all(r >= 1 for r in ranks), "--adapter-rank and --adapter-ranks must be at least 1"),
            (self.max_lora_rank >= max(ranks),
             f"--max-lora-rank ({self.max_lora_rank}) must be at least "
             f"{'the largest of --adapter-ranks' if self.adapter_ranks else '--adapter-rank'} "
             f"({max(ranks)}): the engine rejects adapters above its maximum rank"),
            (self.max_loras is None or 1 <= self.max_loras <= MAX_LORAS,
             f"--max-loras must be in [1, {MAX_LORAS}]"),
            (self.max_cpu_loras is None or self.max_cpu_loras >= 1,
             "--max-cpu-loras must be at least 1"),
            (self.num_registered is None or self.num_registered >= n_max,
             f"--num-registered ({self.num_registered}) must be at least the largest "
             f"--num-adapters ({n_max}): requests only use registered adapters"),
            (self.lora_memory is None or self.pool_adapters is None,
             "give --lora-memory or --pool-adapters, not both"),
            (self.pool_adapters is None or 1 <= self.pool_adapters <= self.registered,
             f"--pool-adapters must be in [1, {self.registered}] (the registered adapters)"),
            (not unknown, f"--systems: unknown {', '.join(unknown)}; choose from "
             f"{', '.join(ADAPTER_SYSTEMS)}"),
            (not self.systems or "loraplex" in self.systems,
             "--systems must include loraplex (the system under test)"),
            (not (peft and len(self.counts) > 1),
             f"PEFT baselines ({', '.join(peft)}) run with one --num-adapters value; for a "
             "sweep use --systems loraplex,loraplex_base"),
            (not (peft and self.skip_hf), "--skip-hf drops the PEFT baselines named in --systems"),
            (not (peft and self.registered > n_max),
             "--num-registered above --num-adapters is for loraplex-only runs (no PEFT)"),
        ]  # fmt: skip
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    # ---- the adapter mode, resolved ----------------------------------------------------------

    @property
    def adapter_mode(self) -> bool:
        return self.num_adapters > 0 or bool(self.adapter_counts)

    @property
    def counts(self) -> tuple[int, ...]:
        """The adapter counts to run: the sweep, or the one N."""
        return self.adapter_counts or ((self.num_adapters,) if self.num_adapters else ())

    @property
    def run_systems(self) -> tuple[System, ...]:
        if self.systems:
            return tuple(s for s in ADAPTER_SYSTEMS if s in self.systems)
        if len(self.counts) > 1 or self.skip_hf:
            return ("loraplex", "loraplex_base")
        return ADAPTER_SYSTEMS

    @property
    def with_peft(self) -> bool:
        return any(s in PEFT_SYSTEMS for s in self.run_systems)

    @property
    def dist(self) -> AdapterDist:
        if self.adapter_dist is not None:
            return self.adapter_dist
        return "uniform" if self.with_peft else "roundrobin"

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.adapter_ranks or (self.adapter_rank,)

    @property
    def registered(self) -> int:
        """Adapters written for the whole run (each engine adds ``num_registered`` or its N)."""
        return self.num_registered or max(self.counts, default=0)

    def command_line(self) -> str:
        """The command that reproduces this run, every knob explicit."""
        knobs = self.engine.kwargs()
        argv = ["loraplex", "bench", "throughput"] + ([self.model] if self.model else [])
        argv += workload_argv(self)
        argv += [
            f"--seed={self.seed}",
            f"--repeats={self.repeats}",
            f"--hf-batch-size={self.hf_batch_size}",
            f"--block-size={knobs['block_size']}",
            f"--max-num-seqs={knobs['max_num_seqs']}",
            f"--max-num-batched-tokens={knobs['max_num_batched_tokens']}",
            f"--dtype={knobs['dtype']}",
        ]
        argv += [f"--hf-max-requests={self.hf_max_requests}"] if self.hf_max_requests else []
        if self.adapter_mode:
            argv += [
                f"--num-adapters={','.join(map(str, self.counts))}",
                f"--systems={','.join(self.run_systems)}",
                f"--adapter-dist={self.dist}",
                f"--adapter-rank={self.adapter_rank}",
                f"--max-lora-rank={self.max_lora_rank}",
            ]
            argv += [f"--powerlaw-alpha={self.powerlaw_alpha}"] if self.dist == "powerlaw" else []
            argv += [f"--adapter-ranks={','.join(map(str, self.adapter_ranks))}"] * bool(
                self.adapter_ranks
            )
            optional = {
                "--max-loras": self.max_loras,
                "--max-cpu-loras": self.max_cpu_loras,
                "--num-registered": self.num_registered,
                "--lora-memory": self.lora_memory,
                "--pool-adapters": self.pool_adapters,
            }
            argv += [f"{flag}={v}" for flag, v in optional.items() if v is not None]
            argv += [f"--peft-mixed-batch-size={self.peft_mixed_batch_size}"] * self.with_peft
        argv += [f"--num-blocks={knobs['num_blocks']}"] if knobs["num_blocks"] else []
        argv += [] if knobs["enable_prefix_caching"] else ["--no-enable-prefix-caching"]
        argv += [f"--attention-backend={knobs['attention_backend']}"]
        argv += [f"--lora-dtype={knobs['lora_dtype']}"] if knobs["lora_dtype"] != "auto" else []
        argv += ["--enforce-eager"] if knobs["enforce_eager"] else []
        tp = knobs["tensor_parallel_size"]
        argv += [f"--tensor-parallel-size={tp}"] if tp != 1 else []
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


@dataclass(frozen=True)
class LoadedWorkload:
    """The model and ``bench throughput``'s seeded workload, as token ids."""

    model_dir: str
    tokenizer: Any
    model_config: dict[str, Any]
    workload: Workload
    prompts: list[list[int]]  # token ids per request
    output_lens: list[int]


def load_throughput_workload(opts: ThroughputOptions) -> LoadedWorkload:
    """Resolve the model, load its tokenizer and config, and encode the options' workload."""
    from loraplex.bench.workload import encode, make_workload
    from loraplex.engine.default_model import resolve_model_dir

    model_dir = resolve_model_dir(opts.model)
    tokenizer, model_config = load_tokenizer_and_config(model_dir)
    workload = make_workload(
        opts.num_requests,
        opts.min_output,
        opts.max_output,
        min_words=opts.min_prompt_words,
        max_words=opts.max_prompt_words,
        seed=opts.seed,
    )
    prompts = [encode(tokenizer, p, chat=opts.chat) for p in workload.prompts]
    return LoadedWorkload(
        model_dir, tokenizer, model_config, workload, prompts, list(workload.output_lens)
    )


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
