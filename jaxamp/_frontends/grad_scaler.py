"""``GradScaler``: torch's ``torch.amp.GradScaler``, method for method, for JAX.

The torch state machine around the loss-scale core (``_core.advance``, shared
with :func:`~jaxamp.dynamic_loss_scale`, so both give the same scale and skips,
bit for bit). What this class adds is torch's per-optimizer stages and flags
(docs/torch_semantics.md §2)::

             unscale_()              step()  [applies the update iff own found_inf == 0]
    READY ─────────────► UNSCALED ─────────────► STEPPED
      └──────────── step() (implicit unscale_) ────────┘
    update() combines every recorded found_inf into one backoff and resets all to READY
"""

from __future__ import annotations

import enum
import functools
import threading
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp import _engine as engine
from jaxamp._autocast.interpreter import tracing as autocast_tracing
from jaxamp._config import (
  LossScaleConfig,
  check_flag,
  check_new_scale,
  is_array,
  loss_scale_config,
  python_number,
  with_options,
)
from jaxamp._frontends.optimizer import Optimizer, per_param_leaf, updated
from jaxamp._frontends.checkpoint import STATE_DICT_KEYS, check_state_dict
from jaxamp._torch.core import (
  LossScaleCore,
  advance,
  check_skip_limit,
  init_core,
  int32_array,
  scale_array,
)
from jaxamp._torch.scaling import multiply_by_scale
from jaxamp._torch.unscale import finite_leaves, unscale
from jaxamp._validation import (
  arrays_only,
  check_float_gradients,
  check_same_structure,
  with_non_arrays,
)
from jaxamp._xla.compile_cache import call_compiled, traced

# torch's messages (docs/torch_semantics.md §4), raised as RuntimeError where torch asserts.
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
_PICKLE = (
  "A GradScaler instance may only be pickled at the beginning of an iteration, or at the "
  "end after scaler.update()."
)


class _Stage(enum.Enum):
  READY = 0
  UNSCALED = 1
  STEPPED = 2


class _Record(NamedTuple):
  """One optimizer's stage and found_inf (``None``: it had no gradients)."""

  stage: _Stage
  found_inf: jax.Array | None


class _Unset:
  """A hyperparameter of a disabled scaler that no setter has given."""

  def __repr__(self) -> str:
    return "<unset>"

  def __reduce__(self) -> str:
    # The one instance, by name: copies and pickles keep ``value is _UNSET`` true.
    return "_UNSET"


_UNSET = _Unset()
_OWNER_LOCK = threading.Lock()
_DISABLED = LossScaleConfig(
  enabled=False, growth_factor=_UNSET, backoff_factor=_UNSET, growth_interval=_UNSET
)


_IN_AUTOCAST = (
  "jaxamp: GradScaler.scale() was called inside a jaxamp.autocast function, which runs "
  "on its own copy of the scaler: the scaler you step would not know it scaled. Scale "
  "the loss the autocast function returns, outside it, as torch's examples do: "
  "opt.grads = jax.grad(lambda p: scaler.scale(jaxamp.autocast(loss_fn)(p, x)))(opt.params). "
  "Nothing was changed."
)


def _step_unless(static, found_inf, grads, params, opt_state, extra_args):
  """``(params, opt_state)`` after one ``tx`` update, or as given when ``found_inf``
  (with the schedules advanced, for ``schedule_counts="iterations"``)."""
  tx, schedule_counts = static

  def update(params, opt_state):
    return updated(tx, grads, opt_state, params, **extra_args)

  apply, output_types = engine.with_output_types(update)

  def skip(params, opt_state):
    _, state_type = output_types(params, opt_state)
    return params, engine.typed_like(engine.skipped_state(opt_state, schedule_counts), state_type)

  return engine.apply_or_skip(found_inf, apply, skip, params, opt_state)


def _unscale_and_check(detect_unscale_overflow, grads, loss_scale):
  """``grads`` unscaled, each leaf's finiteness and whether any leaf is not finite."""
  finite = finite_leaves(grads, loss_scale, detect_unscale_overflow)
  return unscale(grads, loss_scale), finite, ~jnp.all(finite)


def _advance(static, core: LossScaleCore, found_inf: jax.Array) -> LossScaleCore:
  config, eager = static
  return advance(core, found_inf, config, eager=eager)


def _under_jit(x: Any) -> bool:
  """Whether ``x`` is traced by ``jit`` (not only differentiated eagerly: a
  ported torch loop calls ``jax.grad(lambda p: scaler.scale(...))`` outside jit)."""
  while isinstance(x, jax.core.Tracer) and hasattr(x, "primal"):  # JVP, linearize
    x = x.primal
  return isinstance(x, jax.core.Tracer)


def _in_iteration(method):
  """Wraps a method that claims the scaler for its thread (``_claim``): if the call
  raises, the claim it made is undone, as every other change of a refused call."""

  @functools.wraps(method)
  def wrapper(self, *args, **kwargs):
    before = self.__dict__.get("_owner")
    try:
      return method(self, *args, **kwargs)
    except BaseException:
      me = threading.current_thread()
      with _OWNER_LOCK:
        if self.__dict__.get("_owner") is me and before is not me:
          if before is None:
            self.__dict__.pop("_owner", None)
          else:
            self._owner = before if not before.is_alive() else None
      raise

  return wrapper


def _key_of(optimizer: Any) -> int:
  if not isinstance(optimizer, Optimizer):
    raise TypeError(
      "jaxamp.GradScaler expects a jaxamp.Optimizer (an optax transformation "
      f"with its params, state and grads), got {type(optimizer).__name__}."
    )
  return optimizer._key


@with_options(
  positional=("init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled"),
  exclude=("axis_name", "param_labels"),
  torch_style=True,
)
@jax.tree_util.register_pytree_node_class
class GradScaler:
  """torch's ``GradScaler`` for JAX: the same methods, messages and arithmetic.

  torch -> jaxamp (docs/grad_scaler.md has the three reference loops)::

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
  return them: inside ``jit`` the methods change the traced copies. The
  scaler is a pytree: the core's arrays and the recorded found_inf flags are
  its children; the configuration and the stages are static. Where it
  deliberately differs from torch: docs/torch_semantics.md.

  Its options are :func:`~jaxamp.dynamic_loss_scale`'s (but ``axis_name`` and
  ``param_labels``), as Python numbers; torch's five come first and may be
  given by position. One default differs, to keep torch's semantics in a
  torch port: ``schedule_counts="iterations"``, the schedules in the optimizer
  state advance on a skipped step, as torch's ``scheduler.step()`` does. ``update()`` applies them to the found_inf combined over
  all optimizers (``detect_unscale_overflow``: ``unscale_``/``step``).

  Args:
    {options}

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

  def __init__(self, **options: Any):
    """Creates a scaler; see the class docstring."""
    self._core: LossScaleCore  # None when disabled: no method reads it then
    self._states: dict[int, _Record] = {}
    self._scaled = False
    self._init_growth_tracker = 0
    check_flag("enabled", options["enabled"])
    if not options["enabled"]:
      self._config, self._core = _DISABLED, None  # type: ignore[assignment]
      return
    self._config = loss_scale_config(static=True, **options)
    self._core = init_core(self._config)

  @property
  def _enabled(self) -> bool:
    return self._config.enabled

  # -- pytree -------------------------------------------------------------------

  def tree_flatten(self) -> tuple[tuple, tuple]:
    # The static half is read from the static fields only (a found_inf that is
    # None is a None child, not a flag): eqx.partition replaces the array
    # children by None, and both halves must carry the same static data.
    keys = tuple(self._states)
    children = (self._core, tuple(self._states[k].found_inf for k in keys))
    stages = tuple((k, self._states[k].stage) for k in keys)
    return children, (self._config, self._init_growth_tracker, stages)

  @classmethod
  def tree_unflatten(cls, static: tuple, children: tuple) -> GradScaler:
    scaler = object.__new__(cls)
    scaler._config, scaler._init_growth_tracker, stages = static
    scaler._core, found_infs = children
    scaler._states = {
      key: _Record(stage, found_inf) for (key, stage), found_inf in zip(stages, found_infs)
    }
    # Not static: a first scale() inside a jitted loop would retrace its second call.
    scaler._scaled = True
    return scaler

  # -- the iteration --------------------------------------------------------------

  def _claim(self, funcname: str) -> None:
    """Makes the calling thread the owner of the iteration (``scale`` to ``update``),
    refusing a second live thread: torch's iteration spans several calls and
    ``update`` consumes every optimizer's flags, so interleaved threads would mix
    their iterations. A thread that has ended owns nothing: an iteration it left
    unfinished (it raised) does not lock the scaler, and the next thread continues
    from the stages it left, as torch (docs/torch_semantics.md §1.13)."""
    me = threading.current_thread()
    with _OWNER_LOCK:
      owner = self.__dict__.get("_owner")
      if owner is None or owner is me or not owner.is_alive():
        self._owner = me
        return
    raise RuntimeError(
      f"jaxamp: this GradScaler is being used from two threads: {funcname}() called from "
      f"thread {me.name!r} while thread {owner.name!r} is in an iteration (from scale() "
      "to update()). Give each thread its own scaler (torch's GradScaler is not "
      "thread-safe either), or end the other thread's iteration (scaler.update() in that "
      "thread, or let the thread finish) first. Nothing was changed."
    )

  def _release(self) -> None:
    with _OWNER_LOCK:
      self.__dict__.pop("_owner", None)

  # -- copies and pickles -----------------------------------------------------------

  def __getstate__(self) -> dict[str, Any]:
    """What ``copy``, ``deepcopy`` and ``pickle`` keep: as torch, only between
    iterations (the records name optimizers by identity, which a copy cannot keep),
    and the copy starts unowned, like a scaler before its first ``scale()`` at the
    current scale and tracker (docs/torch_semantics.md §1.10)."""
    if self._enabled and self._states:
      raise RuntimeError(
        f"{_PICKLE} (jaxamp: this scaler has recorded unscale_()/step() for "
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

  def _check_scaled(self, funcname: str) -> None:
    if not self._scaled:
      raise RuntimeError(_NOT_SCALED.format(funcname))

  def _check_not_captured(self, funcname: str, values: Any) -> None:
    """Raises if ``values`` are traced by ``jit`` but this scaler is not: it was
    captured from outside the jitted function, where the scale is a frozen
    constant and ``update`` would leak a tracer into the Python object."""
    if isinstance(self._core.loss_scale, jax.core.Tracer):
      return
    if traced(values):
      raise RuntimeError(
        f"jaxamp: GradScaler.{funcname}() ran inside a traced function on a scaler "
        "captured from outside it, whose scale would stay frozen. Pass the scaler "
        "to the jitted function as an argument and return it (as the optimizers). "
        "Nothing was changed."
      )

  @_in_iteration
  def scale(self, outputs: Any) -> Any:
    """Multiplies ``outputs`` (an array, or nested lists/tuples of arrays) by the scale.

    The product has torch's dtype (that of :func:`~jaxamp.scale_loss`): a
    0-dim float16/bfloat16/float32 loss gives float32 (so ``float16(2.0)``
    times 65536 is 131072, not inf); float64 stays float64; a >=1-dim
    low-precision array keeps its dtype. Disabled: returns ``outputs`` itself.

    Args:
      outputs: the loss, a floating array, or nested lists/tuples of them.

    Raises:
      ValueError: an element is not an array (torch's message).
      RuntimeError: called inside a ``jaxamp.autocast`` function (which runs
        a copy of the scaler); scale the loss it returns instead.

    Examples:
      >>> import jax.numpy as jnp, jaxamp
      >>> jaxamp.GradScaler().scale(jnp.float16(2.0))
      Array(131072., dtype=float32)
    """
    if not self._enabled:
      return outputs
    if autocast_tracing():  # autocast runs a rebuilt copy: its _scaled would be lost
      raise RuntimeError(_IN_AUTOCAST)
    self._claim("scale")
    if any(_under_jit(x) for x in jax.tree.leaves(outputs)):
      self._check_not_captured("scale", outputs)
    found_array = False

    def apply(value):
      nonlocal found_array
      if is_array(value):
        found_array = True
        return multiply_by_scale(value, self._core.loss_scale)
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

  def _unscaled(self, optimizer: Optimizer) -> tuple[Any, jax.Array | None, jax.Array | None]:
    """``optimizer``'s grads unscaled, its found_inf (None: no grads), and its
    ``nonfinite_leaves`` as they become (None: unchanged). Changes nothing."""
    grads = optimizer.grads
    if grads is None or not jax.tree.leaves(grads):
      return grads, None, None
    check_float_gradients(grads)
    check_same_structure(grads, optimizer.params)
    grads, finite, found_inf = call_compiled(
      _unscale_and_check, self._config.detect_unscale_overflow, grads, self._core.loss_scale
    )
    nonfinite = per_param_leaf(grads, optimizer.params, ~finite)
    if nonfinite is not None and optimizer.nonfinite_leaves is not None:
      nonfinite = jnp.where(found_inf, nonfinite, optimizer.nonfinite_leaves)
    else:
      nonfinite = None
    return grads, found_inf, nonfinite

  @_in_iteration
  def unscale_(self, optimizer: Optimizer) -> None:
    """Unscales ``optimizer.grads`` in place and records whether they held inf/NaN.

    Call it before changing the gradients (e.g. clipping by global norm);
    ``step`` then uses the found_inf recorded here, not re-checking.

    Args:
      optimizer: the :class:`Optimizer` whose ``grads`` are unscaled.

    Raises:
      RuntimeError: before any ``scale()``, or if ``unscale_`` or ``step``
        was already called on this optimizer since the last ``update()``.
    """
    if not self._enabled:
      return
    key = _key_of(optimizer)
    self._claim("unscale_")
    self._check_scaled("unscale_")
    self._check_not_captured("unscale_", optimizer.grads)
    stage = self._states.get(key, _Record(_Stage.READY, None)).stage
    if stage is _Stage.UNSCALED:
      raise RuntimeError(_UNSCALE_TWICE)
    if stage is _Stage.STEPPED:
      raise RuntimeError(_UNSCALE_AFTER_STEP)
    grads, found_inf, nonfinite = self._unscaled(optimizer)
    optimizer.grads = grads
    if nonfinite is not None:
      optimizer.nonfinite_leaves = nonfinite
    self._states = {**self._states, key: _Record(_Stage.UNSCALED, found_inf)}

  @_in_iteration
  def step(self, optimizer: Optimizer, **extra_args: Any) -> None:
    """Applies ``optimizer``'s update unless its own gradients held inf/NaN.

    Unscales first if ``unscale_`` was not called. The update runs under
    ``lax.cond``: on a skipped step ``params`` are returned untouched, bit for
    bit, and so is ``opt_state`` but for its schedules' counts, which advance
    as torch's ``scheduler.step()`` (``schedule_counts``; Adam's own count
    does not advance). ``opt.grads`` holds
    the unscaled gradients afterwards, inf/NaN included. Keyword arguments are
    passed to ``tx.update``. Disabled: ``optimizer.step(**extra_args)``.

    Args:
      optimizer: the :class:`Optimizer` to step; ``optimizer.grads`` holds the
        gradients of the scaled loss (or those ``unscale_`` unscaled).
      **extra_args: passed to ``tx.update``.

    Raises:
      RuntimeError: ``closure=`` given; before any ``scale()``; ``step``
        already called since the last ``update()``; no gradients to check.
    """
    if not self._enabled:
      return optimizer.step(**extra_args)
    if "closure" in extra_args:
      raise RuntimeError(_CLOSURE)
    key = _key_of(optimizer)
    self._claim("step")
    self._check_scaled("step")
    self._check_not_captured("step", (optimizer.grads, optimizer.params))
    record = self._states.get(key, _Record(_Stage.READY, None))
    if record.stage is _Stage.STEPPED:
      raise RuntimeError(_STEP_TWICE)
    nonfinite = None
    if record.stage is _Stage.READY:
      grads, found_inf, nonfinite = self._unscaled(optimizer)
    else:
      grads, found_inf = optimizer.grads, record.found_inf
    if found_inf is None:
      raise RuntimeError(_NO_CHECKS_OPTIMIZER)
    if grads is None:  # zero_grad() after unscale_: torch's step updates nothing
      self._states = {**self._states, key: _Record(_Stage.STEPPED, found_inf)}
      return
    static = (optimizer.tx, self._config.schedule_counts)
    params, opt_state = call_compiled(
      _step_unless,
      static,
      found_inf,
      grads,
      arrays_only(optimizer.params),
      optimizer.opt_state,
      extra_args,
    )
    params = with_non_arrays(params, optimizer.params)

    optimizer.grads, optimizer.params, optimizer.opt_state = grads, params, opt_state
    if nonfinite is not None:
      optimizer.nonfinite_leaves = nonfinite
    self._states = {**self._states, key: _Record(_Stage.STEPPED, found_inf)}

  @_in_iteration
  def update(self, new_scale: float | jax.Array | None = None) -> None:
    """Updates the scale from this iteration's found_inf flags, and resets the stages.

    One backoff if any optimizer recorded inf/NaN (however many did), else one
    step towards growth: torch's ``_amp_update_scale_``, bit for bit, with the
    options, as in :func:`~jaxamp.dynamic_loss_scale`; the counters advance.
    ``new_scale`` sets the scale instead, as given (not clamped: the bounds
    apply from the next ``update()``), leaving the trackers and counters.

    Args:
      new_scale: ``None``, or a finite float / 0-dim floating-point array.

    Raises:
      RuntimeError: before any ``scale()``; no ``unscale_``/``step`` recorded
        an inf check since the last update; a ``new_scale`` beyond float32;
        ``max_consecutive_skips`` reached (from the computation under ``jit``;
        a ``checkify`` error under ``checkify``).
      TypeError, ValueError: a ``new_scale`` of the wrong kind or not finite.
    """
    if not self._enabled:
      return
    self._claim("update")
    self._check_scaled("update")
    self._check_not_captured("update", ([r.found_inf for r in self._states.values()], new_scale))
    if new_scale is not None:
      self._core = self._core._replace(loss_scale=check_new_scale(new_scale))
      self._states = {}
      self._release()
      return
    found_infs = [r.found_inf for r in self._states.values() if r.found_inf is not None]
    if not found_infs:
      raise RuntimeError(_NO_CHECKS_UPDATE)
    found_inf = functools.reduce(jnp.logical_or, found_infs)
    eager = not traced((self._core, found_inf))
    core = call_compiled(_advance, (self._config, eager), self._core, found_inf)
    if eager:
      check_skip_limit(core, self._config)
    self._core = core
    self._states = {}
    self._release()

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
    """Such ``update()`` calls since the last clean one, int32 ``[]``; the count
    ``max_consecutive_skips`` is checked against."""
    return self._core_field("consecutive_skipped_steps", 0)

  @property
  def hysteresis_tracker(self) -> jax.Array:
    """Overflowing updates still tolerated before a backoff, int32 ``[]``
    (always 1 with ``hysteresis=1``, torch's rule)."""
    return self._core_field("hysteresis_tracker", 1)

  def nonfinite_leaf_paths(self, optimizer: Optimizer) -> list[str]:
    """Names (tree paths in ``optimizer.params``) of the gradient leaves that
    held inf/NaN the last time this scaler found inf/NaN in ``optimizer``'s
    gradients (so the last time its step was skipped); ``[]`` if never.

    Args:
      optimizer: the :class:`Optimizer` whose last skipped step is asked about.

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

  def get_scale(self) -> float | int | jax.Array:
    """The scale as a Python number; inside ``jit``, as a float32 ``[]`` array.

    torch code that reads it inside the iteration (the gradient penalty's
    ``1. / scaler.get_scale()``, clipping still-scaled gradients at
    ``max_norm * scaler.get_scale()``) so runs unchanged under ``jax.jit``.
    Outside ``jit`` it is a host read. Before the first ``scale()``, the
    ``init_scale`` (or loaded scale) as given, as torch; 1.0 when disabled.

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
      new_factor: what the scale is multiplied by after ``growth_interval``
        steps in a row with finite gradients.
    """
    self._set("growth_factor", new_factor)

  def get_backoff_factor(self) -> float:
    """The backoff factor (``AttributeError`` on a disabled scaler, as torch)."""
    return self._get("backoff_factor")

  def set_backoff_factor(self, new_factor: float) -> None:
    """Sets the backoff factor (a Python number; its range is not checked, as torch).

    Args:
      new_factor: what the scale is multiplied by after a step whose gradients
        held inf/NaN.
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
    """torch's five keys, in torch's order, as plain Python values ({} if disabled).

    Loads into ``torch.amp.GradScaler.load_state_dict`` (and back), continuing
    the run bit for bit. A host read: call outside ``jit``.
    """
    if not self._enabled:
      return {}
    config = self._config
    values = (
      self.get_scale(),
      config.growth_factor,
      config.backoff_factor,
      config.growth_interval,
      self._get_growth_tracker(),
    )
    return dict(zip(STATE_DICT_KEYS, values))

  def load_state_dict(self, state_dict: dict[str, Any]) -> None:
    """Loads a dict saved by torch's or jaxamp's ``state_dict()``.

    Everything is checked before anything changes (torch applies the keys one
    by one). The per-optimizer stages are kept, as torch. Disabled: does nothing.

    Args:
      state_dict: what ``state_dict()`` returned, torch's or jaxamp's (``scale``,
        ``growth_factor``, ``backoff_factor``, ``growth_interval``,
        ``_growth_tracker``).

    Raises:
      RuntimeError: an empty dict (torch's message); a scale beyond float32 or
        a tracker beyond int32.
      KeyError: a missing key. ValueError: unexpected keys; a scale that is
        not finite and positive.
      TypeError: a value of the wrong type.
    """
    if not self._enabled:
      return
    checked = check_state_dict(state_dict)
    self._config = self._config.replace(
      init_scale=checked["scale"],
      growth_factor=checked["growth_factor"],
      backoff_factor=checked["backoff_factor"],
      growth_interval=checked["growth_interval"],
    )
    self._init_growth_tracker = checked["_growth_tracker"]
    self._core = self._core._replace(
      loss_scale=scale_array(checked["scale"]),
      growth_tracker=int32_array(checked["_growth_tracker"]),
    )

  def __repr__(self) -> str:
    if not self._enabled:
      return "jaxamp.GradScaler(enabled=False)"
    config = self._config
    return (
      f"jaxamp.GradScaler(growth_factor={config.growth_factor!r}, "
      f"backoff_factor={config.backoff_factor!r}, "
      f"growth_interval={config.growth_interval!r}, "
      f"stages={ {k: r.stage.name for k, r in self._states.items()} })"
    )
