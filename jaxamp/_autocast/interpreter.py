"""The jaxpr interpreter: a traced program re-run equation by equation, with casts.

:class:`Interpreter` evaluates ``autocast``'s jaxpr in the caller's trace, each equation
by the mode of its region (``modes.py``), with the lists of ``policies.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.extend import core as jex_core

from jaxamp._autocast.fused import fused_dtype, fused_spans, in_layer, run_fused
from jaxamp._autocast.higher_order import HIGHER_ORDER, bind_params
from jaxamp._autocast.modes import AS_WRITTEN_SCOPE, OFF, Mode, region, tracing_regions
from jaxamp._autocast.policies import ACCUMULATE_F32, EXACT_DTYPE, F32, FUSED_NO_LOWER, HALF, LOWER
from jaxamp._autocast.promotion import Origins, is_float, widest
from jaxamp._xla.fma_guard import kept_bfloat16


def _is_literal(x: Any) -> bool:
  return isinstance(x, (np.ndarray, np.generic))


def _lowers(eqn: Any, mode: Mode) -> bool:
  """Whether ``eqn``'s region runs matmuls in a half dtype."""
  inner = region(eqn, mode)
  return inner.dtype is not None and not inner.as_written


class _Trace:
  """What the interpreters of one trace share, whatever their mode."""

  def __init__(self) -> None:
    self.casts = 0  # converts of traced values inserted
    self.cache: dict[tuple[int, Any], tuple[Any, Any]] = {}
    self.origins = Origins()
    self.modes: dict[Mode, Interpreter] = {}


class Interpreter:
  """Evaluates jaxprs with a mode; one per ``autocast`` call and mode (a cast cache
  per call)."""

  def __init__(self, mode: Mode, trace: _Trace | None = None):
    self.mode = mode
    self.trace = _Trace() if trace is None else trace
    self.trace.modes.setdefault(mode, self)

  def in_mode(self, mode: Mode) -> Interpreter:
    """The interpreter of ``mode`` sharing this one's cast cache."""
    return self.trace.modes.get(mode) or Interpreter(mode, self.trace)

  def fresh(self) -> Interpreter:
    """An interpreter with the same mode and its own cache (for a nested trace)."""
    return Interpreter(self.mode)

  def cast(self, x: Any, dtype: Any) -> Any:
    dtype = np.dtype(dtype)
    if np.dtype(x.dtype) == dtype:
      return x
    if _is_literal(x):  # a NumPy constant: one of the new dtype, of the same kind
      return self.trace.origins.mark(np.asarray(x, dtype), self.trace.origins.kind(x))
    key = (id(x), dtype)
    hit = self.trace.cache.get(key)
    if hit is not None and hit[0] is x:
      return hit[1]
    y = kept_bfloat16(lax.convert_element_type(x, dtype), x.dtype)  # type: ignore[assignment]
    self.trace.cache[key] = (x, y)  # holds x: its id stays unique while the entry lives
    self.trace.casts += 1
    return y

  def eval_jaxpr(self, jaxpr: Any, consts: Any, args: Any) -> list[Any]:
    env: dict[Any, Any] = {}
    origins = self.trace.origins

    def read(v: Any) -> Any:
      if isinstance(v, jex_core.Literal):  # a scalar constant: a Python scalar to torch
        return origins.mark(np.asarray(v.val, getattr(v.aval, "dtype", None)), "scalar")
      return env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    spans = fused_spans(jaxpr)
    i = 0
    while i < len(jaxpr.eqns):
      span = spans.get(i)
      eqns = jaxpr.eqns[i : i + 1] if span is None else jaxpr.eqns[i : span.end]
      half = None if span is None else fused_dtype(self, eqns, read)
      if span is not None and half is not None:
        run_fused(self, span, eqns, env, read, half)
      else:
        no_lower = span is not None and span.op in FUSED_NO_LOWER and _lowers(eqns[0], self.mode)
        # float32 inputs (no_lower): the op in float32, as written
        evaluate = self.in_mode(OFF).eval_in_mode if no_lower else self.eval_eqn
        for eqn in eqns:
          outs = evaluate(eqn, [read(v) for v in eqn.invars])
          env.update(zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs]))
      i += len(eqns)
    return [read(v) for v in jaxpr.outvars]

  def original(self, eqn: Any, args: list[Any]) -> Any:
    """The equation as the original jaxpr has it: inputs cast back to its dtypes."""
    args = [self.cast(x, v.aval.dtype) for x, v in zip(args, eqn.invars)]
    return eqn.primitive.bind(*args, **bind_params(eqn))

  def eval_eqn(self, eqn: Any, args: list[Any]) -> Any:
    mode = region(eqn, self.mode)
    if mode != self.mode:
      return self.in_mode(mode).eval_eqn(eqn, args)
    return self.eval_in_mode(eqn, args)

  def eval_in_mode(self, eqn: Any, args: list[Any]) -> Any:
    """``eqn`` with this interpreter's mode, whatever region it is in."""
    name = eqn.primitive.name
    if self.mode.as_written or name in EXACT_DTYPE:
      return self.original(eqn, args)
    higher_order = HIGHER_ORDER.get(name)
    if higher_order is not None:
      return higher_order(self, eqn, args)
    if any(isinstance(p, (jex_core.Jaxpr, jex_core.ClosedJaxpr)) for p in eqn.params.values()):
      return self.original(eqn, args)  # a higher-order primitive this package does not know
    origins = self.trace.origins
    if name == "convert_element_type":
      x = args[0]
      if _is_literal(x):  # a NumPy constant (a Python scalar to torch) stays one
        return origins.converted(eqn, x, np.asarray(x, eqn.params["new_dtype"]))
      return origins.converted(eqn, x, kept_bfloat16(eqn.primitive.bind(x, **eqn.params), x.dtype))
    if name in ("broadcast_in_dim", "reshape", "expand_dims", "squeeze", "transpose"):
      return origins.reshaped(eqn, args[0], self._bind(eqn, args), bind_params(eqn))
    return self._bind(eqn, args)

  def _bind(self, eqn: Any, args: list[Any]) -> Any:
    """The equation with the policy: inputs cast, the primitive re-bound."""
    name = eqn.primitive.name
    floats = [i for i, v in enumerate(eqn.invars) if is_float(v.aval.dtype)]
    if not floats:
      return eqn.primitive.bind(*args, **eqn.params)
    args = list(args)
    params = dict(eqn.params)
    dtype = self.mode.dtype
    origins = self.trace.origins
    if name in LOWER and dtype is not None:
      if not all(np.dtype(args[i].dtype) in (F32, *HALF) for i in floats):
        return self.original(eqn, args)
      for i in floats:
        args[i] = self.cast(args[i], dtype)
      params["preferred_element_type"] = dtype
      return origins.lower(eqn.primitive.bind(*args, **params), eqn.primitive, params, args)
    elif name in self.mode.fp32:
      for i in floats:
        if np.dtype(args[i].dtype) in HALF:
          args[i] = self.cast(args[i], F32)
    elif (
      name == "add" and dtype is not None and (bias_add := origins.bias_add(args, in_layer(eqn)))
    ):
      # A bias added to a matmul or conv output: torch's linear, addmm and conv
      # add their bias inside the op, in the lower dtype, rounding once.
      out, bias = bias_add
      fused = origins.add_inside(out, self.cast(bias, dtype))
      if fused is not None:
        return fused
      for i in floats:
        args[i] = self.cast(args[i], dtype)
    elif (opmath := origins.scalar_opmath(eqn, args, self.cast)) is not None:
      return opmath
    else:
      origins.promote(eqn, args, floats, self.cast)
    now = [np.dtype(args[i].dtype) for i in floats]
    if now == [np.dtype(eqn.invars[i].aval.dtype) for i in floats]:
      return eqn.primitive.bind(*args, **params)  # nothing changed
    for key in ("out_dtype", "preferred_element_type"):
      wide = params.get(key)
      if (name not in LOWER or dtype is None) and wide is not None and is_float(wide):
        params[key] = widest(now)
    if name in ACCUMULATE_F32 and now[0] in HALF:
      out = eqn.primitive.bind(*[self.cast(a, F32) for a in args], **params)
      return self.cast(out, now[0])
    try:
      return eqn.primitive.bind(*args, **params)
    except (TypeError, ValueError):
      return self.original(eqn, args)  # not valid in the new dtypes: run it as it was

  def call(self, closed: Any, args: list[Any]) -> list[Any]:
    """A ClosedJaxpr inlined: evaluated in this trace, with this cache."""
    return self.eval_jaxpr(closed.jaxpr, closed.consts, args)

  def traced(self, closed: Any) -> Callable[..., list[Any]]:
    """A function evaluating ``closed`` in a new trace (a fresh cache)."""
    return lambda *args: self.fresh().eval_jaxpr(closed.jaxpr, closed.consts, args)


def is_array_leaf(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def check_outputs(fn: Callable[..., Any], out: Any) -> None:
  bad = [x for x in jax.tree.leaves(out) if not (is_array_leaf(x) or hasattr(x, "aval"))]
  bad = [x for x in bad if not isinstance(x, (bool, int, float, complex))]
  if bad:
    raise TypeError(
      f"autocast: {getattr(fn, '__name__', fn)!r} returned a {type(bad[0]).__name__}, "
      "not a pytree of arrays.\nReturn arrays (or a pytree of them); keep other values "
      "outside the autocast function."
    )


def interpret(fn: Callable[..., Any], mode: Mode, args: Any, kwargs: Any) -> Any:
  """``fn(*args, **kwargs)`` traced to a jaxpr and evaluated with ``mode``."""
  leaves, treedef = jax.tree.flatten((args, kwargs))
  traced = [i for i, x in enumerate(leaves) if is_array_leaf(x) or hasattr(x, "aval")]

  def flat_fn(*arrays: Any) -> Any:
    full = list(leaves)
    for i, a in zip(traced, arrays):
      full[i] = a
    a, kw = jax.tree.unflatten(treedef, full)
    out = fn(*a, **kw)
    check_outputs(fn, out)
    return out

  arrays = [leaves[i] for i in traced]
  with tracing_regions():
    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*arrays)
  with jax.named_scope(AS_WRITTEN_SCOPE):
    outs = Interpreter(mode).eval_jaxpr(closed.jaxpr, closed.consts, arrays)
  return jax.tree.unflatten(jax.tree.structure(out_shape), outs)
