"""Reading a checkpoint's keyed state as tables (``rs.read_state``), without Ray.

The state is built as instances build it: a keyed processor (the runtime's, on RocksDB) per
instance, fed the rows of the key groups a uniform routing gives it; a checkpoint is a RocksDB
snapshot of each, uploaded through ``CheckpointStorage`` and completed with the manifest the
controller writes (``build_manifest``). What ``read_state`` returns is checked against counts of
the input made independently (DuckDB, ``collections.Counter``)."""

from __future__ import annotations

import collections
import json
import shutil
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import raystream as rs
from raystream import cli
from raystream.checkpoint.storage import CheckpointStorage
from raystream.checkpointing import build_manifest
from raystream.errors import CheckpointError, ConfigError, SchemaError
from raystream.keys import RoutingTable
from raystream.runtime.processors import make_processor


class Instances:
    """The keyed instances of one step, and the checkpoints they take (as the runtime does)."""

    def __init__(self, flow: rs.Dataflow, step: str, parallelism: int, base: Path, uri: str):
        self.flow, self.step = flow, step
        ks = flow.key_space
        self.routing = RoutingTable.uniform(ks.num_key_groups, parallelism)
        self.procs = [
            make_processor(
                flow.steps[step], ks, base / f"{step}-{i}", self.routing.key_groups_of(i).tolist()
            )
            for i in range(parallelism)
        ]
        self.base = base
        self.storage = CheckpointStorage(uri, flow.name)

    def process(self, table: pa.Table, key: str) -> None:
        kg, _ = self.flow.key_space.locate(table.column(key))
        owner = self.routing.owners[kg]
        for i, proc in enumerate(self.procs):
            part = table.filter(pa.array(owner == i))
            for batch in part.to_batches(max_chunksize=7_000):
                proc.process(batch)

    def checkpoint(self, cid: int) -> None:
        acks = []
        for i, proc in enumerate(self.procs):
            local = self.base / f"snap-{cid}-{i}"
            proc.backend.snapshot_async(local).result()
            desc = self.storage.upload_state(cid, f"{self.step}/{i}", str(local), proc.backend.uid)
            acks.append(
                {"instance": (self.step, i), "state": desc, "key_groups": proc.owned_key_groups}
            )
        flow = self.flow
        manifest = build_manifest(
            job=flow.name,
            checkpoint_id=cid,
            acks=acks,
            finished_sources=[],
            steps={n: s.kind for n, s in flow.steps.items()},
            parallelism={self.step: len(self.procs)},
            routing={self.step: self.routing},
            num_key_groups=flow.key_space.num_key_groups,
            sub_groups=flow.key_space.sub_groups,
        )
        self.storage.complete(cid, manifest)

    def close(self) -> None:
        for p in self.procs:
            p.close()


@rs.keyed_batches(state=rs.ValueState(int, default=0))
def count(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    new = state.get(batch.keys) + batch.counts
    state.put(batch.keys, new)
    return batch.output({"count": new})


@rs.keyed(
    state={
        "n": rs.ValueState(int, default=0),
        "colors": rs.MapState(),
        "seqs": rs.ListState(),
        "last": rs.ValueState(object),
    }
)
def profile(key: Any, records: pa.RecordBatch, state: Any) -> Any:
    for r in records.to_pylist():
        state.n.value += 1
        state.colors[r["color"]] = state.colors.get(r["color"], 0) + 1
        state.seqs.append(r["seq"])
        state.last.value = {"seq": r["seq"], "color": r["color"]}
    yield {"n": state.n.value}


def _count_flow(name: str = "readcount") -> rs.Dataflow:
    flow = rs.Dataflow(name, num_key_groups=32, sub_groups=4)
    gen = rs.sources.generator(events=10, keys=5)
    flow.source(gen).key_by("key").apply(count, name="count").sink(rs.sinks.collect(), name="out")
    return flow


def _duckdb_counts(events: pa.Table) -> dict[int, int]:
    con = duckdb.connect()
    con.register("events", events.select(["key"]))
    return dict(con.execute("select key, count(*) from events group by key").fetchall())


@pytest.fixture(scope="module")
def int_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Checkpoint 1 after the first 30,000 events, checkpoint 2 after all 80,000 (read only by
    the tests: one that damages a checkpoint copies it first)."""
    tmp_path = tmp_path_factory.mktemp("int-checkpoints")
    events = rs.sources.generator(events=80_000, keys=3_000, zipf=1.1, seed=3).generate_all()
    flow = _count_flow()
    uri = str(tmp_path / "chk")
    inst = Instances(flow, "count", 2, tmp_path / "state", uri)
    try:
        inst.process(events.slice(0, 30_000), "key")
        inst.checkpoint(1)
        inst.process(events.slice(30_000), "key")
        inst.checkpoint(2)
    finally:
        inst.close()
    return {"flow": flow, "uri": uri, "events": events, "storage": inst.storage}


def _as_dict(table: pa.Table, key: str = "key") -> dict[Any, Any]:
    return dict(zip(table.column(key).to_pylist(), table.column("value").to_pylist(), strict=True))


def test_int_keys_each_checkpoint_holds_the_counts_of_its_prefix(
    int_checkpoints: dict[str, Any], tmp_path: Path
) -> None:
    flow, uri, events = int_checkpoints["flow"], int_checkpoints["uri"], int_checkpoints["events"]
    work = tmp_path / "work"
    work.mkdir()
    first = rs.read_state(flow, "count", checkpoint_dir=uri, checkpoint=1, work_dir=str(work))
    latest = rs.read_state(flow, "count", checkpoint_dir=uri, work_dir=str(work))
    assert list(first) == ["state"] and first.checkpoint_id == 1 and latest.checkpoint_id == 2
    table = first["state"]
    assert table.schema == pa.schema([("key", pa.int64()), ("value", pa.int64())])
    assert table.column("key").to_pylist() == sorted(table.column("key").to_pylist())
    assert _as_dict(table) == _duckdb_counts(events.slice(0, 30_000))
    assert _as_dict(latest["state"]) == _duckdb_counts(events)
    assert list(work.iterdir()) == []  # the rebuilt RocksDB folders are removed


def test_one_key_reads_only_its_rows(int_checkpoints: dict[str, Any]) -> None:
    flow, uri, events = int_checkpoints["flow"], int_checkpoints["uri"], int_checkpoints["events"]
    expected = _duckdb_counts(events)
    some = sorted(expected)[:3] + [max(expected)]
    for k in some:
        got = rs.read_state(flow, "count", checkpoint_dir=uri, key=k)["state"]
        assert got.to_pylist() == [{"key": k, "value": expected[k]}]
    absent = max(expected) + 1
    assert rs.read_state(flow, "count", checkpoint_dir=uri, key=absent)["state"].num_rows == 0


def test_savepoint_reads_like_its_checkpoint(
    int_checkpoints: dict[str, Any], tmp_path: Path
) -> None:
    flow, storage = int_checkpoints["flow"], int_checkpoints["storage"]
    storage.savepoint(1, str(tmp_path / "sp"))
    got = rs.read_state(flow, "count", savepoint=str(tmp_path / "sp"))
    assert got.checkpoint_id == 1 and "savepoint" in got.where
    assert _as_dict(got["state"]) == _duckdb_counts(int_checkpoints["events"].slice(0, 30_000))


def _profile_input(n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    users = [f"user-{i}" if i % 7 else f"ü-{i}" for i in rng.integers(0, 400, n)]
    colors = rng.choice(["red", "green", "blue"], n).tolist()
    return pa.table({"user": users, "color": colors, "seq": np.arange(n, dtype=np.int64)})


def test_string_keys_value_map_list_and_object_states(tmp_path: Path) -> None:
    rows = _profile_input(6_000, seed=1)
    flow = rs.Dataflow("profiles", num_key_groups=16, sub_groups=8)
    src = flow.source(rs.sources.from_table(rows))
    src.key_by("user").apply(profile, name="profile").sink(rs.sinks.collect(), name="out")
    inst = Instances(flow, "profile", 2, tmp_path / "state", str(tmp_path / "chk"))
    try:
        inst.process(rows, "user")
        inst.checkpoint(1)
    finally:
        inst.close()
    got = rs.read_state(flow, "profile", checkpoint_dir=str(tmp_path / "chk"))
    assert list(got) == ["n", "colors", "seqs", "last"]
    recs = rows.to_pylist()
    users = collections.Counter(r["user"] for r in recs)
    pairs = collections.Counter((r["user"], r["color"]) for r in recs)
    seqs: dict[str, list[int]] = collections.defaultdict(list)
    last: dict[str, dict[str, Any]] = {}
    for r in recs:
        seqs[r["user"]].append(r["seq"])
        last[r["user"]] = {"seq": r["seq"], "color": r["color"]}
    n = got["n"]
    assert n.schema.field("user").type == pa.string()
    assert _as_dict(n, "user") == dict(users)
    colors = got["colors"]
    assert colors.column_names == ["user", "map_key", "value"]
    assert {
        (u, c): v for u, c, v in zip(*(colors.column(i).to_pylist() for i in range(3)), strict=True)
    } == dict(pairs)
    assert colors.num_rows == len(pairs)  # one row per (key, map key)
    assert _as_dict(got["seqs"], "user") == dict(seqs)
    assert _as_dict(got["last"], "user") == last
    one = rs.read_state(flow, "profile", checkpoint_dir=str(tmp_path / "chk"), key="ü-7")
    assert one["n"].to_pylist() == [{"user": "ü-7", "value": users["ü-7"]}]
    assert one["colors"].num_rows == sum(1 for (u, _) in pairs if u == "ü-7")
    raw = rs.read_state(flow, "profile", checkpoint_dir=str(tmp_path / "chk"), decode=False)
    assert raw["seqs"].schema.field("value").type == pa.binary()


def test_binary_keys_are_found_and_read(tmp_path: Path) -> None:
    keys = [bytes([i % 251, 255, i % 7]) for i in range(3_000)]  # not UTF-8
    table = pa.table({"k": pa.array(keys, pa.binary())})
    flow = rs.Dataflow("binkeys", num_key_groups=8, sub_groups=2)
    flow.source(rs.sources.from_table(table)).key_by("k").apply(count, name="count").sink(
        rs.sinks.collect(), name="out"
    )
    inst = Instances(flow, "count", 2, tmp_path / "state", str(tmp_path / "chk"))
    try:
        inst.process(table, "k")
        inst.checkpoint(4)
    finally:
        inst.close()
    got = rs.read_state(flow, "count", checkpoint_dir=str(tmp_path / "chk"))["state"]
    assert got.schema.field("k").type == pa.binary()
    assert _as_dict(got, "k") == dict(collections.Counter(keys))


PROCESSING_BASE = 10**12  # processing-time timers far ahead: none is due in the test
WATERMARK = 60_000


def _fired(timers: rs.FiredTimers, state: Any) -> pa.RecordBatch:
    return timers.output({"fired": np.ones(len(timers), np.int64)})


@rs.keyed_batches(state=rs.ValueState(int, default=0), on_timer=_fired)
def count_and_remind(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    """Counts, and per event an event-time timer 1 s after it; keys divisible by 3 also get a
    processing-time timer."""
    new = state.get(batch.keys) + batch.counts
    state.put(batch.keys, new)
    ts = batch.records.column("ts").to_numpy()
    batch.timers.register_at(batch.key_index(), ts + 1_000)
    keys = batch.keys.keys.to_numpy()
    every3 = np.flatnonzero(keys % 3 == 0)
    batch.timers.register_processing_at(every3, PROCESSING_BASE + keys[every3])
    return batch.output({"count": new})


def _timers_flow(events: pa.Table) -> rs.Dataflow:
    flow = rs.Dataflow("timers", num_key_groups=16, sub_groups=4)
    flow.source(rs.sources.from_table(events)).key_by("key").apply(
        count_and_remind, name="count"
    ).sink(rs.sinks.collect(), name="out")
    return flow


def test_pending_timers_are_read_with_their_domain_and_timestamp(tmp_path: Path) -> None:
    """Timers registered per event, some fired by a watermark before the checkpoint: the
    reader lists exactly the pending ones (DuckDB computes them from the input)."""
    rng = np.random.default_rng(21)
    n = 20_000
    events = pa.table({"key": rng.integers(0, 500, n), "ts": rng.integers(0, 100_000, n)})
    flow = _timers_flow(events)
    inst = Instances(flow, "count", 2, tmp_path / "state", str(tmp_path / "chk"))
    try:
        inst.process(events, "key")
        fired = sum(sum(b.num_rows for b in proc.on_watermark(WATERMARK)) for proc in inst.procs)
        inst.checkpoint(1)
    finally:
        inst.close()
    con = duckdb.connect()
    con.register("events", events)
    want = con.execute(
        f"""select key, 'event' as domain, ts + 1000 as t from events where ts + 1000 > {WATERMARK}
            union
            select key, 'processing', {PROCESSING_BASE} + key from events where key % 3 = 0
            order by key, domain, t"""
    ).fetchall()
    due = con.execute(
        f"select count(*) from (select distinct key, ts from events where ts + 1000 <= {WATERMARK})"
    ).fetchone()[0]
    assert fired == due > 0  # the watermark fired some: they must be gone from the checkpoint
    got = rs.read_state(flow, "count", checkpoint_dir=str(tmp_path / "chk"))
    timers = got.timers
    assert timers.column_names == ["key", "domain", "timestamp"]
    assert list(zip(*(timers.column(c).to_pylist() for c in timers.column_names))) == want
    assert _as_dict(got["state"]) == dict(collections.Counter(events.column("key").to_pylist()))
    one = rs.read_state(flow, "count", checkpoint_dir=str(tmp_path / "chk"), key=3)
    assert one.timers.to_pylist() == [
        {"key": k, "domain": d, "timestamp": t} for k, d, t in want if k == 3
    ]
    assert "timers:" in repr(got)
    # the command line shows them after the states (text, JSON, Parquet)
    job = tmp_path / "job.py"
    job.write_text(
        "import pyarrow as pa\n"
        "from tests.unit.test_state_reader import _timers_flow\n"
        "flow = _timers_flow(pa.table({'key': [0], 'ts': [0]}))\n"
    )
    base = ["state", str(job), "count", "--checkpoint-dir", str(tmp_path / "chk")]
    runner = CliRunner()
    out = runner.invoke(cli.main, [*base, "--key", "3"])
    assert out.exit_code == 0, out.output
    pending = [(k, d, t) for k, d, t in want if k == 3]
    assert "pending timers of step 'count', checkpoint 1" in out.output
    assert f": {len(pending)} rows" in out.output
    out = runner.invoke(cli.main, [*base, "--json"])
    assert out.exit_code == 0, out.output
    rows = [json.loads(line) for line in out.output.splitlines()]
    assert [(r["key"], r["timer"], r["timestamp"]) for r in rows if "timer" in r] == want
    out = runner.invoke(cli.main, [*base, "--parquet", str(tmp_path / "pq")])
    assert out.exit_code == 0, out.output
    assert pq.read_table(tmp_path / "pq" / "pending_timers.parquet").equals(timers)


def test_timer_rows_decode_string_keys_and_a_key_column_named_timestamp() -> None:
    """Rows as the runtime's timer service encodes them (string keys, both domains) decode to
    their keys and timestamps; a key column named like a timer column leaves room for it."""
    from raystream.keys import KeySpace
    from raystream.runtime.timers import EVENT_TIMERS, PROCESSING_TIMERS, encode_timers
    from raystream.state_reader import _decode

    ks = KeySpace(8, 2)
    keys = pa.array(["b", "a", "ü", "a"], pa.string())
    kg, sg = ks.locate(keys)
    ts = np.array([300, -5, 7, 2**40])
    stored = encode_timers(kg[:3], sg[:3], EVENT_TIMERS, keys[:3], ts[:3]) + encode_timers(
        kg[3:], sg[3:], PROCESSING_TIMERS, keys[3:], ts[3:]
    )
    rows = (pa.array(stored, pa.large_binary()), pa.array([b"s"] * 4, pa.large_binary()))
    _, timers = _decode(
        rows, {}, ks, "timestamp", key_type=None, decode=True, key=None, where="test"
    )
    assert timers.to_pylist() == [
        {"timestamp": "a", "timer_domain": "event", "timer_timestamp": -5},
        {"timestamp": "a", "timer_domain": "processing", "timer_timestamp": 2**40},
        {"timestamp": "b", "timer_domain": "event", "timer_timestamp": 300},
        {"timestamp": "ü", "timer_domain": "event", "timer_timestamp": 7},
    ]


# ---- bad input ------------------------------------------------------------------------------
def test_unknown_and_stateless_steps_name_the_keyed_steps(int_checkpoints: dict[str, Any]) -> None:
    flow, uri = int_checkpoints["flow"], int_checkpoints["uri"]
    with pytest.raises(ConfigError, match=r"no step 'cnt'.*\['count'\]"):
        rs.read_state(flow, "cnt", checkpoint_dir=uri)
    with pytest.raises(ConfigError, match=r"'out' .* is a sink step.*\['count'\]"):
        rs.read_state(flow, "out", checkpoint_dir=uri)


def test_no_checkpoint_says_where_it_looked(tmp_path: Path) -> None:
    empty = tmp_path / "nothing"
    with pytest.raises(
        CheckpointError, match=rf"no complete checkpoint of job 'readcount' under {empty}"
    ):
        rs.read_state(_count_flow(), "count", checkpoint_dir=str(empty))
    assert not empty.exists()  # reading writes nothing
    with pytest.raises(CheckpointError, match=r"checkpoint 9 .* cannot be used"):
        rs.read_state(_count_flow(), "count", checkpoint_dir=str(empty), checkpoint=9)


def test_a_checkpoint_of_another_dataflow_is_refused(
    int_checkpoints: dict[str, Any], tmp_path: Path
) -> None:
    int_checkpoints["storage"].savepoint(2, str(tmp_path / "sp"))
    other = rs.Dataflow("readcount", num_key_groups=64, sub_groups=4)
    other.source(rs.sources.generator(events=10, keys=5)).key_by("key").apply(
        count, name="tally"
    ).sink(rs.sinks.collect(), name="out")
    with pytest.raises(CheckpointError, match=r"steps \['count'\] of the checkpoint are not"):
        rs.read_state(other, "tally", savepoint=str(tmp_path / "sp"))
    with pytest.raises(CheckpointError, match="num_key_groups was 32, is now 64"):
        rs.read_state(other, "tally", savepoint=str(tmp_path / "sp"))


def test_state_declarations_that_do_not_fit_are_refused(int_checkpoints: dict[str, Any]) -> None:
    @rs.keyed_batches(state={"a": rs.ValueState(float), "b": rs.MapState()})
    def other(batch: Any, state: Any) -> None:
        return None

    flow = rs.Dataflow("readcount", num_key_groups=32, sub_groups=4)
    flow.source(rs.sources.generator(events=10, keys=5)).key_by("key").apply(
        other, name="count"
    ).sink(rs.sinks.collect(), name="out")
    got = rs.read_state(flow, "count", checkpoint_dir=int_checkpoints["uri"])
    # 8-byte ints read as floats is not detectable; the map state (id 2) is simply empty
    assert got["b"].num_rows == 0 and got["a"].num_rows > 0

    @rs.keyed_batches(state=rs.ValueState(str))
    def pickled(batch: Any, state: Any) -> None:
        return None

    flow2 = rs.Dataflow("readcount", num_key_groups=32, sub_groups=4)
    flow2.source(rs.sources.generator(events=10, keys=5)).key_by("key").apply(
        pickled, name="count"
    ).sink(rs.sinks.collect(), name="out")
    with pytest.raises(SchemaError, match="cannot be unpickled"):
        rs.read_state(flow2, "count", checkpoint_dir=int_checkpoints["uri"])


def test_a_damaged_checkpoint_is_refused(int_checkpoints: dict[str, Any], tmp_path: Path) -> None:
    flow = int_checkpoints["flow"]
    uri = str(tmp_path / "copy")
    shutil.copytree(int_checkpoints["uri"], uri)
    manifest = CheckpointStorage(uri, flow.name).load(2)
    entry = manifest["instances"]["count/0"]["state"]
    sst = next(f for f in entry["files"] if f["name"].endswith(".sst"))
    path = Path(uri) / flow.name / sst["path"]
    path.write_bytes(path.read_bytes()[:-10])  # truncated: another size than recorded
    with pytest.raises(CheckpointError, match=r"checkpoint 2 .* cannot be used: file .* has"):
        rs.read_state(flow, "count", checkpoint_dir=uri, checkpoint=2)


def test_a_final_checkpoint_holds_no_keyed_state(tmp_path: Path) -> None:
    flow = _count_flow()
    storage = CheckpointStorage(str(tmp_path / "chk"), flow.name)
    manifest = build_manifest(
        job=flow.name,
        checkpoint_id=5,
        acks=[],
        finished_sources=[],
        steps={n: s.kind for n, s in flow.steps.items()},
        parallelism={"count": 1},
        routing={"count": RoutingTable.uniform(32, 1)},
        num_key_groups=32,
        sub_groups=4,
        final=True,
    )
    storage.complete(5, manifest)
    with pytest.raises(CheckpointError, match="final checkpoint.*no keyed state"):
        rs.read_state(flow, "count", checkpoint_dir=str(tmp_path / "chk"))


# ---- the command line -----------------------------------------------------------------------
def test_cli_shows_json_and_parquet(int_checkpoints: dict[str, Any], tmp_path: Path) -> None:
    job = tmp_path / "job.py"
    job.write_text(
        "import raystream as rs\n"
        "from tests.unit.test_state_reader import _count_flow\n"
        "flow = _count_flow()\n"
    )
    expected = _duckdb_counts(int_checkpoints["events"])
    k = sorted(expected)[5]
    base = ["state", str(job), "count", "--checkpoint-dir", int_checkpoints["uri"]]
    runner = CliRunner()
    out = runner.invoke(cli.main, [*base, "--key", str(k)])
    assert out.exit_code == 0, out.output
    assert "checkpoint 2" in out.output
    assert out.output.splitlines()[1:] == ["  key  value", f"  {k:<3}  {expected[k]}"]
    out = runner.invoke(cli.main, [*base, "--json", "--checkpoint", "1"])
    assert out.exit_code == 0, out.output
    lines = [json.loads(line) for line in out.output.splitlines()]
    assert {d["key"]: d["value"] for d in lines} == _duckdb_counts(
        int_checkpoints["events"].slice(0, 30_000)
    )
    out = runner.invoke(cli.main, [*base, "--parquet", str(tmp_path / "pq")])
    assert out.exit_code == 0, out.output
    assert _as_dict(pq.read_table(tmp_path / "pq" / "state.parquet")) == expected
    out = runner.invoke(cli.main, [*base[:2], "nope", "--checkpoint-dir", int_checkpoints["uri"]])
    assert out.exit_code == cli.USAGE and "no step 'nope'" in out.output


def test_checkpoints_on_s3_read_like_local_ones(tmp_path: Path) -> None:
    """The same checkpoint through ``pyarrow.fs`` S3 (a local moto server): state files are
    copied in, not linked."""
    pytest.importorskip("moto.server")
    from tests._s3 import local_s3_bucket

    events = rs.sources.generator(events=20_000, keys=1_000, zipf=1.1, seed=9).generate_all()
    flow = _count_flow("reads3")
    with local_s3_bucket("checkpoints") as endpoint:
        uri = f"s3://test:test@checkpoints/jobs?endpoint_override={endpoint}&scheme=http"
        inst = Instances(flow, "count", 2, tmp_path / "state", uri)
        try:
            inst.process(events, "key")
            inst.checkpoint(3)
        finally:
            inst.close()
        got = rs.read_state(flow, "count", checkpoint_dir=uri)
        assert got.checkpoint_id == 3
        assert _as_dict(got["state"]) == _duckdb_counts(events)
