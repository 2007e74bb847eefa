"""Finding the jaxamp state inside any optimizer state, and scaling the loss."""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxamp._frontends.transform import DynamicLossScaleState
from jaxamp._torch.scaling import multiply_by_scale
from jaxamp._validation import flagged_paths


def is_loss_scale_state(x: Any) -> bool:
  return isinstance(x, DynamicLossScaleState)


def opt_state_of(holder: Any) -> Any:
  """The optimizer state, or that of an ``nnx.Optimizer`` or ``TrainState``."""
  if not isinstance(holder, tuple) and hasattr(holder, "opt_state"):
    return holder.opt_state
  return holder


def find_loss_scale_state(opt_state: Any) -> DynamicLossScaleState:
  """Returns the one :class:`DynamicLossScaleState` inside ``opt_state``, wherever it sits.

  Args:
    opt_state: an optimizer state, an ``nnx.Optimizer`` or a ``TrainState``.

  Raises:
    ValueError: there is no jaxamp state, or more than one.
  """
  leaves = jax.tree.leaves(opt_state_of(opt_state), is_leaf=is_loss_scale_state)
  found = [node for node in leaves if is_loss_scale_state(node)]
  if len(found) != 1:
    what = "no" if not found else f"{len(found)}"
    raise ValueError(
      f"jaxamp: found {what} DynamicLossScaleState in the optimizer state; "
      "expected exactly one. Build the optimizer with "
      "jaxamp.dynamic_loss_scale(inner, ...) and wrap it once."
    )
  return found[0]


_IN_FRONT = (
  "jaxamp: a transformation is chained in front of dynamic_loss_scale, so it sees "
  "the scaled gradients (optax.clip_by_global_norm there would clip the gradients "
  "times the loss scale). Chain it inside instead: "
  "jaxamp.dynamic_loss_scale(optax.chain(transformation, optimizer))."
)
_MULTI_STEPS = (
  "jaxamp: optax.MultiSteps is around dynamic_loss_scale; after the first overflow "
  "its reset (0 * inf = NaN) skips every later window while the scale falls to 0. "
  "Accumulate with jaxamp.accumulate_gradients(jaxamp.dynamic_loss_scale(inner), k) "
  "instead, as torch accumulates."
)
_STACKED = (
  "jaxamp: a dynamic_loss_scale is wrapped inside another, so the gradients would be "
  "unscaled by both scales. Wrap the optimizer in one dynamic_loss_scale only."
)


def _children(node: Any) -> list[tuple[Any, Any]]:
  """``node``'s children, one pytree level down, with their keys."""
  flat, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
  return [(path[0], child) for path, child in flat if path]


def check_placement(opt_state: Any) -> None:
  """Raises ValueError unless the one jaxamp state sees the scaled gradients as given: not
  behind a chained transformation, inside ``optax.MultiSteps`` or inside another."""
  root = opt_state_of(opt_state)
  flat, _ = jax.tree_util.tree_flatten_with_path(root, is_leaf=is_loss_scale_state)
  paths = [path for path, node in flat if is_loss_scale_state(node)]
  if len(paths) != 1:
    find_loss_scale_state(opt_state)  # raises its error: none, or several
    return
  node = root
  for key in paths[0]:
    if isinstance(node, optax.MultiStepsState):
      raise ValueError(_MULTI_STEPS)  # noqa: TRY004  (a layout, not a type, is wrong)
    if type(node) is tuple and getattr(key, "idx", 0) > 0:  # optax.chain's state
      raise ValueError(_IN_FRONT)
    node = dict(_children(node))[key]
  inner = jax.tree.leaves(node.inner_state, is_leaf=is_loss_scale_state)
  if any(is_loss_scale_state(x) for x in inner):
    raise ValueError(_STACKED)


def field_array(field: Any) -> jax.Array:
  """The array in a state field, unwrapping an ``nnx`` variable if present."""
  (leaf,) = jax.tree.leaves(field)
  return leaf


def get_loss_scale(opt_state: Any) -> jax.Array:
  """The current loss scale (float32 ``[]``) from a state holding a jaxamp state.

  Outside ``jit``, a copy that outlives a donation of the state.

  Args:
    opt_state: an optimizer state holding one :func:`dynamic_loss_scale` state,
      or an ``nnx.Optimizer`` or ``TrainState`` holding one.

  Examples:
    >>> import optax, jax.numpy as jnp, jaxamp
    >>> tx = optax.inject_hyperparams(jaxamp.dynamic_loss_scale)(
    ...     optax.chain(optax.add_decayed_weights(1e-4), optax.sgd(0.1)), init_scale=1024.0)
    >>> float(jaxamp.get_loss_scale(tx.init({"w": jnp.ones(3)})))
    1024.0

  Raises:
    ValueError: there is no jaxamp state or more than one, or it does not see
      the gradients of the scaled loss as given (see :func:`check_placement`).
  """
  check_placement(opt_state)
  return outliving_donation(field_array(find_loss_scale_state(opt_state).loss_scale))


def outliving_donation(value: jax.Array) -> jax.Array:
  """``value`` (a state's field), or outside ``jit`` a copy that outlives a donation."""
  if isinstance(value, jax.core.Tracer):
    return value
  # A captured constant inside jit stays itself (flax_utils checks for it).
  copied = jnp.array(value, copy=True)
  return value if isinstance(copied, jax.core.Tracer) else copied


def scale_loss(loss: jax.Array, opt_state: Any) -> jax.Array:
  """``loss * loss_scale``, in float32 for a scalar loss of float32 or less and float64 for
  float64, as torch; a float16 loss warns (docs/grad_scaler.md). Differentiate this.

  Args:
    loss: the loss, a floating array (float32 recommended).
    opt_state: an optimizer state holding one :func:`dynamic_loss_scale` state,
      or an ``nnx.Optimizer`` or ``TrainState`` holding one.

  Examples:
    >>> import optax, jax.numpy as jnp, jaxamp
    >>> state = jaxamp.dynamic_loss_scale(optax.sgd(0.1)).init({"w": jnp.ones(3)})
    >>> jaxamp.scale_loss(jnp.float32(2.0), state)
    Array(131072., dtype=float32)
  """
  dtype = getattr(loss, "dtype", np.dtype(float) if isinstance(loss, float) else None)
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    kind = f"dtype {dtype}" if dtype is not None else f"type {type(loss).__name__}"
    raise TypeError(
      f"jaxamp: scale_loss got a loss of {kind}; it scales a floating-point loss "
      "(float32 recommended), whose gradients can be taken."
    )
  if dtype == jnp.float16:
    warnings.warn(
      "jaxamp: scale_loss got a float16 loss; as in torch, its gradient starts from the loss "
      "scale cast to float16, inf from 65536 on (float16's maximum is 65504), so every step at "
      "such a scale is skipped. Compute the loss in float32 from float32 values, as torch's "
      "autocast does, e.g. optax.softmax_cross_entropy_with_integer_labels(logits.astype("
      "jnp.float32), y); casting the finished float16 loss does not help (its gradient is cast "
      "back).",
      stacklevel=2,
    )
  return multiply_by_scale(loss, get_loss_scale(opt_state))


def nonfinite_leaf_paths(opt_state: Any, params: Any) -> list[str]:
  """The paths of the gradient leaves that held inf/NaN at the last skipped step (host read).

  Args:
    opt_state: an optimizer state (or holder) with one jaxamp state.
    params: the parameter tree the gradients mirror.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> params = {"dense": {"w": jnp.ones(2), "b": jnp.ones(2)}}
    >>> tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1))
    >>> grads = {"dense": {"w": jnp.ones(2), "b": jnp.array([1.0, jnp.nan])}}
    >>> _, state = tx.update(grads, tx.init(params), params)
    >>> jaxamp.ops.nonfinite_leaf_paths(state, params)
    ["['dense']['b']"]
  """
  flags = np.asarray(field_array(find_loss_scale_state(opt_state).nonfinite_leaves))
  paths = flagged_paths(params, flags)
  if paths is None:
    raise ValueError(
      f"jaxamp: params has {len(jax.tree.leaves(params))} leaves but the jaxamp state tracks "
      f"{flags.size}; pass the parameter tree the optimizer was initialised with."
    )
  return paths
