"""A stand-in OpenAI ``/v1/completions`` server whose token timing is known exactly, to measure
what ``pagebatch bench serve`` itself adds to TTFT and ITL (client and event-loop jitter):
every stream gets one token per global tick of ``TICK`` seconds, all streams at the same
instant, as one engine step feeds every running request. With no client error, ITL is TICK at
every percentile; what the benchmark reports above TICK is its own (and this server's) cost.

    TICK=0.03 uvicorn --app-dir scripts fake_sse_server:app --port 8799 &
    pagebatch bench serve --base-url http://127.0.0.1:8799 --model m --num-prompts 256 \\
        --input-len 16 --output-len 128 --range-ratio 0 --vocab-size 1000 --rates inf

Needs starlette and uvicorn (the README's set-up).
"""

from __future__ import annotations

import asyncio
import json
import os
import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

TICK = float(os.environ.get("TICK", "0.03"))  # seconds between two tokens of every stream


async def models(_: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})


async def completions(req: Request) -> StreamingResponse:
    n = int((await req.json())["max_tokens"])

    async def events():
        for _ in range(n):
            tick = (int(time.monotonic() / TICK) + 1) * TICK
            await asyncio.sleep(max(0.0, tick - time.monotonic()))
            chunk = {"id": "c", "object": "text_completion", "model": "m",
                     "choices": [{"index": 0, "text": " a", "finish_reason": None}]}
            yield f"data: {json.dumps(chunk)}\n\n"
        usage = {"id": "c", "choices": [], "usage": {"prompt_tokens": 16,
                                                     "completion_tokens": n}}
        yield f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


app = Starlette(routes=[Route("/v1/models", models),
                        Route("/v1/completions", completions, methods=["POST"])])
