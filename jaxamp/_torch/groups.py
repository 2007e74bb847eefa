"""Several optimizers, one scale: torch's per-optimizer skip in the optax form.

``param_labels`` and ``update_scale=False`` are described in docs/optax.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxamp._validation import is_none


class ParamLabels:
  """``param_labels`` (a label tree, or a function of the gradients) as hashable config."""

  def __init__(self, labels: Any):
    self.labels = labels
    leaves, treedef = jax.tree.flatten(labels)
    self._key = labels if callable(labels) else (treedef, tuple(leaves))

  def __eq__(self, other: object) -> bool:
    return isinstance(other, ParamLabels) and self._key == other._key

  def __hash__(self) -> int:
    return hash(self._key)

  def __repr__(self) -> str:
    return f"ParamLabels({self.labels!r})"

  def of(self, grads: Any) -> list[Any]:
    """The label of each array leaf of ``grads`` (labels may be a prefix of its tree)."""
    labels = self.labels(grads) if callable(self.labels) else self.labels
    grad_leaves, grad_def = jax.tree.flatten(grads, is_leaf=is_none)

    def spread(label: Any, subtree: Any) -> Any:
      return jax.tree.map(lambda _: label, subtree, is_leaf=is_none)

    try:
      label_leaves = jax.tree.leaves(jax.tree.map(spread, labels, grads), is_leaf=is_none)
    except (ValueError, TypeError):
      label_leaves = None
    if label_leaves is None or len(label_leaves) != len(grad_leaves):
      raise ValueError(
        "jaxamp: param_labels does not have the structure of the gradients, nor a "
        f"prefix of it.\n  labels:    {jax.tree.structure(labels)}\n  gradients: {grad_def}"
      )
    return [label for label, grad in zip(label_leaves, grad_leaves) if grad is not None]


def grouped(
  inner: Mapping[str, optax.GradientTransformation],
  labels: ParamLabels,
  stepped: Any = None,
):
  """``optax.multi_transform(inner, labels)``, checked; with ``stepped`` (the labels
  with gradients), the other groups' transformations are not called at all."""
  if not isinstance(inner, Mapping) or not all(
    isinstance(tx, optax.GradientTransformation) for tx in inner.values()
  ):
    raise TypeError(
      "jaxamp: with param_labels, dynamic_loss_scale takes {label: transformation} "
      "(one per optimizer, as optax.multi_transform), got "
      f"{type(inner).__name__}."
    )
  if stepped is not None:
    inner = {label: tx if label in stepped else _idle(tx) for label, tx in inner.items()}
  return optax.multi_transform(dict(inner), labels.labels)


def _idle(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """``tx`` not stepped: its ``None`` updates and its state passed through."""

  def update_fn(updates, state, params=None):
    del params
    return updates, state

  return optax.GradientTransformation(tx.init, update_fn)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class SteppedGroups:
  """Groups stepped with ``update_scale=False`` since the scale advanced (static)."""

  labels: tuple = ()

  def __repr__(self) -> str:
    return f"SteppedGroups({self.labels!r})"


def check_steps(
  pending: SteppedGroups, labels: list[Any] | None, update_scale: Any, has_groups: bool
) -> tuple[Any, ...]:
  """The groups this update steps, checked against ``pending`` as torch checks them."""
  if not isinstance(update_scale, (bool, np.bool_)):
    raise TypeError(
      f"jaxamp: update_scale must be True or False (a Python bool: it decides the "
      f"state's structure), got {update_scale!r}."
    )
  if not has_groups:
    if not update_scale:
      raise ValueError(
        "jaxamp: update_scale=False holds the scale for optimizers that step one after "
        "the other, which needs several: build dynamic_loss_scale({label: optimizer}, "
        "param_labels=...) and pass None gradients for the groups not stepped now."
      )
    return ()
  new = tuple(dict.fromkeys(labels or ()))
  twice = [label for label in new if label in pending.labels]
  if twice:
    raise ValueError(
      f"jaxamp: the group {twice[0]!r} was already stepped since the loss scale last "
      f"advanced (steps with update_scale=False: {list(pending.labels)}); torch refuses "
      "step() twice before update(). Let the last update of each iteration advance the "
      "scale (update_scale=True, the default), and give this group None gradients "
      "in the updates that do not step it."
    )
  if not new and not (update_scale and pending.labels):
    raise ValueError(
      "jaxamp: every gradient is None, so no group steps"
      + (" and no earlier step awaits the scale's advance" if update_scale else "")
      + "; pass the gradients of the groups to step (None for the others)."
    )
  return new


def skipped_leaves(nonfinite: jax.Array, labels: list[Any] | None) -> jax.Array:
  """Per leaf, whether its group's gradients hold inf/NaN (all, without groups)."""
  if labels is None:
    return jnp.broadcast_to(jnp.any(nonfinite), nonfinite.shape)
  found = {label: jnp.zeros([], bool) for label in labels}
  for label, flag in zip(labels, nonfinite):
    found[label] = found[label] | flag
  return jnp.stack([found[label] for label in labels]) if labels else nonfinite
