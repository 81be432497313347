"""Built-in migration strategies (plugins behind :class:`raystream.rescale.MigrationStrategy`).

=============  =================================================================================
``meces``      hot keys first: on-demand fetch of the sub-group a record needs, the rest pulled
               in the background hottest first; only a missing sub-group's records wait
``all_at_once``live but order-unaware: every moved sub-group pulled as one block; records of
               moved key groups wait until all of it arrived
``fluid``      Megaphone: one key group per step, each step its own barrier
``batched``    Megaphone: ``batch_size`` key groups per step
``lazy``       on-demand only; old owners serve as storage for at most ``max_lazy_s``
``stop_restart`` Flink's way: pause sources, drain, snapshot, restore all state, resume
=============  =================================================================================
"""

from raystream.migration.strategies import (
    AllAtOnce,
    Batched,
    Fluid,
    Lazy,
    Meces,
    StopRestart,
)

__all__ = ["AllAtOnce", "Batched", "Fluid", "Lazy", "Meces", "StopRestart"]
