"""Incremental detokenizer: streamed text equals a full decode, never broken UTF-8, stop strings.

Two tokenizers are trained here (no network): a GPT-2-style byte-level BPE, and a
SentencePiece/Llama-style BPE with byte fallback whose decoder drops a window's leading space.
Both are small enough that CJK characters and emoji span several tokens.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from loraplex.detokenizer import IncrementalDetokenizer
from loraplex.sampling_params import SamplingParams

CORPUS = [
    "Hello world, this is a test of streaming.",
    "The quick brown fox jumps over the lazy dog. Stop here. STOP! The end.",
    "日本語のテキストと絵文字 😀 🎉 👩‍💻 émoji façade naïve",
] * 20

TEXTS = [
    "Hello world, this is a test of streaming.",
    " 日本語 and 😀🎉 mixed with façade; STOP! then more 👩‍💻 text",
    "naïve zebra 語😀 qux. The end.",
]
EOS = "<|endoftext|>"


def byte_level() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)


def sentencepiece_style() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    # Trained on ASCII only: every other character falls back to its UTF-8 bytes, one token each.
    tok.train_from_iterator([t for t in CORPUS if t.isascii()], trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    spec["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


TOKENIZERS: dict[str, PreTrainedTokenizerFast] = {
    "byte_level": byte_level(),
    "sentencepiece": sentencepiece_style(),
}


@pytest.fixture(params=sorted(TOKENIZERS))
def tok(request: pytest.FixtureRequest) -> PreTrainedTokenizerFast:
    return TOKENIZERS[request.param]


def encode(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def decode(tok: PreTrainedTokenizerFast, ids: list[int], skip: bool = True) -> str:
    text = tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    assert isinstance(text, str)
    return text


def stream(
    tok: PreTrainedTokenizerFast,
    prompt: list[int],
    output: list[int],
    params: SamplingParams,
    rng: random.Random | None = None,
    check: Callable[[IncrementalDetokenizer, str], None] | None = None,
) -> tuple[IncrementalDetokenizer, list[str]]:
    """Pushes ``output`` in random-sized chunks (one token each without ``rng``)."""
    detok = IncrementalDetokenizer(tok, prompt, params)
    deltas, i = [], 0
    while i < len(output):
        n = rng.randint(1, 4) if rng else 1
        delta = detok.push(output[i : i + n])
        deltas.append(delta.new_text)
        if check:
            check(detok, delta.new_text)
        i += n
    deltas.append(detok.flush())
    return detok, deltas


def test_test_tokenizers_split_characters_across_tokens(tok: PreTrainedTokenizerFast) -> None:
    ids = encode(tok, "日本語 😀")
    assert any("\ufffd" in decode(tok, [i]) for i in ids)  # else the UTF-8 tests test nothing
    assert decode(tok, ids) == "日本語 😀"


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_concatenate_to_the_full_decode(
    tok: PreTrainedTokenizerFast, text: str
) -> None:
    prompt = encode(tok, "Question: say it")
    output = encode(tok, text)
    # The prompt is context: the output's text is what it adds to the prompt's text.
    expected = decode(tok, prompt + output)[len(decode(tok, prompt)) :]
    rng = random.Random(0)
    for trial in range(25):
        detok, deltas = stream(tok, prompt, output, SamplingParams(), rng if trial else None)
        assert "".join(deltas) == expected == detok.text
        assert not any("\ufffd" in d for d in deltas)


def test_byte_level_output_equals_plain_decode() -> None:
    tok = TOKENIZERS["byte_level"]
    for text in TEXTS:
        output = encode(tok, text)
        for prompt in ([], encode(tok, "Hi"), encode(tok, "語")):
            _, deltas = stream(tok, prompt, output, SamplingParams())
            assert "".join(deltas) == decode(tok, output)


def test_sentencepiece_leading_space_comes_from_prompt_context() -> None:
    tok = TOKENIZERS["sentencepiece"]
    output = encode(tok, "world")  # "▁world": its space is dropped when decoded alone
    assert decode(tok, output) == "world"
    _, deltas = stream(tok, encode(tok, "Hello"), output, SamplingParams())
    assert "".join(deltas) == " world"
    _, deltas = stream(tok, [], output, SamplingParams())
    assert "".join(deltas) == "world"


def test_random_token_soup_matches_full_decode() -> None:
    # Byte-level only: SentencePiece's byte fallback decodes an invalid byte run as one U+FFFD
    # per token, valid ASCII bytes included, so its text for a token depends on later tokens.
    tok = TOKENIZERS["byte_level"]
    rng = random.Random(1)
    vocab = tok.get_vocab()
    for _ in range(30):
        output = [rng.randrange(len(vocab)) for _ in range(40)]
        _, deltas = stream(tok, [], output, SamplingParams(), rng)
        full = decode(tok, output)
        # Invalid byte runs inside the text decode as U+FFFD in both; an unfinished character
        # at the very end is dropped by flush rather than shown as U+FFFD.
        assert "".join(deltas) == full.rstrip("\ufffd")


def test_prompt_ending_inside_a_character_is_completed_by_the_output() -> None:
    tok = TOKENIZERS["sentencepiece"]
    ids = encode(tok, "ab 😀")
    cut = len(ids) - 2  # two of the emoji's four byte tokens stay in the prompt
    _, deltas = stream(tok, ids[:cut], ids[cut:], SamplingParams())
    assert "".join(deltas) == "😀"


def test_unfinished_character_waits_then_flush_drops_it() -> None:
    tok = TOKENIZERS["sentencepiece"]
    ids = encode(tok, "ok 😀")
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    assert detok.push(ids[:-1]).new_text == ""  # "ok" waits behind the unfinished emoji
    assert detok.flush() == "ok "
    assert detok.text == "ok "


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(skip: bool) -> None:
    tok = TOKENIZERS["byte_level"]
    eos = tok.eos_token_id
    assert isinstance(eos, int)
    output = [*encode(tok, "Hello"), eos, *encode(tok, " world")]
    _, deltas = stream(tok, [], output, SamplingParams(skip_special_tokens=skip))
    assert "".join(deltas) == ("Hello world" if skip else f"Hello{EOS} world")


def test_decoding_is_incremental_not_quadratic(monkeypatch: pytest.MonkeyPatch) -> None:
    tok = TOKENIZERS["byte_level"]
    windows: list[int] = []
    real_decode = tok.decode

    def counting_decode(ids: list[int], **kwargs: Any) -> str | list[str]:
        windows.append(len(ids))
        return real_decode(ids, **kwargs)

    output = encode(tok, " ".join(TEXTS) * 30)
    detok = IncrementalDetokenizer(tok, encode(tok, "prompt " * 100), SamplingParams())
    monkeypatch.setattr(tok, "decode", counting_decode)
    for t in output:
        detok.push([t])
    monkeypatch.undo()
    assert len(output) > 1000
    assert max(windows) <= 12  # tokens since the last emitted text, plus the chunk before
    assert detok.flush() == "" and detok.text == decode(tok, output)


# -- stop strings ------------------------------------------------------------------------------


def stop_stream(
    tok: PreTrainedTokenizerFast, text: str, seed: int | None = None, **params: object
) -> tuple[IncrementalDetokenizer, str]:
    """Streams ``text``; checks that everything emitted stays a prefix of the final text."""
    emitted: list[str] = []
    detok, deltas = stream(
        tok,
        encode(tok, "Prompt:"),
        encode(tok, text),
        SamplingParams(**params),  # type: ignore[arg-type]
        random.Random(seed) if seed is not None else None,
        check=lambda d, new: emitted.append(new),
    )
    streamed = "".join(deltas)
    assert streamed == detok.text
    prefix = ""
    for piece in emitted:
        prefix += piece
        assert streamed.startswith(prefix)  # nothing emitted was ever taken back
    return detok, streamed


# Texts start with a space: after the prompt "Prompt:" both tokenizers then decode them verbatim.


@pytest.mark.parametrize("seed", [None, 0, 1, 2])
def test_stop_string_spanning_tokens_ends_the_text_before_it(
    tok: PreTrainedTokenizerFast, seed: int | None
) -> None:
    text = " 日本語 and 😀🎉 mixed with façade; STOP! then more"
    assert not any("OP! th" in decode(tok, [t]) for t in encode(tok, text))  # spans tokens
    detok, streamed = stop_stream(tok, text, seed, stop=["OP! th"])
    assert streamed == " 日本語 and 😀🎉 mixed with façade; ST"
    assert detok.stopped and detok.stop_str == "OP! th"
    assert detok.push(encode(tok, " more")).new_text == ""  # stays stopped
    assert detok.flush() == "" and detok.text == streamed


def test_stop_string_inside_a_multibyte_run(tok: PreTrainedTokenizerFast) -> None:
    detok, streamed = stop_stream(tok, " 日本語のテキスト and more", stop="語の")
    assert streamed == " 日本" and detok.stop_str == "語の"


def test_stop_string_at_the_very_start(tok: PreTrainedTokenizerFast) -> None:
    detok, streamed = stop_stream(tok, " Hello world", stop=["zzz", " Hel"])
    assert streamed == "" and detok.stopped and detok.stop_str == " Hel"


def test_the_stop_string_completed_first_wins(tok: PreTrainedTokenizerFast) -> None:
    text = " The quick brown fox jumps over the lazy dog."
    detok, streamed = stop_stream(tok, text, stop=["lazy", "fox jumps", "quick"])
    assert detok.stop_str == "quick" and streamed == " The "
    # "fox jumps" starts first, but "jump" is complete earlier: a stream stops there.
    detok, streamed = stop_stream(tok, text, seed=3, stop=["fox jumps", "jump"])
    assert detok.stop_str == "jump" and streamed == " The quick brown fox "


def test_include_stop_str_in_output(tok: PreTrainedTokenizerFast) -> None:
    for seed in (None, 5):
        detok, streamed = stop_stream(
            tok, " Stop here. STOP! The end.", seed, stop=["STOP!"], include_stop_str_in_output=True
        )
        assert streamed == " Stop here. STOP!" and detok.stop_str == "STOP!"


def test_possible_stop_prefix_is_held_back_then_released(tok: PreTrainedTokenizerFast) -> None:
    stops = ["STOP!", "xyzzy"]
    ids = encode(tok, "Stop here. STOP then S")
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=stops))
    shown, max_held = "", 0
    for i, t in enumerate(ids):
        shown += detok.push([t]).new_text
        so_far = decode(tok, ids[: i + 1])
        # Held back: the longest end of the text that could still grow into a stop string.
        held = max(k for s in stops for k in range(len(s)) if so_far.endswith(s[:k]))
        assert shown == so_far[: len(so_far) - held]
        max_held = max(max_held, held)
    assert max_held >= 2 and not detok.stopped  # "ST", then "STOP" were held
    assert shown == "Stop here. STOP then "  # the last "S" may start "STOP!"
    assert detok.flush() == "S"
    assert detok.text == "Stop here. STOP then S" and not detok.stopped


def reference_stop_cut(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Non-incremental reference: cut at the stop string whose first occurrence ends first."""
    hits = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    end, _, stop = min(hits)
    return text[: end if include else end - len(stop)], stop


def test_random_stops_and_splits_match_the_reference(tok: PreTrainedTokenizerFast) -> None:
    rng = random.Random(7)
    for trial in range(60):
        text = " " + " ".join(rng.sample(TEXTS, 2))
        stops = []
        for _ in range(rng.randint(1, 3)):
            a = rng.randrange(1, len(text) - 1)
            stops.append(text[a : a + rng.randint(1, 6)])
        if trial % 5 == 0:
            stops.append("never there")
        include = rng.random() < 0.5
        detok, streamed = stop_stream(
            tok, text, trial, stop=stops, include_stop_str_in_output=include
        )
        assert (streamed, detok.stop_str) == reference_stop_cut(text, stops, include)
