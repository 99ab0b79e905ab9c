"""Admin request bodies that refuse what they do not know.

A field the operator misspells or misplaces (``{"requests_per_minute": 2}`` beside ``quotas``
instead of inside it, ``{"rpm": 2}``) must not be dropped silently: the change would look done
and be nothing. Every admin body is a ``StrictBody``: unknown fields are a 400 that names each of
them, lists the fields the body takes and, where one was meant, says where it belongs. The schema
says the same (``additionalProperties: false``).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

UNKNOWN_FIELDS = "unknown_fields"  # the error type ``errors.validation_message`` words
WHERE = "<where>"  # in the message: replaced by where the fields were ("the request body", ...)


class StrictBody(BaseModel):
    """A JSON body whose unknown fields are refused (error type ``unknown_fields``; its context
    holds the message, with ``WHERE`` for the place, and the first unknown field's name)."""

    model_config = ConfigDict(extra="forbid")

    # An unknown field name -> what was probably meant (shown after the list of fields).
    unknown_hints: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data  # not an object: pydantic's own error says so
        unknown = [str(k) for k in data if k not in cls.model_fields]
        if not unknown:
            return data
        names = ", ".join(repr(k[:40]) for k in unknown[:10])
        if len(unknown) > 10:
            names += f" and {len(unknown) - 10} more"
        plural = len(unknown) > 1
        message = (
            f"Unknown field{'s' if plural else ''} {names} in {WHERE}: "
            f"{'they' if plural else 'it'} would change nothing; remove "
            f"{'them' if plural else 'it'}. The fields of {WHERE} are: "
            f"{', '.join(cls.model_fields)}."
        )
        hints = [cls.unknown_hints[k] for k in unknown if k in cls.unknown_hints]
        if hints:
            message += " " + " ".join(dict.fromkeys(hints))
        raise PydanticCustomError(
            UNKNOWN_FIELDS, "{message}", {"message": message, "field": unknown[0][:40]}
        )
