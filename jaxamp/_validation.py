"""Checks that turn bad input into clear errors before anything is computed."""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_LOW_PRECISION = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
FLT_MAX = float(np.finfo(np.float32).max)
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def _is_none(x: Any) -> bool:
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
  """Raises ValueError if ``grads`` and ``params`` are different trees.

  ``None`` counts as a leaf on both sides, so a ``None`` gradient for a
  parameter (a frozen one) is accepted.
  """
  if params is None:
    return
  grads_def = jax.tree.structure(grads, is_leaf=_is_none)
  params_def = jax.tree.structure(params, is_leaf=_is_none)
  if grads_def != params_def:
    raise ValueError(
        "jaxamp: the gradient tree does not match the parameter tree.\n"
        f"  gradients:  {grads_def}\n  parameters: {params_def}"
    )


def check_leaf_count(grads: Any, per_leaf_state: Any) -> None:
  """Raises ValueError if ``grads`` has another number of array leaves than
  the parameters the state was initialised with."""
  expected = jax.tree.leaves(per_leaf_state)[0].shape[0]
  count = len(jax.tree.leaves(grads))
  if count != expected:
    raise ValueError(
        f"jaxamp: the gradient tree has {count} array leaves, but the optimizer "
        f"state was initialised for parameters with {expected}."
    )


def concrete_value(x: Any) -> float | None:
  """The value of a concrete number or array scalar; None when traced."""
  if isinstance(x, numbers.Number):
    return x  # type: ignore[return-value]
  if isinstance(x, jax.core.Tracer):
    return None
  try:
    return np.asarray(x).item()
  except (TypeError, ValueError):
    return None


def check_hyperparameter_dtype(name: str, value: Any) -> None:
  dtype = getattr(value, "dtype", None)
  if dtype is not None and jnp.dtype(dtype) in _LOW_PRECISION:
    raise TypeError(
        f"jaxamp: {name} arrived as {jnp.dtype(dtype).name}, which cannot hold "
        "loss-scale values exactly (float16(65536) is inf). With "
        "optax.inject_hyperparams and low-precision params, pass "
        "hyperparam_dtype=jnp.float32."
    )


def check_hyperparameters(
    *, init_scale: Any, growth_factor: Any, backoff_factor: Any, growth_interval: Any
) -> None:
  """Validates concrete hyperparameters; traced ones are left alone."""
  for name, value in (
      ("init_scale", init_scale),
      ("growth_factor", growth_factor),
      ("backoff_factor", backoff_factor),
  ):
    check_hyperparameter_dtype(name, value)
  growth = concrete_value(growth_factor)
  if growth is not None and not (growth > 1.0 and math.isfinite(growth)):
    raise ValueError(f"The growth factor must be > 1.0. (jaxamp: got {growth!r})")
  backoff = concrete_value(backoff_factor)
  if backoff is not None and not (0.0 < backoff < 1.0):
    if backoff >= 1.0:
      raise ValueError(f"The backoff factor must be < 1.0. (jaxamp: got {backoff!r})")
    raise ValueError(f"jaxamp: the backoff factor must be > 0.0, got {backoff!r}.")
  scale = concrete_value(init_scale)
  if scale is not None:
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
      raise TypeError(f"jaxamp: init_scale must be a real number, got {scale!r}.")
    if math.isfinite(scale) and abs(scale) > FLT_MAX:
      raise ValueError(
          "value cannot be converted to type float without overflow "
          f"(jaxamp: init_scale={scale!r} is larger than the float32 maximum)"
      )
    rounded = float(np.float32(scale))
    if not (math.isfinite(rounded) and rounded > 0.0):
      raise ValueError(
          "jaxamp: init_scale must be a finite positive number representable in "
          f"float32, got {scale!r} (float32: {rounded!r})."
      )
  interval = concrete_value(growth_interval)
  if interval is not None and (
      isinstance(interval, bool) or not isinstance(interval, numbers.Integral)
  ):
    raise TypeError(
        "jaxamp: growth_interval must be an int, got "
        f"{type(growth_interval).__name__} {growth_interval!r}."
    )
  if hasattr(growth_interval, "dtype") and not jnp.issubdtype(
      growth_interval.dtype, jnp.integer
  ):
    raise TypeError(
        f"jaxamp: growth_interval must be an integer, got dtype {growth_interval.dtype}."
    )
