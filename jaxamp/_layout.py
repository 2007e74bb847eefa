"""Gradients in row-major layout on XLA CPU, where a jaxamp step receives them."""

from __future__ import annotations

from typing import Any

import jax
from jax import lax
from jax.experimental.layout import Layout, with_layout_constraint

from jaxamp._compile import traced


def _row_major_leaf(grad: Any) -> Any:
  if getattr(grad, "ndim", 0) < 2:
    return grad
  layout = Layout(tuple(range(grad.ndim)))
  return lax.platform_dependent(
    grad, cpu=lambda g: with_layout_constraint(g, layout), default=lambda g: g
  )


def row_major(grads: Any) -> Any:
  """``grads``, each leaf of two or more dimensions in row-major layout on XLA CPU.

  XLA CPU's backward pass writes a weight's gradient column-major (the layout
  its dot produces). A plain step's optimizer kernels read it so, with the
  transposition fused into them. Behind a ``lax.cond``, XLA instead copied each
  such gradient into row-major in a kernel of its own, and the check read it
  strided: a whole training step of a 17M-parameter Transformer at batch 1
  took 1.5-1.6x the plain step (BENCHMARKS.md, "Gradient layout"). Constrained,
  the dot writes it row-major and nothing is transposed. It changes no value;
  on other platforms, and outside a trace, ``grads`` is returned as it is.
  """
  if not traced(grads):
    return grads
  return jax.tree.map(_row_major_leaf, grads)
