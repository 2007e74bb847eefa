"""torch's ``GradScaler.state_dict`` format, read and written for jaxamp states.

torch saves five plain Python values, in this order (SPEC 1.9)::

  {"scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5,
   "growth_interval": 2000, "_growth_tracker": 0}

:func:`state_dict` and :func:`load_state_dict` convert between that dict and the
:class:`~jaxamp.DynamicLossScaleState` inside an optax state, so a run can move
between torch and JAX (in both directions) and continue bit for bit.
``jaxamp.GradScaler`` uses the same format and the same checks.

Deliberate differences from torch's ``load_state_dict``: the dict is checked
completely before anything is applied (torch applies keys one by one and can
stop half way), extra keys are an error (torch ignores them), values must be
Python or NumPy numbers of the right kind, and a scale beyond the float32 range
or a tracker beyond the int32 range is rejected at load time (torch fails at
load or at the next ``scale()``, with the same messages).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._state_access import _array, _opt_state_of, find_loss_scale_state
from jaxamp._transform import DynamicLossScaleState
from jaxamp._validation import FLT_MAX, INT32_MAX, INT32_MIN

STATE_DICT_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

EMPTY_STATE_DICT_MESSAGE = (
  "The source state dict is empty, possibly because it was saved from a "
  "disabled instance of GradScaler."
)
FLOAT_OVERFLOW_MESSAGE = "value cannot be converted to type float without overflow"
INT_OVERFLOW_MESSAGE = "value cannot be converted to type int without overflow"


def _plain(value: Any) -> Any:
  """A NumPy scalar as the Python number it holds; anything else unchanged."""
  return value.item() if isinstance(value, np.generic) else value


def _real(key: str, value: Any) -> float | int:
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
    raise TypeError(
      f"jaxamp: state dict entry {key!r} must be a real Python number, got "
      f"{type(value).__name__} {value!r}; nothing was loaded."
    )
  return _plain(value)


def _integer(key: str, value: Any, low: int, high: int, message: str) -> int:
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
    raise TypeError(
      f"jaxamp: state dict entry {key!r} must be an int, got "
      f"{type(value).__name__} {value!r}; nothing was loaded."
    )
  value = int(value)
  if not low <= value <= high:
    raise RuntimeError(f"{message} (jaxamp: {key}={value}; nothing was loaded)")
  return value


def check_state_dict(state_dict: Any) -> dict[str, Any]:
  """Validates a torch-format state dict and returns it with plain Python values.

  Raises:
    TypeError: ``state_dict`` is not a mapping, or a value has the wrong type.
    RuntimeError: the dict is empty (torch's message), the scale is a finite
      number beyond the float32 range, or the tracker is beyond int32.
    KeyError: a key is missing. ValueError: there are unexpected keys.
  """
  if not isinstance(state_dict, Mapping):
    raise TypeError(f"jaxamp: a state dict must be a mapping, got {type(state_dict).__name__}.")
  if len(state_dict) == 0:
    raise RuntimeError(EMPTY_STATE_DICT_MESSAGE)
  missing = [key for key in STATE_DICT_KEYS if key not in state_dict]
  if missing:
    raise KeyError(
      f"{missing[0]} (jaxamp: the state dict lacks {missing}; expected the keys "
      f"{list(STATE_DICT_KEYS)}; nothing was loaded)"
    )
  extra = [key for key in state_dict if key not in STATE_DICT_KEYS]
  if extra:
    raise ValueError(
      f"jaxamp: unexpected state dict keys {extra}; expected exactly "
      f"{list(STATE_DICT_KEYS)}; nothing was loaded."
    )
  scale = _real("scale", state_dict["scale"])
  if math.isfinite(scale) and abs(scale) > FLT_MAX:
    raise RuntimeError(
      f"{FLOAT_OVERFLOW_MESSAGE} (jaxamp: scale={scale!r} is beyond the float32 "
      "range; nothing was loaded)"
    )
  return {
    "scale": scale,
    "growth_factor": _real("growth_factor", state_dict["growth_factor"]),
    "backoff_factor": _real("backoff_factor", state_dict["backoff_factor"]),
    "growth_interval": _integer(
      "growth_interval",
      state_dict["growth_interval"],
      _INT64_MIN,
      _INT64_MAX,
      "value cannot be converted to type int64_t without overflow",
    ),
    "_growth_tracker": _integer(
      "_growth_tracker",
      state_dict["_growth_tracker"],
      INT32_MIN,
      INT32_MAX,
      INT_OVERFLOW_MESSAGE,
    ),
  }


def scale_array(scale: float) -> jax.Array:
  """``float32(scale)`` rounded to nearest, as torch's ``fill_`` (checked range)."""
  return jnp.asarray(np.float32(scale))


def tracker_array(tracker: int) -> jax.Array:
  return jnp.asarray(np.int32(tracker))


def state_dict(
  opt_state: Any,
  *,
  growth_factor: float = 2.0,
  backoff_factor: float = 0.5,
  growth_interval: int = 2000,
) -> dict[str, Any]:
  """The loss-scale state of ``opt_state`` as torch's ``GradScaler.state_dict()``.

  The optax state holds the scale and the growth tracker; the hyperparameters
  live in the transformation, so pass the ones given to
  :func:`~jaxamp.dynamic_loss_scale` (the defaults are the same). The result
  loads into ``torch.amp.GradScaler.load_state_dict`` and continues the run bit
  for bit. It reads the arrays on the host: call it outside ``jit``.

  Args:
    opt_state: an optimizer state holding one ``DynamicLossScaleState``
      (or an object with ``.opt_state``, e.g. a ``flax.nnx.Optimizer``).
    growth_factor: the value given to ``dynamic_loss_scale``.
    backoff_factor: the value given to ``dynamic_loss_scale``.
    growth_interval: the value given to ``dynamic_loss_scale``.

  Returns:
    ``{"scale": float, "growth_factor": ..., "backoff_factor": ...,
    "growth_interval": int, "_growth_tracker": int}``, in torch's key order.

  Examples:
    >>> import optax, jax.numpy as jnp, jaxamp
    >>> tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=3.0)
    >>> jaxamp.state_dict(tx.init({"w": jnp.ones(2)}))
    {'scale': 3.0, 'growth_factor': 2.0, 'backoff_factor': 0.5, 'growth_interval': 2000, '_growth_tracker': 0}
  """
  loss_scale_state = find_loss_scale_state(opt_state)
  return {
    "scale": float(_array(loss_scale_state.loss_scale)),
    "growth_factor": _plain(growth_factor),
    "backoff_factor": _plain(backoff_factor),
    "growth_interval": _plain(growth_interval),
    "_growth_tracker": int(_array(loss_scale_state.growth_tracker)),
  }


def _with_value(field: Any, value: jax.Array) -> Any:
  """``value`` in the container type of ``field`` (a bare array or an nnx variable)."""
  if isinstance(field, (jax.Array, np.ndarray, np.generic)):
    return value
  return jax.tree.map(lambda _: value, field)


def _is_loss_scale_state(x: Any) -> bool:
  return isinstance(x, DynamicLossScaleState)


def load_state_dict(
  opt_state: Any,
  state_dict: Mapping[str, Any],
  *,
  growth_factor: float | None = None,
  backoff_factor: float | None = None,
  growth_interval: int | None = None,
) -> Any:
  """Returns ``opt_state`` with the scale and growth tracker of ``state_dict``.

  ``state_dict`` is one saved by torch's ``GradScaler.state_dict()`` (also after
  ``torch.save``/``torch.load``) or by :func:`state_dict`. The scale is rounded
  to float32 as torch's ``fill_`` does; every other part of ``opt_state``
  (inner optimizer state, skip counters) is kept. The tree keeps its structure
  and container types: the fields of an ``nnx.Optimizer``'s state stay ``nnx``
  variables (``optimizer.opt_state = jaxamp.load_state_dict(optimizer.opt_state, sd)``).

  The hyperparameters cannot be changed inside an optax transformation: build
  ``dynamic_loss_scale`` with the saved ones. Pass them here as well to have
  them checked against the dict.

  Args:
    opt_state: an optimizer state holding one ``DynamicLossScaleState``.
    state_dict: torch's five keys (SPEC 1.9).
    growth_factor: if given, must equal the dict's value.
    backoff_factor: if given, must equal the dict's value.
    growth_interval: if given, must equal the dict's value.

  Returns:
    A new optimizer state of the same structure.

  Raises:
    TypeError, KeyError, ValueError, RuntimeError: a bad state dict (see
      ``check_state_dict``) or a hyperparameter mismatch; nothing is loaded.

  Examples:
    >>> import optax, jax.numpy as jnp, jaxamp
    >>> state = jaxamp.dynamic_loss_scale(optax.sgd(0.1)).init({"w": jnp.ones(2)})
    >>> state = jaxamp.load_state_dict(state, {"scale": 0.1, "growth_factor": 2.0,
    ...     "backoff_factor": 0.5, "growth_interval": 2000, "_growth_tracker": 7})
    >>> float(state.loss_scale), int(state.growth_tracker)
    (0.10000000149011612, 7)
  """
  checked = check_state_dict(state_dict)
  for name, expected in (
    ("growth_factor", growth_factor),
    ("backoff_factor", backoff_factor),
    ("growth_interval", growth_interval),
  ):
    if expected is not None and _plain(expected) != checked[name]:
      raise ValueError(
        f"jaxamp: the state dict has {name}={checked[name]!r} but the optimizer "
        f"was built with {expected!r}; build dynamic_loss_scale with the saved "
        "hyperparameters. Nothing was loaded."
      )
  if _opt_state_of(opt_state) is not opt_state:
    raise TypeError(
      "jaxamp.load_state_dict takes the optimizer state itself (e.g. "
      "optimizer.opt_state) and returns a new one."
    )
  find_loss_scale_state(opt_state)  # exactly one, or a clear error
  scale = scale_array(checked["scale"])
  tracker = tracker_array(checked["_growth_tracker"])

  def replace(node: Any) -> Any:
    if not _is_loss_scale_state(node):
      return node
    return node._replace(
      loss_scale=_with_value(node.loss_scale, scale),
      growth_tracker=_with_value(node.growth_tracker, tracker),
    )

  return jax.tree.map(replace, opt_state, is_leaf=_is_loss_scale_state)
