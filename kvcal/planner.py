"""Deprecated alias of :mod:`kvcal.capacity` (the capacity planner behind ``kvcal plan``).

The module was renamed so that "plan" means only :class:`kvcal.plan.KVPlan`; the ``kvcal plan``
command keeps its name. Importing ``kvcal.planner`` emits a ``DeprecationWarning``; every name
resolves to the same object in :mod:`kvcal.capacity`. Will be removed in a later release.
"""

from __future__ import annotations

import warnings

from kvcal import capacity as _capacity

warnings.warn("kvcal.planner is deprecated: import kvcal.capacity instead", DeprecationWarning, stacklevel=2)


def __getattr__(name: str):
    return getattr(_capacity, name)


def __dir__() -> list[str]:
    return dir(_capacity)
