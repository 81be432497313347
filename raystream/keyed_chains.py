"""Steps chained after a keyed step follow its rescales: the controller's side.

The stateless steps and the sink that run in the actors of the keyed step before them
(:mod:`raystream.chaining`) have that step's parallelism, as a Flink chain has one parallelism.
A mixin of :class:`raystream.controller.Controller`:

- **Scale-out**: each new instance of the keyed step is a chain actor with a new instance of each
  follower in it. A sink opens a new writer (a sink index a retired instance had once gets a new
  writer index, so its files never meet the retired one's); the chain's tail sends to the next
  steps as it runs now (their routing tables), and those take the tail's new instances as new
  inputs before they run, as when a keyed step feeding another one scales out.
- **Scale-in**: a retired keyed instance ends once it handed its state over; its followers then
  end as at the end of input: a tail ends its outputs (the next steps see that input end), a
  two-phase sink pre-commits what it wrote since the last checkpoint. When the job checkpoints
  and a sink is chained, the rescale takes a checkpoint right away that records and publishes
  those ends (as Flink's committables of a retiring subtask go with the savepoint of the
  rescale), so nothing is lost or written twice whatever fails later; then the chain actor
  stops. Without checkpoints the sink publishes at its end (``close()``), as every sink does.
- **Recovery** restarts the chains at the keyed step's current parallelism; each sink instance
  keeps its writer index. Every checkpoint lists the states of the retired sink instances (and
  the checkpoint may hold instances the job no longer has, when a scale-in came after it); a
  restore folds those into the sink's first instance (``fold_sink_states``: a collect sink's
  stored rows, a Parquet sink's parts), so their committed output stays committed, once.
- Moving one instance of such a keyed step to another node is refused: its followers would have
  to move with it (start the job with ``chain=False`` on the first follower to move instances).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any

import ray

from raystream.errors import ReconfigurationError
from raystream.runtime.instance import InstanceSpec, OutputSpec
from raystream.runtime.messages import ChannelId

__all__ = ["KeyedChains"]

log = logging.getLogger("raystream.keyed_chains")

RETIRE_WAIT_S = 60.0  # a retired chain's instances end this soon after the rescale, or are left


class KeyedChains:
    """Keyed steps with steps chained after them (mixed into the Controller)."""

    def _followers(self: Any, step: str) -> list[str]:
        """The steps chained after keyed step ``step``, in chain order ([]: none)."""
        return [f for f, keyed in self.following.items() if keyed == step]

    def _chain_ids(self: Any, iid: ChannelId) -> list[ChannelId]:
        """The instances in the actor of ``iid`` when it is a keyed instance or a step chained
        after one (head first); else ``[iid]``."""
        step, i = iid
        keyed = self.following.get(step, step)
        return [(keyed, i)] + [(f, i) for f in self._followers(keyed)]

    def _check_movable(self: Any, step: str) -> None:
        followers = self._followers(step)
        if followers:
            msg = (
                f"cannot move an instance of {step!r}: {followers} run chained in its actors "
                f"(operator chaining) and would have to move with it; start the job with "
                f"flow.options({followers[0]!r}, chain=False) (or chaining=False) to move "
                "instances"
            )
            raise ReconfigurationError(msg)

    def _chained_spawn(
        self: Any, step: str, spec: InstanceSpec, parallelism: int, register: bool = True
    ) -> tuple[Any, list[InstanceSpec]]:
        """What the actor of new instance ``spec`` of keyed step ``step`` runs: the spec itself,
        or (steps follow it) a ChainSpec of it and a new instance of each follower at
        ``parallelism`` (registered with the plan; the tail's outputs as the next steps run
        now). Returns (actor spec, the followers' specs). ``register=False`` (a warm standby
        prepared ahead): nothing registered, no sink writer index taken."""
        from raystream.runtime.chain import ChainSpec

        followers = self._followers(step)
        if not followers:
            return spec, []
        i = spec.index
        ids = [(step, i)] + [(f, i) for f in followers]
        members: list[InstanceSpec] = []
        for k, (f, _) in enumerate(ids[1:], start=1):
            template: InstanceSpec = self.specs[(f, 0)]
            tail = k == len(ids) - 1
            outputs = (
                tuple(self._current_output(o) for o in template.outputs)
                if tail
                else (_local(ids[k + 1]),)
            )
            member = replace(
                template,
                step=replace(template.step, parallelism=parallelism),
                index=i,
                inputs=(ids[k - 1],),
                outputs=outputs,
                restore=None,
                sink_writer=(
                    self._writer_for(ids[k], take=register)
                    if template.step.kind == "sink"
                    else None
                ),
            )
            members.append(member)
        head = replace(spec, outputs=(_local(ids[1]),))
        if not register:
            return ChainSpec((head, *members)), members
        for s in (head, *members):
            self.specs[s.id] = s
            self.plan.instances[s.id] = s
        self.plan.chains[(step, i)] = tuple(ids)
        return ChainSpec((head, *members)), members

    def _writer_for(self: Any, sid: ChannelId, take: bool = True) -> int | None:
        """The writer index of a new sink instance ``sid``: its own index unless a writer of
        its step ever had that one (a retired instance's files), else one above all of them.
        ``take=False``: the index it would get now, nothing taken."""
        sink, i = sid
        used: set[int] = self._writers_used.setdefault(sink, set())
        if not used:  # the instances the job started with
            used.update(range(self.plan.steps[sink].parallelism or 1))
        w = i if i not in used else max(used) + 1
        if not take:
            return None if w == i else w
        used.add(w)
        if w == i:
            self._sink_writers.pop(sid, None)
            return None
        self._sink_writers[sid] = w
        return w

    def _follow_rescale(self: Any, step: str, parallelism: int, old: int) -> list[ChannelId]:
        """After a rescale of ``step`` to ``parallelism`` (from ``old``): its followers have
        that parallelism; returns their instances retired with it."""
        retired: list[ChannelId] = []
        for f in self._followers(step):
            self.parallelism[f] = parallelism
            retired += [(f, i) for i in range(parallelism, old)]
        self.retired.update(retired)
        for iid in retired:
            self.actor_names.pop(iid, None)  # status lists the actors of live instances
        return retired

    def _stop_retired(self: Any, iid: ChannelId) -> None:
        """Stop the actor of retired instance ``iid`` once every instance in it ended and no
        sink in it holds an end that is not published yet."""
        ids = self._chain_ids(iid)
        if any(i not in self.outcomes for i in ids):
            return
        if any(self.outcomes[i].get("sink_state") is not None for i in ids):
            return  # a pre-committed end: published by the checkpoint that records it
        handle = self._run_handles.get(ids[0])
        if handle is not None:
            ray.kill(handle, no_restart=True)

    async def _settle_retired_followers(self: Any, retired: list[ChannelId]) -> None:
        """A scale-in retired these chained instances: once they ended, record and publish the
        ends of the sinks among them with a checkpoint (when the job checkpoints), keep their
        results, stop their actors."""
        if not retired:
            return
        deadline = time.monotonic() + RETIRE_WAIT_S
        while any(i not in self.outcomes for i in retired):
            if time.monotonic() > deadline or self.state != "running":
                log.warning("job %s: retired followers %s did not end", self.flow.name, retired)
                return  # they publish with the job's end (or a later checkpoint)
            await asyncio.sleep(0.01)
        if any(self.outcomes[i].get("sink_state") is not None for i in retired):
            try:
                await self._take_checkpoint(max(60.0, 10 * self.config.checkpoint_interval_s))
            except Exception as e:  # noqa: BLE001 - their ends publish with the job's end
                self.failed_checkpoints.append(
                    {"at_s": self._now_s(), "error": f"{type(e).__name__}: {e}"}
                )
                log.warning("job %s: checkpoint after a scale-in failed: %s", self.flow.name, e)
                return
        from raystream.runtime.snapshots import FINAL_CHECKPOINT

        for iid in retired:
            out = self.outcomes[iid]
            if out.get("sink_state") is not None:  # published by that checkpoint: the result
                out["result"] = await self.handles[iid].checkpoint_complete.remote(
                    FINAL_CHECKPOINT
                )
            if out.get("sink_state") is not None:  # every later checkpoint lists it
                self._retired_sink_states.append((iid[0], out["sink_state"]))
                out["sink_state"] = None
            result = out.pop("result", None)
            if self.plan.steps[iid[0]].kind == "sink":
                self._retired_results.append((iid, result))
            out["handed_over"] = True
            self._stop_retired(iid)

    def _forget_retired_sinks(self: Any) -> None:
        """A recovery: the checkpoint it restores holds the retired sinks' states, which the
        restore folds into live sink instances (raystream.checkpointing.restore_specs)."""
        self._retired_results = []
        self._retired_sink_states = []

    def retired_sink_results(self: Any) -> list[tuple[str, Any]]:
        """(sink step, result) of every retired chained sink instance, in retiring order."""
        return [(iid[0], res) for iid, res in self._retired_results if res is not None]


def _local(receiver: ChannelId) -> OutputSpec:
    """The output of a chained instance to the next one in its actor."""
    return OutputSpec(step=receiver[0], parallelism=1, partitioning="local", receivers=(receiver,))
