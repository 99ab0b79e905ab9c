"""What ``python -m benchmarks.masks`` is asked to do (standard library only: the CLI's parser imports
this without the bench's HTTP client)."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from dataclasses import dataclass

HEAVY_REGEX = "((a{21}){21}){21}"  # the costliest nesting the precheck accepts (9,261 copies)


@dataclass(frozen=True)
class MaskOptions:
    policy: str = "fair"
    streams: int = 32
    a_max_tokens: int = 16
    b_interval_s: float = 1.0
    b_max_tokens: int = 8
    warmup_s: float = 5.0
    window_s: float = 30.0
    repeats: int = 2
    regex: str = HEAVY_REGEX
    seed: int = 0
    output_dir: str = "bench-results"

    def command_line(self) -> str:
        argv = ["python", "-m", "benchmarks.masks"]
        for f in dataclasses.fields(self):
            argv.append(f"--{f.name.replace('_', '-')}={getattr(self, f.name)}")
        return shlex.join(argv)


def add_mask_arguments(p: argparse.ArgumentParser) -> None:
    defaults = MaskOptions()
    for f in dataclasses.fields(MaskOptions):
        value = getattr(defaults, f.name)
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(value), default=value)


def options_from(args: argparse.Namespace) -> MaskOptions:
    return MaskOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(MaskOptions)})
