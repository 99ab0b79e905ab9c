"""The other cases of ``python -m benchmarks.structured_suite``: regex, choice and grammar constraints
(vLLM's ``structured_outputs`` body field or its older ``guided_*`` spellings, on chat and on
completions), tool calls (``tool_choice`` required and named), ``parse()`` with a Pydantic model,
a ``json_object`` request, and requests the server must refuse with a 400.

A grammar case carries ``pattern``, a Python regex that accepts exactly the grammar's language
(the grammars are bounded, so one exists): the suite checks outputs with ``re.fullmatch``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from benchmarks.structured_suite.schemas import (
    DATE,
    EMAIL,
    Schema,
    array,
    enum,
    integer,
    number,
    obj,
    pattern,
    text,
)

ConstraintKind = Literal["regex", "choice", "grammar"]
Endpoint = Literal["chat", "completions"]
Spelling = Literal["structured_outputs", "guided"]


@dataclass(frozen=True)
class ConstraintCase:
    kind: ConstraintKind
    name: str
    prompt: str
    value: str | tuple[str, ...]  # the regex, the choices or the Lark grammar
    examples: tuple[str, ...]  # outputs written by hand that must be accepted
    pattern: str = ""  # grammar: a Python regex for the grammar's language
    max_tokens: int = 48
    endpoint: Endpoint = "chat"
    spelling: Spelling = "structured_outputs"

    def body(self) -> dict[str, Any]:
        """The request's extra body: ``{"structured_outputs": {kind: value}}`` or
        ``{"guided_<kind>": value}``."""
        value = list(self.value) if isinstance(self.value, tuple) else self.value
        if self.spelling == "guided":
            return {f"guided_{self.kind}": value}
        return {"structured_outputs": {self.kind: value}}

    def full_pattern(self) -> str:
        """The Python regex an output must match in full."""
        if self.kind == "regex":
            assert isinstance(self.value, str)
            return self.value
        if self.kind == "choice":
            return "|".join(re.escape(c) for c in self.value)
        return self.pattern


_NUM = r"[0-9]{1,3}"
_TERM = rf"(?:{_NUM}|\({_NUM}[-+*/]{_NUM}\))"

CONSTRAINT_CASES: tuple[ConstraintCase, ...] = (
    # -- regex --
    ConstraintCase(
        "regex",
        "iso_date",
        "When did the Apollo 11 landing happen? Answer with the date only, as YYYY-MM-DD.",
        r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
        ("1969-07-20",),
    ),
    ConstraintCase(
        "regex",
        "us_phone",
        "Make up a US phone number for a fictional bakery, formatted like (555) 123-4567.",
        r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}",
        ("(555) 123-4567",),
    ),
    ConstraintCase(
        "regex",
        "hex_colour",
        "Give the hex colour code of a deep sea blue.",
        r"#[0-9a-fA-F]{6}",
        ("#1A4C8B",),
        spelling="guided",
    ),
    ConstraintCase(
        "regex",
        "ipv4",
        "What is the IPv4 address of a typical home router?",
        r"((25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])",
        ("192.168.1.1", "10.0.0.254"),
    ),
    ConstraintCase(
        "regex",
        "time_24h",
        "Q: At what time does a typical office open in the morning (24-hour clock)?\nA: ",
        r"([01][0-9]|2[0-3]):[0-5][0-9]",
        ("09:00",),
        endpoint="completions",
    ),
    ConstraintCase(
        "regex",
        "semver",
        "What would the next minor release after version 2.3.7 be called?",
        r"[0-9]{1,2}\.[0-9]{1,2}\.[0-9]{1,3}",
        ("2.4.0",),
    ),
    ConstraintCase(
        "regex",
        "email",
        "Suggest a work email address for Jane Doe at example.com.",
        r"[a-z]{1,12}(\.[a-z]{1,12})?@[a-z]{2,12}\.(com|org|net)",
        ("jane.doe@example.com",),
    ),
    # -- choice --
    ConstraintCase(
        "choice",
        "sentiment",
        "Is the sentiment of 'I absolutely loved the concert!' positive, negative or neutral?",
        ("positive", "negative", "neutral"),
        ("positive",),
    ),
    ConstraintCase(
        "choice",
        "weekday",
        "Which day of the week comes after Tuesday?",
        ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"),
        ("Wednesday",),
    ),
    ConstraintCase(
        "choice",
        "yes_no",
        "Is Paris the capital of France? Answer yes or no.",
        ("yes", "no"),
        ("yes",),
        spelling="guided",
    ),
    ConstraintCase(
        "choice",
        "ticket_priority",
        "A customer says the whole checkout is down for every user. Priority?",
        ("low", "medium", "high", "urgent"),
        ("urgent",),
    ),
    ConstraintCase(
        "choice",
        "department",
        "Q: Which department handles a question about a missing refund?\nA: ",
        ("billing", "technical support", "sales", "human resources"),
        ("billing",),
        endpoint="completions",
    ),
    ConstraintCase(
        "choice",
        "language",
        "In which language is 'Guten Morgen, wie geht es dir?' written?",
        ("English", "French", "German", "Spanish", "Italian"),
        ("German",),
    ),
    # -- grammar (Lark in llguidance's dialect; every one bounded) --
    ConstraintCase(
        "grammar",
        "arithmetic",
        "Write an arithmetic expression that equals 12, using only digits, + - * / and "
        "parentheses.",
        """start: expr
expr: term | term OP term | term OP term OP term | term OP term OP term OP term
term: NUMBER | "(" NUMBER OP NUMBER ")"
OP: "+" | "-" | "*" | "/"
NUMBER: /[0-9]{1,3}/
""",
        ("3*4", "(2+4)*2", "24/2+0-0"),
        pattern=rf"{_TERM}(?:[-+*/]{_TERM}){{0,3}}",
    ),
    ConstraintCase(
        "grammar",
        "yes_no_reason",
        "Is the sun a star? Answer yes or no, then a short reason.",
        """start: verdict ", because " REASON
verdict: "yes" | "no"
REASON: /[a-z][a-z ,]{2,59}/
""",
        ("yes, because it is a ball of hot gas",),
        pattern=r"(yes|no), because [a-z][a-z ,]{2,59}",
        max_tokens=96,
        spelling="guided",
    ),
    ConstraintCase(
        "grammar",
        "csv_row",
        "Write one CSV row with a person's first name, age and home city.",
        """start: NAME "," AGE "," CITY
NAME: /[A-Z][a-z]{1,15}/
AGE: /[1-9][0-9]?/
CITY: /[A-Z][a-z]{1,15}( [A-Z][a-z]{1,15})?/
""",
        ("Alice,34,New York", "Bo,7,Oslo"),
        pattern=r"[A-Z][a-z]{1,15},[1-9][0-9]?,[A-Z][a-z]{1,15}( [A-Z][a-z]{1,15})?",
        max_tokens=64,
    ),
    ConstraintCase(
        "grammar",
        "sql_select",
        "Q: Write a SQL query that lists the name and email of every customer.\nA: ",
        """start: "SELECT " cols " FROM " TABLE ";"
cols: COL | COL ", " COL | COL ", " COL ", " COL
COL: /[a-z_]{1,16}/
TABLE: /[a-z_]{1,16}/
""",
        ("SELECT name, email FROM customers;",),
        pattern=r"SELECT [a-z_]{1,16}(, [a-z_]{1,16}){0,2} FROM [a-z_]{1,16};",
        max_tokens=64,
        endpoint="completions",
    ),
)


# ---- tools -------------------------------------------------------------------------------------


def _tool(name: str, description: str, parameters: Schema) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


TOOLS: dict[str, dict[str, Any]] = {
    t["function"]["name"]: t
    for t in (
        _tool(
            "get_weather",
            "Current weather for a city.",
            obj({"city": text(30), "unit": enum("celsius", "fahrenheit")}),
        ),
        _tool(
            "create_event",
            "Add an event to the user's calendar.",
            obj(
                {
                    "title": text(40),
                    "date": pattern(DATE),
                    "duration_minutes": integer(5, 480),
                    "attendees": array(pattern(EMAIL), 0, 3),
                }
            ),
        ),
        _tool(
            "search_products",
            "Search the shop's catalogue.",
            obj(
                {"query": text(30), "category": enum("books", "electronics", "garden", "toys")},
                {"max_price": number(0, 10000)},
            ),
        ),
        _tool(
            "convert_currency",
            "Convert an amount between currencies.",
            obj(
                {
                    "amount": number(0, 1000000),
                    "from_currency": pattern(r"^[A-Z]{3}$"),
                    "to_currency": pattern(r"^[A-Z]{3}$"),
                }
            ),
        ),
        _tool(
            "lookup_order",
            "Look up an order by its id.",
            obj({"order_id": pattern(r"^[A-Z]{2}[0-9]{6}$")}),
        ),
    )
}

TOOL_EXAMPLES: dict[str, dict[str, Any]] = {  # arguments written by hand, one per tool
    "get_weather": {"city": "Madrid", "unit": "celsius"},
    "create_event": {
        "title": "Dentist",
        "date": "2024-05-02",
        "duration_minutes": 30,
        "attendees": ["ana@clinic.com"],
    },
    "search_products": {"query": "garden hose", "category": "garden", "max_price": 40},
    "convert_currency": {"amount": 100, "from_currency": "USD", "to_currency": "EUR"},
    "lookup_order": {"order_id": "AB123456"},
}


@dataclass(frozen=True)
class ToolCase:
    name: str
    messages: tuple[dict[str, Any], ...]
    tools: tuple[str, ...]  # names in TOOLS
    tool_choice: str  # "required" or a function's name
    parallel_tool_calls: bool | None = None  # None: not sent
    max_tokens: int = 256

    def tool_choice_param(self) -> str | dict[str, Any]:
        if self.tool_choice == "required":
            return "required"
        return {"type": "function", "function": {"name": self.tool_choice}}


def _user(text: str) -> tuple[dict[str, Any], ...]:
    return ({"role": "user", "content": text},)


TOOL_CASES: tuple[ToolCase, ...] = (
    ToolCase(
        "weather_required",
        _user("What's the weather like in Madrid right now, in celsius?"),
        ("get_weather", "search_products", "lookup_order"),
        "required",
    ),
    ToolCase(
        "order_required_single",
        _user("Where is my order AB123456?"),
        ("get_weather", "lookup_order", "convert_currency"),
        "required",
        parallel_tool_calls=False,
    ),
    ToolCase(
        "event_named",
        _user("Put a 30 minute dentist appointment in my calendar for 2024-05-02."),
        tuple(TOOLS),
        "create_event",
    ),
    ToolCase(
        "currency_named",
        _user("How much is 250 US dollars in Japanese yen?"),
        ("convert_currency", "get_weather"),
        "convert_currency",
    ),
    ToolCase(
        "products_named",
        _user("Find me a toy robot for less than 30 dollars."),
        ("search_products", "lookup_order"),
        "search_products",
    ),
    ToolCase(
        "products_required",
        _user("I need a new book about gardening."),
        tuple(TOOLS),
        "required",
        parallel_tool_calls=True,
        max_tokens=400,
    ),
    ToolCase(
        "weather_after_tool_result",
        (
            {"role": "user", "content": "What's the weather in Lyon, and then in Nice?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_lyon",
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": '{"city": "Lyon", "unit": "celsius"}',
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_lyon", "content": '{"temperature_c": 18}'},
        ),
        ("get_weather",),
        "get_weather",
    ),
)


# ---- parse(), json_object and refusals ---------------------------------------------------------


class CityFacts(BaseModel):
    model_config = ConfigDict(extra="forbid")

    city: str = Field(max_length=30)
    country_code: str = Field(pattern=r"^[A-Z]{2}$")
    population_millions: float = Field(ge=0, le=50)
    landmarks: list[Annotated[str, Field(max_length=30)]] = Field(min_length=1, max_length=3)


class Checklist(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task: str = Field(max_length=40)
    steps: list[Annotated[str, Field(max_length=40)]] = Field(min_length=1, max_length=4)
    difficulty: Literal["easy", "medium", "hard"]


@dataclass(frozen=True)
class ParseCase:
    name: str
    prompt: str
    model: type[BaseModel]
    example: dict[str, Any]
    max_tokens: int = 400


PARSE_CASES: tuple[ParseCase, ...] = (
    ParseCase(
        "city_facts",
        "Give me a few facts about Lisbon.",
        CityFacts,
        {
            "city": "Lisbon",
            "country_code": "PT",
            "population_millions": 0.55,
            "landmarks": ["Belem Tower"],
        },
    ),
    ParseCase(
        "checklist",
        "Make a short checklist for changing a bicycle tyre.",
        Checklist,
        {"task": "Change a tyre", "steps": ["Remove the wheel"], "difficulty": "easy"},
    ),
)


@dataclass(frozen=True)
class JsonObjectCase:
    name: str
    prompt: str
    max_tokens: int = 256


JSON_OBJECT_CASES: tuple[JsonObjectCase, ...] = (
    JsonObjectCase(
        "user_profile",
        'Reply with a JSON object with the keys "name" and "age" for a 30-year-old called Ada.',
    ),
)


@dataclass(frozen=True)
class RefusalCase:
    """A request the server must answer with a 400 (before the engine sees it)."""

    name: str
    create_args: dict[str, Any] = field(default_factory=dict)  # for chat.completions.create
    mentions: tuple[str, ...] = ()  # what the error's message must name


REFUSAL_CASES: tuple[RefusalCase, ...] = (
    RefusalCase(
        "invalid_schema",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "broken",
                    "schema": {"type": "object", "properties": {"n": {"type": "integr"}}},
                },
            }
        },
        ("integr",),
    ),
    RefusalCase(
        "invalid_regex", {"extra_body": {"structured_outputs": {"regex": "([a-z]+"}}}, ("regex",)
    ),
    RefusalCase(
        "two_constraints",
        {"extra_body": {"structured_outputs": {"regex": "[a-z]+", "choice": ["a", "b"]}}},
        ("regex", "choice"),
    ),
    RefusalCase(
        "unknown_tool",
        {
            "tools": [TOOLS["get_weather"]],
            "tool_choice": {"type": "function", "function": {"name": "launch_rocket"}},
        },
        ("launch_rocket", "get_weather"),
    ),
)
