"""The finiteness check alone: jaxamp's against the single-reduction forms.

25M elements in 200 leaves, either all of one size (jaxamp checks them eight
at a time in one variadic reduction) or all of different sizes (each alone:
jaxamp checks its two halves in one variadic reduction). Prints the median
time, the compile time and the temporary memory XLA allocates (a fresh
temporary costs page faults on every call on CPU).

  PYTHONPATH=. python benchmarks/bench_check.py
  PYTHONPATH=. python benchmarks/bench_check.py --leaves 20 --repeats 5     # smoke
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._torch.unscale import leaf_finite_flags


def sum_times_zero(leaves):
  return jnp.stack(
    [jnp.isfinite(jnp.sum(g * jnp.zeros([], g.dtype), dtype=jnp.float32)) for g in leaves]
  )


def all_isfinite(leaves):
  return jnp.stack([jnp.all(jnp.isfinite(g)) for g in leaves])


FORMS = {"jaxamp": leaf_finite_flags, "sum(g*0)": sum_times_zero, "all(isfinite)": all_isfinite}


def main():
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawTextHelpFormatter
  )
  parser.add_argument("--params", type=int, default=25_000_000)
  parser.add_argument("--leaves", type=int, default=200)
  parser.add_argument("--repeats", type=int, default=20)
  args = parser.parse_args()
  per_leaf = args.params // args.leaves
  rng = np.random.default_rng(0)
  print("| leaves | dtype | form | median ms | compile s | temporary MB |")
  print("|---|---|---|---:|---:|---:|")
  for layout in ("same size", "sizes differ"):
    for dtype in (jnp.float32, jnp.float16, jnp.bfloat16):
      sizes = [per_leaf + (2 * i if layout == "sizes differ" else 0) for i in range(args.leaves)]
      leaves = [jnp.asarray(rng.standard_normal(n, np.float32), dtype) for n in sizes]
      compiled, rows = {}, {}
      for name, form in FORMS.items():
        start = time.perf_counter()
        compiled[name] = jax.jit(form).lower(leaves).compile()
        rows[name] = [
          time.perf_counter() - start,
          compiled[name].memory_analysis().temp_size_in_bytes,
        ]
        assert bool(jnp.all(compiled[name](leaves))), name
      times = {name: [] for name in compiled}
      for _ in range(args.repeats + 1):  # interleaved; the first is warm-up
        for name, fn in compiled.items():
          start = time.perf_counter()
          fn(leaves).block_until_ready()
          times[name].append(time.perf_counter() - start)
      for name, (compile_s, temp) in rows.items():
        ms = statistics.median(times[name][1:]) * 1e3
        print(
          f"| {layout} | {jnp.dtype(dtype).name} | {name} | {ms:.2f} | {compile_s:.2f} | {temp / 1e6:.2f} |",
          flush=True,
        )


if __name__ == "__main__":
  main()
