"""Several optimizers, one scale: torch's per-optimizer skip in the optax form.

torch skips each optimizer whose own gradients hold inf/NaN, and backs the
one shared scale off once. :func:`~jaxamp.dynamic_loss_scale` does the same
when given ``{label: transformation}`` and ``param_labels`` (as
``optax.multi_transform`` takes them): a group is skipped only when its own
gradients are not finite.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax


class ParamLabels:
  """``param_labels`` (a tree of labels, or a function of the gradients giving
  one) as static configuration: hashable, compared by value."""

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
    """The label of each array leaf of ``grads``, in ``jax.tree.leaves`` order."""
    labels = self.labels(grads) if callable(self.labels) else self.labels
    label_leaves, label_def = jax.tree.flatten(labels)
    if label_def != jax.tree.structure(grads):  # type: ignore[operator]
      raise ValueError(
        "jaxamp: param_labels does not have the structure of the gradients.\n"
        f"  labels:    {label_def}\n  gradients: {jax.tree.structure(grads)}"
      )
    return label_leaves


def grouped(inner: Mapping[str, optax.GradientTransformation], labels: ParamLabels):
  """``optax.multi_transform(inner, labels)``, checked."""
  if not isinstance(inner, Mapping) or not all(
    isinstance(tx, optax.GradientTransformation) for tx in inner.values()
  ):
    raise TypeError(
      "jaxamp: with param_labels, dynamic_loss_scale takes {label: transformation} "
      "(one per optimizer, as optax.multi_transform), got "
      f"{type(inner).__name__}."
    )
  return optax.multi_transform(dict(inner), labels.labels)


def skipped_leaves(nonfinite: jax.Array, labels: list[Any] | None) -> jax.Array:
  """Per leaf, whether its group's gradients hold inf/NaN (all, without groups)."""
  if labels is None:
    return jnp.broadcast_to(jnp.any(nonfinite), nonfinite.shape)
  found = {label: jnp.zeros([], bool) for label in labels}
  for label, flag in zip(labels, nonfinite):
    found[label] = found[label] | flag
  return jnp.stack([found[label] for label in labels]) if labels else nonfinite
