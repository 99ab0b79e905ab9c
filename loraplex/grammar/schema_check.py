"""A JSON schema's subschemas with their paths, and the two questions ``precheck`` asks of them
that llguidance answers too late or too dearly:

* **the patterns one string must match at once** (``pattern``, ``format`` and those of its
  ``allOf`` members, through ``$ref``): llguidance intersects them and checks the intersection
  for emptiness with no limit it honours (time and memory grow exponentially with the count of
  ``.*x.*`` patterns: 20 already take gigabytes; figures in docs/benchmarks.md);
* **subschemas no finite value satisfies**: a ``$ref`` cycle with nothing between its steps
  (``{"$ref": "#/$defs/a"}`` in ``a``), or a required property that needs its own object again.
  llguidance compiles them and fails at the first token with its parser state for a message.

Paths are JSON pointers from the schema's root (``/properties/a/pattern``), what a client sees.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import unquote

# keyword -> how its value holds subschemas
_ONE = (
    "additionalProperties",
    "items",
    "additionalItems",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
    "unevaluatedItems",
    "unevaluatedProperties",
)
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def subschemas(schema: Any, path: str = "") -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Every subschema object of ``schema`` (itself first) with its JSON pointer; iterative
    (a deep schema cannot overflow the stack), each object once."""
    stack: list[tuple[str, Any]] = [(path, schema)]
    while stack:
        where, node = stack.pop()
        if not isinstance(node, Mapping):
            continue
        yield where, node
        children: list[tuple[str, Any]] = []
        for key in _ONE:
            if key in node:
                value = node[key]
                if isinstance(value, list) and key == "items":  # draft 4-2019 tuples
                    children += [(f"{where}/items/{i}", v) for i, v in enumerate(value)]
                else:
                    children.append((f"{where}/{key}", value))
        for key in _LIST:
            value = node.get(key)
            if isinstance(value, list):
                children += [(f"{where}/{key}/{i}", v) for i, v in enumerate(value)]
        for key in _MAP:
            value = node.get(key)
            if isinstance(value, Mapping):
                children += [(f"{where}/{key}/{_escape(k)}", v) for k, v in value.items()]
        stack.extend(reversed(children))


def _escape(key: str) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


class Schema:
    """One schema's subschemas by path, and ``$ref`` resolution within it."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.nodes: dict[str, Mapping[str, Any]] = dict(subschemas(root))

    def target(self, node: Mapping[str, Any]) -> str | None:
        """The path ``node``'s ``$ref`` points to, when it is a subschema of this schema."""
        ref = node.get("$ref")
        if not isinstance(ref, str) or not ref.startswith("#"):
            return None
        path = unquote(ref[1:])
        return path if path in self.nodes else None

    # ---- patterns met at once ----------------------------------------------------------------

    def intersected(self, path: str) -> int:
        """How many regexes (``pattern``, ``format``) a string at ``path`` must match at once:
        its own and those of its ``allOf`` members and ``$ref`` targets, each counted once."""
        seen: set[str] = set()
        count = 0
        todo = [path]
        while todo:
            where = todo.pop()
            if where in seen:
                continue
            seen.add(where)
            node = self.nodes[where]
            count += isinstance(node.get("pattern"), str) + isinstance(node.get("format"), str)
            members = node.get("allOf")
            if isinstance(members, list):
                todo += [f"{where}/allOf/{i}" for i in range(len(members))]
            ref = self.target(node)
            if ref is not None:
                todo.append(ref)
        return count

    # ---- values that never end ---------------------------------------------------------------

    def never_ending(self) -> list[str] | None:
        """None when the root has a finite value (as far as this reading can tell); else a
        cycle of paths that need each other with nothing in between, first repeated last."""
        ends = dict.fromkeys(self.nodes, False)
        for _ in range(64):  # a least fixed point; no verdict if it has not settled
            changed = False
            for path, node in reversed(self.nodes.items()):  # leaves first: one sweep for a tree
                if not ends[path] and self._ends(path, node, ends):
                    ends[path] = changed = True
            if not changed:
                break
        else:
            return None
        if ends.get("", True):
            return None
        cycle: list[str] = []
        step: str | None = ""
        while step is not None and step not in cycle:
            cycle.append(step)
            step = self._blocker(step, self.nodes[step], ends)
        if step is None:
            return None
        return [*cycle[cycle.index(step) :], step]

    def _needs(self, path: str, node: Mapping[str, Any]) -> list[list[str]]:
        """What ``node`` needs to have a value: alternatives, each a list of subschema paths
        that must all have one. [[]]: nothing (it has a value, as far as this reading goes)."""
        needs: list[str] = []
        ref = self.target(node)
        if ref is not None:
            needs.append(ref)
        members = node.get("allOf")
        if isinstance(members, list):
            needs += [f"{path}/allOf/{i}" for i, m in enumerate(members) if isinstance(m, dict)]
        kind = node.get("type")
        if kind == "object" or kind == ["object"]:
            props = node.get("properties")
            props = props if isinstance(props, Mapping) else {}
            required = node.get("required")
            for name in required if isinstance(required, list) else ():
                if isinstance(name, str) and isinstance(props.get(name), Mapping):
                    needs.append(f"{path}/properties/{_escape(name)}")
        if kind == "array" or kind == ["array"]:
            low = node.get("minItems", 0)
            prefix = node.get("prefixItems")
            prefix = prefix if isinstance(prefix, list) else []
            if isinstance(low, int) and low > 0:
                needs += [
                    f"{path}/prefixItems/{i}"
                    for i in range(min(low, len(prefix)))
                    if isinstance(prefix[i], Mapping)
                ]
                if low > len(prefix) and isinstance(node.get("items"), Mapping):
                    needs.append(f"{path}/items")
        alts: list[list[str]] = []
        for key in ("anyOf", "oneOf"):
            options = node.get(key)
            if isinstance(options, list) and options:
                if not all(isinstance(o, Mapping) for o in options):
                    continue  # a `true` option: a value
                alts = [[*needs, f"{path}/{key}/{i}"] for i in range(len(options))]
                needs = []
                break
        return alts or [needs]

    def _ends(self, path: str, node: Mapping[str, Any], ends: dict[str, bool]) -> bool:
        return any(all(ends.get(p, True) for p in alt) for alt in self._needs(path, node))

    def _blocker(self, path: str, node: Mapping[str, Any], ends: dict[str, bool]) -> str | None:
        """A subschema that keeps ``node`` from a value (the first of its first alternative)."""
        for alt in self._needs(path, node):
            for p in alt:
                if not ends.get(p, True):
                    return p
        return None


def locate_pattern(schema: Any, regex: str) -> str | None:
    """The path of the first ``pattern`` (or ``patternProperties`` key) equal to ``regex``."""
    for path, node in subschemas(schema):
        if node.get("pattern") == regex:
            return f"{path}/pattern"
        props = node.get("patternProperties")
        if isinstance(props, Mapping) and regex in props:
            return f"{path}/patternProperties/{_escape(regex)}"
    return None
