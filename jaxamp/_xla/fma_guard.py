"""Values kept rounded as torch materialises them, where XLA would contract an
FMA or skip a bfloat16 rounding.

XLA CPU contracts ``a * b + c`` into an FMA where torch materialises ``a * b``; the
guard XORs each value's bits with an int zero XLA cannot prove is zero, at no memory pass.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._xla.platform import map_by_platform

_BITS = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}


def _runtime_zero(loss_scale: jax.Array) -> jax.Array:
  """``isnan(loss_scale)`` as an int32: one only for a NaN scale (all-NaN gradients anyway)."""
  return jnp.isnan(jnp.asarray(loss_scale)).astype(jnp.int32)


@jax.custom_jvp
def xor_bits(x: jax.Array, zero: jax.Array) -> jax.Array:
  """``x`` with its bits XOR-ed with the int ``zero``: a value XLA cannot prove unchanged."""
  bits = _BITS[x.dtype.itemsize]
  return lax.bitcast_convert_type(lax.bitcast_convert_type(x, bits) ^ zero.astype(bits), x.dtype)


@xor_bits.defjvp
def _xor_jvp(primals, tangents):
  # The XOR is the identity on values, so it is on tangents (a bitcast has none).
  x, zero = primals
  return xor_bits(x, zero), tangents[0]


def _is_half(x: jax.Array) -> bool:
  return x.dtype in (jnp.float16, jnp.bfloat16)


def _guard(tree: Any, zero: jax.Array, *, halves_rounded_on_cpu: bool) -> Any:
  def xor(x):
    return x if x is None else xor_bits(x, zero)

  if not halves_rounded_on_cpu:
    return jax.tree.map(xor, tree)
  # A float16/bfloat16 unscaled gradient comes out of a narrowing convert,
  # which no XLA CPU pass removes, so it is rounded already there; XLA GPU's
  # simplify-fp-conversions may drop such a convert pair, so it keeps the guard.
  guarded = jax.tree.map(lambda x: x if _is_half(x) else xor(x), tree)
  return map_by_platform(guarded, _is_half, cpu=lambda x: x, default=xor)


def rounded_unscaled(unscaled: Any, loss_scale: jax.Array) -> Any:
  """``unscaled`` (the unscaled gradients), each value as torch materialises it."""
  return _guard(unscaled, _runtime_zero(loss_scale), halves_rounded_on_cpu=True)


def rounded_updates(updates: Any, loss_scale: jax.Array) -> Any:
  """``updates``, each value as ``optax.apply_updates`` reads it from memory."""
  # A zero other than rounded_unscaled's, so that XLA cannot cancel the two
  # XORs of an identity optimizer, (b ^ z) ^ z = b.
  return _guard(updates, _runtime_zero(loss_scale) * 2, halves_rounded_on_cpu=False)


def kept_bfloat16(converted: jax.Array, source: Any) -> jax.Array:
  """``converted`` (a ``source`` value widened) kept rounded to bfloat16, which XLA may
  skip (BENCHMARKS.md, "autocast"); float16 as it is (its subnormals would flush)."""
  wider = jnp.issubdtype(converted.dtype, jnp.floating) and converted.dtype.itemsize > 2
  if np.dtype(source) != jnp.bfloat16 or not wider:
    return converted
  return lax.reduce_precision(converted, exponent_bits=8, mantissa_bits=7)
