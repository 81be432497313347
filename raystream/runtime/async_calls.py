"""Awaiting an ``async def`` stateless function over the records of one batch (no Ray here).

:func:`call_all` hands the arguments to the function as they come, keeps at most ``concurrency``
calls awaited at once and returns the results in the arguments' order (Flink's ordered async
I/O, within one batch). A call that fails or outlasts ``timeout_s`` is made again up to
``retries`` times (backing off); the first that still fails stops the others (cancelled and
awaited) and its error is raised with the argument that caused it.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from raystream.dataflow import AsyncCalls
from raystream.errors import note_context

__all__ = ["call_all"]


async def call_all(
    fn: Callable[[Any], Any],
    args: Sequence[Any],
    calls: AsyncCalls,
    step: str,
    context: Callable[[int], tuple[str, Any]],
    stats: dict[str, list[int]] | None = None,
) -> list[Any]:
    """``[await fn(a) for a in args]`` with up to ``calls.concurrency`` calls in flight.

    ``context(i)``: what to name in an error of the call for ``args[i]`` (``("record", {...})``);
    ``stats["calls"][0]`` counts the calls made, ``stats["retries"][0]`` those made again.
    """
    n = len(args)
    results: list[Any] = [None] * n
    if n == 0:
        return results
    todo = iter(range(n))
    timeout = calls.timeout_s
    stats = stats if stats is not None else {}
    made = stats.setdefault("calls", [0])  # calls made (a retry counts again)
    retried = stats.setdefault("retries", [0])

    async def call_once(i: int) -> Any:
        made[0] += 1
        got = fn(args[i])
        if not inspect.isawaitable(got):
            msg = (
                f"step {step!r}: its function was declared async def but a call returned "
                f"{type(got).__name__} {got!r}, not an awaitable"
            )
            raise TypeError(msg)
        if timeout is None:
            return await got
        try:
            return await asyncio.wait_for(got, timeout)
        except TimeoutError:
            msg = (
                f"step {step!r}: a call of its async function took longer than timeout_s="
                f"{timeout:g} s (raise timeout_s=, or make the call answer sooner)"
            )
            raise TimeoutError(msg) from None

    async def call(i: int) -> Any:
        for attempt in range(calls.retries + 1):
            try:
                return await call_once(i)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if attempt == calls.retries:
                    if calls.retries:
                        e.add_note(f"(the call was made {calls.retries + 1} times: retries=)")
                    raise
                retried[0] += 1
                await asyncio.sleep(calls.retry_backoff_s * 2**attempt)
        raise AssertionError("unreachable")  # pragma: no cover

    async def worker() -> None:
        for i in todo:  # one iterator shared by the workers: each argument is taken once
            try:
                results[i] = await call(i)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                what, value = context(i)
                note_context(e, what, value)
                raise

    workers = [asyncio.ensure_future(worker()) for _ in range(min(calls.concurrency, n))]
    try:
        await asyncio.gather(*workers)
    except BaseException:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        raise
    return results
