"""Flax glue: a loss-scaling ``value_and_grad``, one-call updates, per-step metrics.

Import it as ``from jaxamp import flax_utils`` (``jaxamp`` does not import flax). It works
inside ``nnx.jit`` and ``jax.jit`` with no host sync: docs/flax.md, docs/precision.md (fp8).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT

from jaxamp._distributed import _check_bound as check_axis_bound
from jaxamp._frontends.accumulation import AccumulateGradientsState
from jaxamp._frontends.fused import apply_scaled_updates
from jaxamp._frontends.state_access import (
  field_array,
  find_loss_scale_state,
  get_loss_scale,
  is_loss_scale_state,
  opt_state_of,
  outliving_donation,
)
from jaxamp._torch.scaling import multiply_by_scale

# fp8's scales and amax histories (linen's collection, as nnx.bridge names its variables).
FP8_STATE = nnx.variable_type_from_name(OVERWRITE_WITH_GRADIENT, allow_register=True)


def _holds_scaler(holder: Any) -> bool:
  leaves = jax.tree.leaves(opt_state_of(holder), is_leaf=is_loss_scale_state)
  return any(is_loss_scale_state(leaf) for leaf in leaves)


def _check_holds_scaler(holder: Any, where: str) -> None:
  if not _holds_scaler(holder):
    raise ValueError(
      f"jaxamp: {where} found no DynamicLossScaleState: wrap the optimizer, "
      "jaxamp.dynamic_loss_scale(inner); for float32 runs of the same step, "
      "jaxamp.dynamic_loss_scale(inner, enabled=False) steps as inner alone."
    )
  find_loss_scale_state(holder)  # raises for several


def scales_loss(opt_state_or_optimizer: Any) -> bool:
  """Whether a jaxamp scaler scales the loss (Flax's ``if dynamic_scale:``), as a Python bool.

  ``False`` for a disabled one (``enabled=False``: scale 1, no skips, as torch's) or none.

  Args:
    opt_state_or_optimizer: an ``nnx.Optimizer``, a ``TrainState`` or an optax state.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> from jaxamp import flax_utils
    >>> txs = [jaxamp.dynamic_loss_scale(optax.sgd(0.1), enabled=e) for e in (True, False)]
    >>> [flax_utils.scales_loss(tx.init(jnp.ones(2))) for tx in [*txs, optax.sgd(0.1)]]
    [True, False, False]
  """
  holds = _holds_scaler(opt_state_or_optimizer)
  return holds and find_loss_scale_state(opt_state_or_optimizer).config.enabled


def _fp8_state_after(new: Any, old: Any, opt_state: Any, grads: Any) -> Any:
  """fp8's new scales and amax histories, or the old ones after gradients with inf/NaN
  (a skipped step): an inf in an amax history would hold that scale for 1,024 steps."""
  scaler = find_loss_scale_state(opt_state)
  skipped = field_array(scaler.found_inf)
  if isinstance(opt_state, AccumulateGradientsState) and scaler.config.enabled:
    finite = jnp.all(jnp.stack([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)]))
    skipped = jnp.where(opt_state.mini_step == 0, skipped, ~finite)  # within a window
  return jax.tree.map(lambda n, o: jnp.where(skipped, o, n), new, old)


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
      "jaxamp: the loss is float16; compute it in float32, e.g. optax.softmax_cross_entropy_"
      "with_integer_labels(logits.astype(jnp.float32), labels).mean(). Its gradient starts "
      "from the loss scale cast to float16, which is inf at a scale of 65536 or more "
      "(float16 max 65504, default init_scale 65536): every step at such a scale would be "
      "skipped. Casting the float16 loss does not help (its gradient is cast back)."
    )


def _check_scale_is_live(scale: jax.Array, args: Sequence[Any]) -> None:
  """Raises if the scale is a constant (a captured optimizer) in a traced step."""
  if isinstance(scale, jax.core.Tracer):
    return
  if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(args)):
    raise ValueError(
      "jaxamp: the loss scale is a constant inside this traced step, so it would stay frozen. "
      "The optimizer (or TrainState) given to scaled_value_and_grad was captured from outside "
      "the jitted function: pass it to the step as an argument and call it with that."
    )


def _check_update_arguments(optimizer: Any, model: Any, grads: Any) -> None:
  places = {nnx.Optimizer: "an nnx.Optimizer first", nnx.Module: "the nnx.Module second"}
  for (kind, place), value in zip(places.items(), (optimizer, model)):
    if not isinstance(value, kind):
      raise TypeError(
        f"jaxamp: flax_utils.update takes {place}, got {type(value).__name__}; "
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
  axis_name: str | tuple[str, ...] | None = None,
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
    axis_name: under ``pmap`` or ``shard_map``, the axis to average the gradients
      over (``lax.pmean``, before the unscale, as DDP), as Flax's ``DynamicScale`` does.

  Returns:
    A function with ``fn``'s arguments returning ``(loss, grads)``, or
    ``((loss, aux), grads)`` with ``has_aux=True``. ``loss`` is unscaled and in
    ``fn``'s dtype; ``grads`` are gradients of ``loss * scale``.

  Raises:
    ValueError, TypeError: no jaxamp state, or several; an unbound ``axis_name``; a broken
      rule of docs/flax.md (a captured optimizer, a loss not a float32-like scalar).

  Examples:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> from flax import nnx
    >>> from jaxamp import flax_utils
    >>> model = nnx.Linear(2, 1, use_bias=False, rngs=nnx.Rngs(0))
    >>> tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0)
    >>> optimizer, x = nnx.Optimizer(model, tx, wrt=nnx.Param), jnp.ones((1, 2))
    >>> loss_fn = lambda model, x: jnp.sum(model(x)) ** 2
    >>> loss, grads = flax_utils.scaled_value_and_grad(loss_fn, optimizer)(model, x)
    >>> unscaled_loss, unscaled = nnx.value_and_grad(loss_fn)(model, x)
    >>> bool(loss == unscaled_loss), bool(jnp.all(grads["kernel"][...] == 8 * unscaled["kernel"][...]))
    (True, True)
  """
  _check_holds_scaler(opt_state_or_optimizer, "flax_utils.scaled_value_and_grad")
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
    if axis_name is not None:  # as DynamicScale and torch's DDP: the replicas' mean
      check_axis_bound((axis_name,) if isinstance(axis_name, str) else axis_name, axis_name)
      grads = jax.lax.pmean(grads, axis_name)
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
  ``nnx.jit``; the updates are never materialised. fp8's ``_overwrite_with_gradient``
  variables in ``grads`` (``nnx.bridge``) are written unless skipped. With a disabled
  scaler (``enabled=False``), this is ``optimizer.update`` itself.

  Args:
    optimizer: an ``nnx.Optimizer`` whose ``tx`` holds a
      :func:`jaxamp.dynamic_loss_scale` that receives the gradients unchanged.
    model: the model whose parameters (``optimizer.wrt``) are updated.
    grads: gradients of the scaled loss, e.g. from :func:`scaled_value_and_grad`.
    axis_name: under ``jax.shard_map``, see :func:`jaxamp.apply_scaled_updates`.
    **kwargs: forwarded to ``tx.update``.

  Raises:
    ValueError: no jaxamp state, its ``tx`` does not check the gradients as given
      (e.g. ``optax.MultiSteps`` around it), or ``wrt`` selects fp8 variables.

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
  """
  _check_update_arguments(optimizer, model, grads)
  _check_holds_scaler(optimizer, "flax_utils.update")
  if kwargs.get("update_scale", True) is not True:
    raise ValueError(
      "jaxamp: flax_utils.update cannot hold the scale's advance (update_scale=False): an "
      "nnx.Optimizer keeps the state's arrays only, not the record of the groups stepped. Keep "
      "the optax state outside it for optimizers that step one after the other (docs/optax.md, "
      '"Optimizers that step one after the other (a GAN)"). Nothing was changed.'
    )
  graph = optimizer.graph
  if jax.tree.leaves(nnx.state(model, nnx.All(optimizer.wrt, FP8_STATE), graph=graph)):
    raise ValueError(
      "jaxamp: the optimizer's wrt selects fp8 scales and amax histories "
      f"({OVERWRITE_WITH_GRADIENT} variables), which are not parameters: build it with "
      "wrt=nnx.Param; flax_utils.update writes them from grads, as linen's TrainState does."
    )
  fp8, old_fp8 = (nnx.as_pure(nnx.state(tree, FP8_STATE, graph=graph)) for tree in (grads, model))
  grad_arrays = nnx.as_pure(nnx.state(grads, optimizer.wrt, graph=graph))
  if scales_loss(optimizer):
    new_params, new_opt_state = apply_scaled_updates(
      optimizer.tx,
      grad_arrays,
      nnx.as_pure(optimizer.opt_state),
      nnx.as_pure(nnx.state(model, optimizer.wrt, graph=graph)),
      axis_name=axis_name,
      **nnx.as_pure(kwargs),
    )
    nnx.update(model, new_params)
    nnx.update(optimizer.opt_state, nnx.state(new_opt_state, graph=graph))
    optimizer.step[...] += 1
  else:  # a disabled scaler: nnx.Optimizer.update's own step, bit for bit
    optimizer.update(model, grads, **kwargs)
  if jax.tree.leaves(fp8):
    opt_state = nnx.as_pure(optimizer.opt_state)
    nnx.update(model, _fp8_state_after(fp8, old_fp8, opt_state, grad_arrays))


def apply_gradients(
  state: Any, *, grads: Any, axis_name: str | tuple[str, ...] | None = None, **kwargs: Any
) -> Any:
  """``state.apply_gradients(grads=grads)`` in one :func:`jaxamp.apply_scaled_updates` call.

  As ``TrainState.apply_gradients``, with the same skip decisions; fp8's
  ``OVERWRITE_WITH_GRADIENT`` collection is written as there, but kept on a skipped step.
  With a disabled scaler (``enabled=False``), this is ``state.apply_gradients`` itself.
  Donate the state to ``jax.jit`` to update it in place.

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
  """
  _check_train_state(state)
  _check_grads_given(grads, "flax_utils.apply_gradients")
  _check_holds_scaler(state, "flax_utils.apply_gradients")
  if not scales_loss(state):  # a disabled scaler: TrainState's own step, bit for bit
    return state.apply_gradients(grads=grads, **kwargs)
  overwrite = isinstance(grads, Mapping) and OVERWRITE_WITH_GRADIENT in grads
  grads_with_opt = grads["params"] if overwrite else grads
  params_with_opt = state.params["params"] if overwrite else state.params
  new_params, new_opt_state = apply_scaled_updates(
    state.tx, grads_with_opt, state.opt_state, params_with_opt, axis_name=axis_name
  )
  if overwrite:  # fp8's state: not a gradient, written as Flax does unless skipped
    old, new = state.params[OVERWRITE_WITH_GRADIENT], grads[OVERWRITE_WITH_GRADIENT]
    fp8 = _fp8_state_after(new, old, new_opt_state, grads_with_opt)
    new_params = {"params": new_params, OVERWRITE_WITH_GRADIENT: fp8}
  return state.replace(step=state.step + 1, params=new_params, opt_state=new_opt_state, **kwargs)
