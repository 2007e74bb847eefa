"""The loss-scale configuration: hyperparameters and options, checked in one place."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FLT_MAX = float(np.finfo(np.float32).max)
FLT_MIN_NORMAL = float(np.finfo(np.float32).tiny)
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
FLOAT_OVERFLOW_MESSAGE = "value cannot be converted to type float without overflow"

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

  def __reduce__(self) -> str:
    # The one instance, also in a deep copy or a pickle of a state: a state's
    # configuration is compared with its transformation's by this identity.
    return "INJECTED"


INJECTED = _Injected()


def _key(value: Any) -> Any:
  """A hashable, self-equal stand-in for a configuration value (NaN included)."""
  if isinstance(value, float):
    return (float, value.hex())
  if isinstance(value, (jax.Array, np.ndarray)):
    return (type(value), id(value))
  return (type(value), value)


def _doc(annotation: str, doc: str, **torch_style_default: Any) -> dict[str, Any]:
  """A field's metadata: its type as the front-ends' signatures show it, its
  ``Args:`` entry, and (``torch_default=``) where the torch-style front-end's
  default differs from the field's."""
  return {"annotation": annotation, "doc": doc, **torch_style_default}


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, eq=False)
class LossScaleConfig:
  """Everything a loss scaler is built with; the defaults are torch's.

  The one definition of every option: its default, its documentation and (in
  :func:`loss_scale_config`) its validation. The front-ends take their
  signatures and ``Args:`` entries from here (:func:`with_options`). One
  option has two defaults: ``schedule_counts`` counts as optax does in the
  optax form (the field's default) and as torch does in ``GradScaler`` (its
  ``torch_default``), each front-end keeping the semantics of the code it is
  written next to.

  Numbers are Python numbers, used exactly (float64 factors, as torch), or,
  in :func:`~jaxamp.dynamic_loss_scale` under ``optax.inject_hyperparams``,
  arrays. A JAX pytree with no leaves, compared by value, so it can live in a state.
  """

  init_scale: Any = dataclasses.field(
    default=2.0**16,
    metadata=_doc("float | jax.Array", "the initial scale (a finite positive float32 number)."),
  )
  growth_factor: Any = dataclasses.field(
    default=2.0,
    metadata=_doc(
      "float | jax.Array",
      "multiplies the scale after ``growth_interval`` consecutive finite steps "
      "(> 1). Python numbers are applied exactly as float64, as torch.",
    ),
  )
  backoff_factor: Any = dataclasses.field(
    default=0.5,
    metadata=_doc("float | jax.Array", "multiplies the scale on a step with inf/NaN (0 < x < 1)."),
  )
  growth_interval: Any = dataclasses.field(
    default=2000,
    metadata=_doc(
      "int | jax.Array",
      "consecutive finite steps before growing (an int; zero or less never grows, as in torch).",
    ),
  )
  enabled: bool = dataclasses.field(
    default=True,
    metadata=_doc(
      "bool",
      "``False`` behaves as torch's disabled scaler: the scale is 1, nothing is "
      "checked or skipped, the gradients reach the optimizer as given, and the "
      "other options are neither used nor checked.",
    ),
  )
  axis_name: str | tuple[str, ...] | None = dataclasses.field(
    default=None,
    metadata=_doc(
      "str | tuple[str, ...] | None",
      "under ``jax.shard_map`` (or ``pmap``) with per-device gradients, the "
      "mapped axis (or axes) over which the finiteness flag is all-reduced, so "
      "every device skips the same steps, as torch all-reduces ``found_inf`` "
      "(docs/distributed.md).",
    ),
  )
  min_loss_scale: Any = dataclasses.field(
    default=None,
    metadata=_doc(
      "float | jax.Array | None", "(not in torch) the scale never backs off below this."
    ),
  )
  max_loss_scale: Any = dataclasses.field(
    default=None,
    metadata=_doc("float | jax.Array | None", "(not in torch) the scale never grows above this."),
  )
  hysteresis: Any = dataclasses.field(
    default=1,
    metadata=_doc(
      "int | jax.Array",
      "(not in torch; DeepSpeed, Megatron) overflowing steps tolerated before a "
      'backoff; each is still skipped (docs/protections.md, "Semantics").',
    ),
  )
  consecutive_hysteresis: bool = dataclasses.field(
    default=False,
    metadata=_doc(
      "bool",
      "(not in torch) DeepSpeed's variant of ``hysteresis``: every finite step "
      "refills it, not only a growth attempt.",
    ),
  )
  max_consecutive_skips: Any = dataclasses.field(
    default=None,
    metadata=_doc(
      "int | None",
      "(not in torch) this many skipped steps in a row fail the jitted step, or "
      "are a ``checkify`` error when the step is checkified (docs/protections.md).",
    ),
  )
  detect_unscale_overflow: bool = dataclasses.field(
    default=False,
    metadata=_doc(
      "bool",
      "(not in torch) also skip when unscaling itself overflows (docs/torch_semantics.md §3.2).",
    ),
  )
  schedule_counts: str = dataclasses.field(
    default="applied",
    metadata=_doc(
      "str",
      "``\"iterations\"`` (torch's way, ``GradScaler``'s default): a skipped "
      "step still advances the schedules in the optimizer's state "
      "(``optax.scale_by_schedule``, hence a schedule given as a learning "
      "rate, and ``inject_hyperparams``), as torch's ``LRScheduler.step()`` "
      "runs every iteration, while the optimizer's own counts (Adam's) stay. "
      "``\"applied\"`` (optax's way, ``dynamic_loss_scale``'s default): a "
      "skipped step leaves the inner state untouched, schedules included, so "
      'a schedule counts applied updates (docs/porting.md, "Schedules").',
      torch_default="iterations",
    ),
  )
  param_labels: Any = dataclasses.field(
    default=None,
    metadata=_doc(
      "Any",
      "torch's several optimizers with one scaler: a tree of labels like the "
      "params (or a function of the gradients giving one), as "
      "``optax.multi_transform`` takes it, with ``inner`` a ``{label: "
      "optimizer}``. A group is skipped only when its own gradients hold "
      "inf/NaN; the scale backs off once per step whichever groups did.",
    ),
  )

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
    return self.replace(
      **{name: INJECTED for name in NUMERIC_FIELDS if is_array(getattr(self, name))}
    )

  def arrays(self) -> dict[str, Any]:
    """The array-valued fields (injected hyperparameters), by name."""
    return {name: getattr(self, name) for name in NUMERIC_FIELDS if is_array(getattr(self, name))}


def is_array(value: Any) -> bool:
  return isinstance(value, (jax.Array, np.ndarray))


def _concrete(value: Any) -> Any:
  """A Python number for a number or concrete array scalar; None when traced."""
  if isinstance(value, np.generic):
    return value.item()
  if isinstance(value, jax.core.Tracer) or not is_array(value):
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
    hint = ""
    if isinstance(value, str):
      hint = " jaxamp.GradScaler takes no device argument: drop it."
    elif is_array(value):
      hint = " GradScaler keeps its hyperparameters as static Python numbers."
    raise TypeError(
      f"jaxamp: {name} must be {'an int' if integer else 'a real Python number'}, "
      f"got {type(value).__name__} {value!r}.{hint}"
    )
  return value.item() if isinstance(value, np.generic) else value  # type: ignore[return-value]


def _check_dtype(name: str, value: Any, *, integer: bool) -> None:
  dtype = getattr(value, "dtype", None)
  if dtype is None:
    return
  dtype = jnp.dtype(dtype)
  if integer and not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"jaxamp: {name} must be an int, got an array of dtype {dtype}.")
  if dtype in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
    raise TypeError(
      f"jaxamp: {name} arrived as {dtype.name}, which cannot hold loss-scale "
      "values exactly (float16(65536) is inf). With optax.inject_hyperparams and "
      "low-precision params, pass hyperparam_dtype=jnp.float32."
    )


def _real(name: str, value: Any) -> float | None:
  """The concrete value of a real hyperparameter (None when traced)."""
  _check_dtype(name, value, integer=False)
  concrete = _concrete(value)
  if concrete is None or isinstance(concrete, jax.core.Tracer):
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


def _integer(name: str, value: Any, minimum: int | None) -> int | None:
  """The concrete value of an int hyperparameter (None when traced), range-checked."""
  _check_dtype(name, value, integer=True)
  concrete = _concrete(value)
  if concrete is None or isinstance(concrete, jax.core.Tracer):
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
  """A growth or backoff factor given to ``update_loss_scale``: a real scalar
  (its range is not checked there, as torch's ``_amp_update_scale_``)."""
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
  _real(name, value)


def check_growth_interval(value: Any) -> None:
  """``growth_interval`` as the update rule takes it: an int (a Python int of
  any size: beyond int32 it never grows, as torch), or an int scalar array
  within int32 (an array could otherwise wrap silently)."""
  _integer("growth_interval", value, None)


def check_scale(name: str, value: Any) -> float | None:
  """A loss scale: finite, positive and nonzero in float32 (None when traced)."""
  if value is None:
    raise TypeError(f"jaxamp: {name} must be a finite positive number, got None.")
  scale = _real(name, value)
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


def _check_bound(name: str, value: Any) -> float | None:
  bound = _real(name, value)
  if bound is not None and not (0 < bound <= FLT_MAX and np.float32(bound) >= FLT_MIN_NORMAL):
    raise ValueError(
      f"jaxamp: {name} must be a finite positive float32 number of at least "
      f"{FLT_MIN_NORMAL!r} (XLA flushes smaller ones to zero), got {bound!r}."
    )
  return bound


def _check_axis_name(axis_name: Any) -> None:
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  if axis_name is not None and not (names and all(isinstance(n, str) for n in names)):
    raise TypeError(
      f"jaxamp: axis_name must be a mesh axis name (a str) or a tuple of them, got {axis_name!r}."
    )


def check_flag(name: str, value: Any) -> None:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"jaxamp: {name} must be True or False, got {value!r}.")


def loss_scale_config(*, static: bool = False, **values: Any) -> LossScaleConfig:
  """Checks ``values`` and returns them as a :class:`LossScaleConfig`.

  Every concrete value is checked; traced ones (``optax.inject_hyperparams``
  inside ``jit``) cannot be. A disabled configuration is not checked beyond
  its flags, as torch does not check a disabled scaler. With ``static`` (the
  ``GradScaler``), every number must be a Python number.

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
  _check_axis_name(config.axis_name)
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
  growth = _real("growth_factor", config.growth_factor)
  if growth is not None and not (growth > 1.0 and math.isfinite(growth)):
    raise ValueError(f"The growth factor must be > 1.0. (jaxamp: got {growth!r})")
  backoff = _real("backoff_factor", config.backoff_factor)
  if backoff is not None and backoff >= 1.0:
    raise ValueError(f"The backoff factor must be < 1.0. (jaxamp: got {backoff!r})")
  if backoff is not None and not backoff > 0.0:
    raise ValueError(f"jaxamp: the backoff factor must be > 0.0, got {backoff!r}.")
  check_growth_interval(config.growth_interval)
  low = _check_bound("min_loss_scale", config.min_loss_scale)
  high = _check_bound("max_loss_scale", config.max_loss_scale)
  if low is not None and high is not None and low > high:
    raise ValueError(
      f"jaxamp: min_loss_scale ({low!r}) must not be above max_loss_scale ({high!r})."
    )
  if scale is not None and low is not None and scale < low:
    raise ValueError(f"jaxamp: init_scale {scale!r} is below min_loss_scale {low!r}.")
  if scale is not None and high is not None and scale > high:
    raise ValueError(f"jaxamp: init_scale {scale!r} is above max_loss_scale {high!r}.")
  _integer("hysteresis", config.hysteresis, 1)
  if config.max_consecutive_skips is not None:
    _integer("max_consecutive_skips", config.max_consecutive_skips, 1)
  return config


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


def _entry(name: str, doc: str, indent: str) -> str:
  """``name: doc`` wrapped as a Google-style ``Args:`` entry at ``indent``."""
  lines, line = [], f"{indent}{name}:"
  for word in doc.split():
    if len(line) + 1 + len(word) > 88:
      lines.append(line)
      line = f"{indent}  {word}"
    else:
      line = f"{line} {word}"
  return "\n".join([*lines, line])


def with_options(
  *, positional: tuple[str, ...] = (), exclude: tuple[str, ...] = (), torch_style: bool = False
):
  """Gives a front-end (a function ``fn(*own, **options)``, or a class whose
  ``__init__`` is one) the options of :class:`LossScaleConfig` (all but
  ``exclude``): in its signature, with their defaults (``torch_style``: a
  field's ``torch_default`` where it has one; the ``positional`` ones, in
  that order, positional-or-keyword, as torch's ``GradScaler`` takes them;
  the others keyword-only), and in its docstring's ``Args:``, where the line
  ``{options}`` stands. ``fn`` receives every option, defaults filled in; an
  unknown keyword is a ``TypeError`` that names the known ones."""
  fields = {f.name: f for f in dataclasses.fields(LossScaleConfig) if f.name not in exclude}
  order = [*positional, *(name for name in fields if name not in positional)]

  def parameter(name: str) -> inspect.Parameter:
    kind: inspect._ParameterKind = inspect.Parameter.KEYWORD_ONLY
    if name in positional:
      kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    field = fields[name]
    default = field.metadata.get("torch_default", field.default) if torch_style else field.default
    return inspect.Parameter(name, kind, default=default, annotation=field.metadata["annotation"])

  def documented(doc: str) -> str:
    marker = next(line for line in doc.splitlines() if line.strip() == "{options}")
    indent = marker[: len(marker) - len(marker.lstrip())]
    entries = [_entry(name, fields[name].metadata["doc"], indent) for name in order]
    return doc.replace(marker, "\n".join(entries))

  def wrap(fn: Callable) -> Callable:
    signature = inspect.signature(fn)
    own = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    full = signature.replace(parameters=[*own, *map(parameter, order)])

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
      try:
        bound = full.bind(*args, **kwargs)
      except TypeError as error:
        raise TypeError(
          f"jaxamp: {fn.__qualname__}() {error}. Its options are: {', '.join(order)}."
        ) from None
      bound.apply_defaults()
      values = dict(bound.arguments)
      own_values = [values.pop(p.name) for p in own]
      return fn(*own_values, **values)

    wrapper.__signature__ = full  # type: ignore[attr-defined]
    return wrapper

  def decorate(target: Any) -> Any:
    if isinstance(target, type):
      target.__init__ = wrap(target.__init__)  # type: ignore[misc]
      target.__doc__ = documented(target.__doc__ or "")
      return target
    wrapper = wrap(target)
    wrapper.__doc__ = documented(target.__doc__ or "")
    return wrapper

  return decorate
