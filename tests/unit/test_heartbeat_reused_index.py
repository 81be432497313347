"""An instance index a scale-in retired and a later scale-out reuses starts with a fresh
heartbeat clock: it must not inherit the old incarnation's last heartbeat and be killed as hung
at once (seen in a soak with a rescale a minute: the 2 -> 3 -> 2 -> 3 scale-out's new instance
was killed 60 s after the old one's last answer). Without Ray: the controller is a plain class,
the handles are stand-ins."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from raystream import recovery as recovery_module
from raystream.runtime.instance import RuntimeConfig
from tests.unit._plain_controller import Call, plain_controller


class _Handle:
    def __init__(self) -> None:
        self.run = Call(None)
        self.heartbeat = Call({"records_in": 0, "rows_emitted": 0})


def test_a_reused_index_is_not_hung_by_its_old_incarnations_heartbeat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = plain_controller("beats", tmp_path, RuntimeConfig(heartbeat_timeout_s=0.4))
    killed: list[Any] = []
    monkeypatch.setattr(recovery_module.ray, "kill", lambda h, **_: killed.append(h))
    reused = ("count", 2)

    async def scenario() -> None:
        c.state = "running"
        c.handles = {reused: _Handle()}
        # its previous incarnation answered last 10 s ago, then retired (its outcome came)
        c._heartbeats[reused] = time.monotonic() - 10.0
        c._run(reused)  # a scale-out starts the index again
        loop = asyncio.ensure_future(c._heartbeat_loop())
        await asyncio.sleep(0.35)  # ~3 rounds, under the 0.4 s timeout
        c.state = "finished"
        await asyncio.wait_for(loop, 1.0)

    asyncio.run(scenario())
    assert killed == []
    assert reused not in c._hung
