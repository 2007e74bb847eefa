"""What each per-element operation of jaxamp's fused step costs, built up from plain Adam.

One jitted, donated step per row, on one leaf-size mix, interleaved in one
process; ratios to plain ``optax.adam`` + ``apply_updates``:

  adam            the baseline
  check+cond      ``all_finite(grads)``, then Adam inside a ``lax.cond``
  + multiply      the same, Adam fed ``grads * (1 / scale)``
  + exact unscale torch's ``inv_scale`` and its two normal factors (``unscale_by``)
  + rounding      the unscaled grads and the updates kept rounded (``_xla/fma_guard.py``)
  jaxamp          ``jaxamp.apply_scaled_updates`` (the above plus the loss-scale core)

  PYTHONPATH=. python benchmarks/bench_unscale_ops.py --mix lognormal/25m/200
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import jaxamp
from benchmarks.model_shapes import MIXES, describe
from jaxamp._torch.unscale import inverse_parts, unscale_by
from jaxamp._xla.fma_guard import rounded_unscaled, rounded_updates

ADAM = optax.adam(1e-3)


def adam_step(p, s, g):
  updates, s = ADAM.update(g, s, p)
  return optax.apply_updates(p, updates), s


def skip(p, s, g):
  return p, s


def check_cond(p, s, g, scale):
  return lax.cond(jaxamp.ops.all_finite(g), adam_step, skip, p, s, g)


def multiply(p, s, g, scale):
  inverse = 1.0 / scale
  return lax.cond(
    jaxamp.ops.all_finite(g),
    lambda p, s, g: adam_step(p, s, [x * inverse for x in g]),
    skip,
    p,
    s,
    g,
  )


def exact_unscale(p, s, g, scale):
  parts = inverse_parts(scale)
  return lax.cond(
    jaxamp.ops.all_finite(g), lambda p, s, g: adam_step(p, s, unscale_by(g, parts)), skip, p, s, g
  )


def with_rounding(p, s, g, scale):
  parts = inverse_parts(scale)

  def apply(p, s, g):
    updates, s = ADAM.update(rounded_unscaled(unscale_by(g, parts), scale), s, p)
    return optax.apply_updates(p, rounded_updates(updates, scale)), s

  return lax.cond(jaxamp.ops.all_finite(g), apply, skip, p, s, g)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--mix", default="lognormal/25m/200", choices=sorted(MIXES))
  parser.add_argument("--repeats", type=int, default=15)
  args = parser.parse_args()

  shapes = MIXES[args.mix]()
  rng = np.random.default_rng(0)
  params = [jnp.asarray(rng.standard_normal(s, np.float32)) for s in shapes]
  grads = [jnp.asarray(rng.standard_normal(s, np.float32)) for s in shapes]
  scale = jnp.float32(2.0**16)
  tx = jaxamp.dynamic_loss_scale(ADAM)
  rows = {
    "adam": (lambda p, s, g, scale: adam_step(p, s, g), ADAM),
    "check+cond": (check_cond, ADAM),
    "+ multiply": (multiply, ADAM),
    "+ exact unscale": (exact_unscale, ADAM),
    "+ rounding": (with_rounding, ADAM),
    "jaxamp": (lambda p, s, g, scale: jaxamp.apply_scaled_updates(tx, g, s, p), tx),
  }
  runs = {}
  for name, (fn, opt) in rows.items():
    p, s = [x.copy() for x in params], opt.init(params)
    compiled = jax.jit(fn, donate_argnums=(0, 1)).lower(p, s, grads, scale).compile()
    runs[name] = [compiled, p, s, []]
  for _ in range(args.repeats):  # interleaved
    for run in runs.values():
      start = time.perf_counter()
      run[1], run[2] = jax.block_until_ready(run[0](run[1], run[2], grads, scale))
      run[3].append(time.perf_counter() - start)
  median = {name: statistics.median(run[3][2:]) for name, run in runs.items()}
  print(f"# {args.mix}: {describe(shapes)}; jax {jax.__version__}, {args.repeats} repeats")
  for name, seconds in median.items():
    print(f"{name:16s} {seconds * 1e3:7.1f} ms {seconds / median['adam']:5.2f}x")


if __name__ == "__main__":
  main()
