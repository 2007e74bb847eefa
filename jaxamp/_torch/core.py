"""The loss-scale core shared by both front-ends: its state and the one step that advances it."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxamp._config import LossScaleConfig
from jaxamp._skip_limit import check_in_computation, check_on_host
from jaxamp._torch.scale_rule import update_loss_scale


class LossScaleCore(NamedTuple):
  """The state of a loss scaler, arrays only: the fields of the same names in
  :class:`~jaxamp.DynamicLossScaleState`, which describes them (``int32`` counters saturate)."""

  loss_scale: jax.Array
  growth_tracker: jax.Array
  hysteresis_tracker: jax.Array
  found_inf: jax.Array
  update_count: jax.Array
  skipped_steps: jax.Array
  consecutive_skipped_steps: jax.Array


def scale_array(scale: Any) -> jax.Array:
  """``float32(scale)`` rounded to nearest, as torch's ``fill_`` (a checked scale)."""
  if isinstance(scale, (jax.Array, np.ndarray)):
    return jnp.asarray(scale, jnp.float32)
  return jnp.asarray(np.float32(scale))


def int32_array(value: Any) -> jax.Array:
  return jnp.asarray(value, jnp.int32)


def init_core(config: LossScaleConfig) -> LossScaleCore:
  """The core before the first update: ``init_scale`` (1 when disabled), zero counters."""
  # Copies: a donated state must hold no buffer twice, nor an injected hyperparameter's.
  return LossScaleCore(
    loss_scale=jnp.array(scale_array(config.init_scale if config.enabled else 1.0), copy=True),
    growth_tracker=int32_array(0),
    hysteresis_tracker=jnp.array(int32_array(config.hysteresis), copy=True),
    found_inf=jnp.zeros([], bool),
    update_count=int32_array(0),
    skipped_steps=int32_array(0),
    consecutive_skipped_steps=int32_array(0),
  )


def _count_if(condition: jax.Array | bool, counter: jax.Array) -> jax.Array:
  """``counter + 1`` where ``condition`` holds, saturating at the int32 maximum."""
  return jnp.where(condition, optax.safe_increment(counter), counter)


def advance(
  core: LossScaleCore, found_inf: jax.Array, config: LossScaleConfig, *, eager: bool = False
) -> LossScaleCore:
  """The core after one update that found (or did not find) inf/NaN: torch's rule
  (:func:`~jaxamp.ops.update_loss_scale`) with the options, as docs/protections.md,
  "Semantics" writes it; reaching ``max_consecutive_skips`` fails the computation
  (``eager``: the caller raises with :func:`check_skip_limit` before storing it)."""
  found_inf = jnp.asarray(found_inf, bool)
  back_off = found_inf & (core.hysteresis_tracker <= 1)
  scale, tracker = update_loss_scale(
    core.loss_scale,
    core.growth_tracker,
    found_inf,
    growth_factor=config.growth_factor,
    backoff_factor=config.backoff_factor,
    growth_interval=config.growth_interval,
  )
  scale = jnp.where(found_inf & ~back_off, core.loss_scale, scale)
  if config.min_loss_scale is not None:
    scale = jnp.maximum(scale, scale_array(config.min_loss_scale))
  if config.max_loss_scale is not None:
    scale = jnp.minimum(scale, scale_array(config.max_loss_scale))
  refill = ~found_inf if config.consecutive_hysteresis else ~found_inf & (tracker == 0)
  absorbed = (found_inf & ~back_off).astype(jnp.int32)
  hysteresis = jnp.where(refill, int32_array(config.hysteresis), core.hysteresis_tracker - absorbed)
  new = LossScaleCore(
    loss_scale=scale,
    growth_tracker=tracker,
    hysteresis_tracker=hysteresis,
    found_inf=found_inf,
    update_count=_count_if(True, core.update_count),
    skipped_steps=_count_if(found_inf, core.skipped_steps),
    consecutive_skipped_steps=jnp.where(
      found_inf, _count_if(True, core.consecutive_skipped_steps), 0
    ),
  )
  if config.max_consecutive_skips is not None and not eager:
    check_in_computation(
      new.consecutive_skipped_steps, new.update_count, new.loss_scale, config.max_consecutive_skips
    )
  return new


def check_skip_limit(core: LossScaleCore, config: LossScaleConfig) -> None:
  """Outside ``jit``: raises when ``core``, not yet stored, reached the skip limit."""
  check_on_host(
    core.consecutive_skipped_steps, core.update_count, core.loss_scale, config.max_consecutive_skips
  )
