"""One hyperparameter's value, checked when concrete (traced ones cannot be, and pass)."""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FLT_MAX = float(np.finfo(np.float32).max)
FLT_MIN_NORMAL = float(np.finfo(np.float32).tiny)
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
FLOAT_OVERFLOW_MESSAGE = "value cannot be converted to type float without overflow"


def is_array(value: Any) -> bool:
  return isinstance(value, (jax.Array, np.ndarray))


def _concrete(name: str, value: Any, *, integer: bool) -> Any:
  """A Python number for a number or concrete array scalar; None when traced."""
  dtype = getattr(value, "dtype", None)
  dtype = None if dtype is None else jnp.dtype(dtype)
  if integer and dtype is not None and not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"jaxamp: {name} must be an int, got an array of dtype {dtype}.")
  if dtype in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
    raise TypeError(
      f"jaxamp: {name} arrived as {dtype.name}, which cannot hold loss-scale "
      "values exactly (float16(65536) is inf). With optax.inject_hyperparams and "
      "low-precision params, pass hyperparam_dtype=jnp.float32."
    )
  if isinstance(value, jax.core.Tracer):
    return None
  if isinstance(value, np.generic):
    return value.item()
  if not is_array(value):
    return value
  if value.shape != ():
    raise ValueError(
      f"jaxamp: a hyperparameter must be a scalar, got an array of shape {value.shape}."
    )
  return np.asarray(value).item()


def python_number(name: str, value: Any, *, integer: bool = False) -> int | float:
  """``value`` as a Python number (NumPy scalars converted), else a TypeError."""
  kind = numbers.Integral if integer else numbers.Real
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, kind):
    hint = (
      " GradScaler keeps its hyperparameters as static Python numbers." if is_array(value) else ""
    )
    raise TypeError(
      f"jaxamp: {name} must be {'an int' if integer else 'a real Python number'}, "
      f"got {type(value).__name__} {value!r}.{hint}"
    )
  return value.item() if isinstance(value, np.generic) else value  # type: ignore[return-value]


def concrete_real(name: str, value: Any) -> float | None:
  """The concrete value of a real hyperparameter (None when traced)."""
  concrete = _concrete(name, value, integer=False)
  if concrete is None:
    return None
  if isinstance(concrete, bool) or not isinstance(concrete, numbers.Real):
    raise TypeError(
      f"jaxamp: {name} must be a real Python number, got {type(value).__name__} {value!r}."
    )
  try:
    return float(concrete)
  except OverflowError:  # an int beyond any float
    raise ValueError(
      f"{FLOAT_OVERFLOW_MESSAGE} (jaxamp: {name} is an int of {len(str(abs(concrete)))} "
      "digits, beyond the float range; pass a finite float32 number)"
    ) from None


def concrete_int(name: str, value: Any, minimum: int | None) -> int | None:
  """The concrete value of an int hyperparameter (None when traced), range-checked."""
  concrete = _concrete(name, value, integer=True)
  if concrete is None:
    return None
  if isinstance(concrete, bool) or not isinstance(concrete, numbers.Integral):
    raise TypeError(f"jaxamp: {name} must be an int, got {type(value).__name__} {value!r}.")
  concrete = int(concrete)
  if minimum is not None and concrete < minimum:
    raise ValueError(f"jaxamp: {name} must be >= {minimum}, got {concrete!r}.")
  # An int32 counter must reach it; an int32 array must hold it (a Python int
  # interval beyond int32 is torch's "never grows").
  too_big = concrete > INT32_MAX and (minimum is not None or is_array(value))
  if too_big or (concrete < INT32_MIN and is_array(value)):
    raise ValueError(
      f"jaxamp: {name}={concrete!r} does not fit the int32 counters; use at most {INT32_MAX}."
    )
  return concrete


def check_factor(name: str, value: Any) -> None:
  """A factor given to ``update_loss_scale``: a real scalar, range unchecked as torch."""
  if isinstance(value, (str, bytes, complex)) or value is None:
    raise TypeError(
      f"jaxamp: {name} must be a real Python number, got {type(value).__name__} {value!r}."
    )
  if is_array(value) and value.shape != ():
    raise ValueError(
      f"jaxamp: {name} must be a scalar, got an array of shape {value.shape}; pass one number."
    )
  dtype = getattr(value, "dtype", None)
  real = dtype is None or jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
  if not real or (dtype is not None and jnp.issubdtype(dtype, jnp.bool_)):
    raise TypeError(f"jaxamp: {name} must be a real number, got an array of dtype {dtype}.")
  concrete_real(name, value)


def check_scale(name: str, value: Any) -> float | None:
  """A loss scale: finite, positive and nonzero in float32 (None when traced)."""
  if value is None:
    raise TypeError(f"jaxamp: {name} must be a finite positive number, got None.")
  scale = concrete_real(name, value)
  if scale is None:
    return None
  if math.isfinite(scale) and abs(scale) > FLT_MAX:
    raise ValueError(
      f"{FLOAT_OVERFLOW_MESSAGE} (jaxamp: {name}={scale!r} is larger than the float32 maximum)"
    )
  rounded = float(np.float32(scale))
  if not (math.isfinite(rounded) and rounded > 0.0):
    raise ValueError(
      f"jaxamp: {name} must be a finite positive number representable in float32, "
      f"got {scale!r} (float32: {rounded!r})."
    )
  return scale


def check_bound(name: str, value: Any) -> float | None:
  bound = concrete_real(name, value)
  if bound is not None and not (0 < bound <= FLT_MAX and np.float32(bound) >= FLT_MIN_NORMAL):
    raise ValueError(
      f"jaxamp: {name} must be a finite positive float32 number of at least "
      f"{FLT_MIN_NORMAL!r} (XLA flushes smaller ones to zero), got {bound!r}."
    )
  return bound


def check_axis_name(axis_name: Any) -> None:
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  if axis_name is not None and not (names and all(isinstance(n, str) for n in names)):
    raise TypeError(
      f"jaxamp: axis_name must be a mesh axis name (a str) or a tuple of them, got {axis_name!r}."
    )


def check_flag(name: str, value: Any) -> None:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"jaxamp: {name} must be True or False, got {value!r}.")


def check_new_scale(new_scale: Any) -> jax.Array:
  """``GradScaler.update(new_scale=...)``: a finite positive scalar float, as float32."""
  if isinstance(new_scale, (bool, np.bool_, numbers.Integral)):
    raise TypeError(
      "jaxamp: new_scale must be a float or a 0-dim floating-point array, got "
      f"{type(new_scale).__name__} {new_scale!r} (torch raises AttributeError "
      "here); write it as a float, e.g. 2.0. The scaler is unchanged."
    )
  if isinstance(new_scale, numbers.Real):
    value = float(new_scale)
  elif is_array(new_scale) or isinstance(new_scale, np.generic):
    array = new_scale if isinstance(new_scale, jax.Array) else np.asarray(new_scale)
    if array.shape != () or not jnp.issubdtype(array.dtype, jnp.floating):
      raise ValueError(
        "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
        "torch.FloatTensor with requires_grad=False. (jaxamp: got an array of "
        f"shape {array.shape} and dtype {array.dtype}; pass a 0-dim float array. "
        "The scaler is unchanged.)"
      )
    if isinstance(array, jax.core.Tracer):
      return array.astype(jnp.float32)  # traced: cannot be checked here
    value = float(np.asarray(array))
  else:
    raise TypeError(
      "jaxamp: new_scale must be a float or a 0-dim floating-point array, got "
      f"{type(new_scale).__name__}. The scaler is unchanged."
    )
  if math.isfinite(value) and abs(value) > FLT_MAX:
    raise RuntimeError(
      f"{FLOAT_OVERFLOW_MESSAGE} (jaxamp: new_scale={value!r}; the scaler is unchanged)"
    )
  if not (math.isfinite(value) and np.float32(value) > 0):
    raise ValueError(
      f"jaxamp: new_scale must be finite and positive in float32, got {value!r} "
      "(torch accepts it, and then skips or zeroes every later step). The scaler "
      "is unchanged."
    )
  return jnp.asarray(np.float32(value))
