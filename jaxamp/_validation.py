"""Checks of the gradient trees given to an update, raised before anything is computed."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def is_none(x: Any) -> bool:
  return x is None


def check_float_gradients(grads: Any) -> None:
  """Raises TypeError naming the first leaf that is not a float array."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]:
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
      where = jax.tree_util.keystr(path) or "<root>"
      kind = f"dtype {dtype}" if dtype is not None else f"type {type(leaf).__name__}"
      raise TypeError(
        f"jaxamp: gradient leaf {where} has {kind}; loss scaling needs "
        "floating-point gradients (float16, bfloat16, float32 or float64)."
      )


def check_same_structure(grads: Any, params: Any) -> None:
  """Raises ValueError if ``grads`` and ``params`` are different trees, or a
  gradient leaf has another shape than its parameter.

  ``None`` counts as a leaf on both sides, so a ``None`` gradient for a
  parameter (a frozen one) is accepted.
  """
  if params is None:
    return
  grad_leaves, grads_def = jax.tree.flatten(grads, is_leaf=is_none)
  param_leaves, params_def = jax.tree.flatten(params, is_leaf=is_none)
  if grads_def != params_def:  # type: ignore[operator]
    raise ValueError(
      "jaxamp: the gradient tree does not match the parameter tree.\n"
      f"  gradients:  {grads_def}\n  parameters: {params_def}"
    )
  paths = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_none)[0]
  for (path, _), grad, param in zip(paths, grad_leaves, param_leaves):
    grad_shape, param_shape = getattr(grad, "shape", None), getattr(param, "shape", None)
    if grad is not None and param is not None and grad_shape != param_shape:
      raise ValueError(
        f"jaxamp: the gradient of {jax.tree_util.keystr(path) or '<root>'} has shape "
        f"{grad_shape} but the parameter has shape {param_shape}; pass gradients "
        "shaped like the parameters (jaxamp does not broadcast them)."
      )


def check_leaf_count(grads: Any, nonfinite_leaves: jax.Array) -> None:
  """Raises ValueError if ``grads`` has another number of array leaves than
  the parameters the state was initialised with."""
  expected = jax.tree.leaves(nonfinite_leaves)[0].shape[0]
  count = len(jax.tree.leaves(grads))
  if count != expected:
    raise ValueError(
      f"jaxamp: the gradient tree has {count} array leaves, but the optimizer "
      f"state was initialised for parameters with {expected}."
    )


def check_no_none_gradients(grads: Any, params: Any) -> None:
  """Raises ValueError naming the first parameter whose gradient is ``None``:
  an optax update needs a gradient for every parameter it steps."""
  paths = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_none)[0]
  grad_leaves = jax.tree.leaves(grads, is_leaf=is_none)
  for (path, param), grad in zip(paths, grad_leaves):
    if grad is None and param is not None:
      raise ValueError(
        f"jaxamp: the gradient of {jax.tree_util.keystr(path) or '<root>'} is None; "
        "an optax update needs one for every parameter: give it zeros, or leave a "
        "frozen parameter out of the Optimizer's params. Nothing was changed."
      )
