"""The loss-scale update rule of torch's ``_amp_update_scale_``, bit for bit."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

from jaxamp._hyperparams import INT32_MAX, INT32_MIN, check_factor, concrete_int
from jaxamp._torch.exact import float_bits, multiply_exact_either


def _is_nonzero(x: jax.Array) -> jax.Array:
  """``x != 0`` read from the bits, so a subnormal float counts (XLA flushes it)."""
  if not jnp.issubdtype(x.dtype, jnp.floating):
    return x != 0
  return (float_bits(x) & 0x7FFFFFFF) != 0


_ARGUMENTS = {  # name: (what it must be, accepted dtypes, accepted Python types)
  "loss_scale": ("a float32 scalar", (jnp.floating,), (int, float)),
  "growth_tracker": ("an int32 scalar", (jnp.integer,), (int,)),
  "found_inf": ("a bool scalar", (jnp.bool_, jnp.number), (bool, int, float)),
}


_FIX = {
  "loss_scale": "pass the state's loss_scale, one number for all gradients",
  "growth_tracker": "pass the state's growth_tracker",
  "found_inf": "reduce the per-leaf flags to one with jnp.any",
}


def _check_arguments(**values: object) -> None:
  """Raises for a state argument that would be converted silently (a float tracker)."""
  for name, value in values.items():
    expected, dtypes, python_types = _ARGUMENTS[name]
    dtype = getattr(value, "dtype", None)
    if dtype is None:
      ok = isinstance(value, python_types) and (name == "found_inf" or not isinstance(value, bool))
    else:
      ok = any(jnp.issubdtype(dtype, kind) for kind in dtypes) and (
        name == "found_inf" or not jnp.issubdtype(dtype, jnp.bool_)
      )
    if not ok:
      kind = f"dtype {dtype}" if dtype is not None else f"{type(value).__name__} {value!r}"
      raise TypeError(
        f"jaxamp: update_loss_scale's {name} must be {expected}, got {kind} "
        "(it would be converted silently); pass the state's own array."
      )
    shape = getattr(value, "shape", ())  # a Python number has none
    if shape != ():
      raise ValueError(
        f"jaxamp: update_loss_scale's {name} must be {expected} (shape ()), got shape "
        f"{shape}; {_FIX[name]}."
      )


def update_loss_scale(
  loss_scale: jax.Array,
  growth_tracker: jax.Array,
  found_inf: jax.Array,
  *,
  growth_factor: float | jax.Array = 2.0,
  backoff_factor: float | jax.Array = 0.5,
  growth_interval: int | jax.Array = 2000,
) -> tuple[jax.Array, jax.Array]:
  """Returns the new ``(loss_scale, growth_tracker)`` after one update.

  Exactly torch's ``_amp_update_scale_`` (docs/torch_semantics.md §3.3, in pseudo-code):
  a found inf/NaN multiplies the scale by ``backoff_factor``, with no floor; the
  ``growth_interval``-th finite update in a row (the int32 tracker wraps) by
  ``growth_factor``, unless the product overflows; either resets the tracker. The
  products are rounded as torch's, also in JAX's 32-bit mode; an interval <= 0 never grows.

  Args:
    loss_scale: the current scale, float32 ``[]``.
    growth_tracker: consecutive finite updates so far, int32 ``[]``.
    found_inf: whether this step saw inf or NaN (bool, or a float where any
      non-zero value counts as found, as in torch).
    growth_factor: multiplies the scale on the ``growth_interval``-th
      consecutive finite update. Python numbers are used exactly as float64.
    backoff_factor: multiplies the scale on every update that found inf/NaN.
    growth_interval: how many consecutive finite updates grow the scale.

  Returns:
    The new float32 scale and int32 growth tracker.

  Examples:
    >>> import jax.numpy as jnp
    >>> scale, tracker = update_loss_scale(
    ...     jnp.float32(3.0), jnp.int32(0), jnp.bool_(True), backoff_factor=0.3)
    >>> float(scale), int(tracker)
    (0.8999999761581421, 0)
  """
  _check_arguments(loss_scale=loss_scale, growth_tracker=growth_tracker, found_inf=found_inf)
  check_factor("growth_factor", growth_factor)
  check_factor("backoff_factor", backoff_factor)
  concrete_int("growth_interval", growth_interval, None)
  loss_scale = jnp.asarray(loss_scale, jnp.float32)
  growth_tracker = jnp.asarray(growth_tracker, jnp.int32)
  found = _is_nonzero(jnp.asarray(found_inf))
  successful = growth_tracker + jnp.int32(1)  # wraps like torch's int32
  if isinstance(growth_interval, numbers.Integral) and not (
    INT32_MIN <= growth_interval <= INT32_MAX
  ):
    reaches_interval = jnp.zeros([], bool)  # an int32 tracker never equals it
  else:
    reaches_interval = successful == jnp.asarray(growth_interval).astype(jnp.int32)
  grow = ~found & reaches_interval
  product = multiply_exact_either(loss_scale, found, backoff_factor, growth_factor)
  new_scale = jnp.where(
    found, product, jnp.where(grow & jnp.isfinite(product), product, loss_scale)
  )
  new_tracker = jnp.where(found | grow, jnp.int32(0), successful)
  return new_scale, new_tracker
