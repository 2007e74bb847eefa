"""Unscaling a gradient tree and checking it for inf/NaN, as torch does."""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxamp._validation import check_float_gradients


def inverse_scale(loss_scale: jax.Array) -> jax.Array:
  """Returns ``f32(1 / f64(loss_scale))``, torch's ``inv_scale`` (SPEC 3.1).

  For a normal float32 scale this is the correctly rounded float32 division.
  A subnormal scale (which XLA would read as zero) is handled exactly from its
  bits, so scales between ``1/FLT_MAX`` and ``2**-126`` give torch's finite
  reciprocal. A scale above ``2**126`` has a subnormal reciprocal, which XLA
  flushes to zero where torch keeps it (a documented divergence).
  """
  loss_scale = jnp.asarray(loss_scale, jnp.float32)
  bits = lax.bitcast_convert_type(loss_scale, jnp.int32)
  fraction = bits & 0x7FFFFF
  is_subnormal = ((bits & 0x7F800000) == 0) & (fraction != 0)
  # 1 / (m * 2**-149) = (1/m) * 2**149, scaled in the exponent bits (exact).
  reciprocal_bits = lax.bitcast_convert_type(1.0 / fraction.astype(jnp.float32), jnp.int32)
  overflows = (reciprocal_bits >> 23) + 149 >= 0xFF
  scaled_bits = jnp.where(overflows, 0x7F800000, reciprocal_bits + (149 << 23))
  subnormal_inverse = lax.bitcast_convert_type(scaled_bits | (bits & ~0x7FFFFFFF), jnp.float32)
  return jnp.where(is_subnormal, subnormal_inverse, jnp.float32(1.0) / loss_scale)


def _unscale_leaf(grad: jax.Array, inv_scale: jax.Array) -> jax.Array:
  if grad.dtype == jnp.float64:
    product = grad * inv_scale.astype(jnp.float64)
  else:  # float32, and float16/bfloat16 in float32 "opmath", cast back
    product = (grad.astype(jnp.float32) * inv_scale).astype(grad.dtype)
  return jnp.where(inv_scale == 1.0, grad, product)  # torch's inv == 1 shortcut


class KnownFlags:
  """Per-leaf finiteness already computed for ``grads`` (see :func:`known_flags`)."""

  def __init__(self, grads: Any, flags: jax.Array, found_inf: bool):
    self.leaves, self.flags, self.found_inf, self.uses = jax.tree.leaves(grads), flags, found_inf, 0


_KNOWN_FLAGS: contextvars.ContextVar[KnownFlags | None] = contextvars.ContextVar(
    "jaxamp_known_flags", default=None
)


@contextlib.contextmanager
def known_flags(grads: Any, flags: jax.Array, found_inf: bool):
  """While tracing, ``dynamic_loss_scale`` given these very ``grads`` (the
  same tracers) takes ``flags`` and ``found_inf`` instead of checking them.

  ``jaxamp.apply_scaled_updates`` traces the update in the branches of its own
  ``lax.cond`` on the flags; a Python ``found_inf`` in each branch lets the
  transform emit no ``lax.cond`` of its own, so XLA fuses the whole update.
  Yields the :class:`KnownFlags`, whose ``uses`` counts the substitutions.
  """
  known = KnownFlags(grads, flags, found_inf)
  token = _KNOWN_FLAGS.set(known)
  try:
    yield known
  finally:
    _KNOWN_FLAGS.reset(token)


def known_for(grads: Any) -> KnownFlags | None:
  """The :class:`KnownFlags` given for these very ``grads``, counting the use."""
  known = _KNOWN_FLAGS.get()
  if known is None:
    return None
  leaves = jax.tree.leaves(grads)
  if len(leaves) != len(known.leaves) or any(a is not b for a, b in zip(leaves, known.leaves)):
    return None
  known.uses += 1
  return known


_BITS = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}


def runtime_zero(loss_scale: jax.Array) -> jax.Array:
  """An int32 zero that XLA cannot prove is zero, for :func:`rounded`.

  It is ``isnan(loss_scale)``: one only for a NaN scale, whose unscaled
  gradients are all NaN anyway. It varies over no more ``shard_map`` axes than
  the scale.
  """
  return jnp.isnan(jnp.asarray(loss_scale)).astype(jnp.int32)


def rounded(x: Any, zero: jax.Array) -> Any:
  """``x`` unchanged, as a value XLA and LLVM cannot contract into an FMA.

  ``zero`` is :func:`runtime_zero`: XOR-ing the bits with it keeps ``x``
  rounded to its dtype, so a fused consumer computes what it would from ``x``
  in memory. Costs no memory pass.
  """
  if x is None:
    return None
  bits = _BITS[x.dtype.itemsize]
  return lax.bitcast_convert_type(
      lax.bitcast_convert_type(x, bits) ^ zero.astype(bits), x.dtype
  )


_GROUP = 8  # same-size leaves per reduction: the fastest measured (BENCHMARKS.md)


def _group_is_finite(grads: list[jax.Array]) -> list[jax.Array]:
  """One variadic reduction over same-size leaves: ``all(isfinite(g))`` for each.

  XLA CPU keeps one accumulator per leaf in a single loop instead of a
  sequential loop per leaf: at 200 leaves of 125,000 elements 4.1 ms instead
  of 10.4 (float32), 2.7 instead of 9.5 (float16), and it compiles faster.
  """
  flags = lax.reduce(
      tuple(jnp.isfinite(g.reshape(-1)) for g in grads),  # a reshape is free
      (jnp.bool_(True),) * len(grads),
      _and_each(len(grads)),
      (0,),
  )
  return list(flags)


@functools.cache
def _and_each(n: int):
  """The reduction of :func:`_group_is_finite`, one function per arity: JAX
  caches the reduction's jaxpr (and, outside ``jit``, its compiled kernel) by
  this function, so a new lambda per call would recompile it every eager call."""

  def and_each(acc, x):
    return tuple(a & b for a, b in zip(acc, x))

  return and_each


def _alone_is_finite(grad: jax.Array) -> jax.Array:
  """``all(isfinite(grad))`` for a leaf of a size no other leaf has.

  Its two halves go through one variadic reduction, like a group: 1.6-2.5x
  faster than one reduction over the whole leaf on XLA CPU, and, unlike
  ``all(isfinite(g))`` or ``isfinite(sum(g * 0))``, it writes no temporary
  of the leaf's size for any dtype (BENCHMARKS.md, "Check formulations").
  """
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


def all_finite(tree: Any) -> jax.Array:
  """Whether every element of every array leaf is finite (``None`` skipped)."""
  return jnp.all(leaf_finite_flags(tree))


def unscale_and_check(grads: Any, loss_scale: jax.Array) -> tuple[Any, jax.Array]:
  """Unscales ``grads`` and reports whether they held inf or NaN.

  What torch's ``_amp_foreach_non_finite_check_and_unscale_`` does (SPEC 3.2):

  * detection looks at the still-scaled input, so an overflow produced by the
    multiplication itself is not reported (as in torch);
  * each gradient is multiplied by ``inv = f32(1 / f64(loss_scale))``, not
    divided by the scale; float16 and bfloat16 are multiplied in float32 and
    cast back, float64 by the float32-rounded ``inv``;
  * when ``inv == 1`` the gradients pass through untouched;
  * every gradient is unscaled even when some are not finite.

  Args:
    grads: a pytree of floating-point arrays (``None`` leaves pass through),
      gradients of the scaled loss.
    loss_scale: the float32 scale the loss was multiplied by.

  Returns:
    ``(unscaled_grads, found_inf)``, with ``found_inf`` a bool scalar.

  Raises:
    TypeError: a gradient leaf is not a floating-point array.

  Examples:
    >>> import jax.numpy as jnp
    >>> grads, found_inf = unscale_and_check(
    ...     {"w": jnp.array([3.0, jnp.inf])}, jnp.float32(3.0))
    >>> grads["w"].tolist(), bool(found_inf)
    ([1.0, inf], True)
  """
  unscaled, finite = unscale_and_check_leaves(grads, loss_scale)
  return unscaled, ~jnp.all(finite)


def unscale(grads: Any, loss_scale: jax.Array) -> Any:
  """``grads`` multiplied by torch's ``inv_scale`` (see :func:`unscale_and_check`)."""
  inv_scale = inverse_scale(loss_scale)
  return jax.tree.map(lambda g: _unscale_leaf(g, inv_scale), grads)


def unscale_and_check_leaves(grads: Any, loss_scale: jax.Array) -> tuple[Any, jax.Array]:
  """:func:`unscale_and_check` with the finiteness of each leaf (bool ``[n]``)."""
  check_float_gradients(grads)
  return unscale(grads, loss_scale), leaf_finite_flags(grads)
