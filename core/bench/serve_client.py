"""One streamed request of ``pagebatch bench serve`` to an OpenAI-compatible server (httpx,
async): the request body for ``/v1/completions`` or ``/v1/chat/completions`` and the
timestamps of its output chunks, turned into a `Result` (serve_metrics.py).

An output chunk is a ``data:`` event with ``choices`` (vLLM's client rule), except the
role-only first delta of a chat stream (``{"role": "assistant", "content": ""}``), which
carries no token. The output token count is the server's ``usage.completion_tokens`` (asked
for with ``stream_options.include_usage``), else one per chunk.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Awaitable, Callable

from .serve_dataset import ServeRequest
from .serve_metrics import Result

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


def request_body(endpoint: str, model: str, req: ServeRequest, temperature: float,
                 ignore_eos: bool) -> dict[str, Any]:
    """The JSON body of ``req`` for ``endpoint`` (one of ENDPOINTS): streamed, with usage.
    Chat needs a text prompt (raises ValueError for token ids)."""
    body: dict[str, Any] = {"model": model, "max_tokens": req.output_len,
                            "temperature": temperature, "ignore_eos": ignore_eos,
                            "stream": True, "stream_options": {"include_usage": True}}
    if endpoint.endswith("/chat/completions"):
        if not isinstance(req.prompt, str):
            raise ValueError(f"{endpoint} takes text prompts: use --prompt-kind text")
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


def _is_output(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta")
    if delta is None:  # completions
        return True
    return bool(delta.get("content")) or choice.get("finish_reason") is not None or (
        "role" not in delta)


async def one_request(client: Any, endpoint: str, body: dict[str, Any],
                      prompt_len: int) -> Result:
    """POST ``body`` to ``endpoint`` on the httpx.AsyncClient ``client`` and read its SSE
    stream; ``prompt_len`` stands for the prompt tokens until the server's usage says. A
    failure (HTTP status, an error event, a transport error) is a failed `Result`, not an
    exception."""
    stamps: list[float] = []
    prompt_tokens, output_tokens = prompt_len, 0
    start = time.perf_counter()
    try:
        async with client.stream("POST", endpoint, json=body) as r:
            if r.status_code != 200:
                return Result(error=f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    return Result(error=str(obj["error"])[:300])
                choices = obj.get("choices")
                if choices and any(_is_output(c) for c in choices):
                    stamps.append(time.perf_counter())
                usage = obj.get("usage")
                if usage:
                    prompt_tokens = usage.get("prompt_tokens") or prompt_tokens
                    output_tokens = usage.get("completion_tokens") or 0
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        return Result(error=f"{type(e).__name__}: {e}")
    return Result.from_chunks(start, stamps, prompt_tokens, output_tokens)


async def send_on_schedule(offsets: list[float], start: float,
                           send: Callable[[int], Awaitable[Result]]) -> list[Result]:
    """Start ``send(i)`` at ``start + offsets[i]`` (seconds on ``time.monotonic``, one clock for
    every process of a host; offsets non-decreasing), all concurrently; their results in
    order of i."""
    tasks = []
    for i, offset in enumerate(offsets):
        delay = start + offset - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(send(i)))
    return list(await asyncio.gather(*tasks))
