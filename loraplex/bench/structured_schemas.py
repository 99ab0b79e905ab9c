"""The JSON-schema corpus of ``loraplex bench structured-suite``: realistic schemas (extraction,
classification, forms), each with the user prompt that asks for it, a ``max_tokens`` and
hand-written instances that validate.

Every schema is bounded: strings carry ``maxLength``, an anchored ``pattern``, an ``enum`` or a
``const``; arrays carry ``maxItems``; objects are closed (``additionalProperties: false``). So
``longest_output`` can say how many characters the longest compact instance has, and a case's
``max_tokens`` covers it at one token per character (a token is at least one character). Numbers
count ``NUMBER_CHARS`` and free whitespace between JSON tokens is not counted: both are bounded
by the engine (fraction digits, whitespace runs) and are paid from the slack, since real text
runs several characters to a token.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

Schema = dict[str, Any]
# The regex parser (``re._parser`` from 3.11, ``sre_parse`` before): getwidth() bounds a pattern.
_parser: Any = importlib.import_module("re._parser" if sys.version_info >= (3, 11) else "sre_parse")
NUMBER_CHARS = 24  # a JSON number without digit bounds: sign, digits, fraction, exponent


@dataclass(frozen=True)
class SchemaCase:
    name: str
    prompt: str
    schema: Schema
    examples: tuple[Any, ...]  # instances written by hand; each validates against the schema
    max_tokens: int = 256


# ---- schema builders (plain dicts; they only shorten the corpus) ------------------------------


def text(max_length: int, min_length: int = 1) -> Schema:
    return {"type": "string", "minLength": min_length, "maxLength": max_length}


def pattern(regex: str) -> Schema:
    return {"type": "string", "pattern": regex}


def integer(minimum: int, maximum: int) -> Schema:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


def number(minimum: float, maximum: float) -> Schema:
    return {"type": "number", "minimum": minimum, "maximum": maximum}


def enum(*values: Any) -> Schema:
    return {"type": "string", "enum": list(values)}


def boolean() -> Schema:
    return {"type": "boolean"}


def array(items: Schema, min_items: int, max_items: int) -> Schema:
    return {"type": "array", "items": items, "minItems": min_items, "maxItems": max_items}


def obj(properties: Mapping[str, Schema], optional: Mapping[str, Schema] | None = None) -> Schema:
    """A closed object: ``properties`` required, ``optional`` not."""
    return {
        "type": "object",
        "properties": {**properties, **(optional or {})},
        "required": list(properties),
        "additionalProperties": False,
    }


def nullable(schema: Schema) -> Schema:
    """``schema`` or null: a type list for a scalar, ``anyOf`` with null for an object or ref."""
    if "$ref" in schema or schema.get("type") in ("object", "array"):
        return {"anyOf": [schema, {"type": "null"}]}
    out = {**schema, "type": [schema["type"], "null"]}
    if "enum" in out:
        out["enum"] = [*out["enum"], None]
    return out


def ref(name: str) -> Schema:
    return {"$ref": f"#/$defs/{name}"}


DATE = r"^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$"
TIME = r"^([01][0-9]|2[0-3]):[0-5][0-9]$"
EMAIL = r"^[a-z0-9._]{1,20}@[a-z0-9]{1,15}\.[a-z]{2,4}$"
PHONE = r"^\+?[0-9]{1,3}[ -][0-9]{3}[ -][0-9]{3,4}[ -]?[0-9]{0,4}$"
IPV4 = r"^((25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])$"
CURRENCY = enum("USD", "EUR", "GBP", "JPY")


# ---- what a schema exercises, and its longest output -------------------------------------------

FEATURES = (
    "nested",  # an object inside an object (or inside an array)
    "enum",
    "array_bounds",  # minItems / maxItems
    "number_range",  # minimum / maximum on a number or an integer
    "pattern",
    "lengths",  # minLength / maxLength
    "anyOf",
    "nullable",  # a type list with "null", or anyOf with {"type": "null"}
    "ref",  # $ref into $defs
    "required",
    "closed",  # additionalProperties: false
)


def features(schema: Schema) -> set[str]:
    """The keywords of ``FEATURES`` that ``schema`` (with its ``$defs``) uses."""
    found: set[str] = set()

    def walk(s: Any, inside_object: bool) -> None:
        if not isinstance(s, dict):
            return
        types = s.get("type")
        types = types if isinstance(types, list) else [types]
        if inside_object and ("object" in types or "$ref" in s):
            found.add("nested")
        checks = {
            "enum": "enum" in s,
            "array_bounds": "minItems" in s or "maxItems" in s,
            "number_range": bool({"minimum", "maximum"} & s.keys()),
            "pattern": "pattern" in s,
            "lengths": "minLength" in s or "maxLength" in s,
            "anyOf": "anyOf" in s,
            "nullable": "null" in types or any(b.get("type") == "null" for b in s.get("anyOf", ())),
            "ref": "$ref" in s,
            "required": bool(s.get("required")),
            "closed": s.get("additionalProperties") is False,
        }
        found.update(k for k, v in checks.items() if v)
        here = inside_object or "object" in types or "array" in types
        for child in s.get("properties", {}).values():
            walk(child, True)
        for key in ("items", "$defs"):
            value = s.get(key)
            for child in value.values() if key == "$defs" and value else [value]:
                walk(child, here if key == "items" else False)
        for branch in s.get("anyOf", ()):
            walk(branch, inside_object)

    walk(schema, False)
    return found


class UnboundedSchema(ValueError):
    """A schema whose output has no length bound (a string or array without one)."""


def longest_output(schema: Schema) -> int:
    """The characters of the longest compact JSON instance of ``schema`` (every optional
    property present); ``UnboundedSchema`` where a string or an array has no bound."""
    defs = schema.get("$defs", {})

    def size(s: Schema, where: str) -> int:
        if "$ref" in s:
            return size(defs[s["$ref"].removeprefix("#/$defs/")], s["$ref"])
        if "const" in s:
            return len(json.dumps(s["const"]))
        if "enum" in s:
            return max(len(json.dumps(v)) for v in s["enum"])
        if "anyOf" in s:
            return max(size(b, where) for b in s["anyOf"])
        types = s["type"] if isinstance(s["type"], list) else [s["type"]]
        return max(scalar(s, t, where) for t in types)

    def scalar(s: Schema, t: str, where: str) -> int:
        if t == "string":
            if "maxLength" in s:
                return int(s["maxLength"]) + 2
            if "pattern" in s:
                width = _parser.parse(s["pattern"]).getwidth()[1]
                if width < 10_000:
                    return int(width) + 2
            raise UnboundedSchema(f"{where}: a string without maxLength or a bounded pattern")
        if t == "integer":
            return max(len(str(int(s.get(k, 10**18)))) for k in ("minimum", "maximum"))
        if t == "number":
            return NUMBER_CHARS
        if t == "boolean":
            return 5
        if t == "null":
            return 4
        if t == "array":
            if "maxItems" not in s:
                raise UnboundedSchema(f"{where}: an array without maxItems")
            n = int(s["maxItems"])
            return 2 + n * size(s["items"], f"{where}[]") + max(n - 1, 0)
        if t == "object":
            props = s.get("properties", {})
            if s.get("additionalProperties") is not False:
                raise UnboundedSchema(f"{where}: an object open to more properties")
            parts = [len(json.dumps(k)) + 1 + size(v, f"{where}.{k}") for k, v in props.items()]
            return 2 + sum(parts) + max(len(parts) - 1, 0)
        raise UnboundedSchema(f"{where}: type {t!r}")

    return size(schema, "$")


# ---- the corpus --------------------------------------------------------------------------------

_ADDRESS = obj(
    {
        "street": text(50),
        "city": text(30),
        "postal_code": pattern(r"^[0-9]{5}$"),
        "country": pattern(r"^[A-Z]{2}$"),
    }
)
_PERSON = obj({"name": text(40), "phone": pattern(PHONE)})
_AIRPORT = obj({"code": pattern(r"^[A-Z]{3}$"), "city": text(30)})
_AUTHOR = obj({"name": text(30), "affiliation": nullable(text(30))})

SCHEMA_CASES: tuple[SchemaCase, ...] = (
    # -- extraction --
    SchemaCase(
        "invoice",
        "Extract the invoice as JSON. Invoice INV-2024-0042 from Acme Tools Ltd, dated "
        "2024-03-15, in USD: 3 hammers at 12.50 each and 1 toolbox at 45.00. Total 82.50.",
        {
            **obj(
                {
                    "invoice_number": pattern(r"^INV-[0-9]{4}-[0-9]{4}$"),
                    "vendor": text(30),
                    "date": pattern(DATE),
                    "currency": CURRENCY,
                    "line_items": array(
                        obj(
                            {
                                "description": text(24),
                                "quantity": integer(1, 1000),
                                "unit_price": number(0, 100000),
                            }
                        ),
                        1,
                        3,
                    ),
                    "total": number(0, 1000000),
                }
            )
        },
        (
            {
                "invoice_number": "INV-2024-0042",
                "vendor": "Acme Tools Ltd",
                "date": "2024-03-15",
                "currency": "USD",
                "line_items": [
                    {"description": "hammer", "quantity": 3, "unit_price": 12.5},
                    {"description": "toolbox", "quantity": 1, "unit_price": 45},
                ],
                "total": 82.5,
            },
        ),
        max_tokens=512,
    ),
    SchemaCase(
        "contact_card",
        "Make a contact card from this email signature: 'Maria Lopez, Head of Sales, Brightwave "
        "Inc. maria.lopez@brightwave.com +1 415 555 0199'.",
        obj(
            {
                "name": text(40),
                "email": pattern(EMAIL),
                "phone": nullable(pattern(PHONE)),
                "company": nullable(text(40)),
            },
            {"title": text(30)},
        ),
        (
            {
                "name": "Maria Lopez",
                "email": "maria.lopez@brightwave.com",
                "phone": "+1 415 555 0199",
                "company": "Brightwave Inc.",
                "title": "Head of Sales",
            },
            {"name": "Maria Lopez", "email": "m@b.io", "phone": None, "company": None},
        ),
        max_tokens=300,
    ),
    SchemaCase(
        "meeting",
        "Turn this into a calendar entry: 'Quarterly planning with Ana, Ben and Chloe on "
        "2024-06-03 at 14:30 for 90 minutes in room B2.'",
        obj(
            {
                "title": text(50),
                "date": pattern(DATE),
                "start_time": pattern(TIME),
                "duration_minutes": integer(5, 480),
                "attendees": array(text(30), 1, 5),
                "location": {
                    "anyOf": [
                        obj({"room": text(20)}),
                        obj(
                            {
                                "video_url": pattern(
                                    r"^https://[a-z]{3,12}\.[a-z]{2,3}/[a-z0-9]{1,12}$"
                                )
                            }
                        ),
                    ]
                },
            }
        ),
        (
            {
                "title": "Quarterly planning",
                "date": "2024-06-03",
                "start_time": "14:30",
                "duration_minutes": 90,
                "attendees": ["Ana", "Ben", "Chloe"],
                "location": {"room": "B2"},
            },
            {
                "title": "Sync",
                "date": "2024-06-04",
                "start_time": "09:00",
                "duration_minutes": 15,
                "attendees": ["Ana"],
                "location": {"video_url": "https://meet.io/abc123"},
            },
        ),
        max_tokens=400,
    ),
    SchemaCase(
        "postal_address",
        "Parse this address: 'Apt 4B, 221 Baker Street, Springfield 62704, US'.",
        obj(
            {
                "street": text(50),
                "unit": nullable(text(10)),
                "city": text(30),
                "postal_code": pattern(r"^[0-9]{5}$"),
                "country_code": pattern(r"^[A-Z]{2}$"),
            }
        ),
        (
            {
                "street": "221 Baker Street",
                "unit": "Apt 4B",
                "city": "Springfield",
                "postal_code": "62704",
                "country_code": "US",
            },
        ),
        max_tokens=250,
    ),
    SchemaCase(
        "product_listing",
        "Write a product listing for a blue ceramic coffee mug, SKU MG1024, 350 ml, 9.99 USD, "
        "in stock, 8 cm wide, 10 cm high and 8 cm deep.",
        obj(
            {
                "sku": pattern(r"^[A-Z]{2}[0-9]{4}$"),
                "title": text(60),
                "price": number(0, 10000),
                "currency": CURRENCY,
                "in_stock": boolean(),
                "tags": array(text(15), 0, 4),
                "dimensions_cm": obj(
                    {"width": number(0, 500), "height": number(0, 500), "depth": number(0, 500)}
                ),
            }
        ),
        (
            {
                "sku": "MG1024",
                "title": "Blue ceramic coffee mug, 350 ml",
                "price": 9.99,
                "currency": "USD",
                "in_stock": True,
                "tags": ["mug", "kitchen"],
                "dimensions_cm": {"width": 8, "height": 10, "depth": 8},
            },
        ),
        max_tokens=400,
    ),
    SchemaCase(
        "flight_booking",
        "Book this: two passengers flying economy from Lisbon (LIS) to Berlin (BER) on 2024-09-12.",
        {
            "$defs": {"airport": _AIRPORT},
            **obj(
                {
                    "origin": ref("airport"),
                    "destination": ref("airport"),
                    "date": pattern(DATE),
                    "passengers": integer(1, 9),
                    "cabin": enum("economy", "premium_economy", "business", "first"),
                }
            ),
        },
        (
            {
                "origin": {"code": "LIS", "city": "Lisbon"},
                "destination": {"code": "BER", "city": "Berlin"},
                "date": "2024-09-12",
                "passengers": 2,
                "cabin": "economy",
            },
        ),
        max_tokens=300,
    ),
    SchemaCase(
        "order_addresses",
        "Record the order: ship 2 lamps to 10 Elm Road, Dayton 45402, US; bill the same "
        "address. Order number ORD-55120.",
        {
            "$defs": {"address": _ADDRESS},
            **obj(
                {
                    "order_id": pattern(r"^ORD-[0-9]{5}$"),
                    "billing": ref("address"),
                    "shipping": nullable(ref("address")),
                    "items": integer(1, 100),
                }
            ),
        },
        (
            {
                "order_id": "ORD-55120",
                "billing": {
                    "street": "10 Elm Road",
                    "city": "Dayton",
                    "postal_code": "45402",
                    "country": "US",
                },
                "shipping": None,
                "items": 2,
            },
        ),
        max_tokens=400,
    ),
    SchemaCase(
        "employee_record",
        "Create the HR record: John Smith, employee E10442, joins Engineering on 2024-02-01 "
        "with a salary of 98000; his manager is E10001.",
        obj(
            {
                "employee_id": pattern(r"^E[0-9]{5}$"),
                "name": obj({"first": text(20), "last": text(20)}),
                "department": enum("engineering", "sales", "finance", "hr", "operations"),
                "salary": integer(20000, 500000),
                "manager_id": nullable(pattern(r"^E[0-9]{5}$")),
                "start_date": pattern(DATE),
            }
        ),
        (
            {
                "employee_id": "E10442",
                "name": {"first": "John", "last": "Smith"},
                "department": "engineering",
                "salary": 98000,
                "manager_id": "E10001",
                "start_date": "2024-02-01",
            },
        ),
        max_tokens=300,
    ),
    SchemaCase(
        "book_metadata",
        "Catalogue this book: 'The Silent River' by Ana Costa, ISBN 9781234567897, published "
        "2019, a mystery novel, book 2 of the River series.",
        obj(
            {
                "title": text(50),
                "authors": array(text(30), 1, 3),
                "isbn": pattern(r"^97[89][0-9]{10}$"),
                "published_year": integer(1450, 2030),
                "genres": array(enum("mystery", "romance", "fantasy", "science", "history"), 1, 3),
                "series": nullable(obj({"name": text(30), "number": integer(1, 50)})),
            }
        ),
        (
            {
                "title": "The Silent River",
                "authors": ["Ana Costa"],
                "isbn": "9781234567897",
                "published_year": 2019,
                "genres": ["mystery"],
                "series": {"name": "River", "number": 2},
            },
        ),
        max_tokens=350,
    ),
    SchemaCase(
        "research_paper",
        "Extract the citation: 'Fast Adapters for Small Models' by Lee Wong (MIT) and Sara "
        "Iqbal, NeurIPS 2023, keywords: LoRA, serving.",
        {
            "$defs": {"author": _AUTHOR},
            **obj(
                {
                    "title": text(50),
                    "authors": array(ref("author"), 1, 3),
                    "year": integer(1900, 2030),
                    "venue": text(24),
                    "keywords": array(text(16), 1, 3),
                }
            ),
        },
        (
            {
                "title": "Fast Adapters for Small Models",
                "authors": [
                    {"name": "Lee Wong", "affiliation": "MIT"},
                    {"name": "Sara Iqbal", "affiliation": None},
                ],
                "year": 2023,
                "venue": "NeurIPS",
                "keywords": ["LoRA", "serving"],
            },
        ),
        max_tokens=512,
    ),
    SchemaCase(
        "shipping_label",
        "Make a shipping label: UPS tracking 1Z999AA10123456784, 2.5 kg, from Tom Reed "
        "(+1 212 555 0101) to Eva Park (+1 312 555 0188).",
        {
            "$defs": {"person": _PERSON},
            **obj(
                {
                    "tracking": pattern(r"^1Z[A-Z0-9]{16}$"),
                    "carrier": enum("ups", "fedex", "dhl", "usps"),
                    "weight_kg": number(0, 70),
                    "sender": ref("person"),
                    "recipient": ref("person"),
                }
            ),
        },
        (
            {
                "tracking": "1Z999AA10123456784",
                "carrier": "ups",
                "weight_kg": 2.5,
                "sender": {"name": "Tom Reed", "phone": "+1 212 555 0101"},
                "recipient": {"name": "Eva Park", "phone": "+1 312 555 0188"},
            },
        ),
        max_tokens=350,
    ),
    SchemaCase(
        "recipe",
        "Give me a simple pancake recipe for 4 people as JSON.",
        obj(
            {
                "title": text(40),
                "servings": integer(1, 12),
                "prep_minutes": integer(0, 240),
                "vegetarian": boolean(),
                "ingredients": array(
                    obj(
                        {
                            "name": text(16),
                            "amount": number(0, 1000),
                            "unit": enum("g", "ml", "cup", "tbsp", "tsp", "piece"),
                        }
                    ),
                    2,
                    4,
                ),
            }
        ),
        (
            {
                "title": "Pancakes",
                "servings": 4,
                "prep_minutes": 20,
                "vegetarian": True,
                "ingredients": [
                    {"name": "flour", "amount": 200, "unit": "g"},
                    {"name": "milk", "amount": 300, "unit": "ml"},
                    {"name": "egg", "amount": 2, "unit": "piece"},
                ],
            },
        ),
        max_tokens=512,
    ),
    SchemaCase(
        "job_posting",
        "Structure this job ad: 'Backend engineer at Nimbus, Berlin or remote, full time, "
        "60000 to 80000 EUR, Python and SQL.'",
        obj(
            {
                "title": text(40),
                "company": text(30),
                "location": obj({"city": text(30), "remote": boolean()}),
                "employment_type": enum("full_time", "part_time", "contract", "internship"),
                "salary": obj({"min": integer(0, 1000000), "max": integer(0, 1000000)}),
                "skills": array(text(20), 1, 4),
            }
        ),
        (
            {
                "title": "Backend engineer",
                "company": "Nimbus",
                "location": {"city": "Berlin", "remote": True},
                "employment_type": "full_time",
                "salary": {"min": 60000, "max": 80000},
                "skills": ["Python", "SQL"],
            },
        ),
        max_tokens=350,
    ),
    SchemaCase(
        "nutrition_label",
        "Nutrition facts for one 30 g serving of granola: 130 kcal, 3 g protein, 20 g carbs, "
        "5 g fat; contains nuts and gluten.",
        obj(
            {
                "serving_size_g": integer(1, 1000),
                "calories": integer(0, 5000),
                "macros_g": obj(
                    {"protein": number(0, 500), "carbs": number(0, 500), "fat": number(0, 500)}
                ),
                "allergens": array(enum("nuts", "gluten", "dairy", "soy", "eggs"), 0, 4),
            }
        ),
        (
            {
                "serving_size_g": 30,
                "calories": 130,
                "macros_g": {"protein": 3, "carbs": 20, "fat": 5},
                "allergens": ["nuts", "gluten"],
            },
        ),
        max_tokens=300,
    ),
    SchemaCase(
        "weather_report",
        "Report the weather in Oslo: 4.5 degrees C, light snow, 80 % humidity, wind 12 km/h "
        "from the north.",
        obj(
            {
                "city": text(30),
                "temperature_c": number(-60, 60),
                "condition": enum("sunny", "cloudy", "rain", "snow", "fog", "storm"),
                "humidity_percent": integer(0, 100),
                "wind": obj(
                    {
                        "speed_kmh": number(0, 300),
                        "direction": enum("N", "NE", "E", "SE", "S", "SW", "W", "NW"),
                    }
                ),
            }
        ),
        (
            {
                "city": "Oslo",
                "temperature_c": 4.5,
                "condition": "snow",
                "humidity_percent": 80,
                "wind": {"speed_kmh": 12, "direction": "N"},
            },
        ),
        max_tokens=300,
    ),
    # -- classification --
    SchemaCase(
        "sentiment",
        "Classify the sentiment of this review: 'The battery lasts forever, but the screen "
        "scratches far too easily.'",
        obj(
            {
                "sentiment": enum("positive", "negative", "neutral", "mixed"),
                "confidence": number(0, 1),
            }
        ),
        ({"sentiment": "mixed", "confidence": 0.8},),
        max_tokens=200,
    ),
    SchemaCase(
        "topic_labels",
        "Label the topics of this headline: 'Tech giants lobby parliament over new AI rules'.",
        obj(
            {
                "labels": array(
                    enum("politics", "sports", "technology", "business", "health", "science"),
                    1,
                    3,
                ),
                "primary": enum(
                    "politics", "sports", "technology", "business", "health", "science"
                ),
            }
        ),
        ({"labels": ["technology", "politics"], "primary": "technology"},),
        max_tokens=200,
    ),
    SchemaCase(
        "intent",
        "Classify the request and fill the slots: 'Can you book me a flight to Rome on "
        "2024-07-19?'",
        obj(
            {
                "intent": enum(
                    "book_flight", "cancel_booking", "check_status", "talk_to_agent", "other"
                ),
                "slots": obj({"destination": nullable(text(30)), "date": nullable(pattern(DATE))}),
                "confidence": number(0, 1),
            }
        ),
        (
            {
                "intent": "book_flight",
                "slots": {"destination": "Rome", "date": "2024-07-19"},
                "confidence": 0.95,
            },
        ),
        max_tokens=250,
    ),
    SchemaCase(
        "language_detection",
        "Which language is this text in? 'Le chat dort sur le canapé depuis ce matin.'",
        obj(
            {
                "language": enum("en", "fr", "de", "es", "it", "pt"),
                "script": enum("latin", "cyrillic", "greek", "arabic"),
                "confidence": number(0, 1),
            }
        ),
        ({"language": "fr", "script": "latin", "confidence": 0.99},),
        max_tokens=200,
    ),
    SchemaCase(
        "spam_filter",
        "Is this email spam? 'CONGRATULATIONS!!! You won a free cruise, click here to claim now.'",
        obj(
            {
                "is_spam": boolean(),
                "spam_score": number(0, 1),
                "reasons": array(
                    enum("prize_claim", "urgency", "suspicious_link", "all_caps", "none"), 0, 3
                ),
            }
        ),
        ({"is_spam": True, "spam_score": 0.97, "reasons": ["prize_claim", "urgency"]},),
        max_tokens=200,
    ),
    SchemaCase(
        "transaction_category",
        "Categorise this card transaction: 'NETFLIX.COM 15.49 monthly'.",
        obj(
            {
                "merchant": text(30),
                "amount": number(-100000, 100000),
                "category": enum(
                    "groceries", "entertainment", "transport", "utilities", "dining", "other"
                ),
                "is_recurring": boolean(),
                "confidence": number(0, 1),
            }
        ),
        (
            {
                "merchant": "Netflix",
                "amount": 15.49,
                "category": "entertainment",
                "is_recurring": True,
                "confidence": 0.9,
            },
        ),
        max_tokens=250,
    ),
    SchemaCase(
        "support_ticket",
        "Triage this ticket from customer CUS-004512: 'Since updating to version 2.4.1 the "
        "Photon app crashes whenever I open settings.'",
        obj(
            {
                "customer_id": pattern(r"^CUS-[0-9]{6}$"),
                "category": enum("bug", "billing", "feature_request", "account", "other"),
                "priority": enum("low", "medium", "high", "urgent"),
                "summary": text(80, min_length=10),
                "product": obj(
                    {"name": text(30), "version": pattern(r"^[0-9]{1,2}\.[0-9]{1,2}\.[0-9]{1,3}$")}
                ),
            }
        ),
        (
            {
                "customer_id": "CUS-004512",
                "category": "bug",
                "priority": "high",
                "summary": "App crashes when opening settings",
                "product": {"name": "Photon", "version": "2.4.1"},
            },
        ),
        max_tokens=300,
    ),
    SchemaCase(
        "movie_review",
        "Summarise your review of the film 'Inception' (2010) as JSON.",
        obj(
            {
                "title": text(50),
                "year": integer(1900, 2030),
                "rating": number(0, 10),
                "verdict": enum("recommend", "skip"),
                "pros": array(text(30), 0, 2),
                "cons": array(text(30), 0, 2),
            }
        ),
        (
            {
                "title": "Inception",
                "year": 2010,
                "rating": 9,
                "verdict": "recommend",
                "pros": ["clever plot"],
                "cons": [],
            },
        ),
        max_tokens=400,
    ),
    SchemaCase(
        "product_comparison",
        "Compare phone A (great camera, weak battery) with phone B (average camera, two-day "
        "battery) for a traveller.",
        obj(
            {
                "winner": enum("a", "b", "tie"),
                "scores": obj({"a": number(0, 10), "b": number(0, 10)}),
                "reason": text(80),
            }
        ),
        (
            {
                "winner": "b",
                "scores": {"a": 6.5, "b": 8},
                "reason": "Battery life matters most when travelling",
            },
        ),
        max_tokens=250,
    ),
    # -- forms --
    SchemaCase(
        "signup_form",
        "Fill the signup form for a new user: username jdoe_92, display name Jane Doe, 31 "
        "years old, from Canada, wants the newsletter, referral code AB1234.",
        obj(
            {
                "username": pattern(r"^[a-z][a-z0-9_]{2,15}$"),
                "display_name": text(30),
                "age": integer(13, 120),
                "country": pattern(r"^[A-Z]{2}$"),
                "newsletter": boolean(),
                "referral_code": nullable(pattern(r"^[A-Z]{2}[0-9]{4}$")),
            }
        ),
        (
            {
                "username": "jdoe_92",
                "display_name": "Jane Doe",
                "age": 31,
                "country": "CA",
                "newsletter": True,
                "referral_code": "AB1234",
            },
        ),
        max_tokens=250,
    ),
    SchemaCase(
        "payment",
        "Record a payment of 120.00 EUR by card ending 4242, expiring 09/27.",
        obj(
            {
                "amount": number(0, 1000000),
                "currency": CURRENCY,
                "method": {
                    "anyOf": [
                        obj(
                            {
                                "type": {"const": "card"},
                                "last4": pattern(r"^[0-9]{4}$"),
                                "expiry": pattern(r"^(0[1-9]|1[0-2])/[0-9]{2}$"),
                            }
                        ),
                        obj(
                            {
                                "type": {"const": "bank_transfer"},
                                "iban": pattern(r"^[A-Z]{2}[0-9]{2}[A-Z0-9]{10,20}$"),
                            }
                        ),
                        obj({"type": {"const": "paypal"}, "email": pattern(EMAIL)}),
                    ]
                },
            }
        ),
        (
            {
                "amount": 120,
                "currency": "EUR",
                "method": {"type": "card", "last4": "4242", "expiry": "09/27"},
            },
            {
                "amount": 5,
                "currency": "GBP",
                "method": {"type": "bank_transfer", "iban": "GB29NWBK60161331926819"},
            },
        ),
        max_tokens=250,
    ),
    SchemaCase(
        "event_rsvp",
        "RSVP for Priya Shah: she is coming with 2 guests and eats vegetarian.",
        obj(
            {
                "name": text(40),
                "attending": enum("yes", "no", "maybe"),
                "guests": integer(0, 5),
                "dietary": nullable(enum("vegetarian", "vegan", "gluten_free", "halal")),
            }
        ),
        (
            {"name": "Priya Shah", "attending": "yes", "guests": 2, "dietary": "vegetarian"},
            {"name": "Sam", "attending": "no", "guests": 0, "dietary": None},
        ),
        max_tokens=200,
    ),
    SchemaCase(
        "server_config",
        "Write the config for web server web-01 on port 8443 with TLS, at most 500 "
        "connections, log level info, allowing 10.0.0.5 and 192.168.1.20.",
        obj(
            {
                "hostname": pattern(r"^[a-z][a-z0-9-]{1,30}$"),
                "port": integer(1, 65535),
                "tls": boolean(),
                "max_connections": integer(1, 10000),
                "log_level": enum("debug", "info", "warning", "error"),
                "allowed_ips": array(pattern(IPV4), 0, 4),
            }
        ),
        (
            {
                "hostname": "web-01",
                "port": 8443,
                "tls": True,
                "max_connections": 500,
                "log_level": "info",
                "allowed_ips": ["10.0.0.5", "192.168.1.20"],
            },
        ),
        max_tokens=300,
    ),
    SchemaCase(
        "survey_response",
        "Record this survey answer from respondent 8812: satisfaction 4 of 5, NPS 9, would "
        "recommend, comment 'Fast delivery'.",
        obj(
            {
                "respondent_id": integer(1, 999999),
                "satisfaction": integer(1, 5),
                "nps": integer(0, 10),
                "would_recommend": boolean(),
                "comment": nullable(text(80)),
            }
        ),
        (
            {
                "respondent_id": 8812,
                "satisfaction": 4,
                "nps": 9,
                "would_recommend": True,
                "comment": "Fast delivery",
            },
        ),
        max_tokens=250,
    ),
    SchemaCase(
        "car_listing",
        "List a used car: 2018 Toyota Corolla, 64000 km, petrol, 14500 USD, with air "
        "conditioning and a rear camera.",
        obj(
            {
                "make": enum("toyota", "ford", "volkswagen", "honda", "bmw", "other"),
                "model": text(20),
                "year": integer(1990, 2026),
                "mileage_km": integer(0, 500000),
                "price_usd": integer(0, 200000),
                "fuel": enum("petrol", "diesel", "hybrid", "electric"),
                "features": array(text(20), 0, 4),
            }
        ),
        (
            {
                "make": "toyota",
                "model": "Corolla",
                "year": 2018,
                "mileage_km": 64000,
                "price_usd": 14500,
                "fuel": "petrol",
                "features": ["air conditioning", "rear camera"],
            },
        ),
        max_tokens=300,
    ),
    SchemaCase(
        "availability",
        "I am free on 2024-05-20 from 09:00 to 10:30 and from 15:00 to 16:00, Paris time. "
        "Write that as JSON.",
        obj(
            {
                "date": pattern(DATE),
                "timezone": enum("Europe/Paris", "Europe/London", "America/New_York", "UTC"),
                "slots": array(obj({"start": pattern(TIME), "end": pattern(TIME)}), 1, 4),
            }
        ),
        (
            {
                "date": "2024-05-20",
                "timezone": "Europe/Paris",
                "slots": [{"start": "09:00", "end": "10:30"}, {"start": "15:00", "end": "16:00"}],
            },
        ),
        max_tokens=250,
    ),
    SchemaCase(
        "commit_message",
        "Describe this change as a conventional commit: 'fixed the login form crashing when "
        "the password is empty'.",
        obj(
            {
                "type": enum("feat", "fix", "docs", "refactor", "test", "chore"),
                "scope": nullable(pattern(r"^[a-z]{1,15}$")),
                "subject": text(60, min_length=5),
                "breaking": boolean(),
            }
        ),
        (
            {
                "type": "fix",
                "scope": "login",
                "subject": "handle an empty password",
                "breaking": False,
            },
        ),
        max_tokens=200,
    ),
    SchemaCase(
        "hotel_search",
        "Search hotels in Kyoto from 2024-10-02 for 3 nights, 2 adults and 1 child, under "
        "200 per night, with breakfast and wifi.",
        obj(
            {
                "city": text(30),
                "check_in": pattern(DATE),
                "nights": integer(1, 30),
                "guests": obj({"adults": integer(1, 6), "children": integer(0, 4)}),
                "max_price_per_night": nullable(number(0, 10000)),
                "amenities": array(enum("wifi", "breakfast", "parking", "pool", "gym"), 0, 4),
            }
        ),
        (
            {
                "city": "Kyoto",
                "check_in": "2024-10-02",
                "nights": 3,
                "guests": {"adults": 2, "children": 1},
                "max_price_per_night": 200,
                "amenities": ["breakfast", "wifi"],
            },
        ),
        max_tokens=300,
    ),
    SchemaCase(
        "grade_report",
        "Write the grade report of student S2024117: MAT101 grade A (4 credits), PHY102 "
        "grade B (3 credits); GPA 3.6.",
        obj(
            {
                "student_id": pattern(r"^S[0-9]{7}$"),
                "courses": array(
                    obj(
                        {
                            "code": pattern(r"^[A-Z]{3}[0-9]{3}$"),
                            "grade": enum("A", "B", "C", "D", "F"),
                            "credits": integer(1, 6),
                        }
                    ),
                    1,
                    4,
                ),
                "gpa": number(0, 4),
            }
        ),
        (
            {
                "student_id": "S2024117",
                "courses": [
                    {"code": "MAT101", "grade": "A", "credits": 4},
                    {"code": "PHY102", "grade": "B", "credits": 3},
                ],
                "gpa": 3.6,
            },
        ),
        max_tokens=300,
    ),
    SchemaCase(
        "medical_appointment",
        "Request an appointment for Leo Martin about a persistent cough, not urgent, any day "
        "among 2024-04-08 and 2024-04-09; he is insured.",
        obj(
            {
                "patient_name": text(40),
                "reason": text(60),
                "urgency": enum("routine", "soon", "urgent"),
                "preferred_dates": array(pattern(DATE), 1, 3),
                "insured": boolean(),
            }
        ),
        (
            {
                "patient_name": "Leo Martin",
                "reason": "persistent cough",
                "urgency": "routine",
                "preferred_dates": ["2024-04-08", "2024-04-09"],
                "insured": True,
            },
        ),
        max_tokens=300,
    ),
    SchemaCase(
        "shipment_status",
        "Where is parcel PK-88213? It left the Hamburg depot and should arrive on 2024-11-05.",
        obj(
            {
                "parcel_id": pattern(r"^PK-[0-9]{5}$"),
                "status": enum("created", "in_transit", "out_for_delivery", "delivered", "lost"),
                "last_location": nullable(text(30)),
                "eta": {"anyOf": [pattern(DATE), enum("unknown", "already_delivered")]},
            }
        ),
        (
            {
                "parcel_id": "PK-88213",
                "status": "in_transit",
                "last_location": "Hamburg depot",
                "eta": "2024-11-05",
            },
            {"parcel_id": "PK-00001", "status": "lost", "last_location": None, "eta": "unknown"},
        ),
        max_tokens=200,
    ),
)
