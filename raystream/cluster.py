"""Connecting a command-line process to a running Ray cluster, with clear errors.

Ray 2.60 waits about 2 minutes before it gives up on an address where nothing listens, and about
20 s (then a bare ``ConnectionError``) when the cluster wants a token the client does not send.
:func:`connect` probes the address first (a TCP connect, seconds) and turns both cases into a
:class:`~raystream.errors.ClusterError` naming the address and the fix.

Token authentication: a cluster from ``ray start --head`` (Ray 2.60) checks a token on every
connection; the client sends it only with ``RAY_AUTH_MODE=token``. Ray turns that on by itself
only for ``address="auto"``; raystream also turns it on for an explicit address when a token is
available and ``RAY_AUTH_MODE`` is unset (never when it is set, whatever its value).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from raystream.errors import ClusterError

__all__ = ["connect", "gcs_address", "running_jobs", "token_available"]

CONTROLLER_PREFIX = "raystream-controller:"


def token_available() -> bool:
    """A Ray auth token in RAY_AUTH_TOKEN, the file of RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token."""
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
    try:
        return bool(Path(path).read_text().strip())
    except OSError:
        return False


def gcs_address(address: str | None = None) -> str:
    """``address``, else RAY_ADDRESS, else ``"auto"`` (the cluster started on this machine)."""
    return address or os.environ.get("RAY_ADDRESS") or "auto"


def _enable_token_auth() -> None:
    """RAY_AUTH_MODE=token for this process and its children. Ray reads the variable into its
    config when it is imported, so setting it afterwards needs Ray's own refresh (what
    ``ray.init(address="auto")`` does when a token exists)."""
    os.environ["RAY_AUTH_MODE"] = "token"
    try:
        from ray._private.authentication.authentication_token_setup import (
            _enable_token_auth as enable,
        )
    except ImportError:  # pragma: no cover - another Ray version: the variable alone
        return
    enable()


def _probe(address: str, timeout_s: float = 3.0) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        msg = (
            f"Ray address {address!r} is not HOST:PORT; expected the GCS address of a cluster "
            "(e.g. 127.0.0.1:6379, what `ray start --head --port` says), or 'auto'"
        )
        raise ClusterError(msg)
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        msg = (
            f"cannot reach a Ray cluster at {address} ({e.strerror or type(e).__name__}). Start "
            "one (`ray start --head`, or run the job with `raystream run`), or set RAY_ADDRESS "
            "to its GCS address HOST:PORT"
        )
        raise ClusterError(msg) from None


def connect(
    address: str | None = None, namespace: str = "raystream", *, log_to_driver: bool = False
) -> str:
    """Connect this process to the cluster at ``address`` (see :func:`gcs_address`); returns the
    address tried. Raises :class:`ClusterError` naming that address and the fix."""
    import ray

    target = gcs_address(address)
    if ray.is_initialized():
        return target
    if target.startswith(("http://", "https://")):
        msg = (
            f"RAY_ADDRESS={target!r} is a dashboard (job server) address; status, rescale and "
            "stop need the cluster's GCS address HOST:PORT (the --port of `ray start --head`)"
        )
        raise ClusterError(msg)
    if target not in ("auto", "local") and not target.startswith("ray://"):
        _probe(target)
        if "RAY_AUTH_MODE" not in os.environ and token_available():
            _enable_token_auth()
    try:
        ray.init(
            address=target,
            namespace=namespace,
            log_to_driver=log_to_driver,
            logging_level="error",
        )
    except (ConnectionError, RuntimeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if target == "auto":
            msg = (
                f"cannot find a Ray cluster on this machine (address 'auto': {first}). Start the "
                "job first (`raystream run job.py`, or `ray start --head` and `raystream submit`), "
                "or set RAY_ADDRESS to the cluster's GCS address HOST:PORT"
            )
        else:
            mode = os.environ.get("RAY_AUTH_MODE", "<unset>")
            msg = (
                f"the Ray cluster at {target} is reachable but refused the connection ({first}; "
                f"RAY_AUTH_MODE={mode}). If it uses token authentication, run `ray "
                "get-auth-token --generate` (or copy the cluster's token to ~/.ray/auth_token) "
                "and set RAY_AUTH_MODE=token"
            )
        raise ClusterError(msg) from None
    return target


def running_jobs(namespace: str = "raystream") -> list[str]:
    """Names of the raystream jobs running on the connected cluster (their controller actors)."""
    import ray

    try:
        actors = ray.util.list_named_actors(all_namespaces=True)
    except Exception:  # noqa: BLE001 - listing is a courtesy for error messages
        return []
    names = [
        a.get("name", "") if isinstance(a, dict) else str(a)
        for a in actors
        if not isinstance(a, dict) or a.get("namespace") == namespace
    ]
    return sorted(n[len(CONTROLLER_PREFIX) :] for n in names if n.startswith(CONTROLLER_PREFIX))
