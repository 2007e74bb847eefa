"""``GradScaler``: torch's ``torch.amp.GradScaler``, method for method, for JAX.

For users porting a PyTorch AMP loop line by line. The arithmetic is the core's
(:func:`~jaxamp.unscale_and_check`, :func:`~jaxamp.update_loss_scale`), so the
scale, the unscaled gradients and the skip decisions are those of
:func:`~jaxamp.dynamic_loss_scale` and of torch, bit for bit. What this class
adds is torch's per-optimizer state machine (SPEC 2)::

             unscale_()              step()  [applies the update iff own found_inf == 0]
    READY ─────────────► UNSCALED ─────────────► STEPPED
      └──────────── step() (implicit unscale_) ────────┘
    update() combines every recorded found_inf into one backoff and resets all to READY

The scaler is a JAX pytree: the scale, the growth and hysteresis trackers, the
update counters and the recorded found_inf flags are its array children; the
hyperparameters and options (Python numbers, used exactly as float64, as torch
does) and the stages are static. So a whole
iteration runs inside one ``jax.jit``, the stage machine being checked while
tracing, with no host synchronisation.

The opt-in protections of :func:`~jaxamp.dynamic_loss_scale` (scale bounds,
hysteresis, skip limit, unscale-overflow detection, counters, per-leaf
diagnostic) are constructor options here too, computed by the same functions
(:func:`~jaxamp._protections.update_loss_scale_with_options`), so the two
give the same trajectory bit for bit. All off by default: torch's behaviour.
"""

from __future__ import annotations

import enum
import functools
import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._checkpoint import (
  FLOAT_OVERFLOW_MESSAGE,
  STATE_DICT_KEYS,
  check_state_dict,
  scale_array,
  tracker_array,
)
from jaxamp._optimizer import Optimizer, updated
from jaxamp._protections import (
  check_protection_options,
  check_skip_limit,
  update_loss_scale_with_options,
)
from jaxamp._transform import _count_if
from jaxamp._unscale import leaf_finite_flags, unscale_and_check_leaves
from jaxamp._validation import FLT_MAX, check_hyperparameters

# torch's messages (SPEC 4), raised as RuntimeError where torch asserts.
_NOT_SCALED = (
  "Attempted {} but _scale is None.  This may indicate your script did not use "
  "scaler.scale(loss or outputs) earlier in the iteration."
)
_OUTPUTS = "outputs must be a Tensor or an iterable of Tensors"
_UNSCALE_TWICE = "unscale_() has already been called on this optimizer since the last update()."
_UNSCALE_AFTER_STEP = "unscale_() is being called after step()."
_CLOSURE = "Closure use is not currently supported if GradScaler is enabled."
_STEP_TWICE = "step() has already been called since the last update()."
_NO_CHECKS_OPTIMIZER = "No inf checks were recorded for this optimizer."
_NO_CHECKS_UPDATE = "No inf checks were recorded prior to update."


class _Stage(enum.Enum):
  READY = 0
  UNSCALED = 1
  STEPPED = 2


class _Record(NamedTuple):
  """One optimizer's stage and found_inf (``None``: it had no gradients)."""

  stage: _Stage
  found_inf: jax.Array | None


class _Options(NamedTuple):
  """The opt-in protections (static configuration; the defaults are torch)."""

  min_loss_scale: float | None = None
  max_loss_scale: float | None = None
  hysteresis: int = 1
  consecutive_hysteresis: bool = False
  max_consecutive_skips: int | None = None
  detect_unscale_overflow: bool = False


class _Counters(NamedTuple):
  """``update()`` calls so far, and those whose combined found_inf was set
  (in total, and since the last clean one); int32, saturating."""

  update_count: jax.Array
  skipped: jax.Array
  consecutive_skipped: jax.Array


class _Unset:
  """A hyperparameter of a disabled scaler that no setter has given."""

  def __repr__(self) -> str:
    return "<unset>"


_UNSET = _Unset()


def _static_key(value: Any) -> Any:
  """A hashable, self-equal stand-in for a static value (NaN included)."""
  if isinstance(value, float):
    return (float, value.hex())
  return (type(value), value)


class _Static:
  """Static pytree data compared by value, so that NaN equals NaN."""

  def __init__(self, values: tuple):
    self.values = values
    self._key = tuple(_static_key(v) for v in values)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, _Static) and self._key == other._key

  def __hash__(self) -> int:
    return hash(self._key)


def _python_number(name: str, value: Any, *, integer: bool = False) -> int | float:
  """A Python number (NumPy scalars converted), else a TypeError."""
  kind = numbers.Integral if integer else numbers.Real
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, kind):
    hint = ""
    if isinstance(value, str):
      hint = " jaxamp.GradScaler takes no device argument: drop it."
    elif isinstance(value, jax.Array):
      hint = " GradScaler keeps its hyperparameters as static Python numbers."
    raise TypeError(
      f"jaxamp: {name} must be {'an int' if integer else 'a real Python number'}, "
      f"got {type(value).__name__} {value!r}.{hint}"
    )
  return value.item() if isinstance(value, np.generic) else value


def _optional_number(name: str, value: Any, *, integer: bool = False) -> int | float | None:
  return None if value is None else _python_number(name, value, integer=integer)


def _is_array(value: Any) -> bool:
  return isinstance(value, (jax.Array, np.ndarray))


def _scale_array(value: Any, scale: jax.Array) -> jax.Array:
  """``value * scale`` with torch's result dtype for a 0-dim float32 scale.

  float64 is multiplied in float64; a 0-dim floating, integer or bool value
  gives float32; a >=1-dim float16/bfloat16/float32 value keeps its dtype,
  multiplied in float32 and rounded once (torch's CPU-scalar "opmath" path).
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


def _is_none(value: Any) -> bool:
  return value is None


def _per_param_leaf(grads: Any, params: Any, flags: jax.Array) -> jax.Array | None:
  """``flags`` (one per array leaf of ``grads``) as one per array leaf of
  ``params``: a ``None`` gradient counts as finite. None if the trees differ."""
  grad_leaves, grads_def = jax.tree.flatten(grads, is_leaf=_is_none)
  param_leaves, params_def = jax.tree.flatten(params, is_leaf=_is_none)
  if grads_def != params_def:
    return None
  if all(g is not None and p is not None for g, p in zip(grad_leaves, param_leaves)):
    return flags
  per_position, flag_index = [], 0
  for grad, param in zip(grad_leaves, param_leaves):
    if grad is not None:
      flag, flag_index = flags[flag_index], flag_index + 1
    else:
      flag = jnp.zeros([], bool)
    if param is not None:
      per_position.append(flag)
  return jnp.stack(per_position) if per_position else jnp.zeros([0], bool)


def _compilable(tx: Any, extra_args: dict) -> bool:
  """Whether ``_compiled_step_unless`` can take these (a hashable ``tx``, array args)."""
  try:
    hash(tx)
  except TypeError:
    return False
  return all(isinstance(x, (jax.Array, np.ndarray, np.generic)) for x in jax.tree.leaves(extra_args))


def _step_unless(tx: Any, found_inf: jax.Array, grads: Any, params: Any, opt_state: Any, extra_args: dict):
  """``(params, opt_state)`` after one ``tx`` update, or as given when ``found_inf``."""
  return lax.cond(
      found_inf,
      lambda: (params, opt_state),
      lambda: updated(tx, grads, opt_state, params, **extra_args),
  )


# Compiled once per optimizer and shapes, so an eager loop does not recompile:
# a lax.cond of fresh closures outside jit compiles on every call.
_compiled_step_unless = jax.jit(_step_unless, static_argnums=0)


def _key_of(optimizer: Any) -> int:
  if not isinstance(optimizer, Optimizer):
    raise TypeError(
      "jaxamp.GradScaler expects a jaxamp.Optimizer (an optax transformation "
      f"with its params, state and grads), got {type(optimizer).__name__}."
    )
  return optimizer._key


def _checked_new_scale(new_scale: Any) -> jax.Array:
  """``update(new_scale=...)``: a finite scalar float, as a float32 array."""
  if isinstance(new_scale, (bool, np.bool_)) or isinstance(new_scale, numbers.Integral):
    raise TypeError(
      "jaxamp: new_scale must be a float or a 0-dim floating-point array, got "
      f"{type(new_scale).__name__} {new_scale!r} (torch raises AttributeError "
      "here); write it as a float, e.g. 2.0. The scaler is unchanged."
    )
  if isinstance(new_scale, numbers.Real):
    value = float(new_scale)
  elif _is_array(new_scale) or isinstance(new_scale, np.generic):
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
  if not math.isfinite(value):
    raise ValueError(
      f"jaxamp: new_scale must be finite, got {value!r} (torch accepts it and "
      "then skips every later step). The scaler is unchanged."
    )
  return scale_array(value)


@jax.tree_util.register_pytree_node_class
class GradScaler:
  """torch's ``GradScaler`` for JAX: the same methods, messages and arithmetic.

  torch -> jaxamp (the full table and the three reference loops are in
  ``docs/grad_scaler.md``)::

    torch.amp.GradScaler("cuda", ...)     -> jaxamp.GradScaler(...)  (no device)
    torch.optim.SGD(params, lr)           -> opt = jaxamp.Optimizer(optax.sgd(lr), params)
    scaler.scale(loss).backward()         -> opt.grads = jax.grad(
                                                 lambda p: scaler.scale(loss_fn(p)))(opt.params)
    scaler.unscale_(optimizer)            -> scaler.unscale_(opt)   (unscales opt.grads)
    clip_grad_norm_(params, 1.0)          -> change opt.grads (e.g. clip it)
    scaler.step(optimizer)                -> scaler.step(opt)
    scaler.update()                       -> scaler.update()
    scaler.state_dict() / load_state_dict -> the same; torch's format, both ways

  The methods change ``self`` (and the optimizer) in place, as in torch. To run
  an iteration under ``jax.jit``, pass the scaler and the optimizers in and
  return them: inside ``jit`` the methods change the traced copies.

  Deliberate differences from torch:

  * torch's ``AssertionError`` checks raise ``RuntimeError`` (or ``ValueError``
    for a bad ``new_scale`` array) with torch's text, so that ``python -O``
    keeps them. The stage machine is checked while tracing under ``jit``.
  * A call that raises changes nothing; torch leaves an optimizer ``UNSCALED``
    when ``step`` finds no gradients, and applies a state dict key by key.
  * Hyperparameters are checked at construction, as in
    :func:`~jaxamp.dynamic_loss_scale` (torch accepts a zero or negative
    backoff, a non-positive, infinite or NaN ``init_scale``, and reports an
    ``init_scale`` beyond float32 at the first ``scale()``). Setters check the
    type only (torch checks nothing), so a non-int interval fails at once
    rather than at ``update()``. Changing a hyperparameter changes the static
    part of the pytree: a jitted function traces again.
  * float16 gradients are unscaled (torch's non-fused path raises "Attempting
    to unscale FP16 gradients."), as in the optax wrapper.
  * ``update(new_scale=...)`` accepts a finite float or a 0-dim float array
    (traced ones included); torch also takes inf, NaN and integer tensors, and
    raises ``AttributeError`` for a Python int.
  * ``scale`` takes arrays and (nested) lists/tuples of them (namedtuples too);
    torch turns other iterables into lazy ``map`` objects, jaxamp raises torch's
    ``ValueError``. ``step`` takes keyword arguments only, passed to
    ``tx.update`` (``closure=`` raises torch's error), and returns ``None``.
  * Whether ``scale()`` has run (torch's "_scale is None" check) is a property
    of the Python object: a scaler rebuilt by JAX (inside ``jit``, or by
    ``jax.tree.map``) counts as having scaled. This keeps the pytree structure
    of a fresh scaler equal to a used one, so a jitted step compiles once.
  * There is no pickling guard and no fused-optimizer protocol.

  The keyword-only options after ``enabled`` are not in torch; they are those
  of :func:`~jaxamp.dynamic_loss_scale`, with the same semantics and
  arithmetic, applied by ``update()`` to the found_inf combined over all
  optimizers (``detect_unscale_overflow``: by ``unscale_``/``step``, per
  optimizer). They are static configuration, not part of ``state_dict()``.
  Whatever the options, the scaler counts its ``update()`` calls
  (:attr:`update_count`, :attr:`skipped_updates`,
  :attr:`consecutive_skipped_updates`, int32 arrays, no host read) and each
  optimizer remembers which gradient leaves held inf/NaN
  (:meth:`nonfinite_leaf_paths`).

  Args:
    init_scale: the initial scale, a finite positive Python number.
    growth_factor: multiplies the scale after ``growth_interval`` consecutive
      clean updates (> 1).
    backoff_factor: multiplies the scale on an update that found inf/NaN (in (0, 1)).
    growth_interval: clean updates before growing (an int; <= 0 never grows).
    enabled: ``False`` makes every method a pass-through, as torch's (the
      options below are then ignored and not checked).
    min_loss_scale: (not in torch) the scale never backs off below this (a
      Python number, or ``None``: no bound).
    max_loss_scale: (not in torch) the scale never grows above this.
    hysteresis: (not in torch; DeepSpeed) overflowing updates tolerated before
      a backoff (an int >= 1; 1 is torch). Every overflowing update resets the
      growth tracker, and skips as always; it backs off only when
      :attr:`hysteresis_tracker` is <= 1, else decrements it. The tracker
      refills on a growth (with ``consecutive_hysteresis``, on every clean update).
    consecutive_hysteresis: DeepSpeed's variant, see ``hysteresis``.
    max_consecutive_skips: (not in torch) when this many ``update()`` calls in
      a row found inf/NaN, the update (jitted or not) fails with a
      ``RuntimeError`` naming the update and the scale (a host callback that
      runs only then).
    detect_unscale_overflow: (not in torch) an optimizer whose gradients
      overflow while being unscaled (a bfloat16 ``3e38`` at scale 0.5) also
      records inf and skips; torch misses it.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxamp
    >>> scaler = jaxamp.GradScaler(init_scale=8.0, growth_interval=1)
    >>> opt = jaxamp.Optimizer(optax.sgd(0.5), {"w": jnp.array([1.0, 2.0])})
    >>> loss_fn = lambda p: jnp.sum(p["w"] ** 2)
    >>> opt.grads = jax.grad(lambda p: scaler.scale(loss_fn(p)))(opt.params)
    >>> scaler.step(opt)
    >>> scaler.update()
    >>> opt.params["w"].tolist(), scaler.get_scale()
    ([0.0, 0.0], 16.0)
    >>> scaler.state_dict()
    {'scale': 16.0, 'growth_factor': 2.0, 'backoff_factor': 0.5, 'growth_interval': 1, '_growth_tracker': 0}
  """

  def __init__(
    self,
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
  ):
    """Creates a scaler; see the class docstring."""
    self._enabled = bool(enabled)
    self._states: dict[int, _Record] = {}
    self._scaled = False
    self._options = _Options()
    self._hysteresis_tracker = self._counters = None
    if not self._enabled:
      self._init_scale, self._init_growth_tracker = 1.0, 0
      self._growth_factor = self._backoff_factor = self._growth_interval = _UNSET
      self._scale = self._growth_tracker = None
      return
    init_scale = _python_number("init_scale", init_scale)
    growth_factor = _python_number("growth_factor", growth_factor)
    backoff_factor = _python_number("backoff_factor", backoff_factor)
    growth_interval = _python_number("growth_interval", growth_interval, integer=True)
    check_hyperparameters(
      init_scale=init_scale,
      growth_factor=growth_factor,
      backoff_factor=backoff_factor,
      growth_interval=growth_interval,
    )
    self._init_scale, self._init_growth_tracker = init_scale, 0
    self._growth_factor, self._backoff_factor = growth_factor, backoff_factor
    self._growth_interval = growth_interval
    check_protection_options(
      init_scale=init_scale,
      min_loss_scale=min_loss_scale,
      max_loss_scale=max_loss_scale,
      hysteresis=hysteresis,
      max_consecutive_skips=max_consecutive_skips,
    )
    self._options = _Options(
      min_loss_scale=_optional_number("min_loss_scale", min_loss_scale),
      max_loss_scale=_optional_number("max_loss_scale", max_loss_scale),
      hysteresis=_python_number("hysteresis", hysteresis, integer=True),
      consecutive_hysteresis=bool(consecutive_hysteresis),
      max_consecutive_skips=_optional_number(
        "max_consecutive_skips", max_consecutive_skips, integer=True
      ),
      detect_unscale_overflow=bool(detect_unscale_overflow),
    )
    self._scale = scale_array(init_scale)
    self._growth_tracker = tracker_array(0)
    self._hysteresis_tracker = tracker_array(self._options.hysteresis)
    self._counters = _Counters(tracker_array(0), tracker_array(0), tracker_array(0))

  # -- pytree -------------------------------------------------------------------

  def tree_flatten(self):
    keys = tuple(self._states)
    children = (
      self._scale,
      self._growth_tracker,
      self._hysteresis_tracker,
      self._counters,
      tuple(self._states[k].found_inf for k in keys),
    )
    static = _Static(
      (
        self._enabled,
        self._init_scale,
        self._init_growth_tracker,
        self._growth_factor,
        self._backoff_factor,
        self._growth_interval,
        tuple(self._options),
        tuple((k, self._states[k].stage, self._states[k].found_inf is None) for k in keys),
      )
    )
    return children, static

  @classmethod
  def tree_unflatten(cls, static, children):
    scaler = object.__new__(cls)
    (
      scaler._enabled,
      scaler._init_scale,
      scaler._init_growth_tracker,
      scaler._growth_factor,
      scaler._backoff_factor,
      scaler._growth_interval,
      options,
      stages,
    ) = static.values
    scaler._options = _Options(*options)
    (
      scaler._scale,
      scaler._growth_tracker,
      scaler._hysteresis_tracker,
      scaler._counters,
      found_infs,
    ) = children
    scaler._states = {
      key: _Record(stage, None if no_check else found_inf)
      for (key, stage, no_check), found_inf in zip(stages, found_infs)
    }
    scaler._scaled = True
    return scaler

  # -- the iteration --------------------------------------------------------------

  def _check_scaled(self, funcname: str) -> None:
    if not self._scaled:
      raise RuntimeError(_NOT_SCALED.format(funcname))

  def scale(self, outputs: Any) -> Any:
    """Multiplies ``outputs`` (an array, or nested lists/tuples of arrays) by the scale.

    The product has torch's dtype: a 0-dim float16/bfloat16/float32 loss gives
    float32 (so ``float16(2.0)`` times 65536 is 131072, not inf); float64 stays
    float64; a >=1-dim low-precision array keeps its dtype. Disabled: returns
    ``outputs`` itself.

    Raises:
      ValueError: an element is not an array (torch's message).

    Examples:
      >>> import jax.numpy as jnp, jaxamp
      >>> jaxamp.GradScaler().scale(jnp.float16(2.0))
      Array(131072., dtype=float32)
    """
    if not self._enabled:
      return outputs
    found_array = False

    def apply(value):
      nonlocal found_array
      if _is_array(value):
        found_array = True
        return _scale_array(value, self._scale)
      if isinstance(value, (list, tuple)):
        scaled = [apply(v) for v in value]
        if hasattr(value, "_fields"):  # a namedtuple
          return type(value)(*scaled)
        return type(value)(scaled)
      raise ValueError(
        f"{_OUTPUTS} (jaxamp: got {type(value).__name__}; pass a JAX array, "
        "or a list/tuple of them)"
      )

    result = apply(outputs)
    if found_array:
      self._scaled = True
    return result

  def _unscaled(self, optimizer: Optimizer) -> tuple[Any, jax.Array | None]:
    """``optimizer``'s grads unscaled, and its found_inf (None: no grads).

    Also records, in ``optimizer.nonfinite_leaves``, which leaves held inf/NaN
    when found_inf is set (call it only where the call then succeeds).
    """
    grads = optimizer.grads
    if grads is None or not jax.tree.leaves(grads):
      return grads, None
    unscaled, finite = unscale_and_check_leaves(grads, self._scale)
    if self._options.detect_unscale_overflow:
      finite = finite & leaf_finite_flags(unscaled)
    found_inf = ~jnp.all(finite)
    nonfinite = _per_param_leaf(grads, optimizer.params, ~finite)
    if nonfinite is not None and optimizer.nonfinite_leaves is not None:
      optimizer.nonfinite_leaves = jnp.where(found_inf, nonfinite, optimizer.nonfinite_leaves)
    return unscaled, found_inf

  def unscale_(self, optimizer: Optimizer) -> None:
    """Unscales ``optimizer.grads`` in place and records whether they held inf/NaN.

    Call it before changing the gradients (e.g. clipping by global norm);
    ``step`` then uses the found_inf recorded here, not re-checking.

    Raises:
      RuntimeError: before any ``scale()``, or if ``unscale_`` or ``step``
        was already called on this optimizer since the last ``update()``.
    """
    if not self._enabled:
      return
    key = _key_of(optimizer)
    self._check_scaled("unscale_")
    stage = self._states.get(key, _Record(_Stage.READY, None)).stage
    if stage is _Stage.UNSCALED:
      raise RuntimeError(_UNSCALE_TWICE)
    if stage is _Stage.STEPPED:
      raise RuntimeError(_UNSCALE_AFTER_STEP)
    grads, found_inf = self._unscaled(optimizer)
    optimizer.grads = grads
    self._states = {**self._states, key: _Record(_Stage.UNSCALED, found_inf)}
    return

  def step(self, optimizer: Optimizer, **extra_args: Any) -> None:
    """Applies ``optimizer``'s update unless its own gradients held inf/NaN.

    Unscales first if ``unscale_`` was not called. The update runs under
    ``lax.cond``: on a skipped step ``params`` and ``opt_state`` are returned
    untouched, bit for bit (Adam's count does not advance). ``opt.grads`` holds
    the unscaled gradients afterwards, inf/NaN included. Keyword arguments are
    passed to ``tx.update``. Disabled: ``optimizer.step(**extra_args)``.

    Raises:
      RuntimeError: ``closure=`` given; before any ``scale()``; ``step``
        already called since the last ``update()``; no gradients to check.
    """
    if not self._enabled:
      return optimizer.step(**extra_args)
    if "closure" in extra_args:
      raise RuntimeError(_CLOSURE)
    key = _key_of(optimizer)
    self._check_scaled("step")
    record = self._states.get(key, _Record(_Stage.READY, None))
    if record.stage is _Stage.STEPPED:
      raise RuntimeError(_STEP_TWICE)
    if record.stage is _Stage.READY:
      grads, found_inf = self._unscaled(optimizer)
    else:
      grads, found_inf = optimizer.grads, record.found_inf
    if found_inf is None:
      raise RuntimeError(_NO_CHECKS_OPTIMIZER)

    # A callable extra arg (a line search's value function) or an unhashable
    # tx cannot go through jit's cache: those are traced on every call.
    step = _compiled_step_unless if _compilable(optimizer.tx, extra_args) else _step_unless
    params, opt_state = step(
        optimizer.tx, found_inf, grads, optimizer.params, optimizer.opt_state, extra_args
    )
    optimizer.grads, optimizer.params, optimizer.opt_state = grads, params, opt_state
    self._states = {**self._states, key: _Record(_Stage.STEPPED, found_inf)}
    return None

  def update(self, new_scale: float | jax.Array | None = None) -> None:
    """Updates the scale from this iteration's found_inf flags, and resets the stages.

    One backoff if any optimizer recorded inf/NaN (however many did), else one
    step towards growth, by :func:`~jaxamp.update_loss_scale` (torch's
    ``_amp_update_scale_``, bit for bit), with the scaler's options applied as
    in :func:`~jaxamp.dynamic_loss_scale`; the counters advance. ``new_scale``
    sets the scale instead, as given (not clamped: the bounds apply from the
    next ``update()``), ignoring the flags and leaving the growth tracker, the
    hysteresis tracker and the counters as they are.

    Args:
      new_scale: ``None``, or a finite float / 0-dim floating-point array.

    Raises:
      RuntimeError: before any ``scale()``; no ``unscale_``/``step`` recorded
        an inf check since the last update; a ``new_scale`` beyond float32;
        ``max_consecutive_skips`` reached (from the computation, under ``jit``
        when the jitted function runs; outside ``jit`` nothing is changed).
      TypeError, ValueError: a ``new_scale`` of the wrong kind or not finite.
    """
    if not self._enabled:
      return
    self._check_scaled("update")
    if new_scale is not None:
      self._scale = _checked_new_scale(new_scale)
      self._states = {}
      return
    found_infs = [r.found_inf for r in self._states.values() if r.found_inf is not None]
    if not found_infs:
      raise RuntimeError(_NO_CHECKS_UPDATE)
    found_inf = functools.reduce(jnp.logical_or, found_infs)
    options = self._options
    scale, growth_tracker, hysteresis_tracker = update_loss_scale_with_options(
      self._scale,
      self._growth_tracker,
      self._hysteresis_tracker,
      found_inf,
      growth_factor=self._growth_factor,
      backoff_factor=self._backoff_factor,
      growth_interval=self._growth_interval,
      min_loss_scale=options.min_loss_scale,
      max_loss_scale=options.max_loss_scale,
      hysteresis=options.hysteresis,
      consecutive_hysteresis=options.consecutive_hysteresis,
    )
    counters = self._counters
    counters = _Counters(
      update_count=_count_if(True, counters.update_count),
      skipped=_count_if(found_inf, counters.skipped),
      consecutive_skipped=jnp.where(found_inf, _count_if(True, counters.consecutive_skipped), 0),
    )
    if options.max_consecutive_skips is not None:
      check_skip_limit(
        counters.consecutive_skipped, counters.update_count, scale, options.max_consecutive_skips
      )
    self._scale, self._growth_tracker = scale, growth_tracker
    self._hysteresis_tracker, self._counters = hysteresis_tracker, counters
    self._states = {}
    return

  # -- counters and diagnostics (not in torch) --------------------------------------

  def _counter(self, name: str) -> jax.Array:
    if not self._enabled:
      return tracker_array(0)
    return getattr(self._counters, name)

  @property
  def update_count(self) -> jax.Array:
    """``update()`` calls that applied the rule (not ``update(new_scale)``), int32 ``[]``."""
    return self._counter("update_count")

  @property
  def skipped_updates(self) -> jax.Array:
    """``update()`` calls whose combined found_inf was set, int32 ``[]`` (saturating).

    A device array: reading it does not synchronise; ``int()`` of it does.
    """
    return self._counter("skipped")

  @property
  def consecutive_skipped_updates(self) -> jax.Array:
    """Such ``update()`` calls since the last clean one, int32 ``[]``; the count
    ``max_consecutive_skips`` is checked against."""
    return self._counter("consecutive_skipped")

  @property
  def loss_scale(self) -> jax.Array:
    """The current scale, float32 ``[]`` (a device array: no host read; 1 when disabled)."""
    if not self._enabled:
      return scale_array(1.0)
    return self._scale

  @property
  def growth_tracker(self) -> jax.Array:
    """Consecutive clean updates since the last growth or backoff, int32 ``[]``."""
    if not self._enabled:
      return tracker_array(0)
    return self._growth_tracker

  @property
  def hysteresis_tracker(self) -> jax.Array:
    """Overflowing updates still tolerated before a backoff, int32 ``[]``
    (always 1 with ``hysteresis=1``, torch's rule)."""
    if not self._enabled:
      return tracker_array(1)
    return self._hysteresis_tracker

  def nonfinite_leaf_paths(self, optimizer: Optimizer) -> list[str]:
    """Names (tree paths in ``optimizer.params``) of the gradient leaves that
    held inf/NaN the last time this scaler found inf/NaN in ``optimizer``'s
    gradients (so the last time its step was skipped); ``[]`` if never.

    A host read: call it outside ``jit``.

    Examples:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> scaler = jaxamp.GradScaler()
      >>> opt = jaxamp.Optimizer(optax.sgd(0.1), {"w": jnp.ones(2), "b": jnp.ones(2)})
      >>> _ = scaler.scale(jnp.float32(1.0))
      >>> opt.grads = {"w": jnp.ones(2), "b": jnp.array([1.0, jnp.nan])}
      >>> scaler.step(opt)
      >>> scaler.nonfinite_leaf_paths(opt)
      ["['b']"]
    """
    _key_of(optimizer)
    flags = np.asarray(optimizer.nonfinite_leaves)
    paths = jax.tree_util.tree_flatten_with_path(optimizer.params)[0]
    return [jax.tree_util.keystr(path) for (path, _), flag in zip(paths, flags) if flag]

  # -- getters and setters --------------------------------------------------------

  def get_scale(self) -> float | int:
    """The scale as a Python number (a host read; call outside ``jit``).

    Before the first ``scale()``, the ``init_scale`` (or loaded scale) as
    given, as torch; 1.0 when disabled.
    """
    if not self._enabled:
      return 1.0
    if not self._scaled:
      return self._init_scale
    return float(self._scale)

  def _get_growth_tracker(self) -> int:
    if not self._enabled:
      return 0
    if not self._scaled:
      return self._init_growth_tracker
    return int(self._growth_tracker)

  def _get(self, name: str) -> Any:
    value = getattr(self, name)
    if value is _UNSET:
      raise AttributeError(f"'GradScaler' object has no attribute '{name}'")
    return value

  def get_growth_factor(self) -> float:
    """The growth factor (``AttributeError`` on a disabled scaler, as torch)."""
    return self._get("_growth_factor")

  def set_growth_factor(self, new_factor: float) -> None:
    """Sets the growth factor (a Python number; its range is not checked, as torch)."""
    self._growth_factor = _python_number("new_factor", new_factor)

  def get_backoff_factor(self) -> float:
    """The backoff factor (``AttributeError`` on a disabled scaler, as torch)."""
    return self._get("_backoff_factor")

  def set_backoff_factor(self, new_factor: float) -> None:
    """Sets the backoff factor (a Python number; its range is not checked, as torch)."""
    self._backoff_factor = _python_number("new_factor", new_factor)

  def get_growth_interval(self) -> int:
    """The growth interval (``AttributeError`` on a disabled scaler, as torch)."""
    return self._get("_growth_interval")

  def set_growth_interval(self, new_interval: int) -> None:
    """Sets the growth interval (an int; <= 0 never grows, as torch)."""
    self._growth_interval = _python_number("new_interval", new_interval, integer=True)

  def is_enabled(self) -> bool:
    """Whether the scaler is enabled."""
    return self._enabled

  # -- checkpoints ------------------------------------------------------------------

  def state_dict(self) -> dict[str, Any]:
    """torch's five keys, in torch's order, as plain Python values ({} if disabled).

    Loads into ``torch.amp.GradScaler.load_state_dict`` (and back), continuing
    the run bit for bit. A host read: call outside ``jit``.
    """
    if not self._enabled:
      return {}
    values = (
      self.get_scale(),
      self._growth_factor,
      self._backoff_factor,
      self._growth_interval,
      self._get_growth_tracker(),
    )
    return dict(zip(STATE_DICT_KEYS, values))

  def load_state_dict(self, state_dict: dict[str, Any]) -> None:
    """Loads a dict saved by torch's or jaxamp's ``state_dict()``.

    Everything is checked before anything changes (torch applies the keys one
    by one). The per-optimizer stages are kept, as torch. Disabled: does nothing.

    Raises:
      RuntimeError: an empty dict (torch's message); a scale beyond float32 or
        a tracker beyond int32.
      KeyError: a missing key. ValueError: unexpected keys.
      TypeError: a value of the wrong type.
    """
    if not self._enabled:
      return
    checked = check_state_dict(state_dict)
    scale = scale_array(checked["scale"])
    tracker = tracker_array(checked["_growth_tracker"])
    self._init_scale = checked["scale"]
    self._init_growth_tracker = checked["_growth_tracker"]
    self._growth_factor = checked["growth_factor"]
    self._backoff_factor = checked["backoff_factor"]
    self._growth_interval = checked["growth_interval"]
    self._scale, self._growth_tracker = scale, tracker
    return

  def __repr__(self) -> str:
    if not self._enabled:
      return "jaxamp.GradScaler(enabled=False)"
    return (
      f"jaxamp.GradScaler(growth_factor={self._growth_factor!r}, "
      f"backoff_factor={self._backoff_factor!r}, "
      f"growth_interval={self._growth_interval!r}, "
      f"stages={ {k: r.stage.name for k, r in self._states.items()} })"
    )
