"""A recovery keeps the live actors (raystream.actor_reuse) and resets them in place
(InstanceEndpoint.reset), without Ray: which actors are kept, and an in-process chain actor that
runs, is reset (loop ended, RocksDB closed), configured for the next attempt, and drops a push
of the old attempt that arrives after that (the count against collections.Counter)."""

from __future__ import annotations

import asyncio
import tempfile
from collections import Counter
from dataclasses import replace
from typing import Any

import pyarrow as pa
import pytest

import raystream as rs
from raystream.actor_reuse import actor_groups, choose_kept_actors
from raystream.plan import physical_plan
from raystream.runtime.chain import ChainSpec
from raystream.runtime.instance import RuntimeConfig
from raystream.runtime.messages import EndOfStream

S0, S1 = ("src", 0), ("src", 1)
C0, C1 = ("count", 0), ("count", 1)
O0, O1 = ("out", 0), ("out", 1)


# ---- which actors are kept ------------------------------------------------------------------


def _job() -> tuple[dict[Any, frozenset[Any]], dict[Any, str]]:
    chains = {C0: (C0, O0), C1: (C1, O1)}
    actors = actor_groups([S0, S1, C0, O0, C1, O1], chains)
    return actors, {S0: "a", S1: "b", C0: "a", C1: "b"}


def test_actor_groups_put_a_chain_in_its_heads_actor() -> None:
    actors, _ = _job()
    assert actors == {
        S0: frozenset({S0}),
        S1: frozenset({S1}),
        C0: frozenset({C0, O0}),
        C1: frozenset({C1, O1}),
    }


def test_every_live_actor_is_kept_and_a_dead_one_replaced() -> None:
    actors, nodes = _job()
    choice = choose_kept_actors(actors, actors, dead=[O1], nodes=nodes)
    assert set(choice.kept) == {S0, S1, C0}
    assert choice.replaced == (C1,)  # its chained sink died: the chain's actor
    assert choice.why[C1] == "died"


def test_a_failed_instance_whose_process_lives_is_kept() -> None:
    actors, nodes = _job()  # the user function raised in count/0: not dead
    choice = choose_kept_actors(actors, actors, dead=[], nodes=nodes)
    assert set(choice.kept) == set(actors) and choice.replaced == ()


def test_actors_on_a_lost_node_under_neutral_names_or_with_another_chain_are_replaced() -> None:
    actors, nodes = _job()
    new = dict(actors)
    new[C1] = frozenset({C1})  # the new plan cuts count/1's chain differently
    del new[S0]  # ... and has no src/0 (a change left it half-added)
    choice = choose_kept_actors(actors, new, nodes=nodes, lost_nodes={"a"}, neutral=[S1])
    assert choice.kept == ()
    assert choice.why == {
        S0: "its node was lost",
        C0: "its node was lost",
        S1: "runs under a neutral name",
        C1: "its chain changed",
    }
    choice = choose_kept_actors(actors, new, nodes=nodes)
    assert choice.why == {S0: "not in the new plan", C1: "its chain changed"}


def test_switched_off_every_actor_is_replaced() -> None:
    actors, nodes = _job()
    choice = choose_kept_actors(actors, actors, nodes=nodes, enabled=False)
    assert choice.kept == () and set(choice.replaced) == set(actors)


# ---- an actor reset in place ----------------------------------------------------------------


@rs.keyed_batches(state=rs.ValueState(int, default=0))
def count(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    new = state.get(batch.keys) + batch.counts
    state.put(batch.keys, new)
    return batch.output({"count": new})


def _chain_spec(attempt: int, state_dir: str) -> ChainSpec:
    gen = rs.sources.generator(events=1, keys=10, seed=1)
    flow = rs.Dataflow("reuse", num_key_groups=16)
    flow.source(gen, name="src").options(chain=False).key_by("key").apply(count).sink(
        rs.sinks.collect(), name="out"
    )
    plan = physical_plan(flow, None, RuntimeConfig(metrics_export_s=0), 0, state_dir)
    ids = plan.chains[("count", 0)]
    assert ids == (("count", 0), ("out", 0))
    return ChainSpec(tuple(replace(plan.instances[i], attempt=attempt) for i in ids))


def _batch(keys: list[int]) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict(
        {"key": pa.array(keys, pa.int64()), "ts": pa.array([0] * len(keys), pa.int64())}
    )


def test_a_reset_actor_ends_its_loop_closes_its_state_and_drops_old_pushes(
    monkeypatch: Any,
) -> None:
    from raystream.runtime import actors

    monkeypatch.setattr(actors, "_where", lambda: {})
    src = ("src", 0)
    old_rows = _batch([1, 1, 2, 3])
    stale = _batch([7, 7, 7, 7, 7])  # sent by the old attempt, arrives after the reset
    fresh = _batch([1, 2, 2, 4])
    actor = actors._InstanceActor(_chain_spec(0, tempfile.mkdtemp()))  # noqa: SLF001

    async def start() -> list[asyncio.Future[Any]]:
        await actor.connect({}, None)
        for member in actor._members.values():  # noqa: SLF001
            await member.connect({}, None)
        return [
            asyncio.ensure_future(actor.run()),
            *(asyncio.ensure_future(m.run()) for m in actor._members.values()),  # noqa: SLF001
        ]

    async def drive() -> tuple[Any, ...]:
        runs = await start()
        await actor.push(src, 0, old_rows, 0)
        head = actor._instance  # noqa: SLF001
        for _ in range(200):
            if head.metrics.records_in >= old_rows.num_rows:
                break
            await asyncio.sleep(0.01)
        backend = head.processor.backend
        assert not backend._closed  # noqa: SLF001
        answer = await actor.reset(1)
        old_outcome = await asyncio.wait_for(runs[0], 5)
        closed = backend._closed  # noqa: SLF001
        unconfigured = actor._instance is None  # noqa: SLF001
        await actor.configure(_chain_spec(1, tempfile.mkdtemp()))
        runs = await start()
        await actor.push(src, 0, stale, 0)  # answered at once, never queued
        await actor.push(src, 0, fresh, 1)
        await actor.push(src, 1, EndOfStream(), 1)
        outcomes = await asyncio.wait_for(asyncio.gather(*runs), 10)
        return answer, old_outcome, closed, unconfigured, outcomes

    answer, old_outcome, closed, unconfigured, outcomes = asyncio.run(drive())
    assert answer["pid"] > 0
    assert old_outcome["reset"] is True and old_outcome["error"] is None
    assert closed, "the old attempt's RocksDB was not closed by the reset"
    assert unconfigured
    assert [o["error"] for o in outcomes] == [None, None], outcomes
    assert actor._stale_pushes == 1  # noqa: SLF001
    table = outcomes[1]["result"]
    got = Counter(dict(zip(table["key"].to_pylist(), table["count"].to_pylist(), strict=True)))
    # last count per key: only the fresh batch's rows (the new attempt starts from empty
    # state; the old attempt's rows and the stale push are not in it)
    assert dict(got) == {k: v for k, v in Counter([1, 2, 2, 4]).items()}


def test_recovery_keeps_actors_is_validated() -> None:
    assert RuntimeConfig().recovery_keeps_actors is True
    with pytest.raises(rs.ConfigError, match="recovery_keeps_actors must be True or False"):
        RuntimeConfig(recovery_keeps_actors=1)  # type: ignore[arg-type]


def test_a_writer_waiting_on_a_reset_push_source_gets_the_attempt_error() -> None:
    """A Spark task of the old attempt waiting for room in a push source's buffer is answered
    by the reset (not left hanging), and its later pushes are refused by the new attempt."""
    from raystream.errors import SourceError
    from raystream.runtime import actors

    schema = pa.schema([("key", pa.int64()), ("seq", pa.int64())])
    flow = rs.Dataflow("reuse-push")
    flow.source(rs.sources.push(schema, capacity_rows=10), name="src").options(chain=False).sink(
        rs.sinks.collect(), name="out"
    )

    def spec(attempt: int) -> Any:
        plan = physical_plan(flow, None, RuntimeConfig(metrics_export_s=0), 0, tempfile.mkdtemp())
        return replace(plan.instances[("src", 0)], attempt=attempt)

    def rows(start: int, stop: int) -> pa.RecordBatch:
        n = list(range(start, stop))
        return pa.record_batch({"key": n, "seq": n}, schema=schema)

    actor = actors._InstanceActor(spec(0))  # noqa: SLF001
    token = ("part", 0)

    async def drive() -> tuple[BaseException | None, BaseException | None]:
        await actor.ingest(token, 0, rows(0, 10), 0)  # fills the buffer (nobody reads)
        waiting = asyncio.ensure_future(actor.ingest(token, 10, rows(10, 20), 0))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # backpressure: it waits for room
        await actor.reset(1)
        try:
            await asyncio.wait_for(waiting, 5)
            first = None
        except SourceError as e:
            first = e
        await actor.configure(spec(1))
        try:
            await actor.ingest(token, 20, rows(20, 30), 0)
            late = None
        except SourceError as e:
            late = e
        return first, late

    first, late = asyncio.run(drive())
    assert first is not None and "reset from attempt 0 to attempt 1" in str(first), first
    assert late is not None and "meant for attempt 0" in str(late), late


def test_state_calls_of_a_peer_of_the_old_attempt_are_refused() -> None:
    """serve_state / read_snapshot sent by an instance of an attempt a recovery replaced are
    answered with an error at once, never served from the new attempt's state."""
    from raystream.runtime import actors
    from raystream.runtime.reset import StaleAttemptError

    actor = actors._InstanceActor(_chain_spec(1, tempfile.mkdtemp()))  # noqa: SLF001
    with pytest.raises(StaleAttemptError, match="sent by an instance of attempt 0"):
        asyncio.run(actor.serve_state(1, [0], 1 << 20, False, 0))
    with pytest.raises(StaleAttemptError, match="now serves attempt 1"):
        asyncio.run(actor.read_snapshot("/nowhere", [0], 0))
