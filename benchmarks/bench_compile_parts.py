"""Where a checked step's compile time goes: built up from plain Adam one piece at a time.

Each variant is one jitted step ``(params, opt_state, grads, scale)``, params and
state donated, lowered and compiled once, in this one process, on small float32
leaves (copies of a 32-128-32 MLP layer pair's 6 params, as bench_core's
``compile-tree``); it prints the seconds of lowering and of XLA's compile, the
fusions and the lines of the optimized HLO:

  plain          optax.adam + apply_updates (the baseline)
  multiply       Adam on ``grads * (1 / scale)``: no check, no branch
  cond           the same inside a ``lax.cond`` on ``scale > 0``: a branch, no check
  loop           the same as a ``fori_loop`` of 0 or 1 trips: a loop, no check
  check          jaxamp's check (ops.all_finite), Adam always applied: no branch
  check_cond     jaxamp's check and the ``lax.cond``
  per_leaf       the same, the check one ``isfinite`` reduction a leaf
  sum_zero       the same, the check ``isfinite(sum(g * 0))`` a leaf
  exact          jaxamp's check, torch's exact unscale, the ``lax.cond``
  guarded        the same with the FMA guards (jaxamp/_xla/fma_guard.py)
  jaxamp         jaxamp.apply_scaled_updates
  where          Adam and ``where(all_finite, new, old)`` over params and state:
                 not run by default (it compiled for over 8 minutes at 3,000 leaves)

  PYTHONPATH=. python benchmarks/bench_compile_parts.py --leaves 3000
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import optax
from bench_core import small_layers
from jax import lax

import jaxamp
from jaxamp._torch.unscale import inverse_parts, unscale_finite_by
from jaxamp._xla.fma_guard import rounded_unscaled, rounded_updates

ADAM = optax.adam(1e-3)
TX = jaxamp.dynamic_loss_scale(ADAM)


def plain(p, s, g):
  updates, s = ADAM.update(g, s, p)
  return optax.apply_updates(p, updates), s


def skip(p, s):
  return p, s


def multiply(p, s, g, scale):
  return plain(p, s, [x * (1.0 / scale) for x in g])


def cond(p, s, g, scale):
  return lax.cond(scale > 0, lambda p, s: multiply(p, s, g, scale), skip, p, s)


def loop(p, s, g, scale):
  trips = (scale > 0).astype(jnp.int32)
  return lax.fori_loop(0, trips, lambda _, ps: multiply(*ps, g, scale), (p, s))


def check(p, s, g, scale):
  return (*multiply(p, s, g, scale), jaxamp.ops.all_finite(g))


def checked(finite):
  def step(p, s, g, scale):
    return lax.cond(finite(g, scale), lambda p, s: multiply(p, s, g, scale), skip, p, s)

  return step


def all_finite(g, scale):
  return jaxamp.ops.all_finite(g)


def per_leaf_finite(g, scale):
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in g]))


def sum_zero_finite(g, scale):
  zero = jnp.isnan(scale).astype(jnp.float32)  # a zero XLA cannot fold
  return jnp.all(jnp.isfinite(jnp.stack([jnp.sum(x * zero) for x in g])))


def exact(p, s, g, scale):
  parts = inverse_parts(scale)
  apply = lambda p, s: plain(p, s, unscale_finite_by(g, parts))
  return lax.cond(jaxamp.ops.all_finite(g), apply, skip, p, s)


def guarded(p, s, g, scale):
  parts = inverse_parts(scale)

  def apply(p, s):
    updates, s = ADAM.update(rounded_unscaled(unscale_finite_by(g, parts), scale), s, p)
    return optax.apply_updates(p, rounded_updates(updates, scale)), s

  return lax.cond(jaxamp.ops.all_finite(g), apply, skip, p, s)


def where(p, s, g, scale):
  finite = jaxamp.ops.all_finite(g)
  new = multiply(p, s, g, scale)
  return jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, (p, s))


VARIANTS = {
  "plain": lambda p, s, g, scale: plain(p, s, g),
  "multiply": multiply,
  "cond": cond,
  "loop": loop,
  "check": check,
  "check_cond": checked(all_finite),
  "per_leaf": checked(per_leaf_finite),
  "sum_zero": checked(sum_zero_finite),
  "exact": exact,
  "guarded": guarded,
  "jaxamp": lambda p, s, g, scale: jaxamp.apply_scaled_updates(TX, g, s, p),
  "where": where,
}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--leaves", type=int, default=3000)
  parser.add_argument("--variants", default=",".join(v for v in VARIANTS if v != "where"))
  args = parser.parse_args()
  jax.config.update("jax_enable_compilation_cache", False)
  params = [jnp.zeros(shape) for shape in small_layers(args.leaves)]
  grads = [jnp.zeros_like(x) for x in params]
  print(f"# {args.leaves} leaves; jax {jax.__version__}, {jax.devices()[0].platform}")
  for name in args.variants.split(","):
    state = (TX if name == "jaxamp" else ADAM).init(params)
    start = time.perf_counter()
    step = jax.jit(VARIANTS[name], donate_argnums=(0, 1))
    lowered = step.lower(params, state, grads, jnp.float32(65536.0))
    lowered_at = time.perf_counter()
    hlo = lowered.compile().as_text()
    compiled_at = time.perf_counter()
    print(
      f"{name:12s} lower {lowered_at - start:6.1f} s  compile {compiled_at - lowered_at:6.1f} s"
      f"  fusions {hlo.count(' fusion(')}  HLO lines {hlo.count(chr(10))}",
      flush=True,
    )


if __name__ == "__main__":
  main()
