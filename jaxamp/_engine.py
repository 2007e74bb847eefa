"""One torch iteration for a tree of gradients: check, then apply or skip.

Every front-end runs its steps through :func:`iteration` and :func:`apply_or_skip`,
torch's ``GradScaler`` iteration (docs/torch_semantics.md); the caller then advances
the scale once (``jaxamp._torch.core.advance``). Compiler workarounds stay behind
``jaxamp._xla``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxamp._config import LossScaleConfig
from jaxamp._distributed import all_reduce_found_inf, check_averaged, varying_axes, zeros_of_type
from jaxamp._torch.groups import skipped_leaves
from jaxamp._torch.schedules import (
  advance_schedule_counts,
  has_injected_hyperparams,
  with_hyperparams_of,
)
from jaxamp._torch.unscale import finite_leaves, inverse_parts, unscale_finite_by
from jaxamp._validation import is_array_leaf, is_none
from jaxamp._xla.fma_guard import rounded_unscaled


class Check(NamedTuple):
  """The check of one iteration's gradients."""

  nonfinite: jax.Array  # per gradient leaf, whether it holds inf/NaN
  found_inf: jax.Array  # whether any does (the same on every device)
  inverse: tuple[jax.Array, ...]  # torch's inv_scale as inverse_parts, outside the branches


def check(
  grads: Any, loss_scale: jax.Array, config: LossScaleConfig, state: Any, params: Any = None
) -> Check:
  """torch's inf/NaN check of the still-scaled ``grads``, shared over ``config.axis_name``;
  ``params``, where given, must vary wherever their gradients do (averaged gradients)."""
  if config.axis_name is None:
    varying = sorted(set().union(*map(varying_axes, jax.tree.leaves(grads))))
    if varying:
      raise ValueError(
        f"jaxamp: the gradients differ between the devices of the shard_map axes "
        f"{varying}, but dynamic_loss_scale has no axis_name, so each device would "
        f"skip on its own. Build it with axis_name={tuple(varying) if len(varying) > 1 else varying[0]!r}."
      )
  elif params is not None:
    check_averaged(grads, params, config.axis_name)
  nonfinite = ~finite_leaves(grads, loss_scale, config.detect_unscale_overflow)
  if config.axis_name is not None:
    nonfinite = all_reduce_found_inf(nonfinite, state, config.axis_name)
  return Check(nonfinite, jnp.any(nonfinite), inverse_parts(loss_scale))


def unscaled(grads: Any, check: Check, loss_scale: jax.Array) -> Any:
  """The finite ``grads`` times torch's ``inv_scale``, as torch materialises them."""
  return rounded_unscaled(unscale_finite_by(grads, check.inverse), loss_scale)


def skipped_state(inner_state: Any, schedule_counts: str, applied: Callable[[], Any]) -> Any:
  """The inner state after a skip: as it was; if the schedules count iterations,
  they are a step on and injected hyperparameters the skipped step's, taken from
  ``applied()``, the state an update would give (XLA computes nothing else of it)."""
  if schedule_counts != "iterations":
    return inner_state
  state = advance_schedule_counts(inner_state)
  return with_hyperparams_of(state, applied()) if has_injected_hyperparams(state) else state


def typed_like(value: Any, template: Any) -> Any:
  """``value`` (a tree) with ``template``'s dtypes and ``shard_map`` variance, as both
  branches must return (an optimizer may widen its state on its first update)."""

  def like(x: jax.Array, t: Any) -> jax.Array:
    missing = tuple(sorted(varying_axes(t) - varying_axes(x)))
    return lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(lambda x, t: like(x.astype(t.dtype), t), value, template)


def _on_arrays(fn: Callable[..., Any], operands: tuple, static_out: list):
  """``fn`` on the array leaves of ``operands`` only, and those leaves; each call appends
  its output's structure and non-array leaves to ``static_out``."""
  leaves, treedef = jax.tree.flatten(operands)
  dynamic = [is_array_leaf(leaf) for leaf in leaves]

  def run(*arrays: Any) -> list:
    given = iter(arrays)
    full = [next(given) if d else leaf for leaf, d in zip(leaves, dynamic)]
    out_leaves, out_def = jax.tree.flatten(fn(*jax.tree.unflatten(treedef, full)))
    static_out.append((out_def, [None if is_array_leaf(x) else x for x in out_leaves]))
    return [x for x in out_leaves if is_array_leaf(x)]

  return run, [x for x, d in zip(leaves, dynamic) if d]


def _rebuilt(arrays: list, static_out: list) -> Any:
  """The output of an ``_on_arrays`` function from its array leaves."""
  out_def, statics = static_out[0]
  if any(d != out_def or any(a is not b for a, b in zip(s, statics)) for d, s in static_out):
    raise TypeError(
      "jaxamp: the two branches of a step returned different non-array leaves; "
      "return the operands' own (an Equinox module's functions) from both."
    )
  given = iter(arrays)
  return jax.tree.unflatten(out_def, [next(given) if x is None else x for x in statics])


def eval_shape(fn: Callable[..., Any], *operands: Any) -> Any:
  """``jax.eval_shape``, the leaves that are not arrays passed through as they are."""
  static_out: list = []
  run, arrays = _on_arrays(fn, operands, static_out)
  return _rebuilt(jax.eval_shape(run, *arrays), static_out)


def with_output_types(apply: Callable[..., Any]) -> tuple[Callable[..., Any], Callable[..., Any]]:
  """``apply``, and its output types for a skipped branch: those of ``apply``'s trace
  if it ran first (as ``lax.cond`` traces it), so the optimizer is traced once."""
  seen: list[Any] = []

  def traced_apply(*operands):
    out = apply(*operands)
    # an Equinox module's function is its own type
    seen.append(jax.tree.map(lambda x: jax.typeof(x) if is_array_leaf(x) else x, out))
    return out

  def output_types(*operands):
    return seen[-1] if seen else eval_shape(apply, *operands)

  return traced_apply, output_types


def apply_or_skip(
  found_inf: jax.Array | bool,
  apply: Callable[..., Any],
  skip: Callable[..., Any],
  *operands: Any,
) -> Any:
  """``skip(*operands)`` if ``found_inf`` else ``apply(*operands)``: every step's one
  conditional (a Python bool ``found_inf`` runs only that branch)."""
  if isinstance(found_inf, bool):
    return (skip if found_inf else apply)(*operands)
  return cond(jnp.logical_not(found_inf), apply, skip, *operands)


def cond(pred: jax.Array, true_fn: Callable[..., Any], false_fn: Callable[..., Any], *operands):
  """``lax.cond`` whose operands and outputs may hold non-array leaves, passed around it."""
  if all(map(is_array_leaf, jax.tree.leaves(operands))):
    return lax.cond(pred, true_fn, false_fn, *operands)
  static_out: list = []
  true_run, arrays = _on_arrays(true_fn, operands, static_out)
  false_run, _ = _on_arrays(false_fn, operands, static_out)
  return _rebuilt(lax.cond(pred, true_run, false_run, *arrays), static_out)


def _skip_groups(labels, skipped, applied, inner_state, schedule_counts):
  """The inner update with the groups that found inf/NaN skipped (zeros, states kept)."""
  updates, new_state = applied
  update_leaves, update_def = jax.tree.flatten(updates)
  update_leaves = [jnp.where(s, jnp.zeros_like(u), u) for s, u in zip(skipped, update_leaves)]
  group_skipped = dict(zip(labels, skipped))
  states = {}
  for label, new in new_state.inner_states.items():
    old = skipped_state(inner_state.inner_states[label], schedule_counts, lambda new=new: new)
    skip = group_skipped.get(label, jnp.zeros([], bool))
    states[label] = jax.tree.map(lambda o, n, skip=skip: jnp.where(skip, o, n), old, new)
  return jax.tree.unflatten(update_def, update_leaves), new_state._replace(inner_states=states)


def keep_skipped_params(
  params: Any, stepped: Any, check: Check, labels: list | None, grads: Any
) -> Any:
  """``stepped`` with the params of every skipped group as they were (all of them
  without groups); ``labels`` and ``check`` are those of ``grads``' array leaves."""
  if labels is None:
    return params
  skipped = iter(skipped_leaves(check.nonfinite, labels))

  def keep(param: Any, new: Any, grad: Any) -> Any:
    return new if grad is None else jnp.where(next(skipped), param, new)

  return jax.tree.map(keep, params, stepped, grads, is_leaf=is_none)


def iteration(
  loss_scale: jax.Array,
  config: LossScaleConfig,
  check: Check,
  update: Callable[[Any, Any, Any], tuple[Any, Any]],
  grads: Any,
  inner_state: Any,
  params: Any,
  *,
  labels: list | None = None,
  branch: bool | None = None,
) -> tuple[Any, Any]:
  """One torch iteration's ``(updates, inner_state)``: ``update`` applied to the
  unscaled ``grads``, or skipped. ``labels`` (per gradient leaf) skip each group on
  its own; ``branch`` is the found_inf of the caller's own branch, whose skip then
  returns zeros and the untyped inner state, typed by the caller."""
  if branch is None:
    # Unscaled before the branch, the optimizer compiles as a computation of
    # its own, as ``jax.jit(tx.update)`` does: the same arithmetic, bit for bit.
    grads = unscaled(grads, check, loss_scale)
    apply, output_types = with_output_types(update)
  else:  # inside the caller's fused branch: unscaled there, fused with the update

    def unscaled_update(grads, inner_state, params):
      return update(unscaled(grads, check, loss_scale), inner_state, params)

    apply, output_types = with_output_types(unscaled_update)

  def skip(grads, inner_state, params):
    if labels is not None:  # only the groups whose own gradients hold inf/NaN
      skipped = skipped_leaves(check.nonfinite, labels)
      applied = apply(grads, inner_state, params)
      return _skip_groups(labels, skipped, applied, inner_state, config.schedule_counts)
    state = skipped_state(
      inner_state, config.schedule_counts, lambda: apply(grads, inner_state, params)[1]
    )
    if branch is not None:  # the caller's own skipped branch: it types its outputs
      return jax.tree.map(jnp.zeros_like, grads), state
    updates_type, state_type = output_types(grads, inner_state, params)
    zeros = jax.tree.map(zeros_of_type, updates_type)
    return typed_like(zeros, updates_type), typed_like(state, state_type)

  found_inf = check.found_inf if branch is None else branch
  return apply_or_skip(found_inf, apply, skip, grads, inner_state, params)
