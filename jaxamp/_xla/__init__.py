"""Compiler workarounds, behind one door: nothing else in jaxamp works around XLA.

torch's semantics (``jaxamp/_torch/``) and the update engine (``jaxamp/_engine.py``)
are plain JAX; they call these functions where a plain JAX form would be slow
or would let XLA change a value. Each keeps every value and every derivative,
and each has a plain form, used when it is turned off:

- ``layout``: gradients constrained to row-major on XLA CPU, so no kernel copies
  them a second time (BENCHMARKS.md, "Gradient layout"). Off: as given.
- ``fma_guard``: unscaled gradients and updates kept rounded as torch
  materialises them, by XOR-ing their bits with a zero XLA cannot see, which
  costs no memory pass (BENCHMARKS.md, "FMA guard"). It has no plain form and
  cannot be turned off: without it XLA CPU contracts the unscale into the
  optimizer's FMAs and changes values (``lax.optimization_barrier`` did not
  stop it: tests/test_xla_workarounds.py). The same module keeps autocast's
  bfloat16 values rounded where XLA would skip the rounding (``kept_bfloat16``).
- ``compile_cache``: an eager call compiles once per configuration and shapes
  (BENCHMARKS.md, "Compile cache"). Off: traced and run on every call.
- ``platform``: leaves treated one way on XLA CPU and another elsewhere, in one
  ``lax.platform_dependent`` (BENCHMARKS.md, "Per-platform leaves"). Off: the
  form for every platform.

The switch: ``JAXAMP_XLA_OFF`` names the workarounds to turn off, comma-separated,
or ``all`` (all but ``fma_guard``), read once at import (``JAXAMP_XLA_OFF=all
pytest`` runs the suite with every plain form). ``jaxamp/_xla/jax_internals.py`` holds the only imports
of JAX's private modules.
"""

from __future__ import annotations

import os

WORKAROUNDS = ("layout", "compile_cache", "platform")  # can be turned off


def _read_off(value: str) -> frozenset[str]:
  names = {name.strip() for name in value.split(",") if name.strip()}
  if "fma_guard" in names:
    raise ValueError(
      "jaxamp: JAXAMP_XLA_OFF cannot turn off fma_guard: it keeps torch's values "
      "(without it XLA CPU contracts the unscale into the optimizer's FMAs). "
      "Leave it out; 'all' turns off every other workaround."
    )
  if names == {"all"}:
    return frozenset(WORKAROUNDS)
  unknown = names - set(WORKAROUNDS)
  if unknown:
    raise ValueError(
      f"jaxamp: JAXAMP_XLA_OFF names unknown workarounds {sorted(unknown)}; use 'all' "
      f"or some of {', '.join(WORKAROUNDS)}."
    )
  return frozenset(names)


OFF = _read_off(os.environ.get("JAXAMP_XLA_OFF", ""))


def enabled(name: str) -> bool:
  """Whether the workaround ``name`` (one of :data:`WORKAROUNDS`) is on."""
  assert name in WORKAROUNDS, name
  return name not in OFF
