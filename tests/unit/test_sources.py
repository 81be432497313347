"""Sources: the generator, Parquet and in-memory sources, each against an independent oracle."""

from __future__ import annotations

import pickle
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raystream import sources
from raystream.errors import ConfigError, SchemaError, SourceError


def read_all(reader: sources.SourceReader, max_rows: int) -> list[pa.RecordBatch]:
    batches = []
    while (batch := reader.read(max_rows)) is not None:
        assert 0 < batch.num_rows <= max_rows
        batches.append(batch)
    assert reader.read(max_rows) is None  # stays exhausted
    reader.close()
    return batches


def instance_table(src: sources.Source, index: int, parallelism: int, max_rows: int) -> pa.Table:
    return pa.Table.from_batches(
        read_all(src.open(index, parallelism), max_rows), schema=src.schema()
    )


# ------------------------------------------------------------------------------------------
# generator


@pytest.mark.parametrize("parallelism", [1, 2, 3])
def test_generator_instances_partition_the_global_stream(parallelism: int) -> None:
    gen = sources.generator(events=10_500, keys=300, zipf=1.1, seed=3, chunk_rows=1000)
    everything = gen.generate_all()["key"].to_pylist()
    per_instance = [
        instance_table(gen, i, parallelism, max_rows=333)["key"].to_pylist()
        for i in range(parallelism)
    ]
    # As a multiset ...
    union = Counter()
    for keys in per_instance:
        union.update(keys)
    assert union == Counter(everything)
    # ... and exactly: instance i holds chunks i, i+P, ... in order.
    chunks = [everything[c * 1000 : (c + 1) * 1000] for c in range(gen.num_chunks)]
    for i, keys in enumerate(per_instance):
        assert keys == [k for chunk in chunks[i::parallelism] for k in chunk]


@pytest.mark.parametrize("parallelism", [1, 3])
def test_generator_seq_counts_each_key_within_an_instance(parallelism: int) -> None:
    gen = sources.generator(events=5_000, keys=50, zipf=1.3, seed=11, chunk_rows=700)
    for i in range(parallelism):
        t = instance_table(gen, i, parallelism, max_rows=256)
        seen: dict[int, int] = defaultdict(int)
        for key, seq in zip(t["key"].to_pylist(), t["seq"].to_pylist(), strict=True):
            assert seq == seen[key]
            seen[key] += 1


def test_generate_all_seq_is_global_and_equals_one_instance() -> None:
    gen = sources.generator(events=3_000, keys=20, seed=5, chunk_rows=500)
    whole = gen.generate_all()
    assert whole.equals(instance_table(gen, 0, 1, max_rows=97))
    seen: dict[int, int] = defaultdict(int)
    for key, seq in zip(whole["key"].to_pylist(), whole["seq"].to_pylist(), strict=True):
        assert seq == seen[key]
        seen[key] += 1


def test_generator_is_deterministic_and_seeded() -> None:
    a = sources.generator(events=4_000, keys=100, seed=1).generate_all()
    b = sources.generator(events=4_000, keys=100, seed=1).generate_all()
    c = sources.generator(events=4_000, keys=100, seed=2).generate_all()
    assert a.equals(b)
    assert not a.equals(c)
    assert a.schema == pa.schema([("key", pa.int64()), ("seq", pa.int64())])


def zipf_pmf(keys: int, s: float) -> np.ndarray:
    w = np.array([1.0 / (r**s) for r in range(1, keys + 1)])
    return w / w.sum()


@pytest.mark.parametrize("zipf", [0.0, 1.1])
def test_generator_key_frequencies_follow_bounded_zipf(zipf: float) -> None:
    keys, events = 50, 200_000
    gen = sources.generator(events=events, keys=keys, zipf=zipf, seed=7)
    ids = gen.generate_all()["key"].to_numpy()
    assert ids.min() >= 0 and ids.max() < keys
    freq = np.bincount(ids, minlength=keys) / events
    pmf = zipf_pmf(keys, zipf)
    tol = 5 * np.sqrt(pmf * (1 - pmf) / events) + 1e-3
    # Ranks are hidden behind a permutation: compare sorted frequencies with the sorted pmf ...
    assert np.all(np.abs(np.sort(freq)[::-1] - pmf) <= tol)
    # ... and per key id with the generator's own statement of its distribution.
    probs = gen.key_probabilities()
    assert np.allclose(np.sort(probs)[::-1], pmf)
    assert np.all(np.abs(freq - probs) <= 5 * np.sqrt(probs * (1 - probs) / events) + 1e-3)


def _zipf_cdf(keys: int, s: float) -> np.ndarray:
    cdf = np.cumsum(np.arange(1, keys + 1, dtype=np.float64) ** -s)
    cdf /= cdf[-1]
    cdf[-1] = 1.0
    return cdf


@pytest.mark.parametrize(
    ("keys", "zipf", "bits"),
    [
        (1_000_000, 1.1, 20),
        (100_000, 0.0, 20),
        (50_000, 2.0, 20),
        (1, 1.1, 20),
        (7, 2.0, 4),
        (5_000, 1.1, 3),
    ],
)
def test_inverse_cdf_gives_searchsorted_ranks(keys: int, zipf: float, bits: int) -> None:
    """The guide-table draw gives exactly numpy's searchsorted rank, for random draws and for
    draws on every edge: bucket starts, the CDF's own values and their float neighbours."""
    cdf = _zipf_cdf(keys, zipf)
    guide = sources.guide_table(cdf, bits)
    m = len(guide) - 1
    assert m == 1 << bits and guide[0] == 0 and guide[-1] == keys
    edges = np.concatenate(
        [
            np.arange(0, m, max(1, m // 5000)) / m,
            cdf[:-1],
            np.nextafter(cdf[:-1], 0.0),
            np.nextafter(cdf[:-1], 2.0),
            [0.0, np.nextafter(1.0, 0.0)],
        ]
    )
    edges = edges[(edges >= 0.0) & (edges < 1.0)]
    for u in (np.random.default_rng(keys).random(300_000), edges):
        want = np.searchsorted(cdf, u, side="right")
        got = sources.inverse_cdf(cdf, guide, u, min_draws=0)  # the guide path, at any size
        assert np.array_equal(got, want), f"{np.flatnonzero(got != want)[:5]} differ"
        assert got.min() >= 0 and got.max() < keys
        # the default: small draws take searchsorted itself, large ones the guide
        assert np.array_equal(sources.inverse_cdf(cdf, guide, u[:10]), want[:10])
        assert np.array_equal(sources.inverse_cdf(cdf, guide, u), want)


@pytest.mark.parametrize("hot", [0.0, 0.3])
def test_generator_stream_is_drawn_with_searchsorted_ranks(hot: float) -> None:
    """The generator's keys are those of a plain searchsorted draw of each chunk's uniforms (the
    hot key's events drawn after them), whatever the size of each read."""
    events, keys, rows = 150_000, 20_000, 65_536
    gen = sources.generator(
        events=events, keys=keys, zipf=1.1, seed=5, chunk_rows=rows, hot_key_fraction=hot
    )
    cdf = _zipf_cdf(keys, 1.1)
    key_of_rank = np.random.default_rng([5, 0x5EED, 0xC0FFEE]).permutation(keys)
    want = []
    for c in range(gen.num_chunks):
        n = min(rows, events - c * rows)
        rng = np.random.default_rng([5, c])
        ranks = np.searchsorted(cdf, rng.random(n), side="right")
        if hot:
            ranks[rng.random(n) < hot] = 0
        want.append(key_of_rank[ranks])
    want_ids = np.concatenate(want)
    whole = gen.generate_all()
    assert np.array_equal(whole["key"].to_numpy(), want_ids)
    # small reads (a paced source's) and reads across chunk ends: the same stream, same seq
    for max_rows in (500, 40_000):
        table = instance_table(gen, 0, 1, max_rows)
        assert table.equals(whole), f"reads of {max_rows} rows differ"


def test_generator_spreads_hot_keys_over_the_key_space() -> None:
    gen = sources.generator(events=100_000, keys=1000, zipf=1.1, seed=0)
    top10 = np.argsort(gen.key_probabilities())[::-1][:10]
    assert sorted(top10.tolist()) != list(range(10))


def test_hot_key_fraction_sends_half_the_events_to_one_key() -> None:
    keys, events = 1000, 100_000
    gen = sources.generator(events=events, keys=keys, zipf=0.0, seed=4, hot_key_fraction=0.5)
    counts = Counter(gen.generate_all()["key"].to_pylist())
    (hot, n_hot), (_, n_second) = counts.most_common(2)
    assert abs(n_hot / events - (0.5 + 0.5 / keys)) < 0.01
    assert n_second / events < 0.01


def test_string_keys_name_the_same_key_ids() -> None:
    ints = sources.generator(events=2_000, keys=30, seed=9, chunk_rows=300).generate_all()
    strs = sources.generator(
        events=2_000, keys=30, seed=9, chunk_rows=300, key_type="str"
    ).generate_all()
    assert strs.schema.field("key").type == pa.string()
    assert strs["key"].to_pylist() == [f"k{k}" for k in ints["key"].to_pylist()]
    assert strs["seq"].equals(ints["seq"])


def test_generator_to_parquet_roundtrip(tmp_path: Path) -> None:
    gen = sources.generator(events=2_500, keys=40, seed=2, chunk_rows=1000)
    path = gen.to_parquet(tmp_path / "events.parquet")
    assert pq.read_table(path).equals(gen.generate_all())
    assert pq.ParquetFile(path).num_row_groups == 3


def test_generator_without_events() -> None:
    gen = sources.generator(events=0, keys=5)
    assert gen.open(0, 2).read(10) is None
    assert gen.generate_all().num_rows == 0


def test_generator_spec_pickles_small() -> None:
    gen = sources.generator(events=10**9, keys=10**6)
    assert len(pickle.dumps(gen)) < 1000
    assert pickle.loads(pickle.dumps(gen)) == gen
    assert isinstance(gen, sources.Source)
    assert "keys=1000000" in gen.describe()


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"events": -1}, "events"),
        ({"keys": 0}, "keys"),
        ({"zipf": -0.5}, "zipf"),
        ({"zipf": float("nan")}, "zipf"),
        ({"hot_key_fraction": 1.5}, "hot_key_fraction"),
        ({"key_type": "bytes"}, "key_type"),
        ({"rate_eps": -1}, "rate_eps"),
        ({"chunk_rows": 0}, "chunk_rows"),
        ({"seed": -1}, "seed"),
    ],
)
def test_generator_rejects_bad_arguments(kwargs: dict, fragment: str) -> None:
    args = {"events": 10, "keys": 5} | kwargs
    with pytest.raises(ConfigError, match=fragment):
        sources.generator(**args)


def test_open_and_read_reject_bad_arguments() -> None:
    gen = sources.generator(events=10, keys=5)
    with pytest.raises(ConfigError, match="index"):
        gen.open(2, 2)
    with pytest.raises(ConfigError, match="parallelism"):
        gen.open(0, 0)
    with pytest.raises(ConfigError, match="max_rows"):
        gen.open(0, 1).read(0)


# ------------------------------------------------------------------------------------------
# parquet


def write_ids(path: Path, start: int, n: int, row_group_size: int) -> pa.Table:
    ids = np.arange(start, start + n, dtype=np.int64)
    names = pa.array([f"n{i}" for i in ids], type=pa.string())
    t = pa.table({"id": ids, "key": ids % 7, "name": names})
    pq.write_table(t, path, row_group_size=row_group_size)
    return t


def union_sorted(src: sources.Source, parallelism: int, max_rows: int) -> pa.Table:
    parts = [instance_table(src, i, parallelism, max_rows) for i in range(parallelism)]
    return pa.concat_tables(parts).sort_by("id")


@pytest.mark.parametrize("parallelism", [1, 2, 5])
def test_parquet_file_roundtrip(tmp_path: Path, parallelism: int) -> None:
    path = tmp_path / "one.parquet"
    write_ids(path, 0, 1_050, row_group_size=100)
    src = sources.parquet(path, batch_rows=64)
    expected = pq.read_table(path)
    assert src.schema().equals(expected.schema, check_metadata=False)
    assert union_sorted(src, parallelism, max_rows=150).equals(expected.sort_by("id"))


@pytest.mark.parametrize("parallelism", [1, 3, 20])
def test_parquet_directory_roundtrip(tmp_path: Path, parallelism: int) -> None:
    for i, n in enumerate([300, 0, 455, 17]):
        write_ids(tmp_path / f"part-{i}.parquet", i * 1000, n, row_group_size=128)
    write_ids(tmp_path / "_ignored.parquet", 99_000, 5, row_group_size=128)
    (tmp_path / "README.txt").write_text("not parquet, not matched")
    src = sources.parquet(tmp_path)
    expected = pa.concat_tables([pq.read_table(tmp_path / f"part-{i}.parquet") for i in range(4)])
    assert len(src.files) == 4
    got = union_sorted(src, parallelism, max_rows=100)
    assert got.num_rows == 772
    assert got.equals(expected.sort_by("id"))


def test_parquet_single_instance_keeps_file_order(tmp_path: Path) -> None:
    a = write_ids(tmp_path / "a.parquet", 0, 250, row_group_size=60)
    b = write_ids(tmp_path / "b.parquet", 500, 90, row_group_size=60)
    got = instance_table(sources.parquet(tmp_path, batch_rows=33), 0, 1, max_rows=1000)
    assert got.equals(pa.concat_tables([a, b]))


def test_parquet_missing_path(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="no such file or directory.*expected a Parquet file"):
        sources.parquet(tmp_path / "nope.parquet")


def test_parquet_not_a_parquet_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.parquet"
    bad.write_text("key,value\n1,2\n")
    with pytest.raises(SourceError, match="bad.parquet"):
        sources.parquet(bad)
    with pytest.raises(SourceError, match="bad.parquet"):
        sources.parquet(tmp_path)


def test_parquet_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=r"no \*\.parquet files"):
        sources.parquet(tmp_path)


def test_parquet_schema_mismatch_names_both_files(tmp_path: Path) -> None:
    pq.write_table(pa.table({"key": [1, 2]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"key": ["x", "y"]}), tmp_path / "b.parquet")
    with pytest.raises(SchemaError, match=r"a\.parquet.*b\.parquet.*key: int64 vs string"):
        sources.parquet(tmp_path)


def test_parquet_spec_pickles_and_reads_elsewhere(tmp_path: Path) -> None:
    t = write_ids(tmp_path / "x.parquet", 0, 100, row_group_size=30)
    src = pickle.loads(pickle.dumps(sources.parquet(tmp_path)))
    assert instance_table(src, 0, 1, max_rows=1000).equals(t)
    assert "4 row group(s)" in src.describe()


# ------------------------------------------------------------------------------------------
# in-memory table


@pytest.mark.parametrize("parallelism", [1, 2, 3, 7])
def test_from_table_slices_cover_the_table_in_order(parallelism: int) -> None:
    t = pa.table({"key": list(range(20)), "v": [float(i) for i in range(20)]})
    parts = [instance_table(sources.from_table(t), i, parallelism, 4) for i in range(parallelism)]
    assert pa.concat_tables(parts).equals(t)


def test_from_table_accepts_batches_and_rejects_other_things() -> None:
    b1 = pa.record_batch({"key": [1, 2]})
    b2 = pa.record_batch({"key": [3]})
    src = sources.from_table([b1, b2])
    assert instance_table(src, 0, 1, 10)["key"].to_pylist() == [1, 2, 3]
    assert sources.from_table(b1).schema() == b1.schema
    with pytest.raises(ConfigError, match="pyarrow Table"):
        sources.from_table([])
    with pytest.raises(ConfigError, match="dict"):
        sources.from_table({"key": [1]})  # type: ignore[arg-type]
    with pytest.raises(SchemaError, match="different schemas"):
        sources.from_table([b1, pa.record_batch({"other": [1]})])


@pytest.mark.parametrize("distinct", [50, 70_000])  # radix path and the >65,536-keys path
def test_cumcount_vs_python(distinct: int) -> None:
    from raystream.sources import _cumcount

    ids = np.random.default_rng(3).integers(0, distinct, size=200_000)
    within, keys, counts = _cumcount(ids)
    seen: Counter = Counter()
    expected = []
    for k in ids.tolist():
        expected.append(seen[k])
        seen[k] += 1
    assert within.tolist() == expected
    assert dict(zip(keys.tolist(), counts.tolist(), strict=True)) == dict(seen)
