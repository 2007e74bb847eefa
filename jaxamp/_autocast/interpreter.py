"""The jaxpr interpreter: a traced program re-run equation by equation, with casts.

``autocast`` traces its function to a jaxpr; :class:`Interpreter` evaluates
that jaxpr in the caller's trace, casting each equation's inputs as the policy
(``policies.py``) says, runs the calls of torch's fused ops in float32
(``fused.py``), and rebuilds the nested jaxprs (``jit``, ``scan``, ``while``,
``cond``, ``remat``, custom derivatives) with the policy inside.
"""

from __future__ import annotations

import contextvars
import functools
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jax.experimental.xla_metadata import set_xla_metadata
from jax.extend import core as jex_core

from jaxamp._autocast.fused import CPU_KERNELS, Span, fused_spans
from jaxamp._autocast.policies import (
  ACCUMULATE_F32,
  EXACT_DTYPE,
  F32,
  FUSED_F32,
  HALF,
  LOWER,
  POLICIES,
)
from jaxamp._xla.fma_guard import kept_bfloat16


class Mode(NamedTuple):
  """How a region runs its equations."""

  dtype: Any  # the lower-precision dtype of matmuls and convs; None: no lower-precision list
  fp32: frozenset[str]  # the primitives run in float32
  as_written: bool = False  # every equation as the traced program has it
  policy: str | None = None  # "cpu" or "cuda": whose fused kernels (policies.FUSED_F32)


# A region's equations carry its name scope; each equation runs by the
# innermost one (torch: the innermost autocast context decides), and one in no
# region by the mode of the autocast call that traced it.
# autocast(enabled=False) and autocast_disabled: autocast off, input dtypes.
OFF_SCOPE = "jaxamp_autocast_off"
# Equations that run as traced: what an autocast call emits (already cast) and
# autocast_disabled's casts of its inputs to float32.
AS_WRITTEN_SCOPE = "jaxamp_autocast_as_written"

_MODES = {
  OFF_SCOPE: Mode(None, frozenset()),
  AS_WRITTEN_SCOPE: Mode(None, frozenset(), as_written=True),
}


def policy_scope(dtype: Any, policy: str) -> str:
  """The name scope of an ``autocast(fn, dtype, policy=policy)`` region."""
  return f"jaxamp_autocast_{np.dtype(dtype).name}_{policy}"


for _half in HALF:
  for _policy, _fp32 in POLICIES.items():
    _MODES[policy_scope(_half, _policy)] = Mode(_half, _fp32, policy=_policy)
_SCOPES = re.compile("|".join(sorted(_MODES, key=len, reverse=True)))

# True while an autocast call traces its function: an autocast or
# autocast_disabled called then marks a region instead of interpreting.
_TRACING = contextvars.ContextVar("jaxamp_autocast_tracing", default=False)


def tracing() -> bool:
  """Whether an enclosing ``autocast`` call is tracing its function."""
  return _TRACING.get()


def _region(eqn: Any, mode: Mode) -> Mode:
  """The mode of the innermost region ``eqn`` is in; ``mode`` if none."""
  scopes = _SCOPES.findall(str(eqn.source_info.name_stack))
  return _MODES[scopes[-1]] if scopes else mode


def _is_literal(x: Any) -> bool:
  return isinstance(x, (np.ndarray, np.generic))


def _is_float(dtype: Any) -> bool:
  return jnp.issubdtype(dtype, jnp.floating)


def _widest(dtypes: list[Any]) -> Any:
  return functools.reduce(jnp.promote_types, dtypes)


class _Trace:
  """What the interpreters of one trace share, whatever their mode."""

  def __init__(self) -> None:
    self.casts = 0  # converts of traced values inserted
    self.cache: dict[tuple[int, Any], tuple[Any, Any]] = {}
    # id -> (value, kind): "lower" for the outputs of LOWER primitives,
    # "broadcast" for values broadcast or reshaped to a higher rank (a bias),
    # "zerodim" for a 0-dim value broadcast to an array, "scalar" for a Python
    # scalar (a literal, a weak-typed value, either broadcast to an array) and
    # "int" for a float converted from a bool or an integer: torch's type
    # promotion ranks them below dimensioned float tensors (``_priority``).
    self.origin: dict[int, tuple[Any, str]] = {}
    # id(output of a LOWER primitive in dtype) -> (output, primitive, params,
    # its half operands): what a bias add needs to add inside the op.
    self.lower_ops: dict[int, tuple[Any, Any, dict[str, Any], list[Any]]] = {}
    self.modes: dict[Mode, Interpreter] = {}


class Interpreter:
  """Evaluates jaxprs with a mode; one per ``autocast`` call and mode (a cast cache
  per call)."""

  def __init__(self, mode: Mode, trace: _Trace | None = None):
    self.mode = mode
    self.trace = _Trace() if trace is None else trace
    self.trace.modes.setdefault(mode, self)

  @property
  def casts(self) -> int:
    return self.trace.casts

  def in_mode(self, mode: Mode) -> Interpreter:
    """The interpreter of ``mode`` sharing this one's cast cache."""
    return self.trace.modes.get(mode) or Interpreter(mode, self.trace)

  def _mark(self, x: Any, kind: str) -> Any:
    self.trace.origin[id(x)] = (x, kind)
    return x

  def _kind(self, x: Any) -> str | None:
    hit = self.trace.origin.get(id(x))
    return hit[1] if hit is not None and hit[0] is x else None

  def _category(self, x: Any, var: Any) -> str | None:
    """What torch's type promotion would see: ``"scalar"`` (a Python number),
    ``"int"`` (a bool or integer tensor), ``"zerodim"`` (a 0-dim float tensor)
    or None (a dimensioned float tensor)."""
    kind = self._kind(x)
    if kind == "scalar" or getattr(var.aval, "weak_type", False):
      return "scalar"
    if kind in ("int", "zerodim"):
      return kind
    return "zerodim" if np.ndim(x) == 0 else None

  def _priority(self, x: Any, var: Any) -> int:
    """torch's promotion rank: 0 a dimensioned float tensor, 1 a 0-dim one, 2 a
    Python scalar or a float made from a bool or integer tensor (it never
    decides the float dtype: ``half * mask`` stays half)."""
    return {None: 0, "zerodim": 1}.get(self._category(x, var), 2)

  def _target(self, eqn: Any, args: list[Any], group: list[int]) -> Any:
    """The dtype torch's promotion gives ``args[i] for i in group``: the widest
    of the highest rank (``_priority``)."""
    ranks = [self._priority(args[i], eqn.invars[i]) for i in group]
    return _widest([args[i].dtype for i, r in zip(group, ranks) if r == min(ranks)])

  def _scalar_opmath(self, eqn: Any, args: list[Any]) -> Any:
    """torch's CPU ``mul`` and ``div`` of a half tensor by a wider scalar (a
    Python number, a 0-dim tensor; for ``div`` the divisor, for ``mul`` a 0-dim
    tensor only second) compute in float32 and round once: they do not round
    the scalar to the half dtype first, as the other ops do. None if ``eqn`` is
    not one."""
    name = eqn.primitive.name
    if name not in ("mul", "div") or len(args) != 2 or not all(_is_float(x.dtype) for x in args):
      return None
    kinds = [self._category(x, v) for x, v in zip(args, eqn.invars)]
    if kinds[1] in ("scalar", "zerodim"):
      scalar = 1
    elif name == "mul" and kinds[0] == "scalar":
      scalar = 0
    else:
      return None
    target = np.dtype(self._target(eqn, args, [0, 1]))
    wide = np.dtype(_widest([args[scalar].dtype, target]))  # holds both exactly
    if target not in HALF or wide == target:
      return None
    params = dict(eqn.params)
    if params.get("out_dtype") is not None:
      params["out_dtype"] = wide
    out = eqn.primitive.bind(*[self.cast(x, wide) for x in args], **params)
    return self.cast(out, target)

  def _bias_add(self, args: list[Any]) -> tuple[Any, Any] | None:
    """``(matmul_or_conv_output, b)`` if ``args`` add a bias ``b`` broadcast to it."""
    if len(args) != 2:
      return None
    for out, b in (args, args[::-1]):
      if self._kind(out) == "lower" and self._kind(b) == "broadcast":
        return out, b
    return None

  def _add_inside(self, out: Any, bias: Any) -> Any:
    """``out + bias`` as torch's ``linear``/``addmm``/``conv`` compute it: the
    bias added to the float32 accumulator, the sum rounded to ``dtype`` once."""
    hit = self.trace.lower_ops.get(id(out))
    if hit is None or hit[0] is not out or np.ndim(bias) != np.ndim(out):
      return None
    _, primitive, params, (lhs, rhs) = hit
    return _with_bias(primitive, params, lhs, rhs, self.cast(bias, self.mode.dtype))

  def fresh(self) -> Interpreter:
    """An interpreter with the same mode and its own cache (for a nested trace)."""
    return Interpreter(self.mode)

  # -- casting ------------------------------------------------------------------

  def cast(self, x: Any, dtype: Any) -> Any:
    dtype = np.dtype(dtype)
    if np.dtype(x.dtype) == dtype:
      return x
    if _is_literal(x):  # a NumPy constant: one of the new dtype, of the same kind
      y, kind = np.asarray(x, dtype), self._kind(x)
      return self._mark(y, kind) if kind else y
    key = (id(x), dtype)
    hit = self.trace.cache.get(key)
    if hit is not None and hit[0] is x:
      return hit[1]
    y = kept_bfloat16(lax.convert_element_type(x, dtype), x.dtype)  # type: ignore[assignment]
    self.trace.cache[key] = (x, y)  # holds x: its id stays unique while the entry lives
    self.trace.casts += 1
    return y

  # -- evaluation ---------------------------------------------------------------

  def eval_jaxpr(self, jaxpr: Any, consts: Any, args: Any) -> list[Any]:
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
      if isinstance(v, jex_core.Literal):  # a scalar constant: a Python scalar to torch
        return self._mark(np.asarray(v.val, getattr(v.aval, "dtype", None)), "scalar")
      return env[v]

    def run(eqn: Any) -> None:
      outs = self.eval_eqn(eqn, [read(v) for v in eqn.invars])
      if not eqn.primitive.multiple_results:
        outs = [outs]
      for v, x in zip(eqn.outvars, outs):
        env[v] = x

    for v, x in zip(jaxpr.constvars, consts):
      env[v] = x
    for v, x in zip(jaxpr.invars, args):
      env[v] = x
    spans = fused_spans(jaxpr)
    i = 0
    while i < len(jaxpr.eqns):
      span = spans.get(i)
      if span is None:
        run(jaxpr.eqns[i])
        i += 1
        continue
      eqns = jaxpr.eqns[i : span.end]
      half = self._fused_dtype(eqns, read)
      if half is None:
        for eqn in eqns:
          run(eqn)
      else:
        self._fused(span, eqns, env, read, half)
      i = span.end
    return [read(v) for v in jaxpr.outvars]

  def _fused(
    self, span: Span, eqns: list[Any], env: dict[Any, Any], read: Callable[[Any], Any], half: Any
  ) -> None:
    """A call of a fused op as torch's kernel computes it: its half inputs cast
    to float32, its equations run in float32 (autocast off: in the dtypes their
    inputs arrive in), or torch's CPU arithmetic where it is not the op's as
    written (``CPU_KERNELS``); its result rounded to ``half`` once, or kept
    float32 where the policy's float32 list has the op."""
    mode = _region(eqns[0], self.mode)

    def read32(v: Any) -> Any:
      x = read(v)
      return self.cast(x, F32) if np.dtype(x.dtype) in HALF else x

    kernel = CPU_KERNELS.get(span.op) if mode.policy == "cpu" else None
    outs = kernel(eqns, read32, half, span.outs) if kernel is not None else None
    if outs is None:
      _in_float32(self.in_mode(_MODES[OFF_SCOPE]), eqns, env, read32)
      outs = [env[v] for v in span.outs]
    to_half = span.op not in FUSED_F32.get(mode.policy or "", frozenset())
    for v, x in zip(span.outs, outs):
      env[v] = self.cast(x, half) if to_half and np.dtype(x.dtype) == F32 else x

  def _fused_dtype(self, eqns: list[Any], read: Callable[[Any], Any]) -> Any:
    """The half dtype of a fused op's call's (``eqns``) half inputs: what its
    result rounds to. None where it runs primitive by primitive: no half
    input, inputs in both half dtypes, or autocast off."""
    mode = _region(eqns[0], self.mode)
    if mode.dtype is None or mode.as_written or any(_region(e, self.mode) != mode for e in eqns):
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

  def original(self, eqn: Any, args: list[Any]) -> Any:
    """The equation as the original jaxpr has it: inputs cast back to its dtypes."""
    args = [self.cast(x, v.aval.dtype) for x, v in zip(args, eqn.invars)]
    return eqn.primitive.bind(*args, **_bind_params(eqn))

  def eval_eqn(self, eqn: Any, args: list[Any]) -> Any:
    mode = _region(eqn, self.mode)
    if mode != self.mode:
      return self.in_mode(mode).eval_eqn(eqn, args)
    return self.eval_in_mode(eqn, args)

  def eval_in_mode(self, eqn: Any, args: list[Any]) -> Any:
    """``eqn`` with this interpreter's mode, whatever region it is in."""
    mode = self.mode
    name = eqn.primitive.name
    if mode.as_written or name in EXACT_DTYPE:
      return self.original(eqn, args)
    nested = _NESTED.get(name)
    if nested is not None:
      return nested(self, eqn, args)
    if any(isinstance(p, (jex_core.Jaxpr, jex_core.ClosedJaxpr)) for p in eqn.params.values()):
      return self.original(eqn, args)  # a higher-order primitive this file does not know
    if name == "convert_element_type":
      return self._convert(eqn, args[0])
    if name in ("broadcast_in_dim", "reshape", "expand_dims"):
      out = self._bind(eqn, args)
      x = args[0]
      kind = self._kind(x)
      if kind == "scalar" or eqn.invars[0].aval.weak_type:
        return self._mark(out, "scalar")  # jnp.zeros_like, full, where(m, x, 0.)
      if kind in ("int", "zerodim"):
        return self._mark(out, kind)
      if np.ndim(x) == 0:
        return self._mark(out, "zerodim")  # torch keeps a 0-dim tensor 0-dim
      grows = np.ndim(x) < np.ndim(out) or np.size(x) < np.size(out)
      return self._mark(out, "broadcast") if grows or kind == "broadcast" else out
    if name in LOWER and mode.dtype is not None:
      return self._mark(self._bind(eqn, args), "lower")
    return self._bind(eqn, args)

  def _convert(self, eqn: Any, x: Any) -> Any:
    """``convert_element_type`` as written, keeping what promotion needs to know."""
    new = np.dtype(eqn.params["new_dtype"])
    # a NumPy constant (a literal: a Python scalar) stays one
    out: Any = (
      np.asarray(x, new)
      if _is_literal(x)
      else kept_bfloat16(eqn.primitive.bind(x, **eqn.params), x.dtype)
    )
    if _is_float(new) and not _is_float(x.dtype):
      return self._mark(out, "int")  # jnp's promotion of a mask or an index
    kind = self._kind(x)
    if eqn.invars[0].aval.weak_type:
      kind = "scalar"
    return self._mark(out, kind) if kind in ("scalar", "int", "zerodim") else out

  def _bind(self, eqn: Any, args: list[Any]) -> Any:
    """The equation with the policy: inputs cast, the primitive re-bound."""
    name = eqn.primitive.name
    floats = [i for i, v in enumerate(eqn.invars) if _is_float(v.aval.dtype)]
    if not floats:
      return eqn.primitive.bind(*args, **eqn.params)
    args = list(args)
    params = dict(eqn.params)
    dtype = self.mode.dtype
    if name in LOWER and dtype is not None:
      if all(np.dtype(args[i].dtype) in (F32, *HALF) for i in floats):
        for i in floats:
          args[i] = self.cast(args[i], dtype)
        params["preferred_element_type"] = dtype
        out = eqn.primitive.bind(*args, **params)
        if len(args) == 2:
          self.trace.lower_ops[id(out)] = (out, eqn.primitive, params, args)
        return out
      return self.original(eqn, args)
    elif name in self.mode.fp32:
      for i in floats:
        if np.dtype(args[i].dtype) in HALF:
          args[i] = self.cast(args[i], F32)
    elif name == "add" and dtype is not None and (bias_add := self._bias_add(args)) is not None:
      # A bias added to a matmul or conv output: torch's linear, addmm and conv
      # add their bias inside the op, in the lower dtype, rounding once.
      fused = self._add_inside(*bias_add)
      if fused is not None:
        return fused
      for i in floats:
        args[i] = self.cast(args[i], dtype)
    elif (opmath := self._scalar_opmath(eqn, args)) is not None:
      return opmath
    else:
      self._promote(eqn, args, floats)
    now = [np.dtype(args[i].dtype) for i in floats]
    if now == [np.dtype(eqn.invars[i].aval.dtype) for i in floats]:
      return eqn.primitive.bind(*args, **params)  # nothing changed
    for key in ("out_dtype", "preferred_element_type"):
      wide = params.get(key)
      if (name not in LOWER or dtype is None) and wide is not None and _is_float(wide):
        params[key] = _widest(now)
    if name in ACCUMULATE_F32 and now[0] in HALF:
      out = eqn.primitive.bind(*[self.cast(a, F32) for a in args], **params)
      return self.cast(out, now[0])
    try:
      return eqn.primitive.bind(*args, **params)
    except (TypeError, ValueError):
      return self.original(eqn, args)  # not valid in the new dtypes: run it as it was

  def _promote(self, eqn: Any, args: list[Any], floats: list[int]) -> None:
    """torch's type promotion among inputs the original jaxpr gave one float dtype:
    the widest of the highest rank (``_priority``) wins: dimensioned float
    tensors, else 0-dim ones; Python scalars and floats made from bools or
    integers take the others' dtype."""
    groups: dict[Any, list[int]] = {}
    for i in floats:
      groups.setdefault(np.dtype(eqn.invars[i].aval.dtype), []).append(i)
    for group in groups.values():
      if len({np.dtype(args[i].dtype) for i in group}) < 2:
        continue
      target = self._target(eqn, args, group)
      for i in group:
        args[i] = self.cast(args[i], target)

  # -- nested jaxprs ------------------------------------------------------------

  def call(self, closed: Any, args: list[Any]) -> list[Any]:
    """A ClosedJaxpr inlined: evaluated in this trace, with this cache."""
    return self.eval_jaxpr(closed.jaxpr, closed.consts, args)

  def traced(self, closed: Any) -> Callable[..., list[Any]]:
    """A function evaluating ``closed`` in a new trace (a fresh cache)."""

    def fn(*args: Any) -> list[Any]:
      return self.fresh().eval_jaxpr(closed.jaxpr, closed.consts, args)

    return fn


def _with_bias(primitive: Any, params: dict[str, Any], lhs: Any, rhs: Any, bias: Any) -> Any:
  """``primitive(lhs, rhs) + bias`` (all in one half dtype) rounded once: the bias
  is added to the float32 result before the rounding, as torch's kernels add it
  to their accumulator. The derivative is torch's backward of ``linear``: half
  matmuls of the half cotangent, and the bias gradient summed in float32 and
  rounded once."""
  half = bias.dtype
  wide = dict(params, preferred_element_type=F32)

  @jax.custom_jvp
  def fused(lhs: Any, rhs: Any, bias: Any) -> Any:
    acc = primitive.bind(lhs, rhs, **wide)
    return lax.convert_element_type(lax.add_p.bind(acc, bias.astype(F32)), half)

  def fused_jvp(primals: Any, tangents: Any) -> Any:
    lhs, rhs, bias = primals
    d_lhs, d_rhs, d_bias = tangents
    terms = [
      primitive.bind(*operands, **params).astype(F32)  # half products, summed in float32
      for operands, d in (((d_lhs, rhs), d_lhs), ((lhs, d_rhs), d_rhs))
      if not isinstance(d, SymbolicZero)
    ]
    if not isinstance(d_bias, SymbolicZero):
      terms.append(d_bias.astype(F32))
    out = fused(lhs, rhs, bias)
    if not terms:
      return out, jnp.zeros_like(out)
    return out, lax.convert_element_type(functools.reduce(lax.add_p.bind, terms), half)

  fused.defjvp(fused_jvp, symbolic_zeros=True)
  return fused(lhs, rhs, bias)


def _in_float32(off: Interpreter, eqns: list[Any], env: dict[Any, Any], read32: Callable) -> None:
  """``eqns`` (a fused op's call) run with autocast off on float32 inputs, into
  ``env``: jnp's roundings of a half sum back to the half dtype are left out,
  as torch's kernel has none, in a ``jit`` call the op makes too
  (``jax.nn.standardize`` of a value that is half when traced)."""
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


def _bind_params(eqn: Any) -> dict[str, Any]:
  """The params to re-bind ``eqn``'s primitive with (as ``jax.core.eval_jaxpr`` does)."""
  return dict(eqn.primitive.get_bind_params(eqn.params))


def _inline(interp: Interpreter, eqn: Any, args: list[Any]) -> list[Any]:
  for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    if key in eqn.params:
      return interp.call(eqn.params[key], args)
  return interp.original(eqn, args)


def _custom_jvp(interp: Interpreter, eqn: Any, args: list[Any]) -> list[Any]:
  """The custom rule when the policy changes nothing inside (``jax.nn.relu`` on a
  float16 input: its own jvp at float16); otherwise the primal, inlined, and
  differentiated as it is computed."""
  closed = eqn.params["call_jaxpr"]
  probe = interp.fresh()
  jax.make_jaxpr(lambda *a: probe.eval_jaxpr(closed.jaxpr, closed.consts, a))(*args)
  if probe.casts:
    return interp.call(closed, args)
  params = _bind_params(eqn)
  fun = jax.extend.linear_util.wrap_init(interp.traced(closed), debug_info=closed.jaxpr.debug_info)
  jvp = jax.extend.linear_util.wrap_init(
    _lift_jvp(interp, eqn.params["num_consts"], eqn.params["jvp_jaxpr_fun"]),
    debug_info=closed.jaxpr.debug_info,
  )
  params["subfuns"] = (fun, jvp)
  return eqn.primitive.bind(*args, **params)


def _lift_jvp(interp: Interpreter, num_consts: int, jvp_jaxpr_fun: Any) -> Callable[..., Any]:
  """jax's ``lift_jvp`` with the jvp jaxpr evaluated by a fresh interpreter."""
  zero = jax.custom_derivatives.SymbolicZero

  def jvp(*xs: Any) -> list[Any]:
    n = len(xs) // 2
    primals, tangents = xs[num_consts:n], xs[n + num_consts :]
    zeros = [type(t) is zero for t in tangents]
    jvp_jaxpr, jvp_consts, out_zeros = jvp_jaxpr_fun.call_wrapped(*zeros)
    inner = interp.fresh()
    nonzero = [t for t in tangents if type(t) is not zero]
    out = inner.eval_jaxpr(jvp_jaxpr, jvp_consts, [*primals, *nonzero])
    out_primals, nz_tangents = out[: len(out_zeros)], iter(out[len(out_zeros) :])
    out_tangents = [
      zero(jax.typeof(p).to_tangent_aval()) if z else inner.cast(next(nz_tangents), p.dtype)
      for p, z in zip(out_primals, out_zeros)
    ]
    return [*out_primals, *out_tangents]

  return jvp


def _carry_cast(interp: Interpreter, outs: list[Any], like: list[Any]) -> list[Any]:
  return [interp.cast(o, x.dtype) for o, x in zip(outs, like)]


def _scan(interp: Interpreter, eqn: Any, args: list[Any]) -> list[Any]:
  p = eqn.params
  nc, ncarry = p["num_consts"], p["num_carry"]
  consts, init, xs = args[:nc], args[nc : nc + ncarry], args[nc + ncarry :]
  body_jaxpr = p["jaxpr"]

  def body(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
    inner = interp.fresh()
    outs = inner.eval_jaxpr(body_jaxpr.jaxpr, body_jaxpr.consts, [*consts, *carry, *x])
    return _carry_cast(inner, outs[:ncarry], carry), outs[ncarry:]

  carry, ys = lax.scan(body, init, xs, length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
  return [*carry, *ys]


def _while(interp: Interpreter, eqn: Any, args: list[Any]) -> list[Any]:
  p = eqn.params
  cn, bn = p["cond_nconsts"], p["body_nconsts"]
  cconsts, bconsts, init = args[:cn], args[cn : cn + bn], args[cn + bn :]
  cond_j, body_j = p["cond_jaxpr"], p["body_jaxpr"]

  def cond(carry: Any) -> Any:
    return interp.fresh().eval_jaxpr(cond_j.jaxpr, cond_j.consts, [*cconsts, *carry])[0]

  def body(carry: Any) -> list[Any]:
    inner = interp.fresh()
    return _carry_cast(
      inner, inner.eval_jaxpr(body_j.jaxpr, body_j.consts, [*bconsts, *carry]), carry
    )

  return list(lax.while_loop(cond, body, list(init)))


def _cond(interp: Interpreter, eqn: Any, args: list[Any]) -> list[Any]:
  index, ops = args[0], args[1:]
  branches = eqn.params["branches"]
  shapes = [jax.eval_shape(interp.traced(b), *ops) for b in branches]
  targets = [_widest([s[k].dtype for s in shapes]) for k in range(len(shapes[0]))]

  def branch(closed: Any) -> Callable[..., list[Any]]:
    def fn(*a: Any) -> list[Any]:
      inner = interp.fresh()
      outs = inner.eval_jaxpr(closed.jaxpr, closed.consts, a)
      return [inner.cast(o, t) for o, t in zip(outs, targets)]

    return fn

  return list(lax.switch(index, [branch(b) for b in branches], *ops))


def _remat(interp: Interpreter, eqn: Any, args: list[Any]) -> list[Any]:
  p = eqn.params
  jaxpr = p["jaxpr"]

  def fn(*a: Any) -> list[Any]:
    return interp.fresh().eval_jaxpr(jaxpr, [], a)

  return jax.checkpoint(fn, prevent_cse=p["prevent_cse"], policy=p["policy"])(*args)


_NESTED: dict[str, Callable[[Interpreter, Any, list[Any]], Any]] = {
  "pjit": _inline,
  "jit": _inline,
  "closed_call": _inline,
  "core_call": _inline,
  "custom_vjp_call": _inline,
  "custom_vjp_call_jaxpr": _inline,
  "custom_jvp_call": _custom_jvp,
  "scan": _scan,
  "while": _while,
  "cond": _cond,
  "remat2": _remat,
  "checkpoint": _remat,
}


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
  token = _TRACING.set(True)
  try:
    # jax.jit keys its cache on this context: a jitted function traced here, its
    # autocast calls marked as regions for this interpreter (not interpreted), is
    # traced again when called outside, where they interpret.
    with set_xla_metadata(jaxamp_autocast="region"):
      closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*arrays)
  finally:
    _TRACING.reset(token)
  with jax.named_scope(AS_WRITTEN_SCOPE):
    outs = Interpreter(mode).eval_jaxpr(closed.jaxpr, closed.consts, arrays)
  return jax.tree.unflatten(jax.tree.structure(out_shape), outs)
