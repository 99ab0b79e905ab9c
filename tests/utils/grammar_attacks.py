"""The constraints of issue 31 that cost a compile too much or fail late, and a child process that
compiles them under a memory limit and a timeout (``run_bounded``), so that a test of them cannot
take the test run's machine with it when the bounds regress.

Run as ``python -m tests.utils.grammar_attacks TOKENIZER_DIR NAME...``: compiles each named case
with ``LLGuidanceBackend`` and prints one JSON line per case: refused or not, the message, the
seconds and the process's RSS growth over the compile. ``python -m tests.utils.grammar_attacks
--engine MODEL_DIR``: sends ``heavy_regexes()`` through an offline engine (``engine_main``).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

from loraplex.sampling_params import StructuredOutputsParams as SO

# 40 patterns one string must match at once (about 600 characters as JSON)
ALLOF_40 = {
    "type": "string",
    "allOf": [{"pattern": f".*{chr(97 + i % 26)}{i // 26 or ''}.*"} for i in range(40)],
}

# The ten cases of issue 31 point 6 (with point 1's allOf and point 2's nested counts), and a
# word each refusal's message must hold: the construct, by its path, text or rule.
CASES: dict[str, tuple[SO, str]] = {
    "ref_cycle_direct": (
        SO(json={"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}),
        "#/$defs/a -> #/$defs/a",
    ),
    "ref_cycle_indirect": (
        SO(
            json={
                "$ref": "#/$defs/a",
                "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
            }
        ),
        "#/$defs/a -> #/$defs/b -> #/$defs/a",
    ),
    "empty_regex": (SO(regex=r"[^\s\S]"), r"[^\s\S]"),
    "empty_schema_pattern": (SO(json={"type": "string", "pattern": r"[^\s\S]"}), "/pattern"),
    "start_start": (SO(grammar="start: start"), "rule start"),
    "start_a_start": (SO(grammar='start: "a" start'), "rule start"),
    "counted_regex": (SO(regex="a{1000000}"), "a{1000000}"),
    "counted_schema_pattern": (SO(json={"type": "string", "pattern": "a{1000000}"}), "/pattern"),
    "nested_counts": (SO(regex="((a{100}){100}){100}"), "((a{100}){100}){100}"),
    "allof_40_patterns": (SO(json=ALLOF_40), "40 patterns"),
}

# What a message for a client must not hold: llguidance's parser state and internals.
INTERNALS = (
    "<state>",
    "non-verbose",
    "NoExtension",
    "SearchRegex",
    "(And ",
    "Parser:",
    "lexer_cost",
    "compute_time_us",
    "Tokens:",
    "limits.",
    "fuel",
)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main(tokenizer_dir: str, names: list[str]) -> None:
    from transformers import AutoTokenizer

    from loraplex.grammar import GrammarError, LLGuidanceBackend

    backend = LLGuidanceBackend(AutoTokenizer.from_pretrained(tokenizer_dir))
    for name in names:
        constraint = CASES[name][0]
        before = rss_mb()
        start = time.perf_counter()
        try:
            backend.compile(constraint)
            refused, message = False, ""
        except GrammarError as exc:
            refused, message = True, str(exc)
        seconds = time.perf_counter() - start
        growth = rss_mb() - before
        out = {"name": name, "refused": refused, "message": message, "seconds": seconds}
        print(json.dumps({**out, "rss_growth_mb": growth}), flush=True)


def heavy_regexes(n: int = 100) -> list[str]:
    """``n`` distinct costly regexes: issue 31's ``((a{100}){100}){101}``, ``...{102}`` (each
    built 155 MB of lexer state at its first mask, kept by the engine's cache), and counts just
    under the limit (``a{9001}``: about 4.5 MiB each, kept until the cache's byte bound)."""
    return [
        f"((a{{100}}){{100}}){{{100 + i}}}" if i % 2 == 0 else f"a{{{9000 + i}}}" for i in range(n)
    ]


def engine_main(model_dir: str) -> None:
    """One JSON line: the engine's RSS growth over ``heavy_regexes()`` (two tokens each), how
    many were refused, and what its grammar cache weighs after."""
    from loraplex import SamplingParams
    from loraplex.engine.llm_engine import LLMEngine
    from loraplex.engine_args import engine_config

    engine = LLMEngine(engine_config(model_dir, num_blocks=128, max_model_len=256))

    def run(batch: list[tuple[str, SO | None]]) -> dict[str, str | None]:
        for rid, constraint in batch:
            params = SamplingParams(max_tokens=2, structured_outputs=constraint)
            engine.add_request(rid, "x", params)
        errors: dict[str, str | None] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    errors[out.request_id] = out.outputs[0].error
        return errors

    run([("warm", SO(regex="[a-z]{3}")), ("plain", None)])
    before = rss_mb()
    refused = 0
    regexes = heavy_regexes()
    for start in range(0, len(regexes), 10):
        batch: list[tuple[str, SO | None]] = [
            (f"r{start + i}", SO(regex=r)) for i, r in enumerate(regexes[start : start + 10])
        ]
        refused += sum(e is not None for e in run(batch).values())
    out = {"rss_growth_mb": rss_mb() - before, "refused": refused}
    print(json.dumps({**out, "cache_bytes": engine.core.structured.cache_nbytes}), flush=True)


def run_bounded(
    module: str, args: list[str], memory_mb: int = 3072, timeout: float = 60.0
) -> tuple[int, list[dict[str, Any]], str]:
    """Run ``python -m module args`` with its address space limited to ``memory_mb`` and its
    time to ``timeout`` seconds; returns its exit status (-9: killed at the timeout), the JSON
    lines it printed, and its stderr's tail."""

    def limit() -> None:
        size = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (size, size))

    # few malloc arenas: each thread's arena reserves address space the limit would count
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=limit,
        env=env,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    lines = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    return proc.returncode, lines, err[-2000:]


if __name__ == "__main__":
    if sys.argv[1] == "--engine":
        engine_main(sys.argv[2])
    else:
        main(sys.argv[1], sys.argv[2:])
