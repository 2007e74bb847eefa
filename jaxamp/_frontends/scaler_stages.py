"""A ``GradScaler`` iteration's bookkeeping, from ``scale()`` to ``update()``.

torch's per-optimizer stages (READY, UNSCALED, STEPPED; docs/torch_semantics.md §2) and
its messages (§4), and the one thread an iteration belongs to.
"""

from __future__ import annotations

import enum
import functools
import threading
from typing import Any, NamedTuple

import jax

from jaxamp._frontends.optimizer import Optimizer
from jaxamp._frontends.state_access import is_loss_scale_state

# torch's messages (docs/torch_semantics.md §4), raised as RuntimeError where torch asserts.
NOT_SCALED = (
  "Attempted {} but _scale is None.  This may indicate your script did not use "
  "scaler.scale(loss or outputs) earlier in the iteration."
)
OUTPUTS = "outputs must be a Tensor or an iterable of Tensors"
UNSCALE_TWICE = "unscale_() has already been called on this optimizer since the last update()."
UNSCALE_AFTER_STEP = "unscale_() is being called after step()."
CLOSURE = "Closure use is not currently supported if GradScaler is enabled."
STEP_TWICE = "step() has already been called since the last update()."
NO_CHECKS_OPTIMIZER = "No inf checks were recorded for this optimizer."
NO_CHECKS_UPDATE = "No inf checks were recorded prior to update."
PICKLE = (
  "A GradScaler instance may only be pickled at the beginning of an iteration, or at the "
  "end after scaler.update()."
)
IN_AUTOCAST = (
  "jaxamp: GradScaler.scale() was called inside a jaxamp.autocast function, which runs "
  "on its own copy of the scaler: the scaler you step would not know it scaled. Scale "
  "the loss the autocast function returns, outside it, as torch's examples do: "
  "opt.grads = jax.grad(lambda p: scaler.scale(jaxamp.autocast(loss_fn)(p, x)))(opt.params). "
  "Nothing was changed."
)


class Stage(enum.Enum):
  READY = 0
  UNSCALED = 1
  STEPPED = 2


class Record(NamedTuple):
  """One optimizer's stage and found_inf (``None``: it had no gradients)."""

  stage: Stage
  found_inf: jax.Array | None


READY = Record(Stage.READY, None)


def key_of(optimizer: Any) -> int:
  """The key of ``optimizer``'s record."""
  if not isinstance(optimizer, Optimizer):
    raise TypeError(
      "jaxamp.GradScaler expects a jaxamp.Optimizer (an optax transformation "
      f"with its params, state and grads), got {type(optimizer).__name__}."
    )
  inner_scalers = jax.tree.leaves(optimizer.opt_state, is_leaf=is_loss_scale_state)
  if any(is_loss_scale_state(x) and x.config.enabled for x in inner_scalers):
    raise ValueError(
      "jaxamp.GradScaler: this Optimizer's transformation holds a jaxamp.dynamic_loss_scale, "
      "a second loss scaler: the gradients would be unscaled by both scales. Build the "
      "Optimizer with the plain optimizer (jaxamp.Optimizer(optax.sgd(...), params)), "
      "or drop the GradScaler and call opt.step() alone."
    )
  return optimizer._key


def under_jit(x: Any) -> bool:
  """Whether ``x`` is traced by ``jit``, not only differentiated outside it."""
  while isinstance(x, jax.core.Tracer) and hasattr(x, "primal"):  # JVP, linearize
    x = x.primal
  return isinstance(x, jax.core.Tracer)


# -- the thread that owns the iteration ---------------------------------------------

_OWNER_LOCK = threading.Lock()


def claim(scaler: Any, funcname: str) -> None:
  """Makes the calling thread the owner of ``scaler``'s iteration (``scale`` to
  ``update``), refusing a second live thread, whose flags would mix with its own;
  a thread that has ended owns nothing (docs/torch_semantics.md §1.13)."""
  me = threading.current_thread()
  with _OWNER_LOCK:
    owner = scaler.__dict__.get("_owner")
    if owner is None or owner is me or not owner.is_alive():
      scaler._owner = me
      return
  raise RuntimeError(
    f"jaxamp: this GradScaler is being used from two threads: {funcname}() called from "
    f"thread {me.name!r} while thread {owner.name!r} is in an iteration (from scale() "
    "to update()). Give each thread its own scaler (torch's GradScaler is not "
    "thread-safe either), or end the other thread's iteration (scaler.update() in that "
    "thread, or let the thread finish) first. Nothing was changed."
  )


def release(scaler: Any) -> None:
  """Ends the iteration: no thread owns ``scaler``."""
  with _OWNER_LOCK:
    scaler.__dict__.pop("_owner", None)


def in_iteration(method):
  """Wraps a method that claims the scaler (:func:`claim`): a call that raises undoes it."""

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
