"""Exact float32 arithmetic that torch does in float64: ``f32(f64(x) * factor)``.

Significands multiplied in 12-bit int32 limbs, rounded twice as torch; a power-of-two
factor takes a shorter path (docs/torch_semantics.md §3.3 says why).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_LIMB_BITS = 12
_LIMB_MASK = (1 << _LIMB_BITS) - 1
_PRODUCT_LIMBS = 8  # 2 limbs (f32 significand) x 5 limbs (f64 significand) + carry
_PRODUCT_BITS = _PRODUCT_LIMBS * _LIMB_BITS


def float_bits(x) -> jax.Array:
  """The int32 bits of float32 ``x``, XOR-ed with ``isnan(x)`` so that LLVM cannot turn
  integer tests into float compares (wrong for subnormals); test NaN with ``jnp.isnan``."""
  x = jnp.asarray(x, jnp.float32)
  return lax.bitcast_convert_type(x, jnp.int32) ^ jnp.isnan(x).astype(jnp.int32)


class _Unpacked:
  """A float as ``(-1)**sign * significand * 2**exponent``, plus its class."""

  def __init__(self, sign, limbs, exponent, is_inf, is_nan):
    self.sign, self.limbs, self.exponent = sign, limbs, exponent
    self.is_inf, self.is_nan = is_inf, is_nan

  @property
  def is_zero(self):
    nonzero = self.limbs[0] != 0
    for limb in self.limbs[1:]:
      nonzero = nonzero | (limb != 0)
    return ~nonzero & ~self.is_inf & ~self.is_nan


def _unpack_f32(x) -> _Unpacked:
  bits = float_bits(x)
  biased = (bits >> 23) & 0xFF
  fraction = bits & 0x7FFFFF
  significand = jnp.where(biased == 0, fraction, fraction | 0x800000)
  limbs = [significand & _LIMB_MASK, significand >> _LIMB_BITS]
  exponent = jnp.maximum(biased, 1) - 150
  x = jnp.asarray(x, jnp.float32)  # inf and NaN by float tests (see float_bits)
  return _Unpacked(bits < 0, limbs, exponent, jnp.isinf(x), jnp.isnan(x))


def _unpack_f64_words(hi, lo) -> _Unpacked:
  """Unpacks a float64 given as its high and low 32-bit words (int32)."""
  biased = (hi >> 20) & 0x7FF
  hi_fraction = hi & 0xFFFFF
  hi_significand = jnp.where(biased == 0, hi_fraction, hi_fraction | 0x100000)
  lo = lax.bitcast_convert_type(lo, jnp.uint32)
  lo_bits = lambda shift: lax.bitcast_convert_type(lo >> shift, jnp.int32)
  limbs = [
    lo_bits(0) & _LIMB_MASK,
    lo_bits(12) & _LIMB_MASK,
    (lo_bits(24) | (hi_significand << 8)) & _LIMB_MASK,
    (hi_significand >> 4) & _LIMB_MASK,
    hi_significand >> 16,
  ]
  exponent = jnp.maximum(biased, 1) - 1075
  special = biased == 0x7FF
  fraction_nonzero = (hi_fraction != 0) | (lo != 0)
  return _Unpacked(hi < 0, limbs, exponent, special & ~fraction_nonzero, special & fraction_nonzero)


def _unpack_factor(factor) -> _Unpacked:
  """Unpacks a Python number (exactly, as float64) or a JAX/NumPy scalar."""
  if isinstance(factor, (int, float, np.floating, np.integer)):
    word = int(np.float64(factor).view(np.uint64))
    to_i32 = lambda w: jnp.asarray(np.uint32(w).view(np.int32))
    return _unpack_f64_words(to_i32(word >> 32), to_i32(word & 0xFFFFFFFF))
  factor = jnp.asarray(factor)
  if factor.dtype == jnp.float64:
    words = lax.bitcast_convert_type(factor, jnp.int32)  # [low, high] word order
    return _unpack_f64_words(words[1], words[0])
  return _unpack_f32(factor.astype(jnp.float32))


def _product_bits(a: list, b: list):
  """The bits of the exact product of two limb-encoded integers, LSB first."""
  columns = [jnp.zeros([], jnp.int32)] * _PRODUCT_LIMBS
  for i, x in enumerate(a):
    for j, y in enumerate(b):
      columns[i + j] = columns[i + j] + x * y  # each term < 2**24
  return _limbs_to_bits(_add_limbs(columns, [jnp.zeros([], jnp.int32)] * _PRODUCT_LIMBS))


def _limbs_to_bits(limbs):
  positions = jnp.arange(_LIMB_BITS, dtype=jnp.int32)
  return ((jnp.stack(limbs)[:, None] >> positions) & 1).reshape(-1)


def _bits_to_limbs(bits):
  positions = jnp.arange(_LIMB_BITS, dtype=jnp.int32)
  return list(
    jnp.sum(bits.reshape(_PRODUCT_LIMBS, _LIMB_BITS) << positions, axis=1, dtype=jnp.int32)
  )


def _add_limbs(a: list, b: list) -> list:
  limbs, carry = [], jnp.zeros([], jnp.int32)
  for x, y in zip(a, b):
    total = x + y + carry
    limbs.append(total & _LIMB_MASK)
    carry = total >> _LIMB_BITS
  return limbs


def _lsb_shift(bits, exponent, precision, min_exponent):
  """Index of the lowest bit kept at ``precision`` bits, LSB >= 2**min_exponent."""
  bit_length = jnp.max(jnp.where(bits != 0, jnp.arange(_PRODUCT_BITS, dtype=jnp.int32) + 1, 0))
  return jnp.maximum(bit_length - precision, min_exponent - exponent)


def _round_nearest_even(bits, exponent, precision, min_exponent):
  """Rounds ``sum(bits[i] * 2**(i + exponent))`` to ``precision`` bits, none below
  ``2**min_exponent``, on the same grid; overflow is left to the caller."""
  index = jnp.arange(_PRODUCT_BITS, dtype=jnp.int32)
  shift = _lsb_shift(bits, exponent, precision, min_exponent)
  round_bit = jnp.sum(jnp.where(index == shift - 1, bits, 0), dtype=jnp.int32)
  sticky = jnp.any((bits != 0) & (index < shift - 1)).astype(jnp.int32)
  lsb = jnp.sum(jnp.where(index == shift, bits, 0), dtype=jnp.int32)
  increment = jnp.where(index == shift, round_bit & (sticky | lsb), 0)
  truncated = jnp.where(index >= shift, bits, 0)
  return _limbs_to_bits(_add_limbs(_bits_to_limbs(truncated), _bits_to_limbs(increment)))


def _pack_f32_bits(bits, exponent):
  """Float32 bits (sign 0) of a value that float32 represents, or of inf."""
  index = jnp.arange(_PRODUCT_BITS, dtype=jnp.int32)
  shift = _lsb_shift(bits, exponent, 24, -149)
  significand = jnp.sum(
    jnp.where(index >= shift, bits << jnp.clip(index - shift, 0, 24), 0), dtype=jnp.int32
  )
  lsb_exponent = shift + exponent
  biased = jnp.where(significand >= (1 << 23), lsb_exponent + 150, 0)
  finite_bits = (biased << 23) | (significand & 0x7FFFFF)
  return jnp.where(biased >= 0xFF, 0x7F800000, finite_bits)


def _power_of_two_exponent(factor) -> int | None:
  """``k`` where ``factor`` is a Python (or NumPy) number equal to ``2.0**k``, else None."""
  if not isinstance(factor, (int, float, np.floating, np.integer)) or isinstance(factor, bool):
    return None
  value = np.float64(factor)
  if not (np.isfinite(value) and value > 0):
    return None
  fraction, exponent = np.frexp(value)
  return int(exponent) - 1 if fraction == 0.5 else None


def _times_power_of_two(x, k):
  """``f32(f64(x) * 2.0**k)`` for an int32 ``k``, from the bits of ``x``; zero/inf/NaN pass."""
  a = _unpack_f32(x)
  significand = a.limbs[0] | (a.limbs[1] << _LIMB_BITS)
  exponent = a.exponent + k  # x * 2**k == significand * 2**exponent
  top = 31 - lax.clz(significand)  # the significand's highest set bit
  normal_bits = ((top + exponent + 127) << 23) | ((significand << (23 - top)) & 0x7FFFFF)
  shift = jnp.clip(-149 - exponent, -31, 31)  # to units of 2**-149
  right = jnp.maximum(shift, 1)
  kept, rest, half = significand >> right, significand & ((1 << right) - 1), 1 << (right - 1)
  rounded = kept + ((rest > half) | ((rest == half) & ((kept & 1) == 1))).astype(jnp.int32)
  subnormal_bits = jnp.where(shift > 0, rounded, significand << jnp.maximum(-shift, 0))
  magnitude_bits = jnp.where(
    top + exponent > 127,
    0x7F800000,
    jnp.where(top + exponent >= -126, normal_bits, subnormal_bits),
  )
  product = lax.bitcast_convert_type(magnitude_bits | (a.sign.astype(jnp.int32) << 31), jnp.float32)
  return jnp.where(a.is_inf | a.is_nan | a.is_zero, jnp.asarray(x, jnp.float32), product)


def multiply_exact(x, factor):
  """Returns ``f32(f64(x) * f64(factor))``, rounded as torch rounds it (to float64, then float32).

  Args:
    x: a float32 scalar (the loss scale).
    factor: a Python number (used exactly, as a float64), or a float scalar
      array of any dtype (used with its own value, e.g. a traced
      hyperparameter from ``optax.inject_hyperparams``).

  Returns:
    A float32 scalar, bit-equal to torch's result, subnormal results included.

  Examples:
    >>> import jax.numpy as jnp
    >>> float(multiply_exact(jnp.float32(3.0), 0.3))  # pure float32 gives 0.9000000357627869
    0.8999999761581421
  """
  k = _power_of_two_exponent(factor)
  if k is not None:
    return _times_power_of_two(x, jnp.int32(k))
  return _multiply(x, _unpack_factor(factor))


def multiply_exact_either(x, use_first, first, second):
  """``multiply_exact(x, first if use_first else second)``, selecting the operand
  before the long exact multiplication, so that a program holds one copy of it."""
  powers = _power_of_two_exponent(first), _power_of_two_exponent(second)
  if None not in powers:
    return _times_power_of_two(x, jnp.where(use_first, *map(jnp.int32, powers)))
  a, b = _unpack_factor(first), _unpack_factor(second)
  pick = lambda u, v: jnp.where(use_first, u, v)
  chosen = _Unpacked(
    pick(a.sign, b.sign),
    [pick(u, v) for u, v in zip(a.limbs + [0] * 3, b.limbs + [0] * 3)][:5],
    pick(a.exponent, b.exponent),
    pick(a.is_inf, b.is_inf),
    pick(a.is_nan, b.is_nan),
  )
  return _multiply(x, chosen)


def multiply_by_f64_words(x, hi, lo):
  """``multiply_exact`` with a float64 factor as int32 high/low words (vectorisable)."""
  return _multiply(x, _unpack_f64_words(hi, lo))


def _multiply(x, b: _Unpacked):
  a = _unpack_f32(x)
  exponent = a.exponent + b.exponent
  bits = _product_bits(a.limbs, b.limbs)
  # torch rounds twice: the float64 product, then the cast to float32.
  bits = _round_nearest_even(bits, exponent, 53, -1074)
  bits = _round_nearest_even(bits, exponent, 24, -149)
  magnitude_bits = _pack_f32_bits(bits, exponent)
  sign = (a.sign ^ b.sign).astype(jnp.int32) << 31
  result = lax.bitcast_convert_type(magnitude_bits | sign, jnp.float32)
  inf = jnp.where(a.sign ^ b.sign, -jnp.inf, jnp.inf).astype(jnp.float32)
  result = jnp.where(a.is_inf | b.is_inf, inf, result)
  invalid = (a.is_inf & b.is_zero) | (a.is_zero & b.is_inf) | b.is_nan
  result = jnp.where(invalid, jnp.float32(jnp.nan), result)
  return jnp.where(a.is_nan, jnp.asarray(x, jnp.float32), result)
