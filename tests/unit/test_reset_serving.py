"""A recovery that keeps an actor resets it (raystream.runtime.reset): moved state it serves on
its transfer loop is stopped before the state is closed (the caller gets a StaleAttemptError,
never a chunk read before the reset), and its keyed state is closed without writing the cache
(the folder is deleted next). Without Ray: the endpoint is a plain class, the transfer loop a
thread of this test, the instance a stand-in."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from raystream.runtime import actors
from raystream.runtime import reset as reset_module
from raystream.runtime.reset import StaleAttemptError
from raystream.state.rocks import RocksStateBackend

CHUNK = (["sub-group 3"], ["rows of the old attempt"])


class _Instance:
    """An old owner serving moved state: each serve_state waits on the transfer loop (as one
    waiting for the serving loop) and, if ``answers_anyway``, swallows its cancel and answers
    what it read (a read that finished just as the reset came)."""

    def __init__(self, answers_anyway: bool = False) -> None:
        self.spec = SimpleNamespace(job="j", id=("count", 0), index=0, attempt=0)
        self.step = SimpleNamespace(name="count")
        self.reader = self.writer = self.processor = None
        self.engine = SimpleNamespace(task=SimpleNamespace(server=None))
        self.answers_anyway = answers_anyway
        self.serving = threading.Event()
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True

    async def serve_state(self, epoch: int, groups: list[int], max_bytes: int, urgent: bool) -> Any:
        self.serving.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            if not self.answers_anyway:
                raise
        return CHUNK


@pytest.fixture
def transfer_loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def _endpoint(monkeypatch: pytest.MonkeyPatch, inst: _Instance) -> Any:
    monkeypatch.setattr(actors.wire, "register", lambda: None)  # (needs Ray)
    monkeypatch.setattr(actors.gc, "freeze", lambda: None)
    endpoint = actors.InstanceEndpoint(None)
    endpoint._instance = inst
    endpoint._attempt = 0
    return endpoint


def _serve(endpoint: Any, loop: asyncio.AbstractEventLoop, attempt: int) -> Any:
    return asyncio.run_coroutine_threadsafe(
        endpoint.serve_state(7, [3], 1 << 20, True, attempt), loop
    )


@pytest.mark.parametrize("answers_anyway", [False, True])
def test_a_reset_stops_state_served_on_the_transfer_loop(
    monkeypatch: pytest.MonkeyPatch,
    transfer_loop: asyncio.AbstractEventLoop,
    answers_anyway: bool,
) -> None:
    inst = _Instance(answers_anyway)
    endpoint = _endpoint(monkeypatch, inst)
    # the migration engine's serving loop runs on the transfer loop too
    server = asyncio.run_coroutine_threadsafe(_start_server(), transfer_loop).result(5)
    inst.engine.task.server = server
    call = _serve(endpoint, transfer_loop, attempt=0)
    assert inst.serving.wait(5)
    assert len(endpoint._serving_calls()) == 1

    t0 = time.monotonic()
    asyncio.run(endpoint.reset(1))
    took = time.monotonic() - t0
    assert took < reset_module.RUN_STOP_S / 2, f"the reset waited {took:.2f} s"
    assert inst.stopped
    # the call in progress ended with the reset (not after the caller's timeout), refused
    assert call.done()
    with pytest.raises(StaleAttemptError, match="reset for attempt 1 while it served"):
        call.result(0)
    assert server.done() and server.cancelled()
    assert endpoint._serving_calls() == {}
    # a call of the old attempt that comes after the reset is refused at once
    late = _serve(endpoint, transfer_loop, attempt=0)
    with pytest.raises(StaleAttemptError, match="sent by an instance of attempt 0"):
        late.result(5)


async def _start_server() -> asyncio.Task[None]:
    return asyncio.get_running_loop().create_task(asyncio.Event().wait())


def test_a_serve_call_cancelled_by_its_caller_stays_cancelled(
    monkeypatch: pytest.MonkeyPatch, transfer_loop: asyncio.AbstractEventLoop
) -> None:
    inst = _Instance()
    endpoint = _endpoint(monkeypatch, inst)
    call = _serve(endpoint, transfer_loop, attempt=0)
    assert inst.serving.wait(5)
    call.cancel()  # no reset: the cancel is the caller's
    deadline = time.monotonic() + 5
    while endpoint._serving_calls() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert endpoint._serving_calls() == {}
    assert endpoint._attempt == 0
    with pytest.raises(concurrent.futures.CancelledError):
        call.result(0)


def test_a_serve_call_of_the_current_attempt_answers(
    monkeypatch: pytest.MonkeyPatch, transfer_loop: asyncio.AbstractEventLoop
) -> None:
    inst = _Instance()

    async def answer(*_: Any) -> Any:
        return CHUNK

    inst.serve_state = answer  # type: ignore[method-assign]
    endpoint = _endpoint(monkeypatch, inst)
    assert _serve(endpoint, transfer_loop, attempt=0).result(5) == CHUNK
    assert endpoint._serving_calls() == {}


def test_closing_without_writing_drops_the_cache(tmp_path: Path) -> None:
    keys = [b"\x00\x01\x00key-%d" % i for i in range(50)]
    values = [b"value-%d" % i for i in range(50)]
    for path, write in ((tmp_path / "kept", True), (tmp_path / "dropped", False)):
        db = RocksStateBackend(path)
        db.write(keys[:10], values[:10])
        db.flush()  # these are in RocksDB
        db.write(keys[10:], values[10:])  # these only in the write-back cache
        assert db.multi_get(keys) == values
        db.close(write=write)
        again = RocksStateBackend(path)
        expected = values if write else values[:10] + [None] * 40
        assert again.multi_get(keys) == expected
        again.close()


def test_a_reset_discards_keyed_state_instead_of_writing_it() -> None:
    calls: list[str] = []
    processor = SimpleNamespace(
        discard=lambda: calls.append("discard"), close=lambda: calls.append("close")
    )
    stateless = SimpleNamespace(close=lambda: calls.append("stateless close"))
    for p in (processor, stateless):
        inst = SimpleNamespace(
            engine=None, writer=None, reader=None, processor=p, spec=SimpleNamespace(id="x")
        )
        asyncio.run(reset_module._release(inst))
    assert calls == ["discard", "stateless close"]
