"""torch's type promotion in a jaxpr, and the mixed-dtype arithmetic of its CPU kernels.

In a jaxpr jnp has already promoted every elementwise op's inputs; :class:`Origins`
records what torch's promotion would have seen instead (docs/autocast.md, "Type promotion").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from jaxamp._autocast.policies import F32, HALF

Cast = Callable[[Any, Any], Any]


def is_float(dtype: Any) -> bool:
  return jnp.issubdtype(dtype, jnp.floating)


def widest(dtypes: list[Any]) -> Any:
  return functools.reduce(jnp.promote_types, dtypes)


class Origins:
  """What torch's promotion would see of the values of one trace, by their id: a kind,
  ``"lower"`` (a matmul's or conv's output), ``"broadcast"`` (a bias), ``"zerodim"``,
  ``"scalar"`` (a Python scalar) or ``"int"`` (a float made from a bool or integer)."""

  def __init__(self) -> None:
    self._kinds: dict[int, tuple[Any, str]] = {}  # holds the value: its id stays unique
    # id(a half matmul's or conv's output) -> (output, primitive, params, operands,
    # layout changes as (primitive, params)): what a bias add needs inside the op.
    self._lower: dict[int, tuple[Any, Any, dict[str, Any], list[Any], tuple[Any, ...]]] = {}

  def mark(self, x: Any, kind: str | None) -> Any:
    if kind is not None:
      self._kinds[id(x)] = (x, kind)
    return x

  def kind(self, x: Any) -> str | None:
    hit = self._kinds.get(id(x))
    return hit[1] if hit is not None and hit[0] is x else None

  def lower(self, out: Any, primitive: Any, params: dict[str, Any], args: list[Any]) -> Any:
    """``out``, a matmul's or conv's half output, recorded for a bias add."""
    if len(args) == 2:
      self._lower[id(out)] = (out, primitive, params, args, ())
    return self.mark(out, "lower")

  def reshaped(self, eqn: Any, x: Any, out: Any, params: dict[str, Any]) -> Any:
    """``out``, ``x`` broadcast, reshaped or transposed, marked with what it is to torch
    (a matmul's output stays one through a change of layout, for its bias)."""
    kind = self.kind(x)
    if kind == "lower" and np.size(x) == np.size(out):
      hit = self._lower.get(id(x))
      if hit is not None and hit[0] is x:
        layout = (*hit[4], (eqn.primitive, params))
        self._lower[id(out)] = (out, *hit[1:4], layout)
      return self.mark(out, "lower")
    if kind == "scalar" or eqn.invars[0].aval.weak_type:
      return self.mark(out, "scalar")  # jnp.zeros_like, full, where(m, x, 0.)
    if kind in ("int", "zerodim"):
      return self.mark(out, kind)
    if np.ndim(x) == 0:
      return self.mark(out, "zerodim")  # torch keeps a 0-dim tensor 0-dim
    grows = np.ndim(x) < np.ndim(out) or np.size(x) < np.size(out)
    return self.mark(out, "broadcast") if grows or kind == "broadcast" else out

  def converted(self, eqn: Any, x: Any, out: Any) -> Any:
    """``out``, ``x`` converted as written, keeping what promotion needs to know."""
    if is_float(out.dtype) and not is_float(x.dtype):
      return self.mark(out, "int")  # jnp's promotion of a mask or an index
    kind = "scalar" if eqn.invars[0].aval.weak_type else self.kind(x)
    return self.mark(out, kind if kind in ("scalar", "int", "zerodim") else None)

  def _category(self, x: Any, var: Any) -> str | None:
    """``"scalar"`` (a Python number), ``"int"`` (a bool or integer tensor),
    ``"zerodim"`` (a 0-dim float tensor) or None (a dimensioned float tensor)."""
    kind = self.kind(x)
    if kind == "scalar" or getattr(var.aval, "weak_type", False):
      return "scalar"
    if kind in ("int", "zerodim"):
      return kind
    return "zerodim" if np.ndim(x) == 0 else None

  def _target(self, eqn: Any, args: list[Any], group: list[int]) -> Any:
    """The dtype torch's promotion gives ``args[i] for i in group``: the widest of the
    highest rank (dimensioned, then 0-dim; scalars and masks never decide)."""
    ranks = [{None: 0, "zerodim": 1}.get(self._category(args[i], eqn.invars[i]), 2) for i in group]
    return widest([args[i].dtype for i, r in zip(group, ranks) if r == min(ranks)])

  def promote(self, eqn: Any, args: list[Any], floats: list[int], cast: Cast) -> None:
    """``args`` cast in place as torch promotes inputs the original jaxpr gave one
    float dtype and the policy left with different ones."""
    groups: dict[Any, list[int]] = {}
    for i in floats:
      groups.setdefault(np.dtype(eqn.invars[i].aval.dtype), []).append(i)
    for group in groups.values():
      if len({np.dtype(args[i].dtype) for i in group}) < 2:
        continue
      target = self._target(eqn, args, group)
      for i in group:
        args[i] = cast(args[i], target)

  def scalar_opmath(self, eqn: Any, args: list[Any], cast: Cast) -> Any:
    """torch's CPU ``mul``/``div`` of a half tensor by a wider scalar, in float32 rounded
    once (the scalar not rounded to half first); None if ``eqn`` is not one."""
    name = eqn.primitive.name
    if name not in ("mul", "div") or len(args) != 2 or not all(is_float(x.dtype) for x in args):
      return None
    kinds = [self._category(x, v) for x, v in zip(args, eqn.invars)]
    if kinds[1] in ("scalar", "zerodim"):
      scalar = 1
    elif name == "mul" and kinds[0] == "scalar":
      scalar = 0
    else:
      return None
    target = np.dtype(self._target(eqn, args, [0, 1]))
    wide = np.dtype(widest([args[scalar].dtype, target]))  # holds both exactly
    if target not in HALF or wide == target:
      return None
    params = dict(eqn.params)
    if params.get("out_dtype") is not None:
      params["out_dtype"] = wide
    out = eqn.primitive.bind(*[cast(x, wide) for x in args], **params)
    return cast(out, target)

  def bias_add(self, args: list[Any], in_layer: bool) -> tuple[Any, Any] | None:
    """``(matmul_or_conv_output, b)`` if ``args`` add a bias ``b`` to it: a value broadcast
    to it or, inside a library's layer (``in_layer``), one of its shape; never a scalar."""
    if len(args) != 2:
      return None
    for out, b in (args, args[::-1]):
      if self.kind(out) != "lower":
        continue
      if self.kind(b) == "broadcast":
        return out, b
      fewer = np.size(b) < np.size(out)
      same_rank = self.kind(b) is None and np.ndim(b) == np.ndim(out) > 0
      if same_rank and (fewer or (np.shape(b) == np.shape(out) and in_layer)):
        return out, b
    return None

  def add_inside(self, out: Any, bias: Any) -> Any:
    """``out + bias`` as torch's ``linear`` and ``conv`` compute it, rounded once; None if
    the op is not known."""
    hit = self._lower.get(id(out))
    if hit is None or hit[0] is not out or np.ndim(bias) != np.ndim(out):
      return None
    _, primitive, params, (lhs, rhs), layout = hit
    return _with_bias(primitive, params, lhs, rhs, bias, layout)


def _with_bias(
  primitive: Any, params: dict[str, Any], lhs: Any, rhs: Any, bias: Any, layout: tuple = ()
) -> Any:
  """``primitive(lhs, rhs) + bias`` (one half dtype, the product's ``layout`` changes
  before the add) rounded once, with torch's backward of ``linear``."""
  half = bias.dtype
  wide = dict(params, preferred_element_type=F32)

  def relaid(x: Any) -> Any:
    for change, change_params in layout:
      x = change.bind(x, **change_params)
    return x

  @jax.custom_jvp
  def fused(lhs: Any, rhs: Any, bias: Any) -> Any:
    acc = relaid(primitive.bind(lhs, rhs, **wide))
    return lax.convert_element_type(lax.add_p.bind(acc, bias.astype(F32)), half)

  def fused_jvp(primals: Any, tangents: Any) -> Any:
    lhs, rhs, bias = primals
    d_lhs, d_rhs, d_bias = tangents
    terms = [
      relaid(primitive.bind(*operands, **params)).astype(F32)  # half products, summed in float32
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
