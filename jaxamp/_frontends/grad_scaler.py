"""``GradScaler``: torch's ``torch.amp.GradScaler``, method for method, for JAX.

torch's iteration (:mod:`scaler_stages`) over what the scaler holds
(:mod:`scaler_state`) and the core :func:`~jaxamp.dynamic_loss_scale` shares.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp import _engine as engine
from jaxamp._autocast.modes import tracing as autocast_tracing
from jaxamp._frontends import scaler_stages as stages
from jaxamp._frontends.optimizer import Optimizer, per_param_leaf, updated
from jaxamp._frontends.scaler_stages import Record, Stage, in_iteration, key_of
from jaxamp._frontends.scaler_state import ScalerState
from jaxamp._hyperparams import check_new_scale, is_array
from jaxamp._torch.core import LossScaleCore, advance, check_skip_limit
from jaxamp._torch.scaling import multiply_by_scale
from jaxamp._torch.unscale import finite_leaves, unscale
from jaxamp._validation import (
  arrays_only,
  check_float_gradients,
  check_same_structure,
  with_non_arrays,
)
from jaxamp._xla.compile_cache import call_compiled, traced


def _step_unless(static, found_inf, grads, params, opt_state, extra_args):
  """``(params, opt_state)`` after one ``tx`` update, or as given (schedules aside) if found_inf."""
  tx, schedule_counts = static

  def update(params, opt_state):
    return updated(tx, grads, opt_state, params, **extra_args)

  apply, output_types = engine.with_output_types(update)

  def skip(params, opt_state):
    _, state_type = output_types(params, opt_state)
    state = engine.skipped_state(opt_state, schedule_counts, lambda: update(params, opt_state)[1])
    return params, engine.typed_like(state, state_type)

  return engine.apply_or_skip(found_inf, apply, skip, params, opt_state)


def _unscale_and_check(detect_unscale_overflow, grads, loss_scale):
  """``grads`` unscaled, each leaf's finiteness and whether any leaf is not finite."""
  finite = finite_leaves(grads, loss_scale, detect_unscale_overflow)
  return unscale(grads, loss_scale), finite, ~jnp.all(finite)


def _advance(static, core: LossScaleCore, found_inf: jax.Array) -> LossScaleCore:
  config, eager = static
  return advance(core, found_inf, config, eager=eager)


@jax.tree_util.register_pytree_node_class
class GradScaler(ScalerState):
  """torch's ``GradScaler`` for JAX: the same methods, messages and arithmetic.

  The methods change the scaler and the optimizer in place, as in torch; under ``jax.jit``,
  pass both in and return them (pytrees). docs/grad_scaler.md maps torch's loop line by
  line; docs/torch_semantics.md lists the differences.

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

  # -- pytree -------------------------------------------------------------------

  def tree_flatten(self) -> tuple[tuple, tuple]:
    # Static data from static fields only: eqx.partition turns the array children
    # into None, and both halves must carry the same static data.
    keys = tuple(self._states)
    children = (self._core, tuple(self._states[k].found_inf for k in keys))
    by_key = tuple((k, self._states[k].stage) for k in keys)
    return children, (self._config, self._init_growth_tracker, by_key)

  @classmethod
  def tree_unflatten(cls, static: tuple, children: tuple) -> GradScaler:
    scaler = object.__new__(cls)
    scaler._config, scaler._init_growth_tracker, by_key = static
    scaler._core, found_infs = children
    scaler._states = {
      key: Record(stage, found_inf) for (key, stage), found_inf in zip(by_key, found_infs)
    }
    # Not static: a first scale() inside a jitted loop would retrace its second call.
    scaler._scaled = True
    return scaler

  def _begin(self, funcname: str, values: Any) -> None:
    """The checks before ``unscale_``, ``step`` and ``update`` (``values``: their arrays)."""
    stages.claim(self, funcname)
    if not self._scaled:
      raise RuntimeError(stages.NOT_SCALED.format(funcname))
    self._check_not_captured(funcname, values)

  def _check_not_captured(self, funcname: str, values: Any) -> None:
    """Raises if ``values`` are traced but the scaler is not: captured from outside."""
    if isinstance(self._core.loss_scale, jax.core.Tracer):
      return
    if traced(values):
      raise RuntimeError(
        f"jaxamp: GradScaler.{funcname}() ran inside a traced function on a scaler "
        "captured from outside it, whose scale would stay frozen. Pass the scaler "
        "to the jitted function as an argument and return it (as the optimizers). "
        "Nothing was changed."
      )

  @in_iteration
  def scale(self, outputs: Any) -> Any:
    """Multiplies ``outputs`` (an array, or nested lists/tuples of arrays) by the scale.

    In torch's dtype, as :func:`~jaxamp.scale_loss`: a 0-dim loss gives float32,
    float64 stays float64. Disabled: returns ``outputs`` itself.

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
      raise RuntimeError(stages.IN_AUTOCAST)
    stages.claim(self, "scale")
    if any(stages.under_jit(x) for x in jax.tree.leaves(outputs)):
      self._check_not_captured("scale", outputs)
    found_array = False

    def apply(value):
      nonlocal found_array
      if is_array(value):
        found_array = True
        return multiply_by_scale(value, self._core.loss_scale)
      if isinstance(value, (list, tuple)):
        scaled = [apply(v) for v in value]
        return type(value)(*scaled) if hasattr(value, "_fields") else type(value)(scaled)
      raise ValueError(
        f"{stages.OUTPUTS} (jaxamp: got {type(value).__name__}; pass a JAX array, "
        "or a list/tuple of them)"
      )

    result = apply(outputs)
    if found_array:
      self._scaled = True
    return result

  def _unscaled(self, optimizer: Optimizer) -> tuple[Any, jax.Array | None, jax.Array | None]:
    """``optimizer``'s unscaled grads, found_inf and new ``nonfinite_leaves`` (None: none)."""
    grads = optimizer.grads
    if grads is None or not jax.tree.leaves(grads):
      return grads, None, None
    check_float_gradients(grads)
    check_same_structure(grads, optimizer.params)
    grads, finite, found_inf = call_compiled(
      _unscale_and_check, self._config.detect_unscale_overflow, grads, self._core.loss_scale
    )
    nonfinite = per_param_leaf(grads, optimizer.params, ~finite)
    if nonfinite is None or optimizer.nonfinite_leaves is None:
      return grads, found_inf, None
    return grads, found_inf, jnp.where(found_inf, nonfinite, optimizer.nonfinite_leaves)

  @in_iteration
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
    key = key_of(optimizer)
    self._begin("unscale_", optimizer.grads)
    stage = self._states.get(key, stages.READY).stage
    if stage is Stage.UNSCALED:
      raise RuntimeError(stages.UNSCALE_TWICE)
    if stage is Stage.STEPPED:
      raise RuntimeError(stages.UNSCALE_AFTER_STEP)
    grads, found_inf, nonfinite = self._unscaled(optimizer)
    optimizer.grads = grads
    if nonfinite is not None:
      optimizer.nonfinite_leaves = nonfinite
    self._states = {**self._states, key: Record(Stage.UNSCALED, found_inf)}

  @in_iteration
  def step(self, optimizer: Optimizer, **extra_args: Any) -> None:
    """Applies ``optimizer``'s update unless its own gradients held inf/NaN.

    Unscales first if ``unscale_`` was not called. A skipped step leaves ``params`` and
    ``opt_state`` but for the schedules' counts (``schedule_counts``); ``opt.grads`` holds
    the unscaled gradients afterwards. Disabled: ``optimizer.step(**extra_args)``.

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
      raise RuntimeError(stages.CLOSURE)
    key = key_of(optimizer)
    self._begin("step", (optimizer.grads, optimizer.params))
    record = self._states.get(key, stages.READY)
    if record.stage is Stage.STEPPED:
      raise RuntimeError(stages.STEP_TWICE)
    if record.stage is Stage.READY:
      grads, found_inf, nonfinite = self._unscaled(optimizer)
    else:
      grads, found_inf, nonfinite = optimizer.grads, record.found_inf, None
    if found_inf is None:
      raise RuntimeError(stages.NO_CHECKS_OPTIMIZER)
    if grads is None:  # zero_grad() after unscale_: torch's step updates nothing
      self._states = {**self._states, key: Record(Stage.STEPPED, found_inf)}
      return
    static, arrays = (optimizer.tx, self._config.schedule_counts), arrays_only(optimizer.params)
    params, opt_state = call_compiled(
      _step_unless, static, found_inf, grads, arrays, optimizer.opt_state, extra_args
    )
    params = with_non_arrays(params, optimizer.params, grads)
    optimizer.grads, optimizer.params, optimizer.opt_state = grads, params, opt_state
    if nonfinite is not None:
      optimizer.nonfinite_leaves = nonfinite
    self._states = {**self._states, key: Record(Stage.STEPPED, found_inf)}

  @in_iteration
  def update(self, new_scale: float | jax.Array | None = None) -> None:
    """Updates the scale from this iteration's found_inf flags, and resets the stages.

    One backoff if any optimizer recorded inf/NaN, else one step towards growth,
    torch's rule bit for bit with the options. ``new_scale`` sets the scale
    instead, unclamped, leaving the trackers and counters.

    Args:
      new_scale: ``None``, or a finite float / 0-dim floating-point array.

    Raises:
      RuntimeError: before any ``scale()``; no inf check recorded since the last
        update; a ``new_scale`` beyond float32; ``max_consecutive_skips`` reached.
      TypeError, ValueError: a ``new_scale`` of the wrong kind or not finite.
    """
    if not self._enabled:
      return
    self._begin("update", ([r.found_inf for r in self._states.values()], new_scale))
    if new_scale is not None:
      self._core = self._core._replace(loss_scale=check_new_scale(new_scale))
    else:
      found_infs = [r.found_inf for r in self._states.values() if r.found_inf is not None]
      if not found_infs:
        raise RuntimeError(stages.NO_CHECKS_UPDATE)
      found_inf = functools.reduce(jnp.logical_or, found_infs)
      eager = not traced((self._core, found_inf))
      core = call_compiled(_advance, (self._config, eager), self._core, found_inf)
      if eager:
        check_skip_limit(core, self._config)
      self._core = core
    self._states = {}
    stages.release(self)

  def nonfinite_leaf_paths(self, optimizer: Optimizer) -> list[str]:
    """Paths of the gradient leaves that held inf/NaN at the last skipped step (host read).

    Args:
      optimizer: the :class:`Optimizer` whose last skipped step is asked about.

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
    key_of(optimizer)
    flags = np.asarray(optimizer.nonfinite_leaves)
    paths = jax.tree_util.tree_flatten_with_path(optimizer.params)[0]
    return [jax.tree_util.keystr(path) for (path, _), flag in zip(paths, flags) if flag]
