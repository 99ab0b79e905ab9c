"""Generated text -> content and tool calls, incrementally (one parser for every format).

Text outside ``<tool_call>`` ... ``</tool_call>`` blocks is content. A block holds one call
object or a JSON list of them, each ``{"name": ..., "arguments": {...}}`` (``"parameters"`` is
read as ``"arguments"``). Streaming, a call is announced as soon as its name is whole (a delta
with its index, ``call_<random>`` id and name), then its arguments' text follows in fragments as
it arrives, OpenAI's incremental ``tool_calls`` deltas; the fragments of one call join into its
``arguments``, exactly the text the model wrote.

A block the incremental reader cannot follow (keys in another order, say) is read whole at its
end. A block that is not tool calls at all (malformed JSON, no name) is content, as written,
unless part of it was already sent as a call (streaming only). With ``streaming=False`` nothing
of a block is given out before its end, so a malformed block is always content: a non-streamed
answer's calls are always whole, valid JSON objects.

Whitespace between calls is not content: content is given out once it holds more than
whitespace, and whitespace alone is dropped when the answer has calls.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from loraplex.platform.openai.tools.formats import END, START

# A call's start, up to its arguments object's "{" (a call announced only once its arguments
# are known to be an object: anything else is read whole at the block's end).
_HEADER = re.compile(
    r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)
_WS = " \t\r\n"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallDelta:
    """A piece of call ``index``: its id and name (the first delta), or more arguments text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""  # the arguments object's JSON text
    valid: bool = False  # whole, and the arguments are a JSON object


@dataclass
class Piece:
    """What one push gives out: content text and call deltas, in order of the text."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


class _BlockReader:
    """Reads one block's JSON as it arrives: a call's name once whole, then its arguments' text.
    States: start -> call -> args -> close -> (call | end); ``failed`` once it cannot follow."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0
        self.state = "start"
        self.as_list = False
        self.failed = False
        self.calls: list[tuple[str, str]] = []  # (name, arguments text so far)
        self._arg_start = -1
        self._depth = 0
        self._in_string = False
        self._escaped = False

    @property
    def complete(self) -> bool:
        return not self.failed and self.state == "end"

    def feed(self, text: str) -> list[tuple[int, str | None, str]]:
        """(call index, its name when new, arguments text added) for what ``text`` adds."""
        self.text += text
        out: list[tuple[int, str | None, str]] = []
        while not self.failed and self.pos < len(self.text):
            before = (self.state, self.pos)
            self._step(out)
            if (self.state, self.pos) == before:
                break  # waits for more text
        return out

    def _skip_ws(self) -> bool:
        while self.pos < len(self.text) and self.text[self.pos] in _WS:
            self.pos += 1
        return self.pos < len(self.text)

    def _step(self, out: list[tuple[int, str | None, str]]) -> None:
        if self.state == "args":
            self._args(out)
            return
        if not self._skip_ws():
            return
        c = self.text[self.pos]
        if self.state == "start":
            if c == "[":
                self.as_list, self.state = True, "call"
                self.pos += 1
            elif c == "{":
                self.state = "call"
            else:
                self.failed = True
        elif self.state == "call":
            if self.as_list and c == "]" and not self.calls:
                self.pos += 1
                self.state = "end"  # an empty list: no calls
                return
            match = _HEADER.match(self.text, self.pos)
            if match is None:
                return  # incomplete, or not what this reader follows (read whole at the end)
            try:
                name = json.loads(f'"{match.group(1)}"')
            except ValueError:
                self.failed = True
                return
            self.calls.append((name, ""))
            out.append((len(self.calls) - 1, name, ""))
            self.pos = match.end()
            self.state, self._arg_start = "args", -1
        elif self.state == "close":
            if c != "}":
                self.failed = True
                return
            self.pos += 1
            self.state = "next" if self.as_list else "end"
        elif self.state == "next":
            if c == ",":
                self.pos += 1
                self.state = "call"
            elif c == "]":
                self.pos += 1
                self.state = "end"
            else:
                self.failed = True
        else:  # end: nothing but whitespace may follow
            self.failed = True

    def _args(self, out: list[tuple[int, str | None, str]]) -> None:
        """Scan the arguments object; give out its text as it comes."""
        text = self.text
        if self._arg_start < 0:
            if not self._skip_ws():
                return
            if text[self.pos] != "{":
                self.failed = True
                return
            self._arg_start = self.pos
        start, i = self.pos, self.pos
        done = False
        while i < len(text):
            c = text[i]
            i += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    done = True
                    break
        self.pos = i
        fragment = text[start:i]
        index = len(self.calls) - 1
        name, so_far = self.calls[index]
        self.calls[index] = (name, so_far + fragment)
        if fragment:
            out.append((index, None, fragment))
        if done:
            self.state = "close"


@dataclass
class _Block:
    reader: _BlockReader = field(default_factory=_BlockReader)
    first_call: int = 0  # the index of its first call in the answer
    ws_before: str = ""  # the whitespace content before it
    given: int = 0  # calls already announced


class ToolCallParser:
    """Splits an answer into content and tool calls as its text arrives (see the module)."""

    def __init__(self, *, streaming: bool = True, max_calls: int | None = None) -> None:
        self.streaming = streaming
        self.max_calls = max_calls
        self.calls: list[ParsedCall] = []
        self._buffer = ""  # text not yet given out
        self._held_ws = ""  # whitespace content, given out once more content follows
        self._block: _Block | None = None

    @property
    def valid_calls(self) -> list[ParsedCall]:
        return [c for c in self.calls if c.valid]

    def push(self, text: str) -> Piece:
        self._buffer += text
        piece = Piece()
        while self._buffer:
            if self._block is None:
                if not self._text(piece):
                    break
            elif not self._in_block(piece):
                break
        return piece

    def finish(self) -> Piece:
        """The end of the answer: what was held back, and an unterminated block read whole."""
        piece = Piece()
        if self._block is not None:
            self._close_block(piece, self._buffer, terminated=False)
            self._buffer = ""
        if self._buffer:
            self._content(piece, self._buffer)
            self._buffer = ""
        if self._held_ws and not self.calls:
            piece.content += self._held_ws
        self._held_ws = ""
        return piece

    # ---- outside blocks --------------------------------------------------------------------

    def _text(self, piece: Piece) -> bool:
        """Give out content up to a block's start; False when the rest must wait."""
        at = self._buffer.find(START)
        if at >= 0:
            self._content(piece, self._buffer[:at])
            self._buffer = self._buffer[at + len(START) :]
            # whitespace before a call is not content (unless the block is not calls)
            self._block = _Block(first_call=len(self.calls), ws_before=self._held_ws)
            self._held_ws = ""
            return True
        keep = _partial_suffix(self._buffer, START)
        self._content(piece, self._buffer[: len(self._buffer) - keep])
        self._buffer = self._buffer[len(self._buffer) - keep :]
        return False

    def _content(self, piece: Piece, text: str) -> None:
        """Content; its trailing whitespace is held until more content follows."""
        body = text.rstrip(_WS)
        if body:
            piece.content += self._held_ws + body
            self._held_ws = ""
        self._held_ws += text[len(body) :]

    # ---- inside a block ----------------------------------------------------------------------

    def _in_block(self, piece: Piece) -> bool:
        assert self._block is not None
        at = self._buffer.find(END)
        if at < 0:
            keep = _partial_suffix(self._buffer, END)
            ready = self._buffer[: len(self._buffer) - keep]
            self._buffer = self._buffer[len(self._buffer) - keep :]
            if self.streaming:
                self._follow(piece, self._block, self._block.reader.feed(ready))
            else:
                self._block.reader.text += ready  # read whole at the end
            return False
        body, self._buffer = self._buffer[:at], self._buffer[at + len(END) :]
        self._close_block(piece, body, terminated=True)
        return True

    def _follow(
        self, piece: Piece, block: _Block, events: list[tuple[int, str | None, str]]
    ) -> None:
        for index, name, fragment in events:
            answer_index = block.first_call + index
            if self.max_calls is not None and answer_index >= self.max_calls:
                continue
            if name is not None:
                call = ParsedCall(new_call_id(), name)
                self.calls.append(call)
                block.given += 1
                piece.calls.append(ToolCallDelta(answer_index, call.id, name, ""))
            if fragment and answer_index < len(self.calls):
                self.calls[answer_index].arguments += fragment
                piece.calls.append(ToolCallDelta(answer_index, arguments=fragment))

    def _close_block(self, piece: Piece, rest: str, *, terminated: bool) -> None:
        block = self._block
        assert block is not None
        self._block = None
        if self.streaming:
            reader = block.reader
            self._follow(piece, block, reader.feed(rest))
        else:  # read whole now: its calls only when all of them are whole and valid
            reader = _BlockReader()
            events = reader.feed(block.reader.text + rest)
            if reader.complete and all(_is_object(a) for _, a in reader.calls):
                self._follow(piece, block, events)
        if reader.complete and (block.given or not reader.calls):
            for call in self.calls[block.first_call :]:
                call.valid = _is_object(call.arguments)
            return
        if block.given:
            return  # streamed in part, then not followable: those calls stay invalid
        whole = _read_whole(reader.text)
        if whole is None:  # not tool calls: the text, as written
            self._held_ws = block.ws_before + self._held_ws
            self._content(piece, START + reader.text + (END if terminated else ""))
            return
        for name, arguments in whole:
            index = len(self.calls)
            if self.max_calls is not None and index >= self.max_calls:
                break
            call = ParsedCall(new_call_id(), name, arguments, valid=True)
            self.calls.append(call)
            piece.calls.append(ToolCallDelta(index, call.id, name, ""))  # named first,
            piece.calls.append(ToolCallDelta(index, arguments=arguments))  # as always


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):  # nested too deep to read: not arguments
        return False


def _read_whole(text: str) -> list[tuple[str, str]] | None:
    """A block's calls read as one JSON value (any key order); None when it is not calls."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments: Any = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                return None
        if not isinstance(arguments, dict):
            return None
        calls.append((item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (to hold back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def parse_answer(text: str, max_calls: int | None = None) -> tuple[str, list[ParsedCall]]:
    """A whole answer's content and valid calls (the non-streamed response)."""
    parser = ToolCallParser(streaming=False, max_calls=max_calls)
    first, last = parser.push(text), parser.finish()
    return first.content + last.content, parser.valid_calls
