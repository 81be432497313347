"""Run the ``raystream`` command line against a status dict, without Ray."""

from __future__ import annotations

from typing import Any

from click.testing import CliRunner

import raystream as rs
from raystream import cli


def status_output(monkeypatch: Any, status: dict[str, Any]) -> str:
    """``raystream status kc`` for a job whose ``status()`` is ``status``; its output with
    whitespace runs folded to one space."""

    class _Job:
        def status(self) -> dict[str, Any]:
            return status

    monkeypatch.setattr(cli, "_connect", lambda address=None: None)
    monkeypatch.setattr(rs, "attach", lambda name: _Job())
    result = CliRunner().invoke(cli.main, ["status", "kc"], terminal_width=200)
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())
