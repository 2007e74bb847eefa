"""What a ``GradScaler`` holds: constructor, getters, setters, state dicts and copies."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, ParamSpec

import jax

from jaxamp._config import LossScaleConfig, loss_scale_config
from jaxamp._frontends.checkpoint import HYPERPARAMETERS, check_state_dict
from jaxamp._frontends.scaler_stages import PICKLE, Record
from jaxamp._hyperparams import check_flag, python_number
from jaxamp._torch.core import LossScaleCore, init_core, int32_array, scale_array

P = ParamSpec("P")


class _Unset:
  """A hyperparameter of a disabled scaler that no setter has given."""

  def __repr__(self) -> str:
    return "<unset>"

  def __reduce__(self) -> str:
    # The one instance, by name: copies and pickles keep ``value is _UNSET`` true.
    return "_UNSET"


_UNSET: Any = _Unset()
_DISABLED = LossScaleConfig(
  enabled=False, growth_factor=_UNSET, backoff_factor=_UNSET, growth_interval=_UNSET
)


def _called_as_torch(init: Callable[P, None]) -> Callable[P, None]:
  """``init`` called as torch.amp's ``GradScaler(device, ...)`` or torch.cuda.amp's
  ``GradScaler(init_scale, ...)``; arguments that do not bind are a jaxamp TypeError."""
  signature = inspect.signature(init)

  @functools.wraps(init)
  def wrapper(*args: Any, **kwargs: Any) -> None:
    if len(args) > 1 and not isinstance(args[1], str):  # args[0] is the scaler
      args = (args[0], "cuda", *args[1:])
    try:
      signature.bind(*args, **kwargs)
    except TypeError as error:
      names = ", ".join(list(signature.parameters)[1:])
      raise TypeError(f"jaxamp: GradScaler(): {error}. Its arguments are: {names}.") from None
    init(*args, **kwargs)

  return wrapper


class ScalerState:
  """The state half of :class:`~jaxamp.GradScaler`; see there."""

  _config: LossScaleConfig
  _core: LossScaleCore
  _states: dict[int, Record]
  _scaled: bool
  _init_growth_tracker: int

  @_called_as_torch
  def __init__(
    self,
    device: str | float = "cuda",
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    enabled: bool = True,
    *,
    min_loss_scale: float | None = None,
    max_loss_scale: float | None = None,
    hysteresis: int = 1,
    consecutive_hysteresis: bool = False,
    max_consecutive_skips: int | None = None,
    detect_unscale_overflow: bool = False,
    schedule_counts: str = "iterations",
  ) -> None:
    """Creates a scaler: torch's arguments, then :func:`~jaxamp.dynamic_loss_scale`'s
    options (but ``axis_name`` and ``param_labels``) as Python numbers, keyword-only;
    ``schedule_counts`` defaults to torch's ``"iterations"``.

    Args:
      device: torch.amp's device string (``"cuda"``, ``"cpu"``, ...), ignored: JAX places
        the arrays (``"cuda"`` does not disable it without CUDA, as torch's does). A number
        in its place is torch.cuda.amp's positional form (docs/grad_scaler.md).
      init_scale: the initial scale (a finite positive float32 number).
      growth_factor: multiplies the scale after ``growth_interval`` consecutive finite
        steps (> 1). Python numbers are applied exactly as float64, as torch.
      backoff_factor: multiplies the scale on a step with inf/NaN (0 < x < 1).
      growth_interval: consecutive finite steps before growing (an int; zero or less never
        grows, as in torch).
      enabled: ``False`` behaves as torch's disabled scaler: scale 1, nothing checked or
        skipped, the gradients passed on as given, the other options unused and unchecked.
      min_loss_scale: (not in torch) the scale never backs off below this.
      max_loss_scale: (not in torch) the scale never grows above this.
      hysteresis: (not in torch; DeepSpeed, Megatron) overflowing steps tolerated before a
        backoff; each is still skipped (docs/protections.md, "Semantics").
      consecutive_hysteresis: (not in torch) DeepSpeed's variant of ``hysteresis``: every
        finite step refills it, not only a growth attempt.
      max_consecutive_skips: (not in torch) this many skipped steps in a row fail the
        jitted step, or are a ``checkify`` error (docs/protections.md).
      detect_unscale_overflow: (not in torch) also skip when unscaling itself overflows
        (docs/torch_semantics.md §3.2).
      schedule_counts: ``"iterations"`` (torch's way, ``GradScaler``'s default): a skipped
        step still advances the schedules' counts in the optimizer's state, and nothing else;
        ``"applied"`` (optax's way, ``dynamic_loss_scale``'s default): it leaves the inner
        state untouched (docs/porting.md, "Schedules").

    Raises:
      TypeError, ValueError: a hyperparameter of the wrong kind or out of range
        (not checked when disabled, as torch).
    """
    options = {name: value for name, value in locals().items() if name not in ("self", "device")}
    if not isinstance(device, str):
      raise TypeError(
        f'jaxamp: device must be a string such as "cuda" (ignored: JAX places the '
        f"arrays), got {type(device).__name__} {device!r}. torch.cuda.amp's form takes "
        "init_scale first, by position only: GradScaler(2.0**16, 2.0, 0.5, 2000)."
      )
    self._states, self._scaled, self._init_growth_tracker = {}, False, 0
    check_flag("enabled", enabled)
    if not enabled:
      self._config, self._core = _DISABLED, None  # type: ignore[assignment]  # never read
      return
    self._config = loss_scale_config(static=True, **options)
    self._core = init_core(self._config)

  @property
  def _enabled(self) -> bool:
    return self._config.enabled

  # -- copies and pickles -----------------------------------------------------------

  def __getstate__(self) -> dict[str, Any]:
    """Only between iterations, as torch; the copy starts as a fresh scaler at the
    current scale and tracker (docs/torch_semantics.md §1.10)."""
    if self._enabled and self._states:
      raise RuntimeError(
        f"{PICKLE} (jaxamp: this scaler has recorded unscale_()/step() for "
        f"{len(self._states)} optimizer(s) since the last update(); copy or pickle it "
        "after update(). Nothing was changed.)"
      )
    state = {k: v for k, v in self.__dict__.items() if k != "_owner"}
    if self._enabled:
      state["_config"] = self._config.replace(init_scale=self.get_scale())
      state["_init_growth_tracker"] = self._get_growth_tracker()
      state["_scaled"] = False
    return state

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__dict__.update(state)

  # -- the core's arrays (no host read) and diagnostics (not in torch) ---------------

  def _core_field(self, name: str, disabled: Any) -> jax.Array:
    return int32_array(disabled) if not self._enabled else getattr(self._core, name)

  @property
  def loss_scale(self) -> jax.Array:
    """The current scale, float32 ``[]`` (1 when disabled)."""
    return scale_array(1.0) if not self._enabled else self._core.loss_scale

  @property
  def growth_tracker(self) -> jax.Array:
    """Consecutive clean updates since the last growth or backoff, int32 ``[]``."""
    return self._core_field("growth_tracker", 0)

  @property
  def update_count(self) -> jax.Array:
    """``update()`` calls that applied the rule (not ``update(new_scale)``), int32 ``[]``."""
    return self._core_field("update_count", 0)

  @property
  def skipped_updates(self) -> jax.Array:
    """``update()`` calls whose combined found_inf was set, int32 ``[]`` (saturating)."""
    return self._core_field("skipped_steps", 0)

  @property
  def consecutive_skipped_updates(self) -> jax.Array:
    """Such ``update()`` calls since the last clean one (``max_consecutive_skips``)."""
    return self._core_field("consecutive_skipped_steps", 0)

  @property
  def hysteresis_tracker(self) -> jax.Array:
    """Overflowing updates still tolerated before a backoff, int32 ``[]``."""
    return self._core_field("hysteresis_tracker", 1)

  # -- getters and setters --------------------------------------------------------

  def get_scale(self) -> float | int | jax.Array:
    """The scale as a Python number (a host read); inside ``jit``, a float32 ``[]``.

    So torch code reading it mid-iteration (``1. / scaler.get_scale()``) runs
    under ``jax.jit``. Before the first ``scale()``, ``init_scale`` as given.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxamp
      >>> scaler = jaxamp.GradScaler(init_scale=4.0)
      >>> _ = scaler.scale(jnp.float32(1.0))
      >>> scaler.get_scale(), float(jax.jit(lambda s: 1.0 / s.get_scale())(scaler))
      (4.0, 0.25)
    """
    if not self._enabled:
      return 1.0
    if not self._scaled:
      return self._config.init_scale
    if isinstance(self._core.loss_scale, jax.core.Tracer):
      return self._core.loss_scale  # inside jit: the traced scale, no host read
    return float(self._core.loss_scale)

  def _get_growth_tracker(self) -> int:
    if not self._enabled:
      return 0
    if not self._scaled:
      return self._init_growth_tracker
    return int(self._core.growth_tracker)

  def _get(self, name: str) -> Any:
    value = getattr(self._config, name)
    if value is _UNSET:
      raise AttributeError(f"'GradScaler' object has no attribute '_{name}'")
    return value

  def _set(self, name: str, value: Any, *, integer: bool = False) -> None:
    self._config = self._config.replace(**{name: python_number(name, value, integer=integer)})

  def get_growth_factor(self) -> float:
    """The growth factor (``AttributeError`` on a disabled scaler, as torch)."""
    return self._get("growth_factor")

  def set_growth_factor(self, new_factor: float) -> None:
    """Sets the growth factor (a Python number; its range is not checked, as torch).

    Args:
      new_factor: multiplies the scale after ``growth_interval`` finite steps in a row.
    """
    self._set("growth_factor", new_factor)

  def get_backoff_factor(self) -> float:
    """The backoff factor (``AttributeError`` on a disabled scaler, as torch)."""
    return self._get("backoff_factor")

  def set_backoff_factor(self, new_factor: float) -> None:
    """Sets the backoff factor (a Python number; its range is not checked, as torch).

    Args:
      new_factor: multiplies the scale after a step whose gradients held inf/NaN.
    """
    self._set("backoff_factor", new_factor)

  def get_growth_interval(self) -> int:
    """The growth interval (``AttributeError`` on a disabled scaler, as torch)."""
    return self._get("growth_interval")

  def set_growth_interval(self, new_interval: int) -> None:
    """Sets the growth interval (an int; <= 0 never grows, as torch).

    Args:
      new_interval: how many steps in a row with finite gradients grow the scale.
    """
    self._set("growth_interval", new_interval, integer=True)

  def is_enabled(self) -> bool:
    """Whether the scaler is enabled."""
    return self._enabled

  # -- checkpoints ------------------------------------------------------------------

  def state_dict(self) -> dict[str, Any]:
    """torch's five keys, in its order, as Python values ({} if disabled); a host read."""
    if not self._enabled:
      return {}
    in_use = {name: getattr(self._config, name) for name in HYPERPARAMETERS}
    return {"scale": self.get_scale(), **in_use, "_growth_tracker": self._get_growth_tracker()}

  def load_state_dict(self, state_dict: dict[str, Any]) -> None:
    """Loads torch's or jaxamp's ``state_dict()``, checked whole; stages kept (disabled: no-op).

    Args:
      state_dict: what torch's or jaxamp's ``state_dict()`` returned.

    Raises:
      TypeError, KeyError, ValueError, RuntimeError: a bad state dict
        (:func:`jaxamp.load_state_dict` lists them); nothing is loaded.
    """
    if not self._enabled:
      return
    checked = check_state_dict(state_dict)
    in_use = {name: checked[name] for name in HYPERPARAMETERS}
    self._config = self._config.replace(init_scale=checked["scale"], **in_use)
    self._init_growth_tracker = checked["_growth_tracker"]
    self._core = self._core._replace(
      loss_scale=scale_array(checked["scale"]),
      growth_tracker=int32_array(checked["_growth_tracker"]),
    )

  def __repr__(self) -> str:
    if not self._enabled:
      return "jaxamp.GradScaler(enabled=False)"
    fields = ", ".join(f"{name}={getattr(self._config, name)!r}" for name in HYPERPARAMETERS)
    stages = {key: record.stage.name for key, record in self._states.items()}
    return f"jaxamp.GradScaler({fields}, stages={stages})"
