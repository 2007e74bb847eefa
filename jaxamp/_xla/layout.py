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
  """``grads``, each leaf of two or more dimensions in row-major layout on XLA CPU.

  XLA CPU's backward pass writes a weight's gradient column-major (the layout
  its dot produces). A plain step's optimizer kernels read it so, with the
  transposition fused into them. Behind a ``lax.cond``, XLA instead copies each
  such gradient into row-major in a kernel of its own, and the check reads it
  strided (BENCHMARKS.md, "Gradient layout"). Constrained,
  each is transposed in the kernel that materialises it (where the dot's
  float32 output is rounded to the compute dtype and back), and nothing copies
  it again. It changes no value; on other platforms, and outside a trace,
  ``grads`` is returned as it is.
  """
  if not (enabled("layout") and traced(grads)):
    return grads
  return map_by_platform(grads, _is_matrix, cpu=_constrained, default=lambda g: g)
