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

from jaxamp._scale_update import update_loss_scale
from jaxamp._validation import FLT_MAX, check_hyperparameter_dtype, concrete_value


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
        isinstance(value, numbers.Real) and 0 < value <= FLT_MAX and np.float32(value) > 0
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


def update_loss_scale_with_options(
    loss_scale: jax.Array,
    growth_tracker: jax.Array,
    hysteresis_tracker: jax.Array,
    found_inf: jax.Array,
    *,
    growth_factor: Any,
    backoff_factor: Any,
    growth_interval: Any,
    min_loss_scale: Any = None,
    max_loss_scale: Any = None,
    hysteresis: Any = 1,
    consecutive_hysteresis: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """torch's :func:`~jaxamp.update_loss_scale` with the opt-in options.

  Returns the new ``(loss_scale, growth_tracker, hysteresis_tracker)``::

    back_off = found_inf and hysteresis_tracker <= 1
    scale, tracker = update_loss_scale(scale, tracker, found_inf)   # torch
    if found_inf and not back_off: scale = old scale                # absorbed
    scale = clip(scale, min_loss_scale, max_loss_scale)
    hysteresis_tracker: refilled to ``hysteresis`` on a growth attempt (or on
      any finite step with ``consecutive_hysteresis``), decremented by an
      absorbed overflow, kept on a backoff.

  With the defaults (no bounds, ``hysteresis=1``) this is exactly torch's rule.
  """
  back_off = found_inf & (hysteresis_tracker <= 1)
  new_scale, new_tracker = update_loss_scale(
      loss_scale,
      growth_tracker,
      found_inf,
      growth_factor=growth_factor,
      backoff_factor=backoff_factor,
      growth_interval=growth_interval,
  )
  new_scale = jnp.where(found_inf & ~back_off, loss_scale, new_scale)
  new_scale = clamp_scale(new_scale, min_loss_scale, max_loss_scale)
  refill = ~found_inf if consecutive_hysteresis else ~found_inf & (new_tracker == 0)
  absorbed = (found_inf & ~back_off).astype(jnp.int32)
  new_hysteresis = jnp.where(
      refill, jnp.asarray(hysteresis, jnp.int32), hysteresis_tracker - absorbed
  )
  return new_scale, new_tracker, new_hysteresis


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
