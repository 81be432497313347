"""Where instances run: per-step Ray actor options and the choice of a node for each instance.

Pure logic over plain data (no Ray calls), so it is unit-tested without a cluster; the
controller feeds it the cluster's nodes (:func:`cluster_nodes`) and applies the choice as a
node affinity.

By default the instances of a step are spread over the alive nodes: each new instance goes to
the node with the fewest instances of that step that still has room for it (its CPUs, GPUs,
memory and custom resources), ties broken by the fewest instances of the whole job and then by
the most free CPUs. A step with its own ``scheduling_strategy`` is left to Ray.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from raystream.errors import ConfigError, PlacementError

__all__ = [
    "standby_slots",
    "ActorOptions",
    "Node",
    "PlacementError",
    "check_satisfiable",
    "choose_nodes",
    "cluster_nodes",
    "controller_options",
    "on_nodes_gone",
    "reachable_nodes",
]

_STRATEGIES = ("DEFAULT", "SPREAD")
_STRATEGY_CLASSES = (
    "NodeAffinitySchedulingStrategy",
    "PlacementGroupSchedulingStrategy",
    "NodeLabelSchedulingStrategy",
)
_RESERVED = {"CPU", "GPU", "memory", "object_store_memory"}
# the public fields of Ray's runtime_env (ray.runtime_env.RuntimeEnv.known_fields, Ray 2.x)
RUNTIME_ENV_KEYS = (
    "conda",
    "config",
    "container",
    "env_vars",
    "excludes",
    "image_uri",
    "java_jars",
    "pip",
    "py_executable",
    "py_modules",
    "uv",
    "working_dir",
    "worker_process_setup_hook",
)


@dataclass(frozen=True)
class ActorOptions:
    """Ray actor options of a step's instances (as ``@ray.remote(...)`` takes them).

    ``memory`` is in bytes; ``resources`` are custom resources (``{"ssd": 1}``);
    ``scheduling_strategy`` is ``"DEFAULT"``, ``"SPREAD"`` or a strategy object from
    ``ray.util.scheduling_strategies`` (then raystream does not choose the node);
    ``runtime_env`` is Ray's runtime environment of the step's actors (``env_vars``, ``pip``,
    ``working_dir``, ... as Ray takes them; Ray merges it with the job's own).
    """

    num_cpus: float = 0.0
    num_gpus: float = 0.0
    memory: int = 0
    resources: tuple[tuple[str, float], ...] = ()
    scheduling_strategy: Any = None
    runtime_env: dict[str, Any] | None = field(default=None, hash=False)

    @classmethod
    def of(cls, step: str, **options: Any) -> ActorOptions:
        """Validated options of step ``step``; a clear error names what is wrong."""
        known = {"num_cpus", "num_gpus", "memory", "resources", "scheduling_strategy"}
        known.add("runtime_env")
        unknown = sorted(set(options) - known)
        if unknown:
            msg = (
                f"step {step!r}: unknown actor option(s) {unknown}; the options are "
                f"{sorted(known)}"
            )
            raise ConfigError(msg)
        for name in ("num_cpus", "num_gpus", "memory"):
            value = options.get(name, 0)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value < 0
            ):
                msg = f"step {step!r}: {name} must be a number >= 0, got {value!r}"
                raise ConfigError(msg)
        resources = options.get("resources") or {}
        if not isinstance(resources, Mapping):
            msg = f"step {step!r}: resources must be a dict of name -> amount, got {resources!r}"
            raise ConfigError(msg)
        for name, amount in resources.items():
            if not isinstance(name, str) or name in _RESERVED:
                msg = (
                    f"step {step!r}: resources key {name!r} is not a custom resource; give CPUs, "
                    "GPUs and memory as num_cpus=, num_gpus=, memory="
                )
                raise ConfigError(msg)
            if isinstance(amount, bool) or not isinstance(amount, int | float) or amount < 0:
                msg = f"step {step!r}: resources[{name!r}] must be a number >= 0, got {amount!r}"
                raise ConfigError(msg)
        strategy = options.get("scheduling_strategy")
        if strategy is not None and not (
            strategy in _STRATEGIES or type(strategy).__name__ in _STRATEGY_CLASSES
        ):
            msg = (
                f"step {step!r}: scheduling_strategy must be 'DEFAULT', 'SPREAD' or an object "
                f"from ray.util.scheduling_strategies, got {strategy!r}"
            )
            raise ConfigError(msg)
        return cls(
            num_cpus=float(options.get("num_cpus", 0)),
            num_gpus=float(options.get("num_gpus", 0)),
            memory=int(options.get("memory", 0)),
            resources=tuple(sorted((k, float(v)) for k, v in resources.items())),
            scheduling_strategy=strategy,
            runtime_env=_check_runtime_env(step, options.get("runtime_env")),
        )

    @property
    def demand(self) -> dict[str, float]:
        """What one instance takes from a node, in Ray's resource names (zeros left out)."""
        out = {"CPU": self.num_cpus, "GPU": self.num_gpus, "memory": float(self.memory)}
        out.update(dict(self.resources))
        return {k: v for k, v in out.items() if v > 0}

    @property
    def is_default(self) -> bool:
        """Nothing asked for: any warm standby actor can become such an instance."""
        return not self.demand and self.scheduling_strategy is None and not self.runtime_env

    def ray_options(self, node_id: str | None = None) -> dict[str, Any]:
        """Keyword arguments for ``ActorClass.options(...)``; ``node_id`` pins to that node."""
        out: dict[str, Any] = {"num_cpus": self.num_cpus}
        if self.num_gpus:
            out["num_gpus"] = self.num_gpus
        if self.memory:
            out["memory"] = self.memory
        if self.resources:
            out["resources"] = dict(self.resources)
        if self.runtime_env:
            out["runtime_env"] = copy.deepcopy(self.runtime_env)
        if self.scheduling_strategy is not None:
            out["scheduling_strategy"] = self.scheduling_strategy
        elif node_id is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            # hard: Ray's soft affinity does not hold for zero-CPU actors (they land anywhere);
            # the node was alive a moment ago, and an actor that cannot start there fails the
            # deploy like any dead actor (recovery redeploys on the nodes alive then)
            out["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
        return out


def _check_runtime_env(step: str, env: Any) -> dict[str, Any] | None:
    """``env`` as a plain dict (a copy), checked: a dict with Ray's runtime_env keys only,
    ``env_vars`` a dict of str -> str; None or ``{}`` means none."""
    if env is None:
        return None
    if not isinstance(env, Mapping):
        msg = (
            f"step {step!r}: runtime_env must be a dict as Ray takes it (e.g. "
            f"{{'env_vars': {{'NAME': 'value'}}, 'pip': ['pkg==1.0']}}), got {env!r}"
        )
        raise ConfigError(msg)
    unknown = sorted(str(k) for k in env if k not in RUNTIME_ENV_KEYS)
    if unknown:
        msg = (
            f"step {step!r}: unknown runtime_env key(s) {unknown}; Ray's runtime_env keys are "
            f"{list(RUNTIME_ENV_KEYS)}"
        )
        raise ConfigError(msg)
    env_vars = env.get("env_vars")
    if env_vars is not None and (
        not isinstance(env_vars, Mapping)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in env_vars.items())
    ):
        msg = (
            f"step {step!r}: runtime_env['env_vars'] must be a dict of str -> str (Ray sets "
            f"them as environment variables), got {env_vars!r}"
        )
        raise ConfigError(msg)
    return copy.deepcopy(dict(env)) or None


@dataclass(frozen=True)
class Node:
    """One alive node: its id, address, total and currently free resources, and the port its
    raylet (node manager) listens on (0: not known)."""

    node_id: str
    address: str
    total: Mapping[str, float] = field(default_factory=dict)
    available: Mapping[str, float] = field(default_factory=dict)
    port: int = 0


def _fits(demand: Mapping[str, float], room: Mapping[str, float]) -> bool:
    return all(room.get(k, 0.0) + 1e-9 >= v for k, v in demand.items())


def _describe(resources: Mapping[str, float]) -> str:
    shown = {k: v for k, v in resources.items() if not k.startswith("node:") and v}
    return ", ".join(f"{k} {v:g}" for k, v in sorted(shown.items())) or "nothing"


def check_satisfiable(step: str, options: ActorOptions, nodes: Iterable[Node]) -> None:
    """Fail before anything starts if no node could ever hold one instance of ``step``."""
    nodes = list(nodes)
    demand = options.demand
    if not demand or any(_fits(demand, n.total) for n in nodes):
        return
    missing = sorted(
        {k for k, v in demand.items() if all(n.total.get(k, 0.0) + 1e-9 < v for n in nodes)}
    )
    have = "; ".join(f"{n.address} ({n.node_id[:8]}): {_describe(n.total)}" for n in nodes)
    what = ", ".join(f"{k} {demand[k]:g}" for k in missing) if missing else _describe(demand)
    msg = (
        f"step {step!r} asks for {_describe(demand)} per instance, but no node of the cluster "
        f"has {what} (nodes: {have or 'none'}). Lower the step's actor options or add a node "
        "that has them."
    )
    raise PlacementError(msg)


def choose_nodes(
    step: str,
    options: ActorOptions,
    nodes: Iterable[Node],
    count: int,
    step_placed: Mapping[str, int] | None = None,
    job_placed: Mapping[str, int] | None = None,
) -> list[str | None]:
    """A node for each of ``count`` new instances of ``step`` (None: leave it to Ray).

    ``step_placed`` / ``job_placed``: how many live instances of this step / of the whole job
    each node already holds. A node must have free room for the step's demand (taken as the
    instances are assigned); among those the fewest instances of the step wins.
    """
    nodes = list(nodes)
    if options.scheduling_strategy is not None or not nodes:
        return [None] * count
    check_satisfiable(step, options, nodes)
    demand = options.demand
    room = {n.node_id: dict(n.available) for n in nodes}
    per_step = Counter(dict(step_placed or {}))
    per_job = Counter(dict(job_placed or {}))
    out: list[str | None] = []
    for _ in range(count):
        fits = [n for n in nodes if _fits(demand, room[n.node_id])]
        if not fits:
            free = "; ".join(
                f"{n.address} ({n.node_id[:8]}): {_describe(room[n.node_id])}" for n in nodes
            )
            msg = (
                f"no node has room for another instance of step {step!r} (needs "
                f"{_describe(demand)}; free: {free}). Add a node or lower the step's actor options."
            )
            raise PlacementError(msg)
        best = min(
            fits,
            key=lambda n: (
                per_step[n.node_id],
                per_job[n.node_id],
                -room[n.node_id].get("CPU", 0.0),
                n.node_id,
            ),
        )
        for k, v in demand.items():
            room[best.node_id][k] = room[best.node_id].get(k, 0.0) - v
        per_step[best.node_id] += 1
        per_job[best.node_id] += 1
        out.append(best.node_id)
    return out


def standby_slots(
    parallelism: Mapping[str, int], taken: Iterable[tuple[str, int]], count: int
) -> list[tuple[str, int]]:
    """The ``(step, index)`` slots warm standby actors should be made for: Ray names an actor
    only when it is created, so a standby is named for the instance a scale-out would make of it
    (the next indexes of each step, taken in turn over the steps), skipping slots in ``taken``
    (a standby or a live or retiring instance holds the name). At most ``count`` slots.

    Example::

        >>> standby_slots({"a": 2, "b": 3}, [("a", 2)], 3)
        [('b', 3), ('a', 3), ('b', 4)]
    """
    held = set(taken)
    out: list[tuple[str, int]] = []
    if count <= 0 or not parallelism:
        return out
    for k in range(count + len(held)):
        for step, p in parallelism.items():
            slot = (step, p + k)
            if slot not in held and len(out) < count:
                out.append(slot)
    return out


def on_nodes_gone(nodes: Iterable[str | None], alive: Iterable[str]) -> list[int]:
    """Positions in ``nodes`` (the node of each warm actor: standbys, change spares) of those
    whose node is not in ``alive``: they died with it. None (node not known) counts as alive.

    Example::

        >>> on_nodes_gone(["a", "b", None, "b"], ["a"])
        [1, 3]
    """
    up = set(alive)
    return [k for k, n in enumerate(nodes) if n is not None and n not in up]


def controller_options(driver_node: str | None) -> dict[str, Any]:
    """Ray options that keep a job's controller on the node of the driver that starts it.

    The controller is owned by that driver and ends with it anyway (it is not detached), so on
    the driver's node it adds no way to fail; anywhere else, losing that node would end the job
    with no one left to recover it. ``None`` (the driver's node is not known): Ray chooses."""
    if not driver_node:
        return {}
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(driver_node, soft=False)}


def reachable_nodes(nodes: Iterable[Node], timeout_s: float = 1.0) -> tuple[list[Node], list[str]]:
    """``nodes`` split into those whose raylet takes a TCP connection within ``timeout_s`` and
    the ids of those whose raylet does not (refused or no answer: the machine or its raylet is
    gone, or cut off). Ray marks a lost node dead only after its health checks failed for a while
    (about 15 s by default); a recovery placing instances meanwhile asks this instead. A node
    whose port is not known counts as reachable. All nodes are probed at once."""
    import socket
    from concurrent.futures import ThreadPoolExecutor

    nodes = list(nodes)

    def answers(node: Node) -> bool:
        if not node.port or not node.address:
            return True
        try:
            with socket.create_connection((node.address, node.port), timeout=timeout_s):
                return True
        except OSError:
            return False

    if not nodes:
        return [], []
    with ThreadPoolExecutor(len(nodes)) as pool:
        up = list(pool.map(answers, nodes))
    return (
        [n for n, ok in zip(nodes, up, strict=True) if ok],
        [n.node_id for n, ok in zip(nodes, up, strict=True) if not ok],
    )


def cluster_nodes() -> list[Node]:
    """The alive nodes of the connected Ray cluster with their total and free resources."""
    import ray

    try:  # free resources per node: not in Ray's public API; totals are the fallback
        from ray._private.state import available_resources_per_node

        free = available_resources_per_node()
    except Exception:  # noqa: BLE001 - an older or newer Ray without it
        free = {}
    out = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        total = {k: float(v) for k, v in (n.get("Resources") or {}).items()}
        out.append(
            Node(
                node_id=n["NodeID"],
                address=str(n.get("NodeManagerAddress", "")),
                total=total,
                available={k: float(v) for k, v in free.get(n["NodeID"], total).items()},
                port=int(n.get("NodeManagerPort") or 0),
            )
        )
    return out
