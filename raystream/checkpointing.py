"""The controller's side of checkpoints and recovery, as plain logic (no Ray here).

- :func:`build_manifest`: what a complete checkpoint records, from the instances' acknowledgements.
- :func:`restore_specs`: what every instance of a (re)started job starts from: the key groups a
  keyed instance owns come from whichever instance held them at the checkpoint (the parallelism
  may differ: a restore is a redistribution of key groups), sources rewind, sinks publish what
  the checkpoint pre-committed.
- :class:`RestartStrategy`: Flink's fixed-delay strategy with a bound on attempts, and optionally
  a failure-rate bound (at most N failures within S seconds).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from raystream.errors import CheckpointError
from raystream.keys import RoutingTable

__all__ = [
    "RestartStrategy",
    "build_manifest",
    "default_checkpoint_dir",
    "manifest_routing",
    "restore_specs",
]


def default_checkpoint_dir() -> str:
    """Where a job keeps its checkpoints when no ``checkpoint_dir`` is given (it outlives the
    job, so ``--from-checkpoint latest`` finds them after the driver died)."""
    return os.path.join(tempfile.gettempdir(), "raystream-checkpoints")


def _iid(key: str) -> tuple[str, int]:
    step, _, index = key.rpartition("/")
    return step, int(index)


def build_manifest(
    *,
    job: str,
    checkpoint_id: int,
    acks: Iterable[dict[str, Any]],
    finished_sources: Iterable[tuple[str, int]],
    steps: dict[str, str],
    parallelism: dict[str, int],
    routing: dict[str, RoutingTable],
    num_key_groups: int,
    sub_groups: int,
    final: bool = False,
    savepoint: bool = False,
    finished: Iterable[tuple[str, int]] = (),
    retired_sinks: Iterable[tuple[str, Any]] = (),
    partition_commits: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON-able record of checkpoint ``checkpoint_id``. Raises CheckpointError when an
    instance reported a failure or a keyed step's key groups are not all covered.

    ``finished``: instances that reached the end of their input before the barrier came (as
    Flink's checkpoints after tasks finished, FLIP-147): their part of the checkpoint is
    ``{"finished": True}``, and a finished keyed instance covers the key groups ``routing`` gives
    it with no state (everything it held went out at its end; no input for them can come). On
    recovery such an instance starts empty and ends as soon as its inputs (finished too) end.

    ``retired_sinks``: (sink step, state) of sink instances a scale-in retired after their ends
    were published (sinks chained to a keyed step): a recovery folds them into a live instance
    (:func:`fold_sink_states`), so their output stays in the job's results.

    ``partition_commits``: per partitioned sink step with a partition commit, the folders
    written and not committed yet (:class:`raystream.partition_commit.JobPartitionCommits`),
    taken before this checkpoint's commits: a recovery commits them again when due."""
    instances: dict[str, dict[str, Any]] = {}
    for a in acks:
        step, index = a["instance"]
        if a.get("error"):
            msg = f"instance {step}/{index} could not take checkpoint {checkpoint_id}: {a['error']}"
            raise CheckpointError(msg)
        entry: dict[str, Any] = {}
        if "source_state" in a:
            entry["source"] = a["source_state"]
        if "state" in a:
            entry["state"] = a["state"]
            entry["key_groups"] = [int(g) for g in a["key_groups"]]
        if "sink_state" in a:
            entry["sink"] = a["sink_state"]
        instances[f"{step}/{index}"] = entry
    for step, index in finished_sources:
        instances.setdefault(f"{step}/{index}", {})["source"] = {"finished": True}
    for step, index in finished:
        key = f"{step}/{index}"
        if key in instances and ("state" in instances[key] or "sink" in instances[key]):
            continue  # it acknowledged this checkpoint before it ended: its part is that
        entry = instances.setdefault(key, {})
        entry["finished"] = True
        if step in routing and steps.get(step) in ("keyed", "keyed_batches"):
            entry["key_groups"] = [int(g) for g in routing[step].key_groups_of(index)]
    for step, kind in steps.items():
        if final or kind not in ("keyed", "keyed_batches"):
            continue  # a final checkpoint (every input ended) holds no state, only the sinks
        covered = [
            g for k, e in instances.items() if _iid(k)[0] == step for g in e.get("key_groups", [])
        ]
        if sorted(covered) != list(range(num_key_groups)):
            missing = sorted(set(range(num_key_groups)) - set(covered))
            msg = (
                f"checkpoint {checkpoint_id} does not hold every key group of step {step!r} "
                f"(missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                f"{len(covered)} reported for {num_key_groups})"
            )
            raise CheckpointError(msg)
    return {
        "job": job,
        "checkpoint_id": checkpoint_id,
        "created_s": time.time(),
        "final": final,
        "savepoint": savepoint,
        "steps": dict(steps),
        "parallelism": dict(parallelism),
        "routing": {
            n: {
                "epoch": t.epoch,
                "owners": [int(o) for o in t.owners],
                "parallelism": t.parallelism,
            }
            for n, t in routing.items()
        },
        "num_key_groups": num_key_groups,
        "sub_groups": sub_groups,
        "instances": instances,
        "retired_sinks": [[step, state] for step, state in retired_sinks],
        **({"partition_commits": partition_commits} if partition_commits else {}),
    }


def manifest_routing(manifest: dict[str, Any]) -> dict[str, RoutingTable]:
    return {
        n: RoutingTable(
            epoch=int(t["epoch"]),
            owners=np.asarray(t["owners"], dtype=np.int32),
            parallelism=int(t["parallelism"]),
        )
        for n, t in manifest.get("routing", {}).items()
    }


def restore_specs(
    manifest: dict[str, Any] | None,
    instances: Iterable[tuple[str, int]],
    routing: dict[str, RoutingTable],
    storage: tuple[str, str],
) -> dict[tuple[str, int], dict[str, Any]]:
    """Per instance of the restarted job, what it starts from. ``manifest`` None: a restart from
    scratch (sources from the start, empty state, sinks drop everything not yet published)."""
    entries = (manifest or {}).get("instances", {})
    held: dict[str, list[tuple[dict[str, Any], set[int]]]] = {}
    for key, e in entries.items():
        if "state" in e:
            held.setdefault(_iid(key)[0], []).append((e["state"], set(e["key_groups"])))
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for step, index in instances:
        spec: dict[str, Any] = {
            "storage": storage,
            "checkpoint_id": (manifest or {}).get("checkpoint_id"),
        }
        e = entries.get(f"{step}/{index}", {})
        if "source" in e:
            spec["source"] = e["source"]
        spec["sink"] = e.get("sink")
        if step in routing:
            mine = set(routing[step].key_groups_of(index).tolist())
            spec["keyed"] = [
                {"state": state, "key_groups": sorted(kgs & mine)}
                for state, kgs in held.get(step, [])
                if kgs & mine
            ]
        out[(step, index)] = spec
    _fold_orphan_sinks(manifest or {}, out)
    return out


def _fold_orphan_sinks(
    manifest: dict[str, Any], out: dict[tuple[str, int], dict[str, Any]]
) -> None:
    """Sink states of the checkpoint with no instance in the restarted job (a sink chained to a
    keyed step that a scale-in retired, before or after the checkpoint) go to the sink's first
    instance: what they committed stays committed and in the results."""
    entries = manifest.get("instances", {})
    for step, kind in manifest.get("steps", {}).items():
        if kind != "sink":
            continue
        planned = sorted(i for s, i in out if s == step)
        if not planned:
            continue
        orphans = [
            e["sink"]
            for key, e in sorted(entries.items())
            if _iid(key)[0] == step and _iid(key)[1] not in planned and e.get("sink") is not None
        ]
        orphans += [state for s, state in manifest.get("retired_sinks", []) if s == step]
        if orphans:
            first = out[(step, planned[0])]
            first["sink"] = fold_sink_states(first.get("sink"), orphans, step)


def fold_sink_states(own: Any, others: list[Any], step: str) -> dict[str, Any]:
    """One sink instance's checkpoint state with the committed output of ``others`` added: a
    collect sink's stored row blobs, a Parquet sink's pre-committed parts (published on restore,
    already published ones are kept as they are)."""
    state: dict[str, Any] = dict(own or {})
    for other in others:
        if isinstance(other, dict) and "blobs" in other:
            state["blobs"] = [*state.get("blobs", []), *other["blobs"]]
        elif isinstance(other, dict) and "pending" in other:
            state["pending"] = [*state.get("pending", []), *other["pending"]]
            state.setdefault("checkpoint", -1)
        else:
            msg = (
                f"sink {step!r}: the checkpoint holds the state of an instance a scale-in "
                f"retired ({type(other).__name__}), which this sink cannot take over (only "
                "collect and Parquet sinks can); restart the job with its sink not chained "
                f"(flow.options({step!r}, chain=False)) to rescale it"
            )
            raise CheckpointError(msg)
    return state


@dataclass
class RestartStrategy:
    """Fixed delay between attempts, at most ``attempts`` recoveries in the job's life, and with
    ``failure_rate=(n, s)`` at most ``n`` failures within any ``s`` seconds."""

    attempts: int = 3
    delay_s: float = 1.0
    failure_rate: tuple[int, float] | None = None
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self.failures: deque[float] = deque()
        self.used = 0

    def next_delay(self) -> float | None:
        """Record a failure; the delay before recovering, or None when the job must fail."""
        now = self.clock()
        self.failures.append(now)
        if self.failure_rate is not None:
            n, window_s = self.failure_rate
            while self.failures and self.failures[0] < now - window_s:
                self.failures.popleft()
            if len(self.failures) > n:
                return None
        if self.used >= self.attempts:
            return None
        self.used += 1
        return self.delay_s

    def why_not(self) -> str:
        if self.failure_rate is not None and len(self.failures) > self.failure_rate[0]:
            n, s = self.failure_rate
            return f"more than {n} failures within {s} s (restart_failure_rate)"
        return f"{self.used} of {self.attempts} recoveries used (restart_attempts)"
