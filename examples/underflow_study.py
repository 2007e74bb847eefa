"""How much of a float16 gradient underflows to zero, with and without jaxamp.

Trains the same MLP from the same initial parameters on the same batches three
ways: (a) in float32, (b) computing in float16 without loss scaling, (c)
computing in float16 with ``jaxamp.dynamic_loss_scale`` (torch's defaults:
initial scale 2**16, growth every 2000 steps). The parameters are float32 in
all three and the loss is computed in float32; only the model's activations
and matmuls change dtype.

Every ``--measure-every`` steps it takes the run's current parameters and
batch and computes the gradient twice: with the float32 model, and as that run
computes it (float16, times the current scale, unscaled in float32). An
element *underflowed* when it is non-zero in float32 and exactly zero in
float16. The fraction reported is underflowed / non-zero-in-float32, averaged
over the measured steps. Some elements also differ because float16 rounding
changes which ReLUs are active; run (c)'s fraction is an upper bound on that
effect.

  python examples/underflow_study.py --out docs/underflow.md
"""

from __future__ import annotations

import argparse
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _digits import batch_indices, load_digits_split
from flax.training import train_state

import jaxamp
from jaxamp import flax_utils

FAST_GROWTH = 200
RUNS = {  # name: (computes in float16, growth_interval or None for no loss scaling)
  "float32": (False, None),
  "float16": (True, None),
  "float16 + jaxamp": (True, 2000),
  f"float16 + jaxamp, growth_interval={FAST_GROWTH}": (True, FAST_GROWTH),
}


class MLP(nn.Module):
  """ReLU layers computing in ``dtype`` on float32 parameters (Flax's default init)."""

  depth: int
  width: int
  dtype: jnp.dtype

  @nn.compact
  def __call__(self, x):
    x = x.astype(self.dtype)
    for _ in range(self.depth):
      x = jax.nn.relu(nn.Dense(self.width, dtype=self.dtype, param_dtype=jnp.float32)(x))
    return nn.Dense(10, dtype=self.dtype, param_dtype=jnp.float32)(x)


def _loss(model, params, x, y):
  logits = model.apply({"params": params}, x).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _make_train_step(model, scaled: bool):
  @jax.jit
  def train_step(state, x, y):
    def loss_fn(params):
      return _loss(model, params, x, y)

    if scaled:
      loss, grads = flax_utils.scaled_value_and_grad(loss_fn, state)(state.params)
    else:
      loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  return train_step


def _make_measure(model16, model32):
  @jax.jit
  def measure(params, x, y, scale):
    """Counts of (non-zero in float32, of those zero in float16), overall and layer 0."""
    g32 = jax.grad(lambda p: _loss(model32, p, x, y))(params)
    g16 = jax.grad(lambda p: _loss(model16, p, x, y) * scale)(params)
    g16 = jax.tree.map(lambda g: g * (1.0 / scale), g16)
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(g16)]))

    def counts(a, b):
      nonzero = a != 0
      return jnp.sum(nonzero), jnp.sum(nonzero & (b == 0))

    totals = [counts(a, b) for a, b in zip(jax.tree.leaves(g32), jax.tree.leaves(g16))]
    nonzero = sum(t[0] for t in totals)
    lost = sum(t[1] for t in totals)
    first_nonzero, first_lost = counts(g32["Dense_0"]["kernel"], g16["Dense_0"]["kernel"])
    return finite, nonzero, lost, first_nonzero, first_lost

  return measure


def run(name, args, data, model16, model32, params0, measure):
  x_train, y_train, x_test, y_test = data
  in_float16, growth_interval = RUNS[name]
  scaled = growth_interval is not None
  model = model16 if in_float16 else model32
  tx = optax.adam(args.lr)
  if scaled:
    tx = jaxamp.dynamic_loss_scale(tx, growth_interval=growth_interval)
  state = train_state.TrainState.create(apply_fn=model.apply, params=params0, tx=tx)
  train_step = _make_train_step(model, scaled)

  losses, fractions, first_fractions, skipped_measures = [], [], [], 0
  batches = batch_indices(len(x_train), args.batch_size, args.steps, args.seed)
  for step, idx in enumerate(batches):
    x, y = x_train[idx], y_train[idx]
    if in_float16 and step % args.measure_every == 0:
      scale = jaxamp.get_loss_scale(state) if scaled else jnp.float32(1.0)
      finite, nonzero, lost, first_nonzero, first_lost = measure(state.params, x, y, scale)
      if bool(finite):
        fractions.append(int(lost) / max(int(nonzero), 1))
        first_fractions.append(int(first_lost) / max(int(first_nonzero), 1))
      else:
        skipped_measures += 1
    state, loss = train_step(state, x, y)
    losses.append(loss)

  logits = model.apply({"params": state.params}, x_test)
  accuracy = float(jnp.mean(jnp.argmax(logits, -1) == y_test))
  losses = np.asarray(jax.device_get(losses), np.float64)
  result = {
    "accuracy": accuracy,
    "final_loss": float(np.mean(losses[-args.steps // 10 :])),
    "underflow": float(np.mean(fractions)) if fractions else float("nan"),
    "underflow_last": _mean_of_last_half(fractions),
    "underflow_first_layer": float(np.mean(first_fractions)) if fractions else float("nan"),
    "skipped": 0,
    "final_scale": 1.0,
  }
  if scaled:
    metrics = flax_utils.loss_scale_metrics(state)
    result["skipped"] = int(metrics["skipped_steps"])
    result["final_scale"] = float(metrics["loss_scale"])
  return result


def _mean_of_last_half(values):
  if not values:
    return float("nan")
  return float(np.mean(values[len(values) // 2 :]))


def _percent(x):
  return "n/a" if np.isnan(x) else f"{100 * x:.2f}%"


def table(results_by_depth) -> str:
  lines = [
    (
      "| hidden layers | run | test accuracy | train loss (last 10% of steps) "
      "| grad elements underflowed to 0 | same, second half of training "
      "| same, first layer's kernel | skipped steps | final scale |"
    ),
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for depth, results in results_by_depth.items():
    for name, r in results.items():
      reference = not RUNS[name][0]
      lines.append(
        f"| {depth} | {name} | {r['accuracy']:.4f} | {r['final_loss']:.1e} | "
        f"{'(reference)' if reference else _percent(r['underflow'])} | "
        f"{'' if reference else _percent(r['underflow_last'])} | "
        f"{'' if reference else _percent(r['underflow_first_layer'])} | "
        f"{r['skipped']} | {r['final_scale']:g} |"
      )
  return "\n".join(lines)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=2000)
  parser.add_argument("--depths", type=int, nargs="+", default=[4, 8, 12], help="hidden layers")
  parser.add_argument("--width", type=int, default=128)
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--lr", type=float, default=1e-3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--measure-every", type=int, default=10)
  parser.add_argument("--out", default=None, help="write the markdown report here")
  args = parser.parse_args(argv)

  start = time.perf_counter()
  data = load_digits_split(args.seed)
  results_by_depth = {}
  for depth in args.depths:
    model16 = MLP(depth, args.width, jnp.float16)
    model32 = MLP(depth, args.width, jnp.float32)
    params0 = model32.init(jax.random.key(args.seed), data[0][:1])["params"]
    measure = _make_measure(model16, model32)
    results_by_depth[depth] = {
      name: run(name, args, data, model16, model32, params0, measure) for name in RUNS
    }
  report = table(results_by_depth)
  elapsed = time.perf_counter() - start
  print(report)
  print(f"({elapsed:.0f} s)")
  if args.out:
    command = "python examples/underflow_study.py " + " ".join(
      sys.argv[1:] if argv is None else argv
    )
    with open(args.out, "w") as f:
      f.write(_markdown(args, report, command, elapsed))
  return results_by_depth


def _markdown(args, report, command, elapsed) -> str:
  return f"""# float16 gradient underflow, measured

{report}

MLPs on scikit-learn's digits (1437 training and 360 test images): ReLU hidden
layers of width {args.width}, Flax's default initialisation, Adam (lr {args.lr}),
batch {args.batch_size}, {args.steps} steps, seed {args.seed}, the same initial
parameters and batches for every run of a depth. Parameters are float32 and the
loss is computed in float32 from float32 logits; the float16 runs compute
activations and matmuls in float16. Underflow is measured every
{args.measure_every} steps on the run's own parameters and batch: elements that
are non-zero in the float32 gradient and exactly zero in the float16 one.

Reproduce (CPU, jax {jax.__version__}, {elapsed:.0f} s):

```
{command.strip()}
```
"""


if __name__ == "__main__":
  main()
