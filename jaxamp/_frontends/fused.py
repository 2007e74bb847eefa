"""``apply_scaled_updates``: unscale, check, and update the params or skip, in one call."""

from __future__ import annotations

from typing import Any

import jax
import optax

from jaxamp import _engine as engine
from jaxamp._frontends.accumulation import (
  AccumulateGradients,
  AccumulateGradientsState,
  accumulated,
  after_window,
  at_window_end,
  within_window,
)
from jaxamp._frontends.state_access import find_loss_scale_state, is_loss_scale_state
from jaxamp._frontends.transform import CheckedState, DynamicLossScaleState, core_of
from jaxamp._torch.core import check_skip_limit
from jaxamp._torch.schedules import INJECT_STATES
from jaxamp._validation import apply_updates, arrays_only, checked_gradients, with_non_arrays
from jaxamp._xla.compile_cache import call_compiled, traced
from jaxamp._xla.fma_guard import rounded_updates
from jaxamp._xla.layout import row_major

_IN_FRONT = "jaxamp.apply_scaled_updates: the dynamic_loss_scale inside tx does not see the gradients as given: "


def _holds_scaler(node: Any) -> bool:
  leaves = jax.tree.leaves(node, is_leaf=lambda x: isinstance(x, DynamicLossScaleState))
  return any(isinstance(x, DynamicLossScaleState) for x in leaves)


def _check_sees_grads_as_given(opt_state: Any) -> None:
  """Raises unless the jaxamp state receives the gradients unchanged: bare, inside
  ``inject_hyperparams`` or first in ``chain``, under at most an outer accumulation."""
  # A layout, not a type, is wrong here: ValueError, as documented.
  root = isinstance(opt_state, AccumulateGradientsState)
  node = opt_state.inner_state if root else opt_state
  while not isinstance(node, DynamicLossScaleState):
    if isinstance(node, (optax.MultiStepsState, AccumulateGradientsState)):
      name = (
        "optax.MultiSteps"
        if isinstance(node, optax.MultiStepsState)
        else "an inner accumulate_gradients"
      )
      raise ValueError(  # noqa: TRY004
        f"{_IN_FRONT}{name} around it sums them before it checks them. Accumulate outside "
        "the scaler, as torch does: jaxamp.accumulate_gradients(jaxamp.dynamic_loss_scale(inner), k)."
      )
    if isinstance(node, INJECT_STATES):
      node = node.inner_state
    elif type(node) is tuple and node:  # optax.chain
      ahead = next(i for i, part in enumerate(node) if _holds_scaler(part))
      if ahead:
        raise ValueError(
          f"{_IN_FRONT}{ahead} transformation(s) of optax.chain stand in front of it and "
          "would transform the still-scaled gradients (a clip would clip at the scaled "
          "norm). Move them inside the scaler: jaxamp.dynamic_loss_scale(optax.chain(..., inner))."
        )
      node = node[0]
    elif isinstance(node, optax.LookaheadState):
      raise ValueError(
        f"{_IN_FRONT}optax.lookahead around it steps the fast and slow parameters itself. "
        "Call updates, opt_state = tx.update(grads, opt_state, params), then "
        "params = optax.apply_updates(params, updates)."
      )
    else:
      raise ValueError(
        f"{_IN_FRONT}it is nested in a {type(node).__name__} state. Make dynamic_loss_scale "
        "the outermost transformation (inside optax.inject_hyperparams or first in optax.chain)."
      )


def apply_scaled_updates(
  tx: optax.GradientTransformation,
  grads: Any,
  opt_state: optax.OptState,
  params: Any,
  *,
  axis_name: str | tuple[str, ...] | None = None,
  **extra_args: Any,
) -> tuple[Any, optax.OptState]:
  """``tx.update`` and ``optax.apply_updates`` in one call, skipped as a whole on inf/NaN.

  The loss-scale state and every skip decision are bit-identical to those two calls,
  params and the inner state to the last bits; one ``lax.cond`` runs it all (docs/speed.md).
  ``tx`` holds a :func:`dynamic_loss_scale` that receives ``grads`` unchanged (bare,
  inside ``optax.inject_hyperparams``, or first in ``optax.chain``), possibly under an
  outermost :func:`accumulate_gradients`. Donate ``params`` and ``opt_state`` in the
  order they are returned to update them in place.

  Args:
    tx: the optimizer, holding a :func:`dynamic_loss_scale`.
    grads: gradients of the scaled loss, a tree like ``params``.
    opt_state: ``tx``'s state.
    params: the parameters to update.
    axis_name: optional: the transform's ``axis_name`` is used (every device
      then takes the same branch); if given, it must be the same.
    **extra_args: forwarded to ``tx.update``.

  Returns:
    ``(new_params, new_opt_state)``.

  Raises:
    ValueError: ``opt_state`` holds no jaxamp state; ``tx`` does not check
      ``grads`` as given (a transformation in front of the scaler, or
      ``optax.MultiSteps`` around it); another ``axis_name`` than the transform's.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxamp
    >>> tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=4.0)
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> step = jax.jit(jaxamp.apply_scaled_updates, static_argnums=0)
    >>> params, state = step(tx, {"w": jnp.array([4.0, jnp.inf])}, state, params)
    >>> params["w"].tolist(), float(state.loss_scale)   # skipped, backed off
    ([1.0, 1.0], 2.0)
    >>> params, state = step(tx, {"w": jnp.array([4.0, 2.0])}, state, params)
    >>> params["w"].tolist()
    [0.800000011920929, 0.8999999761581421]
  """
  if not (hasattr(tx, "init") and hasattr(tx, "update")):  # optax.MultiSteps is a class
    raise TypeError(
      "jaxamp.apply_scaled_updates: tx must be the optax transformation holding the "
      f"dynamic_loss_scale, got {type(tx).__name__}."
    )
  scale_state = find_loss_scale_state(opt_state)
  config = scale_state.config
  if axis_name is not None and axis_name != config.axis_name:
    raise ValueError(
      f"jaxamp.apply_scaled_updates: axis_name={axis_name!r} but the dynamic_loss_scale "
      f"in tx was built with axis_name={config.axis_name!r}; the devices would take "
      "different branches. Leave axis_name out here: the transform's is used."
    )
  if isinstance(opt_state, AccumulateGradientsState) and not isinstance(tx, AccumulateGradients):
    raise TypeError(
      "jaxamp.apply_scaled_updates: the state is jaxamp.accumulate_gradients' but tx is "
      "not the transformation it returned; pass that one, unwrapped."
    )
  if config.enabled:
    _check_sees_grads_as_given(opt_state)
  if grads is None and params is not None:
    raise ValueError(
      "jaxamp.apply_scaled_updates: the gradient tree does not match the parameter tree: "
      "grads is None. Pass gradients shaped like params (None leaves for frozen ones)."
    )
  grads = checked_gradients(grads, params)
  if "end_window" in extra_args and not isinstance(opt_state, AccumulateGradientsState):
    raise TypeError(
      "jaxamp.apply_scaled_updates: end_window ends a jaxamp.accumulate_gradients window, "
      "and tx accumulates nothing. Wrap it: jaxamp.accumulate_gradients(tx, every_k)."
    )
  eager = not traced((grads, opt_state))
  arguments = (grads, opt_state, arrays_only(params), extra_args)
  new_params, new_state = call_compiled(_apply_scaled_updates, (tx, eager), *arguments)
  new_params = with_non_arrays(new_params, params, grads)
  if eager:  # outside jit: a clear error, and the caller's state as it was
    check_skip_limit(core_of(find_loss_scale_state(new_state)), config)
  return new_params, new_state


def _apply_scaled_updates(static, grads, opt_state, params, extra_args):
  tx, eager = static
  grads = row_major(grads)  # before the conds: see row_major
  if not isinstance(opt_state, AccumulateGradientsState):
    return _fused_step(tx, grads, opt_state, params, extra_args, eager)
  extra_args = dict(extra_args)
  end_window = extra_args.pop("end_window", False)
  total = accumulated(grads, opt_state)

  def end(params, state):
    inner_state = state.inner_state
    new_params, inner_state = _fused_step(tx.inner, total, inner_state, params, extra_args, eager)
    return new_params, after_window(state, inner_state)

  def hold(params, state):
    return params, within_window(state, total)

  return at_window_end(opt_state, tx.every_k, end_window, end, hold, params, opt_state)


def _fused_step(tx, grads, opt_state, params, extra_args, eager):
  """The engine's check once, then ``tx.update`` and ``apply_updates`` or the skip."""
  scale_state = find_loss_scale_state(opt_state)
  config = scale_state.config
  if not config.enabled:  # a disabled scaler checks nothing and never skips
    updates, new_state = tx.update(grads, opt_state, params, **extra_args)
    return apply_updates(params, updates), new_state
  check = engine.check(grads, scale_state.loss_scale, config, scale_state, params)
  labels = None if config.param_labels is None else config.param_labels.of(grads)

  def update(params, opt_state, found_inf):
    # The transformation runs the engine's iteration in this branch, with
    # this check: it neither checks nor branches again.
    def checked(node):
      return CheckedState(node, check, found_inf, eager) if is_loss_scale_state(node) else node

    opt_state = jax.tree.map(checked, opt_state, is_leaf=is_loss_scale_state)
    return tx.update(grads, opt_state, params, **extra_args)

  def applied(params, opt_state):
    updates, new_state = update(params, opt_state, False)
    updates = rounded_updates(updates, scale_state.loss_scale)
    return apply_updates(params, updates), new_state

  apply, output_types = engine.with_output_types(applied)

  def skip(params, opt_state):
    updates, new_state = update(params, opt_state, True)
    if labels is None:  # nothing applied: the state typed as the applied branch's
      return params, engine.typed_like(new_state, output_types(params, opt_state)[1])
    stepped = apply_updates(params, updates)  # the finite groups' updates
    return engine.keep_skipped_params(params, stepped, check, labels, grads), new_state

  # params and opt_state are the branches' operands, so a donated buffer is
  # updated in place, and a skipped step leaves it untouched without a copy.
  return engine.apply_or_skip(check.found_inf, apply, skip, params, opt_state)
