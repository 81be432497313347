"""Spark preconditions fail with errors that say what to install; no Spark is started here."""

from __future__ import annotations

import sys

import pytest

from raystream.errors import SourceError
from raystream.spark import check_spark


def test_missing_java_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    monkeypatch.setenv("PATH", str(tmp_path))  # no java on it
    monkeypatch.delenv("JAVA_HOME", raising=False)
    with pytest.raises(SourceError, match=r"Java 17\+.*apt-get install openjdk-17-jre-headless"):
        check_spark()


def test_java_home_is_enough(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    java = tmp_path / "jdk" / "bin" / "java"
    java.parent.mkdir(parents=True)
    java.write_text("#!/bin/sh\n")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "jdk"))
    check_spark()  # no error: JAVA_HOME points at a java


def test_pyspark_not_importable_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pyspark", None)  # makes `import pyspark` fail
    with pytest.raises(SourceError, match=r"PySpark is not importable.*pip install pyspark==4.3.0"):
        check_spark()


def test_a_spark_source_needs_a_dataframe() -> None:
    import raystream as rs

    with pytest.raises(rs.ConfigError, match="expected a pyspark.sql.DataFrame, got list"):
        rs.sources.spark([1, 2, 3])


def test_spark_batches_are_recut_into_pushes_of_push_rows() -> None:
    import pyarrow as pa

    from raystream.spark import _coalesce

    sizes = [3, 0, 10, 1, 25, 2]
    start = 0
    batches = []
    for n in sizes:
        batches.append(pa.record_batch({"x": list(range(start, start + n))}))
        start += n
    pushes = list(_coalesce(iter(batches), 8))
    assert [p.num_rows for p in pushes] == [8, 8, 8, 8, 8, 1]
    assert pa.Table.from_batches(pushes).column("x").to_pylist() == list(range(sum(sizes)))
