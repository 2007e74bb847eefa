"""Higher-order primitives, inlined (``jit``, ``custom_vjp``) or rebuilt with ``lax`` with
the policy inside (docs/autocast.md, "Nested jaxprs")."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
from jax import lax

from jaxamp._autocast.promotion import widest

if TYPE_CHECKING:
  from jaxamp._autocast.interpreter import Interpreter


def bind_params(eqn: Any) -> dict[str, Any]:
  """The params to re-bind ``eqn``'s primitive with (as ``jax.core.eval_jaxpr`` does)."""
  return dict(eqn.primitive.get_bind_params(eqn.params))


def _inline(interp: Interpreter, eqn: Any, args: list[Any]) -> list[Any]:
  for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    if key in eqn.params:
      return interp.call(eqn.params[key], args)
  return interp.original(eqn, args)


def _custom_jvp(interp: Interpreter, eqn: Any, args: list[Any]) -> list[Any]:
  """The custom rule when the policy changes nothing inside; otherwise the primal, inlined."""
  closed = eqn.params["call_jaxpr"]
  probe = interp.fresh()
  jax.make_jaxpr(lambda *a: probe.eval_jaxpr(closed.jaxpr, closed.consts, a))(*args)
  if probe.trace.casts:
    return interp.call(closed, args)
  params = bind_params(eqn)
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
  targets = [widest([s[k].dtype for s in shapes]) for k in range(len(shapes[0]))]

  def branch(closed: Any) -> Callable[..., list[Any]]:
    def fn(*a: Any) -> list[Any]:
      inner = interp.fresh()
      outs = inner.eval_jaxpr(closed.jaxpr, closed.consts, a)
      return [inner.cast(o, t) for o, t in zip(outs, targets)]

    return fn

  return list(lax.switch(index, [branch(b) for b in branches], *ops))


def _remat(interp: Interpreter, eqn: Any, args: list[Any]) -> list[Any]:
  p = eqn.params

  def fn(*a: Any) -> list[Any]:
    return interp.fresh().eval_jaxpr(p["jaxpr"], [], a)

  return jax.checkpoint(fn, prevent_cse=p["prevent_cse"], policy=p["policy"])(*args)


_INLINED = ("pjit", "jit", "closed_call", "core_call", "custom_vjp_call", "custom_vjp_call_jaxpr")
HIGHER_ORDER: dict[str, Callable[[Interpreter, Any, list[Any]], Any]] = {
  **dict.fromkeys(_INLINED, _inline),
  "custom_jvp_call": _custom_jvp,
  "scan": _scan,
  "while": _while,
  "cond": _cond,
  "remat2": _remat,
  "checkpoint": _remat,
}
