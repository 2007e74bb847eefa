"""Unscaling a gradient tree and checking it for inf/NaN, as torch does."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxamp._torch.exact import float_bits
from jaxamp._torch.finite import leaf_finite_flags
from jaxamp._validation import check_float_gradients


def _subnormal_reciprocal_bits(bits: jax.Array) -> jax.Array:
  """Bits ``n`` of torch's subnormal ``round(1 / scale) == n * 2**-149`` for a scale above
  ``2**126``: ``round(2**t / m)`` is the float32 quotient's floor, or one more when
  ``(2 * floor + 1) * m < 2**(t + 1)`` (a 48-bit product in 12-bit limbs, never equal)."""
  m = (bits & 0x7FFFFF) | 0x800000
  t = 299 - ((bits >> 23) & 0xFF)
  power = lax.bitcast_convert_type((t + 127) << 23, jnp.float32)  # 2.0**t
  floor = jnp.floor(power / m.astype(jnp.float32)).astype(jnp.int32)
  k = 2 * floor + 1
  kh, kl, mh, ml = k >> 12, k & 0xFFF, m >> 12, m & 0xFFF
  middle = kh * ml + kl * mh
  high = kh * mh + (middle >> 12) + ((kl * ml + ((middle & 0xFFF) << 12)) >> 24)
  return floor + (high < jnp.left_shift(1, t - 23)).astype(jnp.int32)


def inverse_parts(loss_scale: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """torch's ``inv_scale``; ``(high, low)``, normal floats with ``high * low ==
  inv_scale`` exactly, as XLA flushes a subnormal operand; and ``inv_scale == 1``,
  compared once, not per leaf (BENCHMARKS.md, "Compile time")."""
  loss_scale = jnp.asarray(loss_scale, jnp.float32)
  bits = float_bits(loss_scale)
  sign = bits & ~0x7FFFFFFF
  fraction, biased = bits & 0x7FFFFF, (bits >> 23) & 0xFF
  is_subnormal = (biased == 0) & (fraction != 0)
  # 1 / (m * 2**-149) = (1/m) * 2**149, scaled in the exponent bits (exact).
  reciprocal_bits = lax.bitcast_convert_type(1.0 / fraction.astype(jnp.float32), jnp.int32)
  overflows = (reciprocal_bits >> 23) + 149 >= 0xFF
  scaled_bits = jnp.where(overflows, 0x7F800000, reciprocal_bits + (149 << 23))
  inverse = jnp.where(
    is_subnormal,
    lax.bitcast_convert_type(scaled_bits | sign, jnp.float32),
    jnp.float32(1.0) / loss_scale,
  )
  # A scale above 2**126 has a subnormal reciprocal: its bits are n, its
  # value (n * 2**-85) * 2**-64.
  is_large = (biased >= 253) & (biased < 0xFF)
  n = _subnormal_reciprocal_bits(bits)
  high_bits = lax.bitcast_convert_type(n.astype(jnp.float32) * 2.0**-85, jnp.int32) | sign
  high = lax.bitcast_convert_type(high_bits, jnp.float32)
  inverse = jnp.where(is_large, lax.bitcast_convert_type(n | sign, jnp.float32), inverse)
  low = jnp.where(is_large, jnp.float32(2.0**-64), jnp.float32(1.0))
  return inverse, jnp.where(is_large, high, inverse), low, inverse == 1.0


def inverse_scale(loss_scale: jax.Array) -> jax.Array:
  """Returns ``f32(1 / f64(loss_scale))``, torch's ``inv_scale``, bit for bit
  (docs/torch_semantics.md §3.1), subnormal scales and reciprocals included.

  Args:
    loss_scale: the scale, float32 ``[]``.

  Examples:
    >>> import jax.numpy as jnp, numpy as np
    >>> scale = np.float32(1e38)
    >>> np.asarray(inverse_scale(jnp.asarray(scale))).tobytes() == np.float32(1 / np.float64(scale)).tobytes()
    True
  """
  _check_loss_scale(loss_scale)
  return inverse_parts(loss_scale)[0]


def _unscale_leaf(grad: jax.Array, parts: tuple) -> jax.Array:
  _, high, low, is_one = parts
  if grad.dtype == jnp.float64:
    product = grad * (high.astype(jnp.float64) * low.astype(jnp.float64))
  else:  # float32, and float16/bfloat16 in float32 "opmath", cast back
    product = ((grad.astype(jnp.float32) * high) * low).astype(grad.dtype)
  return jnp.where(is_one, grad, product)  # torch's inv == 1 shortcut


def unscale_and_check(grads: Any, loss_scale: jax.Array) -> tuple[Any, jax.Array]:
  """Unscales ``grads`` and reports whether they held inf or NaN.

  torch's ``_amp_foreach_non_finite_check_and_unscale_`` (docs/torch_semantics.md §3.2):
  checks the still-scaled gradients, then multiplies them all by ``inv_scale``.

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
  _check_loss_scale(loss_scale)
  check_float_gradients(grads)
  return unscale(grads, loss_scale), ~jnp.all(leaf_finite_flags(grads))


def unscale(grads: Any, loss_scale: jax.Array) -> Any:
  """``grads`` multiplied by torch's ``inv_scale`` (see :func:`unscale_and_check`)."""
  return unscale_by(grads, inverse_parts(loss_scale))


def unscale_by(grads: Any, parts: tuple[jax.Array, ...]) -> Any:
  """:func:`unscale` with :func:`inverse_parts` computed already: outside the
  ``lax.cond``, or XLA fuses their scalar arithmetic into every leaf's kernel
  (BENCHMARKS.md, "Unscale factors")."""
  return jax.tree.map(lambda g: _unscale_leaf(g, parts), grads)


def unscale_finite_by(grads: Any, parts: tuple[jax.Array, ...]) -> Any:
  """:func:`unscale_by` for finite gradients: float16 is one multiply, no select (torch's
  value for any finite ``g``, as a product XLA flushes to zero is zero in float16 too)."""
  inverse = parts[0]

  def leaf(g: jax.Array) -> jax.Array:
    if g.dtype == jnp.float16:
      return (g.astype(jnp.float32) * inverse).astype(jnp.float16)
    return _unscale_leaf(g, parts)

  return jax.tree.map(leaf, grads)


def _check_loss_scale(loss_scale: Any) -> None:
  dtype, shape = getattr(loss_scale, "dtype", None), getattr(loss_scale, "shape", ())
  is_float = dtype is not None and jnp.issubdtype(dtype, jnp.floating)
  if not (is_float or isinstance(loss_scale, float)):
    raise TypeError(
      "jaxamp: loss_scale must be a float32 scalar (the state's loss_scale), got "
      f"{type(loss_scale).__name__} {loss_scale!r}."
    )
  if shape != ():
    raise ValueError(
      f"jaxamp: loss_scale must be a float32 scalar, got an array of shape {shape}; "
      "pass the state's loss_scale."
    )


def finite_leaves(grads: Any, loss_scale: jax.Array, detect_unscale_overflow: bool) -> jax.Array:
  """Per leaf, whether ``grads`` is finite: torch's check of the still-scaled
  gradients, and with ``detect_unscale_overflow`` also of the unscaled ones
  (torch misses a bfloat16 ``3e38`` that unscaling at 0.5 makes inf)."""
  finite = leaf_finite_flags(grads)
  if detect_unscale_overflow:
    finite = finite & leaf_finite_flags(unscale(grads, loss_scale))
  return finite
