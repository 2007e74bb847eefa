"""One optimizer step with loss scaling: jaxamp against optax, flax, jmp and torch.

Every contender runs in this one process, interleaved step by step, on the same
gradients; the table gives the median step time, its spread (p10-p90), the
ratio to plain ``optax.adam`` of the same configuration and the compile time.

  PYTHONPATH=. python benchmarks/bench_step.py --quick
  PYTHONPATH=. python benchmarks/bench_step.py --mixes lognormal/25m/200 --grads f32 --repeats 30

Leaf-size mixes (``--mixes``, benchmarks/model_shapes.py): equal sizes
(``equal/25m/200``: 25M params in 200 leaves), lognormal sizes (sigma 1), and
the parameter shapes of GPT-2 small, ResNet-50 and ViT-B/16. Grads are float32,
float16 or bfloat16 (``--grads f32,f16,bf16``); params are float32.

Contenders (``--contenders``, comma separated):
  adam            plain optax.adam + apply_updates (the baseline, ratio 1)
  jaxamp          dynamic_loss_scale(adam) + apply_updates (the optax form)
  jaxamp_step     jaxamp.apply_scaled_updates(dynamic_loss_scale(adam), ...)
  jaxamp_flat     the same on one flat float32 buffer (ravel_pytree layout)
  floor           the least any check-then-skip step costs, not torch's arithmetic:
                  jaxamp.ops.all_finite(grads), then plain Adam on grads * (1 / scale)
                  (multiplied in float32, in the grads' dtype as torch's) inside a
                  lax.cond (no exact inverse, no rounding guard, a fixed scale):
                  the reference for what checking before updating costs
  adam_flat       plain adam on the flat buffer (reference for jaxamp_flat)
  flax            flax DynamicScale pattern: unscale, all(isfinite), jnp.where
                  select of params and optimizer state
  jmp             jmp.DynamicLossScale + jmp.select_tree
  apply_if_finite optax.apply_if_finite(adam) (no scaling at all)
  torch_foreach   torch GradScaler + Adam(foreach=True), CPU
  torch_fused     torch GradScaler + Adam(fused=True), CPU

Params and optimizer state are donated, in the order the step returns them:
``step(params, opt_state, grads) -> (params, opt_state)``. JAX pairs each
donated input with the first output of the same shape and dtype, in order;
donating ``(grads, opt_state, params)`` to a step returning ``(params,
opt_state)`` pairs the params' output with Adam's ``mu`` buffer and so on
around, and XLA then copies every buffer (a 5x slower plain Adam step here). Each
configuration is run with finite gradients and, for the contenders that can
skip, with one inf in the gradients (``skip`` rows; the ratio is still to the
finite plain-adam step). A contender whose compile exceeds ``--compile-budget``
seconds is reported and not timed; slow baselines are left out of the
2,000-leaf configuration unless named with ``--contenders``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax
import results_file
from jax.flatten_util import ravel_pytree
from model_shapes import MIXES, describe

import jaxamp

GRAD_DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": jnp.bfloat16}

ALL = [
  "adam",
  "jaxamp",
  "jaxamp_step",
  "floor",
  "adam_flat",
  "jaxamp_flat",
  "flax",
  "jmp",
  "apply_if_finite",
  "torch_foreach",
  "torch_fused",
]
SLOW_AT_MANY_LEAVES = {"flax", "jmp", "apply_if_finite"}
SCALE = 2.0**16
LR = 1e-3


def make_tree(shapes, dtype, seed, scale=1.0):
  rng = np.random.default_rng(seed)
  return [(rng.standard_normal(s, np.float32) * scale).astype(dtype) for s in shapes]


# ---------------------------------------------------------------- JAX steps


def _adam_step(grads, state, params, tx):
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state


def _jaxamp_step(grads, state, params, tx):
  return jaxamp.apply_scaled_updates(tx, grads, state, params)


def _floor_step(grads, state, params, tx):
  inverse = 1.0 / state["scale"]

  def apply(params, opt_state):
    unscaled = [(g.astype(jnp.float32) * inverse).astype(g.dtype) for g in grads]
    return _adam_step(unscaled, opt_state, params, tx)

  params, opt_state = jax.lax.cond(
    jaxamp.ops.all_finite(grads), apply, lambda p, s: (p, s), params, state["opt"]
  )
  return params, {"scale": state["scale"], "opt": opt_state}


def _flax_step(grads, state, params, tx):
  # flax.training.dynamic_scale.DynamicScale.value_and_grad after grad_fn
  # (flax 0.12, verbatim), then the select of its README/examples.
  scale, fin_steps = state["scale"], state["fin_steps"]
  grads = jax.tree.map(lambda g: jnp.asarray(g, jnp.float32) / scale, grads)
  finite = jnp.array(True)
  for g in jax.tree.leaves(grads):
    finite &= jnp.all(jax.lax.is_finite(g))
  grow = fin_steps == 2000
  fin_scale = jnp.where(grow & finite, jnp.minimum(scale * 2.0, jnp.finfo(jnp.float32).max), scale)
  new_scale = jnp.where(finite, fin_scale, scale * 0.5)
  new_fin_steps = jnp.where(grow | (~finite), 0, fin_steps + 1)
  updates, opt_state = tx.update(grads, state["opt"], params)
  new_params = optax.apply_updates(params, updates)
  select = lambda a, b: jax.tree.map(lambda x, y: jnp.where(finite, x, y), a, b)
  return select(new_params, params), {
    "scale": new_scale,
    "fin_steps": new_fin_steps,
    "opt": select(opt_state, state["opt"]),
  }


def _jmp_step(grads, state, params, tx):
  import jmp

  loss_scale = jmp.DynamicLossScale(state["scale"], state["counter"])
  grads = loss_scale.unscale(grads)
  finite = jmp.all_finite(grads)
  loss_scale = loss_scale.adjust(finite)
  updates, opt_state = tx.update(grads, state["opt"], params)
  new_params = optax.apply_updates(params, updates)
  params, opt_state = jmp.select_tree(finite, (new_params, opt_state), (params, state["opt"]))
  return params, {"scale": loss_scale.loss_scale, "counter": loss_scale.counter, "opt": opt_state}


def _flat_jaxamp_step(grads, state, params, tx):
  return jaxamp.apply_scaled_updates(tx, grads, state, params)


def build_jax(name, params, grads):
  """Returns ``(step, params, state, grads)`` with step = jitted (p, s, g) -> (p, s)."""
  adam = optax.adam(LR)
  if name in ("adam_flat", "jaxamp_flat"):
    params = ravel_pytree(params)[0]
    grads = [ravel_pytree(g)[0] for g in grads]
  if name in ("adam", "adam_flat"):
    tx, fn, state = adam, _adam_step, adam.init(params)
  elif name in ("jaxamp", "jaxamp_step", "jaxamp_flat"):
    tx = jaxamp.dynamic_loss_scale(adam, init_scale=SCALE)
    fn = _adam_step if name == "jaxamp" else _jaxamp_step
    state = tx.init(params)
  elif name == "floor":
    tx, fn = adam, _floor_step
    state = {"scale": jnp.float32(SCALE), "opt": adam.init(params)}
  elif name == "flax":
    tx, fn = adam, _flax_step
    state = {"scale": jnp.float32(SCALE), "fin_steps": jnp.int32(0), "opt": adam.init(params)}
  elif name == "jmp":
    tx, fn = adam, _jmp_step
    state = {"scale": jnp.float32(SCALE), "counter": jnp.int32(0), "opt": adam.init(params)}
  elif name == "apply_if_finite":
    tx = optax.apply_if_finite(adam, max_consecutive_errors=10**6)
    fn, state = _adam_step, tx.init(params)
  else:
    raise ValueError(name)
  # (params, state, grads) -> (params, state): JAX pairs each donated input
  # with the first output of the same shape, in order, so the donated
  # arguments come in the order of the outputs (see the module docstring).
  step = jax.jit(lambda p, s, g: fn(g, s, p, tx), donate_argnums=(0, 1))
  return step, params, state, grads


# -------------------------------------------------------------- torch steps


class TorchStep:
  def __init__(self, name, params, grads):
    import torch

    self.torch = torch
    self.params = [torch.nn.Parameter(torch.from_numpy(np.array(p, np.float32))) for p in params]
    self.grads = [[torch.from_numpy(np.asarray(x)) for x in g] for g in grads]
    for p, g in zip(self.params, self.grads[0]):
      p.grad = g.clone()
    kind = {"torch_foreach": {"foreach": True}, "torch_fused": {"fused": True}}[name]
    self.opt = torch.optim.Adam(self.params, lr=LR, **kind)
    self.scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    self.scaler.scale(torch.ones(()))  # creates the scale tensor, as a training loop would

  def __call__(self, which):
    with self.torch.no_grad():  # restore the scaled grads, outside the timing
      for p, g in zip(self.params, self.grads[which]):
        p.grad.copy_(g)
    start = time.perf_counter()
    self.scaler.step(self.opt)
    self.scaler.update()
    return time.perf_counter() - start


# ------------------------------------------------------------------ driver


def run_config(size, grad_dtype, contenders, repeats, budget):
  shapes = MIXES[size]()
  dtype = GRAD_DTYPES[grad_dtype]
  params = [jnp.asarray(x) for x in make_tree(shapes, np.float32, 0)]
  finite = make_tree(shapes, dtype, 1, scale=4.0)
  skipped = [x.copy() for x in finite]
  middle = skipped[len(shapes) // 2]
  middle.reshape(-1)[middle.size // 2] = np.inf
  grads_np = [finite, skipped]
  grads = [[jnp.asarray(x) for x in g] for g in grads_np]
  rows, runners = [], {}
  for name in contenders:
    if name.startswith("torch"):
      if grad_dtype != "f32":
        rows.append((name, "n/a: torch's GradScaler needs grads in the params' dtype"))
        continue
      try:
        runners[name] = TorchStep(name, params, grads_np)
        rows.append((name, None))
      except Exception as error:  # noqa: BLE001 - reported in the table
        rows.append((name, f"failed: {type(error).__name__}: {error}"[:120]))
      continue
    try:
      step, p, s, g = build_jax(name, [jnp.array(x) for x in params], grads)
      start = time.perf_counter()
      compiled = step.lower(p, s, g[0]).compile()
      compile_s = time.perf_counter() - start
      print(f"  {size} {grad_dtype} {name}: compiled in {compile_s:.1f} s", flush=True)
      if compile_s > budget:
        rows.append((name, f"not timed: compile {compile_s:.0f} s > budget {budget:.0f} s"))
        continue
      runners[name] = [compiled, p, s, g, compile_s]
      rows.append((name, None))
    except Exception as error:  # noqa: BLE001
      traceback.print_exc(limit=1)
      rows.append((name, f"failed: {type(error).__name__}: {str(error).splitlines()[0]}"[:140]))
  skips = [n for n in runners if n not in ("adam", "adam_flat")]
  times = {(n, w): [] for n in runners for w in (0, 1) if w == 0 or n in skips}
  for _ in range(repeats + 2):  # the first two are warm-up
    for (name, which), ts in times.items():
      runner = runners[name]
      if name.startswith("torch"):
        ts.append(runner(which))
        continue
      compiled, p, s, g, _ = runner
      start = time.perf_counter()
      p, s = compiled(p, s, g[which])
      jax.block_until_ready((p, s))
      ts.append(time.perf_counter() - start)
      runner[1], runner[2] = p, s
  base = statistics.median(times[("adam", 0)][2:]) if ("adam", 0) in times else None
  table = []
  for name, note in rows:
    for which in (0, 1):
      if (name, which) not in times:
        if which == 0 and note:
          table.append((size, grad_dtype, name, "finite", None, None, None, note))
        continue
      ts = np.asarray(times[(name, which)][2:]) * 1e3
      med = float(np.median(ts))
      spread = (float(np.percentile(ts, 10)), float(np.percentile(ts, 90)))
      compile_s = None if name.startswith("torch") else runners[name][4]
      ratio = med / (base * 1e3) if base else None
      table.append(
        (size, grad_dtype, name, "skip" if which else "finite", med, spread, ratio, compile_s)
      )
  del runners
  return table


def print_table(table):
  print("| size | grads | contender | step | median ms | p10-p90 ms | / adam | compile s |")
  print("|---|---|---|---|---:|---:|---:|---:|")
  for size, dt, name, which, med, spread, ratio, extra in table:
    if med is None:
      print(f"| {size} | {dt} | {name} | {which} | - | - | - | {extra} |")
      continue
    comp = "" if extra is None else f"{extra:.1f}"
    print(
      f"| {size} | {dt} | {name} | {which} | {med:.1f} | {spread[0]:.1f}-{spread[1]:.1f} "
      f"| {ratio:.2f} | {comp} |"
    )


def main():
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawTextHelpFormatter
  )
  parser.add_argument("--mixes", default=",".join(MIXES), help=f"of: {', '.join(MIXES)}")
  parser.add_argument("--grads", default="f32,f16")
  parser.add_argument(
    "--contenders", default=None, help="default: all (slow ones not at 2000 leaves)"
  )
  parser.add_argument("--repeats", type=int, default=30)
  parser.add_argument("--compile-budget", type=float, default=300.0)
  parser.add_argument("--quick", action="store_true", help="equal/1m/4 only, 5 repeats")
  parser.add_argument(
    "--json", metavar="PATH", help="write the figures there (benchmarks/results/)"
  )
  args = parser.parse_args()
  if args.quick:
    args.mixes, args.repeats = "equal/1m/4", 5
  print(
    f"# {platform.processor() or platform.machine()}, {jax.devices()[0].platform}, "
    f"jax {jax.__version__}, optax {optax.__version__}, repeats {args.repeats}, "
    f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}",
    flush=True,
  )
  table = []
  for size in args.mixes.split(","):
    print(f"# {size}: {describe(MIXES[size]())}", flush=True)
    for grad_dtype in args.grads.split(","):
      if args.contenders:
        names = args.contenders.split(",")
      else:
        many = len(MIXES[size]()) >= 2000
        names = [n for n in ALL if not (many and n in SLOW_AT_MANY_LEAVES)]
      rows = run_config(size, grad_dtype, names, args.repeats, args.compile_budget)
      print_table(rows)
      table += rows
  print("\n## All configurations\n")
  print_table(table)
  keys = ("mix", "grads", "contender", "step", "median_ms", "p10_p90_ms", "ratio", "compile_s")
  rows = [dict(zip(keys, row)) for row in table]  # a failed row: its error as compile_s
  results_file.write(args.json, {"repeats": args.repeats, "rows": rows})


if __name__ == "__main__":
  main()
