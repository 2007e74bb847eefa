"""Flax's own update methods against jaxamp's flax_utils fast paths.

One jitted update step on the same gradients, interleaved, in one process:

  ts        TrainState.apply_gradients             (linen, jax.jit, state donated)
  ts_fast   flax_utils.apply_gradients(state, ...) (the same through apply_scaled_updates)
  nnx       nnx.Optimizer.update                   (nnx.jit, model and optimizer donated)
  nnx_fast  flax_utils.update(optimizer, model, ...)

each with plain ``optax.adam`` (``adam``, the baseline of its row group: ratio
1) and with ``jaxamp.dynamic_loss_scale(optax.adam)`` (``jaxamp``), on finite
gradients and on gradients with one inf (``skip``).

  PYTHONPATH=. python benchmarks/bench_flax.py                   # 25M params in 200 leaves
  PYTHONPATH=. python benchmarks/bench_flax.py --leaves 4 --params 1000000 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import results_file
from flax import nnx
from flax.training import train_state

import jaxamp
from jaxamp import flax_utils


class Weights(nnx.Module):
  def __init__(self, arrays):
    self.ws = nnx.List([nnx.Param(jnp.asarray(a)) for a in arrays])


def _arrays(n_params, n_leaves, seed, scale=1.0):
  rng = np.random.default_rng(seed)
  per_leaf = n_params // n_leaves
  return [rng.standard_normal((per_leaf // 250, 250), np.float32) * scale for _ in range(n_leaves)]


def train_state_runner(tx, params, fast):
  state = train_state.TrainState.create(
    apply_fn=None, params=[jnp.asarray(p) for p in params], tx=tx
  ).replace(step=jnp.int32(0))
  if fast:
    update = lambda s, g: flax_utils.apply_gradients(s, grads=g)
  else:
    update = lambda s, g: s.apply_gradients(grads=g)
  step = jax.jit(update, donate_argnums=0)
  box = [state]

  def run(grads):
    box[0] = step(box[0], grads)
    jax.block_until_ready(box[0])

  return run


def nnx_runner(tx, params, fast):
  model = Weights(params)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  if fast:
    update = lambda o, m, g: flax_utils.update(o, m, g)
  else:
    update = lambda o, m, g: o.update(m, g)
  step = nnx.jit(update, donate_argnums=(0, 1))

  def run(grads):
    step(optimizer, model, grads)
    jax.block_until_ready(nnx.state(model))

  return run


def main():
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawTextHelpFormatter
  )
  parser.add_argument("--params", type=int, default=25_000_000)
  parser.add_argument("--leaves", type=int, default=200)
  parser.add_argument("--repeats", type=int, default=15)
  parser.add_argument(
    "--json", metavar="PATH", help="write the figures there (benchmarks/results/)"
  )
  args = parser.parse_args()
  params = _arrays(args.params, args.leaves, 0)
  finite = _arrays(args.params, args.leaves, 1, scale=4.0)
  skipped = [a.copy() for a in finite]
  skipped[args.leaves // 2][0, 7] = np.inf
  grad_sets = {
    "ts": [[jnp.asarray(a) for a in g] for g in (finite, skipped)],
    "nnx": [Weights(g) for g in (finite, skipped)],
  }
  runners = {}
  for api, make in (("ts", train_state_runner), ("nnx", nnx_runner)):
    for opt in ("adam", "jaxamp"):
      for fast in (False,) if opt == "adam" else (False, True):
        tx = optax.adam(1e-3)
        if opt == "jaxamp":
          tx = jaxamp.dynamic_loss_scale(tx, init_scale=2.0**16)
        name = f"{api}_fast" if fast else api
        run = make(tx, params, fast)
        start = time.perf_counter()
        run(grad_sets[api][0])  # compiles
        print(f"  {name} {opt}: first call {time.perf_counter() - start:.1f} s", flush=True)
        for which in (0,) if opt == "adam" else (0, 1):
          runners[(name, opt, which)] = (run, grad_sets[api][which])
  times = {key: [] for key in runners}
  for _ in range(args.repeats + 2):  # the first two are warm-up
    for key, (run, grads) in runners.items():
      start = time.perf_counter()
      run(grads)
      times[key].append(time.perf_counter() - start)
  print(
    f"\n{args.params:,} float32 params in {args.leaves} leaves, {args.repeats} repeats, "
    f"jax {jax.__version__}, GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}\n"
  )
  print("| update | optimizer | step | median ms | p10-p90 ms | / same API with adam |")
  print("|---|---|---|---:|---:|---:|")
  rows = []
  for (name, opt, which), ts in times.items():
    ms = np.asarray(ts[2:]) * 1e3
    base = statistics.median(times[(name.removesuffix("_fast"), "adam", 0)][2:]) * 1e3
    med = float(np.median(ms))
    print(
      f"| {name} | {opt} | {'skip' if which else 'finite'} | {med:.1f} | "
      f"{np.percentile(ms, 10):.1f}-{np.percentile(ms, 90):.1f} | {med / base:.2f} |"
    )
    step = "skip" if which else "finite"
    rows.append(
      {"update": name, "optimizer": opt, "step": step, "median_ms": med, "ratio": med / base}
    )
  results_file.write(args.json, {"params": args.params, "leaves": args.leaves, "rows": rows})


if __name__ == "__main__":
  main()
