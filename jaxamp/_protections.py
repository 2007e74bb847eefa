"""Opt-in protections that torch's GradScaler lacks (all off by default).

* ``min_loss_scale`` / ``max_loss_scale``: clamps on the scale (apex, Megatron).
* ``hysteresis``: back off only after that many overflowing steps, as DeepSpeed
  and Megatron define it (``consecutive_hysteresis`` is DeepSpeed's variant).
* ``max_consecutive_skips``: raise from inside the jitted step when too many
  steps in a row were skipped.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._validation import check_hyperparameter_dtype, concrete_value

_FLT_MAX = float(np.finfo(np.float32).max)


def check_protection_options(
    *,
    init_scale: Any,
    min_loss_scale: Any,
    max_loss_scale: Any,
    hysteresis: Any,
    max_consecutive_skips: Any,
) -> None:
  """Validates the concrete options; raises ValueError/TypeError naming the problem."""
  low, high = concrete_value(min_loss_scale), concrete_value(max_loss_scale)
  for name, option, value in (
      ("min_loss_scale", min_loss_scale, low),
      ("max_loss_scale", max_loss_scale, high),
  ):
    check_hyperparameter_dtype(name, option)
    if value is not None and not (
        isinstance(value, numbers.Real) and 0 < value <= _FLT_MAX and np.float32(value) > 0
    ):
      raise ValueError(
          f"jaxamp: {name} must be a finite positive float32 number, got {value!r}."
      )
  if low is not None and high is not None and low > high:
    raise ValueError(
        f"jaxamp: min_loss_scale ({low!r}) must not be above max_loss_scale ({high!r})."
    )
  scale = concrete_value(init_scale)
  if scale is not None and low is not None and scale < low:
    raise ValueError(f"jaxamp: init_scale {scale!r} is below min_loss_scale {low!r}.")
  if scale is not None and high is not None and scale > high:
    raise ValueError(f"jaxamp: init_scale {scale!r} is above max_loss_scale {high!r}.")
  for name, value, minimum in (
      ("hysteresis", hysteresis, 1),
      ("max_consecutive_skips", max_consecutive_skips, 1),
  ):
    concrete = concrete_value(value)
    if concrete is None:
      continue
    if isinstance(concrete, bool) or not isinstance(concrete, numbers.Integral):
      raise TypeError(f"jaxamp: {name} must be an int, got {value!r}.")
    if concrete < minimum:
      raise ValueError(f"jaxamp: {name} must be >= {minimum}, got {concrete!r}.")


def clamp_scale(scale: jax.Array, min_loss_scale: Any, max_loss_scale: Any) -> jax.Array:
  """``scale`` clamped to the configured bounds (``None``: no bound)."""
  if min_loss_scale is not None:
    scale = jnp.maximum(scale, jnp.asarray(min_loss_scale, jnp.float32))
  if max_loss_scale is not None:
    scale = jnp.minimum(scale, jnp.asarray(max_loss_scale, jnp.float32))
  return scale


def _raise_too_many_skips(consecutive, step, scale, limit):
  raise FloatingPointError(
      f"jaxamp: {int(consecutive)} consecutive optimizer steps were skipped because "
      f"the gradients held inf or NaN (max_consecutive_skips={int(limit)}), at "
      f"update {int(step)}, with the loss scale now {float(scale)!r}. The loss itself "
      "is probably inf/NaN; check the model and data, or lower the learning rate."
  )


def check_skip_limit(consecutive, step, scale, limit) -> None:
  """Raises (as a runtime error of the jitted computation) when
  ``consecutive >= limit``. Runs a host callback only on that step."""
  jax.lax.cond(
      consecutive >= limit,
      lambda: jax.debug.callback(_raise_too_many_skips, consecutive, step, scale, limit),
      lambda: None,
  )
