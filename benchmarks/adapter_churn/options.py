"""What ``python -m benchmarks.adapter_churn`` is asked to do: ``ChurnOptions``, issue 30's two
scenarios as presets, and the flags (the standard library and the config only, so the CLI builds
its parser cheaply).

Scenario ``a``: the default server; tenant A keeps 5 requests going over 5 rank-64 adapters,
B sends one request at a time. Scenario ``b``: a pool for 4 adapters (``--max-loras 4
--max-lora-rank 8 --max-cpu-loras 8 --max-num-seqs 16``); A keeps 16 requests going over 40
rank-8 adapters, B sends one request every 2 s. A flag given on the command line wins over
the scenario's value.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from dataclasses import dataclass
from typing import Any, get_args

from loraplex.config import SchedulingPolicy

SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SERVER_KNOBS = ("max_loras", "max_lora_rank", "max_cpu_loras", "max_num_seqs")
# field -> value; the server knobs absent from a scenario keep the server's defaults
SCENARIOS: dict[str, dict[str, Any]] = {
    "a": {"num_adapters": 5, "rank": 64, "concurrency": 5, "b_interval_s": 0.0},
    "b": {
        "num_adapters": 40,
        "rank": 8,
        "concurrency": 16,
        "b_interval_s": 2.0,
        "max_loras": 4,
        "max_lora_rank": 8,
        "max_cpu_loras": 8,
        "max_num_seqs": 16,
    },
}


@dataclass(frozen=True)
class ChurnOptions:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    scenario: str = "a"
    num_adapters: int = 5  # tenant A's adapters, used round robin in the churn phase
    rank: int = 64  # of every adapter (A's and B's)
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    concurrency: int = 5  # A's requests kept open (closed loop)
    a_max_tokens: int = 16
    b_interval_s: float = 0.0  # 0: one request at a time, back to back; else one every N s
    b_max_tokens: int = 16
    duration_s: float = 60.0  # B's window in the baseline and the churn phases
    alone_s: float = 20.0  # B's window with A idle
    warmup_s: float = 5.0  # A's load runs this long before B's window opens
    policy: str | None = None  # None: the server's default scheduling policy
    max_loras: int | None = None  # the server knobs; None: the server's default
    max_lora_rank: int | None = None
    max_cpu_loras: int | None = None
    max_num_seqs: int | None = None
    sample_s: float = 1.0  # /metrics is read this often (engine counters, restarts)
    seed: int = 0
    output_dir: str = "bench-results"
    extra_serve_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.scenario not in SCENARIOS:
            raise ValueError(f"--scenario must be one of {', '.join(SCENARIOS)}")
        if self.policy is not None and self.policy not in get_args(SchedulingPolicy):
            raise ValueError(f"--policy must be one of {', '.join(get_args(SchedulingPolicy))}")
        unknown = [t for t in self.target_modules if t not in SUPPORTED_TARGETS]
        if unknown or not self.target_modules:
            raise ValueError(
                f"--target-modules takes modules from {','.join(SUPPORTED_TARGETS)}; "
                f"got {','.join(self.target_modules) or 'none'}"
            )
        for name in ("num_adapters", "rank", "concurrency", "a_max_tokens", "b_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        for name in ("b_interval_s", "alone_s", "warmup_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be 0 or more")
        if self.duration_s <= 0 or self.sample_s <= 0:
            raise ValueError("--duration-s and --sample-s must be more than 0")
        for name in SERVER_KNOBS:
            if (value := getattr(self, name)) is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.max_lora_rank is not None and self.rank > self.max_lora_rank:
            raise ValueError(
                f"--rank {self.rank} is above --max-lora-rank {self.max_lora_rank}: the server "
                "would refuse the uploads; lower --rank or raise --max-lora-rank"
            )

    @classmethod
    def of_scenario(cls, scenario: str, **changes: Any) -> ChurnOptions:
        """Scenario ``scenario``'s values, then ``changes``."""
        if scenario not in SCENARIOS:
            raise ValueError(f"--scenario must be one of {', '.join(SCENARIOS)}")
        return cls(**(SCENARIOS[scenario] | {"scenario": scenario} | changes))

    def serve_args(self) -> list[str]:
        """``loraplex serve``'s arguments (its host, port and data directory aside)."""
        args = [self.model] if self.model else []
        if self.policy:
            args += ["--scheduling-policy", self.policy]
        for name in SERVER_KNOBS:
            if (value := getattr(self, name)) is not None:
                args += [f"--{name.replace('_', '-')}", str(value)]
        return [*args, "--log-level", "warning", *self.extra_serve_args]

    def command_line(self) -> str:
        argv = ["python", "-m", "benchmarks.adapter_churn"] + ([self.model] if self.model else [])
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("model", "extra_serve_args") or value is None:
                continue
            shown = ",".join(value) if isinstance(value, tuple) else value
            argv.append(f"--{f.name.replace('_', '-')}={shown}")
        return shlex.join(argv)


# ---- the command line ------------------------------------------------------------------------

_HELP = {
    "scenario": "issue 30's scenario: a (the default server, 5 rank-64 adapters) or b (a pool "
    "for 4 adapters, 40 rank-8 adapters); the flags below override its values",
    "num_adapters": "tenant A's adapters, round robin in the churn phase",
    "rank": "rank of every adapter (A's and B's)",
    "target_modules": "comma-separated modules every adapter targets",
    "concurrency": "tenant A's open requests (closed loop), in the baseline and churn phases",
    "a_max_tokens": "max_tokens of A's requests",
    "b_interval_s": "seconds between tenant B's streamed requests (0: one at a time)",
    "b_max_tokens": "max_tokens of B's requests",
    "duration_s": "B's measured window in the baseline (A on one adapter) and churn phases",
    "alone_s": "B's measured window with A idle",
    "warmup_s": "seconds of A's load before B's window opens",
    "policy": "the server's --scheduling-policy (fcfs, priority, fair; default: the server's)",
    "max_loras": "the server's --max-loras (device adapter slots)",
    "max_lora_rank": "the server's --max-lora-rank",
    "max_cpu_loras": "the server's --max-cpu-loras (host adapter cache)",
    "max_num_seqs": "the server's --max-num-seqs",
    "sample_s": "seconds between readings of /metrics (engine counters and restarts)",
    "seed": "prompt text and adapter weights seed",
    "output_dir": "where the JSON and PNG go",
}


def add_churn_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="local Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument("--scenario", choices=tuple(SCENARIOS), default="a", help=_HELP["scenario"])
    p.add_argument("--policy", choices=get_args(SchedulingPolicy), default=None,
                   help=_HELP["policy"])  # fmt: skip
    p.add_argument("--target-modules", type=_modules, default=None,
                   help=f"{_HELP['target_modules']} (default q_proj,v_proj)")  # fmt: skip
    defaults = ChurnOptions()
    for f in dataclasses.fields(ChurnOptions):
        if f.name in ("model", "scenario", "policy", "target_modules", "extra_serve_args"):
            continue
        value = getattr(defaults, f.name)
        if any(f.name in v for v in SCENARIOS.values()):
            shown = ", ".join(
                f"scenario {s}: {_shown(v.get(f.name, value))}" for s, v in SCENARIOS.items()
            )
        else:
            shown = f"default {value}"
        p.add_argument(
            f"--{f.name.replace('_', '-')}",
            type=float if f.name.endswith("_s") else (str if f.name == "output_dir" else int),
            default=None,
            help=f"{_HELP[f.name]} ({shown})",
        )


def _shown(value: object) -> str:
    return "the server's default" if value is None else str(value)


def _modules(text: str) -> tuple[str, ...]:
    return tuple(m.strip() for m in text.split(",") if m.strip())


def options_from(args: argparse.Namespace) -> ChurnOptions:
    """The scenario's values, then every flag given on the command line."""
    given = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(ChurnOptions)
        if f.name not in ("scenario", "extra_serve_args")
        and getattr(args, f.name, None) is not None
    }
    return ChurnOptions.of_scenario(args.scenario, **given)
