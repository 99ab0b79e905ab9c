"""A reading of a Lark grammar (llguidance's dialect) good enough to refuse, by rule name, what
llguidance would only find out while generating: a start rule that never ends (``start: start``,
``start: "a" start``: the first has no first token, the second runs into llguidance's item limit
mid-generation), counted repetitions that multiply (``A: (("a"{100}){100}){100}``), and the
embedded ``%json`` schemas and ``/regex/`` tokens, which ``precheck`` checks like top-level ones.

``read_lark`` returns None for a grammar it cannot follow (a construct this reader does not
know): then only llguidance judges it. The reader never refuses a grammar llguidance accepts
because of a misreading: an unknown rule name or an odd token counts as "ends" and "cheap".
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# An item's repetition: None (once), "?", "*", "+", or (low, high) counts
Quant = str | tuple[int, int] | None


@dataclass
class Atom:
    kind: str  # "lit", "regex", "ref", "group", "json", "other"
    text: str = ""  # the regex, the rule name, or the %json body
    alts: list[list[Item]] = field(default_factory=list)  # a group's alternatives


@dataclass
class Item:
    atom: Atom
    quant: Quant = None


@dataclass
class Lark:
    """The rules (and tokens) of a grammar: name -> alternatives, each a sequence of items."""

    rules: dict[str, list[list[Item]]]

    def regexes(self) -> list[tuple[str, str]]:
        """Every ``/regex/`` with the rule it is in: (rule, regex)."""
        return [(name, a.text) for name, a in self._atoms() if a.kind == "regex"]

    def schemas(self) -> list[tuple[str, str]]:
        """Every ``%json`` body with the rule it is in: (rule, JSON text)."""
        return [(name, a.text) for name, a in self._atoms() if a.kind == "json"]

    def _atoms(self) -> list[tuple[str, Atom]]:
        out: list[tuple[str, Atom]] = []
        for name, alts in self.rules.items():
            stack = [alts]
            while stack:
                for alt in stack.pop():
                    for item in alt:
                        out.append((name, item.atom))
                        if item.atom.kind == "group":
                            stack.append(item.atom.alts)
        return out

    def never_ending(self) -> list[str]:
        """The rules no finite text completes (least fixed point of "some alternative has
        only items that end"), in definition order."""
        ends = dict.fromkeys(self.rules, False)
        changed = True
        while changed:
            changed = False
            for name, alts in self.rules.items():
                if not ends[name] and any(self._seq_ends(alt, ends) for alt in alts):
                    ends[name] = changed = True
        return [name for name, done in ends.items() if not done]

    def _seq_ends(self, alt: list[Item], ends: dict[str, bool]) -> bool:
        return all(self._item_ends(item, ends) for item in alt)

    def _item_ends(self, item: Item, ends: dict[str, bool]) -> bool:
        q = item.quant
        if q in ("?", "*") or (isinstance(q, tuple) and q[0] == 0):
            return True
        atom = item.atom
        if atom.kind == "ref":
            return ends.get(atom.text, True)  # unknown names: llguidance reports them
        if atom.kind == "group":
            return any(self._seq_ends(alt, ends) for alt in atom.alts)
        return True

    def repeats(self, regex_product: Callable[[str], int], limit: int) -> tuple[int, str] | None:
        """A rule whose nested counted repetitions (across rule references; a regex counts
        ``regex_product(pattern)``) multiply past ``limit``, with that product: the one
        nearest the leaves (the smallest such product, the last defined on a tie)."""
        memo: dict[str, int] = {}
        busy: set[str] = set()

        def of_alts(alts: list[list[Item]]) -> int:
            return max((of_item(i) for alt in alts for i in alt), default=1)

        def of_item(item: Item) -> int:
            atom = item.atom
            if atom.kind == "ref":
                inner = of_rule(atom.text)
            elif atom.kind == "group":
                inner = of_alts(atom.alts)
            elif atom.kind == "regex":
                inner = regex_product(atom.text)
            else:
                inner = 1
            q = item.quant
            return inner * max(q[1], 1) if isinstance(q, tuple) else inner

        def of_rule(name: str) -> int:
            if name in memo:
                return memo[name]
            if name in busy or name not in self.rules:
                return 1  # recursion repeats without counting; unknown names are llguidance's
            busy.add(name)
            memo[name] = of_alts(self.rules[name])
            busy.discard(name)
            return memo[name]

        over = [(of_rule(name), -i, name) for i, name in enumerate(self.rules)]
        over = [o for o in over if o[0] > limit]
        if not over:
            return None
        product, _, name = min(over)
        return product, name


class _Unsupported(Exception):
    """A construct this reader does not follow: no verdict on the grammar."""


def read_lark(text: str) -> Lark | None:
    """The rules of the Lark grammar ``text``, or None when it cannot be read here."""
    try:
        tokens = _tokens(text)
        return Lark(_rules(tokens))
    except (_Unsupported, IndexError, ValueError):
        return None


# ---- tokens ------------------------------------------------------------------------------------

_OPS = "|()[]?*+~:.,{}&=-<>!"


def _tokens(text: str) -> list[tuple[str, str]]:
    """(kind, text) pairs: NAME, NUM, STR, RE, JSON (a %json body), DIR (%word), OP, NL."""
    out: list[tuple[str, str]] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\n":
            out.append(("NL", c))
            i += 1
        elif c in " \t\r":
            i += 1
        elif text.startswith("//", i) or c == "#":
            while i < n and text[i] != "\n":
                i += 1
        elif c == '"' or c == "'":
            j = _quoted_end(text, i, c)
            out.append(("STR", text[i:j]))
            i = j
            if i < n and text[i] == "i":  # case-insensitive flag
                i += 1
        elif c == "/":
            j = _quoted_end(text, i, "/")
            out.append(("RE", text[i + 1 : j - 1]))
            i = j
            while i < n and text[i].isalpha():  # flags
                i += 1
        elif c == "%":
            j = i + 1
            while j < n and (text[j].isalnum() or text[j] == "_"):
                j += 1
            word = text[i:j]
            i = j
            if word in ("%json", "%regex", "%llguidance"):
                while i < n and text[i] in " \t\r\n":
                    i += 1
                if i >= n or text[i] != "{":
                    raise _Unsupported(word)
                j = _braces_end(text, i)
                out.append(("JSON" if word == "%json" else "DIR", text[i:j]))
                i = j
            else:
                out.append(("DIR", word))
        elif c == "<" and i + 1 < n and text[i + 1] in "[|":  # <[128]>, <|eot|>: a token
            j = text.find(">", i)
            if j < 0:
                raise _Unsupported("<")
            out.append(("STR", text[i : j + 1]))
            i = j + 1
        elif c.isalpha() or c == "_":
            j = i
            while j < n and (text[j].isalnum() or text[j] == "_"):
                j += 1
            out.append(("NAME", text[i:j]))
            i = j
        elif c.isdigit():
            j = i
            while j < n and text[j].isdigit():
                j += 1
            out.append(("NUM", text[i:j]))
            i = j
        elif text.startswith("..", i) or text.startswith("->", i):
            out.append(("OP", text[i : i + 2]))
            i += 2
        elif c in _OPS:
            out.append(("OP", c))
            i += 1
        else:
            raise _Unsupported(c)
    out.append(("NL", "\n"))
    return out


def _quoted_end(text: str, i: int, quote: str) -> int:
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == quote:
            return j + 1
        if text[j] == "\n":
            break
        j += 1
    raise _Unsupported("an unterminated literal")


def _braces_end(text: str, i: int) -> int:
    depth = 0
    j = i
    while j < len(text):
        c = text[j]
        if c == '"':
            j = _quoted_end(text, j, '"')
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    raise _Unsupported("an unbalanced %json body")


# ---- rules -------------------------------------------------------------------------------------


def _rules(tokens: list[tuple[str, str]]) -> dict[str, list[list[Item]]]:
    rules: dict[str, list[list[Item]]] = {}
    i = 0
    while i < len(tokens):
        kind, _text = tokens[i]
        if kind == "NL":
            i += 1
            continue
        if kind in ("DIR", "JSON"):  # %ignore, %import, %llguidance: not rules
            while tokens[i][0] != "NL" or _continues(tokens, i):
                i += 1
            continue
        i, name = _head(tokens, i)
        end = i
        while tokens[end][0] != "NL" or _continues(tokens, end):
            end += 1
        body = [t for t in tokens[i:end] if t[0] != "NL"]
        alts, pos = _alts(body, 0)
        if pos != len(body):
            raise _Unsupported(body[pos][1])
        if name in rules:
            raise _Unsupported(f"{name} defined twice")
        rules[name] = alts
        i = end
    return rules


def _continues(tokens: list[tuple[str, str]], i: int) -> bool:
    """Whether the line after the newline at ``i`` goes on with the same rule (it starts
    with ``|``, or it is not a rule head)."""
    j = i
    while j < len(tokens) and tokens[j][0] == "NL":
        j += 1
    if j >= len(tokens):
        return False
    kind, text = tokens[j]
    if kind in ("DIR", "JSON") or (kind == "OP" and text in "?!"):
        return False
    if kind == "NAME":
        k = j + 1
        if tokens[k] == ("OP", "."):
            k += 1
            if tokens[k] == ("OP", "-"):
                k += 1
            k += 1
        if tokens[k] == ("OP", "["):
            return False  # name[attributes]: a head
        return tokens[k] != ("OP", ":")
    return True


def _head(tokens: list[tuple[str, str]], i: int) -> tuple[int, str]:
    if tokens[i] in (("OP", "?"), ("OP", "!")):
        i += 1
    kind, name = tokens[i]
    if kind != "NAME":
        raise _Unsupported(name)
    i += 1
    if tokens[i] == ("OP", "."):  # priority
        i += 1
        if tokens[i] == ("OP", "-"):
            i += 1
        i += 1
    if tokens[i] == ("OP", "["):  # attributes: stop=..., max_tokens=..., lazy
        depth = 0
        while True:
            if tokens[i] == ("OP", "["):
                depth += 1
            elif tokens[i] == ("OP", "]"):
                depth -= 1
                if depth == 0:
                    break
            elif tokens[i][0] == "NL":
                raise _Unsupported("attributes over lines")
            i += 1
        i += 1
    if tokens[i] != ("OP", ":"):
        raise _Unsupported(tokens[i][1])
    return i + 1, name


def _alts(body: list[tuple[str, str]], i: int) -> tuple[list[list[Item]], int]:
    alts: list[list[Item]] = [[]]
    while i < len(body):
        kind, text = body[i]
        if kind == "OP" and text == "|":
            alts.append([])
            i += 1
        elif kind == "OP" and text in ")]":
            break
        elif kind == "OP" and text == "->":  # an alias: its name follows
            i += 2
        elif kind == "OP" and text == "&":  # intersection of tokens: both must match
            i += 1
        else:
            item, i = _item(body, i)
            alts[-1].append(item)
    return alts, i


def _item(body: list[tuple[str, str]], i: int) -> tuple[Item, int]:
    kind, text = body[i]
    negated = kind == "OP" and text == "~"
    if negated:  # ~/regex/: the complement, some text matches it
        i += 1
        kind, text = body[i]
    if kind == "STR":
        atom = Atom("lit")
        i += 1
        if i < len(body) and body[i] == ("OP", ".."):  # "a".."z"
            i += 2
    elif kind == "RE":
        atom = Atom("regex", text)
        i += 1
    elif kind == "NAME":
        atom = Atom("ref", text)
        i += 1
    elif kind == "JSON":
        atom = Atom("json", text)
        i += 1
    elif kind == "OP" and text in "([":
        alts, i = _alts(body, i + 1)
        if i >= len(body) or body[i][1] != {"(": ")", "[": "]"}[text]:
            raise _Unsupported(text)
        i += 1
        atom = Atom("group", alts=alts)
        if text == "[":
            return Item(atom, "?"), i
    else:
        raise _Unsupported(text)
    if negated:
        atom = Atom("other")
    return _quant(body, i, atom)


def _quant(body: list[tuple[str, str]], i: int, atom: Atom) -> tuple[Item, int]:
    if i >= len(body) or body[i][0] != "OP":
        return Item(atom), i
    text = body[i][1]
    if text in "?*+":
        return Item(atom, text), i + 1
    if text == "~":  # item ~ n, item ~ n..m
        low = int(body[i + 1][1])
        i += 2
        high = low
        if i < len(body) and body[i] == ("OP", ".."):
            high = int(body[i + 1][1])
            i += 2
        return Item(atom, (low, high)), i
    if text == "{":  # item{n}, item{n,}, item{n,m}
        low = int(body[i + 1][1])
        i += 2
        high = low
        if body[i] == ("OP", ","):
            i += 1
            if body[i][0] == "NUM":
                high = int(body[i][1])
                i += 1
        if body[i] != ("OP", "}"):
            raise _Unsupported("{")
        return Item(atom, (low, high)), i + 1
    return Item(atom), i


def json_body(text: str) -> Any:
    """A ``%json`` body as a value (``ValueError`` when it is not JSON: llguidance says so)."""
    return json.loads(text)
