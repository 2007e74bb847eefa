"""torch's fused ops in a jaxpr: which equations are one call, and how the call runs.

``fused_spans`` finds the calls of ``policies.FUSED_FUNCTIONS`` by their equations'
tracebacks; ``run_fused`` runs one in float32, rounded once (docs/autocast.md, "Fused
ops: computed in float32, rounded once").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from jax.extend import core as jex_core

from jaxamp._autocast import policies
from jaxamp._autocast.modes import OFF, region
from jaxamp._autocast.policies import BIAS_LAYERS, F32, FUSED_F32, FUSED_FUNCTIONS, HALF

if TYPE_CHECKING:
  from jaxamp._autocast.interpreter import Interpreter


class Span(NamedTuple):
  """One call of a fused op: equations ``start:end`` of a jaxpr."""

  end: int
  op: str  # a value of policies.FUSED_FUNCTIONS
  outs: tuple[Any, ...]  # the variables it defines that are read after it


@functools.lru_cache(maxsize=4096)
def _code_op(code: Any) -> str | None:
  """The fused op whose function ``code`` is, if any."""
  filename = code.co_filename.replace("\\", "/")
  qualname = getattr(code, "co_qualname", code.co_name)
  for (suffix, name), op in FUSED_FUNCTIONS.items():
    if qualname == name and filename.endswith(suffix):
      return op
  return None


@functools.lru_cache(maxsize=4096)
def _is_layer(code: Any) -> bool:
  """Whether ``code`` is the call of a library's linear or conv layer (``BIAS_LAYERS``)."""
  filename = code.co_filename.replace("\\", "/")
  qualname = getattr(code, "co_qualname", code.co_name)
  return any(qualname == name and filename.endswith(suffix) for suffix, name in BIAS_LAYERS)


def in_layer(eqn: Any) -> bool:
  """Whether ``eqn`` was traced inside a library's linear or conv layer."""
  return any(_is_layer(code) for code in _frames(eqn)[0])


def _frames(eqn: Any) -> tuple[tuple[Any, ...], tuple[int, ...]]:
  """The code objects and instruction offsets of ``eqn``'s traceback, innermost first."""
  tb = eqn.source_info.traceback
  if tb is None:
    return (), ()
  codes, lastis = tb.raw_frames()
  return tuple(codes), tuple(lastis)


def _fused_call(eqn: Any) -> tuple[str, Any, Any] | None:
  """``(op, call site, traceback)`` when ``eqn`` belongs to a call of a fused op (the
  outermost in its traceback); a ``jit`` equation of a jitted fused op is one by itself."""
  codes, lastis = _frames(eqn)
  for k in range(len(codes) - 1, -1, -1):
    op = _code_op(codes[k])
    if op is not None:
      return op, (codes[k], codes[k + 1 :], lastis[k + 1 :]), (codes, lastis)
  inner = eqn.params.get("jaxpr") if eqn.primitive.name in ("pjit", "jit") else None
  if inner is not None and inner.jaxpr.eqns:
    # an inner trace's tracebacks end at the function jit traced
    traced = _frames(inner.jaxpr.eqns[0])[0]
    op = _code_op(traced[-1]) if traced else None
    if op is not None:
      return op, ("jit", id(eqn)), (codes, lastis)
  return None


def fused_spans(jaxpr: Any) -> dict[int, Span]:
  """The calls of fused ops in ``jaxpr``, by their first equation (a call's equations are
  consecutive; a first equation's traceback again starts a new call from one line)."""
  calls = [_fused_call(eqn) for eqn in jaxpr.eqns]
  if not any(calls):
    return {}
  last_read: dict[Any, int] = {}  # the outputs are read after the last equation
  for i, read in enumerate([*(eqn.invars for eqn in jaxpr.eqns), jaxpr.outvars]):
    for v in read:
      if not isinstance(v, jex_core.Literal):
        last_read[v] = i
  spans = {}
  i = 0
  while i < len(calls):
    call = calls[i]
    if call is None:
      i += 1
      continue
    op, site, first = call
    end = i + 1
    while end < len(calls):
      nxt = calls[end]
      if nxt is None or nxt[:2] != (op, site):
        break
      if nxt[2] == first and calls[end - 1][2] != first:  # type: ignore[index]
        break
      end += 1
    outs = tuple(v for eqn in jaxpr.eqns[i:end] for v in eqn.outvars if last_read.get(v, -1) >= end)
    spans[i] = Span(end, op, outs)
    i = end
  return spans


def fused_dtype(interp: Interpreter, eqns: list[Any], read: Callable[[Any], Any]) -> Any:
  """The one half dtype of a fused op's call's half inputs; None where it runs primitive
  by primitive (no half input, both half dtypes, or autocast off)."""
  mode = region(eqns[0], interp.mode)
  if mode.dtype is None or mode.as_written or any(region(e, interp.mode) != mode for e in eqns):
    return None
  defined: set[Any] = set()
  halves = set()
  for eqn in eqns:
    for v in eqn.invars:
      if not isinstance(v, jex_core.Literal) and v not in defined:
        dtype = np.dtype(read(v).dtype)
        if dtype in HALF:
          halves.add(dtype)
    defined.update(eqn.outvars)
  return halves.pop() if len(halves) == 1 else None


def run_fused(
  interp: Interpreter,
  span: Span,
  eqns: list[Any],
  env: dict[Any, Any],
  read: Callable[[Any], Any],
  half: Any,
) -> None:
  """A fused op's call as torch's kernel computes it, into ``env``: in float32, rounded to
  ``half`` once (kept float32 where the policy's float32 list has the op, and for a
  batch norm's statistics)."""
  mode = region(eqns[0], interp.mode)
  halves = []

  def read32(v: Any) -> Any:
    x = read(v)
    if np.dtype(x.dtype) not in HALF:
      return x
    halves.append(v)
    return interp.cast(x, F32)

  _in_float32(interp.in_mode(OFF), eqns, env, read32)
  to_half = span.op not in FUSED_F32.get(mode.policy or "", frozenset())
  elementwise = _elementwise_from(eqns, halves) if span.op in policies.FUSED_STATISTICS else None
  for v in span.outs:
    x = env[v]
    statistic = elementwise is not None and v not in elementwise
    if to_half and not statistic and np.dtype(x.dtype) == F32:
      env[v] = interp.cast(x, half)


# Ops that reduce over elements or devices: what comes through them is a statistic.
_REDUCTIONS = frozenset(
  {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "psum", "pmax", "pmin"}
)


def _elementwise_from(eqns: list[Any], sources: Any) -> set[Any]:
  """The variables of ``eqns`` that ``sources`` reach other than through a reduction: a
  batch norm's output, where its running statistics come through its mean and variance."""
  reached = {v for v in sources if not isinstance(v, jex_core.Literal)}
  for eqn in eqns:
    hit = [not isinstance(v, jex_core.Literal) and v in reached for v in eqn.invars]
    if eqn.primitive.name in ("jit", "pjit"):
      inner = eqn.params["jaxpr"].jaxpr
      inner_reached = _elementwise_from(inner.eqns, [i for i, h in zip(inner.invars, hit) if h])
      reached.update(o for o, i in zip(eqn.outvars, inner.outvars) if i in inner_reached)
    elif eqn.primitive.name not in _REDUCTIONS and any(hit):
      reached.update(eqn.outvars)
  return reached


def _in_float32(off: Interpreter, eqns: list[Any], env: dict[Any, Any], read32: Callable) -> None:
  """``eqns`` run with autocast off on float32 inputs, into ``env``, without jnp's
  roundings back to a half dtype (torch's kernel has none), inside ``jit`` calls too."""
  for eqn in eqns:
    args = [read32(v) for v in eqn.invars]
    if eqn.primitive.name == "convert_element_type" and eqn.params["new_dtype"] in HALF:
      env[eqn.outvars[0]] = args[0]
      continue
    if eqn.primitive.name in ("jit", "pjit"):
      closed = eqn.params["jaxpr"]
      inner = dict(zip(closed.jaxpr.constvars, closed.consts))
      inner.update(zip(closed.jaxpr.invars, args))

      def read_inner(v: Any, inner: dict = inner) -> Any:
        x = v.val if isinstance(v, jex_core.Literal) else inner[v]
        return off.cast(x, F32) if np.dtype(x.dtype) in HALF else x

      _in_float32(off, closed.jaxpr.eqns, inner, read_inner)
      outs = [read_inner(v) for v in closed.jaxpr.outvars]
    else:
      out = off.eval_in_mode(eqn, args)
      outs = out if eqn.primitive.multiple_results else [out]
    for v, x in zip(eqn.outvars, outs):
      env[v] = x
