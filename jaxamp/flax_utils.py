"""Flax glue: a loss-scaling ``value_and_grad``, one-call updates, per-step metrics.

Import it as ``from jaxamp import flax_utils`` (``jaxamp`` does not import flax). It works
inside ``nnx.jit`` and ``jax.jit`` with no host sync; docs/flax.md has the NNX and linen steps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT

from jaxamp._frontends.fused import apply_scaled_updates
from jaxamp._frontends.state_access import (
  field_array,
  find_loss_scale_state,
  get_loss_scale,
  outliving_donation,
)
from jaxamp._torch.scaling import multiply_by_scale


def _check_loss(loss: Any, has_aux: bool) -> None:
  if isinstance(loss, (tuple, list)) and not has_aux:
    raise TypeError(
      f"jaxamp: the loss function returned a {type(loss).__name__}, not a scalar "
      "loss. If it returns (loss, aux), pass has_aux=True."
    )
  dtype, shape = getattr(loss, "dtype", None), getattr(loss, "shape", None)
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    kind = f"dtype {dtype}" if dtype is not None else f"type {type(loss).__name__}"
    raise TypeError(
      f"jaxamp: the loss has {kind}; it must be a floating-point jax array "
      "(float32 recommended) to be differentiated and scaled."
    )
  if shape != ():
    raise ValueError(
      f"jaxamp: the loss must be a scalar, got shape {shape}. Reduce it inside "
      "the loss function, e.g. return jnp.mean(per_example_losses)."
    )
  if jnp.dtype(dtype) == jnp.float16:
    raise TypeError(
      "jaxamp: the loss is float16. Its gradient starts from the loss scale "
      "cast to float16, which overflows (float16 max 65504, default "
      "scale 65536), so every update would be skipped. Compute the loss in "
      "float32 from float32 values, e.g. "
      "optax.softmax_cross_entropy_with_integer_labels("
      "logits.astype(jnp.float32), labels).mean(). Casting the finished "
      "float16 loss to float32 does not help: its gradient is cast back."
    )


def _check_scale_is_live(scale: jax.Array, args: Sequence[Any]) -> None:
  """Raises if the scale is a constant (a captured optimizer) in a traced step."""
  if isinstance(scale, jax.core.Tracer):
    return
  if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(args)):
    raise ValueError(
      "jaxamp: the loss scale is a constant inside this traced step, so it "
      "would stay frozen at its current value. The optimizer (or TrainState) "
      "given to scaled_value_and_grad was captured from outside the jitted "
      "function: pass it to the step as an argument and call "
      "scaled_value_and_grad inside the step with that argument."
    )


def _check_update_arguments(optimizer: Any, model: Any, grads: Any) -> None:
  if not isinstance(optimizer, nnx.Optimizer):
    raise TypeError(
      f"jaxamp: flax_utils.update takes an nnx.Optimizer first, got {type(optimizer).__name__}; "
      "call it as flax_utils.update(optimizer, model, grads)."
    )
  if not isinstance(model, nnx.Module):
    raise TypeError(
      f"jaxamp: flax_utils.update takes the nnx.Module second, got {type(model).__name__}; "
      "call it as flax_utils.update(optimizer, model, grads)."
    )
  _check_grads_given(grads, "flax_utils.update")


def _check_grads_given(grads: Any, where: str) -> None:
  if grads is None:
    raise TypeError(
      f"jaxamp: {where} got grads=None; pass the gradients of the scaled loss, "
      "a tree like the parameters."
    )


def _check_train_state(state: Any) -> None:
  if not all(hasattr(state, name) for name in ("tx", "params", "opt_state", "step", "replace")):
    raise TypeError(
      "jaxamp: flax_utils.apply_gradients takes a flax TrainState (with tx, params, "
      f"opt_state and step), got {type(state).__name__}; for an optax state call "
      "jaxamp.apply_scaled_updates(tx, grads, opt_state, params)."
    )


def scaled_value_and_grad(
  fn: Callable[..., Any],
  opt_state_or_optimizer: Any,
  *,
  argnums: int | Sequence[int] = 0,
  has_aux: bool = False,
) -> Callable[..., Any]:
  """``value_and_grad`` of ``fn`` with the loss multiplied by the loss scale.

  Inside a jitted step, create it from the optimizer or state the step receives as an
  argument (``nnx.value_and_grad`` for an ``nnx.Optimizer``, else ``jax.value_and_grad``).

  Args:
    fn: the loss function, returning a scalar float32 (or bfloat16, float64)
      loss, or ``(loss, aux)`` with ``has_aux=True``.
    opt_state_or_optimizer: an ``nnx.Optimizer``, a ``TrainState`` or an optax
      state holding exactly one :class:`jaxamp.DynamicLossScaleState`.
    argnums: which positional arguments to differentiate, as in
      ``jax.value_and_grad`` (an ``nnx.DiffState`` is accepted for NNX).
    has_aux: whether ``fn`` returns ``(loss, aux)``.

  Returns:
    A function with ``fn``'s arguments returning ``(loss, grads)``, or
    ``((loss, aux), grads)`` with ``has_aux=True``. ``loss`` is unscaled and in
    ``fn``'s dtype; ``grads`` are gradients of ``loss * scale``.

  Raises:
    ValueError: no jaxamp state, or several; a loss that is not a scalar; an
      optimizer captured from outside the traced step (a frozen scale).
    TypeError: a loss that is not a floating-point array, or is float16 (its
      gradient starts from the scale cast to float16, which overflows).

  Examples:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> from flax import nnx
    >>> from jaxamp import flax_utils
    >>> model = nnx.Linear(2, 1, use_bias=False, rngs=nnx.Rngs(0))
    >>> optimizer = nnx.Optimizer(
    ...     model, jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0),
    ...     wrt=nnx.Param)
    >>> def loss_fn(model, x):
    ...   return jnp.sum(model(x)) ** 2
    >>> x = jnp.ones((1, 2))
    >>> loss, grads = flax_utils.scaled_value_and_grad(loss_fn, optimizer)(model, x)
    >>> bool(loss == loss_fn(model, x))
    True
    >>> _, unscaled = nnx.value_and_grad(loss_fn)(model, x)
    >>> bool(jnp.all(grads["kernel"][...] == 8.0 * unscaled["kernel"][...]))
    True
  """
  find_loss_scale_state(opt_state_or_optimizer)  # fail early when there is none
  is_nnx = isinstance(opt_state_or_optimizer, nnx.Optimizer)

  def scaled_fn(*args, **kwargs):
    out = fn(*args, **kwargs)
    if has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
      raise TypeError(
        "jaxamp: with has_aux=True the loss function must return (loss, aux), "
        f"got {type(out).__name__}."
      )
    loss, aux = out if has_aux else (out, None)
    _check_loss(loss, has_aux)
    return multiply_by_scale(loss, get_loss_scale(opt_state_or_optimizer)), (loss, aux)

  transform = nnx.value_and_grad if is_nnx else jax.value_and_grad
  grad_fn = transform(scaled_fn, argnums=argnums, has_aux=True)

  def value_and_scaled_grad(*args, **kwargs):
    _check_scale_is_live(get_loss_scale(opt_state_or_optimizer), (args, kwargs))
    (_, (loss, aux)), grads = grad_fn(*args, **kwargs)
    return ((loss, aux), grads) if has_aux else (loss, grads)

  return value_and_scaled_grad


def loss_scale_metrics(opt_state_or_optimizer: Any) -> dict[str, jax.Array]:
  """The loss-scale state as a dict of arrays, for logging without a host sync.

  Args:
    opt_state_or_optimizer: an ``nnx.Optimizer``, a ``TrainState`` or an optax
      state holding exactly one :class:`jaxamp.DynamicLossScaleState`.

  Returns:
    Arrays ``[]`` (outside ``jit``, copies that outlive a donation): ``loss_scale``
    (float32, for the *next* loss), ``skipped`` (bool, the last update), ``skipped_steps``
    (int32; Flax's ``step`` counts skipped ones too), ``consecutive_skipped_steps`` (int32).

  Raises:
    ValueError: no jaxamp state, or several.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> from jaxamp import flax_utils
    >>> tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0)
    >>> state = tx.init({"w": jnp.ones(2)})
    >>> _, state = tx.update({"w": jnp.array([1.0, jnp.inf])}, state)
    >>> {k: v.item() for k, v in flax_utils.loss_scale_metrics(state).items()}
    {'loss_scale': 4.0, 'skipped': True, 'skipped_steps': 1, 'consecutive_skipped_steps': 1}
  """
  state = find_loss_scale_state(opt_state_or_optimizer)
  fields = {
    "loss_scale": state.loss_scale,
    "skipped": state.found_inf,
    "skipped_steps": state.skipped_steps,
    "consecutive_skipped_steps": state.consecutive_skipped_steps,
  }
  return {name: outliving_donation(field_array(field)) for name, field in fields.items()}


def update(
  optimizer: nnx.Optimizer,
  model: nnx.Module,
  grads: Any,
  /,
  *,
  axis_name: str | tuple[str, ...] | None = None,
  **kwargs: Any,
) -> None:
  """``optimizer.update(model, grads)`` in one :func:`jaxamp.apply_scaled_updates` call.

  In place, as ``nnx.Optimizer.update`` (``step`` counts a skipped call too), inside
  ``nnx.jit``; the updates are never materialised.

  Args:
    optimizer: an ``nnx.Optimizer`` whose ``tx`` holds a
      :func:`jaxamp.dynamic_loss_scale` that receives the gradients unchanged.
    model: the model whose parameters (``optimizer.wrt``) are updated.
    grads: gradients of the scaled loss, e.g. from :func:`scaled_value_and_grad`.
    axis_name: under ``jax.shard_map``, see :func:`jaxamp.apply_scaled_updates`.
    **kwargs: forwarded to ``tx.update``.

  Raises:
    ValueError: no jaxamp state, or its ``tx`` does not check the gradients as
      given (e.g. ``optax.MultiSteps`` around it).

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxamp
    >>> from flax import nnx
    >>> from jaxamp import flax_utils
    >>> tx = jaxamp.dynamic_loss_scale(optax.sgd(0.5), init_scale=4.0)
    >>> model = nnx.Linear(2, 1, use_bias=False, rngs=nnx.Rngs(0))
    >>> model.kernel[...] = jnp.ones((2, 1))
    >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    >>> as_grads = lambda g: jax.tree.map(lambda _: jnp.array(g), nnx.state(model, nnx.Param))
    >>> flax_utils.update(optimizer, model, as_grads([[4.0], [jnp.inf]]))   # skipped, backed off
    >>> model.kernel[...].ravel().tolist(), float(optimizer.opt_state.loss_scale[...])
    ([1.0, 1.0], 2.0)
    >>> flax_utils.update(optimizer, model, as_grads([[2.0], [-2.0]]))
    >>> model.kernel[...].ravel().tolist(), int(optimizer.step[...])
    ([0.5, 1.5], 2)
  """
  _check_update_arguments(optimizer, model, grads)
  if kwargs.get("update_scale", True) is not True:
    raise ValueError(
      "jaxamp: flax_utils.update cannot hold the scale's advance (update_scale=False): "
      "an nnx.Optimizer stores the state's arrays back into its variables and drops "
      "the record of the groups stepped, so the next update would not see them. Keep "
      "the optax state outside the nnx.Optimizer for optimizers that step one after "
      'the other (docs/optax.md, "Optimizers that step one after the other (a GAN)"). '
      "Nothing was changed."
    )
  graph = optimizer.graph
  param_arrays = nnx.as_pure(nnx.state(model, optimizer.wrt, graph=graph))
  grad_arrays = nnx.as_pure(nnx.state(grads, optimizer.wrt, graph=graph))
  opt_state_arrays = nnx.as_pure(optimizer.opt_state)
  new_params, new_opt_state = apply_scaled_updates(
    optimizer.tx,
    grad_arrays,
    opt_state_arrays,
    param_arrays,
    axis_name=axis_name,
    **nnx.as_pure(kwargs),
  )
  nnx.update(model, new_params)
  nnx.update(optimizer.opt_state, nnx.state(new_opt_state, graph=graph))
  optimizer.step[...] += 1


def apply_gradients(
  state: Any, *, grads: Any, axis_name: str | tuple[str, ...] | None = None, **kwargs: Any
) -> Any:
  """``state.apply_gradients(grads=grads)`` in one :func:`jaxamp.apply_scaled_updates` call.

  As ``TrainState.apply_gradients``, with the same skip decisions and fp8's
  ``OVERWRITE_WITH_GRADIENT``. Donate the state to ``jax.jit`` to update it in place.

  Args:
    state: a ``TrainState`` whose ``tx`` holds a
      :func:`jaxamp.dynamic_loss_scale` that receives the gradients unchanged.
    grads: gradients of the scaled loss, a tree like ``state.params``.
    axis_name: under ``jax.shard_map``, see :func:`jaxamp.apply_scaled_updates`.
    **kwargs: other ``TrainState`` fields to replace.

  Returns:
    The updated ``TrainState``.

  Raises:
    ValueError: no jaxamp state, or its ``tx`` does not check the gradients as
      given (e.g. ``optax.MultiSteps`` around it).

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxamp
    >>> from flax.training import train_state
    >>> from jaxamp import flax_utils
    >>> state = train_state.TrainState.create(
    ...     apply_fn=None, params={"w": jnp.ones(2)},
    ...     tx=jaxamp.dynamic_loss_scale(optax.sgd(0.5), init_scale=4.0))
    >>> step = jax.jit(lambda s, g: flax_utils.apply_gradients(s, grads=g), donate_argnums=0)
    >>> state = step(state, {"w": jnp.array([4.0, jnp.nan])})   # skipped, backed off
    >>> state.params["w"].tolist(), float(state.opt_state.loss_scale), int(state.step)
    ([1.0, 1.0], 2.0, 1)
    >>> state = step(state, {"w": jnp.array([2.0, -2.0])})
    >>> state.params["w"].tolist()
    [0.5, 1.5]
  """
  _check_train_state(state)
  _check_grads_given(grads, "flax_utils.apply_gradients")
  overwrite = isinstance(grads, Mapping) and OVERWRITE_WITH_GRADIENT in grads
  grads_with_opt = grads["params"] if overwrite else grads
  params_with_opt = state.params["params"] if overwrite else state.params
  new_params_with_opt, new_opt_state = apply_scaled_updates(
    state.tx, grads_with_opt, state.opt_state, params_with_opt, axis_name=axis_name
  )
  new_params = new_params_with_opt
  if overwrite:
    new_params = {"params": new_params, OVERWRITE_WITH_GRADIENT: grads[OVERWRITE_WITH_GRADIENT]}
  return state.replace(step=state.step + 1, params=new_params, opt_state=new_opt_state, **kwargs)
