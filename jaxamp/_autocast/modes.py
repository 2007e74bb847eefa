"""Nested regions: the modes equations run by, and the name scopes that mark them.

Inside an enclosing ``autocast``'s trace, a nested one only names its mode in a name
scope; the innermost scope decides (docs/autocast.md, "Nested regions").
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
from jax.experimental.xla_metadata import set_xla_metadata

from jaxamp._autocast.policies import HALF, POLICIES


class Mode(NamedTuple):
  """How a region runs its equations."""

  dtype: Any  # the lower-precision dtype of matmuls and convs; None: no lower-precision list
  fp32: frozenset[str]  # the primitives run in float32
  as_written: bool = False  # every equation as the traced program has it
  policy: str | None = None  # "cpu" or "cuda": whose fused ops are float32 (policies.FUSED_F32)


# autocast(enabled=False) and autocast_disabled: autocast off, input dtypes.
OFF_SCOPE = "jaxamp_autocast_off"
# Equations that run as traced: what an autocast call emits (already cast) and
# autocast_disabled's casts of its inputs to float32.
AS_WRITTEN_SCOPE = "jaxamp_autocast_as_written"

MODES = {
  OFF_SCOPE: Mode(None, frozenset()),
  AS_WRITTEN_SCOPE: Mode(None, frozenset(), as_written=True),
}
OFF = MODES[OFF_SCOPE]


def policy_scope(dtype: Any, policy: str) -> str:
  """The name scope of an ``autocast(fn, dtype, policy=policy)`` region."""
  return f"jaxamp_autocast_{np.dtype(dtype).name}_{policy}"


for _half in HALF:
  for _policy, _fp32 in POLICIES.items():
    MODES[policy_scope(_half, _policy)] = Mode(_half, _fp32, policy=_policy)
_SCOPES = re.compile("|".join(sorted(MODES, key=len, reverse=True)))

# True while an autocast call traces its function: an autocast or
# autocast_disabled called then marks a region instead of interpreting.
_TRACING = contextvars.ContextVar("jaxamp_autocast_tracing", default=False)


def tracing() -> bool:
  """Whether an enclosing ``autocast`` call is tracing its function."""
  return _TRACING.get()


@contextlib.contextmanager
def tracing_regions() -> Iterator[None]:
  """The context an ``autocast`` call traces its function in."""
  token = _TRACING.set(True)
  try:
    # jax.jit keys its cache on this context: a jitted function traced here, its
    # autocast calls marked as regions (not interpreted), is traced again when
    # called outside, where they interpret.
    with set_xla_metadata(jaxamp_autocast="region"):
      yield
  finally:
    _TRACING.reset(token)


def region(eqn: Any, mode: Mode) -> Mode:
  """The mode of the innermost region ``eqn`` is in; ``mode`` if none."""
  scopes = _SCOPES.findall(str(eqn.source_info.name_stack))
  return MODES[scopes[-1]] if scopes else mode
