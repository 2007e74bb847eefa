"""Gradients in row-major layout on XLA CPU, where a jaxamp step receives them."""

from __future__ import annotations

from typing import Any

from jax.experimental.layout import Layout, with_layout_constraint

from jaxamp._xla import enabled
from jaxamp._xla.compile_cache import traced
from jaxamp._xla.platform import map_by_platform


def _constrained(g: Any) -> Any:
  return with_layout_constraint(g, Layout(tuple(range(g.ndim))))


def _is_matrix(g: Any) -> bool:
  return getattr(g, "ndim", 0) >= 2


def row_major(grads: Any) -> Any:
  """``grads``, each leaf of two or more dimensions in row-major layout on XLA CPU, so
  no kernel behind a ``lax.cond`` copies it again (BENCHMARKS.md, "Gradient layout");
  as it is on other platforms and outside a trace."""
  if not (enabled("layout") and traced(grads)):
    return grads
  return map_by_platform(grads, _is_matrix, cpu=_constrained, default=lambda g: g)
