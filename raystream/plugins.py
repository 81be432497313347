"""One way to find plugins: an object, a ``"package.module:attr"`` path, or a registered name.

Built-ins and third-party plugins register under the entry-point groups
``raystream.migration_strategies`` and ``raystream.autoscaler_policies``. An import path works
under ``ray job submit`` without packaging anything. An unknown name lists the known ones.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

from raystream.errors import ConfigError, PluginNotFoundError

__all__ = ["MIGRATION_STRATEGIES", "AUTOSCALER_POLICIES", "known", "load"]

MIGRATION_STRATEGIES = "raystream.migration_strategies"
AUTOSCALER_POLICIES = "raystream.autoscaler_policies"

# Also listed here so a source checkout works before `pip install` wrote the entry points.
_BUILTIN: dict[str, dict[str, str]] = {
    MIGRATION_STRATEGIES: {
        "meces": "raystream.migration.strategies:Meces",
        "all_at_once": "raystream.migration.strategies:AllAtOnce",
        "fluid": "raystream.migration.strategies:Fluid",
        "batched": "raystream.migration.strategies:Batched",
        "lazy": "raystream.migration.strategies:Lazy",
        "stop_restart": "raystream.migration.strategies:StopRestart",
    },
    AUTOSCALER_POLICIES: {
        "ds2": "raystream.autoscaler.policies:DS2",
        "threshold": "raystream.autoscaler.policies:Threshold",
        "schedule": "raystream.autoscaler.policies:Schedule",
        "fixed": "raystream.autoscaler.policies:Fixed",
    },
}


def known(group: str) -> dict[str, str]:
    """Registered names of ``group`` -> their import paths."""
    names = dict(_BUILTIN.get(group, {}))
    for ep in entry_points(group=group):
        names[ep.name] = ep.value
    return names


def _import(path: str, group: str) -> Any:
    module, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in attr.split(".") if attr else []:
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        msg = f"cannot load {group} plugin {path!r}: {e}. Expected 'package.module:attr'."
        raise PluginNotFoundError(msg) from e
    return obj


def load(group: str, spec: Any, **kwargs: Any) -> Any:
    """The plugin ``spec`` of ``group``: an instance is returned as is; a class or factory found
    by name or path is called with ``kwargs``."""
    if not isinstance(spec, str):
        if kwargs:
            msg = f"options {sorted(kwargs)} cannot be applied to the plugin object {spec!r}; set them when you create it"
            raise ConfigError(msg)
        return spec
    registry = known(group)
    if ":" in spec:
        target = _import(spec, group)
    elif spec in registry:
        target = _import(registry[spec], group)
    else:
        label = {
            MIGRATION_STRATEGIES: "migration strategy",
            AUTOSCALER_POLICIES: "autoscaler policy",
        }
        msg = (
            f"unknown {label.get(group, group)} {spec!r}; known: "
            f"{sorted(registry)}, or give an import path 'package.module:attr'"
        )
        raise PluginNotFoundError(msg)
    if not (callable(target) and isinstance(target, type)):
        if kwargs:
            msg = f"options {sorted(kwargs)} cannot be applied to {spec!r}: it is not a class"
            raise ConfigError(msg)
        return target
    try:
        return target(**kwargs)
    except TypeError as e:
        msg = f"bad options for {group.rsplit('.', 1)[-1]} {spec!r}: {e}"
        raise ConfigError(msg) from e
