"""The optax form's applied-or-skipped step, with the updates written where the gradients were."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxamp._xla import enabled
from jaxamp._xla.compile_cache import traced
from jaxamp._xla.fma_guard import xor_bits
from jaxamp._xla.jax_internals import is_batched


def _differentiated(x: Any) -> bool:
  """Whether ``x`` carries a tangent (``jax.jvp``, ``jax.grad``, ``jax.linearize``)."""
  while isinstance(x, jax.core.Tracer):
    if hasattr(x, "tangent"):
      return True
    x = getattr(x, "primal", None) if hasattr(x, "primal") else getattr(x, "val", None)
  return False


def _types(tree: Any) -> tuple[Any, list]:
  """``tree``'s structure and its leaves' types, weak or not."""
  return jax.tree.structure(tree), [jax.typeof(x).strip_weak_type() for x in jax.tree.leaves(tree)]


# XLA CPU compiles a loop that touches few bytes into one kernel of its own,
# whose arithmetic it contracts otherwise than the top level's (BENCHMARKS.md,
# "In-place updates"); a step this small has no buffer worth reusing.
SMALL_BYTES = 1 << 20


def _is_float(x: Any) -> bool:
  return jnp.issubdtype(x.dtype, jnp.floating)


def _nbytes(tree: Any) -> int:
  return sum(jax.typeof(x).size * jax.typeof(x).dtype.itemsize for x in jax.tree.leaves(tree))


def apply_unless(
  found_inf: jax.Array,
  apply: Callable,
  grads: Any,
  inner_state: Any,
  params: Any,
  *,
  conditional: Callable[[], tuple[Any, Any]],
  on_skip: Callable | None = None,
) -> tuple[Any, Any]:
  """``conditional()``, the engine's ``lax.cond(~found_inf, apply, skip, grads,
  inner_state, params)``, computed in place.

  ``optax.apply_updates`` reads the updates after ``tx.update`` returns them,
  so they must come out as arrays. A ``lax.cond``'s outputs are a buffer of
  their own, written while all the gradients are still live, so a training
  step carries a gradient-sized temporary more than the plain step
  (BENCHMARKS.md, "In-place updates"). Here the step is a ``lax.while_loop``
  of zero or one trip, whose carry XLA updates in place: the updates take the
  gradients' buffer, and a skipped step (zero trips) returns the inner state
  untouched and zero updates. Differentiated, it is the same step's
  ``lax.cond`` (reverse mode cannot transpose a loop), which computes the same.
  Gradients that are an input of the jitted function, not computed in it,
  are copied into the loop first.

  Where the inner update returns other types than it takes (structure, shapes,
  dtypes: optax's Adam widens a bfloat16 parameter's moments on its first
  update), no loop can carry them, and this is the ``lax.cond``; so it is
  when the in_place workaround is off, for a step under :data:`SMALL_BYTES`,
  eagerly, and under ``vmap``. ``on_skip``, when given, is what a skipped step
  does to the inner state (torch's schedule counts); it must change only a few
  leaves and return the others as they are.
  """
  # Eagerly (jax.disable_jit) a loop of no trip would not see the types; under
  # vmap its predicate is batched, and checkify cannot check a batched loop;
  # differentiated, reverse mode cannot transpose a while_loop.
  operands = (grads, inner_state, params)
  if (
    not enabled("in_place")
    or not traced(found_inf)
    or is_batched(found_inf)
    or any(map(_differentiated, jax.tree.leaves(operands)))
    or _nbytes((grads, inner_state)) < SMALL_BYTES
  ):
    return conditional()
  # The update, as a function of what it closes over (the params, extra args):
  # a derivative rule is traced after this trace, when its tracers are gone.
  traced_apply, out_shape = jax.make_jaxpr(lambda g, s: apply(g, s, params), return_shape=True)(
    grads, inner_state
  )
  carried = (grads, inner_state)
  if _types(out_shape) != _types(carried):
    return conditional()

  def step(carried: Any, consts: list) -> Any:
    out = jax.core.eval_jaxpr(traced_apply.jaxpr, consts, *jax.tree.leaves(carried))
    return jax.tree.unflatten(jax.tree.structure(carried), out)

  updates, state = _in_place(step)(found_inf, carried, list(traced_apply.consts))
  updates = jax.tree.map(lambda u: jnp.where(found_inf, jnp.zeros_like(u), u), updates)
  if on_skip is not None:  # select only the leaves a skipped step changes
    advanced = on_skip(state)
    state = jax.tree.map(lambda a, s: s if a is s else jnp.where(found_inf, a, s), advanced, state)
  return updates, state


def _in_place(step: Callable[[Any, list], Any]) -> Callable:
  """``step(carried, consts)`` unless ``found_inf`` (else ``carried``), as a
  loop of zero or one trip, differentiated as the ``lax.cond`` that computes
  the same."""

  @jax.custom_jvp
  def loop(found_inf, carried, consts):
    def body(c):
      go, carried = c
      # XLA hoists out of a loop what depends on no carry (``params * wd``),
      # and a hoisted product is not contracted into the FMA the top level
      # computes; XOR-ed with a zero that depends on the carry, nothing does.
      zero = (~go).astype(jnp.int32)
      varying = [xor_bits(k, zero) if _is_float(k) else k for k in consts]
      return ~go, step(carried, varying)  # one trip

    return lax.while_loop(lambda c: c[0], body, (~found_inf, carried))[1]

  @loop.defjvp
  def as_cond(primals, tangents):
    def branched(found_inf, carried, consts):
      return lax.cond(found_inf, lambda c, k: c, step, carried, consts)

    return jax.jvp(branched, primals, tangents)

  return loop


def cond_around_loops(pred: jax.Array, true_fn: Callable, false_fn: Callable, *operands, cond):
  """``cond(pred, true_fn, false_fn, *operands)`` for branches that may hold an
  :func:`apply_unless` loop; differentiated, both branches run and the result
  is selected: JAX traces a ``lax.cond``'s branches before it differentiates
  them, so the loop inside could not see the tangents, and reverse mode cannot
  transpose it."""
  if not enabled("in_place") or not any(map(_differentiated, jax.tree.leaves(operands))):
    return cond(pred, true_fn, false_fn, *operands)
  taken, other = true_fn(*operands), false_fn(*operands)
  # A leaf both branches return as it is (an Equinox module's function) is kept.
  return jax.tree.map(lambda t, o: t if t is o else jnp.where(pred, t, o), taken, other)
