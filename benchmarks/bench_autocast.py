"""``jaxamp.autocast`` against the same casts written by hand: one jitted training step.

A pre-LayerNorm Transformer block (attention with softmax, two LayerNorms, a GELU
MLP) and an MSE loss; the step is ``jax.value_and_grad`` of the loss, jitted.
``autocast`` runs the float32 block under ``policy="cpu"``; the hand-written
version casts the same values to float16 where that policy does (the matmul
weights, biases and inputs) and nothing else. Both run in this one process,
interleaved, and the table gives the median step time of each, their ratio, and
the ratio of the time to trace, lower and compile each step.

  PYTHONPATH=. python benchmarks/bench_autocast.py
  PYTHONPATH=. python benchmarks/bench_autocast.py --dim 256 --seq 128 --repeats 50
  PYTHONPATH=.:benchmarks python benchmarks/bench_autocast.py --runs 3 --repeats 60 \
    --json benchmarks/results/autocast.json
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import results_file

import jaxamp

H = jnp.float16


def layer_norm(x, w, b):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-5) * w + b


def block(p, x, y, heads):
  """The float32 block: what autocast is given."""
  batch, seq, dim = x.shape

  def split(t):
    return t.reshape(batch, seq, heads, dim // heads).transpose(0, 2, 1, 3)

  h = layer_norm(x, p["ln1_w"], p["ln1_b"])
  q, k, v = map(split, jnp.split(h @ p["wqkv"].T + p["bqkv"], 3, -1))
  a = jax.nn.softmax(q @ k.swapaxes(-1, -2) / math.sqrt(dim // heads), -1)
  o = (a @ v).transpose(0, 2, 1, 3).reshape(batch, seq, dim)
  x = x + (o @ p["wo"].T + p["bo"])
  h = layer_norm(x, p["ln2_w"], p["ln2_b"])
  x = x + (jax.nn.gelu(h @ p["w1"].T + p["b1"], approximate=False) @ p["w2"].T + p["b2"])
  return jnp.mean((x - y) ** 2)


HALF_PARAMS = ("wqkv", "bqkv", "wo", "bo", "w1", "b1", "w2", "b2")


def linear16(h, w, b):
  """torch's float16 ``linear``: the matmul accumulated in float32, the bias
  added to it, one rounding to float16."""
  acc = jax.lax.dot_general(
    h, w, (((h.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32
  )
  return (acc + b.astype(jnp.float32)).astype(H)


def block_by_hand(p, x, y, heads):
  """The same with torch's CPU autocast casts written out: matmuls and their
  biases in float16 (the bias added before the one rounding), softmax and GELU
  in float32 rounded once, the residual stream, LayerNorms and loss in float32."""
  batch, seq, dim = x.shape
  hp = {k: p[k].astype(H) for k in HALF_PARAMS}

  def split(t):
    return t.reshape(batch, seq, heads, dim // heads).transpose(0, 2, 1, 3)

  h = layer_norm(x, p["ln1_w"], p["ln1_b"]).astype(H)
  q, k, v = map(split, jnp.split(linear16(h, hp["wqkv"], hp["bqkv"]), 3, -1))
  # torch's CPU div of a half tensor by a scalar: in float32, rounded once
  scores = (q @ k.swapaxes(-1, -2)).astype(jnp.float32) / math.sqrt(dim // heads)
  # torch's fused softmax: in float32, rounded once
  a = jax.nn.softmax(scores.astype(H).astype(jnp.float32), -1).astype(H)
  o = (a @ v).transpose(0, 2, 1, 3).reshape(batch, seq, dim)
  x = x + linear16(o, hp["wo"], hp["bo"]).astype(jnp.float32)
  h = layer_norm(x, p["ln2_w"], p["ln2_b"]).astype(H)
  # torch's fused GELU: in float32, rounded once
  g = jax.nn.gelu(linear16(h, hp["w1"], hp["b1"]).astype(jnp.float32), approximate=False)
  mlp = linear16(g.astype(H), hp["w2"], hp["b2"])
  x = x + mlp.astype(jnp.float32)
  return jnp.mean((x - y) ** 2)


def params(dim, seed=0):
  rng = np.random.default_rng(seed)
  shapes = {
    "ln1_w": (dim,), "ln1_b": (dim,), "wqkv": (3 * dim, dim), "bqkv": (3 * dim,),
    "wo": (dim, dim), "bo": (dim,), "ln2_w": (dim,), "ln2_b": (dim,),
    "w1": (4 * dim, dim), "b1": (4 * dim,), "w2": (dim, 4 * dim), "b2": (dim,),
  }  # fmt: skip
  p = {
    k: jnp.asarray(rng.standard_normal(s).astype(np.float32) / math.sqrt(s[-1]))
    for k, s in shapes.items()
  }
  p["ln1_w"], p["ln2_w"] = p["ln1_w"] + 1.0, p["ln2_w"] + 1.0
  return p


def measure(contenders, p, x, y, args):
  """One interleaved measurement: compile times, step times, their ratios."""
  compile_times = {name: [] for name in contenders}
  for _ in range(args.compiles):  # interleaved: trace + lower + compile, no cache
    for name, loss in contenders.items():
      start = time.perf_counter()
      jax.jit(jax.value_and_grad(loss)).lower(p, x, y).compile()
      compile_times[name].append(time.perf_counter() - start)

  steps = {name: jax.jit(jax.value_and_grad(loss)) for name, loss in contenders.items()}
  values = {name: step(p, x, y) for name, step in steps.items()}  # compile, warm up
  loss_diff = abs(float(values["autocast"][0]) - float(values["by hand"][0]))
  times = {name: [] for name in contenders}
  for _ in range(args.repeats):
    for name, step in steps.items():
      start = time.perf_counter()
      jax.block_until_ready(step(p, x, y))
      times[name].append(time.perf_counter() - start)

  med = {name: statistics.median(t) for name, t in times.items()}
  cmed = {name: statistics.median(t) for name, t in compile_times.items()}
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; block dim {args.dim}, "
        f"seq {args.seq}, batch {args.batch}; median of {args.repeats} steps, {args.compiles} compiles")  # fmt: skip
  print(f"{'':10} {'step ms':>9} {'compile s':>10}")
  for name in contenders:
    print(f"{name:10} {med[name] * 1e3:9.3f} {cmed[name]:10.3f}")
  print(f"runtime ratio autocast / by hand: {med['autocast'] / med['by hand']:.3f}")
  print(f"compile ratio autocast / by hand: {cmed['autocast'] / cmed['by hand']:.3f}")
  print(f"|loss difference|: {loss_diff:.3g}")
  return {
    "step_ms": {n: round(med[n] * 1e3, 3) for n in contenders},
    "compile_s": {n: round(cmed[n], 3) for n in contenders},
    "runtime_ratio": round(med["autocast"] / med["by hand"], 3),
    "compile_ratio": round(cmed["autocast"] / cmed["by hand"], 3),
    "loss_difference": loss_diff,
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dim", type=int, default=128)
  parser.add_argument("--seq", type=int, default=64)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--repeats", type=int, default=30)
  parser.add_argument("--compiles", type=int, default=5)
  parser.add_argument("--runs", type=int, default=1, help="measurements one after the other")
  parser.add_argument("--json", help="also write the figures to this results file")
  args = parser.parse_args()

  p = params(args.dim)
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((args.batch, args.seq, args.dim)).astype(np.float32))
  y = jnp.asarray(rng.standard_normal((args.batch, args.seq, args.dim)).astype(np.float32))

  def auto_loss(p, x, y):
    return jaxamp.autocast(lambda p, x, y: block(p, x, y, args.heads), policy="cpu")(p, x, y)

  def hand_loss(p, x, y):
    return block_by_hand(p, x, y, args.heads)

  contenders = {"autocast": auto_loss, "by hand": hand_loss}
  runs = []
  for _ in range(args.runs):
    runs.append(measure(contenders, p, x, y, args))
  results_file.write(
    args.json,
    {
      "what": "one jitted value_and_grad step of a Transformer block, autocast(policy='cpu') against the same casts by hand",
      "args": vars(args),
      "runs": runs,
    },
  )


if __name__ == "__main__":
  main()
