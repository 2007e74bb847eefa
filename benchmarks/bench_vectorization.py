"""Which leaf-sized kernels XLA CPU vectorizes: plain Adam against jaxamp, even and odd sizes.

On XLA CPU a kernel that reads a runtime scalar (jaxamp's ``1/scale``, Adam's
bias corrections) is compiled to scalar code when the leaf's outer dimension
does not split evenly over the threads XLA partitions it into: every element
then runs behind a bounds check, and LLVM does not vectorize a loop that loads
a scalar inside that check. Plain Adam's moment kernels read no runtime scalar
and stay vectorized; jaxamp's unscale puts one in each of them.

For one leaf of each of ``--shapes`` (by default 4,000,000 and 4,000,001
elements, even and odd on this 2-core machine, which splits each kernel in
two, and shapes of several dimensions: what counts is the number of
elements, as XLA CPU indexes a kernel's arrays flat), float32
and float16 grads, this compiles plain ``optax.adam`` and ``jaxamp.apply_scaled_updates``
with XLA's dumps on, counts the leaf-sized kernels whose optimized LLVM IR
holds vector instructions, and times each step (donated, interleaved, median).

  PYTHONPATH=. python benchmarks/bench_vectorization.py
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import re
import statistics
import sys
import tempfile
import time

DUMP = tempfile.mkdtemp(prefix="jaxamp_vectorization_")
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={DUMP}".strip()

import jax  # XLA_FLAGS is read when the backend starts, after this
import jax.numpy as jnp
import optax
import results_file

import jaxamp

ADAM = optax.adam(1e-3)
TX = jaxamp.dynamic_loss_scale(optax.adam(1e-3))


def kernels(module: str, shape: tuple[int, ...]) -> tuple[int, int]:
  """(vectorized, all) among the kernels of ``module`` that loop over a ``shape`` array."""
  vectorized = total = 0
  array_type = f"[{math.prod(shape)} x "  # XLA CPU's kernels index arrays flat
  for path in glob.glob(os.path.join(DUMP, f"*.{module}.*kernel_module.ir-no-opt.ll")):
    with open(path) as f:
      if not re.search(re.escape(array_type) + "(float|half)", f.read()):
        continue
    with open(path.replace("ir-no-opt", "ir-with-opt")) as f:
      vectorized += bool(re.search(r"<\d+ x (float|half)>", f.read()))
    total += 1
  return vectorized, total


def step_function(name: str, contender: str):
  def adam(p, s, g):
    updates, s = ADAM.update(g, s, p)
    return optax.apply_updates(p, updates), s

  def scaled(p, s, g):
    return jaxamp.apply_scaled_updates(TX, g, s, p)

  step = adam if contender == "adam" else scaled
  step.__name__ = name  # names the dumped module
  return step


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--shapes", default="4000000,4000001,4001x1000,4001x999,7x7x256x320,7x7x255x321"
  )
  parser.add_argument("--repeats", type=int, default=15)
  parser.add_argument(
    "--json", metavar="PATH", help="write the figures there (benchmarks/results/)"
  )
  args = parser.parse_args()
  runs = {}
  for shape in [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]:
    label = "x".join(map(str, shape))
    for grads in ("f32", "f16"):
      g = {"w": jnp.ones(shape, jnp.float32 if grads == "f32" else jnp.float16)}
      for contender in ("adam", "jaxamp"):
        name = f"{contender}_{grads}_{label}"
        opt = ADAM if contender == "adam" else TX
        p = {"w": jnp.ones(shape, jnp.float32)}
        fn = jax.jit(step_function(name, contender), donate_argnums=(0, 1))
        compiled = fn.lower(p, opt.init(p), g).compile()
        runs[(shape, grads, contender)] = [compiled, p, opt.init(p), g, []]
  for _ in range(args.repeats + 2):
    for run in runs.values():
      start = time.perf_counter()
      run[1], run[2] = jax.block_until_ready(run[0](run[1], run[2], run[3]))
      run[4].append(time.perf_counter() - start)
  print(f"# {os.cpu_count()} cores, jax {jax.__version__}, {args.repeats} repeats; dumps in {DUMP}")
  print("| leaf shape | grads | contender | median ms | / adam | vectorized kernels |")
  print("|---|---|---|---:|---:|---:|")
  rows = []
  for (shape, grads, contender), run in runs.items():
    label = "x".join(map(str, shape))
    ms = statistics.median(run[4][2:]) * 1e3
    base = statistics.median(runs[(shape, grads, "adam")][4][2:]) * 1e3
    vectorized, total = kernels(f"jit_{contender}_{grads}_{label}", shape)
    print(
      f"| {label} | {grads} | {contender} | {ms:.2f} | {ms / base:.2f} | {vectorized}/{total} |"
    )
    rows.append(
      {
        "leaf": label,
        "grads": grads,
        "contender": contender,
        "median_ms": ms,
        "ratio": ms / base,
        "kernels_vectorized": [vectorized, total],
      }
    )
  results_file.write(args.json, {"repeats": args.repeats, "rows": rows})
  sys.stdout.flush()


if __name__ == "__main__":
  main()
