"""The controller's checkpoint logic without Ray: manifests, what each restarted instance loads,
and the restart strategy (with a fake clock)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from raystream.checkpointing import (
    RestartStrategy,
    build_manifest,
    manifest_routing,
    restore_specs,
)
from raystream.errors import CheckpointError
from raystream.keys import RoutingTable

KG = 16
STEPS = {"source": "source", "count": "keyed_batches", "out": "sink"}


def _acks(table: RoutingTable) -> list[dict]:
    acks: list[dict] = [
        {"instance": ("source", 0), "source_state": {"offset": 1234}},
        {"instance": ("out", 0), "sink_state": {"pending": [{"file": ".p", "checkpoint": 7}]}},
    ]
    for i in range(table.parallelism):
        acks.append(
            {
                "instance": ("count", i),
                "state": {"files": [{"name": f"{i}.sst", "path": f"shared/u{i}/x", "size": 1}]},
                "key_groups": table.key_groups_of(i).tolist(),
            }
        )
    return acks


def _manifest(table: RoutingTable, **kw: object) -> dict:
    return build_manifest(
        job="j",
        checkpoint_id=7,
        acks=_acks(table),
        finished_sources=[],
        steps=STEPS,
        parallelism={"source": 1, "count": table.parallelism, "out": 1},
        routing={"count": table},
        num_key_groups=KG,
        sub_groups=4,
        **kw,  # type: ignore[arg-type]
    )


def test_manifest_is_json_and_round_trips_the_routing_table() -> None:
    owners = np.array([0, 1, 2] * 5 + [0])
    table = RoutingTable(epoch=5, owners=owners, parallelism=3)
    m = json.loads(json.dumps(_manifest(table)))
    assert m["instances"]["source/0"]["source"] == {"offset": 1234}
    back = manifest_routing(m)["count"]
    assert back.epoch == 5 and back.parallelism == 3
    assert np.array_equal(back.owners, owners)


def test_manifest_refuses_missing_key_groups_and_instance_errors() -> None:
    table = RoutingTable.uniform(KG, 2)
    acks = _acks(table)[:-1]  # count/1 never reported
    with pytest.raises(CheckpointError, match=r"does not hold every key group of step 'count'"):
        build_manifest(
            job="j", checkpoint_id=1, acks=acks, finished_sources=[], steps=STEPS,
            parallelism={}, routing={"count": table}, num_key_groups=KG, sub_groups=4,
        )
    bad = [*_acks(table), {"instance": ("count", 9), "error": "OSError: disk full"}]
    with pytest.raises(CheckpointError, match="count/9 could not take checkpoint 1: OSError"):
        build_manifest(
            job="j", checkpoint_id=1, acks=bad, finished_sources=[], steps=STEPS,
            parallelism={}, routing={"count": table}, num_key_groups=KG, sub_groups=4,
        )


@pytest.mark.parametrize(("old_p", "new_p"), [(2, 2), (2, 5), (4, 1), (3, 7)])
def test_restore_redistributes_key_groups_from_their_holders(old_p: int, new_p: int) -> None:
    rng = np.random.default_rng(old_p * 10 + new_p)
    old = RoutingTable(epoch=3, owners=rng.integers(0, old_p, KG), parallelism=old_p)
    m = _manifest(old)
    new = RoutingTable.uniform(KG, new_p)
    ids = [("source", 0), ("out", 0)] + [("count", i) for i in range(new_p)]
    specs = restore_specs(m, ids, {"count": new}, ("/chk", "j"))
    assert specs[("source", 0)]["source"] == {"offset": 1234}
    assert specs[("out", 0)]["sink"]["pending"][0]["checkpoint"] == 7
    seen: list[int] = []
    for i in range(new_p):
        parts = specs[("count", i)]["keyed"]
        for part in parts:
            holder = part["state"]["files"][0]["name"].split(".")[0]
            # each part comes from the instance that held those key groups at the checkpoint
            assert all(old.owners[g] == int(holder) for g in part["key_groups"])
            seen += part["key_groups"]
        mine = sorted(g for p in parts for g in p["key_groups"])
        assert mine == new.key_groups_of(i).tolist()
    assert sorted(seen) == list(range(KG))


def test_restart_from_scratch_has_no_state_and_drops_sink_output() -> None:
    specs = restore_specs(None, [("source", 0), ("out", 0)], {}, ("/chk", "j"))
    assert specs[("source", 0)].get("source") is None
    assert specs[("out", 0)]["sink"] is None


def test_restart_strategy_fixed_delay_and_attempts() -> None:
    now = [0.0]
    rs = RestartStrategy(attempts=2, delay_s=0.5, clock=lambda: now[0])
    assert rs.next_delay() == 0.5
    assert rs.next_delay() == 0.5
    assert rs.next_delay() is None
    assert "2 of 2 recoveries used" in rs.why_not()


def test_restart_strategy_failure_rate_window() -> None:
    now = [0.0]
    rs = RestartStrategy(attempts=100, delay_s=0.0, failure_rate=(2, 10.0), clock=lambda: now[0])
    assert rs.next_delay() == 0.0
    now[0] = 5.0
    assert rs.next_delay() == 0.0
    now[0] = 16.0  # both earlier failures left the window
    assert rs.next_delay() == 0.0
    now[0] = 17.0
    assert rs.next_delay() == 0.0
    now[0] = 18.0  # three within 10 s (16, 17, 18)
    assert rs.next_delay() is None
    assert "more than 2 failures within 10.0 s" in rs.why_not()


def test_a_push_sources_dedupe_table_goes_through_the_manifest_to_its_restore() -> None:
    """The table a push source reports at the barrier reaches the same instance on restore, and
    an IngestBuffer restored from it (after the manifest's JSON) drops exactly the covered rows."""
    import asyncio

    import pyarrow as pa

    from raystream.ingest import IngestBuffer

    schema = pa.schema([("key", pa.int64())])
    buf = IngestBuffer(schema, capacity_rows=100)

    async def before() -> None:
        await buf.offer(("spark:j:source", 0, 1), 0, pa.record_batch({"key": list(range(10))}))
        await buf.read(7, timeout_s=0.01)

    asyncio.run(before())
    table = RoutingTable.uniform(KG, 2)
    acks = _acks(table)
    pushed = {"offset": 7, "pushed": buf.checkpoint_state()}
    acks[0] = {"instance": ("source", 0), "source_state": pushed}
    manifest = build_manifest(
        job="j", checkpoint_id=3, acks=acks, finished_sources=[], steps=STEPS,
        parallelism={}, routing={"count": table}, num_key_groups=KG, sub_groups=4,
    )  # fmt: skip
    manifest = json.loads(json.dumps(manifest))  # as _MANIFEST.json holds it
    spec = restore_specs(manifest, [("source", 0)], {}, ("file:///tmp", "j"))[("source", 0)]
    again = IngestBuffer(schema, capacity_rows=100)
    again.restore(spec["source"]["pushed"])

    async def after() -> list[int]:
        await again.offer(("spark:j:source", 0, 1), 0, pa.record_batch({"key": list(range(10))}))
        await again.end()
        return (await again.read(100, timeout_s=0.01)).column("key").to_pylist()

    assert spec["source"]["offset"] == 7
    assert asyncio.run(after()) == [7, 8, 9]


def test_a_checkpoint_after_a_branch_finished_records_it_as_finished() -> None:
    """Two branches: ``short -> count_a -> out_a`` ended before the barrier (none of its
    instances acknowledged it), ``long -> count -> out`` is live. The checkpoint completes: the
    finished keyed instances cover their key groups with no state, the finished source and sink
    are recorded as finished (the sink with its pre-committed end); on restore the finished part
    starts empty (at another parallelism too) and the live part loads its state as before."""
    table = RoutingTable.uniform(KG, 2)
    steps = {**STEPS, "short": "source", "count_a": "keyed_batches", "out_a": "sink"}
    finished_sink = {"instance": ("out_a", 0), "sink_state": {"pending": [{"file": ".f"}]}}
    manifest = build_manifest(
        job="j",
        checkpoint_id=9,
        acks=[*_acks(table), finished_sink],
        finished_sources=[("short", 0)],
        steps=steps,
        parallelism={"source": 1, "count": 2, "out": 1, "short": 1, "count_a": 2, "out_a": 1},
        routing={"count": table, "count_a": table},
        num_key_groups=KG,
        sub_groups=4,
        finished=[("short", 0), ("count_a", 0), ("count_a", 1), ("out_a", 0)],
    )
    m = json.loads(json.dumps(manifest))
    got = m["instances"]
    assert got["short/0"] == {"source": {"finished": True}, "finished": True}
    assert got["out_a/0"] == {"sink": finished_sink["sink_state"]}  # its end, to publish
    covered = sorted(g for i in (0, 1) for g in got[f"count_a/{i}"]["key_groups"])
    assert covered == list(range(KG))
    assert all("state" not in got[f"count_a/{i}"] for i in (0, 1))
    # a finished step that is missing an instance is still refused
    with pytest.raises(CheckpointError, match="count_a"):
        build_manifest(
            job="j", checkpoint_id=9, acks=_acks(table), finished_sources=[("short", 0)],
            steps=steps, parallelism={}, routing={"count": table, "count_a": table},
            num_key_groups=KG, sub_groups=4, finished=[("count_a", 0)],
        )
    new = RoutingTable.uniform(KG, 3)
    iids = [("short", 0), ("out_a", 0), ("count", 0)] + [("count_a", i) for i in range(3)]
    specs = restore_specs(m, iids, {"count": table, "count_a": new}, ("file:///x", "j"))
    assert specs[("short", 0)]["source"] == {"finished": True}
    assert specs[("out_a", 0)]["sink"] == finished_sink["sink_state"]
    assert all(specs[("count_a", i)]["keyed"] == [] for i in range(3))
    assert [p["key_groups"] for p in specs[("count", 0)]["keyed"]] == [
        table.key_groups_of(0).tolist()
    ]
