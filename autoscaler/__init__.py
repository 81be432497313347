"""Autoscaler policies and the guard rails around them (``raystream.autoscaler``).

A policy maps a :class:`ScalingContext` to a :class:`ScalingDecision`; built-ins are registered
under the entry-point group ``raystream.autoscaler_policies``: ``ds2``, ``threshold``,
``schedule``, ``fixed``. Choose one with ``rs.run(flow, autoscaler="ds2", autoscaler_config={...})``
or give ``"package.module:attr"`` or an object.
"""

from raystream.autoscaler.guard import AutoscalerConfig, Change, Guard
from raystream.autoscaler.policies import DS2, Fixed, Schedule, Threshold
from raystream.autoscaler.policy import (
    AutoscalerPolicy,
    OperatorSignals,
    ScalingContext,
    ScalingDecision,
    as_decision,
    policy_callable,
)
from raystream.autoscaler.signals import SignalWindow

__all__ = [
    "DS2",
    "AutoscalerConfig",
    "AutoscalerPolicy",
    "Change",
    "Fixed",
    "Guard",
    "OperatorSignals",
    "Schedule",
    "ScalingContext",
    "ScalingDecision",
    "SignalWindow",
    "Threshold",
    "as_decision",
    "policy_callable",
]
