"""``jaxamp.autocast`` against ``torch.autocast("cpu")``: how often the fused ops agree.

Part 1 (the default): per op, the fraction of elements of jaxamp's output equal
to torch's, for float16 and bfloat16, under ``policy="cpu"``. Each op runs on
the output of a half matmul (``x @ w``: 512 x 64, standard deviation about 2),
written the usual JAX way (``jax.nn.softmax``, ``jax.nn.gelu``, Flax and
Equinox ``LayerNorm``, ``optax.softmax_cross_entropy*``) and the usual torch
way (``torch.softmax``, ``F.gelu``, ``F.layer_norm``, ``F.cross_entropy``).
"equal" compares jaxamp's value cast to torch's dtype; "at half" compares both
rounded to the half dtype (for the losses, which torch computes in float32).
Both compute each op in float32 and round once, with different float32
arithmetic: what differs is where that lands against a half rounding boundary,
and which kernels torch runs depends on the CPU (``ATEN_CPU_CAPABILITY``,
oneDNN), so the fractions are this machine's.

Part 2 (``--train``): a Transformer block (a linear embedding, LayerNorms,
attention with softmax, a GELU MLP, a linear head and cross-entropy), trained
200 steps of SGD in float16 autocast from the same weights and data by torch
(``torch.autocast("cpu", torch.float16)``) and by jaxamp (``policy="cpu"``):
the largest and the final ``|loss_jax - loss_torch|``.

  PYTHONPATH=. python benchmarks/autocast_agreement.py
  PYTHONPATH=. python benchmarks/autocast_agreement.py --train --steps 200
"""

from __future__ import annotations

import argparse
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
import torch.nn.functional as F
from flax import linen, nnx

import jaxamp

HALVES = {"float16": (jnp.float16, torch.float16), "bfloat16": (jnp.bfloat16, torch.bfloat16)}
N, D = 512, 64


def _ln_params(rng):
  return (1.0 + 0.1 * rng.standard_normal(D)).astype(np.float32), (
    0.1 * rng.standard_normal(D)
  ).astype(np.float32)


def _nnx_ln(scale, bias):
  m = nnx.LayerNorm(D, epsilon=1e-5, rngs=nnx.Rngs(0))
  m.scale[...], m.bias[...] = jnp.asarray(scale), jnp.asarray(bias)
  return m


def _eqx_ln(scale, bias):
  m = eqx.nn.LayerNorm(D, eps=1e-5)
  return eqx.tree_at(lambda m: (m.weight, m.bias), m, (jnp.asarray(scale), jnp.asarray(bias)))


def ops(scale, bias, labels):
  """name -> (JAX op, torch op), each applied to the half matmul output."""
  one_hot = jax.nn.one_hot(labels, D)
  nnx_ln, eqx_ln = _nnx_ln(scale, bias), _eqx_ln(scale, bias)
  linen_params = {"params": {"scale": jnp.asarray(scale), "bias": jnp.asarray(bias)}}
  t_scale, t_bias, t_labels = torch.tensor(scale), torch.tensor(bias), torch.tensor(labels)
  return {
    "matmul (reference)": (lambda h: h, lambda h: h),
    "jax.nn.softmax": (lambda h: jax.nn.softmax(h, -1), lambda h: torch.softmax(h, -1)),
    "jax.nn.softmax (axis 0)": (lambda h: jax.nn.softmax(h, 0), lambda h: torch.softmax(h, 0)),
    "jax.nn.log_softmax": (
      lambda h: jax.nn.log_softmax(h, -1),
      lambda h: torch.log_softmax(h, -1),
    ),
    "jax.nn.gelu(approximate=True)": (
      lambda h: jax.nn.gelu(h, approximate=True),
      lambda h: F.gelu(h, approximate="tanh"),
    ),
    "jax.nn.gelu(approximate=False)": (
      lambda h: jax.nn.gelu(h, approximate=False),
      lambda h: F.gelu(h),
    ),
    "jax.nn.standardize": (
      lambda h: jax.nn.standardize(h, -1, epsilon=1e-5),
      lambda h: F.layer_norm(h, (D,)),
    ),
    "flax.nnx.LayerNorm": (lambda h: nnx_ln(h), lambda h: F.layer_norm(h, (D,), t_scale, t_bias)),
    "flax.linen.LayerNorm": (
      lambda h: linen.LayerNorm(epsilon=1e-5).apply(linen_params, h),
      lambda h: F.layer_norm(h, (D,), t_scale, t_bias),
    ),
    "equinox.nn.LayerNorm": (
      lambda h: jax.vmap(eqx_ln)(h),
      lambda h: F.layer_norm(h, (D,), t_scale, t_bias),
    ),
    "optax.softmax_cross_entropy": (
      lambda h: optax.softmax_cross_entropy(h, one_hot),
      lambda h: F.cross_entropy(h, t_labels, reduction="none"),
    ),
    "optax.softmax_cross_entropy_with_integer_labels": (
      lambda h: optax.softmax_cross_entropy_with_integer_labels(h, jnp.asarray(labels)),
      lambda h: F.cross_entropy(h, t_labels, reduction="none"),
    ),
  }


def _equal(a, b):
  return float(np.mean((a == b) | (np.isnan(a) & np.isnan(b))))


def agreement(seed=0):
  """{(op, half): (jaxamp dtype, torch dtype, equal, equal at half)}."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((N, D)).astype(np.float32)
  w = (2.0 / math.sqrt(D) * rng.standard_normal((D, D))).astype(np.float32)
  scale, bias = _ln_params(rng)
  labels = rng.integers(0, D, N)
  table = {}
  for name, (j_op, t_op) in ops(scale, bias, labels).items():
    for half, (j_half, t_half) in HALVES.items():
      ours = jaxamp.autocast(lambda x, w, j_op=j_op: j_op(x @ w), j_half, policy="cpu")(
        jnp.asarray(x), jnp.asarray(w)
      )
      with torch.autocast("cpu", dtype=t_half):
        theirs = t_op(torch.tensor(x) @ torch.tensor(w))
      t_dtype = str(theirs.dtype).removeprefix("torch.")
      t = theirs.float().numpy()
      o_at_t = np.asarray(jnp.asarray(ours).astype(t_dtype).astype(jnp.float32))
      o_half = np.asarray(jnp.asarray(ours).astype(j_half).astype(jnp.float32))
      t_half_vals = theirs.to(t_half).float().numpy()
      table[name, half] = (str(ours.dtype), t_dtype, _equal(o_at_t, t), _equal(o_half, t_half_vals))
  return table


def print_agreement(table):
  names = list(dict.fromkeys(name for name, _ in table))
  print(f"{'op':50s} {'half':9s} {'dtype jaxamp/torch':22s} {'equal':>8s} {'at half':>8s}")
  for name in names:
    for half in HALVES:
      ours, theirs, eq, eq_half = table[name, half]
      print(f"{name:50s} {half:9s} {ours + '/' + theirs:22s} {eq:8.2%} {eq_half:8.2%}")


# -- a Transformer block trained against torch --------------------------------------

B, T, DIN, DM, HEADS, V = 8, 16, 32, 64, 4, 32
SHAPES = {
  "w_in": (DM, DIN),
  "b_in": (DM,),
  "ln0_w": (DM,),
  "ln0_b": (DM,),
  "ln1_w": (DM,),
  "ln1_b": (DM,),
  "wqkv": (3 * DM, DM),
  "bqkv": (3 * DM,),
  "wo": (DM, DM),
  "bo": (DM,),
  "ln2_w": (DM,),
  "ln2_b": (DM,),
  "w1": (4 * DM, DM),
  "b1": (4 * DM,),
  "w2": (DM, 4 * DM),
  "b2": (DM,),
  "w_out": (V, DM),
  "b_out": (V,),
}


def init_params(seed=0):
  rng = np.random.default_rng(seed)
  p = {}
  for k, shape in SHAPES.items():
    if k.startswith("ln") and k.endswith("_w"):
      p[k] = np.ones(shape, np.float32)
    elif k.startswith("b") or k.endswith("_b"):
      p[k] = np.zeros(shape, np.float32)
    else:
      p[k] = (rng.standard_normal(shape) / math.sqrt(shape[1])).astype(np.float32)
  return p


def batches(steps, seed=1):
  rng = np.random.default_rng(seed)
  teacher = rng.standard_normal((DIN, V)).astype(np.float32)
  for _ in range(steps):
    x = rng.standard_normal((B, T, DIN)).astype(np.float32)
    yield x, (x.mean(1, keepdims=True) + x) @ teacher


def _labels(y):
  return np.argmax(y, -1)


def _ln_jax(x, w, b):
  return linen.LayerNorm(epsilon=1e-5).apply({"params": {"scale": w, "bias": b}}, x)


def block_jax(p, x, labels):
  def split(t):
    return t.reshape(B, T, HEADS, DM // HEADS).transpose(0, 2, 1, 3)

  x = _ln_jax(x @ p["w_in"].T + p["b_in"], p["ln0_w"], p["ln0_b"])
  h = _ln_jax(x, p["ln1_w"], p["ln1_b"])
  q, k, v = map(split, jnp.split(h @ p["wqkv"].T + p["bqkv"], 3, -1))
  a = jax.nn.softmax(q @ k.swapaxes(-1, -2) / math.sqrt(DM // HEADS), -1)
  o = (a @ v).transpose(0, 2, 1, 3).reshape(B, T, DM)
  x = x + (o @ p["wo"].T + p["bo"])
  h = _ln_jax(x, p["ln2_w"], p["ln2_b"])
  x = x + (jax.nn.gelu(h @ p["w1"].T + p["b1"], approximate=False) @ p["w2"].T + p["b2"])
  logits = x @ p["w_out"].T + p["b_out"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def block_torch(p, x, labels):
  def split(t):
    return t.reshape(B, T, HEADS, DM // HEADS).transpose(1, 2)

  x = F.layer_norm(F.linear(x, p["w_in"], p["b_in"]), (DM,), p["ln0_w"], p["ln0_b"])
  h = F.layer_norm(x, (DM,), p["ln1_w"], p["ln1_b"])
  q, k, v = map(split, F.linear(h, p["wqkv"], p["bqkv"]).split(DM, -1))
  a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(DM // HEADS), -1)
  o = (a @ v).transpose(1, 2).reshape(B, T, DM)
  x = x + F.linear(o, p["wo"], p["bo"])
  h = F.layer_norm(x, (DM,), p["ln2_w"], p["ln2_b"])
  x = x + F.linear(F.gelu(F.linear(h, p["w1"], p["b1"])), p["w2"], p["b2"])
  logits = F.linear(x, p["w_out"], p["b_out"])
  return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))


def train(steps, lr=0.05):
  """(jaxamp losses, torch losses) of ``steps`` SGD steps from the same start."""
  p0 = init_params()
  params = {k: jnp.asarray(v) for k, v in p0.items()}
  t_params = {k: torch.tensor(v, requires_grad=True) for k, v in p0.items()}
  opt = torch.optim.SGD(list(t_params.values()), lr=lr)
  loss_fn = jaxamp.autocast(block_jax, jnp.float16, policy="cpu")

  @jax.jit
  def step(params, x, labels):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, labels)
    return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss

  ours, theirs = [], []
  for x, y in batches(steps):
    labels = _labels(y)
    params, loss = step(params, jnp.asarray(x), jnp.asarray(labels))
    ours.append(float(loss))
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
      t_loss = block_torch(t_params, torch.tensor(x), torch.tensor(labels))
    t_loss.backward()
    opt.step()
    theirs.append(t_loss.item())
  return np.array(ours), np.array(theirs)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--train", action="store_true", help="the training comparison too")
  parser.add_argument("--steps", type=int, default=200)
  args = parser.parse_args()
  print_agreement(agreement())
  if args.train:
    ours, theirs = train(args.steps)
    drift = np.abs(ours - theirs)
    print(f"\nTransformer block, {args.steps} SGD steps, float16 autocast (cpu):")
    print(f"  loss torch first {theirs[0]:.6f} final {theirs[-1]:.6f}")
    print(f"  loss jaxamp first {ours[0]:.6f} final {ours[-1]:.6f}")
    print(f"  max |loss_jax - loss_torch| {drift.max():.3g} (step {drift.argmax()})")
    print(f"  final |loss_jax - loss_torch| {drift[-1]:.3g}")
    print(f"  first step |loss_jax - loss_torch| {drift[0]:.3g}")


if __name__ == "__main__":
  main()
