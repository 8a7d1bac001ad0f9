"""Streams of the HTTP frontend: merging request streams, server-sent events, and noticing a
client that went away.

A client that disconnects must have its request aborted at once, also while nothing is being
written (a long prefill, a queued request, a stop string holding text back). uvicorn reports the
disconnect as an ``http.disconnect`` message on ``receive``, so both responses here wait on
``receive`` alongside the work: `EventStreamResponse` for streams, `until_disconnected` for
one-body answers. Cancelling the work ends its request streams, whose ``finally`` aborts the
requests in the engine core (all n samples); the core applies the abort before its next step.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagebatch.request import RequestOutput


def sse(obj: Any) -> str:
    """One server-sent event: ``data: {json}\\n\\n``."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class EventStreamResponse(StreamingResponse):
    """``text/event-stream`` of an async iterator of events, cancelled as soon as the client
    disconnects: ``receive`` is watched concurrently with the body, whatever the ASGI spec
    version (starlette stops watching at spec 2.4 and relies on a failing write instead, which
    never comes while no token is written)."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:
            async def body() -> None:
                try:
                    await self.stream_response(send)
                except OSError:  # the connection broke mid-write: the client is gone
                    pass
                tg.cancel_scope.cancel()

            tg.start_soon(body)
            await self.listen_for_disconnect(receive)
            tg.cancel_scope.cancel()


async def merge(streams: list[AsyncIterator[RequestOutput]]
                ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several request streams as they come, tagged with the stream's index.
    Leaving early cancels the pumps (which aborts their requests)."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in s:
                await queue.put((i, out))
        except BaseException as e:
            await queue.put((i, e))
            return
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def until_disconnected(request: Request, work: Any) -> Any:
    """Run ``work`` (a coroutine) unless the client goes away first (then cancel it, which
    aborts its requests, and return None). For non-streaming responses, whose body has been
    read: the next ASGI message can only be the disconnect."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if not task.done() or task.cancelled():
        try:
            await task
        except asyncio.CancelledError:
            pass
        return None
    return task.result()
