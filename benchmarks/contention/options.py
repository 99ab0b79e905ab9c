"""What ``python -m benchmarks.contention`` is asked to do: ``ContentionOptions`` and its flags (the
standard library and the config only, so the CLI builds its parser cheaply)."""

from __future__ import annotations

import argparse
import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from benchmarks.vllm_dtype import CHOICES
from loraplex.argtypes import non_negative_int, positive_int
from loraplex.bench.common import add_workload_arguments, workload_argv
from loraplex.config import MAX_LORAS

Scenario = Literal["workload", "batch1"]
SCENARIOS: tuple[Scenario, ...] = get_args(Scenario)
# A spin setting: "engine" (what loraplex sets by itself: cpu_threads.DEFAULT_SPINCOUNT),
# "default" (GNU OpenMP's own, 300,000), "passive" (OMP_WAIT_POLICY=passive) or a whole number
# of spins (LORAPLEX_OMP_SPINCOUNT=<n>).
SPIN_WORDS = ("engine", "default", "passive")


@dataclass(frozen=True)
class ContentionOptions:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    scenarios: tuple[Scenario, ...] = SCENARIOS
    busy: tuple[int, ...] = (0, 1)  # competing busy processes per run; 0 is the quiet run
    spincounts: tuple[str, ...] = ("default", "1000", "10000", "100000")
    repeats: int = 2
    # The workload of ``loraplex bench throughput``.
    num_requests: int = 64
    min_output: int = 16
    max_output: int = 128
    min_prompt_words: int = 20
    max_prompt_words: int = 60
    chat: bool = False
    seed: int = 0
    num_adapters: int = 0  # 0: base model; N: request i on adapter i % N (the workload only)
    adapter_rank: int = 8
    # The batch-1 decode: one request that copies a passage.
    batch1_tokens: int = 192
    batch1_words: int = 120
    threads: int | None = None  # torch threads in the loraplex child (None: torch's default)
    copy_mb: int = 256  # the bandwidth probe's tensor
    vllm_python: str | None = None  # a Python with vLLM installed; None: loraplex alone
    vllm_dtype: str = "auto"  # benchmarks.vllm_dtype: vLLM's fastest on this CPU
    timeout_s: float = 3600.0  # one child operation (load, warm-up or a timed run)
    output_dir: str = "bench-results"

    def __post_init__(self) -> None:
        spins = [s for s in self.spincounts if s not in SPIN_WORDS and not s.isdigit()]
        unknown = [s for s in self.scenarios if s not in SCENARIOS]
        checks = [
            (bool(self.scenarios) and not unknown,
             f"--scenarios: choose from {', '.join(SCENARIOS)}; got {_csv(unknown) or 'none'}"),
            (len(set(self.scenarios)) == len(self.scenarios),
             f"--scenarios: a scenario is repeated in {_csv(self.scenarios)}"),
            (bool(self.busy) and min(self.busy) >= 0 and len(set(self.busy)) == len(self.busy),
             f"--busy: distinct counts of 0 or more, e.g. 0,1; got {_csv(self.busy)}"),
            (0 in self.busy,
             f"--busy must include 0: each busy run is paired with a quiet one "
             f"(got {_csv(self.busy)})"),
            (bool(self.spincounts) and not spins,
             f"--spincounts: whole numbers, 'engine', 'default' or 'passive'; got "
             f"{_csv(spins) or 'none'}"),
            (len(set(self.spincounts)) == len(self.spincounts),
             f"--spincounts: a setting is repeated in {_csv(self.spincounts)}"),
            (self.repeats >= 1, "--repeats must be at least 1"),
            (self.num_requests >= 1, "--num-requests must be at least 1"),
            (1 <= self.min_output <= self.max_output, "need 1 <= --min-output <= --max-output"),
            (1 <= self.min_prompt_words <= self.max_prompt_words,
             "need 1 <= --min-prompt-words <= --max-prompt-words"),
            (0 <= self.num_adapters <= MAX_LORAS, f"--num-adapters must be in [0, {MAX_LORAS}]"),
            (self.adapter_rank >= 1, "--adapter-rank must be at least 1"),
            (self.batch1_tokens >= 2, "--batch1-tokens must be at least 2 (a prefill and a "
             "decode step)"),
            (self.batch1_words >= 1, "--batch1-words must be at least 1"),
            (self.threads is None or self.threads >= 1, "--threads must be at least 1"),
            (self.copy_mb >= 1, "--copy-mb must be at least 1"),
            (self.timeout_s > 0, "--timeout-s must be more than 0"),
            (self.vllm_python is None or os.access(self.vllm_python, os.X_OK),
             f"--vllm-python {self.vllm_python}: no executable there; give the python of the "
             "virtual environment vLLM is installed in (e.g. /work/venv-vllm/bin/python)"),
        ]  # fmt: skip
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def paired_busy(self) -> tuple[int, ...]:
        """The busy counts compared against the quiet run."""
        return tuple(b for b in self.busy if b > 0)

    def command_line(self) -> str:
        """The command that reproduces this run, every knob explicit."""
        argv = ["python", "-m", "benchmarks.contention"] + ([self.model] if self.model else [])
        argv += [
            f"--scenarios={','.join(self.scenarios)}",
            f"--busy={_csv(self.busy)}",
            f"--spincounts={','.join(self.spincounts)}",
            f"--repeats={self.repeats}",
            *workload_argv(self),
            f"--seed={self.seed}",
            f"--num-adapters={self.num_adapters}",
            f"--adapter-rank={self.adapter_rank}",
            f"--batch1-tokens={self.batch1_tokens}",
            f"--batch1-words={self.batch1_words}",
            f"--copy-mb={self.copy_mb}",
        ]
        argv += ["--chat"] if self.chat else []
        argv += [f"--threads={self.threads}"] if self.threads else []
        if self.vllm_python:
            argv += [f"--vllm-python={self.vllm_python}", f"--vllm-dtype={self.vllm_dtype}"]
        argv += [f"--timeout-s={self.timeout_s:g}", f"--output-dir={self.output_dir}"]
        return shlex.join(argv)


def _csv(values: Sequence[object]) -> str:
    return ",".join(map(str, values))


# ---- the command line ------------------------------------------------------------------------


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected whole numbers separated by commas, e.g. 0,1; got {text!r}"
        ) from None


def _words(text: str) -> tuple[str, ...]:
    return tuple(v.strip().lower() for v in text.split(",") if v.strip())


def add_contention_arguments(p: argparse.ArgumentParser) -> None:
    d = ContentionOptions()
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="local Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)",
    )
    r = p.add_argument_group("runs")
    r.add_argument(
        "--scenarios",
        type=_words,
        default=d.scenarios,
        help="workload (the 64-request mix of bench throughput) and/or batch1 (one request "
        "decoding --batch1-tokens); default workload,batch1",
    )
    r.add_argument(
        "--busy",
        type=_int_list,
        default=d.busy,
        help="competing busy processes (python spinning 'while True: pass') per run; each "
        "count above 0 is paired with the quiet run of the same repeat (default 0,1)",
    )
    r.add_argument(
        "--spincounts",
        type=_words,
        default=d.spincounts,
        help="OpenMP spin settings, one loraplex child process each: whole numbers "
        "(LORAPLEX_OMP_SPINCOUNT), 'engine' (loraplex's own choice, unset), 'default' (the "
        "runtime's 300,000) or 'passive' (OMP_WAIT_POLICY=passive); default "
        "default,1000,10000,100000",
    )
    r.add_argument(
        "--repeats", type=positive_int, default=d.repeats, help="alternating pairs per setting"
    )
    r.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch threads in the loraplex child (default: torch's)",
    )
    r.add_argument("--timeout-s", type=float, default=d.timeout_s, help=argparse.SUPPRESS)
    w = p.add_argument_group("workload (as bench throughput) and the batch-1 request")
    add_workload_arguments(w)
    w.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    w.add_argument("--seed", type=int, default=d.seed)
    w.add_argument(
        "--num-adapters",
        type=non_negative_int,
        default=0,
        help="spread the workload over N random adapters, request i on adapter i %% N "
        "(default 0: the base model)",
    )
    w.add_argument("--adapter-rank", type=positive_int, default=d.adapter_rank)
    w.add_argument("--batch1-tokens", type=positive_int, default=d.batch1_tokens)
    w.add_argument(
        "--batch1-words",
        type=positive_int,
        default=d.batch1_words,
        help="words of the passage the batch-1 request is asked to copy",
    )
    w.add_argument(
        "--copy-mb",
        type=positive_int,
        default=d.copy_mb,
        help="size of the copy that measures memory bandwidth (MB, default 256)",
    )
    v = p.add_argument_group("vLLM side by side")
    v.add_argument(
        "--vllm-python",
        default=None,
        metavar="PATH",
        help="python of a virtual environment with vLLM installed: run the same runs "
        "through vLLM's LLM, alternating with loraplex",
    )
    v.add_argument(
        "--vllm-dtype", choices=CHOICES, default=d.vllm_dtype,
        help="auto (default): bf16 where the CPU has AMX-BF16 or AVX512-BF16, else fp32",
    )  # fmt: skip
    p.add_argument("--output-dir", default=d.output_dir)


def options_from(args: argparse.Namespace) -> ContentionOptions:
    return ContentionOptions(
        model=args.model,
        scenarios=args.scenarios,
        busy=args.busy,
        spincounts=args.spincounts,
        repeats=args.repeats,
        num_requests=args.num_requests,
        min_output=args.min_output,
        max_output=args.max_output,
        min_prompt_words=args.min_prompt_words,
        max_prompt_words=args.max_prompt_words,
        chat=args.chat,
        seed=args.seed,
        num_adapters=args.num_adapters,
        adapter_rank=args.adapter_rank,
        batch1_tokens=args.batch1_tokens,
        batch1_words=args.batch1_words,
        threads=args.threads,
        copy_mb=args.copy_mb,
        vllm_python=args.vllm_python,
        vllm_dtype=args.vllm_dtype,
        timeout_s=args.timeout_s,
        output_dir=args.output_dir,
    )
