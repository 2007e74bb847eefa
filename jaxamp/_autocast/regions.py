"""``autocast`` and ``autocast_disabled``: torch's autocast regions for JAX functions."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._autocast.interpreter import check_outputs, interpret, is_array_leaf
from jaxamp._autocast.modes import AS_WRITTEN_SCOPE, OFF_SCOPE, Mode, policy_scope, tracing
from jaxamp._autocast.policies import F32, HALF, POLICIES


def autocast(
  fn: Callable[..., Any],
  dtype: Any = jnp.float16,
  *,
  policy: str = "cuda",
  enabled: bool = True,
) -> Callable[..., Any]:
  """``fn`` with torch's autocast op policy: matmuls and convolutions in ``dtype``.

  ``fn`` is plain float32 JAX code (a function, a Flax NNX module, a linen ``apply``),
  traced and evaluated equation by equation; parameters stay float32. The policy, fused
  ops, promotion, nested regions and what differs from torch: ``docs/autocast.md``.

  Args:
    fn: the function; its array arguments (leaves of any pytree) are traced,
      other leaves are static. It returns a pytree of arrays. An NNX module
      has its state passed in and returned (BatchNorm statistics and RNG
      counts update).
    dtype: ``jnp.float16`` or ``jnp.bfloat16``.
    policy: ``"cuda"`` or ``"cpu"``: whose float32 list to apply.
    enabled: ``False``: ``fn`` as it is; inside another autocast function, a
      region with autocast off (torch's ``autocast(enabled=False)``: every
      primitive in the dtypes its inputs arrive in).

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import jaxamp
    >>> def f(w, x):
    ...   return jax.nn.softmax(x @ w)
    >>> w, x = jnp.ones((3, 3)), jnp.ones((2, 3))
    >>> jax.eval_shape(jaxamp.autocast(lambda w, x: x @ w), w, x).dtype
    dtype('float16')
    >>> jaxamp.autocast(f)(w, x).dtype   # softmax: float32 on the CUDA list
    dtype('float32')
    >>> jaxamp.autocast(f, policy="cpu")(w, x).dtype   # torch's CPU list: input dtype
    dtype('float16')
  """
  if not callable(fn):
    raise TypeError(
      f"autocast: fn must be callable, got {type(fn).__name__}.\n"
      "Pass the function (or module) itself: jaxamp.autocast(f)(x), not jaxamp.autocast(f(x))."
    )
  if policy not in POLICIES:
    raise ValueError(
      f"autocast: unknown policy {policy!r}.\nUse policy='cuda' (the default) or policy='cpu'."
    )
  try:
    half = np.dtype(dtype)
  except TypeError:
    half = None
  if half not in HALF:
    raise ValueError(
      f"autocast: dtype must be float16 or bfloat16, got {dtype!r}.\n"
      "Use jnp.float16 or jnp.bfloat16 (as torch does); to run fn in float32, "
      "pass enabled=False."
    )
  if not enabled:
    return _region(fn, OFF_SCOPE, fn)
  mode = Mode(half, POLICIES[policy], policy=policy)

  nnx = sys.modules.get("flax.nnx")
  if nnx is not None and isinstance(fn, nnx.Module):
    return _region(fn, policy_scope(half, policy), _module_call(nnx, fn, mode))

  def interpreted(*args: Any, **kwargs: Any) -> Any:
    return interpret(fn, mode, args, kwargs)

  return _region(fn, policy_scope(half, policy), interpreted)


def _region(
  fn: Callable[..., Any], scope: str, outermost: Callable[..., Any]
) -> Callable[..., Any]:
  """``outermost`` where no autocast encloses the call, else ``fn`` in the name ``scope``."""

  @functools.wraps(fn)
  def wrapped(*args: Any, **kwargs: Any) -> Any:
    if not tracing():
      return outermost(*args, **kwargs)
    with jax.named_scope(scope):
      out = fn(*args, **kwargs)
    check_outputs(fn, out)
    return out

  return wrapped


def _module_call(nnx: Any, module: Any, mode: Mode) -> Callable[..., Any]:
  """An NNX module's call with its state passed in and returned, in the old state's dtypes."""

  def call(*args: Any, **kwargs: Any) -> Any:
    graphdef, state = nnx.split(module)

    def pure(state: Any, *args: Any, **kwargs: Any) -> Any:
      m = nnx.merge(graphdef, state)
      return m(*args, **kwargs), nnx.state(m)

    out, new_state = interpret(pure, mode, (state, *args), kwargs)
    new_state = jax.tree.map(
      lambda new, old: new.astype(old.dtype) if jnp.issubdtype(old.dtype, jnp.floating) else new,
      new_state,
      state,
    )
    nnx.update(module, new_state)
    return out

  return call


def autocast_disabled(fn: Callable[..., Any]) -> Callable[..., Any]:
  """``fn`` run in float32 inside an :func:`autocast` function (torch's
  ``autocast(enabled=False)`` region after ``.float()``): its floating inputs cast to
  float32, autocast off. Outside ``autocast`` it is ``fn`` with float32 inputs.

  Args:
    fn: the function to run in float32.

  Examples:
    >>> import jax.numpy as jnp
    >>> import jaxamp
    >>> def f(w, x):
    ...   h = x @ w                                            # float16
    ...   return jaxamp.autocast_disabled(lambda h: h @ w)(h)  # float32
    >>> jaxamp.autocast(f)(jnp.ones((3, 3)), jnp.ones((2, 3))).dtype
    dtype('float32')
  """

  @functools.wraps(fn)
  def wrapped(*args: Any, **kwargs: Any) -> Any:
    with jax.named_scope(OFF_SCOPE):
      with jax.named_scope(AS_WRITTEN_SCOPE):
        args, kwargs = jax.tree.map(_to_float32, (args, kwargs))
      return fn(*args, **kwargs)

  return wrapped


def _to_float32(x: Any) -> Any:
  if not (is_array_leaf(x) or hasattr(x, "aval")) or not jnp.issubdtype(x.dtype, jnp.floating):
    return x
  if np.dtype(x.dtype) in HALF:
    return jnp.asarray(x).astype(F32)
  if tracing():
    # Traced in float32, x may arrive half when the enclosing autocast runs: a
    # copy run as written is a cast to float32 there.
    return jnp.copy(x)
  return x
