"""The loss-scale configuration: every option's default, and its checks in one place."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

from jaxamp._hyperparams import (
  check_axis_name,
  check_bound,
  check_flag,
  check_scale,
  concrete_int,
  concrete_real,
  is_array,
  python_number,
)

# The numeric fields that optax.inject_hyperparams may give as arrays.
NUMERIC_FIELDS = (
  "init_scale",
  "growth_factor",
  "backoff_factor",
  "growth_interval",
  "min_loss_scale",
  "max_loss_scale",
  "hysteresis",
  "max_consecutive_skips",
)


class _Injected:
  """Stands in, in a state's record of its configuration, for an array value."""

  def __repr__(self) -> str:
    return "<injected>"

  def __reduce__(self) -> str:  # one instance, through copies and pickles: compared by identity
    return "INJECTED"


INJECTED = _Injected()


def _key(value: Any) -> Any:
  """A hashable, self-equal stand-in for a configuration value (NaN included)."""
  if isinstance(value, float):
    return (float, value.hex())
  if is_array(value):
    return (type(value), id(value))
  return (type(value), value)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, eq=False)
class LossScaleConfig:
  """Everything a loss scaler is built with; the defaults are torch's.

  The record of every option, which the front-ends' signatures repeat
  (tests/test_options.py holds them to it). Numbers are Python numbers, used
  exactly, or arrays under ``optax.inject_hyperparams``. A static pytree,
  compared by value, so it can live in a state.
  """

  init_scale: float | jax.Array = 2.0**16
  growth_factor: float | jax.Array = 2.0
  backoff_factor: float | jax.Array = 0.5
  growth_interval: int | jax.Array = 2000
  enabled: bool = True
  axis_name: str | tuple[str, ...] | None = None
  min_loss_scale: float | jax.Array | None = None
  max_loss_scale: float | jax.Array | None = None
  hysteresis: int | jax.Array = 1
  consecutive_hysteresis: bool = False
  max_consecutive_skips: int | None = None
  detect_unscale_overflow: bool = False
  schedule_counts: str = "applied"
  param_labels: Any = None

  def _values(self) -> tuple:
    return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

  def __eq__(self, other: object) -> bool:
    if not isinstance(other, LossScaleConfig):
      return NotImplemented
    return tuple(map(_key, self._values())) == tuple(map(_key, other._values()))

  def __hash__(self) -> int:
    return hash(tuple(map(_key, self._values())))

  def replace(self, **changes: Any) -> LossScaleConfig:
    return dataclasses.replace(self, **changes)

  def recorded(self) -> LossScaleConfig:
    """This configuration with each array value replaced by ``INJECTED``."""
    return self.replace(**dict.fromkeys(self.arrays(), INJECTED))

  def arrays(self) -> dict[str, Any]:
    """The array-valued fields (injected hyperparameters), by name."""
    return {name: getattr(self, name) for name in NUMERIC_FIELDS if is_array(getattr(self, name))}


def loss_scale_config(*, static: bool = False, **values: Any) -> LossScaleConfig:
  """Checks ``values`` (the concrete ones; a disabled scaler's only for its flags,
  as torch) and returns them as a :class:`LossScaleConfig`. ``static``: every
  number must be a Python number (``GradScaler``).

  Raises:
    TypeError: a value of the wrong kind. ValueError: a value out of range,
      or options that contradict each other.
  """
  config = LossScaleConfig(**values)
  check_flag("enabled", config.enabled)
  if not config.enabled:
    return config
  for name in ("consecutive_hysteresis", "detect_unscale_overflow"):
    check_flag(name, getattr(config, name))
  check_axis_name(config.axis_name)
  if config.schedule_counts not in ("applied", "iterations"):
    raise ValueError(
      'jaxamp: schedule_counts must be "applied" (optax: schedules count applied '
      'updates) or "iterations" (torch: skipped ones too), got '
      f"{config.schedule_counts!r}."
    )
  if static:
    integers = ("growth_interval", "hysteresis", "max_consecutive_skips")
    config = config.replace(
      **{
        name: python_number(name, getattr(config, name), integer=name in integers)
        for name in NUMERIC_FIELDS
        if getattr(config, name) is not None
      }
    )
  if config.growth_factor is None or config.backoff_factor is None:
    raise TypeError("jaxamp: growth_factor and backoff_factor must be numbers, got None.")
  scale = check_scale("init_scale", config.init_scale)
  growth = concrete_real("growth_factor", config.growth_factor)
  if growth is not None and not (growth > 1.0 and math.isfinite(growth)):
    raise ValueError(f"The growth factor must be > 1.0. (jaxamp: got {growth!r})")
  backoff = concrete_real("backoff_factor", config.backoff_factor)
  if backoff is not None and backoff >= 1.0:
    raise ValueError(f"The backoff factor must be < 1.0. (jaxamp: got {backoff!r})")
  if backoff is not None and not backoff > 0.0:
    raise ValueError(f"jaxamp: the backoff factor must be > 0.0, got {backoff!r}.")
  concrete_int("growth_interval", config.growth_interval, None)  # beyond int32: never grows
  low = check_bound("min_loss_scale", config.min_loss_scale)
  high = check_bound("max_loss_scale", config.max_loss_scale)
  if low is not None and high is not None and low > high:
    raise ValueError(
      f"jaxamp: min_loss_scale ({low!r}) must not be above max_loss_scale ({high!r})."
    )
  if scale is not None and low is not None and scale < low:
    raise ValueError(f"jaxamp: init_scale {scale!r} is below min_loss_scale {low!r}.")
  if scale is not None and high is not None and scale > high:
    raise ValueError(f"jaxamp: init_scale {scale!r} is above max_loss_scale {high!r}.")
  concrete_int("hysteresis", config.hysteresis, 1)
  if config.max_consecutive_skips is not None:
    concrete_int("max_consecutive_skips", config.max_consecutive_skips, 1)
  return config
