"""The client leaving, for the request path (proxy.py): watching for its disconnect, racing upstream
work against it, and spreading it over a prompt list's parts (each part has its own `gone` event,
so one part's failure stops the others as a client leaving would)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response

from kvbridge.proxy import prompt_lists

T = TypeVar("T")


async def relay(gone: asyncio.Event, parts: list[asyncio.Event]) -> None:
    """Set every part's event once `gone` is set (the client left: every prompt of its list stops)."""
    await gone.wait()
    for part in parts:
        part.set()


async def first_failure_stops_the_rest(tasks: list[asyncio.Task[Response]], parts: list[asyncio.Event],
                                       ) -> tuple[list[Response], Response | None]:
    """Every task's answer, in order, and the first error answer (None: none). Once one answers an
    error (or raises), the others' clients are 'gone': each stops as a request whose client left
    (P's KV released, D's connection closed) and answers 499. Cancelled itself, it stops them all
    the same before it ends."""

    def bad(task: asyncio.Task[Response]) -> bool:
        return task.cancelled() or task.exception() is not None or prompt_lists.failed(task.result())

    def stop_all() -> None:
        for part in parts:
            part.set()

    first: Response | None = None
    try:
        pending: set[asyncio.Task[Response]] = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if any(bad(task) for task in done):
                stop_all()
                if first is None:  # the failure that stopped the rest (theirs are 499s)
                    first = next((t.result() for t in tasks if t in done and not t.cancelled()
                                  and t.exception() is None and prompt_lists.failed(t.result())), None)
    except BaseException:
        stop_all()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close_answers(tasks)
        raise
    broken = [task for task in tasks if task.cancelled() or task.exception() is not None]
    if broken:
        await close_answers(tasks)
        broken[0].result()  # raises its exception (a bug: the app answers 500)
    return [task.result() for task in tasks], first


async def close_answers(tasks: list[asyncio.Task[Response]]) -> None:
    answers = [t.result() for t in tasks if t.done() and not t.cancelled() and t.exception() is None]
    await asyncio.gather(*(prompt_lists.close(a) for a in answers), return_exceptions=True)


async def watch_disconnect(request: Request, gone: asyncio.Event) -> None:
    """Set `gone` when the client disconnects. The body has been read, so the next ASGI
    message can only be the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    gone.set()


async def unless(gone: asyncio.Event, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None if `gone` is set first; then `work` is cancelled, which
    closes its upstream connection (an upstream kvbridge server aborts the request)."""
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(gone.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return task.result() if not task.cancelled() else None
