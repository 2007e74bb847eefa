"""torch's schedule semantics on skipped steps: the schedules count iterations."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

# The state of the stateful schedule inject_hyperparams wraps a schedule in.
_WRAPPED_SCHEDULE_STATE = type(optax.WrappedSchedule(lambda count: count).init())
# The optax wrappers that hold a transformation's state as their inner_state.
INJECT_STATES = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)
# The optax states whose ``count`` drives a schedule (not an optimizer's own
# count, such as Adam's bias correction).
SCHEDULE_STATES = (optax.ScaleByScheduleState, _WRAPPED_SCHEDULE_STATE, *INJECT_STATES)


def _is_schedule_state(x: Any) -> bool:
  return isinstance(x, SCHEDULE_STATES)


def _advanced(node: Any) -> Any:
  if not _is_schedule_state(node):
    return node
  if isinstance(node, (optax.ScaleByScheduleState, _WRAPPED_SCHEDULE_STATE)):
    return node._replace(count=optax.safe_increment(node.count))
  if isinstance(node, optax.InjectStatefulHyperparamsState):
    for name, schedule_state in node.hyperparams_states.items():
      if not isinstance(schedule_state, _WRAPPED_SCHEDULE_STATE):
        raise TypeError(
          f"jaxamp: schedule_counts='iterations' (GradScaler's default) cannot advance "
          f"the stateful schedule of {name!r} on a skipped step; give "
          "inject_hyperparams a plain schedule function, or use schedule_counts='applied'."
        )
    node = node._replace(
      hyperparams_states={k: _advanced(v) for k, v in node.hyperparams_states.items()}
    )
  return node._replace(
    count=optax.safe_increment(node.count), inner_state=advance_schedule_counts(node.inner_state)
  )


def _is_injected(x: Any) -> bool:
  return isinstance(x, INJECT_STATES)


def with_hyperparams_of(skipped: Any, applied: Any) -> Any:
  """``skipped`` with each ``inject_hyperparams`` state's hyperparameters those
  of ``applied`` (the same tree after the update): the values of the skipped
  iteration, as torch's ``param_groups`` show its learning rate."""

  def take(old: Any, new: Any) -> Any:
    if not _is_injected(old):
      return old
    fresh = {  # the values of new, the types of old (a traced update may give Python ones)
      k: jnp.asarray(new.hyperparams[k], v.dtype) if hasattr(v, "dtype") else v
      for k, v in old.hyperparams.items()
    }
    return old._replace(hyperparams=fresh)

  return jax.tree.map(take, skipped, applied, is_leaf=_is_injected)


def has_injected_hyperparams(inner_state: Any) -> bool:
  return any(map(_is_injected, jax.tree.leaves(inner_state, is_leaf=_is_injected)))


def advance_schedule_counts(inner_state: Any) -> Any:
  """``inner_state`` with every schedule count one step on, and nothing else: a
  skipped step's with ``schedule_counts="iterations"``, as torch's ``LRScheduler``."""
  return jax.tree.map(_advanced, inner_state, is_leaf=_is_schedule_state)
