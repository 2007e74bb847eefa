"""Multiplying a loss by the loss scale, with the dtype torch's ``scaler.scale`` gives."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def multiply_by_scale(value: Any, scale: jax.Array) -> jax.Array:
  """``value * scale`` for a float32 ``[]`` scale, in torch's result dtype.

  float64 is multiplied in float64 and complex in its own dtype; a 0-dim
  floating, integer or bool value gives float32 (so a float16 loss times 65536
  is 131072, not inf); a >=1-dim float16/bfloat16/float32 array keeps its
  dtype, multiplied in float32 and rounded once (torch's "opmath").

  Examples:
    >>> import jax.numpy as jnp
    >>> multiply_by_scale(jnp.float16(2.0), jnp.float32(65536.0))
    Array(131072., dtype=float32)
  """
  value = jnp.asarray(value)
  dtype = value.dtype
  if dtype == jnp.float64:
    return value * scale.astype(jnp.float64)
  if jnp.issubdtype(dtype, jnp.complexfloating):
    return value * scale.astype(dtype)
  if jnp.issubdtype(dtype, jnp.floating) and value.ndim > 0:
    return (value.astype(jnp.float32) * scale).astype(dtype)
  return value.astype(jnp.float32) * scale
