"""Tool calling in chat completions, the request side: ``tools``, ``tool_choice``,
``parallel_tool_calls`` -> a `ToolRequest` (OpenAI's semantics, vLLM's server behaviour).

- ``tool_choice`` defaults to ``auto`` when there are tools (else ``none``). ``auto``: the model
  writes free text and the server's tool-call parser (``tool_call_parser``) finds the calls;
  it needs ``enable_auto_tool_choice`` and a parser (else a 400 saying so, as vLLM's).
- ``required`` and a named function ``{"type": "function", "function": {"name": ...}}`` are
  enforced by the structured output backend: ``required`` constrains the output to a JSON
  array of ``{"name": <one of the tools>, "arguments": <its parameters>}`` (at most one item
  with ``parallel_tool_calls: false``), a named function to that function's parameters; so
  the arguments always parse and validate (unless ``max_tokens`` cuts them short).
- ``none``: no calls; the tools still go to the chat template (vLLM's default) unless
  ``exclude_tools_when_tool_choice_none``.

The tools go to the chat template (transformers' ``apply_chat_template(tools=...)``). Assistant
messages' ``tool_calls`` have their JSON ``arguments`` turned into objects for the template
(templates write them with ``tojson``), as vLLM does; ``tool`` messages pass as they are.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from pagebatch.structured_output import StructuredOutputsParams

from .structured import bad

AUTO_HELP = ("start the server with --enable-auto-tool-choice and --tool-call-parser NAME "
             "(e.g. hermes, llama3_json), or send tool_choice 'required' or a named function")


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools, resolved. ``tools``: the request's tool objects; ``choice``:
    ``auto``, ``none``, ``required`` or ``function`` (``name`` then names it); ``parallel``:
    ``parallel_tool_calls``; ``render``: the tools the chat template gets (None: none)."""

    tools: list[dict[str, Any]]
    choice: str
    name: str | None
    parallel: bool
    render: list[dict[str, Any]] | None

    def constraint(self) -> StructuredOutputsParams | None:
        """The structured output constraint that enforces ``required`` / a named function,
        else None."""
        if self.choice == "function":
            i = next(i for i, t in enumerate(self.tools) if t["function"]["name"] == self.name)
            return StructuredOutputsParams(json=_parameters(self.tools[i]),
                                           origin=f"tools[{i}].function.parameters")
        if self.choice == "required":
            return StructuredOutputsParams(json=required_schema(self.tools, self.parallel),
                                           origin="tools")
        return None


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON schema of ``tool_choice: required``'s output: an array (one item or more; at
    most one unless ``parallel``) of ``{"name": <a tool's name>, "arguments": <its
    parameters>}``, one ``anyOf`` branch per tool (vLLM's construction, with OpenAI's
    ``arguments``)."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": t["function"]["name"]},
                             "arguments": _parameters(t)}} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def tool_request(body: dict[str, Any], auto_enabled: bool,
                 exclude_tools_when_none: bool = False) -> ToolRequest | None:
    """The request's tools and choice, or None without tools (and ``tool_choice`` absent or
    ``none``). Raises ApiError 400 naming the field: ``tool_choice`` without tools, a named
    function that is no tool (``tool_choice.function.name``), two tools of one name,
    ``auto`` on a server without a parser (SamplingParamsError, answered as a 400). Types are
    schemas.py's, checked before."""
    tools = body.get("tools") or []
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls") is not False
    if not tools:
        if choice is None or choice == "none":
            return None
        raise bad(f"tool_choice {choice!r:.100} needs tools; give tools or leave tool_choice "
                  f"out", "tool_choice")
    names: dict[str, int] = {}
    for i, t in enumerate(tools):
        name = t["function"]["name"]
        if name in names:
            raise bad(f"tools[{i}] and tools[{names[name]}] are both named {name!r}",
                      f"tools[{i}].function.name")
        names[name] = i
    name = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in names:
            raise bad(f"tool_choice names the function {name!r:.100}, which is not among the "
                      f"tools {sorted(names)}", "tool_choice.function.name")
        choice = "function"
    if choice == "auto" and not auto_enabled:
        raise bad(f"tool_choice 'auto' (the default when tools are given) needs a tool-call "
                  f"parser on this server: {AUTO_HELP}", "tool_choice")
    render = None if choice == "none" and exclude_tools_when_none else list(tools)
    return ToolRequest(list(tools), choice, name, parallel, render)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as chat templates take them: each assistant ``tool_calls[i].function
    .arguments`` given as JSON text becomes the object (left as text when it is not JSON).
    Returns a new list when something changed; the input is not modified."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        if calls:
            m = copy.deepcopy(m)
            for call in m["tool_calls"]:
                fn = call.get("function") if isinstance(call, dict) else None
                args = fn.get("arguments") if isinstance(fn, dict) else None
                if isinstance(args, str):
                    try:
                        fn["arguments"] = json.loads(args)
                    except ValueError:
                        pass
        out.append(m)
    return out
