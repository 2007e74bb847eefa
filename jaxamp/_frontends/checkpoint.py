"""torch's ``GradScaler.state_dict`` format for jaxamp states (docs/torch_semantics.md §1.9)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxamp._config import INJECTED
from jaxamp._frontends.state_access import (
  field_array,
  find_loss_scale_state,
  is_loss_scale_state,
  opt_state_of,
)
from jaxamp._frontends.transform import DynamicLossScaleState
from jaxamp._hyperparams import FLOAT_OVERFLOW_MESSAGE, FLT_MAX, INT32_MAX, INT32_MIN, check_scale
from jaxamp._torch.core import int32_array, scale_array
from jaxamp._torch.schedules import INJECT_STATES

STATE_DICT_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
HYPERPARAMETERS = ("growth_factor", "backoff_factor", "growth_interval")
# The C++ type torch fills each int with, and its range.
_INTEGERS = {
  "growth_interval": ("int64_t", -(2**63), 2**63 - 1),
  "_growth_tracker": ("int", INT32_MIN, INT32_MAX),
}

EMPTY_STATE_DICT_MESSAGE = (
  "The source state dict is empty, possibly because it was saved from a "
  "disabled instance of GradScaler."
)


def _plain(value: Any) -> Any:
  """A NumPy scalar (or a 0-dim array) as the Python number it holds."""
  if isinstance(value, (np.generic, np.ndarray, jax.Array)):
    return np.asarray(value).item()
  return value


def _number(key: str, value: Any) -> float | int:
  """The entry ``key`` as a Python number: a real one, or an int in its C++ range."""
  integer = key in _INTEGERS
  kind: Any = numbers.Integral if integer else numbers.Real
  name = "an int" if integer else "a real Python number"
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, kind):
    raise TypeError(
      f"jaxamp: state dict entry {key!r} must be {name}, got "
      f"{type(value).__name__} {value!r}; nothing was loaded."
    )
  if not integer:
    return _plain(value)
  value, (ctype, low, high) = int(value), _INTEGERS[key]
  if not low <= value <= high:
    raise RuntimeError(
      f"value cannot be converted to type {ctype} without overflow "
      f"(jaxamp: {key}={value}; nothing was loaded)"
    )
  return value


def check_state_dict(state_dict: Any) -> dict[str, Any]:
  """Validates a torch-format state dict and returns it with plain Python values."""
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
  scale = _number("scale", state_dict["scale"])
  # A finite number beyond float32 (an int of any size: math.isfinite would overflow).
  if (isinstance(scale, numbers.Integral) or math.isfinite(scale)) and abs(scale) > FLT_MAX:
    raise RuntimeError(
      f"{FLOAT_OVERFLOW_MESSAGE} (jaxamp: scale={scale!r} is beyond the float32 "
      "range; nothing was loaded)"
    )
  check_scale("the state dict's scale", scale)
  return {
    "scale": scale,
    **{key: _number(key, state_dict[key]) for key in STATE_DICT_KEYS[1:]},
  }


def _is_recorder(x: Any) -> bool:
  return isinstance(x, (DynamicLossScaleState, *INJECT_STATES))


def _injected_hyperparameters(opt_state: Any) -> dict[str, Any]:
  """The hyperparameters of ``inject_hyperparams`` states around the jaxamp state."""
  found: dict[str, Any] = {}
  for node in jax.tree.leaves(opt_state, is_leaf=_is_recorder):
    if isinstance(node, INJECT_STATES) and any(
      isinstance(x, DynamicLossScaleState)
      for x in jax.tree.leaves(node.inner_state, is_leaf=_is_recorder)
    ):
      found.update(node.hyperparams)
      found.update(_injected_hyperparameters(node.inner_state))
  return found


def _checked_in_use(opt_state, growth_factor, backoff_factor, growth_interval) -> dict[str, Any]:
  """torch's three hyperparameters in use, checked against those given (not ``None``)."""
  opt_state = opt_state_of(opt_state)
  config = find_loss_scale_state(opt_state).config
  injected = _injected_hyperparameters(opt_state)
  in_use = {}
  for name in HYPERPARAMETERS:
    value = field_array(injected[name]) if name in injected else getattr(config, name)
    if value is INJECTED:
      raise ValueError(
        f"jaxamp: {name} was given to dynamic_loss_scale as an array, which the "
        "state cannot record; pass a Python number (or optax.inject_hyperparams, "
        "whose state holds the value) to save a state dict."
      )
    in_use[name] = _plain(value)
  given = dict(zip(HYPERPARAMETERS, (growth_factor, backoff_factor, growth_interval)))
  _check_hyperparameters(in_use, given, "the call")
  return in_use


def _check_hyperparameters(in_use: dict[str, Any], given: dict[str, Any], where: str) -> None:
  for name, value in given.items():
    if value is not None and _plain(value) != in_use[name]:
      raise ValueError(
        f"jaxamp: {where} has {name}={_plain(value)!r} but the optimizer uses "
        f"{in_use[name]!r}; build dynamic_loss_scale with the hyperparameters of "
        "the checkpoint. Nothing was changed."
      )


def state_dict(
  opt_state: Any,
  *,
  growth_factor: float | None = None,
  backoff_factor: float | None = None,
  growth_interval: int | None = None,
) -> dict[str, Any]:
  """The loss-scale state of ``opt_state`` as torch's ``GradScaler.state_dict()``.

  With the hyperparameters the state records; it loads into torch and continues the run
  bit for bit. A host read: call it outside ``jit``.

  Args:
    opt_state: an optimizer state holding one ``DynamicLossScaleState``
      (or an object with ``.opt_state``, e.g. a ``flax.nnx.Optimizer``).
    growth_factor: if given, checked against the one in use.
    backoff_factor: if given, checked against the one in use.
    growth_interval: if given, checked against the one in use.

  Returns:
    ``{"scale": float, "growth_factor": ..., "backoff_factor": ...,
    "growth_interval": int, "_growth_tracker": int}``, in torch's key order.

  Raises:
    ValueError: no jaxamp state, or a given hyperparameter is not the one in use.

  Examples:
    >>> import optax, jax.numpy as jnp, jaxamp
    >>> tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=3.0, growth_interval=10)
    >>> jaxamp.state_dict(tx.init({"w": jnp.ones(2)}))
    {'scale': 3.0, 'growth_factor': 2.0, 'backoff_factor': 0.5, 'growth_interval': 10, '_growth_tracker': 0}
  """
  in_use = _checked_in_use(opt_state, growth_factor, backoff_factor, growth_interval)
  loss_scale_state = find_loss_scale_state(opt_state)
  return {
    "scale": float(field_array(loss_scale_state.loss_scale)),
    **in_use,
    "_growth_tracker": int(field_array(loss_scale_state.growth_tracker)),
  }


def _with_value(field: Any, value: jax.Array) -> Any:
  """``value`` in the container type of ``field`` (a bare array or an nnx variable)."""
  if isinstance(field, (jax.Array, np.ndarray, np.generic)):
    return value
  return jax.tree.map(lambda _: value, field)


def load_state_dict(
  opt_state: Any,
  state_dict: Mapping[str, Any],
  *,
  growth_factor: float | None = None,
  backoff_factor: float | None = None,
  growth_interval: int | None = None,
) -> Any:
  """Returns ``opt_state`` with the scale and growth tracker of ``state_dict``.

  Its hyperparameters must be the ones in use; the scale is rounded to float32 as torch's
  ``fill_`` does, and the rest of ``opt_state`` is kept.

  Args:
    opt_state: an optimizer state holding one ``DynamicLossScaleState``.
    state_dict: torch's five keys (docs/torch_semantics.md §1.9).
    growth_factor: if given, must be the one in use.
    backoff_factor: if given, must be the one in use.
    growth_interval: if given, must be the one in use.

  Returns:
    A new optimizer state of the same structure.

  Raises:
    TypeError: not a mapping, or a value of the wrong kind. KeyError: a missing
      key. ValueError: unexpected keys; a scale not finite and positive in
      float32; hyperparameters other than the ones in use. RuntimeError: an
      empty dict (torch's message); a scale beyond float32 or a tracker beyond
      int32. Nothing is loaded.

  Examples:
    >>> import optax, jax.numpy as jnp, jaxamp
    >>> state = jaxamp.dynamic_loss_scale(optax.sgd(0.1)).init({"w": jnp.ones(2)})
    >>> state = jaxamp.load_state_dict(state, {"scale": 0.1, "growth_factor": 2.0,
    ...     "backoff_factor": 0.5, "growth_interval": 2000, "_growth_tracker": 7})
    >>> float(state.loss_scale), int(state.growth_tracker)
    (0.10000000149011612, 7)
  """
  checked = check_state_dict(state_dict)
  if opt_state_of(opt_state) is not opt_state:
    raise TypeError(
      "jaxamp.load_state_dict takes the optimizer state itself (e.g. "
      "optimizer.opt_state) and returns a new one."
    )
  in_use = _checked_in_use(opt_state, growth_factor, backoff_factor, growth_interval)
  _check_hyperparameters(
    in_use, {name: checked[name] for name in HYPERPARAMETERS}, "the state dict"
  )
  scale = scale_array(checked["scale"])
  tracker = int32_array(checked["_growth_tracker"])

  def replace(node: Any) -> Any:
    if not is_loss_scale_state(node):
      return node
    return node._replace(
      loss_scale=_with_value(node.loss_scale, scale),
      growth_tracker=_with_value(node.growth_tracker, tracker),
    )

  return jax.tree.map(replace, opt_state, is_leaf=is_loss_scale_state)
