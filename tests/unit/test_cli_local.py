"""The ``raystream`` command line without Ray: parsing, exit codes, error text, progress,
the run summary and the status table (the parts that talk to a cluster are faked)."""

from __future__ import annotations

import importlib.metadata
import traceback
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from click.testing import CliRunner
from rich.console import Console

import raystream as rs
from raystream import cli
from raystream.job import JobResult
from raystream.metrics import InstanceMetrics
from raystream.sinks import WrittenFile
from raystream.status_view import operator_rows, summary_lines

CLUSTER_COMMANDS = ["list", "status", "rescale", "stop", "cancel", "savepoint", "run"]


def _invoke(*args: str) -> Any:
    return CliRunner().invoke(cli.main, list(args), prog_name="raystream")


def test_version_is_the_installed_version() -> None:
    out = _invoke("--version")
    assert out.exit_code == 0
    assert out.output.strip() == f"raystream, version {importlib.metadata.version('raystream')}"
    assert importlib.metadata.version("raystream") == rs.__version__


@pytest.mark.parametrize("command", CLUSTER_COMMANDS)
def test_every_command_that_talks_to_a_cluster_takes_address(command: str) -> None:
    out = _invoke(command, "--help")
    assert out.exit_code == 0, out.output
    assert "--address" in out.output


@pytest.mark.parametrize(
    "args",
    [
        ["run", "no_such_file.py"],
        ["run", __file__, "-p", "count=two"],
        ["rescale", "job", "count", "three"],
        ["status", "job", "--watch", "--interval", "0"],
        ["status"],
        ["no-such-command"],
    ],
)
def test_usage_errors_exit_2(args: list[str]) -> None:
    out = _invoke(*args)
    assert out.exit_code == cli.USAGE == 2, out.output


def _job_file(tmp_path: Path) -> Path:
    f = tmp_path / "job.py"
    f.write_text(
        "import pyarrow as pa, raystream as rs\n"
        "flow = rs.Dataflow('clijob')\n"
        "flow.source(rs.sources.from_table(pa.table({'k': [1]}))).sink(rs.sinks.collect())\n"
    )
    return f


def _real_failure() -> rs.JobFailedError:
    """A JobFailedError as the controller builds it, from a real exception and traceback."""

    def explode(key: str) -> None:
        raise KeyError(f"no price for {key}")

    try:
        explode("AAPL")
    except KeyError as e:
        return rs.JobFailedError.of_instance(
            "clijob",
            "price",
            1,
            f"{type(e).__name__}: {e}",
            context=("key", "'AAPL'"),
            traceback="".join(traceback.format_exception(e)),
        )
    raise AssertionError("unreachable")


class FakeJob:
    """Stands in for rs.Job: ``wait`` returns running states, then ends (or raises)."""

    def __init__(self, statuses: list[dict[str, Any]], end: Any) -> None:
        self.statuses = list(statuses)
        self.end = end
        self.stopped = False
        self.name = "clijob"

    def wait(self, timeout_s: float | None = None) -> JobResult:
        if self.statuses:
            return JobResult("clijob", "running", 0.0)
        if isinstance(self.end, BaseException):
            raise self.end
        return self.end  # type: ignore[no-any-return]

    def status(self) -> dict[str, Any]:
        return self.statuses.pop(0)

    def stop(self) -> None:
        self.stopped = True


def test_a_failed_job_exits_1_with_step_instance_key_and_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    failure = _real_failure()
    monkeypatch.setattr(rs, "start", lambda flow, **kw: FakeJob([], failure))
    out = _invoke("run", str(_job_file(tmp_path)))
    assert out.exit_code == cli.JOB_FAILED == 1, out.output
    text = out.output
    assert "job 'clijob' failed in step 'price', instance 1: KeyError: 'no price for AAPL'" in text
    assert "while processing key 'AAPL'" in text
    assert "Traceback (most recent call last)" in text and "in explode" in text


def test_error_exit_unwraps_what_ray_wraps() -> None:
    class Wrapped(rs.RescaleError):  # what ray.exceptions.RayTaskError.as_instanceof_cause makes
        def __init__(self, cause: Exception) -> None:
            super().__init__(f"ray.exceptions.RayTaskError: ...\n  File ...\n{cause}")
            self.cause = cause

    plain = cli.error_exit(Wrapped(rs.RescaleError("parallelism must be >= 1, got 0")))
    assert plain.exit_code == 2 and plain.message == "parallelism must be >= 1, got 0"
    failed = cli.error_exit(_real_failure())
    assert failed.exit_code == 1 and "Traceback" in failed.message


def _status(count_in: int, src_out: int, parallelism: int, **extra: Any) -> dict[str, Any]:
    return {
        "job": "clijob",
        "state": "running",
        "parallelism": {"src": 1, "count": parallelism, "out": 1},
        "instances": [
            {"step": "src", "index": 0, "role": "source", "records_out": src_out},
            {"step": "count", "index": 0, "role": "operator", "records_in": count_in, **extra},
            {"step": "out", "index": 0, "role": "sink", "records_in": count_in // 2},
        ],
        "latency": {"p50_ms": 4.0, "p99_ms": 12.5, "max_ms": 20.0},
    }


def test_follow_prints_progress_and_rescales_then_returns_the_result() -> None:
    done = JobResult("clijob", "finished", 3.0)
    job = FakeJob([_status(1000, 2000, 2), _status(5000, 6000, 3)], done)
    lines: list[str] = []
    progress = cli.Progress(tty=False, write=lines.append)
    assert cli.follow(job, 0.01, progress) is done
    text = "".join(lines).splitlines()
    assert len(text) == 3, text
    assert "in 2,000" in text[0] and "out 500" in text[0] and "p99 12.5 ms" in text[0]
    assert "parallelism src=1 count=2 out=1" in text[0]
    assert "rescaled 'count' 2 -> 3" in text[1]
    # the second reading: rates from the difference to the first, over the time between them
    assert "in 6,000 (" in text[2] and "out 2,500 (" in text[2]
    assert not job.stopped


def test_follow_stops_the_job_on_ctrl_c_and_not_when_it_failed() -> None:
    job = FakeJob([], KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        cli.follow(job, 0.01, cli.Progress(tty=False, write=lambda s: None))
    assert job.stopped
    failed = FakeJob([], _real_failure())
    with pytest.raises(rs.JobFailedError):
        cli.follow(failed, 0.01, cli.Progress(tty=False, write=lambda s: None))
    assert not failed.stopped  # the controller stopped it already


def test_progress_rewrites_one_line_on_a_terminal() -> None:
    out: list[str] = []
    p = cli.Progress(tty=True, write=out.append)
    p.line("a")
    p.line("b")
    p.event("rescaled")
    p.line("c")
    p.close()
    assert "".join(out) == "\r\x1b[2Ka\r\x1b[2Kb\r\x1b[2Krescaled\n\r\x1b[2Kc\n"


def _metrics(step: str, index: int, role: str, n_in: int, n_out: int) -> dict[str, Any]:
    m = InstanceMetrics(origin_ns=0)
    if n_in:
        m.record_in(n_in, now_ns=1)
    if n_out:
        m.record_out(n_out)
    snap = m.snapshot()
    snap.update(step=step, index=index, role=role, finished=True, busy_s=0.5, uptime_s=2.0)
    return snap


def test_run_summary_is_readable_text_with_the_totals() -> None:
    metrics = [
        _metrics("source", 0, "source", 0, 700),
        _metrics("count", 0, "operator", 300, 300),
        _metrics("count", 1, "operator", 400, 400),
        _metrics("out", 0, "sink", 700, 0),
        _metrics("files", 0, "sink", 700, 0),
    ]
    result = JobResult(
        "clijob",
        "finished",
        1.5,
        {
            "out": [pa.table({"key": [1, 2], "count": [3, 4]}), None],
            "files": [
                WrittenFile("/tmp/o/part-00000.parquet", 700, ("/tmp/o/part-00000.parquet",))
            ],
        },
        metrics,
        rescales=[{"step": "count", "from": 1, "to": 2, "strategy": "meces", "duration_s": 0.25}],
    )
    lines = summary_lines(result)
    assert lines[0] == "job 'clijob' finished in 1.50 s"
    count = next(line for line in lines if line.strip().startswith("count"))
    assert "operator 2 instances" in count
    assert f"in {300 + 400:,}" in count and "busy 25 %" in count
    assert any("rescaled 'count' 1 -> 2 with meces in 0.25 s" in line for line in lines)
    assert "sink 'out': 2 rows collected (columns: key, count)" in lines
    assert "sink 'files': 700 rows written to /tmp/o/part-00000.parquet" in lines
    assert not any("pyarrow.Table" in line or "WrittenFile(" in line for line in lines)


def test_status_table_shows_recent_busy_and_migration_progress() -> None:
    before = _status(1000, 2000, 2, busy_s=1.0, uptime_s=10.0)
    now = _status(
        5000,
        6000,
        2,
        busy_s=2.5,
        uptime_s=12.0,
        migration={"done": False, "arrived": 5, "incoming": 16},
    )
    rows = {r["operator"]: r for r in operator_rows(now, previous=before)}
    assert rows["count"]["busy_recent_pct"] == pytest.approx(100 * 1.5 / 2.0)  # 75 % lately
    assert rows["count"]["busy_pct"] == pytest.approx(100 * 2.5 / 12.0, abs=0.05)
    assert rows["count"]["role"] == "operator" and rows["src"]["role"] == "source"
    console = Console(record=True, width=160)
    console.print(cli.status_view(now, list(rows.values()), watching=2.0))
    text = console.export_text()
    assert "5/16 sub-groups in" in text and "75.0" in text
    assert "over the last 2 s" in text


def test_status_watch_checks_its_options_before_connecting() -> None:
    out = _invoke("status", "clijob", "--watch", "--count", "0", "--address", "127.0.0.1:1")
    assert out.exit_code == 2
    assert "--count N >= 1" in out.output and "cannot reach" not in out.output


class WatchedJob:
    """Stands in for the handle ``raystream status --watch`` polls: ``status()`` answers from
    a list (an exception in it is raised), ``name`` names the job."""

    name = "clijob"

    def __init__(self, answers: list[Any]) -> None:
        self.answers = list(answers)

    def status(self) -> dict[str, Any]:
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer  # type: ignore[no-any-return]


def _terminal() -> tuple[Console, Any]:
    import io

    out = io.StringIO()
    return Console(file=out, force_terminal=True, width=160, color_system=None), out


def test_status_watch_redraws_one_table_in_place_until_the_job_ends() -> None:
    first = _status(1000, 2000, 2, busy_s=1.0, uptime_s=10.0)
    second = _status(
        5000,
        6000,
        2,
        busy_s=2.5,
        uptime_s=12.0,
        migration={"done": False, "arrived": 5, "incoming": 16},
    )
    ended = {**second, "state": "finished"}
    console, out = _terminal()
    slept: list[float] = []
    cli._watch(WatchedJob([second, ended]), first, 2.0, None, console=console, sleep=slept.append)
    text = out.getvalue()
    assert slept == [2.0, 2.0]  # two tables, a sleep after each, then the job had ended
    assert "\x1b[?25l" in text and text.rstrip().endswith("job 'clijob' finished")
    frames = text.split("\x1b[?25h")[0]  # while live: the cursor is hidden
    one, two = frames.index("1,000"), frames.index("5,000")
    assert one < two and "\x1b[1A" in frames[one:two] and "\x1b[2K" in frames[one:two]  # redrawn
    assert "5/16 sub-groups in" in frames[two:]
    assert "75.0" in frames[two:]  # busy % over the last refresh: 1.5 s busy of 2 s
    assert "every 2 s" in frames


def test_status_watch_stops_on_ctrl_c_a_gone_controller_or_its_count() -> None:
    import ray

    def interrupt(_s: float) -> None:
        raise KeyboardInterrupt

    console, out = _terminal()
    cli._watch(WatchedJob([]), _status(10, 20, 1), 1.0, None, console=console, sleep=interrupt)
    text = out.getvalue()
    assert "\x1b[?25h" in text and "ended" not in text  # the cursor is back, no message

    console, out = _terminal()
    gone = WatchedJob([ray.exceptions.RayActorError()])
    cli._watch(gone, _status(10, 20, 1), 1.0, None, console=console, sleep=lambda s: None)
    assert "job 'clijob' ended (its controller is gone)" in out.getvalue()

    plain = Console(record=True, width=160)  # not a terminal: one table per refresh
    slept: list[float] = []
    statuses = [_status(30, 40, 1), _status(50, 60, 1)]
    cli._watch(WatchedJob(statuses), _status(10, 20, 1), 1.0, 2, console=plain, sleep=slept.append)
    text = plain.export_text()
    assert slept == [1.0] and text.count("job 'clijob': running") == 2
    assert "\x1b" not in text
