"""Helpers for structured-output tests: a byte-level tokenizer a grammar can steer (the tiny
models' word-level ``t0 .. t511`` tokenizer has no ``{`` to write JSON with), and the checks
an output must pass for its constraint."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from loraplex.sampling_params import StructuredOutputsParams

# Multi-byte tokens, so grammars see tokens that span lexemes (`{"`, `":`, `",`) as real ones do.
MERGES = [
    ('"', ":"),
    ("{", '"'),
    ('"', ","),
    (",", '"'),
    ("t", "r"),
    ("tr", "u"),
    ("tru", "e"),
    ("n", "a"),
    ("na", "m"),
    ("nam", "e"),
    ("1", "2"),
    ("Ġ", '"'),
]
BOS, EOS, UNK = "<s>", "</s>", "<unk>"  # ids 0, 1, 2 (EOS = 1 is not the tiny config's 2)


def write_byte_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer: three special tokens, the 256 bytes, a few merges (well
    under the tiny models' 512-token vocabulary; ids past it are never generated)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {BOS: 0, EOS: 1, UNK: 2}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=MERGES, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, unk_token=UNK
    )
    fast.save_pretrained(path)


def byte_model(path: Path, seed: int = 0, **overrides: Any) -> str:
    """A tiny random llama with the byte-level tokenizer (EOS id 1 in config and tokenizer)."""
    from tests.utils.models import make_tiny_model

    model_dir = make_tiny_model(
        path, "llama", seed=seed, eos_token_id=1, bos_token_id=0, **overrides
    )
    write_byte_tokenizer(path)
    return model_dir


# Lark grammars the tests use -> a regex of the same language (to check outputs with ``re``)
GRAMMAR_REGEXES = {'start: "x=" num ";"\nnum: /[1-9][0-9]{0,3}/': r"x=[1-9][0-9]{0,3};"}


def satisfies(constraint: StructuredOutputsParams, text: str) -> bool:
    """Whether ``text`` is a complete output of ``constraint`` (json schemas validated with
    jsonschema; grammars through ``GRAMMAR_REGEXES``)."""
    kind = constraint.kind
    if kind in ("json", "json_object"):
        try:
            value = json.loads(text)
        except ValueError:
            return False
        if kind == "json_object":
            return isinstance(value, dict)
        import jsonschema

        try:
            jsonschema.validate(value, dict(constraint.json or {}))
        except jsonschema.ValidationError:
            return False
        return True
    if kind == "regex":
        assert constraint.regex is not None
        return re.fullmatch(constraint.regex, text) is not None
    if kind == "choice":
        return text in (constraint.choice or ())
    if kind == "grammar" and constraint.grammar in GRAMMAR_REGEXES:
        return re.fullmatch(GRAMMAR_REGEXES[constraint.grammar], text) is not None
    raise ValueError(f"no checker for {kind}")
