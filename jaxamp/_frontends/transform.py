"""``dynamic_loss_scale``: torch's GradScaler iteration as an optax wrapper."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxamp import _engine as engine
from jaxamp._config import LossScaleConfig, loss_scale_config
from jaxamp._engine import Check
from jaxamp._frontends.serialization import register_with_flax
from jaxamp._torch.core import LossScaleCore, advance, check_skip_limit, init_core
from jaxamp._torch.groups import ParamLabels, SteppedGroups, check_steps, grouped
from jaxamp._validation import check_same_structure, checked_gradients, flag_slots, set_flags
from jaxamp._xla.compile_cache import call_compiled, traced
from jaxamp._xla.layout import row_major


class DynamicLossScaleState(NamedTuple):
  """State of :func:`dynamic_loss_scale`; the fields up to ``update_count`` are GradScaler's too.

  Attributes:
    loss_scale: the scale to multiply the next loss by, float32 ``[]``.
    growth_tracker: consecutive finite updates since the last growth or
      backoff, int32 ``[]`` (torch's ``_growth_tracker``).
    found_inf: whether the last update found inf/NaN and was skipped, bool ``[]`` (after
      ``update_scale=False``: whether any group stepped since the scale advanced did).
    skipped_steps: total skipped updates, int32 ``[]`` (saturates at 2**31-1).
    consecutive_skipped_steps: skipped updates since the last applied one,
      int32 ``[]`` (saturating).
    hysteresis_tracker: overflowing steps still tolerated before a backoff,
      int32 ``[]`` (always ``hysteresis``, 1 by default: torch backs off at once).
    update_count: updates so far, skipped or not, int32 ``[]`` (saturating).
    nonfinite_leaves: per leaf of the params given to ``init``, whether its gradient held
      inf/NaN in the last skipped step, bool ``[n_leaves]``
      (:func:`jaxamp.ops.nonfinite_leaf_paths`).
    stepped_groups: the ``param_labels`` groups stepped with ``update_scale=False``
      since the scale last advanced: static, part of the tree structure.
    config: the configuration the transformation was built with: static, part of the
      tree structure (build ``shard_map`` specs from it); injected hyperparameters
      are recorded as ``<injected>``.
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
  stepped_groups: SteppedGroups
  config: LossScaleConfig
  inner_state: optax.OptState


def core_of(state: DynamicLossScaleState) -> LossScaleCore:
  return LossScaleCore(**{name: getattr(state, name) for name in LossScaleCore._fields})


@jax.tree_util.register_pytree_node_class
class CheckedState:
  """A state whose gradients ``apply_scaled_updates`` checked already, with its ``Check``,
  and, static, its branch's ``found_inf`` and whether the call is eager."""

  def __init__(self, state: DynamicLossScaleState, check: Check, found_inf: bool, eager: bool):
    self.state, self.check, self.found_inf, self.eager = state, check, found_inf, eager

  def tree_flatten(self):
    return (self.state, self.check), (self.found_inf, self.eager)

  @classmethod
  def tree_unflatten(cls, static, children):
    return cls(*children, *static)


def _update(static, grads, state, params, extra_args, checked, injected):
  """One torch iteration of the engine, with ``inner`` as the update."""
  inner, recorded, eager, slots, update_scale, stepping = static
  config = recorded.replace(**injected)
  if config.param_labels is None:
    inner, labels = optax.with_extra_args_support(inner), None
  else:
    labels = config.param_labels.of(grads)
    inner = grouped(dict(inner), config.param_labels, stepped=set(labels))
  if checked is None:
    grads = row_major(grads)  # before the step's loop or cond: see row_major
    check = engine.check(grads, state.loss_scale, config, state, params)
  else:
    check = checked.check

  def update(unscaled, inner_state, params):
    return inner.update(unscaled, inner_state, params, **extra_args)

  pending = state.stepped_groups.labels
  updates, inner_state = engine.iteration(
    state.loss_scale,
    config,
    check,
    update,
    grads,
    state.inner_state,
    params,
    labels=labels,
    branch=None if checked is None else checked.found_inf,
  )
  # torch's update() advances the scale once, on the found_inf of every
  # optimizer stepped since the last one; each group above skipped on its own.
  found_inf = state.found_inf | check.found_inf if pending else check.found_inf
  eager = eager or bool(checked and checked.eager)
  if update_scale:
    core = advance(core_of(state), found_inf, config, eager=eager)
  else:
    core = core_of(state)._replace(found_inf=found_inf)
  nonfinite = set_flags(state.nonfinite_leaves, slots, check.nonfinite)
  if pending:  # the flags of the groups stepped before this one, in this iteration
    nonfinite = nonfinite | (state.nonfinite_leaves & state.found_inf)
  nonfinite = jnp.where(found_inf, nonfinite, state.nonfinite_leaves)
  stepped = SteppedGroups(() if update_scale else (*pending, *stepping))
  return updates, state._replace(
    **core._asdict(), nonfinite_leaves=nonfinite, stepped_groups=stepped, inner_state=inner_state
  )


def check_state(state: Any, recorded: LossScaleConfig) -> None:
  """Raises a clear error for a state this transformation did not make."""
  if not isinstance(state, DynamicLossScaleState):
    raise TypeError(
      f"jaxamp: dynamic_loss_scale's update got a {type(state).__name__} as its state, "
      "not a DynamicLossScaleState. Pass the whole state from tx.init (not its "
      "inner_state); restore an orbax checkpoint with that state as the target."
    )
  if state.config != recorded:
    raise ValueError(
      "jaxamp: this state was made by a dynamic_loss_scale built with another "
      f"configuration ({state.config}), not this one ({recorded}). Initialise the "
      "state with the same transformation that updates it."
    )


def dynamic_loss_scale(
  inner: optax.GradientTransformation | Mapping[Any, optax.GradientTransformation],
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
  schedule_counts: str = "applied",
  param_labels: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` with dynamic loss scaling, as ``torch.amp.GradScaler``.

  Pass ``update`` the gradients of the loss times the scale (:func:`scale_loss`): each
  update is one torch iteration (docs/torch_semantics.md), jitted, with no host sync.
  ``inner`` sees unscaled gradients; ``update(..., update_scale=False)`` is torch's
  ``scaler.step(opt)`` without ``scaler.update()`` (docs/optax.md).

  Args:
    inner: the optimizer to run on unscaled gradients; with ``param_labels``,
      ``{label: optimizer}``, one per group of parameters.
    init_scale: the initial scale (a finite positive float32 number).
    growth_factor: multiplies the scale after ``growth_interval`` consecutive finite
      steps (> 1). Python numbers are applied exactly as float64, as torch.
    backoff_factor: multiplies the scale on a step with inf/NaN (0 < x < 1).
    growth_interval: consecutive finite steps before growing (an int; zero or less never
      grows, as in torch).
    enabled: ``False`` behaves as torch's disabled scaler: scale 1, nothing checked or
      skipped, the gradients passed on as given, the other options unused and unchecked.
    axis_name: under ``jax.shard_map`` (or ``pmap``), the mapped axis (or axes) over which
      ``found_inf`` is all-reduced, so every device skips the same steps (docs/distributed.md).
    min_loss_scale: (not in torch) the scale never backs off below this.
    max_loss_scale: (not in torch) the scale never grows above this.
    hysteresis: (not in torch; DeepSpeed, Megatron) overflowing steps tolerated before a
      backoff; each is still skipped (docs/protections.md, "Semantics").
    consecutive_hysteresis: (not in torch) DeepSpeed's variant of ``hysteresis``: every
      finite step refills it, not only a growth attempt.
    max_consecutive_skips: (not in torch) this many skipped steps in a row fail the
      jitted step, or are a ``checkify`` error (docs/protections.md).
    detect_unscale_overflow: (not in torch) also skip when unscaling itself overflows
      (docs/torch_semantics.md §3.2).
    schedule_counts: ``"iterations"`` (torch's way, ``GradScaler``'s default): a skipped
      step still advances the schedules' counts in the optimizer's state, and nothing else;
      ``"applied"`` (optax's way, ``dynamic_loss_scale``'s default): it leaves the inner
      state untouched (docs/porting.md, "Schedules").
    param_labels: torch's several optimizers with one scaler: labels as
      ``optax.multi_transform`` takes them, with ``inner`` a ``{label: optimizer}``; a group
      skips only on its own inf/NaN, the scale backs off once per step (docs/optax.md).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`DynamicLossScaleState`.

  Raises:
    ValueError, TypeError: a concrete hyperparameter is invalid (injected ones cannot be
      checked); at ``update``, gradients not floating point or not shaped like the params,
      a group stepped twice before the scale advances, ``update_scale=False`` without
      ``param_labels``.

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
  options = {name: value for name, value in locals().items() if name != "inner"}
  labels = None if param_labels is None else ParamLabels(param_labels)
  if labels is not None:
    static_inner = tuple(inner.items()) if isinstance(inner, Mapping) else inner  # hashable
    inner = grouped(inner, labels)
  elif isinstance(inner, optax.GradientTransformation):
    static_inner = inner  # the caller's: the same object on every call
  else:
    hint = ""
    if hasattr(inner, "gradient_transformation"):  # e.g. optax.MultiSteps
      hint = (
        " For gradient accumulation wrap the other way, as torch accumulates: "
        "jaxamp.accumulate_gradients(jaxamp.dynamic_loss_scale(inner), k)."
      )
    raise TypeError(
      "jaxamp: dynamic_loss_scale wraps an optax.GradientTransformation (e.g. "
      f"optax.adam(1e-3)), got {type(inner).__name__}.{hint}"
    )
  config = loss_scale_config(**{**options, "param_labels": labels})
  recorded = config.recorded()
  static = (static_inner, recorded)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    register_with_flax()
    return DynamicLossScaleState(
      **init_core(config)._asdict(),
      nonfinite_leaves=jnp.zeros([len(jax.tree.leaves(params))], bool),
      stepped_groups=SteppedGroups(),
      config=recorded,
      inner_state=inner.init(params),
    )

  def update_fn(updates, state, params=None, *, update_scale=True, **extra_args):
    checked = None
    if isinstance(state, CheckedState):  # from inside apply_scaled_updates' branch
      checked, state = state, state.state
    check_state(state, recorded)
    if "end_window" in extra_args:  # optax would pass it on to inner, unused
      raise TypeError(
        "jaxamp: end_window ends a jaxamp.accumulate_gradients window, and this "
        "dynamic_loss_scale is not inside one: jaxamp.accumulate_gradients(tx, every_k)."
      )
    updates = checked_gradients(updates, params)
    step_labels = None if labels is None else labels.of(updates)
    stepping = check_steps(state.stepped_groups, step_labels, update_scale, labels is not None)
    if not config.enabled:  # torch's disabled scaler: each step() is the optimizer's own
      tx = inner if labels is None else grouped(dict(static_inner), labels, set(stepping))
      tx = optax.with_extra_args_support(tx)
      updates, inner_state = tx.update(updates, state.inner_state, params, **extra_args)
      return updates, state._replace(inner_state=inner_state)
    slots = flag_slots(updates, params, state.nonfinite_leaves.shape[0])
    if params is None:  # no params to check the shapes against: the inner update's
      shapes, _ = jax.eval_shape(
        lambda g, s: inner.update(g, s, None, **extra_args), updates, state.inner_state
      )
      check_same_structure(updates, shapes)
    arguments = (updates, state, params, extra_args, checked, config.arrays())
    eager = not traced((updates, state))
    updates, new_state = call_compiled(
      _update, (*static, eager, slots, bool(update_scale), stepping), *arguments
    )
    if eager:  # outside jit: a clear error, and the caller's state as it was
      check_skip_limit(core_of(new_state), config)
    return updates, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
