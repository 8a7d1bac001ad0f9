"""The structured output fields of a request body -> `StructuredOutputsParams` (vLLM's surface).

Accepted (at most one per request): ``structured_outputs`` (an object with one of ``json``,
``json_object``, ``regex``, ``choice``, ``grammar``), vLLM's older ``guided_json`` /
``guided_regex`` / ``guided_choice`` / ``guided_grammar``, and OpenAI's ``response_format``
(``{"type": "text"}``, ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema":
{"name": ..., "schema": {...}, "strict": ...}}``; ``strict`` is accepted either way: the schema
is always enforced), in chat completions and, as vLLM's server takes it, in completions. Each
constraint remembers the field it came from, so that a 400 for a schema the backend cannot
compile names that field.
"""

from __future__ import annotations

from typing import Any

from pagebatch.errors import SamplingParamsError
from pagebatch.structured_output import KINDS, StructuredOutputsParams


def bad(message: str, param: str) -> SamplingParamsError:
    return SamplingParamsError(message, param)  # answered as a 400 naming ``param``

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}


def structured_outputs(body: dict[str, Any]) -> StructuredOutputsParams | None:
    """The request's constraint, or None. Raises SamplingParamsError (a 400) naming the field
    for a malformed one (the compile check is the engine's, and names the same field)."""
    found: list[StructuredOutputsParams] = []
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict) or not so:
            raise bad(f"structured_outputs must be an object with one of {list(KINDS)}, got "
                      f"{so!r:.100}", "structured_outputs")
        unknown = sorted(set(so) - set(KINDS))
        if unknown:
            raise bad(f"structured_outputs has unknown keys {unknown}; allowed: {list(KINDS)}",
                      "structured_outputs")
        set_ = [k for k in KINDS if so.get(k) not in (None, False)]
        origin = f"structured_outputs.{set_[0]}" if len(set_) == 1 else "structured_outputs"
        found.append(StructuredOutputsParams(**so, origin=origin))
    for name, kind in GUIDED.items():
        if body.get(name) is not None:
            found.append(StructuredOutputsParams(**{kind: body[name]}, origin=name))
    rf = _response_format(body.get("response_format"))
    if rf is not None:
        found.append(rf)
    if len(found) > 1:
        raise bad(f"{found[0].origin} and {found[1].origin} both constrain the output; give "
                  f"one", found[1].origin)
    return found[0] if found else None


def _response_format(rf: Any) -> StructuredOutputsParams | None:
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, origin="response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
            raise bad("response_format json_schema needs json_schema.schema, a JSON schema "
                      f"object, got {js!r:.100}", "response_format.json_schema.schema")
        for key, types, what in (("name", str, "a string"), ("description", str, "a string"),
                                 ("strict", bool, "a boolean")):
            if js.get(key) is not None and not isinstance(js[key], types):
                raise bad(f"response_format.json_schema.{key} must be {what}, got "
                          f"{js[key]!r:.50}", f"response_format.json_schema.{key}")
        return StructuredOutputsParams(json=js["schema"],
                                       origin="response_format.json_schema.schema")
    raise bad("response_format.type must be 'text', 'json_object' or 'json_schema', got "
              f"{kind!r:.50}", "response_format.type")
