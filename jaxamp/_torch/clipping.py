"""torch's ``clip_grad_norm_``: its formula, as a function and as an optax transformation."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


def _norm(x: jax.Array, norm_type: float) -> jax.Array:
  """``torch.linalg.vector_norm(x, norm_type)``, in float32 (or float64)."""
  x = jnp.abs(x.reshape(-1).astype(jnp.promote_types(x.dtype, jnp.float32)))
  if norm_type == float("inf"):
    return jnp.max(x, initial=0.0)
  if norm_type == float("-inf"):
    return jnp.min(x, initial=float("inf"))
  if norm_type == 0.0:
    return jnp.sum(x != 0).astype(x.dtype)
  if norm_type == 2.0:
    return jnp.sqrt(jnp.sum(x * x))
  return jnp.sum(x**norm_type) ** (1.0 / norm_type)


def clip_grad_norm(grads: Any, max_norm: float, norm_type: float = 2.0) -> tuple[Any, jax.Array]:
  """``torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)``, functional.

  Every gradient times ``min(max_norm / (total_norm + 1e-6), 1)``, unlike optax's
  ``clip_by_global_norm``; norms agree with torch's to float32 rounding.

  Args:
    grads: a pytree of floating-point arrays (``None`` leaves pass through).
    max_norm: the largest total norm kept.
    norm_type: the p of the p-norm, as torch: any float (``inf`` the max,
      ``-inf`` the min, ``0`` the count of non-zero entries) or anything
      ``float()`` takes (``"inf"``).

  Returns:
    ``(clipped_grads, total_norm)``, as torch returns the total norm.

  Examples:
    >>> import jax.numpy as jnp, numpy as np, jaxamp
    >>> clipped, norm = jaxamp.clip_grad_norm({"w": jnp.array([3.0, 4.0])}, 1.0)
    >>> float(norm), bool(np.allclose(clipped["w"], np.array([3.0, 4.0]) / (5.0 + 1e-6)))
    (5.0, True)
  """
  norm_type = float(norm_type)  # as torch: "inf" is the max norm
  leaves = jax.tree.leaves(grads)
  if not leaves:
    return grads, jnp.zeros([], jnp.float32)
  norms = [_norm(g, norm_type).astype(g.dtype) for g in leaves]
  dtype = jnp.result_type(*norms)
  total = _norm(jnp.stack([n.astype(dtype) for n in norms]), norm_type).astype(dtype)
  coefficient = jnp.minimum(max_norm / (total + 1e-6), 1.0)

  def scaled(g):
    opmath = jnp.promote_types(g.dtype, jnp.float32)
    return (g.astype(opmath) * coefficient.astype(opmath)).astype(g.dtype)

  return jax.tree.map(scaled, grads), total


class ClipGradNormState(NamedTuple):
  """The total norm of the last update's gradients, before clipping.

  Attributes:
    total_norm: the norm, float32 ``[]``, as ``clip_grad_norm_`` returns it.
  """

  total_norm: jax.Array


def clip_by_torch_norm(max_norm: float, norm_type: float = 2.0) -> optax.GradientTransformation:
  """:func:`clip_grad_norm` as an optax transformation (torch's clipping formula).

  Put it inside :func:`~jaxamp.dynamic_loss_scale` (unscaled gradients, as torch clips
  after ``scaler.unscale_``); its state keeps the total norm.

  Args:
    max_norm: the largest total norm kept.
    norm_type: the p of the p-norm, as in :func:`clip_grad_norm`.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> tx = jaxamp.dynamic_loss_scale(
    ...     optax.chain(jaxamp.ops.clip_by_torch_norm(1.0), optax.sgd(1.0)), init_scale=4.0)
    >>> params = {"w": jnp.zeros(2)}
    >>> updates, state = tx.update({"w": jnp.array([12.0, 16.0])}, tx.init(params), params)
    >>> float(state.inner_state[0].total_norm)  # the unscaled gradients' norm
    5.0
    >>> bool(jnp.allclose(updates["w"], -jnp.array([3.0, 4.0]) / (5.0 + 1e-6)))
    True
  """
  norm_type = float(norm_type)  # as clip_grad_norm; a bad value fails here, not in the step

  def init_fn(params):
    del params
    return ClipGradNormState(jnp.zeros([], jnp.float32))

  def update_fn(updates, state, params=None):
    del params, state
    clipped, total = clip_grad_norm(updates, max_norm, norm_type)
    return clipped, ClipGradNormState(total.astype(jnp.float32))

  return optax.GradientTransformation(init_fn, update_fn)


def _unitwise_norm(x: jax.Array, norm_type: float) -> jax.Array:
  """timm's ``unitwise_norm``: one norm per output unit (first axis), or one for a vector."""
  axes = tuple(range(1, x.ndim)) if x.ndim > 1 else tuple(range(x.ndim))
  x = jnp.abs(x.astype(jnp.promote_types(x.dtype, jnp.float32)))
  if norm_type == float("inf"):
    return jnp.max(x, axis=axes, keepdims=True)
  return jnp.sum(x**norm_type, axis=axes, keepdims=True) ** (1.0 / norm_type)


def adaptive_clip_grad(
  grads: Any, params: Any, clip_factor: float = 0.01, eps: float = 1e-3, norm_type: float = 2.0
) -> Any:
  """timm's ``adaptive_clip_grad`` (AGC, Brock et al. 2021) on weights in torch's layout.

  Each output unit's gradient (a ``Linear`` row, a ``Conv`` filter; a vector whole) is
  scaled to at most ``clip_factor`` times its weight's norm (at least ``eps``); optax's
  ``adaptive_grad_clip`` takes Flax's layouts. Use it after ``scaler.unscale_``.

  Args:
    grads: the gradients, a tree like ``params`` (``None`` leaves pass through).
    params: the weights, in torch's layout (output features first).
    clip_factor: the largest ratio of a unit's gradient norm to its weight norm.
    eps: the smallest weight norm used.
    norm_type: the p of the p-norms (``inf``: the largest magnitude).

  Examples:
    >>> import jax.numpy as jnp, jaxamp
    >>> w = jnp.array([[3.0, 4.0], [0.0, 1.0]])
    >>> g = jaxamp.ops.adaptive_clip_grad(jnp.array([[0.3, 0.4], [0.0, 0.001]]), w, 0.01)
    >>> [[round(float(v), 6) for v in row] for row in g]  # row 0 clipped to norm 0.05
    [[0.03, 0.04], [0.0, 0.001]]
  """
  norm_type = float(norm_type)

  def clip(g: Any, p: Any) -> Any:
    if g is None:
      return None
    max_norm = jnp.maximum(_unitwise_norm(p, norm_type), eps) * clip_factor
    g_norm = _unitwise_norm(g, norm_type)
    clipped = g * (max_norm / jnp.maximum(g_norm, 1e-6))
    return jnp.where(g_norm < max_norm, g, clipped).astype(g.dtype)

  return jax.tree.map(clip, grads, params, is_leaf=lambda x: x is None)


def adaptive_clip_by_torch_layout(
  clip_factor: float = 0.01, eps: float = 1e-3, norm_type: float = 2.0
) -> optax.GradientTransformation:
  """:func:`adaptive_clip_grad` as an optax transformation; put it inside
  :func:`~jaxamp.dynamic_loss_scale`, where it sees unscaled gradients.

  Args:
    clip_factor: as :func:`adaptive_clip_grad`.
    eps: as :func:`adaptive_clip_grad`.
    norm_type: as :func:`adaptive_clip_grad`.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> tx = jaxamp.dynamic_loss_scale(optax.chain(
    ...     jaxamp.ops.adaptive_clip_by_torch_layout(0.01), optax.sgd(1.0)), init_scale=2.0)
    >>> params = {"w": jnp.array([[3.0, 4.0]])}
    >>> updates, _ = tx.update({"w": jnp.array([[0.6, 0.8]])}, tx.init(params), params)
    >>> [round(float(v), 6) for v in updates["w"][0]]
    [-0.03, -0.04]
  """

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("jaxamp: adaptive clipping scales by the weights' norms: pass params.")
    return adaptive_clip_grad(updates, params, clip_factor, eps, norm_type), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)
