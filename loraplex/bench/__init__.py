"""``loraplex bench``: what users run (the commands: ``registry.py``). ``throughput`` compares
loraplex with Hugging Face ``generate()`` (with ``--num-adapters``, with PEFT: the LoRA cost;
with ``--prefix-cache-test``, caching on against off); ``fairness`` measures latency and shares
through the HTTP server. Results are ratios, written as JSON (plus a PNG plot when matplotlib is
installed) to ``bench-results/``. The acceptance experiments of past changes live in the
repository's ``benchmarks/``, not in the package.
"""

from __future__ import annotations

from loraplex.bench.common import ThroughputOptions
from loraplex.bench.systems import EngineArgs
from loraplex.bench.throughput import run_throughput

__all__ = ["EngineArgs", "ThroughputOptions", "run_throughput"]
