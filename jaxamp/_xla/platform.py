"""Leaves computed one way on XLA CPU and another elsewhere, in one ``lax.platform_dependent``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax import lax

from jaxamp._xla import enabled


def map_by_platform(
  tree: Any, chosen: Callable[[Any], bool], *, cpu: Callable, default: Callable
) -> Any:
  """``tree`` with each ``chosen`` leaf mapped by ``cpu`` on XLA CPU and by ``default``
  elsewhere, in one ``lax.platform_dependent`` for the whole tree."""
  leaves, treedef = jax.tree.flatten(tree)
  picked = [i for i, leaf in enumerate(leaves) if chosen(leaf)]
  if not picked:
    return tree
  if not enabled("platform"):
    return jax.tree.map(lambda leaf: default(leaf) if chosen(leaf) else leaf, tree)
  mapped = lax.platform_dependent(
    *(leaves[i] for i in picked),
    cpu=lambda *ls: tuple(map(cpu, ls)),
    default=lambda *ls: tuple(map(default, ls)),
  )
  for i, leaf in zip(picked, mapped):
    leaves[i] = leaf
  return jax.tree.unflatten(treedef, leaves)
