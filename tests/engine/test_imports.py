"""What importing the engine's torch-free parts pulls in: the scheduler, the KV manager, adapter
residency and the scheduling policy (pure-Python cores), and the engine clients the platform
imports."""

from __future__ import annotations

import subprocess
import sys

import pytest

TORCH_FREE = [
    "loraplex.engine.scheduler",
    "loraplex.engine.adapter_residency",
    "loraplex.lora.plan",
    "loraplex.lora.pool",
    "loraplex.engine.kv_cache",
    "loraplex.engine.waiting_queue",
    "loraplex.engine.admission",
    "loraplex.engine.priority_queue",
    "loraplex.engine.fair_queue",
    "loraplex.engine.records",
    "loraplex.engine.request",
    "loraplex.engine.client",
    "loraplex.engine.inproc_client",
    "loraplex.engine.proc_client",
    "loraplex.engine.proc_main",
    "loraplex.engine.llm_engine",
]


@pytest.mark.parametrize("module", TORCH_FREE)
def test_imports_no_torch(module: str) -> None:
    code = (
        "import importlib, sys\n"
        f"importlib.import_module({module!r})\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "sys.exit(f'imports {bad[:3]}' if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
