"""What a request constrains its output to: `StructuredOutputsParams`, with vLLM's names."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from treadle.validate import MAX_NESTING, too_deep

# The kinds of constraint, in the order a message lists them; a request sets exactly one.
KINDS = ("json", "json_object", "regex", "choice", "grammar")
_TOO_DEEP = f"structured_outputs.json nests objects and lists more than {MAX_NESTING} deep"


@dataclass
class StructuredOutputsParams:
    """Exactly one of:
      json: a JSON schema (a dict, or its JSON text) the output must be an instance of;
      json_object: True for any JSON object;
      regex: a regular expression the whole output must match;
      choice: a list of strings, one of which the output must be;
      grammar: an EBNF (GBNF) grammar whose `root` rule the output must match.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # JSON kinds only: no free whitespace between tokens (small models can loop on it).
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}; "
                             f"got {', '.join(given) if given else 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    self.json = json.loads(self.json)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
                except RecursionError:   # deeper than Python's limit
                    raise ValueError(_TOO_DEEP) from None
            # As deep as a request's body may nest (protocol.RequestBody): a compile also grows
            # fast with depth (xgrammar's: 3 s at 300 levels).
            if too_deep([self.json]) is not None:
                raise ValueError(_TOO_DEEP)
            if not isinstance(self.json, (dict, bool)):
                raise ValueError(f"structured_outputs.json must be a JSON schema (an object), "
                                 f"got {type(self.json).__name__}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be a bool")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a bool, "
                             f"got {type(self.json_object).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 "non-empty strings")
            self.choice = list(self.choice)

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> "StructuredOutputsParams":
        if not isinstance(spec, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(spec).__name__}")
        known = KINDS + ("disable_any_whitespace",)
        unknown = set(spec) - set(known)
        if unknown:
            raise ValueError(f"structured_outputs has unknown keys {sorted(unknown)}; "
                             f"known: {', '.join(known)}")
        return cls(**spec)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text: schema JSON, regex, choices as JSON, or grammar."""
        value = getattr(self, self.kind)
        if self.kind in ("json", "choice"):
            # Key order stays: a schema's property order is the order the output must follow.
            return json.dumps(value, ensure_ascii=False)
        return "" if self.kind == "json_object" else value

    @property
    def key(self) -> tuple[str, str, bool]:
        """What a compiled grammar is cached under: equal keys, equal constraints."""
        return self.kind, self.spec, self.disable_any_whitespace
