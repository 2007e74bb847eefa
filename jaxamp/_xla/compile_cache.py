"""Compiled once: run a function jitted per static configuration and argument shapes.

A ``lax.cond`` of fresh closures run outside ``jit`` compiles on every call; through
:func:`call_compiled` an eager loop compiles each step once (BENCHMARKS.md, "Compile cache").
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np

from jaxamp._xla import enabled

_ARRAY_LIKE = (jax.Array, np.ndarray, np.generic)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _compiled(fn: Callable, static: Hashable, treedef: Any, others: tuple, arrays: list) -> Any:
  leaves = list(arrays)
  for index, value in others:
    leaves.insert(index, value)
  return fn(static, *jax.tree.unflatten(treedef, leaves))


def traced(tree: Any) -> bool:
  """Whether any leaf of ``tree`` is being traced (by ``jit``, ``grad``, ...)."""
  return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(tree))


def _hashable(value: Any) -> bool:
  try:
    hash(value)
  except TypeError:
    return False
  return True


def call_compiled(fn: Callable, static: Hashable, *args: Any) -> Any:
  """``fn(static, *args)``, compiled once per ``fn``, ``static``, argument shapes and
  non-array leaves (traced on every call where one is unhashable; as it is under a trace)."""
  if traced(args) or not enabled("compile_cache"):
    return fn(static, *args)
  leaves, treedef = jax.tree.flatten(args)
  arrays = [leaf for leaf in leaves if isinstance(leaf, _ARRAY_LIKE)]
  others = tuple((i, leaf) for i, leaf in enumerate(leaves) if not isinstance(leaf, _ARRAY_LIKE))
  if not (_hashable(static) and _hashable(treedef) and _hashable(others)):
    return fn(static, *args)
  return _compiled(fn, static, treedef, others, arrays)
