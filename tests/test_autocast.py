"""jaxamp.autocast: torch's autocast op policy on float32 JAX code.

The torch tests build each model twice, in torch (functional, so each op is
visible) and in JAX, from the same float32 weights, and return every
intermediate the comparison names: the JAX model's intermediates come back
through ``jaxamp.autocast`` as outputs, so their dtypes are the interpreted
ones. torch runs live under ``torch.autocast("cpu", ...)`` and jaxamp under
``policy="cpu"``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jaxamp

HALVES = {"float16": jnp.float16, "bfloat16": jnp.bfloat16}
EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7}  # the half dtypes' machine epsilon


def _torch():
  return pytest.importorskip("torch")


def _weights(shapes, seed=0):
  rng = np.random.default_rng(seed)
  return {
    k: (rng.standard_normal(s) / math.sqrt(s[-1] if len(s) > 1 else 4)).astype(np.float32)
    for k, s in shapes.items()
  }


# -- the three models, torch and JAX ------------------------------------------------------

MLP = {"w1": (16, 8), "b1": (16,), "w2": (16, 16), "b2": (16,), "w3": (4, 16), "b3": (4,)}


def mlp_torch(F, p, x, y):
  out = {}
  out["fc1"] = h = F.linear(x, p["w1"], p["b1"])
  out["relu1"] = h = F.relu(h)
  out["fc2"] = h = F.linear(h, p["w2"], p["b2"])
  out["relu2"] = h = F.relu(h)
  out["fc3"] = h = F.linear(h, p["w3"], p["b3"])
  out["loss"] = F.mse_loss(h, y)
  return out


def mlp_jax(p, x, y):
  out = {}
  out["fc1"] = h = x @ p["w1"].T + p["b1"]
  out["relu1"] = h = jax.nn.relu(h)
  out["fc2"] = h = h @ p["w2"].T + p["b2"]
  out["relu2"] = h = jax.nn.relu(h)
  out["fc3"] = h = h @ p["w3"].T + p["b3"]
  out["loss"] = jnp.mean((h - y) ** 2)
  return out


CNN = {"k": (4, 3, 3, 3), "kb": (4,), "w": (5, 4 * 3 * 3), "b": (5,)}


def cnn_torch(F, p, x, labels):
  out = {}
  out["conv"] = h = F.conv2d(x, p["k"], p["kb"])
  out["relu"] = h = F.relu(h)
  out["pool"] = h = F.max_pool2d(h, 2)
  out["fc"] = h = F.linear(h.flatten(1), p["w"], p["b"])
  out["loss"] = F.cross_entropy(h, labels)
  return out


def _cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def cnn_jax(p, x, labels):
  out = {}
  h = lax.conv_general_dilated(
    x, p["k"], (1, 1), "VALID", dimension_numbers=("NCHW", "OIHW", "NCHW")
  )
  out["conv"] = h = h + p["kb"][None, :, None, None]
  out["relu"] = h = jax.nn.relu(h)
  out["pool"] = h = lax.reduce_window(h, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")
  out["fc"] = h = h.reshape(h.shape[0], -1) @ p["w"].T + p["b"]
  # torch's CPU list has cross_entropy in float32; in a jaxpr it is log_softmax's
  # primitives, which that list runs in their input dtype: the loss opts out.
  out["loss"] = jaxamp.autocast_disabled(_cross_entropy)(h, labels)
  return out


D, HEADS, T = 8, 2, 4
BLOCK = {
  "ln1_w": (D,),
  "ln1_b": (D,),
  "wqkv": (3 * D, D),
  "bqkv": (3 * D,),
  "wo": (D, D),
  "bo": (D,),
  "ln2_w": (D,),
  "ln2_b": (D,),
  "w1": (4 * D, D),
  "b1": (4 * D,),
  "w2": (D, 4 * D),
  "b2": (D,),
}


def block_torch(F, p, x, y):
  torch = _torch()
  out = {}
  out["ln1"] = h = F.layer_norm(x, (D,), p["ln1_w"], p["ln1_b"])
  out["qkv"] = qkv = F.linear(h, p["wqkv"], p["bqkv"])
  q, k, v = (t.reshape(2, T, HEADS, D // HEADS).transpose(1, 2) for t in qkv.split(D, -1))
  out["scores"] = s = q @ k.transpose(-1, -2) / math.sqrt(D // HEADS)
  out["softmax"] = a = torch.softmax(s, -1)
  out["attn"] = o = (a @ v).transpose(1, 2).reshape(2, T, D)
  out["proj"] = o = F.linear(o, p["wo"], p["bo"])
  out["res1"] = x = x + o
  out["ln2"] = h = F.layer_norm(x, (D,), p["ln2_w"], p["ln2_b"])
  out["mlp1"] = h = F.linear(h, p["w1"], p["b1"])
  out["gelu"] = h = F.gelu(h)
  out["mlp2"] = h = F.linear(h, p["w2"], p["b2"])
  out["res2"] = x = x + h
  out["loss"] = F.mse_loss(x, y)
  return out


def _layer_norm(x, w, b):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) * lax.rsqrt(var + 1e-5) * w + b


def block_jax(p, x, y):
  out = {}
  out["ln1"] = h = _layer_norm(x, p["ln1_w"], p["ln1_b"])
  out["qkv"] = qkv = h @ p["wqkv"].T + p["bqkv"]
  q, k, v = (
    t.reshape(2, T, HEADS, D // HEADS).transpose(0, 2, 1, 3) for t in jnp.split(qkv, 3, -1)
  )
  out["scores"] = s = q @ k.swapaxes(-1, -2) / math.sqrt(D // HEADS)
  out["softmax"] = a = jax.nn.softmax(s, -1)
  out["attn"] = o = (a @ v).transpose(0, 2, 1, 3).reshape(2, T, D)
  out["proj"] = o = o @ p["wo"].T + p["bo"]
  out["res1"] = x = x + o
  out["ln2"] = h = _layer_norm(x, p["ln2_w"], p["ln2_b"])
  out["mlp1"] = h = h @ p["w1"].T + p["b1"]
  out["gelu"] = h = jax.nn.gelu(h, approximate=False)
  out["mlp2"] = h = h @ p["w2"].T + p["b2"]
  out["res2"] = x = x + h
  out["loss"] = jnp.mean((x - y) ** 2)
  return out


def _mlp_data(rng):
  return rng.standard_normal((6, 8)).astype(np.float32), rng.standard_normal((6, 4)).astype(
    np.float32
  )


def _cnn_data(rng):
  return rng.standard_normal((2, 3, 8, 8)).astype(np.float32), rng.integers(0, 5, 2)


def _block_data(rng):
  return rng.standard_normal((2, T, D)).astype(np.float32), rng.standard_normal((2, T, D)).astype(
    np.float32
  )


def _block_weights():
  w = _weights(BLOCK, seed=2)
  for name in ("ln1_w", "ln2_w"):
    w[name] = 1.0 + 0.1 * w[name]
  return w


MODELS = {
  # name: (torch forward, JAX forward, weights, data, depth: the half roundings in a row)
  "mlp": (mlp_torch, mlp_jax, lambda: _weights(MLP), _mlp_data, 3),
  "cnn": (cnn_torch, cnn_jax, lambda: _weights(CNN, seed=1), _cnn_data, 2),
  "block": (block_torch, block_jax, _block_weights, _block_data, 6),
}


def _run_both(model, half):
  torch = _torch()
  torch_fwd, jax_fwd, weights, data, depth = MODELS[model]
  p = weights()
  x, y = data(np.random.default_rng(3))
  with torch.autocast("cpu", dtype=getattr(torch, half)):
    theirs = torch_fwd(
      torch.nn.functional,
      {k: torch.tensor(v) for k, v in p.items()},
      torch.tensor(x),
      torch.tensor(y),
    )
  ours = jaxamp.autocast(jax_fwd, HALVES[half], policy="cpu")(
    {k: jnp.asarray(v) for k, v in p.items()}, jnp.asarray(x), jnp.asarray(y)
  )
  return theirs, ours, depth


@pytest.mark.torch
@pytest.mark.parametrize("half", sorted(HALVES))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_op_dtypes_match_torch_cpu_autocast(model, half):
  theirs, ours, _ = _run_both(model, half)
  assert set(ours) == set(theirs)
  torch_dtypes = {k: str(v.dtype).removeprefix("torch.") for k, v in theirs.items()}
  jax_dtypes = {k: str(v.dtype) for k, v in ours.items()}
  assert jax_dtypes == torch_dtypes
  assert str(ours["loss"].dtype) == "float32"
  assert "float32" != jax_dtypes["fc1" if model == "mlp" else "conv" if model == "cnn" else "qkv"]


@pytest.mark.torch
@pytest.mark.parametrize("half", sorted(HALVES))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_outputs_match_torch_within_half_rounding(model, half):
  theirs, ours, depth = _run_both(model, half)
  # torch and XLA both compute a half matmul in float32 and round once, but sum in
  # different orders: a point may differ by an ulp of its half result, and the
  # differences add up along the chain of `depth` half roundings. The bound is
  # normwise (max |diff| / max |torch|), 2 ulps per rounding; measured: <= 1.8 ulps
  bound = 2 * depth * EPS[half]
  worst = 0.0
  for name, t in theirs.items():
    t = t.detach().float().numpy()
    diff = np.max(np.abs(np.asarray(ours[name], np.float32) - t)) / max(np.max(np.abs(t)), 1e-30)
    worst = max(worst, diff)
    assert diff <= bound, (name, diff, bound)
  print(f"{model} {half}: max normwise relative difference {worst:.3g} (bound {bound:.3g})")
