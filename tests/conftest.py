"""Shared fixtures: tiny random-weight Hugging Face models saved as real model directories
(``tests/utils/models.py`` builds them)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.utils.models import make_tiny_model

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# A fixed thread count: the governor (tested alone on fake clocks) would change it under a
# loaded test run, and so the order of float sums between engines a test compares token for token.
os.environ.setdefault("LORAPLEX_THREAD_GOVERNOR", "0")
# dtype "auto" picks bf16 matrix products on CPUs with bf16 units; the suite's comparisons
# against Hugging Face and PEFT in fp32 ask for fp32, and the bf16 tests ask for bf16 by name
# (tests/engine/test_precision.py, tests/kernels/test_packed_gemm_bf16.py).
os.environ.setdefault("LORAPLEX_CPU_AUTO_DTYPE", "float32")


@pytest.fixture
def tiny_llama(tmp_path: Path) -> str:
    return make_tiny_model(tmp_path / "llama", "llama")
