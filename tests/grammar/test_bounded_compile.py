"""Bounded compilation (issue 31 points 1, 2, 6): the constructs no llguidance limit bounds are
refused before compiling, by name; what llguidance reports is said without its internals;
honest constraints (the bench corpora, tool grammars, recursive schemas) still compile; caches
are bounded in bytes; compile threads are shared fairly between tenants.

The attacks themselves run in a child process with a memory limit and a timeout
(``tests.utils.grammar_attacks``): before the bounds, the 40-pattern allOf aborted that child at
its 3 GiB limit, and the other nine compiled without a refusal."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import CancelledError, Future
from pathlib import Path
from typing import Any

import pytest

from loraplex.grammar import (
    MAX_NESTED_RANGE,
    MAX_PATTERNS_AT_ONCE,
    MAX_REPEAT,
    FairExecutor,
    GrammarCache,
    GrammarError,
    LLGuidanceBackend,
    Verdicts,
)
from loraplex.grammar.lark_check import read_lark
from loraplex.grammar.llg import describe, grammar_text, parser_limits, plain
from loraplex.grammar.precheck import precheck
from loraplex.grammar.regex_cost import regex_cost
from loraplex.sampling_params import StructuredOutputsParams as SO
from tests.utils.grammar_attacks import CASES, INTERNALS, run_bounded
from tests.utils.structured import write_byte_tokenizer

VOCAB = 512
EOS = 1


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = tmp_path_factory.mktemp("bytetok")
    write_byte_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def backend(tokenizer_dir: Path) -> LLGuidanceBackend:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return LLGuidanceBackend(tok, vocab_size=VOCAB, eos_token_ids=[EOS])


def _refusal(constraint: SO) -> str:
    text = grammar_text(constraint) if constraint.kind == "grammar" else None
    with pytest.raises(GrammarError) as info:
        precheck(constraint, text)
    return str(info.value)


# ---- the attacks, in a bounded child ---------------------------------------------------------


@pytest.mark.timeout(120)
def test_the_ten_attacks_are_refused_by_name_fast_and_small(tokenizer_dir: Path) -> None:
    rc, lines, err = run_bounded(
        "tests.utils.grammar_attacks", [str(tokenizer_dir), *CASES], memory_mb=3072, timeout=60
    )
    assert rc == 0, f"the child died ({rc}) after {[ln['name'] for ln in lines]}: {err}"
    assert [ln["name"] for ln in lines] == list(CASES)
    for ln in lines:
        name, message = ln["name"], ln["message"]
        assert ln["refused"], f"{name} compiled"
        assert CASES[name][1] in message, (name, message)
        assert not [bad for bad in INTERNALS if bad in message], (name, message)
        assert ln["seconds"] < 2.0, (name, ln["seconds"])
        assert ln["rss_growth_mb"] < 200, (name, ln["rss_growth_mb"])


# ---- what the pre-check refuses and what it lets through ---------------------------------------


@pytest.mark.parametrize(
    ("pattern", "largest", "nested", "nested_ranged"),
    [
        ("a{1000000}", 1_000_000, 1, 1),
        ("((a{100}){100}){100}", 100, 1_000_000, 1),
        ("([a-z]{1,50}){1,50}", 50, 2_500, 2_500),
        (r"(?:[A-Za-z0-9+/]{4}){0,1000}", 1_000, 4_000, 1),  # base64: the inner count is fixed
        (r"\x{41}{3}[a-z{}]{2}(?i)(ab){3}", 3, 1, 1),  # braces of escapes and classes
        (r"[[a-z]&&[^b]]{10}[]]{4}", 10, 1, 1),  # nested classes, a literal ]
    ],
)
def test_regex_cost_reads_counts_and_their_nesting(
    pattern: str, largest: int, nested: int, nested_ranged: int
) -> None:
    cost = regex_cost(pattern)
    assert (cost.largest.product, cost.nested.product) == (largest, nested)
    assert cost.nested_ranged.product == nested_ranged


@pytest.mark.parametrize(
    ("constraint", "words"),
    [
        (SO(regex=f"[0-9]{{{MAX_REPEAT + 1}}}"), "[0-9]{10001}"),
        (SO(regex="([a-z]{1,50}){1,50}"), "with a range inside: `([a-z]{1,50}){1,50}` "),
        (SO(json={"patternProperties": {"^x{20000}$": {}}}), "patternProperties key"),
        (SO(grammar='start: A\nA: (("a"{100}){100}){100}'), "rule A repeats"),
        (SO(grammar="start: B\nB: /b{99999}/"), "/b{99999}/ in rule B"),
        (SO(grammar='root ::= "a" root'), "rule start never ends"),  # GBNF, read as Lark
        (SO(grammar='start: x\nx: "a" x'), "rules with no finite text: start, x"),
        (
            SO(json={"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]}),
            "# -> #/properties/n -> #",
        ),
        (
            SO(json={"properties": {"s": {"allOf": [{"pattern": "a"}] * 9}}}),
            "a string at /properties/s match 9 patterns at once",
        ),
        (SO(json={"type": "object", "x-guidance": {"lenient": True}}), "x-guidance at the root"),
        (
            SO(json={"properties": {"a": {"type": "string", "x-guidance": {}}}}),
            "x-guidance at /properties/a",
        ),
        (
            SO(grammar='start: x\nx: %json {"type": "object", "x-guidance": {"lenient": true}}'),
            "%json schema in rule x sets x-guidance.lenient",
        ),
    ],
)
def test_precheck_refuses_by_name(constraint: SO, words: str) -> None:
    message = _refusal(constraint)
    assert words in message, message


KIDS = {"type": "array", "items": {"$ref": "#/$defs/n"}}
TREE = {"type": "object", "properties": {"kids": KIDS}}
NEXT = {"anyOf": [{"$ref": "#"}, {"type": "null"}]}  # a required self-reference with a way out
HONEST = [
    SO(regex=r"(?:[A-Za-z0-9+/]{4}){0,1000}"),
    SO(regex=r"([a-z0-9]{1,63}\.){1,10}[a-z]{2,6}"),
    SO(regex=f"a{{{MAX_REPEAT}}}"),
    SO(regex=r"(\d{1,3}\.){3}\d{1,3}"),
    SO(grammar='start: "a" start | "b"'),
    SO(grammar='start: "(" start ")" | "x"'),
    SO(grammar='start: item+\nitem: "a"{2,5} | /[0-9]{1,4}/'),
    SO(grammar='start: "v=" obj\nobj: %json {"type": "integer", "x-guidance": {"lenient": false}}'),
    SO(json={"$defs": {"n": TREE}, "$ref": "#/$defs/n"}),  # recursion through an array
    SO(json={"type": "object", "properties": {"next": NEXT}, "required": ["next"]}),
    SO(json={"type": "string", "allOf": [{"pattern": "^[a-z]+$"}, {"maxLength": 5}]}),
    # one $ref target met three times counts once
    SO(json={"allOf": [{"$ref": "#/$defs/p"}] * 3, "$defs": {"p": {"pattern": "a"}}}),
]


@pytest.mark.parametrize("constraint", HONEST, ids=lambda c: c.key()[:40])
def test_honest_constraints_pass_the_precheck_and_compile(
    constraint: SO, backend: LLGuidanceBackend
) -> None:
    backend.compile(constraint)


def test_the_bench_corpora_and_tool_grammars_pass_the_precheck() -> None:
    from benchmarks.structured import big_schema
    from benchmarks.structured_suite.constraints import CONSTRAINT_CASES, TOOLS
    from benchmarks.structured_suite.schemas import SCHEMA_CASES
    from loraplex.platform.openai.tools.formats import FORMATS
    from loraplex.platform.openai.tools.grammar import calls_or_json, tool_grammar
    from loraplex.platform.openai.tools.request import Tool, ToolPlan

    constraints = [SO(json=c.schema) for c in SCHEMA_CASES] + [SO(json=big_schema(600))]
    for c in CONSTRAINT_CASES:
        value: Any = list(c.value) if isinstance(c.value, tuple) else c.value
        constraints.append(SO(**{c.kind: value}))
    tools = tuple(
        Tool(name, t["function"].get("description"), t["function"]["parameters"])
        for name, t in TOOLS.items()
    )
    for fmt in FORMATS.values():
        constraints.append(SO(grammar=tool_grammar(fmt, ToolPlan(tools, "required", True))))
        plan = ToolPlan(tools, "auto", True)
        constraints.append(SO(grammar=calls_or_json(fmt, plan, SCHEMA_CASES[0].schema)))
    for constraint in constraints:
        text = grammar_text(constraint) if constraint.kind == "grammar" else None
        precheck(constraint, text)
        if constraint.kind == "grammar":
            assert read_lark(text or "") is not None, text  # read, not skipped


# ---- llguidance's own reports, said plainly ----------------------------------------------------


def test_compiles_run_under_limits_that_hide_the_parser_state() -> None:
    limits = parser_limits()
    assert limits.verbose_errors is False
    assert limits.initial_lexer_fuel == 50_000 and limits.max_lexer_states == 20_000


@pytest.mark.parametrize(
    ("why", "words"),
    [
        ("lexer error: too many expressions constructed\n<state>\nTokens: ⟦aaaa⟧", "too complex"),
        ("NoExtensionBias\n<non-verbose/>", "matches no output"),
        ("parser error: Too many items (limit 50000; ff_tokens)", "too complex"),
        (
            "Unable to determine if regex is empty:  (And (SearchRegex /.*a.*/) (SearchRegex "
            "/.*b.*/))",
            "too complex to intersect",
        ),
        ('Unimplemented keys: ["not"]\n<state>\nParser: {...}', 'Unimplemented keys: ["not"]'),
    ],
)
def test_llguidance_messages_reach_clients_without_internals(why: str, words: str) -> None:
    message = describe(SO(json={"type": "string", "pattern": ".*a.*"}), why)
    assert words in message, message
    assert not [bad for bad in INTERNALS if bad in message], message
    assert "<state>" not in plain(why) and "SearchRegex" not in plain(why)


def test_a_matchers_mid_generation_error_is_plain(backend: LLGuidanceBackend) -> None:
    matcher = backend.compile(SO(regex="[a-z]{3}")).matcher()
    (digit,) = backend.tokenizer.tokenize_str("0")
    assert not matcher.accept_token(digit)
    assert matcher.error is not None
    assert "<state>" not in matcher.error and "non-verbose" not in matcher.error


# ---- caches bounded in bytes -------------------------------------------------------------------


def test_a_grammar_weighs_what_its_compile_allocated(backend: LLGuidanceBackend) -> None:
    small = backend.compile(SO(regex="[0-9]{3}"))
    large = backend.compile(SO(regex="a{9000}"))  # about 4.5 MiB of lexer on this tokenizer
    assert 16 * 1024 <= small.nbytes < 1 << 20
    assert large.nbytes > 2 << 20


def test_the_grammar_cache_is_bounded_in_bytes(backend: LLGuidanceBackend) -> None:
    cache = GrammarCache(backend, size=100, max_bytes=12 << 20)
    for i in range(8):  # 8 grammars of 4-5 MiB: at most 3 fit
        cache.get(SO(regex=f"a{{{9000 + i}}}"))
    assert cache.nbytes <= 12 << 20
    assert 1 <= len(cache._items) <= 3
    cache.get(SO(regex="a{9007}"))  # the newest stayed


def test_verdicts_keep_no_grammar(backend: LLGuidanceBackend) -> None:
    verdicts = Verdicts(backend)
    verdicts.check(SO(regex="a{9000}"))
    with pytest.raises(GrammarError, match="repeats"):
        verdicts.check(SO(regex="a{20000}"))
    assert verdicts.known(SO(regex="a{9000}")) == ""
    assert "repeats" in (verdicts.known(SO(regex="a{20000}")) or "")
    assert verdicts._items.nbytes < 1024  # keys and messages, no compiled grammar


# ---- fair compile threads ----------------------------------------------------------------------


def _held(gate: threading.Event, log: list[str], name: str) -> str:
    log.append(name)
    assert gate.wait(10)
    return name


def test_one_tenants_slow_jobs_leave_a_thread_to_the_others() -> None:
    pool = FairExecutor(2, "test")
    gate = threading.Event()
    log: list[str] = []
    a1 = pool.submit("a", _held, gate, log, "a1")
    a2 = pool.submit("a", _held, gate, log, "a2")
    b = pool.submit("b", lambda: "b")
    assert b.result(timeout=1) == "b"  # while a1 holds one thread and a2 waits behind a1
    time.sleep(0.05)
    assert log == ["a1"] and not a2.done()
    gate.set()
    assert (a1.result(5), a2.result(5)) == ("a1", "a2")
    pool.shutdown()


def test_tenants_take_turns_and_keep_their_own_order() -> None:
    pool = FairExecutor(1, "test", per_tenant=1)
    gate = threading.Event()
    log: list[str] = []
    first = pool.submit("a", _held, gate, log, "a0")
    deadline = time.monotonic() + 5
    while not log and time.monotonic() < deadline:  # a0 runs: the others queue behind it
        time.sleep(0.01)
    futures: list[Future[Any]] = [pool.submit("a", log.append, f"a{i}") for i in range(1, 4)]
    futures += [pool.submit("b", log.append, f"b{i}") for i in range(2)]
    futures += [pool.submit("c", log.append, "c0")]
    gate.set()
    for f in [first, *futures]:
        f.result(5)
    assert log == ["a0", "a1", "b0", "c0", "a2", "b1", "a3"]
    pool.shutdown()


def test_no_tenant_is_not_capped_and_waiting_jobs_can_be_cancelled() -> None:
    pool = FairExecutor(2, "test")
    gate = threading.Event()
    log: list[str] = []
    held = [pool.submit(None, _held, gate, log, f"n{i}") for i in range(2)]
    deadline = time.monotonic() + 5
    while len(log) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(log) == ["n0", "n1"]  # the tenant None may hold both threads
    waiting: Future[Any] = pool.submit("a", log.append, "never")
    assert waiting.cancel()
    gate.set()
    for f in held:
        f.result(5)
    with pytest.raises(CancelledError):
        waiting.result(1)
    assert "never" not in log
    pool.shutdown()


def test_limits_are_exported_for_messages() -> None:
    assert MAX_NESTED_RANGE < MAX_REPEAT
    assert json.dumps([MAX_REPEAT, MAX_NESTED_RANGE, MAX_PATTERNS_AT_ONCE])
