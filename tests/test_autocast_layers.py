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
import optax
import pytest
import torch
import torch.nn.functional as F
from flax import linen, nnx
from jax.experimental import io_callback
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import jaxamp

pytestmark = pytest.mark.torch

B, L, D, C, OUT, HEADS = 2, 6, 8, 4, 3, 2
HALVES = {"float16": (jnp.float16, torch.float16), "bfloat16": (jnp.bfloat16, torch.bfloat16)}
LAYERS = ("linear", "conv", "layer_norm", "rms_norm", "mha")
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


# -- ops of torch 2.13's compiled autocast lists ----------------------------------------------

# name: (JAX function, torch function, JAX input shapes, torch input shapes)
OPS = {
  "logsumexp": (
    lambda x: jax.nn.logsumexp(x, -1),
    lambda x: torch.logsumexp(x, -1),
    [(B, D)],
    [(B, D)],
  ),
  "huber_loss": (
    lambda a, b: optax.huber_loss(a, b, delta=1.0),
    lambda a, b: F.huber_loss(a, b, reduction="none", delta=1.0),
    [(B, D)] * 2,
    [(B, D)] * 2,
  ),
  "upsample_nearest": (
    lambda x: jax.image.resize(x, (B, C, 2 * L), "nearest"),
    lambda x: F.interpolate(x, scale_factor=2, mode="nearest"),
    [(B, C, L)],
    [(B, C, L)],
  ),
  "upsample_linear": (
    lambda x: jax.image.resize(x, (B, C, 2 * L), "linear"),
    lambda x: F.interpolate(x, scale_factor=2, mode="linear"),
    [(B, C, L)],
    [(B, C, L)],
  ),
  "scaled_dot_product_attention": (  # JAX's (batch, seq, heads, dim), torch's (batch, heads, seq, dim)
    jax.nn.dot_product_attention,
    F.scaled_dot_product_attention,
    [(B, L, HEADS, D)] * 3,
    [(B, HEADS, L, D)] * 3,
  ),
  "linalg_vecdot": (jnp.linalg.vecdot, torch.linalg.vecdot, [(B, D)] * 2, [(B, D)] * 2),
  "vecdot_written_out": (  # a multiply, then a sum: float32 on CUDA's list, not on CPU's
    lambda a, b: (a * b).sum(-1),
    lambda a, b: (a * b).sum(-1),
    [(B, D)] * 2,
    [(B, D)] * 2,
  ),
  "reciprocal": (jnp.reciprocal, torch.reciprocal, [(B, D)], [(B, D)]),  # JAX's integer_pow
  # On none of torch's lists: their input dtype on CUDA too.
  "exp2": (jnp.exp2, torch.exp2, [(B, D)], [(B, D)]),
  "logcumsumexp": (
    lambda x: jax.lax.cumlogsumexp(x, axis=1),
    lambda x: torch.logcumsumexp(x, 1),
    [(B, D)],
    [(B, D)],
  ),
}


@functools.cache
def torch_op_dtype(op, inputs, half, policy):
  """The output dtype of torch's ``op`` under autocast, on float32 inputs or on
  half ones (``inputs="half"``: each multiplied by the identity first)."""
  _, t_fn, _, shapes = OPS[op]
  dtype = HALVES[half][1]
  if policy == "cpu":
    xs = [torch.randn(s) for s in shapes]
    with torch.autocast("cpu", dtype):
      return _name(t_fn(*[x @ torch.eye(x.shape[-1]) if inputs == "half" else x for x in xs]).dtype)
  with _cuda_autocast(dtype):
    xs = [torch.empty(s, device="cuda") for s in shapes]
    if inputs == "half":
      xs = [x @ torch.empty((s[-1],) * 2, device="cuda") for x, s in zip(xs, shapes)]
    return _name(t_fn(*xs).dtype)


@pytest.mark.parametrize("policy", ["cpu", "cuda"])
@pytest.mark.parametrize("half", sorted(HALVES))
@pytest.mark.parametrize("inputs", ["float32", "half"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_op_dtype_matches_torch_autocast_lists(op, inputs, half, policy):
  j_fn, _, shapes, _ = OPS[op]

  def fn(*xs):
    return j_fn(*[x @ jnp.eye(x.shape[-1]) if inputs == "half" else x for x in xs])

  rng = np.random.default_rng(0)
  xs = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]
  out = jax.eval_shape(jaxamp.autocast(fn, HALVES[half][0], policy=policy), *xs)
  theirs = torch_op_dtype(op, inputs, half, policy)
  assert _name(out.dtype) == theirs, (
    f"{op}, {inputs} inputs, {half}, policy={policy!r}: jaxamp {out.dtype}, torch {theirs}"
  )


# -- one small model in each library ----------------------------------------------------------

MODEL_LAYERS = ("dense_in", "ln", "attn", "rms", "conv", "dense_out")


class TorchModel(nn.Module):
  """A linear, LayerNorm, self-attention, RMSNorm, a convolution over the sequence,
  a linear head; on (batch, seq, features)."""

  def __init__(self, attention):
    super().__init__()
    self.dense_in = nn.Linear(D, D)
    self.ln = nn.LayerNorm(D)
    self.attn = attention
    self.rms = nn.RMSNorm(D)
    self.conv = nn.Conv1d(D, D, 3, padding=1)
    self.dense_out = nn.Linear(D, OUT)

  def forward(self, x):
    h = self.ln(self.dense_in(x))
    h = self.attn(h, h, h)
    h = self.rms(h[0] if isinstance(h, tuple) else h)
    # a contiguous copy: the fake CUDA tensors' conv wants one (the dtypes are the same)
    h = h.transpose(1, 2).clone(memory_format=torch.contiguous_format)
    return self.dense_out(self.conv(h).transpose(1, 2))


@functools.cache
def torch_model_dtypes(half, policy):
  """The output dtype of each of ``TorchModel``'s layers under autocast."""
  torch.manual_seed(0)
  if policy == "cpu":
    attention = nn.MultiheadAttention(D, HEADS, batch_first=True)
  else:
    attention = _Attention()
  model = TorchModel(attention)
  _, seen = torch_run(model, [torch.randn(B, L, D)], policy, half, hooks=True)
  return {name: seen[name] for name in MODEL_LAYERS}


class LinenModel(linen.Module):
  @linen.compact
  def __call__(self, x):
    h = linen.LayerNorm(name="ln")(linen.Dense(D, name="dense_in")(x))
    h = linen.MultiHeadDotProductAttention(num_heads=HEADS, name="attn")(h)
    h = linen.Conv(D, (3,), padding=1, name="conv")(linen.RMSNorm(name="rms")(h))
    return linen.Dense(OUT, name="dense_out")(h)


class NnxModel(nnx.Module):
  def __init__(self, rngs):
    self.dense_in = nnx.Linear(D, D, rngs=rngs)
    self.ln = nnx.LayerNorm(D, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=HEADS, in_features=D, decode=False, rngs=rngs)
    self.rms = nnx.RMSNorm(D, rngs=rngs)
    self.conv = nnx.Conv(D, D, (3,), padding=1, rngs=rngs)
    self.dense_out = nnx.Linear(D, OUT, rngs=rngs)

  def __call__(self, x):
    h = self.attn(self.ln(self.dense_in(x)))
    return self.dense_out(self.conv(self.rms(h)))


class EqxModel(eqx.Module):
  """On one example (seq, features), each layer as Equinox applies it: the
  per-vector layers mapped over the sequence; it returns every layer's output."""

  dense_in: eqx.nn.Linear
  ln: eqx.nn.LayerNorm
  attn: eqx.nn.MultiheadAttention
  rms: eqx.nn.RMSNorm
  conv: eqx.nn.Conv1d
  dense_out: eqx.nn.Linear

  def __init__(self, key):
    keys = jax.random.split(key, 4)
    self.dense_in = eqx.nn.Linear(D, D, key=keys[0])
    self.ln = eqx.nn.LayerNorm(D)
    self.attn = eqx.nn.MultiheadAttention(HEADS, D, key=keys[1])
    self.rms = eqx.nn.RMSNorm(D)
    self.conv = eqx.nn.Conv1d(D, D, 3, padding=1, key=keys[2])
    self.dense_out = eqx.nn.Linear(D, OUT, key=keys[3])

  def __call__(self, x):
    out = {}
    h = out["dense_in"] = jax.vmap(self.dense_in)(x)
    h = out["ln"] = jax.vmap(self.ln)(h)
    h = out["attn"] = self.attn(h, h, h)
    h = out["rms"] = jax.vmap(self.rms)(h)
    h = out["conv"] = self.conv(h.T).T
    out["dense_out"] = jax.vmap(self.dense_out)(h)
    return out


def _flat(tree):
  """``{"a/b/c": leaf}`` for a nested dict (or NNX ``State``) of captured values."""

  def part(k):
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        return str(getattr(k, attr))
    return str(k)

  leaves = jax.tree_util.tree_leaves_with_path(tree)
  return {"/".join(part(k) for k in path): leaf for path, leaf in leaves}


def _jax_model(lib):
  """``(fn, params, example_shape)``: ``fn(params, x)`` returns the output of every
  layer the library's capture mechanism records, by path."""
  key = jax.random.key(0)
  if lib == "linen":
    model = LinenModel()
    params = model.init(key, jnp.zeros((B, L, D)))

    def fn(p, x):
      _, state = model.apply(p, x, capture_intermediates=True, mutable=["intermediates"])
      return _flat(state["intermediates"])

    return fn, params, (L, D)
  if lib == "nnx":
    graphdef, state = nnx.split(NnxModel(nnx.Rngs(0)))

    def fn(s, x):
      model = nnx.merge(graphdef, s)
      _, captured = nnx.capture(model, nnx.Intermediate, method_outputs=nnx.Intermediate)(x)
      return _flat(captured)

    return fn, state, (L, D)
  return (lambda m, x: m(x)), EqxModel(key), (L, D)


def _torch_name(path):
  """The ``TorchModel`` layer a captured path is the output of. Flax's attention
  records its projections too (``attn/query``, ``attn/out``): linears, compared
  with the model's ``nn.Linear`` (torch's ``nn.MultiheadAttention`` calls
  ``F.linear`` itself, which no hook sees)."""
  parts = path.split("/")
  if "__call__" in parts:  # Flax's: the module's path, then its method's
    parts = parts[: parts.index("__call__")]
  if not parts:
    return "dense_out"  # the model's own output
  if parts[0] == "attn" and len(parts) > 1:
    return "dense_in"
  return parts[0]


@pytest.mark.parametrize("policy", ["cpu", "cuda"])
@pytest.mark.parametrize("half", sorted(HALVES))
@pytest.mark.parametrize("batching", BATCHING)
@pytest.mark.parametrize("lib", LIBRARIES)
def test_model_every_layer_dtype_matches_torch_autocast(lib, batching, half, policy):
  fn, params, shape = _jax_model(lib)
  x = _input(lib, batching, shape)
  run = batched(fn, batching, HALVES[half][0], policy)
  ours = {path: _name(v.dtype) for path, v in jax.eval_shape(lambda x: run(params, x), x).items()}
  theirs = torch_model_dtypes(half, policy)
  assert {_torch_name(p) for p in ours} == set(MODEL_LAYERS), sorted(ours)
  wrong = {p: (d, theirs[_torch_name(p)]) for p, d in ours.items() if d != theirs[_torch_name(p)]}
  assert not wrong, f"{lib}, {batching}, {half}, policy={policy!r}: (jaxamp, torch) {wrong}"


# -- what users put around layers -------------------------------------------------------------


def _np_tanh(a):
  return np.tanh(a.astype(np.float32)).astype(a.dtype)


@pytest.mark.parametrize("callback", ["pure_callback", "io_callback"])
def test_host_callback_of_a_half_value_runs_as_traced(callback):
  """A callback's result dtype is declared when traced: it runs as written, its
  input cast back to float32 (docs/autocast.md, rule 4), where it used to receive
  the half matmul output and fail returning a dtype it had not declared."""

  def f(w, x):
    h = x @ w
    shape = jax.ShapeDtypeStruct(h.shape, h.dtype)
    if callback == "io_callback":
      return h, io_callback(_np_tanh, shape, h)
    return h, jax.pure_callback(_np_tanh, shape, h)

  rng = np.random.default_rng(0)
  w, x = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((D, D), (B, D)))
  h, out = jax.jit(jaxamp.autocast(f, jnp.float16, policy="cpu"))(w, x)
  assert h.dtype == jnp.float16 and out.dtype == jnp.float32
  np.testing.assert_array_equal(out, np.tanh(np.asarray(h, np.float32)))


def test_scalar_added_to_a_matmul_in_a_nested_region_is_no_bias_matches_torch():
  """A Python scalar added to a matmul output is not a bias: in a nested region of
  the other half dtype the sum keeps the matmul's dtype, as torch's (found by the
  autocast fuzzer's long run, against a bias rule that took any value of fewer
  elements for a bias)."""
  rng = np.random.default_rng(0)
  w, x = (rng.standard_normal(s).astype(np.float32) for s in ((D, D), (B, D)))

  def f(w, x):
    h = jaxamp.autocast(lambda w, x: x @ w, jnp.float16, policy="cpu")(w, x)
    return jaxamp.autocast(lambda h: 0.5 + h, jnp.bfloat16, policy="cpu")(h)

  ours = jaxamp.autocast(f, jnp.bfloat16, policy="cpu")(jnp.asarray(w), jnp.asarray(x))
  with torch.autocast("cpu", torch.bfloat16):
    with torch.autocast("cpu", torch.float16):
      h = torch.tensor(x) @ torch.tensor(w)
    theirs = 0.5 + h
  assert _name(ours.dtype) == _name(theirs.dtype) == "float16"
  np.testing.assert_array_equal(np.asarray(ours, np.float32), theirs.float().numpy())
