"""``apply_scaled_updates``: unscale, check, and update the params or skip, in one call."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxamp._distributed import all_reduce_found_inf
from jaxamp._state_access import find_loss_scale_state
from jaxamp._unscale import known_flags, leaf_finite_flags, rounded, runtime_zero
from jaxamp._validation import check_float_gradients, check_same_structure

_NOT_AS_GIVEN = (
    "jaxamp.apply_scaled_updates: the dynamic_loss_scale inside tx does not see "
    "the gradients as given (a transformation in front of it, or optax.MultiSteps "
    "around it). Call tx.update and optax.apply_updates instead."
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

  Computes what this computes::

    updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
    params = optax.apply_updates(params, updates)

  The loss-scale state, every skip decision and the unscaled gradients the
  optimizer sees are bit-identical to it. Params and the inner state agree to
  the last bits: XLA CPU fuses the single expression differently (multiply-add
  contraction inside the optimizer's own arithmetic), as two ways of writing
  the same optax step may.

  ``tx`` holds a :func:`dynamic_loss_scale` (bare or inside ``optax.chain``,
  ``optax.inject_hyperparams``) that receives ``grads`` unchanged. The
  gradients are checked once; the step then runs in a ``lax.cond``: on finite
  gradients the whole update (unscale, inner optimizer, ``apply_updates``)
  compiles to one branch that XLA fuses, with no materialised updates and no
  second check; on a skipped step only the loss-scale bookkeeping runs and
  ``params`` and the inner state come back untouched. Donate ``params`` and
  ``opt_state`` to ``jax.jit`` to update them in place, in the order they are
  returned (``step(params, opt_state, grads) -> (params, opt_state)`` with
  ``donate_argnums=(0, 1)``): JAX pairs each donated input with the first
  output of its shape, and a crosswise pairing makes XLA copy every buffer.

  Args:
    tx: the optimizer, holding a :func:`dynamic_loss_scale`.
    grads: gradients of the scaled loss, a tree like ``params``.
    opt_state: ``tx``'s state.
    params: the parameters to update.
    axis_name: under ``jax.shard_map``, the same ``axis_name`` as given to
      :func:`dynamic_loss_scale`, so every device takes the same branch.
    **extra_args: forwarded to ``tx.update``.

  Returns:
    ``(new_params, new_opt_state)``.

  Raises:
    ValueError: ``opt_state`` holds no jaxamp state, or ``tx`` does not check
      ``grads`` as given (e.g. ``optax.MultiSteps`` around it: then call
      ``tx.update`` and ``optax.apply_updates``).

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
  scale_state = find_loss_scale_state(opt_state)
  is_multi = lambda x: isinstance(x, optax.MultiStepsState)
  if any(is_multi(x) for x in jax.tree.leaves(opt_state, is_leaf=is_multi)):
    raise ValueError(_NOT_AS_GIVEN)
  check_float_gradients(grads)
  check_same_structure(grads, params)
  flags = leaf_finite_flags(grads)
  if axis_name is not None:
    flags = ~all_reduce_found_inf(~flags, scale_state, axis_name)
  found_inf = ~jnp.all(flags)
  uses = []

  def update(params, opt_state, known, found):
    with known_flags(grads, known, found) as substituted:
      updates, new_state = tx.update(grads, opt_state, params, **extra_args)
    uses.append(substituted.uses)
    return updates, new_state

  def skip(params, opt_state):
    # found_inf is a constant here, so XLA drops the transform's own lax.cond.
    _, new_state = update(params, opt_state, flags, True)
    return params, new_state

  def apply(params, opt_state):
    # XLA CPU contracts a * b + c into an FMA inside a fusion, where tx.update
    # then apply_updates rounds the materialised updates first. XOR-ing their
    # bits with a runtime zero keeps that rounding, bit for bit, and costs no
    # memory pass. (The transform rounds the unscaled grads with its own zero;
    # this one is doubled so that XLA cannot cancel the two XORs of an
    # identity optimizer, (b ^ z) ^ z = b.)
    zero = runtime_zero(scale_state.loss_scale) * 2
    updates, new_state = update(params, opt_state, jnp.ones(flags.shape, bool), False)
    updates = jax.tree.map(functools.partial(rounded, zero=zero), updates)
    return optax.apply_updates(params, updates), new_state

  # params and opt_state are the branches' operands, so a donated buffer is
  # updated in place, and a skipped step leaves it untouched without a copy.
  new_params, new_state = lax.cond(~found_inf, apply, skip, params, opt_state)
  if uses and all(n == 1 for n in uses):  # both branches (one under disable_jit)
    return new_params, new_state
  if not any(uses):  # a disabled scaler checks nothing and never skips
    updates, new_state = tx.update(grads, opt_state, params, **extra_args)
    return optax.apply_updates(params, updates), new_state
  raise ValueError(_NOT_AS_GIVEN)
