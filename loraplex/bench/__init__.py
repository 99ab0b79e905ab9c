"""``loraplex bench``: benchmarks that compare systems on one machine in one run.

Results are ratios (loraplex against Hugging Face ``generate()`` or, with ``--num-adapters``, against
PEFT; LoRA on against off; prefix caching on against off), written as JSON (plus a PNG plot when matplotlib is installed) to ``bench-results/``.
"""

from __future__ import annotations

from loraplex.bench.common import ThroughputOptions
from loraplex.bench.systems import EngineArgs
from loraplex.bench.throughput import run_throughput

__all__ = ["EngineArgs", "ThroughputOptions", "run_throughput"]
