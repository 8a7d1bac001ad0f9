"""The ``http`` frontend plugin: an OpenAI-compatible HTTP server (starlette + uvicorn),
started by ``pagebatch serve [MODEL] [--config FILE] [--host H] [--port P] ...``.

Its options (below) are config keys like the engine's: on the command line, or in the YAML file
(CLI > file > defaults); values land in ``EngineConfig.plugin_options``. starlette, uvicorn and
prometheus-client are imported only when the server runs, so loading this plugin costs nothing
elsewhere. See docs/serving.md and docs/observability.md.
"""

from __future__ import annotations

import argparse
from typing import Any

from pagebatch import hookimpl
from pagebatch.config import ConfigOption, EngineConfig, parse_bool, parse_int


def _parse_optional_str(v: Any) -> str | None:
    return None if v is None or v == "" else str(v)


def _parse_origins(v: Any) -> list[str]:
    """A list of origins, or a comma-separated string of them (``*`` allows any)."""
    if v is None:
        return []
    items = v if isinstance(v, (list, tuple)) else str(v).split(",")
    return [str(o).strip() for o in items if str(o).strip()]


def _parse_seconds(v: Any) -> float:
    if isinstance(v, bool):
        raise ValueError("expected a number of seconds")
    x = float(v)
    if not x >= 0:
        raise ValueError("must be >= 0")
    return x


OPTIONS = [
    ConfigOption("host", "127.0.0.1", "address the HTTP server listens on", str),
    ConfigOption("port", 8000, "TCP port the HTTP server listens on", parse_int(0, 65535)),
    ConfigOption("api_key", None, "key clients must send as 'Authorization: Bearer KEY' on "
                 "/v1/*, /tokenize and /detokenize (default: $PAGEBATCH_API_KEY; none = no "
                 "check)", _parse_optional_str),
    ConfigOption("metrics_require_api_key", False, "with an api_key, /metrics needs it too "
                 "(default: /metrics is open, for Prometheus scrapers)", parse_bool),
    ConfigOption("served_model_name", None, "model name the API answers to (default: the "
                 "model key)", _parse_optional_str),
    ConfigOption("max_request_body_bytes", 16 * 2**20, "largest request body accepted "
                 "(413 above)", parse_int(1)),
    ConfigOption("max_prompts_per_request", 256, "most prompts in one /v1/completions "
                 "request", parse_int(1)),
    ConfigOption("max_n_per_request", 128, "largest n (samples per prompt) accepted",
                 parse_int(1)),
    ConfigOption("allowed_origins", [], "CORS origins allowed (comma-separated; empty = CORS "
                 "off)", _parse_origins),
    ConfigOption("shutdown_timeout", 30.0, "seconds running requests get to finish on "
                 "SIGTERM before they are aborted", _parse_seconds),
    ConfigOption("tool_call_parser", None, "the tool-call parser plugin that reads tool calls "
                 "from the model's text for tool_choice 'auto' (built-ins: hermes, "
                 "llama3_json; vLLM's --tool-call-parser)", _parse_optional_str),
    ConfigOption("enable_auto_tool_choice", False, "accept tool_choice 'auto' (the default "
                 "with tools), parsed by tool_call_parser (vLLM's --enable-auto-tool-choice)",
                 parse_bool),
    ConfigOption("exclude_tools_when_tool_choice_none", False, "with tool_choice 'none', do "
                 "not render the tools in the chat template (default: rendered, as vLLM)",
                 parse_bool),
    ConfigOption("metrics_vllm_names", False, "also serve /metrics under vLLM's names "
                 "(vllm:num_requests_waiting, ...) for dashboards and autoscalers built for "
                 "vllm serve", parse_bool),
]


# `pagebatch serve`'s own defaults of engine keys (`Frontend.engine_defaults`; the file and the
# command line override them). Streams wait on every step, so a step that carries decodes
# computes at most 4096 prompt tokens, and steps of up to 2048 tokens replay piecewise CUDA
# graphs. Against the offline defaults (0 = no cap, 512), Llama-3.1-8B shape, one H100, 200
# mixed-length requests a rate (docs/benchmarks.md "Session 45, H100"): at 8-32 req/s TTFT p99
# 56-95 vs 86-124 ms and ITL p99 19-32 vs 27-46 ms; at saturation ITL p99 112-137 vs 372 ms,
# for 3 % of output throughput and TTFT p99 2.50 vs 2.31 s; at 64 req/s all three a little
# worse (TTFT p99 227 vs 204 ms, ITL p99 112 vs 87 ms, 0.8 % of throughput).
SERVE_ENGINE_DEFAULTS = {"max_mixed_prefill_tokens": 4096,
                         "piecewise_cuda_graph_max_tokens": 2048}


class HttpFrontend:
    help = "OpenAI-compatible HTTP server (starlette + uvicorn)"
    engine_defaults = SERVE_ENGINE_DEFAULTS

    def add_cli_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Nothing beyond the config keys in OPTIONS (added with the engine keys)."""

    def run(self, config: EngineConfig, args: argparse.Namespace | None = None) -> int:
        from .server import serve

        return serve(config)


@hookimpl
def register_frontends(register):
    register("serve", HttpFrontend())


@hookimpl
def register_config_options(register):
    for opt in OPTIONS:
        register(opt)
