"""What ``loraplex bench fairness`` is asked to do: ``FairnessOptions`` and its flags (no
imports beyond the standard library and the config, so the CLI builds its parser cheaply)."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_args

from loraplex.config import SchedulingPolicy


@dataclass(frozen=True)
class FairnessOptions:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    policies: tuple[str, ...] = ("fcfs", "fair")
    repeats: int = 2
    max_num_seqs: int = 16
    warmup_s: float = 10.0  # load runs this long before a window is measured
    flood_streams: int = 48
    flood_max_tokens: int = 48
    b_interval_s: float = 3.0
    b_max_tokens: int = 16
    flood_s: float = 60.0
    share_streams: int = 32
    share_max_tokens: int = 48
    share_s: float = 60.0
    share_weight: float = 3.0
    settle_s: float = 10.0  # after the weight change, before its window
    priority_requests: int = 5
    seed: int = 0
    output_dir: str = "bench-results"
    extra_serve_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.policies:
            raise ValueError("--policies needs at least one policy")
        for name, value in dataclasses.asdict(self).items():
            if isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
                raise ValueError(f"{name} must be 0 or more")
        if min(self.repeats, self.max_num_seqs, self.flood_streams, self.share_streams) < 1:
            raise ValueError("repeats, max-num-seqs and stream counts must be at least 1")

    def command_line(self) -> str:
        argv = ["loraplex", "bench", "fairness"] + ([self.model] if self.model else [])
        argv += [f"--policies={','.join(self.policies)}", f"--repeats={self.repeats}"]
        for f in dataclasses.fields(self):
            if f.name in ("model", "policies", "repeats", "extra_serve_args"):
                continue
            argv.append(f"--{f.name.replace('_', '-')}={getattr(self, f.name)}")
        return shlex.join(argv)


# ---- the command line ------------------------------------------------------------------------

_HELP = {
    "policies": "comma-separated scheduling policies to compare (each gets its own server)",
    "repeats": "runs per policy, alternating (the order flips every repeat)",
    "max_num_seqs": "the server's --max-num-seqs (running slots)",
    "warmup_s": "seconds of load before a window is measured",
    "flood_streams": "flood: tenant A's open streams (closed loop)",
    "flood_max_tokens": "flood: max_tokens of A's requests",
    "b_interval_s": "flood: seconds between tenant B's requests",
    "b_max_tokens": "flood: max_tokens of B's requests",
    "flood_s": "flood: the measured window, seconds",
    "share_streams": "shares: open streams per tenant",
    "share_max_tokens": "shares: mean max_tokens per request (each from half to 1.5 times it)",
    "share_s": "shares: each measured window (equal weights, then A's weight changed), seconds",
    "share_weight": "shares: A's weight in the second window",
    "settle_s": "shares: seconds after the weight change before its window",
    "priority_requests": "priority: priority -1 requests from tenant C",
    "seed": "prompt text seed",
    "output_dir": "where the JSON and PNG go",
}


def add_fairness_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="local Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)",
    )
    defaults = FairnessOptions()
    for f in dataclasses.fields(FairnessOptions):
        if f.name in ("model", "extra_serve_args"):
            continue
        value = getattr(defaults, f.name)
        kind: Callable[[str], Any] = _policies if f.name == "policies" else type(value)
        shown = ",".join(value) if f.name == "policies" else value
        p.add_argument(
            f"--{f.name.replace('_', '-')}",
            type=kind,
            default=value,
            help=f"{_HELP[f.name]} (default {shown})",
        )


def _policies(text: str) -> tuple[str, ...]:
    known = get_args(SchedulingPolicy)
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"expected policies from {', '.join(known)} separated by commas; got {text!r}"
        )
    return names


def options_from(args: argparse.Namespace) -> FairnessOptions:
    names = [f.name for f in dataclasses.fields(FairnessOptions) if f.name != "extra_serve_args"]
    return FairnessOptions(**{n: getattr(args, n) for n in names})
