"""Checks of the gradient trees given to an update, raised before anything is computed."""

from __future__ import annotations

import itertools
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import optax


def is_none(x: Any) -> bool:
  return x is None


def is_array_leaf(x: Any) -> bool:
  """Whether a parameter leaf can have a gradient: an array or a Python number."""
  return x is not None and (hasattr(x, "dtype") or isinstance(x, numbers.Number))


def zeros_like_arrays(params: Any) -> Any:
  """Zeros like each array leaf of ``params``, ``None`` for the other leaves."""
  return jax.tree.map(lambda p: jnp.zeros_like(p) if is_array_leaf(p) else None, params)


def apply_updates(params: Any, updates: Any) -> Any:
  """``optax.apply_updates``; a ``None`` update leaves its parameter, as in Equinox."""

  def apply(param: Any, update: Any) -> Any:
    if param is None or update is None:
      return param
    return jnp.asarray(param + update).astype(jnp.asarray(param).dtype)

  return jax.tree.map(apply, params, updates, is_leaf=is_none)


def none_expanded(grads: Any, params: Any) -> Any:
  """``grads`` with a ``None`` for a subtree of ``params`` (``{"d": grads_d, "g":
  None}``) as a ``None`` per leaf; as given when no prefix (the shape check says so)."""
  if params is None or not any(g is None for g in jax.tree.leaves(grads, is_leaf=is_none)):
    return grads

  def expand(grad: Any, param: Any) -> Any:
    return jax.tree.map(lambda _: None, param, is_leaf=is_none) if grad is None else grad

  try:
    return jax.tree.map(expand, grads, params, is_leaf=is_none)
  except (ValueError, TypeError):
    return grads


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
  """Raises ValueError if the trees (``None`` a leaf) or a leaf's shapes differ."""
  if params is None:
    return
  grad_leaves, grads_def = jax.tree.flatten(grads, is_leaf=is_none)
  param_leaves, params_def = jax.tree.flatten(params, is_leaf=is_none)
  if isinstance(params, optax.LookaheadParams) and grads_def != params_def:  # type: ignore[operator]
    raise ValueError(
      "jaxamp: put optax.lookahead around the loss scaler, not inside it: "
      "optax.lookahead(jaxamp.dynamic_loss_scale(inner), sync_period, slow_step_size), "
      "stepped with tx.update and optax.apply_updates.\n"
      "  lookahead's parameters are LookaheadParams (fast and slow), its gradients "
      "the fast parameters' tree, which the scaler checks and unscales."
    )
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


def checked_gradients(grads: Any, params: Any) -> Any:
  """``grads`` :func:`none_expanded`, then checked: float leaves shaped like ``params``."""
  grads = none_expanded(grads, params)
  check_float_gradients(grads)
  check_same_structure(grads, params)
  return grads


def flag_slots(grads: Any, params: Any, n_flags: int) -> tuple[int, ...]:
  """Each array leaf's index in ``nonfinite_leaves``: the first of ``params``' leaves, its
  array leaves, ``grads``' positions or its arrays that has ``n_flags`` (else ValueError)."""
  grad_leaves, _ = jax.tree.flatten(grads, is_leaf=is_none)
  has_grad = [g is not None for g in grad_leaves]
  candidates = []
  if params is not None:
    param_leaves = jax.tree.leaves(params, is_leaf=is_none)
    if len(param_leaves) == len(grad_leaves):  # else the shape check reports it
      candidates += [[p is not None for p in param_leaves], list(map(is_array_leaf, param_leaves))]
  candidates += [[True] * len(grad_leaves), has_grad]
  for mask in candidates:
    if sum(mask) == n_flags and all(m for m, g in zip(mask, has_grad) if g):
      starts = itertools.accumulate(mask, initial=0)  # each leaf's index among the masked
      return tuple(index for index, g in zip(starts, has_grad) if g)
  count, missing = sum(has_grad), len(has_grad) - sum(has_grad)
  nones = f" and {missing} None" if missing else ""
  raise ValueError(
    f"jaxamp: the gradient tree has {count} array leaves{nones}, but the optimizer "
    f"state was initialised for parameters with {n_flags}. Initialise it with the "
    "parameters these gradients are for (with Equinox: eqx.filter(model, eqx.is_array), "
    "or the trainable part only), and pass those params to update."
  )


def set_flags(flags: jax.Array, slots: tuple[int, ...], nonfinite: jax.Array) -> jax.Array:
  """``nonfinite`` at ``slots`` of a ``flags``-shaped vector, ``False`` elsewhere."""
  if len(slots) == flags.shape[0]:
    return nonfinite
  return jnp.zeros_like(flags).at[jnp.asarray(slots, int)].set(nonfinite)


def none_gradient_error(grads: Any, params: Any) -> ValueError | None:
  """The error naming the first ``None`` gradient of an array parameter, or None."""
  paths = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_none)[0]
  grad_leaves = jax.tree.leaves(grads, is_leaf=is_none)
  for (path, param), grad in zip(paths, grad_leaves):
    if grad is None and is_array_leaf(param):
      return ValueError(
        f"jaxamp: the gradient of {jax.tree_util.keystr(path) or '<root>'} is None, and "
        "the optimizer cannot skip a parameter its state holds (as optax's Adam cannot). "
        "Leave frozen parameters out of the params the optimizer is built with "
        "(with Equinox: eqx.filter(model, trainable)), or give them zero gradients. "
        "Nothing was changed."
      )
  return None


def flagged_paths(params: Any, flags: Any) -> list[str] | None:
  """Paths of ``params``' leaves whose ``flags`` are set; None if no form fits."""
  leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_none)[0]
  for keep in (lambda leaf: leaf is not None, is_array_leaf, lambda leaf: True):
    paths = [jax.tree_util.keystr(path) for path, leaf in leaves if keep(leaf)]
    if len(paths) == len(flags):
      return [path for path, flag in zip(paths, flags) if flag]
  return None


def arrays_only(tree: Any) -> Any:
  """``tree`` with ``None`` for each non-array leaf, as ``eqx.filter(tree, eqx.is_array)``."""
  return jax.tree.map(lambda x: x if is_array_leaf(x) else None, tree)


def with_non_arrays(new: Any, old: Any, grads: Any) -> Any:
  """``new`` (from :func:`arrays_only` of ``old``) with ``old``'s other leaves back, and its
  Python numbers without a gradient as given, as ``eqx.apply_updates`` (not as arrays)."""
  back = lambda n, o, g: o if n is None or (g is None and not hasattr(o, "dtype")) else n
  return jax.tree.map(back, new, old, none_expanded(grads, old), is_leaf=is_none)
