"""Gradient accumulation as torch does it: sum ``.grad`` over micro-batches, step, zero."""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxamp import _engine as engine
from jaxamp._distributed import zeros_of_type
from jaxamp._hyperparams import INT32_MAX
from jaxamp._validation import is_none, zeros_like_arrays


class AccumulateGradientsState(NamedTuple):
  """State of :func:`accumulate_gradients`.

  Attributes:
    mini_step: micro-batches accumulated in this window so far, int32 ``[]``.
    acc_grads: their gradients summed, in the params' dtypes.
    inner_state: the wrapped transformation's state.
  """

  mini_step: jax.Array
  acc_grads: Any
  inner_state: optax.OptState


class AccumulateGradients(optax.GradientTransformationExtraArgs):
  """:func:`accumulate_gradients`' transformation, with the ``inner`` and ``every_k``
  that ``jaxamp.apply_scaled_updates`` reads."""

  inner: optax.GradientTransformationExtraArgs
  every_k: int


def accumulated(grads: Any, state: AccumulateGradientsState) -> Any:
  """``acc + grads``, this window's gradients so far; a ``None`` gradient stays ``None``."""

  def add(acc: Any, g: Any) -> Any:
    return None if g is None or acc is None else acc + g.astype(acc.dtype)

  return jax.tree.map(add, state.acc_grads, grads, is_leaf=is_none)


def at_window_end(
  state: AccumulateGradientsState, every_k: int, end_window: Any, end, hold, *operands: Any
):
  """``end(*operands)`` on a window's last call (the ``every_k``-th, or one
  ``end_window`` ends early), else ``hold(*operands)``: the one place a window
  is closed (the optax form and ``apply_scaled_updates``)."""
  if not (isinstance(end_window, (bool, np.bool_)) or jnp.shape(end_window) == ()):
    raise TypeError(f"jaxamp: end_window must be a bool or a bool scalar, got {end_window!r}.")
  # >=, not ==: a state saved mid-window of a longer window ends on its next call.
  ends = (state.mini_step >= every_k - 1) | jnp.asarray(end_window, bool)
  return engine.cond(ends, end, hold, *operands)


def after_window(state: AccumulateGradientsState, inner_state: Any):
  """The state after a window's last micro-batch: zero gradients, new inner state."""
  zeros = jax.tree.map(jnp.zeros_like, state.acc_grads)  # not 0 * acc: acc may hold inf
  return AccumulateGradientsState(jnp.zeros([], jnp.int32), zeros, inner_state)


def within_window(state: AccumulateGradientsState, total: Any) -> AccumulateGradientsState:
  acc = jax.tree.map(lambda a, t: a if t is None else t, state.acc_grads, total, is_leaf=is_none)
  return state._replace(mini_step=state.mini_step + 1, acc_grads=acc)


def accumulate_gradients(inner: optax.GradientTransformation, every_k: int) -> AccumulateGradients:
  """Sums the gradients of ``every_k`` calls and passes the sum to ``inner`` on the last.

  torch's accumulation (docs/optax.md): around :func:`~jaxamp.dynamic_loss_scale` the scale
  is fixed within a window and a window with inf/NaN is skipped. It sums (divide the loss by
  ``every_k``) and restarts from zeros, unlike ``optax.MultiSteps``; calls within a window
  return zero updates. ``update(..., end_window=True)`` (a bool, or a traced bool scalar)
  ends the window early, as torch's ``step()`` after fewer micro-batches.

  Args:
    inner: the transformation run once per window on the summed gradients.
    every_k: micro-batches per window (an int >= 1).

  Examples:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> tx = jaxamp.accumulate_gradients(optax.sgd(1.0), 2)
    >>> params = {"w": jnp.zeros(1)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.ones(1)}, state, params)
    >>> updates["w"].tolist()
    [0.0]
    >>> updates, state = tx.update({"w": jnp.full(1, 2.0)}, state, params)
    >>> updates["w"].tolist()
    [-3.0]
  """
  is_int = isinstance(every_k, numbers.Integral) and not isinstance(every_k, bool)
  if not (is_int and 1 <= every_k <= INT32_MAX):
    raise ValueError(
      f"jaxamp: every_k must be an int from 1 to 2**31 - 1 (the window's count is an "
      f"int32), got {every_k!r}."
    )
  every_k = int(every_k)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    zeros = zeros_like_arrays(params)  # None for an Equinox module's functions
    return AccumulateGradientsState(jnp.zeros([], jnp.int32), zeros, inner.init(params))

  def update_fn(updates, state, params=None, *, end_window=False, **extra_args):
    total = accumulated(updates, state)

    def end(total, inner_state, params):
      new_updates, inner_state = inner.update(total, inner_state, params, **extra_args)
      return new_updates, after_window(state, inner_state)

    def hold(total, inner_state, params):
      shapes, _ = engine.eval_shape(end, total, inner_state, params)
      zeros = jax.tree.map(zeros_of_type, shapes)
      return zeros, within_window(state, total)

    return at_window_end(state, every_k, end_window, end, hold, total, state.inner_state, params)

  tx = AccumulateGradients(init_fn, update_fn)
  tx.inner, tx.every_k = inner, every_k
  return tx
