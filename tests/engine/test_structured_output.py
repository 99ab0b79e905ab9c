"""Structured output in the engine, on a tiny random llama with a byte-level tokenizer (whose
unconstrained text is noise, so only the constraint makes it valid): outputs satisfy their
constraint for greedy and seeded sampling, n > 1, LoRA rows, preemption and rollback; each
step's masks are per row and right; compiles never hold up other requests' steps and an engine
with only compiles to wait for does not spin; a backend that fails ends only its requests."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex import StructuredOutputsParams as SO
from loraplex.engine.client import RequestDelta
from loraplex.engine.core import EngineCore
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.records import SchedulerOutput
from loraplex.engine.structured import IDLE_WAIT, MASK_TOKENS_PER_SECOND
from loraplex.engine_args import engine_config
from loraplex.grammar import GrammarError, LLGuidanceBackend
from loraplex.outputs import RequestOutput
from tests.utils.clients import collect, sample_tokens, start_client, stop_client
from tests.utils.clients import engine_config as client_config
from tests.utils.models import make_adapter
from tests.utils.structured import byte_model, satisfies

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 2},
        "score": {"anyOf": [{"type": "number", "minimum": 0, "maximum": 1}, {"type": "null"}]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
    "$defs": {"tag": {"type": "string", "pattern": "^[a-z]{1,4}$"}},
}
# Bounded constraints only: a random model given a loose one may run to max_tokens. Compact JSON
# where the test is not about whitespace: a random model loves it (16 characters per gap).
COMPACT = SO(json=PERSON, disable_any_whitespace=True)
CONSTRAINTS = [
    SO(json=PERSON),
    SO(json=PERSON, disable_any_whitespace=True),
    SO(regex=r"(ab|cd){1,3}-[0-9]{2,4}"),
    SO(choice=["red", "green", "blue"]),
    SO(grammar='start: "x=" num ";"\nnum: /[1-9][0-9]{0,3}/'),
]
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return byte_model(tmp_path_factory.mktemp("structured") / "m", seed=3)


@pytest.fixture(scope="module")
def llm(model_dir: str) -> LLM:
    return LLM(model_dir, num_blocks=256, max_num_seqs=16, max_model_len=256)


def params(constraint: SO | None, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=constraint, **kw)


def assert_valid(out: RequestOutput, constraint: SO) -> None:
    for sample in out.outputs:
        assert sample.finish_reason == "stop", (constraint.kind, sample.text, sample.error)
        assert satisfies(constraint, sample.text), (constraint.kind, sample.text)


@pytest.mark.parametrize(
    "decoding",
    [dict(temperature=0.0), dict(temperature=1.0, seed=7), dict(temperature=0.9, top_p=0.9)],
    ids=["greedy", "seeded", "top_p"],
)
def test_every_output_satisfies_its_constraint_in_a_mixed_batch(
    llm: LLM, decoding: dict[str, Any]
) -> None:
    prompts, ps, wanted = [], [], []
    for i, constraint in enumerate(CONSTRAINTS):
        prompts.append(f"hello {i}")
        ps.append(params(constraint, **decoding))
        wanted.append(constraint)
    prompts.append("an unconstrained neighbour")
    ps.append(SamplingParams(max_tokens=20, ignore_eos=True, **decoding))
    outs = llm.generate(prompts, ps, use_tqdm=False)
    for out, constraint in zip(outs[:-1], wanted, strict=True):
        assert_valid(out, constraint)
    assert len(outs[-1].outputs[0].token_ids) == 20  # unconstrained rows are not masked


def test_n_samples_each_follow_their_own_matcher(llm: LLM) -> None:
    constraint = COMPACT
    (out,) = llm.generate(
        ["samples"], params(constraint, n=4, temperature=1.0, seed=11), use_tqdm=False
    )
    assert len(out.outputs) == 4
    assert_valid(out, constraint)
    assert len({s.text for s in out.outputs}) > 1  # sampled apart, each valid


def test_greedy_constrained_output_is_deterministic_and_ends_without_eos(llm: LLM) -> None:
    constraint = SO(regex=r"[a-z]{3}")
    a, b = (
        llm.generate(["same"], params(constraint, temperature=0.0), use_tqdm=False)[0]
        for _ in range(2)
    )
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    # The grammar ended it: its last token completes the match, no EOS is sampled after it.
    assert llm.get_tokenizer().eos_token_id not in a.outputs[0].token_ids
    assert len(a.outputs[0].text) == 3


def test_ignore_eos_and_a_stop_string_with_a_constraint(llm: LLM) -> None:
    choice = SO(choice=["yes", "no"])
    (out,) = llm.generate(["q"], params(choice, ignore_eos=True, temperature=0.0), use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text in ("yes", "no")
    regex = SO(regex=r"ab;cd;ef")
    (cut,) = llm.generate(["q"], params(regex, stop=[";"], temperature=0.0), use_tqdm=False)
    assert cut.outputs[0].text == "ab" and cut.outputs[0].finish_reason == "stop"
    assert not llm.llm_engine.core.structured._matchers  # the aborted request let go


def test_max_tokens_reached_on_the_completing_token_is_a_stop(llm: LLM) -> None:
    constraint = SO(regex=r"abcd")
    (out,) = llm.generate(["q"], params(constraint, temperature=0.0), use_tqdm=False)
    n = len(out.outputs[0].token_ids)
    (exact,) = llm.generate(
        ["q"],
        SamplingParams(max_tokens=n, temperature=0.0, structured_outputs=constraint),
        use_tqdm=False,
    )
    assert exact.outputs[0].finish_reason == "stop" and exact.outputs[0].text == "abcd"


def test_lora_rows_mixed_in_are_constrained_too(model_dir: str, tmp_path: Path) -> None:
    adapter = make_adapter(model_dir, tmp_path / "a", 4, 8, ["q_proj", "v_proj"], seed=2)
    llm = LLM(model_dir, num_blocks=256, max_num_seqs=16, max_model_len=256, max_loras=2)
    lora = LoRARequest("a", adapter)
    constraint = COMPACT
    n = 6
    outs = llm.generate(
        [f"row {i // 2}" for i in range(n)],  # each prompt once on the base, once on the adapter
        params(constraint, temperature=0.0),
        lora_request=[lora if i % 2 else None for i in range(n)],
        use_tqdm=False,
    )
    for out in outs:
        assert_valid(out, constraint)
    texts = [o.outputs[0].text for o in outs]
    assert any(texts[i] != texts[i + 1] for i in range(0, n, 2))  # the adapter really ran


def test_preemption_keeps_every_matcher_right(model_dir: str, llm: LLM) -> None:
    """A KV cache of 10 blocks of 16 tokens for 4 requests of about 100 tokens: requests are
    preempted and recomputed, and their matchers still match their (kept) output tokens."""
    constraint = COMPACT
    prompts = [f"preempt {i} " + "x " * 8 for i in range(4)]
    ps = params(constraint, temperature=0.0)
    tight = LLM(model_dir, num_blocks=11, max_num_seqs=4, max_model_len=160)
    outs = tight.generate(prompts, ps, use_tqdm=False)
    assert tight.engine_stats().num_preemptions > 0
    roomy = llm.generate(prompts, ps, use_tqdm=False)
    for out, ref in zip(outs, roomy, strict=True):
        assert_valid(out, constraint)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids  # greedy: same either way


# ---- one step at a time ----------------------------------------------------------------------


def engine_for(model_dir: str, **knobs: Any) -> LLMEngine:
    knobs = {"num_blocks": 128, "max_model_len": 256, **knobs}
    return LLMEngine(engine_config(model_dir, **knobs))


def run(engine: LLMEngine, limit: int = 400) -> dict[str, RequestOutput]:
    done: dict[str, RequestOutput] = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    raise AssertionError("the engine did not finish its requests")


def allowed_after(backend: LLGuidanceBackend, constraint: SO, tokens: list[int]) -> np.ndarray:
    """The mask a fresh matcher gives after ``tokens``."""
    m = backend.compile(constraint).matcher()
    for t in tokens:
        assert m.accept_token(t)
    mask = np.zeros((1, -(-backend.vocab_size // 32)), dtype=np.int32)
    m.fill_bitmask(mask, 0)
    return mask[0]


def test_each_step_masks_exactly_the_constrained_rows(model_dir: str) -> None:
    engine = engine_for(model_dir)
    core = engine.core
    json_c, regex_c = COMPACT, SO(regex=r"[0-9]{2,6}")
    engine.add_request("plain", "free text", SamplingParams(max_tokens=12, ignore_eos=True))
    engine.add_request("json", "a json", params(json_c, temperature=1.0, seed=1, n=3))
    engine.add_request("num", "a number", params(regex_c, temperature=0.0))
    constraint_of = {"json": json_c, "json#1": json_c, "json#2": json_c, "num": regex_c}
    backend = LLGuidanceBackend(engine.tokenizer, core.vocab_size, core.eos_token_ids)
    seen: dict[str, int] = {}
    forks_masked: list[str] = []
    execute = core.runner.execute

    def checking(out: SchedulerOutput) -> Any:
        sampling = {s.request_id for s in out.requests if s.sample} | {
            f.request_id for f in out.forks
        }
        forks_masked.extend(f.request_id for f in out.forks if f.request_id in out.token_masks)
        assert set(out.token_masks) == {r for r in sampling if r in constraint_of}
        for rid, mask in out.token_masks.items():
            req = core.scheduler.requests[rid]
            want = allowed_after(backend, constraint_of[rid], req.output_token_ids)
            assert np.array_equal(mask, want), rid
            seen[rid] = seen.get(rid, 0) + 1
        return execute(out)

    core.runner.execute = checking  # type: ignore[method-assign]
    done = run(engine)
    assert sorted(forks_masked) == ["json#1", "json#2"]  # forks get their own rows' masks
    assert seen.keys() == constraint_of.keys()
    assert_valid(done["json"], json_c)
    assert_valid(done["num"], regex_c)
    assert len(done["plain"].outputs[0].token_ids) == 12


def test_rollback_rolls_the_matcher_back(model_dir: str) -> None:
    engine = engine_for(model_dir)
    core = engine.core
    constraint = COMPACT
    engine.add_request("r", "roll back", params(constraint, temperature=1.0, seed=3))
    for _ in range(12):
        engine.step()
    req = core.scheduler.requests["r"]
    emitted = req.num_output_tokens  # all of them reached the client already
    assert emitted >= 8
    keep = req.num_prompt_tokens + 4
    core.scheduler.rollback("r", keep)
    assert req.num_output_tokens == 4
    backend = LLGuidanceBackend(engine.tokenizer, core.vocab_size, core.eos_token_ids)
    mask = np.zeros((1, -(-backend.vocab_size // 32)), dtype=np.int32)
    core.structured._matchers["r"].fill_bitmask(mask, 0)
    assert np.array_equal(mask[0], allowed_after(backend, constraint, req.output_token_ids))
    (sample,) = run(engine)["r"].outputs
    assert sample.finish_reason == "stop"
    # The client saw the dropped tokens too (a rollback is the engine's business: speculative
    # decoding rolls back before it emits); the request's own tokens are the kept 4 and the rest.
    tokens = sample.token_ids[:4] + sample.token_ids[emitted:]
    assert satisfies(constraint, engine.tokenizer.decode(tokens, skip_special_tokens=True))


class GatedBackend:
    """llguidance, but compiling a constraint whose key contains ``slow_word`` waits for
    ``gate``; and faults on demand: at compile, in a mask fill, at a token's accept."""

    name = "gated"

    def __init__(self, inner: LLGuidanceBackend, slow_word: str = "SLOW") -> None:
        self.inner = inner
        self.vocab_size = inner.vocab_size
        self.slow_word = slow_word
        self.gate = threading.Event()
        self.compile_started = threading.Event()

    def compile(self, constraint: SO) -> Any:
        key = constraint.key()
        if self.slow_word in key:
            self.compile_started.set()
            assert self.gate.wait(30)
        if "BOOM" in key:
            raise RuntimeError("compiler exploded")
        compiled = self.inner.compile(constraint)
        if "ACCEPT" in key:
            return FaultyGrammar(compiled, fail_accept_after=3)
        if "FILL" in key:
            return FaultyGrammar(compiled, fail_fill_after=2)
        return compiled

    def fill_bitmasks(self, matchers: Any, bitmask: np.ndarray) -> None:
        for m, row in matchers:
            m.fill_bitmask(bitmask, row)


class FaultyGrammar:
    def __init__(
        self, inner: Any, fail_accept_after: int | None = None, fail_fill_after: int | None = None
    ) -> None:
        self.inner = inner
        self.fail_accept_after = fail_accept_after
        self.fail_fill_after = fail_fill_after

    def matcher(self) -> Any:
        return FaultyMatcher(self.inner.matcher(), self.fail_accept_after, self.fail_fill_after)


class FaultyMatcher:
    def __init__(self, inner: Any, accept_after: int | None, fill_after: int | None) -> None:
        self.inner, self.accept_after, self.fill_after = inner, accept_after, fill_after
        self.accepted = self.filled = 0

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        self.filled += 1
        if self.fill_after is not None and self.filled > self.fill_after:
            raise RuntimeError("mask fill exploded")
        self.inner.fill_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        self.accepted += 1
        if self.accept_after is not None and self.accepted > self.accept_after:
            raise RuntimeError("accept exploded")
        return bool(self.inner.accept_token(token_id))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def gated_engine(model_dir: str, **knobs: Any) -> tuple[LLMEngine, GatedBackend]:
    engine = engine_for(model_dir, **knobs)
    core = engine.core
    gated = GatedBackend(LLGuidanceBackend(engine.tokenizer, core.vocab_size, core.eos_token_ids))
    core.structured.wrap_backend(lambda inner: gated)
    return engine, gated


def test_a_slow_compile_holds_up_no_step_and_an_idle_wait_does_not_spin(model_dir: str) -> None:
    engine, gated = gated_engine(model_dir)
    core = engine.core
    slow = SO(json={**PERSON, "description": "SLOW"}, disable_any_whitespace=True)
    engine.add_request("slow", "waits", params(slow, temperature=0.0))
    assert gated.compile_started.wait(10)

    # Only a compile to wait for: a step waits about IDLE_WAIT for it, and returns nothing.
    start = time.perf_counter()
    steps = 0
    while time.perf_counter() - start < 0.25:
        assert core.step() == []
        steps += 1
    assert steps <= 0.25 / IDLE_WAIT + 2  # not a busy loop
    assert core.stats().num_waiting == 1

    waits: list[float] = []
    wait = core.structured.wait
    core.structured.wait = lambda timeout=IDLE_WAIT: waits.append(timeout) or wait(timeout)  # type: ignore[method-assign]
    engine.add_request("fast", "runs", SamplingParams(max_tokens=30, ignore_eos=True))
    tokens = 0
    while tokens < 30:
        outs = engine.step()
        tokens += sum(len(o.outputs[0].token_ids) for o in outs if o.request_id == "fast")
    # 30 steps ran while the compile was still blocked, and none of them waited for it.
    assert not gated.gate.is_set() and "slow" not in core.scheduler.requests
    assert waits == []
    gated.gate.set()
    done = run(engine)
    assert_valid(done["slow"], slow)
    assert done["slow"].outputs[0].finish_reason == "stop"


def test_faults_end_only_their_own_requests(model_dir: str) -> None:
    engine, _ = gated_engine(model_dir)
    good = COMPACT
    faults = {
        "compile": SO(json={**PERSON, "description": "BOOM"}, disable_any_whitespace=True),
        "accept": SO(json={**PERSON, "description": "ACCEPT"}, disable_any_whitespace=True),
        "fill": SO(json={**PERSON, "description": "FILL"}, disable_any_whitespace=True),
    }
    engine.add_request("good1", "fine", params(good, temperature=0.0))
    for name, constraint in faults.items():
        engine.add_request(name, "faulty", params(constraint, temperature=0.0, n=2))
    engine.add_request("good2", "fine too", params(good, temperature=1.0, seed=2))
    engine.add_request("plain", "free", SamplingParams(max_tokens=10, ignore_eos=True))
    done = run(engine)
    assert_valid(done["good1"], good)
    assert_valid(done["good2"], good)
    assert len(done["plain"].outputs[0].token_ids) == 10
    messages = {
        "compile": "compiler exploded",
        "accept": "accept exploded",
        "fill": "mask fill exploded",
    }
    for name, word in messages.items():
        for sample in done[name].outputs:
            assert sample.finish_reason == "error", (name, sample)
            assert sample.error is not None and word in sample.error, sample.error
    assert len(done["accept"].outputs[0].token_ids) == 4  # the 4th token's accept failed
    assert not engine.core.scheduler.requests and not engine.core.structured._matchers
    # A refused compile is not cached as a success, and the engine still serves.
    engine.add_request("after", "again", params(good, temperature=0.0))
    assert_valid(run(engine)["after"], good)


def test_a_grammar_error_in_the_engine_is_the_clients_message(model_dir: str) -> None:
    engine = engine_for(model_dir)
    bad = SO(json={"type": "object", "not": {}})
    engine.add_request("bad", "x", params(bad))  # not checked before: the engine refuses it
    engine.add_request("ok", "y", SamplingParams(max_tokens=5, ignore_eos=True))
    done = run(engine)
    (sample,) = done["bad"].outputs
    assert sample.finish_reason == "error" and sample.error and '"not"' in sample.error
    assert len(done["ok"].outputs[0].token_ids) == 5


def test_llm_generate_refuses_a_bad_constraint_before_running(llm: LLM) -> None:
    with pytest.raises(GrammarError, match=r'prompt 1: .*"uniqueItems"'):
        llm.generate(
            ["a", "b"],
            [params(SO(regex="a")), params(SO(json={"type": "array", "uniqueItems": True}))],
            use_tqdm=False,
        )
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_core_built_without_a_tokenizer_loads_it_for_its_first_constraint(
    model_dir: str,
) -> None:
    core = EngineCore(engine_config(model_dir, num_blocks=64, max_model_len=128), model_dir)
    core.structured.check(SO(choice=["x"]))


@pytest.mark.parametrize("kind", ["inproc", "proc"])
def test_engine_clients_carry_constraints_and_errors(model_dir: str, kind: str) -> None:
    """Through either client (the child process: SamplingParams pickle across the pipe, the
    matchers live in the engine process): valid outputs, and a grammar the engine cannot
    compile comes back as finish_reason "error" with the message; the engine keeps serving."""
    from transformers import AutoTokenizer

    served = start_client(kind, client_config(model_dir, max_model_len=256), model_dir)
    try:
        tok = AutoTokenizer.from_pretrained(model_dir)
        prompt = tok("client").input_ids
        good = params(COMPACT, temperature=1.0, seed=4, n=2)
        bad = params(SO(json={"type": "array", "uniqueItems": True}))

        async def both() -> tuple[list[RequestDelta], list[RequestDelta]]:
            client = served.client
            return await asyncio.gather(
                collect(client.generate("good", prompt, good)),
                collect(client.generate("bad", prompt, bad)),
            )

        good_deltas, bad_deltas = served.run(both())
        for index in range(2):
            text = tok.decode(sample_tokens(good_deltas, index), skip_special_tokens=True)
            assert satisfies(COMPACT, text), text
        (last,) = [d for d in bad_deltas if d.finish_reason is not None]
        assert last.finish_reason == "error" and last.error and '"uniqueItems"' in last.error
        again = served.run(collect(served.client.generate("again", prompt, good)))
        assert {d.finish_reason for d in again if d.finish_reason} == {"stop"}
    finally:
        stop_client(served)


@pytest.mark.slow
def test_the_embedded_model_fills_a_schema_and_picks_a_choice() -> None:
    """SmolLM2-135M-Instruct, greedy, through its chat template: the outputs parse, validate,
    and carry the facts of the prompt."""
    llm = LLM(None, max_model_len=1024, max_num_seqs=8)
    tok = llm.get_tokenizer()

    def chat(text: str) -> str:
        return str(
            tok.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
        )

    person = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "city": {"type": "string", "maxLength": 40},
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    }
    extract = SO(json=person)
    mood = SO(choice=["positive", "negative"])
    outs = llm.generate(
        [
            chat("Extract the person as JSON: John Smith is 42 years old and lives in Paris."),
            chat("Is this review positive or negative? 'I love it, best purchase ever!'"),
        ],
        [
            SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=extract),
            SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=mood),
        ],
        use_tqdm=False,
    )
    assert_valid(outs[0], extract)
    assert_valid(outs[1], mood)
    person_out = json.loads(outs[0].outputs[0].text)
    assert person_out["age"] == 42 and "John" in person_out["name"], person_out
    assert outs[1].outputs[0].text == "positive"


# ---- bounded compiles (issue 31 points 2 and 4) -----------------------------------------------


def test_one_tenants_slow_compiles_do_not_hold_another_tenants(model_dir: str) -> None:
    """Two held compiles of tenant a (two 70-tool grammars, say) take at most one of the two
    compile threads: tenant b's json_object compiles and runs meanwhile. Before the per-tenant
    queue both threads were a's, and b waited for a's compiles."""
    engine, gated = gated_engine(model_dir)
    for i in range(2):
        slow = SO(json={**PERSON, "description": f"SLOW {i}"}, disable_any_whitespace=True)
        engine.add_request(f"a{i}", "slow", params(slow, temperature=0.0), tenant="a")
    assert gated.compile_started.wait(10)
    start = time.perf_counter()
    other = SO(json_object=True, disable_any_whitespace=True)
    engine.add_request("b", "quick", SamplingParams(max_tokens=3, structured_outputs=other),
                       tenant="b")  # fmt: skip
    done: dict[str, RequestOutput] = {}
    while "b" not in done and time.perf_counter() - start < 5:
        done.update({o.request_id: o for o in engine.step() if o.finished})
    waited = time.perf_counter() - start
    gated.gate.set()
    assert "b" in done and waited < 1.0, waited
    assert not {"a0", "a1"} & set(done)  # still held when b was done
    done.update(run(engine))
    assert {"a0", "a1"} <= set(done)


@pytest.mark.timeout(180)
def test_heavy_regexes_leave_the_engines_memory_bounded(model_dir: str) -> None:
    """100 distinct costly regexes through an engine in a child process (3 GiB address space,
    2 minutes): the nested counts are refused before compiling, the rest stay within the
    cache's byte bound, and the engine's RSS grows by under 300 MB. Before: the child aborted
    at its memory limit (issue 31's 2.5 -> 8.8 GB)."""
    from loraplex.grammar import CACHE_BYTES
    from tests.utils.grammar_attacks import run_bounded

    rc, lines, err = run_bounded(
        "tests.utils.grammar_attacks", ["--engine", model_dir], memory_mb=4096, timeout=150
    )
    assert rc == 0 and lines, f"the child died ({rc}): {err}"
    (result,) = lines
    assert result["refused"] == 50
    assert result["cache_bytes"] <= CACHE_BYTES
    assert result["rss_growth_mb"] < 300, result


def test_a_grammar_whose_matcher_failed_leaves_the_cache(model_dir: str) -> None:
    """Matchers of one grammar share its lexer state: one that hit a limit of the grammar
    library would fail every later copy at once, so its grammar is compiled afresh."""
    engine, _ = gated_engine(model_dir)
    fill = SO(json={**PERSON, "description": "FILL"}, disable_any_whitespace=True)
    good = COMPACT
    engine.add_request("fill", "x", params(fill, temperature=0.0))
    engine.add_request("good", "y", params(good, temperature=0.0))
    done = run(engine)
    assert done["fill"].outputs[0].finish_reason == "error"
    compiled = engine.core.structured._compiled
    assert fill.key() not in compiled and good.key() in compiled


class SlowMatcher:
    """A matcher whose mask takes ``seconds`` to fill (a costly constraint)."""

    def __init__(self, inner: Any, seconds: float) -> None:
        self.inner = inner
        self.seconds = seconds

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        time.sleep(self.seconds)
        self.inner.fill_bitmask(bitmask, row)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class SlowMaskBackend:
    """llguidance, with 30 ms mask fills for constraints whose key holds HEAVY."""

    name = "slow-masks"

    def __init__(self, inner: LLGuidanceBackend) -> None:
        self.inner = inner
        self.vocab_size = inner.vocab_size

    def compile(self, constraint: SO) -> Any:
        compiled = self.inner.compile(constraint)
        if "HEAVY" not in constraint.key():
            return compiled
        grammar = SimpleNamespace(**vars(compiled)) if hasattr(compiled, "__dict__") else compiled
        make = compiled.matcher
        grammar.matcher = lambda: SlowMatcher(make(), 0.03)  # type: ignore[union-attr]
        return grammar

    def fill_bitmasks(self, matchers: Any, bitmask: np.ndarray) -> None:
        self.inner.fill_bitmasks(matchers, bitmask)


def test_mask_work_is_charged_to_its_tenant_and_a_costly_mask_ends_its_request(
    model_dir: str,
) -> None:
    from loraplex.engine.request import Request

    engine = engine_for(model_dir, scheduling_policy="fair", max_num_seqs=8)
    core = engine.core
    inner = LLGuidanceBackend(engine.tokenizer, core.vocab_size, core.eos_token_ids)
    core.structured.wrap_backend(lambda _: SlowMaskBackend(inner))  # type: ignore[arg-type, return-value]
    heavy = SO(json={**PERSON, "description": "HEAVY"}, disable_any_whitespace=True)
    light = SO(json=PERSON, disable_any_whitespace=True)
    ids = engine.tokenizer("a person").input_ids
    p = dict(max_tokens=60, temperature=0.0)
    core.add_request(
        Request("heavy", ids, SamplingParams(structured_outputs=heavy, **p), tenant="a")
    )
    core.add_request(
        Request("light", ids, SamplingParams(structured_outputs=light, **p), tenant="b")
    )
    last: dict[str, Any] = {}
    for _ in range(400):
        for out in core.step():
            last[out.request_id] = out
        if not core.has_unfinished_requests():
            break
    assert last["heavy"].finish_reason == "error"
    assert last["heavy"].error_code == "constraint_too_costly"
    assert "ms of work per token" in (last["heavy"].error or "")
    assert last["light"].finish_reason == "stop"
    counters = core.scheduler.waiting.virtual_service()
    assert counters is not None
    # beyond its tokens, a was charged its masks: 30 ms a step, 15 tokens of service each
    tenants = core.stats().tenants
    tokens = {
        t: tenants[t].num_prompt_tokens_computed + 2 * tenants[t].num_generated_tokens
        for t in ("a", "b")
    }
    a_masks = counters["a"] - tokens["a"]
    assert a_masks >= 3 * 0.03 * MASK_TOKENS_PER_SECOND * 0.9
    # b is charged its own rows' time only, never a's: its cheap rows (well under a
    # millisecond each, a few on a slow shared runner) cost a small part of a's 30 ms rows
    assert counters["b"] - tokens["b"] < a_masks / 3
