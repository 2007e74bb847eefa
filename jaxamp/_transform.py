"""``dynamic_loss_scale``: torch's GradScaler iteration as an optax wrapper."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxamp._distributed import all_reduce_found_inf, varying_axes
from jaxamp._protections import (
  check_protection_options,
  check_skip_limit,
  update_loss_scale_with_options,
)
from jaxamp._unscale import known_for, leaf_finite_flags, rounded, runtime_zero, unscale
from jaxamp._validation import (
  check_float_gradients,
  check_hyperparameters,
  check_leaf_count,
  check_same_structure,
)


class DynamicLossScaleState(NamedTuple):
  """State of :func:`dynamic_loss_scale`.

  Attributes:
    loss_scale: the scale to multiply the next loss by, float32 ``[]``.
    growth_tracker: consecutive finite updates since the last growth or
      backoff, int32 ``[]`` (torch's ``_growth_tracker``).
    found_inf: whether the last update found inf/NaN and was skipped, bool ``[]``.
    skipped_steps: total skipped updates, int32 ``[]`` (saturates at 2**31-1).
    consecutive_skipped_steps: skipped updates since the last applied one,
      int32 ``[]`` (saturating).
    hysteresis_tracker: overflowing steps still tolerated before a backoff,
      int32 ``[]`` (always ``hysteresis``, 1 by default: torch backs off at once).
    update_count: updates so far, skipped or not, int32 ``[]`` (saturating).
    nonfinite_leaves: for each gradient leaf (``jax.tree.leaves`` order),
      whether it held inf/NaN in the last skipped step, bool ``[n_leaves]``;
      see :func:`jaxamp.nonfinite_leaf_paths`.
    inner_state: the wrapped transformation's state, untouched by skipped updates.
  """

  loss_scale: jax.Array
  growth_tracker: jax.Array
  found_inf: jax.Array
  skipped_steps: jax.Array
  consecutive_skipped_steps: jax.Array
  hysteresis_tracker: jax.Array
  update_count: jax.Array
  nonfinite_leaves: jax.Array
  inner_state: optax.OptState


def _count_if(condition: jax.Array, counter: jax.Array) -> jax.Array:
  """``counter + 1`` where ``condition`` holds, saturating at the int32 maximum."""
  return jnp.where(condition, optax.safe_increment(counter), counter)


def _like(value: jax.Array, template: Any) -> jax.Array:
  """``value`` marked as varying over the same ``shard_map`` axes as ``template``."""
  missing = tuple(sorted(varying_axes(template) - varying_axes(value)))
  return lax.pcast(value, missing, to="varying") if missing else value


def _skipped_step(applied_step, grads, inner_state, params):
  """Zero updates and the untouched inner state, typed as ``applied_step``'s output."""
  updates_out, state_out = jax.eval_shape(applied_step, grads, inner_state, params)
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), updates_out)
  return (
      jax.tree.map(_like, zeros, updates_out),
      jax.tree.map(_like, inner_state, state_out),
  )


def dynamic_loss_scale(
    inner: optax.GradientTransformation,
    *,
    init_scale: float | jax.Array = 2.0**16,
    growth_factor: float | jax.Array = 2.0,
    backoff_factor: float | jax.Array = 0.5,
    growth_interval: int | jax.Array = 2000,
    enabled: bool = True,
    axis_name: str | tuple[str, ...] | None = None,
    min_loss_scale: float | jax.Array | None = None,
    max_loss_scale: float | jax.Array | None = None,
    hysteresis: int | jax.Array = 1,
    consecutive_hysteresis: bool = False,
    max_consecutive_skips: int | None = None,
    detect_unscale_overflow: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` with dynamic loss scaling, as ``torch.amp.GradScaler``.

  Multiply the loss by ``get_loss_scale(opt_state)`` (or use
  :func:`scale_loss`) and pass the gradients of the *scaled* loss to
  ``update``. Each update does one torch iteration, jitted and without host
  synchronisation (called outside ``jit``, it compiles once per shapes)::

    unscaled, found_inf = unscale_and_check(grads, loss_scale)
    if found_inf:  updates, inner_state = zeros, inner_state      # skipped
    else:          updates, inner_state = inner.update(unscaled, inner_state, params)
    loss_scale, growth_tracker = update_loss_scale(...)           # torch's rule

  The inner update is not computed on a skipped step (``lax.cond``), and the
  inner state comes back bit-identical. Chained transformations inside
  ``inner`` (e.g. ``optax.clip_by_global_norm``) see unscaled gradients. For
  gradient accumulation, put ``optax.MultiSteps`` *outside*:
  ``optax.MultiSteps(dynamic_loss_scale(inner), k)``, so the scale stays fixed
  within a window and is updated once per optimizer step, as in torch.

  Args:
    inner: the optimizer to run on unscaled gradients.
    init_scale: the initial scale (a finite positive float32 number).
    growth_factor: multiplies the scale after ``growth_interval`` consecutive
      finite steps (> 1). Python numbers are applied exactly as float64, as torch.
    backoff_factor: multiplies the scale on a step with inf/NaN (0 < x < 1).
    growth_interval: consecutive finite steps before growing (an int; zero or
      less never grows, as in torch).
    enabled: ``False`` behaves as torch's disabled scaler: the scale is 1, there
      is no check, and ``inner`` sees the gradients as given.
    axis_name: for per-device gradients under ``jax.shard_map`` (or ``pmap``):
      the mapped axis (or axes) over which the finiteness flag is all-reduced,
      so every device skips the same steps and keeps the same scale, as torch
      all-reduces ``found_inf``. Not needed under ``jax.jit`` with sharded
      arrays, where the check is already global. Without it under
      ``shard_map``, each device decides from its own gradients and replicas
      can diverge.
    min_loss_scale: (not in torch) the scale never backs off below this.
    max_loss_scale: (not in torch) the scale never grows above this.
    hysteresis: (not in torch; DeepSpeed, Megatron) overflowing steps tolerated
      before a backoff. Every overflowing step is skipped and resets the growth
      tracker; it backs off only when ``hysteresis_tracker <= 1``, otherwise it
      decrements the tracker. The tracker refills to ``hysteresis`` on a growth
      (or, with ``consecutive_hysteresis``, on every finite step). 1 is torch.
    consecutive_hysteresis: DeepSpeed's variant, see ``hysteresis``.
    max_consecutive_skips: (not in torch) when this many steps in a row are
      skipped, the jitted step fails with a runtime error naming the update and
      the scale (a host callback that runs only on that step).
    detect_unscale_overflow: (not in torch) also skip when unscaling itself
      overflows (torch misses a bfloat16 ``3e38`` at scale 0.5: SPEC 3.2).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`DynamicLossScaleState`.

  Raises:
    ValueError: a concrete hyperparameter is invalid (checked at construction;
      traced values from ``optax.inject_hyperparams`` are not checked).
    TypeError: a gradient leaf is not floating point (at ``update``).

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxamp
    >>> tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0)
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> loss_fn = lambda p: jnp.sum(p["w"] ** 2)
    >>> grads = jax.grad(lambda p: jaxamp.scale_loss(loss_fn(p), state))(params)
    >>> updates, state = tx.update(grads, state, params)
    >>> updates["w"].tolist(), float(state.loss_scale)
    ([-0.20000000298023224, -0.20000000298023224], 8.0)
  """
  if enabled:
    check_hyperparameters(
        init_scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
    )
    check_protection_options(
        init_scale=init_scale,
        min_loss_scale=min_loss_scale,
        max_loss_scale=max_loss_scale,
        hysteresis=hysteresis,
        max_consecutive_skips=max_consecutive_skips,
    )
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    scale = jnp.asarray(init_scale if enabled else 1.0, jnp.float32)
    return DynamicLossScaleState(
        loss_scale=scale,
        growth_tracker=jnp.zeros([], jnp.int32),
        found_inf=jnp.zeros([], bool),
        skipped_steps=jnp.zeros([], jnp.int32),
        consecutive_skipped_steps=jnp.zeros([], jnp.int32),
        hysteresis_tracker=jnp.asarray(hysteresis, jnp.int32),
        update_count=jnp.zeros([], jnp.int32),
        nonfinite_leaves=jnp.zeros([len(jax.tree.leaves(params))], bool),
        inner_state=inner.init(params),
    )

  def update_fn(updates, state, params=None, **extra_args):
    check_float_gradients(updates)
    check_same_structure(updates, params)
    if not enabled:
      new_updates, inner_state = inner.update(
          updates, state.inner_state, params, **extra_args
      )
      return new_updates, state._replace(inner_state=inner_state)

    check_leaf_count(updates, state.nonfinite_leaves)
    known = known_for(updates)
    finite = leaf_finite_flags(updates) if known is None else known.flags
    unscaled = None
    if detect_unscale_overflow:
      unscaled = unscale(updates, state.loss_scale)
      finite = finite & leaf_finite_flags(unscaled)
    nonfinite = ~finite
    if axis_name is not None:
      nonfinite = all_reduce_found_inf(nonfinite, state, axis_name)
    found_inf = jnp.any(nonfinite) if known is None else jnp.asarray(known.found_inf)
    zero = runtime_zero(state.loss_scale)

    def apply_inner(grads, inner_state, params):
      # Unscaling inside the branch lets XLA fuse it into the optimizer's
      # kernels; `rounded` keeps every unscaled value rounded to its dtype, as
      # torch materialises it, even where a consumer would contract it into an FMA.
      grads_in = unscale(grads, state.loss_scale) if unscaled is None else unscaled
      grads_in = jax.tree.map(lambda g: rounded(g, zero), grads_in)
      return inner.update(grads_in, inner_state, params, **extra_args)

    def skip_inner(grads, inner_state, params):
      return _skipped_step(apply_inner, grads, inner_state, params)

    operands = (updates, state.inner_state, params)
    if known is not None:  # inside apply_scaled_updates' branches: no cond of our own
      new_updates, inner_state = (skip_inner if known.found_inf else apply_inner)(*operands)
    else:
      new_updates, inner_state = lax.cond(~found_inf, apply_inner, skip_inner, *operands)
    loss_scale, growth_tracker, hysteresis_tracker = update_loss_scale_with_options(
        state.loss_scale,
        state.growth_tracker,
        state.hysteresis_tracker,
        found_inf,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        min_loss_scale=min_loss_scale,
        max_loss_scale=max_loss_scale,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive_hysteresis,
    )
    new_state = DynamicLossScaleState(
        loss_scale=loss_scale,
        growth_tracker=growth_tracker,
        found_inf=found_inf,
        skipped_steps=_count_if(found_inf, state.skipped_steps),
        consecutive_skipped_steps=jnp.where(
            found_inf, _count_if(found_inf, state.consecutive_skipped_steps), 0
        ),
        hysteresis_tracker=hysteresis_tracker,
        update_count=_count_if(True, state.update_count),
        nonfinite_leaves=jnp.where(found_inf, nonfinite, state.nonfinite_leaves),
        inner_state=inner_state,
    )
    if max_consecutive_skips is not None:
      check_skip_limit(
          new_state.consecutive_skipped_steps,
          new_state.update_count,
          new_state.loss_scale,
          max_consecutive_skips,
      )
    return new_updates, new_state

  compiled_update = jax.jit(update_fn)

  def update_compiled_once_outside_jit(updates, state, params=None, **extra_args):
    # Outside jit, lax.cond of fresh closures would compile on every call;
    # jitting the whole update compiles it once per shapes. Inside a trace
    # (jit, grad, apply_scaled_updates' branches) the update is traced inline.
    arguments = (updates, state, params, extra_args)
    if all(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
           for x in jax.tree.leaves(arguments)):
      return compiled_update(updates, state, params, **extra_args)
    return update_fn(updates, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(init_fn, update_compiled_once_outside_jit)
