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


@pytest.fixture
def tiny_llama(tmp_path: Path) -> str:
    return make_tiny_model(tmp_path / "llama", "llama")
