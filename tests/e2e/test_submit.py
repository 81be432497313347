"""End to end on a real Ray head: token auth on, jobs submitted through Ray's job server.

A module fixture starts ``ray start --head --block`` on loopback with free ports, its own temp dir
and its own auth token (``RAY_AUTH_MODE=token``, ``RAY_AUTH_TOKEN_PATH``), and the metrics export
port; it is stopped by killing its process group (never ``ray stop``, which would stop every Ray
cluster on the machine). Everything talks to it through subprocesses with an explicit
``RAY_ADDRESS``; this module needs no Ray in the test process.

Oracles: the example's own generator (``source.generate_all()``) counted with numpy; Prometheus
totals against those counts and against ``raystream status --json``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import runpy
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

VENV_BIN = Path(sys.executable).parent
CLI = str(VENV_BIN / "raystream")
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
KEYCOUNT = EXAMPLES / "keycount_job.py"


@dataclass(frozen=True)
class Head:
    gcs: str  # HOST:PORT for ray.init / raystream status
    dashboard: str  # http://HOST:PORT, the job server
    metrics_url: str
    env: dict[str, str]  # what a client process on this machine needs (token auth on)
    token_path: Path


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _clean_env() -> dict[str, str]:
    """This process's environment without any RAY_* (the session's embedded Ray sets some)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"  # the head's jobs find our python
    env.pop("PYTHONPATH", None)
    return env


def _http_ok(url: str, token: str) -> bool:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=3) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _stop_group(proc: subprocess.Popen[bytes], marker: str) -> None:
    """SIGTERM the head's process group, SIGKILL after 5 s; then any process of this head that
    left the group (its command line names our temp dir) is killed by pid. ``ray start`` is our
    child: it is reaped while we wait, or its zombie would keep the group alive."""
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            proc.poll()
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            continue
        break
    proc.wait(timeout=10)
    for pid in _pids_mentioning(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _pids_mentioning(marker: str) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd:
            out.append(int(entry.name))
    return out


@pytest.fixture(scope="module")
def ray_head() -> Iterator[Head]:
    tmp = Path(tempfile.mkdtemp(prefix="rse2e-", dir="/tmp"))  # short: Ray's socket paths
    token = secrets.token_hex(32)
    token_path = tmp / "auth_token"
    token_path.write_text(token)
    env = _clean_env()
    env.update(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN_PATH=str(token_path),
        RAY_metrics_report_interval_ms="1000",
    )
    gcs, dash, metrics, client, agent, rt_agent = _free_ports(6)
    cmd = [
        str(VENV_BIN / "ray"),
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        f"--port={gcs}",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dash}",
        f"--metrics-export-port={metrics}",
        f"--ray-client-server-port={client}",
        f"--dashboard-agent-listen-port={agent}",
        f"--runtime-env-agent-port={rt_agent}",
        "--num-cpus=2",
        "--disable-usage-stats",
        f"--temp-dir={tmp / 'ray'}",
    ]
    log = (tmp / "head.log").open("wb")
    proc = subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        dashboard = f"http://127.0.0.1:{dash}"
        deadline = time.monotonic() + 120
        while not _http_ok(f"{dashboard}/api/jobs/", token):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"ray head did not start: {(tmp / 'head.log').read_text()[-3000:]}")
            time.sleep(1.0)
        yield Head(
            gcs=f"127.0.0.1:{gcs}",
            dashboard=dashboard,
            metrics_url=f"http://127.0.0.1:{metrics}/metrics",
            env=env,
            token_path=token_path,
        )
    finally:
        _stop_group(proc, str(tmp))
        log.close()
        assert not _pids_mentioning(str(tmp)), "a process of the test's Ray head survived"
        shutil.rmtree(tmp, ignore_errors=True)


def _cli(
    *args: str, env: dict[str, str], timeout_s: float = 240
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CLI, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        cwd=tempfile.gettempdir(),
    )


def _example_source(path: Path, env: dict[str, str]):  # noqa: ANN202 - a generator spec
    """The example's source, built under the same environment variables as the job (the oracle)."""
    saved = dict(os.environ)
    try:
        os.environ.update(env)
        return runpy.run_path(str(path), run_name="oracle")["source"]
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _prometheus(url: str, wait_s: float = 60) -> list[tuple[str, dict[str, str], float]]:
    """The ``ray_raystream_*`` series of Ray's metrics endpoint (which the dashboard agent opens
    some seconds after the head is up)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                text = r.read().decode()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
    out = []
    for line in text.splitlines():
        m = re.match(r"^(ray_raystream_\w+)\{(.*)\}\s+(\S+)$", line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            out.append((m.group(1), labels, float(m.group(3))))
    return out


def _total(series: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    return sum(
        v for n, lab, v in series if n == name and all(lab.get(k) == w for k, w in labels.items())
    )


# ---- submit an example and read its result ---------------------------------------------------

EVENTS = 400_000


@pytest.fixture(scope="module")
def submitted_keycount(
    ray_head: Head, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("keycount-out")
    started = time.monotonic()
    done = _cli(
        "submit",
        str(KEYCOUNT),
        "-p",
        "count=2",
        "--address",
        ray_head.dashboard,
        "--env",
        f"RAYSTREAM_OUT={out}",
        "--env",
        f"RAYSTREAM_EVENTS={EVENTS}",
        "--env",
        "RAYSTREAM_RATE_EPS=0",
        env=ray_head.env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    print(f"submit -> SUCCEEDED in {time.monotonic() - started:.1f} s")
    return out, done.stdout


def test_submit_runs_the_example_on_the_cluster_and_its_counts_match_numpy(
    submitted_keycount: tuple[Path, str],
) -> None:
    out, stdout = submitted_keycount
    assert "SUCCEEDED" in stdout and "job 'keycount' finished" in stdout, stdout
    table = pq.read_table(out)
    got = table.to_pandas().groupby("key")["count"].max()
    src = _example_source(KEYCOUNT, {"RAYSTREAM_EVENTS": str(EVENTS), "RAYSTREAM_RATE_EPS": "0"})
    keys, counts = np.unique(src.generate_all().column("key").to_numpy(), return_counts=True)
    assert got.index.to_numpy().tolist() == keys.tolist()
    assert got.to_numpy().tolist() == counts.tolist()
    assert int(counts.sum()) == EVENTS


def test_operator_metrics_reach_prometheus_with_the_job_totals(
    ray_head: Head, submitted_keycount: tuple[Path, str]
) -> None:
    out, _ = submitted_keycount
    sink_rows = pq.read_metadata(next(out.glob("*.parquet"))).num_rows
    expected = {
        ("ray_raystream_records_out_total", "source"): EVENTS,
        ("ray_raystream_records_in_total", "count"): EVENTS,
        ("ray_raystream_records_in_total", "out"): sink_rows,
    }
    deadline = time.monotonic() + 30  # the final export is reported within ~1 s
    while True:
        series = _prometheus(ray_head.metrics_url)
        got = {k: _total(series, k[0], job="keycount", step=k[1]) for k in expected}
        if got == expected or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert got == expected
    busy = _total(series, "ray_raystream_busy_seconds_total", job="keycount", step="count")
    assert 0 < busy < 120


# ---- status / rescale / stop from another process, by name ------------------------------------


def _status_json(env: dict[str, str]) -> dict[str, Any]:
    st = _cli("status", "keycount", "--json", env=env)
    assert st.returncode == 0, st.stdout + st.stderr
    return json.loads(st.stdout)  # type: ignore[no-any-return]


def test_status_rescale_stop_a_submitted_job_by_name(ray_head: Head) -> None:
    env = {**ray_head.env, "RAY_ADDRESS": ray_head.gcs}
    baseline = _prometheus(ray_head.metrics_url)
    before_in = _total(baseline, "ray_raystream_records_in_total", job="keycount", step="count")
    sub = _cli(
        "submit",
        str(KEYCOUNT),
        "-p",
        "count=2",
        "--address",
        ray_head.dashboard,
        "--no-wait",
        "--env",
        # 20 minutes at 20,000 events/s (generated as read): the test stops it. Its own steps
        # (the deploy, ~8 CLI calls of 2-10 s each on a shared 2-core machine) took up to
        # ~100 s, too close to an input of 120 s: the input must outlast them on any machine
        "RAYSTREAM_EVENTS=24000000",
        "--env",
        "RAYSTREAM_RATE_EPS=20000",  # (a lighter load: the CLI calls share the 2 cores with it)
        env=env,
    )
    assert sub.returncode == 0, sub.stdout + sub.stderr
    sid = re.search(r"as Ray job (\S+)", sub.stdout).group(1)  # type: ignore[union-attr]

    deadline = time.monotonic() + 90
    while True:  # until the job is deployed and records flow (120 s of input at 20k/s)
        st = _cli("status", "keycount", "--json", env=env)
        if st.returncode == 0:
            first = json.loads(st.stdout)  # a reading before the Prometheus scrape below
            rows = {r["operator"]: r for r in first["operators"]}
            if rows["count"]["records_in"] > 0:
                break
        else:
            assert "no running job named 'keycount'" in st.stderr, st.stderr
        assert time.monotonic() < deadline, st.stdout + st.stderr
        time.sleep(1.0)
    assert list(rows) == ["source", "count", "out"]
    assert rows["count"]["parallelism"] == 2 and rows["source"]["records_out"] > 0
    # the input is throttled at 20,000 events/s: the recent rate cannot be far above it
    assert 0 <= rows["count"]["rate_in_per_s"] <= 30_000, rows["count"]

    table = _cli("status", "keycount", env=env)
    assert table.returncode == 0, table.stderr
    for header in ("operator", "parallelism", "records in", "in/s", "busy %", "backlog", "p99 ms"):
        assert header in table.stdout, table.stdout
    assert re.search(r"│ count\s+│\s+2 │", table.stdout), table.stdout

    # Prometheus sees the running job: its total lies between two of raystream's own readings
    # (the first minus what a few seconds of export lag can hold back)
    time.sleep(4.0)
    series = _prometheus(ray_head.metrics_url)
    second = _status_json(env)
    prom_in = (
        _total(series, "ray_raystream_records_in_total", job="keycount", step="count") - before_in
    )
    in_1, in_2 = (
        sum(r["records_in"] for r in s["operators"] if r["operator"] == "count")
        for s in (first, second)
    )
    assert in_1 - 300_000 <= prom_in <= in_2 and prom_in > 0, (in_1, prom_in, in_2)
    # gauges exist only while their actor lives (Ray drops a dead worker's gauges, not counters)
    up = sorted(
        (lab["step"], lab["index"])
        for n, lab, v in series
        if n == "ray_raystream_instance_up" and lab.get("job") == "keycount" and v == 1
    )
    assert up == [("count", "0"), ("count", "1"), ("out", "0"), ("source", "0")], up
    names = {n for n, lab, _ in series if lab.get("job") == "keycount"}
    for name in (
        "ray_raystream_backlog_batches",
        "ray_raystream_throughput_in_per_s",
        "ray_raystream_throughput_out_per_s",
        "ray_raystream_sink_latency_p50_ms",
        "ray_raystream_sink_latency_p99_ms",
    ):
        assert name in names, sorted(names)
    p99 = [v for n, lab, v in series if n == "ray_raystream_sink_latency_p99_ms"]
    assert p99 and all(0 < v < 60_000 for v in p99), p99
    rate = _total(series, "ray_raystream_throughput_in_per_s", job="keycount", step="count")
    assert 0 < rate <= 40_000, rate  # the source is throttled at 20,000 events/s

    resc = _cli("rescale", "keycount", "count", "3", "--strategy", "meces", env=env)
    assert resc.returncode == 0, resc.stderr
    assert "rescaled 'count' 2 -> 3 with meces" in resc.stdout, resc.stdout
    bad = _cli("rescale", "keycount", "count", "0", env=env)  # refused, the job runs on
    assert bad.returncode != 0 and "parallelism" in (bad.stderr + bad.stdout), bad.stderr
    after = _status_json(env)
    assert after["parallelism"]["count"] == 3
    assert {r["operator"]: r["parallelism"] for r in after["operators"]}["count"] == 3

    stopped = _cli("stop", "keycount", env=env)
    assert stopped.returncode == 0, stopped.stderr
    assert "job 'keycount' stopped" in stopped.stdout, stopped.stdout

    gone = _cli("status", "keycount", env=env)
    assert gone.returncode == 2
    assert (
        "no running job named 'keycount'" in gone.stderr
        and "running raystream jobs: none" in gone.stderr
    )
    # the Ray job ends too (its driver returns once the job stopped)
    deadline = time.monotonic() + 60
    while True:
        logs = subprocess.run(
            [str(VENV_BIN / "ray"), "job", "status", "--address", ray_head.dashboard, sid],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        if "succeeded" in logs.stdout.lower() or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert f"Job '{sid}' succeeded" in logs.stdout, logs.stdout + logs.stderr


# ---- clear errors ------------------------------------------------------------------------------


def test_errors_unknown_job_unreachable_cluster_missing_token_missing_file(ray_head: Head) -> None:
    env = {**ray_head.env, "RAY_ADDRESS": ray_head.gcs}
    unknown = _cli("status", "no-such-job", env=env)
    assert unknown.returncode == 2
    assert "no running job named 'no-such-job'" in unknown.stderr
    assert "running raystream jobs:" in unknown.stderr

    (dead,) = _free_ports(1)
    started = time.monotonic()
    unreachable = _cli("status", "keycount", env={**env, "RAY_ADDRESS": f"127.0.0.1:{dead}"})
    assert unreachable.returncode == 2
    assert f"cannot reach a Ray cluster at 127.0.0.1:{dead}" in unreachable.stderr
    assert "RAY_ADDRESS" in unreachable.stderr
    assert time.monotonic() - started < 60  # Ray alone waits ~2 minutes

    no_server = _cli("submit", str(KEYCOUNT), "--address", f"http://127.0.0.1:{dead}", env=env)
    assert no_server.returncode == 2
    assert f"cannot reach Ray's job server at http://127.0.0.1:{dead}" in no_server.stderr

    # no RAY_AUTH_MODE and no token anywhere (Ray sends an explicit RAY_AUTH_TOKEN_PATH's token
    # even without RAY_AUTH_MODE, so that goes too; HOME hides ~/.ray/auth_token)
    no_token = {k: v for k, v in env.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")}
    no_token["HOME"] = str(ray_head.token_path.parent / "home")
    refused = _cli("submit", str(KEYCOUNT), "--address", ray_head.dashboard, env=no_token)
    assert refused.returncode == 2
    assert (
        "ray get-auth-token --generate" in refused.stderr
        and "RAY_AUTH_MODE=token" in refused.stderr
    )

    missing = _cli("submit", "no_such_job.py", "--address", ray_head.dashboard, env=env)
    assert missing.returncode == 2 and "no job file 'no_such_job.py'" in missing.stderr
