"""``jaxamp.autocast`` on layers as the JAX libraries write them, against torch's
modules run live (issue #41, item 2).

The layers of Flax linen and NNX (``Dense``/``Linear``, ``Conv``, ``LayerNorm``,
``RMSNorm``, ``MultiHeadAttention``) and Equinox (``Linear``, ``Conv1d``,
``LayerNorm``, ``RMSNorm``, ``MultiheadAttention``), each alone and in one small
model, with and without ``jax.vmap`` (inside the autocast function and around
it), give the dtypes torch's ``nn`` modules give under autocast:

- ``policy="cpu"``: ``torch.autocast("cpu", dtype)`` on real tensors;
- ``policy="cuda"``: torch's compiled CUDA autocast kernels, run on fake CUDA
  tensors (``FakeTensorMode``: shapes and dtypes without a GPU), so the CUDA lists
  are torch 2.13's as built, not as documented.

The model's intermediates are captured with each library's own mechanism (linen's
``capture_intermediates``, ``nnx.capture``; an Equinox forward returning each
layer's output) and torch's with forward hooks.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flax import linen, nnx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import jaxamp

pytestmark = pytest.mark.torch

B, L, D, C, OUT, HEADS = 2, 6, 8, 4, 3, 2
HALVES = {"float16": (jnp.float16, torch.float16), "bfloat16": (jnp.bfloat16, torch.bfloat16)}
LAYERS = ("linear", "conv", "layer_norm", "mha")
LIBRARIES = ("linen", "nnx", "equinox")
# "none": Flax layers on a batch, Equinox layers on one example (as each library
# is written); "vmap_inside": autocast(vmap(f)); "vmap_outside": vmap(autocast(f)).
BATCHING = ("none", "vmap_inside", "vmap_outside")


def _name(dtype) -> str:
  return str(dtype).removeprefix("torch.")


# -- torch: CPU autocast on real tensors, CUDA autocast on fake CUDA tensors -----------------


@contextlib.contextmanager
def _cuda_autocast(dtype):
  """torch's CUDA autocast on fake CUDA tensors: ``torch.autocast("cuda")`` itself
  refuses without a GPU, so the autocast state is set directly."""
  was = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
  with FakeTensorMode(allow_non_fake_inputs=True):
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    try:
      yield
    finally:
      torch.set_autocast_enabled("cuda", was[0])
      torch.set_autocast_dtype("cuda", was[1])
      torch.clear_autocast_cache()


def torch_run(module, inputs, policy, half, hooks=False):
  """``module(*inputs)`` (float32 tensors) under torch's autocast for ``policy``:
  the output's dtype, and with ``hooks`` the output dtype of every submodule
  that ran (forward hooks; a tuple output: its first element)."""
  seen = {}

  def hook(name):
    def record(_mod, _args, out):
      seen[name] = _name((out[0] if isinstance(out, tuple) else out).dtype)

    return record

  handles = [m.register_forward_hook(hook(n)) for n, m in module.named_modules() if n and hooks]
  try:
    with warnings.catch_warnings():
      # torch's rms_norm of a half input and float32 weights (autocast casts
      # neither) warns that it runs its composite form
      warnings.filterwarnings("ignore", "Mismatch dtype between input and weight")
      if policy == "cpu":
        with torch.autocast("cpu", HALVES[half][1]):
          out = module(*inputs)
      else:
        with _cuda_autocast(HALVES[half][1]):
          params = {k: torch.empty_like(v, device="cuda") for k, v in module.state_dict().items()}
          args = [torch.empty_like(x, device="cuda") for x in inputs]
          out = torch.func.functional_call(module, params, tuple(args))
  finally:
    for h in handles:
      h.remove()
  out = out[0] if isinstance(out, tuple) else out
  return _name(out.dtype), seen


class _Attention(nn.Module):
  """What ``nn.MultiheadAttention`` computes (``multi_head_attention_forward``
  with ``need_weights=False``): the in-projection (``F.linear``), torch's
  ``scaled_dot_product_attention``, the out-projection (``F.linear``). The CUDA
  reference for attention: ``nn.MultiheadAttention`` itself does not run on fake
  CUDA tensors (its in-projection's ``contiguous`` wants a CUDA kernel)."""

  def __init__(self):
    super().__init__()
    self.in_proj = nn.Linear(D, 3 * D)
    self.out_proj = nn.Linear(D, D)

  def forward(self, x, *_):
    q, k, v = [
      t.view(t.shape[0], t.shape[1], HEADS, D // HEADS).transpose(1, 2)
      for t in self.in_proj(x).split(D, -1)
    ]
    out = F.scaled_dot_product_attention(q, k, v)
    return self.out_proj(out.transpose(1, 2).reshape(x.shape))


class _AfterMatmul(nn.Module):
  """``module`` on half inputs: each input multiplied by the identity first, a
  matmul, half under autocast (as ``after_matmul`` does in JAX)."""

  def __init__(self, module, n):
    super().__init__()
    self.module = module
    self.register_buffer("eye", torch.eye(n))

  def forward(self, *xs):
    return self.module(*[x @ self.eye for x in xs])


def _torch_layer(layer):
  torch.manual_seed(0)
  return {
    "linear": lambda: (nn.Linear(D, OUT), [(B, D)]),
    "conv": lambda: (nn.Conv1d(C, OUT, 3, padding=1), [(B, C, L)]),
    "layer_norm": lambda: (nn.LayerNorm(D), [(B, L, D)]),
    "rms_norm": lambda: (nn.RMSNorm(D), [(B, L, D)]),
    "mha": lambda: (nn.MultiheadAttention(D, HEADS, batch_first=True), [(B, L, D)] * 3),
  }[layer]()


@functools.cache
def torch_layer_dtype(layer, inputs, half, policy):
  """The output dtype of torch's module for ``layer`` on float32 inputs, or on
  half ones (``inputs="half"``: after a matmul)."""
  module, shapes = _torch_layer(layer)
  if layer == "mha" and policy == "cuda":
    module = _Attention()
  if inputs == "half":
    module = _AfterMatmul(module, shapes[0][-1])
  return torch_run(module, [torch.randn(s) for s in shapes], policy, half)[0]


# -- JAX: each library's layer, a function of (params, x) -------------------------------------


def _jax_layer(lib, layer):
  """``(fn, params, example_shape)``: ``fn(params, x)`` applies the library's layer
  to ``x``, an example (Equinox) or a batch of examples (Flax) of ``example_shape``."""
  key = jax.random.key(0)
  if lib == "equinox":
    model, shape = {
      "linear": lambda: (eqx.nn.Linear(D, OUT, key=key), (D,)),
      "conv": lambda: (eqx.nn.Conv1d(C, OUT, 3, padding=1, key=key), (C, L)),
      "layer_norm": lambda: (eqx.nn.LayerNorm(D), (D,)),
      "rms_norm": lambda: (eqx.nn.RMSNorm(D), (D,)),
      "mha": lambda: (eqx.nn.MultiheadAttention(HEADS, D, key=key), (L, D)),
    }[layer]()
    if layer == "mha":
      return (lambda m, x: m(x, x, x)), model, shape
    return (lambda m, x: m(x)), model, shape
  shape = {"linear": (D,), "conv": (L, C)}.get(layer, (L, D))
  if lib == "linen":
    model = {
      "linear": lambda: linen.Dense(OUT),
      "conv": lambda: linen.Conv(OUT, (3,), padding=1),
      "layer_norm": lambda: linen.LayerNorm(),
      "rms_norm": lambda: linen.RMSNorm(),
      "mha": lambda: linen.MultiHeadDotProductAttention(num_heads=HEADS),
    }[layer]()
    params = model.init(key, jnp.zeros((B, *shape)))
    return model.apply, params, shape
  rngs = nnx.Rngs(0)
  model = {
    "linear": lambda: nnx.Linear(D, OUT, rngs=rngs),
    "conv": lambda: nnx.Conv(C, OUT, (3,), padding=1, rngs=rngs),
    "layer_norm": lambda: nnx.LayerNorm(D, rngs=rngs),
    "rms_norm": lambda: nnx.RMSNorm(D, rngs=rngs),
    "mha": lambda: nnx.MultiHeadAttention(num_heads=HEADS, in_features=D, decode=False, rngs=rngs),
  }[layer]()
  graphdef, state = nnx.split(model)
  return (lambda s, x: nnx.merge(graphdef, s)(x)), state, shape


def after_matmul(fn):
  """``fn`` on half inputs under autocast: ``x`` multiplied by the identity first."""
  return lambda p, x: fn(p, x @ jnp.eye(x.shape[-1]))


def batched(fn, batching, dtype, policy):
  """``fn`` under autocast, with ``batching`` (``BATCHING``)."""
  if batching == "vmap_inside":
    return jaxamp.autocast(lambda p, x: jax.vmap(lambda xi: fn(p, xi))(x), dtype, policy=policy)
  if batching == "vmap_outside":
    return jax.vmap(jaxamp.autocast(fn, dtype, policy=policy), in_axes=(None, 0))
  return jaxamp.autocast(fn, dtype, policy=policy)


def _input(lib, batching, shape):
  one = lib == "equinox" and batching == "none"
  return jnp.asarray(
    np.random.default_rng(0).standard_normal(shape if one else (B, *shape)), jnp.float32
  )


@pytest.mark.parametrize("policy", ["cpu", "cuda"])
@pytest.mark.parametrize("half", sorted(HALVES))
@pytest.mark.parametrize("inputs", ["float32", "half"])
@pytest.mark.parametrize("batching", BATCHING)
@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("lib", LIBRARIES)
def test_layer_output_dtype_matches_torch_autocast(lib, layer, batching, inputs, half, policy):
  fn, params, shape = _jax_layer(lib, layer)
  if inputs == "half":
    fn = after_matmul(fn)
  x = _input(lib, batching, shape)
  # params closed over: jax.eval_shape would abstract Equinox's Python leaves too
  run = batched(fn, batching, HALVES[half][0], policy)
  out = jax.eval_shape(lambda x: run(params, x), x)
  theirs = torch_layer_dtype(layer, inputs, half, policy)
  assert _name(out.dtype) == theirs, (
    f"{lib} {layer}, {batching}, {inputs} inputs, {half}, policy={policy!r}: "
    f"jaxamp {out.dtype}, torch {theirs}"
  )
