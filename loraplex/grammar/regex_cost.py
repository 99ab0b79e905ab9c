"""What a regex costs the lexer before anything compiles it: its counted repetitions.

llguidance builds a counted repetition ``x{n}`` as ``n`` copies, so the work and memory of a
regex grow with its counts, and nested counts multiply: ``((a{100}){100}){100}`` is a million
copies (its first mask stalled the step and took 155 MB, and the second step failed for every
later request of it). Nested counts over variable-length parts blow up sooner: ``([a-z]{1,50}){1,50}``
fails after 16 tokens with llguidance's own limits. ``regex_cost`` finds the largest single count
and the largest product of nested counts (with the text of the part that makes it) so that
``precheck`` can refuse them by name.

The scanner reads the Rust ``regex`` syntax llguidance uses (escapes, classes with nesting,
``(?flags)``, named groups); it never raises: a pattern it cannot follow is scored as far as it
got, and llguidance reports what is malformed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_COUNT = re.compile(r"\{(\d{1,12})(,(\d{0,12}))?\}")
_BRACED_ESCAPES = frozenset("xuUpPN")  # \x{41}, \p{Greek}: braces that are not a count


@dataclass(frozen=True)
class Part:
    """A piece of the pattern: its repeat ``product`` (1 when not counted), how many counted
    repetitions nest in it (``levels``), whether a count inside its outermost one is a range
    (``ranged``: ``{1,50}``, ``{3,}``), and where it is (``start``, ``end``: a slice)."""

    product: int = 1
    levels: int = 0
    ranged: bool = False
    start: int = 0
    end: int = 0


@dataclass(frozen=True)
class RegexCost:
    largest: Part  # the single largest count (its own product: the count)
    nested: Part  # the largest product of nested counts
    nested_ranged: Part  # the same among nests with a range inside the outer count


def regex_cost(pattern: str) -> RegexCost:
    """The counted repetitions of ``pattern`` (see the module's docstring)."""
    largest = Part()
    nested = Part()
    nested_ranged = Part()
    # one frame per open group: (where it opened, the costliest part inside it so far)
    frames: list[tuple[int, Part]] = [(0, Part())]
    i, n = 0, len(pattern)
    while i < n:
        start = i
        c = pattern[i]
        if c == "(":
            header = _group_header(pattern, i)
            if header < 0:  # (?i) and the like: flags, not a group
                i = -header
                continue
            frames.append((start, Part()))
            i = header
            continue
        if c == ")":
            if len(frames) == 1:  # unbalanced: llguidance will say so
                i += 1
                continue
            opened, inside = frames.pop()
            atom = Part(inside.product, inside.levels, inside.ranged, opened, i + 1)
            i += 1
        elif c == "|":
            i += 1
            continue
        elif c == "\\":
            i = _escape_end(pattern, i)
            atom = Part(start=start, end=i)
        elif c == "[":
            i = _class_end(pattern, i)
            atom = Part(start=start, end=i)
        else:
            i += 1
            atom = Part(start=start, end=i)
        # a quantifier may follow the atom
        m = _COUNT.match(pattern, i)
        if m is not None:
            low = int(m.group(1))
            high = low if m.group(2) is None else int(m.group(3) or low)
            count = max(low, high)
            i = m.end()
            if i < n and pattern[i] in "?+":  # lazy or possessive
                i += 1
            ranged = m.group(2) is not None and (not m.group(3) or high != low)
            if count > largest.product:
                largest = Part(count, 1, ranged, atom.start, i)
            outer = Part(atom.product * max(count, 1), atom.levels + 1, atom.ranged, atom.start, i)
            if outer.levels > 1 and outer.product > nested.product:
                nested = outer
            if outer.levels > 1 and outer.ranged and outer.product > nested_ranged.product:
                nested_ranged = outer
            # seen from outside, a range anywhere in it counts
            atom = Part(outer.product, outer.levels, atom.ranged or ranged, atom.start, i)
        elif i < n and pattern[i] in "*+?":
            i += 1
            if i < n and pattern[i] in "?+":
                i += 1
            atom = Part(atom.product, atom.levels, atom.ranged, atom.start, i)
        opened, inside = frames[-1]
        if atom.product > inside.product:
            frames[-1] = (opened, atom)
    return RegexCost(largest, nested, nested_ranged)


def _group_header(pattern: str, i: int) -> int:
    """Where the content of the group opened at ``i`` starts; minus the index after it when
    it is a flag setting such as ``(?i)`` (no group)."""
    j = i + 1
    if j >= len(pattern) or pattern[j] != "?":
        return j
    k = j + 1
    while k < len(pattern):
        c = pattern[k]
        if c == ")":
            return -(k + 1)
        if c == ":" or c == ">":
            return k + 1
        if c == "<" and k + 1 < len(pattern) and pattern[k + 1] in "=!":  # look-around
            return k + 2
        k += 1
    return len(pattern)


def _escape_end(pattern: str, i: int) -> int:
    """The index after the escape at ``i`` (``\\d``, ``\\x{41}``, ``\\p{Greek}``)."""
    j = i + 2
    braced = j - 1 < len(pattern) and pattern[j - 1] in _BRACED_ESCAPES
    if braced and j < len(pattern) and pattern[j] == "{":
        close = pattern.find("}", j)
        return len(pattern) if close < 0 else close + 1
    return min(j, len(pattern))


def _class_end(pattern: str, i: int) -> int:
    """The index after the class opened at ``i`` (nested classes, escapes, ``[]...]``)."""
    depth = 0
    j = i
    n = len(pattern)
    while j < n:
        c = pattern[j]
        if c == "\\":
            j = _escape_end(pattern, j)
            continue
        if c == "[":
            if pattern.startswith("[:", j):  # [:alpha:]
                close = pattern.find(":]", j + 2)
                if close >= 0:
                    j = close + 2
                    continue
            depth += 1
            j += 1
            # a ']' right after '[' or '[^' is a literal
            if j < n and pattern[j] == "^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            continue
        if c == "]":
            depth -= 1
            j += 1
            if depth == 0:
                return j
            continue
        j += 1
    return n
