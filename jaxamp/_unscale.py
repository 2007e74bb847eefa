"""Unscaling a gradient tree and checking it for inf/NaN, as torch does."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxamp._finite import leaf_finite_flags
from jaxamp._validation import check_float_gradients


def inverse_scale(loss_scale: jax.Array) -> jax.Array:
  """Returns ``f32(1 / f64(loss_scale))``, torch's ``inv_scale`` (docs/torch_semantics.md §3.1).

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
  return lax.bitcast_convert_type(lax.bitcast_convert_type(x, bits) ^ zero.astype(bits), x.dtype)


def unscale_and_check(grads: Any, loss_scale: jax.Array) -> tuple[Any, jax.Array]:
  """Unscales ``grads`` and reports whether they held inf or NaN.

  What torch's ``_amp_foreach_non_finite_check_and_unscale_`` does (docs/torch_semantics.md §3.2):

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


def finite_leaves(grads: Any, loss_scale: jax.Array, detect_unscale_overflow: bool) -> jax.Array:
  """Per leaf, whether ``grads`` is finite: torch's check of the still-scaled
  gradients, and with ``detect_unscale_overflow`` also of the unscaled ones
  (torch misses a bfloat16 ``3e38`` that unscaling at 0.5 makes inf)."""
  finite = leaf_finite_flags(grads)
  if detect_unscale_overflow:
    finite = finite & leaf_finite_flags(unscale(grads, loss_scale))
  return finite
