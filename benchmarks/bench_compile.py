"""First-call compile time of one optimizer step: jaxamp's two forms against plain Adam.

For each leaf-size mix (benchmarks/model_shapes.py), a fresh jitted, donated
step is traced, lowered and compiled ``--repeats`` times per contender,
interleaved; the table gives the median and its ratio to plain
``optax.adam`` + ``apply_updates``:

  adam                  the baseline
  optax form            dynamic_loss_scale(adam): tx.update + optax.apply_updates
  apply_scaled_updates  the same tx through jaxamp.apply_scaled_updates

  PYTHONPATH=. python benchmarks/bench_compile.py --mixes equal/25m/200,gpt2

To compare with another revision, put its ``jaxamp`` first on the path:
``git worktree add /tmp/old REV && PYTHONPATH=/tmp/old:. python benchmarks/bench_compile.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import optax
import results_file
from model_shapes import MIXES, describe

import jaxamp

CONTENDERS = ("adam", "optax form", "apply_scaled_updates")


def compile_seconds(contender: str, params: list) -> float:
  adam = optax.adam(1e-3)
  tx = adam if contender == "adam" else jaxamp.dynamic_loss_scale(adam)
  state = jax.eval_shape(tx.init, params)
  if contender == "apply_scaled_updates":

    def step(p, s, g):
      return jaxamp.apply_scaled_updates(tx, g, s, p)

  else:

    def step(p, s, g):
      updates, s = tx.update(g, s, p)
      return optax.apply_updates(p, updates), s

  start = time.perf_counter()
  jax.jit(step, donate_argnums=(0, 1)).lower(params, state, params).compile()
  return time.perf_counter() - start


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--mixes", default="equal/25m/200,lognormal/25m/200,gpt2,resnet50")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument(
    "--json", metavar="PATH", help="write the figures there (benchmarks/results/)"
  )
  args = parser.parse_args()
  print(
    f"# {os.cpu_count()} cores, jax {jax.__version__}, jaxamp from "
    f"{os.path.dirname(jaxamp.__file__)}, median of {args.repeats} compiles"
  )
  print("| mix | contender | compile s | / adam |")
  print("|---|---|---:|---:|")
  rows = []
  for mix in args.mixes.split(","):
    shapes = MIXES[mix]()
    params = [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in shapes]
    seconds = {name: [] for name in CONTENDERS}
    for _ in range(args.repeats):
      for name in CONTENDERS:
        seconds[name].append(compile_seconds(name, params))
    base = statistics.median(seconds["adam"])
    for name in CONTENDERS:
      median = statistics.median(seconds[name])
      print(
        f"| {mix} ({describe(shapes)}) | {name} | {median:.2f} | {median / base:.2f} |", flush=True
      )
      rows.append({"mix": mix, "contender": name, "compile_s": median, "ratio": median / base})
  results_file.write(args.json, {"repeats": args.repeats, "rows": rows})


if __name__ == "__main__":
  main()
