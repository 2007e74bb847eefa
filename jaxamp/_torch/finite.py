"""Checking a gradient tree for inf/NaN, leaf by leaf, in few reductions."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

_GROUP = 8  # same-size leaves per reduction (BENCHMARKS.md, "Check formulations")


def _group_is_finite(grads: list[jax.Array]) -> list[jax.Array]:
  """``all(isfinite(g))`` for each same-size leaf, in one variadic reduction: one
  loop, not one per leaf, on XLA CPU (BENCHMARKS.md, "Check formulations")."""
  flags = lax.reduce(
    tuple(jnp.isfinite(g.reshape(-1)) for g in grads),  # a reshape is free
    (jnp.bool_(True),) * len(grads),
    _and_each(len(grads)),
    (0,),
  )
  return list(flags)


@functools.cache
def _and_each(n: int):
  """The reduction of :func:`_group_is_finite`, one per arity: JAX caches its kernel
  by this function, which a new lambda per call would recompile."""

  def and_each(acc, x):
    return tuple(a & b for a, b in zip(acc, x))

  return and_each


def _alone_is_finite(grad: jax.Array) -> jax.Array:
  """``all(isfinite(grad))`` for a leaf of a size no other leaf has: its two halves
  as a group, faster on XLA CPU and with no temporary of the leaf's size
  (BENCHMARKS.md, "Check formulations")."""
  flat = grad.reshape(-1)
  half = flat.size // 2
  first, second = _group_is_finite([flat[:half], flat[half : 2 * half]])
  finite = first & second
  return finite & jnp.isfinite(flat[-1]) if flat.size % 2 else finite


def leaf_finite_flags(tree: Any) -> jax.Array:
  """Per array leaf (in ``jax.tree.leaves`` order), whether it is all finite."""
  leaves = jax.tree.leaves(tree)
  flags: list[Any] = [None] * len(leaves)
  same_size: dict[tuple[int, Any], list[int]] = {}
  for i, leaf in enumerate(leaves):
    same_size.setdefault((leaf.size, jnp.dtype(leaf.dtype)), []).append(i)
  for indices in same_size.values():
    for start in range(0, len(indices), _GROUP):
      group = indices[start : start + _GROUP]
      if len(group) == 1:
        flags[group[0]] = _alone_is_finite(leaves[group[0]])
      else:
        for i, flag in zip(group, _group_is_finite([leaves[i] for i in group])):
          flags[i] = flag
  return jnp.stack(flags) if flags else jnp.ones([0], bool)


def _check_arrays(tree: Any) -> None:
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if not hasattr(leaf, "dtype"):
      where = jax.tree_util.keystr(path) or "<root>"
      raise TypeError(f"jaxamp: leaf {where} is a {type(leaf).__name__}, not an array.")


def all_finite(tree: Any) -> jax.Array:
  """Whether every element of every array leaf is finite (``None`` skipped).

  Args:
    tree: a pytree of arrays.

  Examples:
    >>> import jax.numpy as jnp, jaxamp
    >>> bool(jaxamp.ops.all_finite({"w": jnp.ones(2), "b": jnp.array([1.0, jnp.inf])}))
    False
  """
  _check_arrays(tree)
  return jnp.all(leaf_finite_flags(tree))
