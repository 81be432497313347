"""Submitting a job file to a running Ray cluster through Ray's job submission API.

``raystream submit job.py`` is the same as::

    RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 \\
        --working-dir <folder of job.py> -- python -m raystream run job.py

The working directory is the job file's folder, never the raystream repository: there the bare
``raystream/`` source folder would shadow the installed package (ARCHITECTURE.md section 1).
Ray 2.60 clusters started with ``ray start --head`` use token authentication; the client sends the
token when ``RAY_AUTH_MODE=token`` is set (token in ``~/.ray/auth_token``, ``RAY_AUTH_TOKEN_PATH``
or ``RAY_AUTH_TOKEN``).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raystream.errors import ClusterError, ConfigError, JobFailedError

__all__ = [
    "DEFAULT_DASHBOARD_ADDRESS",
    "Submission",
    "check_job_file",
    "dashboard_address",
    "submit",
    "token_hint",
    "wait_for_job",
]

DEFAULT_DASHBOARD_ADDRESS = "http://127.0.0.1:8265"
_TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def token_hint() -> str:
    return (
        "the cluster uses token authentication: run `ray get-auth-token --generate` on the "
        "cluster's machine (or copy its token to ~/.ray/auth_token, or point RAY_AUTH_TOKEN_PATH "
        "at it) and set RAY_AUTH_MODE=token for this command"
    )


def dashboard_address(address: str | None) -> str:
    """The job server (dashboard) address: ``address``, else RAY_API_SERVER_ADDRESS, else an
    ``http(s)://`` RAY_ADDRESS, else http://127.0.0.1:8265."""
    if address:
        return address.rstrip("/")
    for var in ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS"):
        value = os.environ.get(var, "")
        if value.startswith(("http://", "https://")):
            return value.rstrip("/")
    return DEFAULT_DASHBOARD_ADDRESS


@dataclass(frozen=True)
class Submission:
    """What ``raystream submit`` sends: the file, its folder as working dir, the entrypoint."""

    job_file: Path
    parallelism: dict[str, int] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    strategy: str | None = None
    autoscaler: str | None = None
    run_args: tuple[str, ...] = ()  # more `raystream run` options (checkpoints, restore points)

    @property
    def working_dir(self) -> Path:
        return self.job_file.parent

    def entrypoint(self) -> str:
        args = ["python", "-m", "raystream", "run", self.job_file.name]
        for step, n in sorted(self.parallelism.items()):
            args += ["-p", f"{step}={n}"]
        if self.strategy:
            args += ["--strategy", self.strategy]
        if self.autoscaler:
            args += ["--autoscaler", self.autoscaler]
        args += list(self.run_args)
        return shlex.join(args)

    def runtime_env(self) -> dict[str, Any]:
        env: dict[str, Any] = {"working_dir": str(self.working_dir)}
        if self.env:
            env["env_vars"] = dict(self.env)
        return env


def check_job_file(path: str | os.PathLike[str]) -> Path:
    """The job file, resolved; a clear error if it is missing or sits in a folder that would
    shadow the raystream package on the cluster."""
    file = Path(path).expanduser()
    if not file.is_file():
        msg = (
            f"no job file {os.fspath(path)!r} (looked in {os.getcwd()}); expected a Python file "
            "that builds a raystream Dataflow, e.g. examples/keycount_job.py"
        )
        raise ConfigError(msg)
    file = file.resolve()
    if (file.parent / "raystream" / "__init__.py").is_file():
        msg = (
            f"{file.parent} holds a raystream/ source folder, which would shadow the installed "
            "package on the cluster (it becomes the job's working dir); move the job file to its "
            "own folder"
        )
        raise ConfigError(msg)
    return file


@contextlib.contextmanager
def _without_env(*names: str) -> Iterator[None]:
    """Ray's JobSubmissionClient lets RAY_API_SERVER_ADDRESS / RAY_ADDRESS override the address it
    is given; the address we resolved (``--address`` first) must win."""
    saved = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _client(address: str) -> Any:
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    try:
        with _without_env("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS"):
            client = JobSubmissionClient(address)
        client.list_jobs()  # an authenticated request: a missing token fails here, not later
    except AuthenticationError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        mode = os.environ.get("RAY_AUTH_MODE", "<unset>")
        msg = (
            f"Ray's job server at {address} refused the request ({first}; "
            f"RAY_AUTH_MODE={mode}): {token_hint()}"
        )
        raise ClusterError(msg) from None
    except (ConnectionError, OSError) as e:
        msg = (
            f"cannot reach Ray's job server at {address} ({type(e).__name__}). Is the cluster "
            "running (`ray start --head --dashboard-host=127.0.0.1`)? Pass its dashboard address "
            "with --address http://HOST:PORT (default port 8265) or set RAY_API_SERVER_ADDRESS."
        )
        raise ClusterError(msg) from None
    return client


def submit(
    submission: Submission, address: str, *, submission_id: str | None = None
) -> tuple[Any, str]:
    """Submit; returns ``(client, submission_id)``."""
    client = _client(address)
    sid = submission_id or f"raystream-{submission.job_file.stem}-{uuid.uuid4().hex[:8]}"
    sid = client.submit_job(
        entrypoint=submission.entrypoint(),
        runtime_env=submission.runtime_env(),
        submission_id=sid,
        entrypoint_num_cpus=0,
    )
    return client, sid


def wait_for_job(
    client: Any,
    submission_id: str,
    *,
    echo: Callable[[str], None] = print,
    poll_s: float = 0.5,
    timeout_s: float | None = None,
) -> str:
    """Print the job's log as it grows until it ends; returns the final status name and raises
    :class:`JobFailedError` if it failed or was stopped."""
    printed = 0
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        status = str(client.get_job_status(submission_id).value)
        logs = client.get_job_logs(submission_id)
        if len(logs) > printed:
            echo(logs[printed:].rstrip("\n"))
            printed = len(logs)
        if status in _TERMINAL:
            break
        if deadline is not None and time.monotonic() > deadline:
            msg = f"job {submission_id} still {status} after {timeout_s} s; it keeps running"
            raise JobFailedError(msg)
        time.sleep(poll_s)
    if status != "SUCCEEDED":
        info = client.get_job_info(submission_id)
        msg = f"Ray job {submission_id} {status}: {info.message or 'see its log above'}"
        raise JobFailedError(msg)
    return status
