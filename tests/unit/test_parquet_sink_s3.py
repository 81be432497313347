"""The Parquet sink on an object store: S3 served by a local moto server (skipped without moto).
Two-phase commit, rolling and upsert output, crashes at random points (also between the copy
and the delete of a publish), and bad URIs. The reader is boto3 listing the bucket the way a
``folder/*.parquet`` glob picks files (names ending in ``.parquet``, not hidden) and pyarrow
reading those objects; the oracle is numpy ranges and a dict of every key's last change. No Ray.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import boto3
import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

import raystream as rs
from raystream import sinks
from raystream.errors import ConfigError
from tests._s3 import local_s3_bucket

moto_server = pytest.importorskip("moto.server")

BUCKET = "sinks"


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with local_s3_bucket(BUCKET) as ep:
        yield ep


def uri(endpoint: str, prefix: str) -> str:
    return (
        f"s3://test:test@{BUCKET}/{prefix}?endpoint_override={endpoint}"
        "&scheme=http&region=us-east-1"
    )


def client(endpoint: str) -> object:
    return boto3.client(
        "s3",
        endpoint_url=f"http://{endpoint}",
        aws_access_key_id="test",
        aws_secret_access_key="test",  # noqa: S106 - moto's dummy credentials
        region_name="us-east-1",
    )


def keys(endpoint: str, prefix: str) -> list[str]:
    """Every object name directly below ``prefix`` (directory markers left out)."""
    out = client(endpoint).list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/")  # type: ignore[attr-defined]
    names = [o["Key"][len(prefix) + 1 :] for o in out.get("Contents", [])]
    return sorted(n for n in names if n and "/" not in n)


def visible(endpoint: str, prefix: str) -> list[str]:
    return [n for n in keys(endpoint, prefix) if n.endswith(".parquet") and n[0] not in "._"]


def read_visible(endpoint: str, prefix: str) -> pa.Table:
    """What a reader of ``prefix/*.parquet`` sees, sorted by id."""
    fs = pafs.S3FileSystem(
        access_key="test",
        secret_key="test",  # noqa: S106 - moto's dummy credentials
        endpoint_override=endpoint,
        scheme="http",
        region="us-east-1",
    )
    tables = [
        pq.read_table(f"{BUCKET}/{prefix}/{n}", filesystem=fs) for n in visible(endpoint, prefix)
    ]
    if not tables:
        return oracle()
    return pa.concat_tables(tables).sort_by("id")


def oracle(*ranges: tuple[int, int]) -> pa.Table:
    parts = [np.arange(a, b, dtype=np.int64) for a, b in ranges]
    ids = np.sort(np.concatenate(parts)) if parts else np.array([], dtype=np.int64)
    return pa.table({"id": ids, "v": ids.astype(np.float64) / 2})


def test_parts_appear_only_at_commit_and_whole(endpoint: str) -> None:
    sink = rs.sinks.parquet(uri(endpoint, "commit"))
    writer = sink.open(0, 1)
    assert isinstance(writer, sinks.CommittingSinkWriter)
    writer.write(oracle((0, 100)).to_batches()[0])
    assert keys(endpoint, "commit") == []  # the open part is on local disk
    state = json.loads(json.dumps(writer.pre_commit(1)))
    assert state["pending"] == [
        {"file": ".part-00000-00000001.parquet.pending", "checkpoint": 1, "rows": 100}
    ]
    assert keys(endpoint, "commit") == [".part-00000-00000001.parquet.pending"]
    assert visible(endpoint, "commit") == []  # durable, not visible
    writer.write(oracle((100, 130)).to_batches()[0])
    writer.pre_commit(2)
    writer.commit(1)
    assert visible(endpoint, "commit") == ["part-00000-00000001.parquet"]
    assert read_visible(endpoint, "commit").equals(oracle((0, 100)))
    writer.commit(1)  # idempotent
    writer.write(oracle((130, 140)).to_batches()[0])
    result = writer.close()
    assert keys(endpoint, "commit") == [
        "part-00000-00000001.parquet",
        "part-00000-00000002.parquet",
        "part-00000.parquet",
    ]
    assert result.rows == 140
    assert result.paths == tuple(f"s3://{BUCKET}/commit/{n}" for n in keys(endpoint, "commit"))
    assert "test:test" not in sink.describe() and "***@" in sink.describe()
    assert read_visible(endpoint, "commit").equals(oracle((0, 140)))


def test_restore_publishes_listed_parts_once_and_drops_the_rest(endpoint: str) -> None:
    sink = rs.sinks.parquet(uri(endpoint, "restore"))
    w0 = sink.open(0, 2)
    w0.write(oracle((0, 50)).to_batches()[0])
    s1 = json.loads(json.dumps(w0.pre_commit(1)))
    # checkpoint 1 completes; the publish copied the part, then the process died before the
    # pending object was deleted: both are in the bucket
    fs, root = pafs.FileSystem.from_uri(uri(endpoint, "restore"))
    fs.copy_file(
        f"{root}/.part-00000-00000001.parquet.pending", f"{root}/part-00000-00000001.parquet"
    )
    w0.write(oracle((50, 80)).to_batches()[0])
    w0.pre_commit(2)  # checkpoint 2 never completes
    w1 = sink.open(1, 2)  # another instance's committed part is left alone
    w1.write(oracle((1000, 1010)).to_batches()[0])
    w1.pre_commit(1)
    w1.commit(1)
    del w0
    for _attempt in range(2):  # restoring twice (a crash during recovery) gives the same files
        again = sink.open(0, 2)
        again.restore(s1)
    assert keys(endpoint, "restore") == [
        "part-00000-00000001.parquet",
        "part-00001-00000001.parquet",
    ]
    again.write(oracle((50, 80)).to_batches()[0])  # the replay after checkpoint 1
    assert again.close().rows == 80
    assert read_visible(endpoint, "restore").equals(oracle((0, 80), (1000, 1010)))


def test_exactly_once_over_crashes_with_rolling(endpoint: str) -> None:
    """Ids 0..n-1 in batches through a rolling sink, checkpoints at random (some never complete,
    some complete without their commit), three crashes; recovery from the last complete
    checkpoint replays from its offset. A reader sees every id once, and a pre-commit makes
    nothing new visible (only a commit does)."""
    rng = np.random.default_rng(7)
    prefix = "crash"
    n, size = 700, 41
    crash_at = {4, 11, 19}  # the n-th batch written (over all attempts) is followed by a crash
    sink = rs.sinks.parquet(uri(endpoint, prefix), max_file_bytes=2_000)
    complete: dict | None = None
    cid, written = 0, 0
    while True:
        writer = sink.open(0, 1)
        writer.restore(complete["sink"] if complete else None)
        offset = complete["offset"] if complete else 0
        crashed = False
        while offset < n:
            hi = min(offset + size, n)
            writer.write(oracle((offset, hi)).to_batches()[0])
            offset, written = hi, written + 1
            if rng.random() < 0.4:
                cid += 1
                before = visible(endpoint, prefix)
                state = json.loads(json.dumps(writer.pre_commit(cid)))
                assert visible(endpoint, prefix) == before
                if rng.random() < 0.8:
                    complete = {"offset": offset, "sink": state}
                    if rng.random() < 0.8:
                        writer.commit(cid)
            if written in crash_at:
                crashed = True
                break  # no close, no abort
        if not crashed:
            writer.close()
            break
    assert written > max(crash_at)
    assert read_visible(endpoint, prefix).equals(oracle((0, n)))
    assert not [k for k in keys(endpoint, prefix) if k.startswith(".")]
    assert any("-r" in k for k in visible(endpoint, prefix))  # it rolled


def test_upsert_output_read_back_from_the_bucket(endpoint: str) -> None:
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 40, 600)
    vals = rng.integers(0, 1_000, 600)
    ops = rng.choice(["+I", "+U", "-D"], 600, p=[0.4, 0.45, 0.15])
    expect: dict[int, int] = {}
    for k, v, op in zip(ids.tolist(), vals.tolist(), ops.tolist(), strict=True):
        if op == "-D":
            expect.pop(k, None)
        else:
            expect[k] = v
    target = uri(endpoint, "upsert")
    w = rs.sinks.parquet(target, mode="upsert", key=["id"], kind_column="op").open(0, 1)
    for lo in range(0, 600, 100):
        w.write(
            pa.record_batch(
                {"id": ids[lo : lo + 100], "v": vals[lo : lo + 100], "op": ops[lo : lo + 100]}
            )
        )
        w.pre_commit(lo // 100 + 1)
        if lo < 400:
            w.commit(lo // 100 + 1)
    w.close()
    got = rs.read_upsert(target)
    assert dict(zip(got["id"].to_pylist(), got["v"].to_pylist(), strict=True)) == expect
    fs, root = pafs.FileSystem.from_uri(target)
    assert rs.read_upsert(root, filesystem=fs).equals(got)


def test_bad_uris_and_an_unwritable_bucket(endpoint: str) -> None:
    with pytest.raises(
        ConfigError, match="scheme 'ftp'.*expected a local folder or a pyarrow.fs URI"
    ):
        rs.sinks.parquet("ftp://host/out")
    with pytest.raises(ConfigError, match="names no bucket"):
        rs.sinks.parquet("s3:///out")
    assert rs.sinks.parquet("file:///tmp/raystream-out").path == "/tmp/raystream-out"
    missing = (
        f"s3://test:test@no-such-bucket/out?endpoint_override={endpoint}"
        "&scheme=http&region=us-east-1"
    )
    sink = rs.sinks.parquet(missing)  # defining the flow needs no network
    with pytest.raises(
        ConfigError, match="cannot be written.*bucket to exist and credentials"
    ) as e:
        sink.check_writable()
    assert "test:test" not in str(e.value)
    with pytest.raises(ConfigError, match="cannot be written"):
        sink.open(0, 1)


def test_deferred_upload_runs_after_the_barrier_and_a_failed_one_is_retried(
    endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runtime takes the state at the barrier and runs the upload in a thread while rows
    flow on; an upload that failed (that checkpoint fails) goes with the next pre-commit."""
    writer = rs.sinks.parquet(uri(endpoint, "deferred"), mode="upsert", key=["id"]).open(0, 1)
    assert writer.slow_commit
    writer.write(oracle((0, 20)).to_batches()[0])
    state, upload = writer.pre_commit_deferred(1)
    assert [p["file"] for p in state["pending"]] == [".part-00000-00000001.parquet.pending"]
    assert state["next_seq"] == 20 and upload is not None
    writer.write(oracle((20, 30)).to_batches()[0])  # the next part, while the upload waits
    assert keys(endpoint, "deferred") == []
    store = writer._inner._store  # noqa: SLF001
    real_put = store.put

    def refuse(staged: str, name: str) -> None:
        raise OSError("the store refused the upload")

    monkeypatch.setattr(store, "put", refuse)
    with pytest.raises(OSError, match="refused"):
        upload()  # checkpoint 1 fails
    monkeypatch.setattr(store, "put", real_put)
    state2, upload2 = writer.pre_commit_deferred(2)
    assert upload2 is not None
    upload2()  # both parts now
    assert keys(endpoint, "deferred") == [
        ".part-00000-00000001.parquet.pending",
        ".part-00000-00000002.parquet.pending",
    ]
    assert writer.pre_commit_deferred(3)[1] is None  # nothing new, nothing to upload
    writer.commit(2)
    # two checkpoints' uploads out of order: the later one uploads both, the earlier then skips
    writer.write(oracle((30, 40)).to_batches()[0])
    _, upload4 = writer.pre_commit_deferred(4)
    writer.write(oracle((40, 45)).to_batches()[0])
    _, upload5 = writer.pre_commit_deferred(5)
    assert upload4 is not None and upload5 is not None
    upload5()
    upload4()
    writer.commit(5)
    writer.write(oracle((45, 50)).to_batches()[0])
    writer.close()
    assert [k for k in keys(endpoint, "deferred") if k.startswith(".")] == []
    got = rs.read_upsert(uri(endpoint, "deferred"))
    assert got.sort_by("id").equals(oracle((0, 50)))
