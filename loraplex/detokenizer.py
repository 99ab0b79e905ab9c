"""Incremental detokenization with stop strings: O(new tokens) per push, never broken UTF-8.

Token ids -> text uses the prefix/read-offset window (as vLLM and TGI do), which works for any
tokenizer with a ``decode`` (byte-level BPE, SentencePiece with byte fallback, slow or fast):

    ids:   ... | prefix ...... | read ...... |
                 already text    not yet text

``decode(ids[prefix:read])`` is text already produced and ``decode(ids[prefix:])`` the same plus
the new tokens; the new text is the difference. Decoding from ``prefix`` rather than ``read``
keeps the context a tokenizer needs for leading spaces (SentencePiece drops the space of a
window's first token). While the window ends in U+FFFD (a character whose bytes have not all
arrived) nothing is produced and ``read`` stays put; once text is produced, ``prefix`` moves to
the old ``read``. Only the window ``ids[prefix:]`` is kept.

Stop strings: produced text is searched for any stop string; the last characters that could
still begin one are held back, so a stop string is never emitted in part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from loraplex.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 6  # prompt tokens decoded as context ahead of the first output token


class Tokenizer(Protocol):
    """What is used of a Hugging Face tokenizer (``PreTrainedTokenizerBase`` matches it)."""

    def decode(
        self, token_ids: list[int], skip_special_tokens: bool = ..., **kwargs: Any
    ) -> str | list[str]: ...


@dataclass
class DetokenizerDelta:
    new_text: str  # safe to show: complete characters, no part of a possible stop string
    stopped: bool = False
    stop_str: str | None = None  # the stop string that ended the output, when stopped


class IncrementalDetokenizer:
    """Detokenizes one request's output as it grows. ``text`` is what has been emitted."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stops = params.stop_strings
        self._include_stop = params.include_stop_str_in_output
        # The window: decode(ids[:read]) is text already produced and ends on a whole
        # character; ids[read:] are pending. Starts as a few prompt tokens of context.
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._read = len(self._ids)
        # A prompt given as ids may end inside a character: its last bytes then wait, as pending
        # tokens, for the output tokens that complete it.
        while self._read > 0 and self._decode(self._ids[: self._read]).endswith(_REPLACEMENT):
            self._read -= 1
        self._chunks: list[str] = []  # the emitted text
        # Produced but not emitted: the longest end of the text that could begin a stop string.
        # Invariant: no stop string starts inside emitted text, so a search for one only needs
        # held + new text: O(new text) per push.
        self._held = ""
        self._stopped = False
        self._stop_str: str | None = None

    @property
    def text(self) -> str:
        if len(self._chunks) > 1:
            self._chunks[:] = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def stop_str(self) -> str | None:
        return self._stop_str

    def push(self, new_token_ids: list[int]) -> DetokenizerDelta:
        if self._stopped or not new_token_ids:
            return DetokenizerDelta("", self._stopped, self._stop_str)
        self._ids.extend(new_token_ids)
        prefix_text = self._decode(self._ids[: self._read])
        full_text = self._decode(self._ids)
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return DetokenizerDelta("")  # an unfinished character, or only skipped tokens
        del self._ids[: self._read]  # the new window starts where the old one was read to
        self._read = len(self._ids)
        return self._produce(full_text[len(prefix_text) :], final=False)

    def flush(self) -> str:
        """Releases held-back text at the end of the request. Pending bytes of a character that
        never completed are dropped rather than emitted as U+FFFD."""
        if self._stopped:
            return ""
        new_text = ""
        if self._read < len(self._ids):
            prefix_text = self._decode(self._ids[: self._read])
            new_text = self._decode(self._ids)[len(prefix_text) :].rstrip(_REPLACEMENT)
            self._ids, self._read = [], 0
        return self._produce(new_text, final=True).new_text

    def _decode(self, ids: list[int]) -> str:
        # No clean-up of tokenization spaces: it is not stable under concatenation of pieces.
        text = self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False
        )
        assert isinstance(text, str)  # one sequence in, one string out
        return text

    def _produce(self, new_text: str, final: bool) -> DetokenizerDelta:
        window = self._held + new_text
        cut = len(window)
        hit = self._find_stop(window)
        if hit is not None:
            pos, stop = hit
            cut = pos + len(stop) if self._include_stop else pos
            self._stopped, self._stop_str, final = True, stop, True
        end = cut if final else cut - self._held_back(window)
        self._held = window[end:cut]
        if end:
            self._chunks.append(window[:end])
        return DetokenizerDelta(window[:end], self._stopped, self._stop_str)

    def _find_stop(self, window: str) -> tuple[int, str] | None:
        """The stop string a token-by-token stream would meet first: the one that ends
        earliest (then the longest of those)."""
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for stop in self._stops:
            pos = window.find(stop)
            if pos != -1 and (best is None or (pos + len(stop), -len(stop), stop) < best):
                best = (pos + len(stop), -len(stop), stop)
        if best is None:
            return None
        end, _, stop = best
        return end - len(stop), stop

    def _held_back(self, window: str) -> int:
        """Length of the longest end of ``window`` that is a proper prefix of a stop string."""
        held = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(window)), held, -1):
                if window.endswith(stop[:k]):
                    held = k
                    break
        return held
