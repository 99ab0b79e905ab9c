"""Fixtures shared by the OpenAI API tests."""

from __future__ import annotations

from typing import Any

import pytest

from tests.utils.scripted import smollm2_dir


@pytest.fixture(scope="session")
def smollm2() -> Any:
    """The embedded SmolLM2's tokenizer (converted once, cached)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir())
