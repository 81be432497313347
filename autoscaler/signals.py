"""Signals per operator over a sliding window of metric samples. No Ray here.

The controller samples every instance's cumulative counters (``records_in``, ``records_out``,
``busy_s``, ``backlog``; sources also ``target_rate_eps`` and ``lag_rows``) every few hundred
milliseconds; :class:`SignalWindow` keeps the samples of the last ``window_s`` seconds and turns
them into :class:`~raystream.autoscaler.policy.OperatorSignals`.

Counters are per instance id ``(step, index)``. An id that comes back after a scale-in is a new
actor whose counters start at 0: a counter that went down counts from 0 again.

Example::

    >>> w = SignalWindow(window_s=2.0)
    >>> snap = lambda n, busy: [{"step": "count", "index": 0, "records_in": n,
    ...                          "records_out": n, "busy_s": busy, "backlog": 0}]
    >>> w.add(0.0, snap(0, 0.0)); w.add(2.0, snap(20_000, 1.0))
    >>> s = w.signals({"count": "keyed"}, {"count": 1})["count"]
    >>> s.input_rate_eps, s.busy_fraction, s.true_rate_eps
    (10000.0, 0.5, 20000.0)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from raystream.autoscaler.policy import OperatorSignals

from raystream.errors import ConfigError

__all__ = ["SignalWindow"]

_COUNTERS = ("records_in", "records_out", "busy_s")


@dataclass(frozen=True)
class _Sample:
    t_s: float
    counters: dict[tuple[str, int], tuple[float, float, float]]  # cumulative, per instance
    deltas: dict[tuple[str, int], tuple[float, float, float]]  # since the previous sample
    backlog: dict[str, int]
    target_rate: dict[str, float]
    lag: dict[str, int]


class SignalWindow:
    """Samples of the last ``window_s`` seconds (plus the one just before, as the base)."""

    def __init__(self, window_s: float) -> None:
        if isinstance(window_s, bool) or not isinstance(window_s, (int, float)) or window_s <= 0:
            msg = f"window_s must be a number > 0 (seconds), got {window_s!r}"
            raise ConfigError(msg)
        self.window_s = float(window_s)
        self._samples: deque[_Sample] = deque()

    def reset(self) -> None:
        """Forget everything (after a rescale: the old samples describe another layout)."""
        self._samples.clear()

    @property
    def span_s(self) -> float:
        if len(self._samples) < 2:
            return 0.0
        return self._samples[-1].t_s - self._samples[0].t_s

    def ready(self, fraction: float = 0.95) -> bool:
        """True once the samples cover (almost) the whole window."""
        return self.span_s >= self.window_s * fraction

    def add(self, t_s: float, instances: Sequence[Mapping[str, Any]]) -> None:
        """One sample: the metric snapshots of every instance at time ``t_s``."""
        counters: dict[tuple[str, int], tuple[float, float, float]] = {}
        finished: dict[tuple[str, int], bool] = {}
        backlog: dict[str, int] = {}
        target: dict[str, float] = {}
        lag: dict[str, int] = {}
        for snap in instances:
            if "step" not in snap:
                continue
            iid = (str(snap["step"]), int(snap.get("index", 0)))
            done = bool(snap.get("finished", False))
            if iid in counters and not finished[iid] and done:
                continue  # a live instance beats the outcome of a retired one with the same id
            counters[iid] = tuple(float(snap.get(c, 0) or 0) for c in _COUNTERS)  # type: ignore[assignment]
            finished[iid] = done
        for snap in instances:
            if "step" not in snap or snap.get("finished"):
                continue
            step = str(snap["step"])
            backlog[step] = backlog.get(step, 0) + int(snap.get("backlog", 0) or 0)
            if snap.get("target_rate_eps") is not None:
                target[step] = target.get(step, 0.0) + float(snap["target_rate_eps"])
            lag[step] = lag.get(step, 0) + int(snap.get("lag_rows", 0) or 0)
        prev = self._samples[-1].counters if self._samples else {}
        deltas: dict[tuple[str, int], tuple[float, float, float]] = {}
        for iid, now in counters.items():
            before = prev.get(iid)
            if before is None:
                # first seen: it started within this interval unless this is the first sample
                deltas[iid] = now if self._samples else (0.0, 0.0, 0.0)
            elif any(n < b for n, b in zip(now, before, strict=True)):
                deltas[iid] = now  # a new actor under a reused id: its counters restarted
            else:
                deltas[iid] = tuple(n - b for n, b in zip(now, before, strict=True))  # type: ignore[assignment]
        self._samples.append(_Sample(float(t_s), counters, deltas, backlog, target, lag))
        while len(self._samples) >= 2 and self._samples[1].t_s <= t_s - self.window_s:
            self._samples.popleft()

    def signals(
        self, kinds: Mapping[str, str], parallelism: Mapping[str, int]
    ) -> dict[str, OperatorSignals]:
        """Signals of every operator in ``kinds`` (step -> kind) over the window."""
        out: dict[str, OperatorSignals] = {}
        span = self.span_s
        if span <= 0:
            return {
                n: OperatorSignals(n, k, parallelism.get(n, 1), window_s=0.0)
                for n, k in kinds.items()
            }
        first, last = self._samples[0], self._samples[-1]
        per_instance: dict[tuple[str, int], list[float]] = {}
        for sample in list(self._samples)[1:]:
            for iid, d in sample.deltas.items():
                acc = per_instance.setdefault(iid, [0.0, 0.0, 0.0])
                for j in range(3):
                    acc[j] += d[j]
        for name, kind in kinds.items():
            mine = [v for iid, v in per_instance.items() if iid[0] == name]
            rin = sum(v[0] for v in mine)
            rout = sum(v[1] for v in mine)
            busy = sum(v[2] for v in mine)
            p = max(1, int(parallelism.get(name, 1)))
            is_source = kind == "source"
            processed = rout if is_source else rin
            out[name] = OperatorSignals(
                name=name,
                kind=kind,
                parallelism=p,
                input_rate_eps=rin / span,
                output_rate_eps=rout / span,
                busy_fraction=min(1.0, busy / (span * p)),
                max_busy_fraction=min(1.0, max((v[2] for v in mine), default=0.0) / span),
                true_rate_eps=processed / busy if busy > 0 and processed > 0 else None,
                true_output_rate_eps=rout / busy if busy > 0 and rout > 0 else None,
                backlog_batches=last.backlog.get(name, 0),
                backlog_growth_batches=last.backlog.get(name, 0) - first.backlog.get(name, 0),
                target_rate_eps=last.target_rate.get(name),
                lag_rows=last.lag.get(name, 0),
                window_s=span,
            )
        return out
