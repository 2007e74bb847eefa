"""Compiler workarounds, behind one door: nothing else in jaxamp works around XLA.

Each keeps every value and derivative: ``layout`` (BENCHMARKS.md, "Gradient layout"),
``compile_cache`` (BENCHMARKS.md, "Compile cache") and ``platform`` (BENCHMARKS.md,
"Per-platform leaves") have a plain form, used when turned off; ``fma_guard``
(BENCHMARKS.md, "FMA guard") has none: without it XLA CPU contracts the unscale
into the optimizer's FMAs (tests/test_xla_workarounds.py). ``JAXAMP_XLA_OFF`` names
the workarounds to turn off, comma-separated, or ``all``, read once at import
(``JAXAMP_XLA_OFF=all pytest`` runs the suite with every plain form).
``jaxamp/_xla/jax_internals.py`` holds the only imports of JAX's private modules.
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
