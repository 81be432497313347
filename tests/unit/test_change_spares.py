"""Which warm spares a change takes, their names, and the config knob (no Ray)."""

from __future__ import annotations

from typing import Any

import pytest

from raystream.change_spares import pick_spares, spare_actor_name
from raystream.errors import ConfigError
from raystream.runtime.instance import RuntimeConfig
from tests._cli import status_output


def test_any_spares_oldest_first_when_no_node_is_asked_for() -> None:
    assert pick_spares(["a", "b", "a"], 2) == [0, 1]


def test_only_spares_on_the_asked_node() -> None:
    assert pick_spares(["a", "b", "a", "b"], 1, "b") == [1]
    assert pick_spares(["a", "b", "a", "b"], 5, "a") == [0, 2]  # fewer than asked: all there are
    assert pick_spares(["a"], 1, "c") == []


def test_no_spares_no_pick() -> None:
    assert pick_spares([], 3) == []
    assert pick_spares(["a"], 0) == []


@pytest.mark.parametrize("count", [-1, 1.5, True, "2"])
def test_a_count_that_is_not_a_number_of_instances_is_refused(count: object) -> None:
    with pytest.raises(ValueError, match="expected a number of instances >= 0"):
        pick_spares(["a"], count)  # type: ignore[arg-type]


def test_spares_are_named_neutrally_per_job() -> None:
    assert spare_actor_name("keycount", 3) == "raystream:keycount:spare:3"


def test_config_knobs() -> None:
    assert RuntimeConfig().change_spares == 0
    assert RuntimeConfig(change_spares=2).change_spares == 2
    with pytest.raises(ConfigError, match="change_spares must be an int >= 0"):
        RuntimeConfig(change_spares=-1)
    with pytest.raises(ConfigError, match="change_spare_refill_delay_s must be a number >= 0"):
        RuntimeConfig(change_spare_refill_delay_s=-0.5)


def test_cli_status_names_the_actors_of_inserted_and_moved_instances(monkeypatch: Any) -> None:
    status = {
        "job": "kc",
        "state": "running",
        "parallelism": {"source": 1, "tally": 2, "out": 1},
        "instances": [],
        "graph_version": 2,
        "graph": [],
        "actor_names": {"tally/1": "raystream:kc:spare:2", "tally/0": "raystream:kc:spare:1"},
        "reconfigurations": [],
    }

    out = status_output(monkeypatch, status)
    assert "actors: tally/0 in raystream:kc:spare:1, tally/1 in raystream:kc:spare:2" in out
