"""One skip decision for all devices, replicas kept identical, and the mesh types of a
skipped step's zeros."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxamp._validation import is_array_leaf, is_none


def varying_axes(x: Any) -> frozenset:
  """The mesh axes a value varies over inside ``shard_map`` (empty elsewhere)."""
  aval = x if isinstance(x, jax.core.ShapedArray) else jax.typeof(x)
  varying = getattr(aval, "vma", None)
  if varying is None:  # newer JAX spells it manual_axis_type.varying
    varying = getattr(getattr(aval, "manual_axis_type", None), "varying", ())
  return frozenset(varying or ())


def zeros_of_type(aval: Any) -> jax.Array:
  """Zeros of ``aval``'s shape and dtype, sharded as it is where its mesh axes are
  ``Explicit`` (a sharding that is part of the type; elsewhere XLA chooses)."""
  sharding = getattr(aval, "sharding", None)
  axis_types = getattr(getattr(sharding, "mesh", None), "axis_types", ())
  explicit = any(t == jax.sharding.AxisType.Explicit for t in axis_types)
  return jnp.zeros(aval.shape, aval.dtype, out_sharding=sharding if explicit else None)


def _check_replicated(state: Any, axis_names: tuple[str, ...]) -> None:
  for field in ("loss_scale", "growth_tracker", "hysteresis_tracker", "update_count"):
    value = getattr(state, field)
    varying = set(varying_axes(value)) & set(axis_names)
    if varying:
      raise ValueError(
        f"jaxamp: the loss-scale state must be replicated over {axis_names}, but "
        f"{field} varies over {sorted(varying)}. Pass the optimizer state with "
        "a replicated spec (P()) to shard_map."
      )


def all_reduce_found_inf(
  found_inf: jax.Array, state: Any, axis_name: str | tuple[str, ...]
) -> jax.Array:
  """``found_inf`` OR-ed over the devices of ``axis_name``.

  Raises:
    ValueError: ``axis_name`` is not bound (not inside ``shard_map``/``pmap``
      over it), or the scale state differs between those devices.
  """
  names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
  _check_bound(names, axis_name)
  _check_replicated(state, names)
  return lax.psum(found_inf.astype(jnp.int32), names) > 0


def _check_bound(names: tuple[str, ...], axis_name: Any) -> None:
  # Asked before psum: inside shard_map, psum over an axis the mesh lacks fails
  # with a bare AssertionError (jax 0.10), not the NameError it raises elsewhere.
  for name in names:
    try:
      lax.axis_size(name)
    except NameError as error:
      raise ValueError(
        f"jaxamp: axis_name={axis_name!r} is not bound here. Call the update "
        "inside jax.shard_map (or pmap) over that mesh axis, or leave axis_name "
        f"unset under plain jax.jit. ({error})"
      ) from None


def check_averaged(grads: Any, params: Any, axis_name: str | tuple[str, ...]) -> None:
  """Raises ValueError for a gradient varying over ``axis_name`` where its parameter is
  replicated: the replicas would differ (sharded parameters vary too, and pass)."""
  names = {axis_name} if isinstance(axis_name, str) else set(axis_name)
  paths = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_none)[0]
  for (path, param), grad in zip(paths, jax.tree.leaves(grads, is_leaf=is_none)):
    if grad is None or not is_array_leaf(param):
      continue
    axes = sorted((varying_axes(grad) - varying_axes(param)) & names)
    if axes:
      axis = axes[0] if len(axes) == 1 else tuple(axes)
      raise ValueError(
        f"jaxamp: average the gradients over the devices before the update: "
        f"grads = lax.pmean(grads, {axis!r}). The gradient of "
        f"{jax.tree_util.keystr(path) or '<root>'} varies over {axes} but its parameter "
        "is replicated, so each device would step its copy differently.\n"
        "  To step each device's copy on its own on purpose, pass the parameters as "
        f"varying: lax.pcast(params, {axis!r}, to='varying')."
      )
