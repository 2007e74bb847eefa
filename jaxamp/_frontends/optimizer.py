"""``Optimizer``: a torch-style optimizer handle for ``jaxamp.GradScaler``, and one update."""

from __future__ import annotations

import itertools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxamp._validation import apply_updates, is_none, none_gradient_error, zeros_like_arrays

_KEYS = itertools.count()


@jax.tree_util.register_pytree_node_class
class Optimizer:
  """An optax transformation with its params, state and grads, as a torch optimizer.

  What ``scaler.unscale_`` and ``scaler.step`` need (docs/grad_scaler.md). A pytree (``tx``
  static): pass it to a jitted function and return it. A copy or pickle is a new optimizer
  to a ``GradScaler`` (torch keys by ``id``); a pytree rebuilt inside ``jit`` is the same.

  Attributes:
    tx: the optax transformation (static: it is part of the pytree structure).
    params: the parameter tree.
    opt_state: ``tx``'s state.
    grads: the current gradients, a tree like ``params``, or ``None``.
    nonfinite_leaves: per leaf of ``params``, whether its gradient held inf/NaN at
      the last skipped step, bool ``[n_leaves]`` (``scaler.nonfinite_leaf_paths``).

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxamp
    >>> opt = jaxamp.Optimizer(optax.sgd(0.5), {"w": jnp.array([1.0, 2.0])})
    >>> opt.grads = jax.grad(lambda p: jnp.sum(p["w"] ** 2))(opt.params)
    >>> opt.step()
    >>> opt.params["w"].tolist()
    [0.0, 0.0]
  """

  def __init__(
    self, tx: optax.GradientTransformation, params: Any, *, opt_state: Any = None, grads: Any = None
  ):
    """``opt_state`` defaults to ``tx.init(params)``, ``grads`` to zeros like ``params``."""
    if not isinstance(tx, optax.GradientTransformation):
      raise TypeError(
        f"jaxamp.Optimizer takes an optax.GradientTransformation first, got {type(tx).__name__}."
      )
    self.tx = tx
    self.params = params
    self.opt_state = tx.init(params) if opt_state is None else opt_state
    self.grads = zeros_like_arrays(params) if grads is None else grads
    self.nonfinite_leaves = jnp.zeros([len(jax.tree.leaves(params))], bool)
    self._key = next(_KEYS)

  def zero_grad(self, set_to_none: bool = True) -> None:
    """Forgets the gradients, as torch's ``zero_grad()``.

    Args:
      set_to_none: ``True`` (torch's default) sets ``grads`` to ``None``,
        ``False`` to zeros like ``params``.
    """
    self.grads = None if set_to_none else zeros_like_arrays(self.params)

  def accumulate(self, grads: Any) -> None:
    """Adds ``grads`` to ``self.grads`` (``None`` counts as zeros), as torch's ``backward()``.

    Args:
      grads: the gradients to add, a tree like ``params``.

    Examples:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> opt = jaxamp.Optimizer(optax.sgd(1.0), {"w": jnp.zeros(2)})
      >>> opt.zero_grad(set_to_none=False)
      >>> for g in (1.0, 2.0):
      ...   opt.accumulate({"w": jnp.full(2, g)})
      >>> opt.grads["w"].tolist()
      [3.0, 3.0]
    """
    if self.grads is None:
      self.grads = grads
    else:
      self.grads = jax.tree.map(_add, self.grads, grads, is_leaf=is_none)

  def updated(self, grads: Any, **extra_args: Any) -> tuple[Any, Any]:
    """The ``(params, opt_state)`` after one ``tx`` update with ``grads``; pure.

    Args:
      grads: the gradients to apply, a tree like ``params``.
      **extra_args: passed to ``tx.update``.
    """
    return updated(self.tx, grads, self.opt_state, self.params, **extra_args)

  def step(self, **extra_args: Any) -> None:
    """Applies ``grads`` as torch's ``optimizer.step()``; a ``None`` gradient updates nothing.

    Args:
      **extra_args: passed to ``tx.update``.

    Raises:
      ValueError: ``tx`` cannot take a ``None`` gradient for a parameter its
        state holds (optax's Adam); the message names the leaf. Nothing is changed.
    """
    if self.grads is None:
      return
    self.params, self.opt_state = self.updated(self.grads, **extra_args)

  def __getstate__(self) -> dict[str, Any]:
    return {k: v for k, v in self.__dict__.items() if k != "_key"}

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__dict__.update(state)
    self._key = next(_KEYS)  # a copy is a new optimizer (torch: a new id())

  def tree_flatten(self) -> tuple[tuple, tuple]:
    return (self.params, self.opt_state, self.grads, self.nonfinite_leaves), (self.tx, self._key)

  @classmethod
  def tree_unflatten(cls, aux: tuple, children: tuple) -> Optimizer:
    optimizer = object.__new__(cls)
    optimizer.tx, optimizer._key = aux
    optimizer.params, optimizer.opt_state, optimizer.grads, optimizer.nonfinite_leaves = children
    return optimizer

  def __repr__(self) -> str:
    return f"jaxamp.Optimizer(key={self._key}, params={jax.tree.structure(self.params)})"


def _add(accumulated: Any, grad: Any) -> Any:
  """One leaf of ``accumulate``: a ``None`` gradient is zeros."""
  if accumulated is None:
    return grad
  return accumulated if grad is None else jnp.add(accumulated, grad)


def updated(
  tx: optax.GradientTransformation, grads: Any, opt_state: Any, params: Any, **extra_args: Any
):
  """``(params, opt_state)`` after ``tx.update`` and ``apply_updates`` (``None``: no change)."""
  try:
    updates, new_state = optax.with_extra_args_support(tx).update(
      grads, opt_state, params, **extra_args
    )
  except (ValueError, TypeError) as error:
    none_error = none_gradient_error(grads, params)
    if none_error is None:
      raise
    raise none_error from error
  if jax.tree.structure(new_state) != jax.tree.structure(opt_state):  # type: ignore[operator]
    # optax's momentum drops a None gradient's trace: the state changed shape,
    # which no later step (and no skipped branch) could take.
    none_error = none_gradient_error(grads, params)
    if none_error is not None:
      raise none_error
  return apply_updates(params, updates), new_state


def per_param_leaf(grads: Any, params: Any, flags: jax.Array) -> jax.Array | None:
  """``flags`` per array leaf of ``params`` (``None`` gradients finite); None if trees differ."""
  grad_leaves, grads_def = jax.tree.flatten(grads, is_leaf=is_none)
  param_leaves, params_def = jax.tree.flatten(params, is_leaf=is_none)
  if grads_def != params_def:  # type: ignore[operator]
    return None
  if all(g is not None and p is not None for g, p in zip(grad_leaves, param_leaves)):
    return flags
  per_position, flag_index = [], 0
  for grad, param in zip(grad_leaves, param_leaves):
    if grad is not None:
      flag, flag_index = flags[flag_index], flag_index + 1
    else:
      flag = jnp.zeros([], bool)
    if param is not None:
      per_position.append(flag)
  return jnp.stack(per_position) if per_position else jnp.zeros([0], bool)
