"""Losing a node: which nodes a recovery may place instances on, and where the controller runs
(pure logic and plain sockets, no Ray)."""

from __future__ import annotations

import socket

from raystream.placement import Node, controller_options, on_nodes_gone, reachable_nodes


def _closed_port() -> int:
    """A local port nothing listens on (bound, then released: a connection is refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_node_whose_raylet_refuses_connections_is_not_reachable() -> None:
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        up = Node(
            "up" + "0" * 8, "127.0.0.1", {"CPU": 1.0}, {"CPU": 1.0}, listening.getsockname()[1]
        )
        gone = Node("gone" + "0" * 8, "127.0.0.1", {"CPU": 1.0}, {"CPU": 1.0}, _closed_port())
        unknown = Node("unknown" + "0" * 8, "127.0.0.1", {"CPU": 1.0}, {"CPU": 1.0})  # no port
        reachable, lost = reachable_nodes([gone, up, unknown], timeout_s=1.0)
    assert [n.node_id for n in reachable] == [up.node_id, unknown.node_id]
    assert lost == [gone.node_id]
    assert reachable_nodes([]) == ([], [])


def test_a_node_that_does_not_answer_in_time_is_not_reachable() -> None:
    # a non-routable address (TEST-NET-1): the connection neither succeeds nor is refused
    silent = Node("silent" + "0" * 8, "192.0.2.254", {}, {}, 9)
    reachable, lost = reachable_nodes([silent], timeout_s=0.2)
    assert reachable == [] and lost == [silent.node_id]


def test_the_controller_is_pinned_to_the_drivers_node() -> None:
    pinned = controller_options("ab" * 28)["scheduling_strategy"]
    assert type(pinned).__name__ == "NodeAffinitySchedulingStrategy"
    assert pinned.node_id == "ab" * 28 and pinned.soft is False
    assert controller_options(None) == {}


def test_warm_actors_on_a_node_that_is_gone_are_found() -> None:
    # each warm standby's / spare's node; the recovery drops those not among the live nodes
    assert on_nodes_gone(["a", "b", None, "b", "c"], ["a", "c"]) == [1, 3]
    assert on_nodes_gone(["a"], ["a", "b"]) == []
    assert on_nodes_gone([], []) == []
