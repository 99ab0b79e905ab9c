"""Which structured-output backend loraplex uses: llguidance against xgrammar, measured here.

With the embedded model's tokenizer (SmolLM2-135M-Instruct, 49,152 tokens; or the model
directory given), for each library:

* **setup**: building its tokenizer index (once per engine);
* **compile**: five JSON schemas (small, nested, ``$ref``, enum, pattern) from nothing to the
  first token mask (llguidance builds lazily, so the first mask is part of its compile), with
  caches off, median of ``--repeats``;
* **mask**: time per generated token to fill the bitmask and accept the token, following a
  valid document of each schema, at batch 1 (one matcher) and batch 32 (32 matchers, each
  library's batched fill), median over the tokens, in microseconds per step and per row.

Prints one JSON object (``--output`` also writes it). Needs ``pip install xgrammar`` for the
comparison (without it only llguidance is measured).

    python -m benchmarks.structured_backends [MODEL_DIR] [--repeats 5] [--output FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "small": (
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
        },
        {"name": "Ada Lovelace", "age": 36},
    ),
    "nested": (
        {
            "type": "object",
            "properties": {
                "order": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer"},
                        "items": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {
                                    "sku": {"type": "string"},
                                    "qty": {"type": "integer", "minimum": 1},
                                    "price": {"type": "number"},
                                },
                                "required": ["sku", "qty", "price"],
                            },
                            "minItems": 1,
                            "maxItems": 5,
                        },
                        "shipping": {
                            "type": "object",
                            "properties": {
                                "city": {"type": "string"},
                                "express": {"type": "boolean"},
                            },
                            "required": ["city", "express"],
                        },
                    },
                    "required": ["id", "items", "shipping"],
                }
            },
            "required": ["order"],
        },
        {
            "order": {
                "id": 1042,
                "items": [
                    {"sku": "A-1", "qty": 2, "price": 9.5},
                    {"sku": "B-7", "qty": 1, "price": 120.0},
                ],
                "shipping": {"city": "Lyon", "express": False},
            }
        },
    ),
    "ref": (
        {
            "$defs": {
                "person": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "email": {"type": "string"},
                        "manager": {"anyOf": [{"$ref": "#/$defs/person"}, {"type": "null"}]},
                    },
                    "required": ["name", "email", "manager"],
                }
            },
            "type": "object",
            "properties": {"employee": {"$ref": "#/$defs/person"}},
            "required": ["employee"],
        },
        {
            "employee": {
                "name": "Bo",
                "email": "bo@example.com",
                "manager": {"name": "Al", "email": "al@example.com", "manager": None},
            }
        },
    ),
    "enum": (
        {
            "type": "object",
            "properties": {
                "sentiment": {"enum": ["positive", "negative", "neutral", "mixed"]},
                "topic": {"enum": ["billing", "shipping", "returns", "product", "other"]},
                "urgent": {"type": "boolean"},
            },
            "required": ["sentiment", "topic", "urgent"],
        },
        {"sentiment": "negative", "topic": "returns", "urgent": True},
    ),
    "pattern": (
        {
            "type": "object",
            "properties": {
                "phone": {"type": "string", "pattern": "^\\+?[0-9]{2,3}-[0-9]{3}-[0-9]{4}$"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "code": {"type": "string", "minLength": 3, "maxLength": 8},
            },
            "required": ["phone", "zip", "code"],
        },
        {"phone": "+33-612-3456", "zip": "69001", "code": "XK-42"},
    ),
}
BATCHES = (1, 32)


def median_us(values: list[float]) -> float:
    return round(statistics.median(values) * 1e6, 1)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


# ---- llguidance ------------------------------------------------------------------------------


def measure_llguidance(
    tokenizer: Any, vocab: int, eos: list[int], repeats: int, docs: dict[str, list[int]]
) -> dict[str, Any]:
    import llguidance as llg
    import llguidance.numpy as llnp

    from loraplex.grammar.llg import llg_tokenizer

    setup, lltok = timed(lambda: llg_tokenizer(tokenizer, vocab, eos))
    words = -(-vocab // 32)
    executor = llg.LLExecutor()
    out: dict[str, Any] = {
        "version": llg.__version__,
        "setup_s": round(setup, 3),
        "compile_ms": {},
        "mask_us": {},
    }

    def build(schema: dict[str, Any]) -> Any:
        grammar = llg.LLMatcher.grammar_from_json_schema(schema)
        m = llg.LLMatcher(lltok, grammar, log_level=0)
        first = np.zeros((1, words), dtype=np.int32)
        llnp.fill_next_token_bitmask(m, first, 0)
        assert not m.is_error(), m.get_error()
        return m

    for name, (schema, _) in SCHEMAS.items():
        times = [timed(lambda s=schema: build(s))[0] for _ in range(repeats)]
        out["compile_ms"][name] = {
            "first": round(times[0] * 1e3, 2),
            "median": round(statistics.median(times) * 1e3, 2),
        }
    for batch in BATCHES:
        per_step: list[float] = []
        for name, (schema, _) in SCHEMAS.items():
            template = build(schema)
            matchers = [template.deep_copy() for _ in range(batch)]
            mask = np.zeros((batch, words), dtype=np.int32)
            pairs = [(m, i) for i, m in enumerate(matchers)]
            for tok in docs[name]:
                start = time.perf_counter()
                if batch == 1:
                    llnp.fill_next_token_bitmask(matchers[0], mask, 0)
                    ok = [matchers[0].consume_token(tok)]
                else:
                    llnp.fill_next_token_bitmask_par(executor, pairs, mask)
                    ok = llnp.consume_token_par(executor, [(m, tok) for m in matchers])
                per_step.append(time.perf_counter() - start)
                assert all(ok) and (mask[0, tok // 32] >> (tok % 32)) & 1, (name, tok)
        out["mask_us"][f"batch{batch}"] = {
            "per_step": median_us(per_step),
            "per_row": round(median_us(per_step) / batch, 2),
            "p90_per_step": round(float(np.percentile(per_step, 90)) * 1e6, 1),
        }
    return out


# ---- xgrammar --------------------------------------------------------------------------------


def measure_xgrammar(
    tokenizer: Any, vocab: int, eos: list[int], repeats: int, docs: dict[str, list[int]]
) -> dict[str, Any]:
    import torch
    import xgrammar as xgr

    setup, info = timed(
        lambda: xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=eos)
    )
    out: dict[str, Any] = {
        "version": getattr(xgr, "__version__", None) or _dist_version("xgrammar"),
        "setup_s": round(setup, 3),
        "compile_ms": {},
        "mask_us": {},
    }

    def build(schema: dict[str, Any]) -> Any:
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=True)
        m = xgr.GrammarMatcher(compiled)
        first = xgr.allocate_token_bitmask(1, vocab)
        m.fill_next_token_bitmask(first, 0)
        return compiled

    for name, (schema, _) in SCHEMAS.items():
        times = [timed(lambda s=schema: build(s))[0] for _ in range(repeats)]
        out["compile_ms"][name] = {
            "first": round(times[0] * 1e3, 2),
            "median": round(statistics.median(times) * 1e3, 2),
        }
    batcher = xgr.BatchGrammarMatcher()
    for batch in BATCHES:
        per_step: list[float] = []
        for name, (schema, _) in SCHEMAS.items():
            compiled = build(schema)
            matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
            mask = xgr.allocate_token_bitmask(batch, vocab)
            for tok in docs[name]:
                start = time.perf_counter()
                if batch == 1:
                    matchers[0].fill_next_token_bitmask(mask, 0)
                    ok = [matchers[0].accept_token(tok)]
                else:
                    batcher.batch_fill_next_token_bitmask(matchers, mask)
                    ok = xgr.BatchGrammarMatcher.batch_accept_token(matchers, [tok] * batch)
                per_step.append(time.perf_counter() - start)
                row = mask[0].numpy() if isinstance(mask, torch.Tensor) else mask[0]
                assert all(ok) and (int(row[tok // 32]) >> (tok % 32)) & 1, (name, tok)
        out["mask_us"][f"batch{batch}"] = {
            "per_step": median_us(per_step),
            "per_row": round(median_us(per_step) / batch, 2),
            "p90_per_step": round(float(np.percentile(per_step, 90)) * 1e6, 1),
        }
    return out


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="model directory (default: the embedded one)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()

    from transformers import AutoConfig, AutoTokenizer

    from loraplex.engine.default_model import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab = int(AutoConfig.from_pretrained(model_dir).vocab_size)
    eos = [int(tokenizer.eos_token_id)]
    docs = {
        name: tokenizer(json.dumps(doc), add_special_tokens=False).input_ids
        for name, (_, doc) in SCHEMAS.items()
    }
    result: dict[str, Any] = {
        "model": Path(model_dir).name,
        "vocab_size": vocab,
        "doc_tokens": {name: len(ids) for name, ids in docs.items()},
        "llguidance": measure_llguidance(tokenizer, vocab, eos, args.repeats, docs),
    }
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        result["xgrammar"] = "not installed (pip install xgrammar)"
    else:
        result["xgrammar"] = measure_xgrammar(tokenizer, vocab, eos, args.repeats, docs)
    text = json.dumps(result, indent=2)
    print(text)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
