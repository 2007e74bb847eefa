"""torch's fused ops in a jaxpr: which equations are one call, and torch's CPU arithmetic.

torch computes softmax, log-softmax, GELU, layer norm and cross-entropy in one
kernel each, in float32, rounding the result once; JAX writes them as several
primitives. ``fused_spans`` finds the calls of the functions of
``policies.FUSED_FUNCTIONS`` in a jaxpr by the frames of its equations'
tracebacks; the interpreter runs each in float32 and rounds once, with
``CPU_KERNELS`` where torch's CPU kernel computes otherwise than the op as
written (docs/autocast.md, "Fused ops: computed in float32, rounded once").
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core

from jaxamp._autocast import cpu_math, erf_gelu
from jaxamp._autocast.policies import F32, FUSED_FUNCTIONS


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


def _frames(eqn: Any) -> tuple[tuple[Any, ...], tuple[int, ...]]:
  """The code objects and instruction offsets of ``eqn``'s traceback, innermost first."""
  tb = eqn.source_info.traceback
  if tb is None:
    return (), ()
  codes, lastis = tb.raw_frames()
  return tuple(codes), tuple(lastis)


def _fused_call(eqn: Any) -> tuple[str, Any, Any] | None:
  """``(op, call, frames)`` when ``eqn`` belongs to a call of a fused op: the
  outermost fused op in its traceback, the call site (the frames outside the op,
  with their offsets) and its whole traceback. A ``jit`` equation of a jitted
  fused op (``jax.nn.log_softmax``) is a call by itself."""
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
  """The calls of fused ops in ``jaxpr``, by their first equation. A call's
  equations are consecutive (the trace records them in order); one that starts
  where the same call site's last ended starts with its first equation's
  traceback (two calls from one line, as in a loop)."""
  calls = [_fused_call(eqn) for eqn in jaxpr.eqns]
  if not any(calls):
    return {}
  last_read: dict[Any, int] = {}
  for i, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:
      if not isinstance(v, jex_core.Literal):
        last_read[v] = i
  for v in jaxpr.outvars:
    if not isinstance(v, jex_core.Literal):
      last_read[v] = len(jaxpr.eqns)
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


def _primitive_eqns(eqns: list[Any]) -> list[Any]:
  """``eqns`` with the equations of ``jit`` calls in place of the calls."""
  out = []
  for eqn in eqns:
    if eqn.primitive.name in ("pjit", "jit"):
      out += _primitive_eqns(eqn.params["jaxpr"].jaxpr.eqns)
    else:
      out.append(eqn)
  return out


def _unary(eqns: list[Any], read: Callable[[Any], Any], outs: tuple[Any, ...]) -> Any:
  """The one input array of a call with one output; None otherwise."""
  defined = {v for eqn in eqns for v in eqn.outvars}
  ins = {
    v
    for eqn in eqns
    for v in eqn.invars
    if not isinstance(v, jex_core.Literal) and v not in defined
  }
  if len(ins) != 1 or len(outs) != 1:
    return None
  x = read(ins.pop())
  return x if np.shape(x) == tuple(outs[0].aval.shape) else None


def _tanh(u: Any) -> Any:
  """tanh in float32 as near correctly rounded as torch's (SLEEF's): near +-1,
  where GELU's ``1 + tanh`` cancels, it is ``1 - 2 / (exp(2|u|) + 1)``, whose
  rounding is then the only error (XLA's ``tanh`` is a few ulps off there)."""
  a = jnp.abs(u)
  t = 1.0 - 2.0 / (jnp.exp(2.0 * a) + 1.0)
  return jnp.where(u < 0, -t, t)


def _gelu_cpu(
  eqns: list[Any], read: Callable[[Any], Any], half: Any, outs: Any
) -> list[Any] | None:
  """torch's CPU GELU kernel: ``0.5 * x * (1 + tanh(b * (x + k * x**3)))`` in
  float32 with its ``tanh``, or the erf GELU torch runs for ``half`` inputs on this
  machine (``erf_gelu``)."""
  x = _unary(eqns, read, outs)
  names = {eqn.primitive.name for eqn in _primitive_eqns(eqns)}
  if x is None:
    return None
  x = x.astype(F32)
  if "tanh" in names:
    beta, kappa = np.float32(math.sqrt(2.0 / math.pi)), np.float32(0.044715)
    return [0.5 * x * (1.0 + _tanh(beta * (x + kappa * (x * x * x))))]
  if names & {"erf", "erfc"}:
    return [erf_gelu.torch_cpu(x, half)]
  return None


def _log_softmax_cpu(
  eqns: list[Any], read: Callable[[Any], Any], half: Any, outs: Any
) -> list[Any] | None:
  """torch's CPU log-softmax kernel over the last axis of a half input: the sum
  of ``exp(x - max)`` in float32, rounded to the half dtype, its log rounded
  again, ``x - max - log`` in float32 rounded once. Over another axis every
  step is float32 (the ops as written)."""
  x = _unary(eqns, read, outs)
  maxes = [e for e in _primitive_eqns(eqns) if e.primitive.name == "reduce_max"]
  if x is None or len(maxes) != 1 or tuple(maxes[0].params["axes"]) != (np.ndim(x) - 1,):
    return None
  x = x.astype(F32)
  shifted = x - lax.stop_gradient(jnp.max(x, -1, keepdims=True))
  total = jnp.sum(jnp.exp(shifted), -1, keepdims=True).astype(half).astype(F32)
  return [shifted - jnp.log(total).astype(half).astype(F32)]


def _max_operand(eqns: list[Any]) -> Any:
  """The variable of ``eqns``' scope whose ``reduce_max`` the one in ``eqns``
  (or in a ``jit`` among them) takes, when it takes it unchanged; else None."""
  for eqn in eqns:
    if eqn.primitive.name == "reduce_max":
      return eqn.invars[0]
    if eqn.primitive.name in ("pjit", "jit"):
      inner = eqn.params["jaxpr"].jaxpr
      v = _max_operand(inner.eqns)
      if v is not None and v in inner.invars:
        return eqn.invars[inner.invars.index(v)]
      if any(e.primitive.name == "reduce_max" for e in _primitive_eqns(inner.eqns)):
        return None
  return None


def _cross_entropy_cpu(
  eqns: list[Any], read: Callable[[Any], Any], half: Any, outs: Any
) -> list[Any] | None:
  """torch's CPU ``cross_entropy`` of float32 logits over the last axis (its
  log-softmax kernel, then ``nll_loss``): ``-((x[t] - max) - log(sum))`` with
  SLEEF's ``exp`` and ``log`` and the sum in the vector lanes' order
  (``cpu_math``); against one-hot or soft labels ``-sum(labels * (x - max -
  log(sum)))``, the label sum as written. None (the ops as written) where torch's
  CPU kernels are not SLEEF's (``cpu_math.torch_cpu_lanes``), over another axis,
  or with ``where``."""
  lanes = cpu_math.torch_cpu_lanes()
  maxes = [e for e in _primitive_eqns(eqns) if e.primitive.name == "reduce_max"]
  logits = _max_operand(eqns)
  defined = {v for eqn in eqns for v in eqn.outvars}
  ins = {
    v
    for eqn in eqns
    for v in eqn.invars
    if not isinstance(v, jex_core.Literal) and v not in defined
  }
  if lanes is None or len(maxes) != 1 or logits not in ins or len(ins) != 2 or len(outs) != 1:
    return None
  (other,) = ins - {logits}
  x, labels = read(logits), read(other)
  shape = np.shape(x)
  if (
    np.dtype(x.dtype) != F32
    or tuple(maxes[0].params["axes"]) != (len(shape) - 1,)
    or tuple(outs[0].aval.shape) != shape[:-1]
  ):
    return None
  shifted = x - lax.stop_gradient(jnp.max(x, -1, keepdims=True))
  log_sum = cpu_math.log(cpu_math.row_sum(cpu_math.exp(shifted), lanes))
  if np.issubdtype(labels.dtype, np.integer) and np.shape(labels) == shape[:-1]:
    picked = jnp.take_along_axis(shifted, labels[..., None], axis=-1)[..., 0]
    return [-(picked - log_sum)]
  if np.issubdtype(labels.dtype, np.floating) and np.shape(labels) == shape:
    return [-jnp.sum(labels * (shifted - log_sum[..., None]), -1)]
  return None


CPU_KERNELS: dict[str, Callable[..., list[Any] | None]] = {
  "cross_entropy": _cross_entropy_cpu,
  "gelu": _gelu_cpu,
  "log_softmax": _log_softmax_cpu,
}
