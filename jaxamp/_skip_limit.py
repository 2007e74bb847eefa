"""The ``max_consecutive_skips`` error: one message, raised on the host, from a
jitted computation, or returned as data under ``jax.experimental.checkify``.

Inside ``jit`` the check is one primitive: lowered, a host callback that fails the
computation; under ``checkify.checkify(step)``, a ``checkify`` error, so the step
still returns its (valid) params and state (docs/protections.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jaxamp._xla.jax_internals import checkify as _checkify
from jaxamp._xla.jax_internals import debug_effect


def skip_limit_message(consecutive, update, scale, limit, state_note: str = "") -> str:
  """The error's text; ``state_note``, on what the caller holds, goes before the advice."""
  return (
    f"jaxamp: {int(consecutive)} consecutive optimizer steps were skipped because "
    f"the gradients held inf or NaN (max_consecutive_skips={int(limit)}), at "
    f"update {int(update)}, with the loss scale now {float(scale)!r}. {state_note}"
    "The loss itself is probably inf/NaN; check the model and data, or lower the "
    "learning rate."
  )


def check_on_host(consecutive, update, scale, limit: int | None) -> None:
  """Outside ``jit``: raises ``RuntimeError`` when ``consecutive`` reached ``limit``."""
  if limit is not None and int(consecutive) >= limit:
    message = skip_limit_message(consecutive, update, scale, limit)
    raise RuntimeError(message + " Nothing was changed.")


class SkipLimitError(_checkify.FailedCheckError):
  """The ``checkify`` form of the error (a user check: on by default)."""

  def __str__(self):
    valid = (
      "The params and optimizer state this step returned are valid: the skipped "
      "steps left them unchanged. "
    )
    return skip_limit_message(*self.args, state_note=valid)


def _raise(consecutive, update, scale, limit):
  message = skip_limit_message(consecutive, update, scale, limit)
  raise FloatingPointError(
    message + " To keep donated params and optimizer state when this happens, wrap "
    "the jitted step in jax.experimental.checkify.checkify and call err.throw() "
    "after it (docs/protections.md)."
  )


def _staged(consecutive, update, scale, limit):
  jax.lax.cond(
    consecutive >= limit,
    lambda: jax.debug.callback(_raise, consecutive, update, scale, limit),
    lambda: None,
  )
  return []


def _as_checkify_error(error, enabled_errors, consecutive, update, scale, limit):
  del enabled_errors  # a user check (FailedCheckError's effect): checkify's default
  new = SkipLimitError(_checkify.get_traceback(), "", consecutive, update, scale, limit)
  return _checkify.assert_func(error, consecutive >= limit, new), []


def _batched(args, dims):
  """Under ``vmap``: the check of the member closest to (or past) its limit."""
  values = jnp.broadcast_arrays(
    *(batching.bdim_at_front(a, d, 1) if d is not None else a for a, d in zip(args, dims))
  )
  consecutive, _, _, limit = (x.reshape(-1) for x in values)
  worst = jnp.argmax(consecutive - limit)
  _skip_limit_p.bind(*(x.reshape(-1)[worst] for x in values))
  return [], []


_DTYPES = (jnp.int32, jnp.int32, jnp.float32, jnp.int32)
_skip_limit_p = Primitive("jaxamp_skip_limit")
_skip_limit_p.multiple_results = True
_skip_limit_p.def_effectful_abstract_eval(lambda *_: ([], {debug_effect}))
_skip_limit_p.def_impl(_staged)
mlir.register_lowering(_skip_limit_p, mlir.lower_fun(_staged, multiple_results=True))
batching.primitive_batchers[_skip_limit_p] = _batched
_checkify.error_checks[_skip_limit_p] = _as_checkify_error


def check_in_computation(consecutive, update, scale, limit) -> None:
  """Inside ``jit``: fails the computation when ``consecutive >= limit``, or
  records a ``checkify`` error when the step is checkified."""
  _skip_limit_p.bind(
    *(jnp.asarray(x, dtype) for x, dtype in zip((consecutive, update, scale, limit), _DTYPES))
  )
