"""``flax.serialization`` (msgpack) of jaxamp's states, without importing flax.

The static configuration and stepped groups serialize as nothing and are restored from
the target, as orbax restores them; registered when flax is loaded (import or ``init``).
"""

from __future__ import annotations

import sys
from typing import Any

from jaxamp._config import LossScaleConfig
from jaxamp._torch.groups import SteppedGroups

_registered: list = []  # the flax.serialization module registered with, once


def register_with_flax() -> None:
  """Registers the static parts of jaxamp's states with ``flax.serialization``
  when flax is imported (a no-op otherwise, and when done already)."""
  serialization: Any = sys.modules.get("flax.serialization")
  if serialization is None or _registered:
    return
  for static in (LossScaleConfig, SteppedGroups):
    serialization.register_serialization_state(
      static, lambda _: {}, lambda target, _: target, override=True
    )
  _registered.append(serialization)
