"""``flax.serialization`` (msgpack) of jaxamp's states, without importing flax.

A state's configuration and stepped groups are static, part of its tree
structure: they serialize as nothing and are restored from the target, as
orbax restores them. Registered where flax is loaded, at import or at ``init``.
"""

from __future__ import annotations

import sys

from jaxamp._config import LossScaleConfig
from jaxamp._torch.groups import SteppedGroups


def register_with_flax() -> None:
  """Registers the static parts of jaxamp's states with ``flax.serialization``
  when flax is imported (a no-op otherwise, and when done already)."""
  serialization = sys.modules.get("flax.serialization")
  if serialization is None or getattr(serialization, "_jaxamp_registered", False):
    return
  for static in (LossScaleConfig, SteppedGroups):
    serialization.register_serialization_state(
      static, lambda _: {}, lambda target, _: target, override=True
    )
  serialization._jaxamp_registered = True
