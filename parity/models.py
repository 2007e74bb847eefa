"""Paired torch / Flax models with identical initial weights, and their data.

Every model exists twice: a ``torch.nn.Module`` and a ``flax.linen`` module.
The Flax parameters are *copied* from the freshly initialised torch module, so
both frameworks start bit-identical. Everything the suite compares (parameters,
gradients, optimizer states) is converted to torch's layout and names
(``"0.weight"``): a Dense kernel is torch's weight transposed, a Conv kernel is
torch's OIHW weight as HWIO. Transposes are exact, so no comparison hides a
conversion error.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclasses.dataclass
class Pair:
  """One model in both frameworks.

  Attributes:
    name: the model's name in the scenario registry.
    torch_module: the torch model (float32 parameters unless stated).
    params: the Flax parameters, copied from ``torch_module``.
    layout: ``(torch_name, flax_path, kind)`` per parameter, in torch's order;
      ``kind`` is ``"dense"`` (transpose), ``"conv"`` (OIHW -> HWIO) or ``"same"``.
    torch_loss: ``(module, batch, autocast_dtype) -> 0-dim loss``.
    jax_loss: ``(params, batch) -> loss`` (float32).
    batch: ``step -> tuple of numpy arrays``, the same data for both frameworks.
    stages: for optimizers that step one after the other (a GAN), one
      ``(torch_loss, jax_loss)`` per optimizer, in order: each loss is
      backpropagated and its optimizer stepped before the next loss is
      computed (from the params just updated), one scale update after the
      last. ``torch_loss``/``jax_loss`` are then the first stage's.
  """

  name: str
  torch_module: torch.nn.Module
  params: Any
  layout: list[tuple[str, tuple[str, ...], str]]
  torch_loss: Callable
  jax_loss: Callable
  batch: Callable[[int], tuple]
  stages: tuple[tuple[Callable, Callable], ...] = ()

  @property
  def names(self) -> list[str]:
    return [name for name, _, _ in self.layout]

  def to_torch_layout(self, tree: Any) -> dict[str, np.ndarray]:
    """A params-shaped JAX tree as ``{torch_name: numpy array}`` in torch layout.

    Leaves that ``optax.multi_transform`` masked out are left out.
    """
    out = {}
    for name, path, kind in self.layout:
      leaf = _get(tree, path)
      if isinstance(leaf, optax.MaskedNode):
        continue
      out[name] = _to_torch(np.asarray(leaf), kind)
    return out

  def from_torch_layout(self, arrays: dict[str, Any]) -> Any:
    """The inverse of :meth:`to_torch_layout` (all names required)."""
    tree: dict = {}
    for name, path, kind in self.layout:
      _set(tree, path, jnp.asarray(_from_torch(np.asarray(arrays[name]), kind)))
    return tree

  def flax_position(self, name: str, index: int) -> int:
    """Where torch's flat ``index`` into parameter ``name`` is in the Flax layout."""
    kind = {n: k for n, _, k in self.layout}[name]
    shape = self.torch_arrays("data")[name].shape
    positions = _from_torch(np.arange(int(np.prod(shape))).reshape(shape), kind).reshape(-1)
    return int(np.flatnonzero(positions == index)[0])

  def tree_of(self, values: dict[str, Any]) -> Any:
    """A params-shaped tree holding ``values[torch_name]`` as leaves, unconverted."""
    tree: dict = {}
    for name, path, _ in self.layout:
      _set(tree, path, values[name])
    return tree

  def torch_arrays(self, attr: str = "data") -> dict[str, np.ndarray]:
    """The torch parameters (``attr="data"``) or gradients (``"grad"``) as numpy."""
    out = {}
    for name, p in self.torch_module.named_parameters():
      value = getattr(p, attr)
      out[name] = None if value is None else _numpy(value)
    return out


class NamedLayout:
  """The parameters ``names`` of ``pair`` as a flat ``{torch_name: leaf}`` dict.

  Leaves keep the Flax layout (a Dense kernel is transposed); this is how one
  ``jaxamp.Optimizer`` holds just the parameters its torch optimizer owns.
  """

  def __init__(self, pair: Pair, names: list[str]):
    self.names = list(names)
    self._kinds = {name: kind for name, _, kind in pair.layout}
    self._paths = {name: path for name, path, _ in pair.layout}

  def to_torch_layout(self, tree: dict) -> dict[str, np.ndarray]:
    return {
      n: _to_torch(np.asarray(tree[n]), self._kinds[n])
      for n in self.names
      if not isinstance(tree[n], optax.MaskedNode)
    }

  def from_torch_layout(self, arrays: dict[str, Any]) -> dict:
    return {n: jnp.asarray(_from_torch(np.asarray(arrays[n]), self._kinds[n])) for n in self.names}

  def take(self, full_tree: Any) -> dict:
    """This subset's leaves of a full (Flax-structured) params tree."""
    return {n: _get(full_tree, self._paths[n]) for n in self.names}


def _numpy(t: torch.Tensor) -> np.ndarray:
  """A torch tensor as numpy, bfloat16 kept bit-exact (as ``ml_dtypes``)."""
  t = t.detach()
  if t.dtype == torch.bfloat16:
    return t.view(torch.int16).numpy().view(jnp.bfloat16).copy()
  return t.numpy().copy()


def to_torch_tensor(a: np.ndarray) -> torch.Tensor:
  a = np.asarray(a)
  if a.dtype == jnp.bfloat16:
    return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
  return torch.from_numpy(a.copy())


def _to_torch(a: np.ndarray, kind: str) -> np.ndarray:
  if kind == "dense":
    return a.T
  if kind == "conv":
    return a.transpose(3, 2, 0, 1)
  return a


def _from_torch(a: np.ndarray, kind: str) -> np.ndarray:
  if kind == "dense":
    return a.T
  if kind == "conv":
    return a.transpose(2, 3, 1, 0)
  return a


def _get(tree: Any, path: tuple[str, ...]) -> Any:
  for key in path:
    tree = tree[key]
  return tree


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _copy_weights(module: torch.nn.Module, layout) -> Any:
  arrays = {name: _numpy(p) for name, p in module.named_parameters()}
  tree: dict = {}
  for name, path, kind in layout:
    _set(tree, path, jnp.asarray(_from_torch(arrays[name], kind)))
  return tree


def _autocast(dtype: str | None):
  if dtype is None:
    return torch.autocast("cpu", enabled=False)
  return torch.autocast("cpu", dtype=_TORCH_DTYPES[dtype])


# ---------------------------------------------------------------------------------------
# Dense stacks: Linear(10,10), Linear -> ReLU -> Linear, the digits MLP.


class _DenseStack(nn.Module):
  """``Linear -> ReLU -> ... -> Linear`` with torch's layer names ``0, 2, ...``."""

  features: tuple[int, ...]
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    x = x.astype(self.dtype)
    for i, width in enumerate(self.features):
      if i:
        x = nn.relu(x)
      x = nn.Dense(width, dtype=self.dtype, param_dtype=jnp.float32, name=str(2 * i))(x)
    return x.astype(jnp.float32)


def _dense_layout(n_layers: int):
  layout = []
  for i in range(n_layers):
    layout.append((f"{2 * i}.weight", ("params", str(2 * i), "kernel"), "dense"))
    layout.append((f"{2 * i}.bias", ("params", str(2 * i), "bias"), "same"))
  return layout


def _torch_dense_stack(sizes: tuple[int, ...]) -> torch.nn.Sequential:
  layers: list[torch.nn.Module] = []
  for i, (n_in, n_out) in enumerate(itertools.pairwise(sizes)):
    if i:
      layers.append(torch.nn.ReLU())
    layers.append(torch.nn.Linear(n_in, n_out))
  return torch.nn.Sequential(*layers)


def _regression_batches(seed: int, n_in: int, n_out: int, batch: int = 8):
  def batch_at(step: int):
    rng = np.random.default_rng([seed, step])
    x = rng.standard_normal((batch, n_in)).astype(np.float32)
    y = rng.standard_normal((batch, n_out)).astype(np.float32)
    return x, y

  return batch_at


def _mse_pair(name, sizes, seed, zero_loss=False):
  torch.manual_seed(seed)
  module = _torch_dense_stack(sizes)
  layout = _dense_layout(len(sizes) - 1)
  flax_module = _DenseStack(tuple(sizes[1:]))
  factor = 0.0 if zero_loss else 1.0

  def torch_loss(m, batch, autocast_dtype=None):
    x, y = (torch.from_numpy(a) for a in batch)
    with _autocast(autocast_dtype):
      out = m(x)
    return torch.nn.functional.mse_loss(out.float(), y) * factor

  def jax_loss(params, batch):
    x, y = batch
    return jnp.mean((flax_module.apply(params, x) - y) ** 2) * factor

  return Pair(
    name,
    module,
    _copy_weights(module, layout),
    layout,
    torch_loss,
    jax_loss,
    _regression_batches(seed, sizes[0], sizes[-1]),
  )


def linear10(seed: int = 0, zero_loss: bool = False) -> Pair:
  """``Linear(10, 10)`` and an MSE loss on fresh N(0, 1) data each step."""
  return _mse_pair("linear10", (10, 10), seed, zero_loss)


def two_layer(seed: int = 1) -> Pair:
  """``Linear(10, 10) -> ReLU -> Linear(10, 10)`` (the model of docs/porting.md's examples)."""
  return _mse_pair("two_layer", (10, 10, 10), seed)


# ---------------------------------------------------------------------------------------
# Real data: scikit-learn's bundled 8x8 digits (1797 images, no download).


def _digits():
  from sklearn.datasets import load_digits

  data = load_digits()
  x = (data.data / 16.0).astype(np.float32)
  return x, data.target.astype(np.int64)


def _digit_batches(seed: int, batch: int = 64, image: bool = False):
  x_all, y_all = _digits()

  def batch_at(step: int):
    idx = np.random.default_rng([seed, step]).choice(len(x_all), batch, replace=False)
    x = x_all[idx]
    return (x.reshape(-1, 1, 8, 8) if image else x), y_all[idx]

  return batch_at


def _cross_entropy_pair(name, module, flax_module, layout, seed, image, compute_dtype):
  def torch_loss(m, batch, autocast_dtype=None):
    x, y = (torch.from_numpy(a) for a in batch)
    with _autocast(autocast_dtype):
      logits = m(x)
    return torch.nn.functional.cross_entropy(logits.float(), y)

  def jax_loss(params, batch):
    x, y = batch
    logits = flax_module.apply(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  return Pair(
    name,
    module,
    _copy_weights(module, layout),
    layout,
    torch_loss,
    jax_loss,
    _digit_batches(seed, image=image),
  )


def mlp_digits(seed: int = 2, compute_dtype: str = "float32") -> Pair:
  """``Linear(64, 32) -> ReLU -> Linear(32, 10)`` classifying the digits."""
  torch.manual_seed(seed)
  module = _torch_dense_stack((64, 32, 10))
  flax_module = _DenseStack((32, 10), dtype=jnp.dtype(compute_dtype))
  return _cross_entropy_pair(
    "mlp_digits", module, flax_module, _dense_layout(2), seed, False, compute_dtype
  )


def mlp_digits_autocast(seed: int = 2) -> Pair:
  """``mlp_digits`` in float32, its forward pass under ``jaxamp.autocast(float16,
  policy="cpu")`` as torch's under ``autocast("cpu", float16)``; the loss outside,
  from float32 logits, as torch's ``cross_entropy(logits.float(), y)``."""
  import jaxamp

  pair = mlp_digits(seed)
  forward = jaxamp.autocast(_DenseStack((32, 10)).apply, jnp.float16, policy="cpu")

  def jax_loss(params, batch):
    x, y = batch
    logits = forward(params, x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  return dataclasses.replace(pair, name="mlp_digits_autocast", jax_loss=jax_loss)


class _ConvNet(nn.Module):
  """``Conv2d(1, 4, 3) -> ReLU -> Flatten -> Linear(144, 10)`` on NCHW input."""

  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    x = jnp.transpose(x, (0, 2, 3, 1)).astype(self.dtype)  # NCHW -> NHWC
    x = nn.Conv(4, (3, 3), padding="VALID", dtype=self.dtype, param_dtype=jnp.float32, name="0")(x)
    x = nn.relu(x)
    x = jnp.transpose(x, (0, 3, 1, 2)).reshape(x.shape[0], -1)  # torch's C,H,W order
    x = nn.Dense(10, dtype=self.dtype, param_dtype=jnp.float32, name="3")(x)
    return x.astype(jnp.float32)


def cnn_digits(seed: int = 3, compute_dtype: str = "float32") -> Pair:
  """A small convolutional classifier on the 8x8 digits."""
  torch.manual_seed(seed)
  module = torch.nn.Sequential(
    torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(144, 10)
  )
  layout = [
    ("0.weight", ("params", "0", "kernel"), "conv"),
    ("0.bias", ("params", "0", "bias"), "same"),
    ("3.weight", ("params", "3", "kernel"), "dense"),
    ("3.bias", ("params", "3", "bias"), "same"),
  ]
  flax_module = _ConvNet(dtype=jnp.dtype(compute_dtype))
  return _cross_entropy_pair("cnn_digits", module, flax_module, layout, seed, True, compute_dtype)


# ---------------------------------------------------------------------------------------
# Raw parameter vectors, as in docs/torch_semantics.md §6: loss = sum(p * w), so the gradient is
# exactly w times the scale in both frameworks and only the scaler is under test.


class _Vectors(torch.nn.Module):
  def __init__(self, init: dict[str, np.ndarray]):
    super().__init__()
    for name, value in init.items():
      self.register_parameter(name, torch.nn.Parameter(to_torch_tensor(value)))


def vectors(dtypes: dict[str, str], size: int = 4, seed: int = 4, data_scale: float = 1.0) -> Pair:
  """Parameter vectors of the given dtypes; ``loss = sum_k sum(p_k * w_k)``, the
  ``w_k`` N(0, 1) times ``data_scale`` (rounded to float32)."""
  rng = np.random.default_rng(seed)
  init = {
    name: rng.standard_normal(size).astype(np.float32).astype(jnp.dtype(dtype))
    for name, dtype in dtypes.items()
  }
  module = _Vectors(init)
  layout = [(name, (name,), "same") for name in dtypes]

  def batch_at(step: int):
    r = np.random.default_rng([seed, step])
    return tuple(
      (r.standard_normal(size) * data_scale).astype(np.float32).astype(jnp.dtype(dtypes[name]))
      for name in dtypes
    )

  def torch_loss(m, batch, autocast_dtype=None):
    terms = [(p * to_torch_tensor(w)).sum().float() for p, w in zip(m.parameters(), batch)]
    return sum(terms[1:], terms[0])

  def jax_loss(params, batch):
    terms = [jnp.sum(params[name] * w).astype(jnp.float32) for name, w in zip(dtypes, batch)]
    return sum(terms[1:], terms[0])

  params = {name: jnp.asarray(value) for name, value in init.items()}
  return Pair("vectors", module, params, layout, torch_loss, jax_loss, batch_at)


# ---------------------------------------------------------------------------------------
# A small decoder-only Transformer (pre-LN, causal self-attention) on a copy task.


class _TorchBlock(torch.nn.Module):
  def __init__(self, d: int, heads: int, hidden: int):
    super().__init__()
    self.heads = heads
    self.ln1 = torch.nn.LayerNorm(d)
    # q, k, v without bias: a key bias gets an exactly-zero gradient (softmax is
    # invariant to it), pure rounding noise that Adam would amplify to full steps.
    self.q, self.k, self.v = (torch.nn.Linear(d, d, bias=False) for _ in range(3))
    self.o = torch.nn.Linear(d, d)
    self.ln2 = torch.nn.LayerNorm(d)
    self.fc1, self.fc2 = torch.nn.Linear(d, hidden), torch.nn.Linear(hidden, d)

  def attention(self, x):
    b, t, d = x.shape
    dh = d // self.heads

    def split(y):  # (B, T, D) -> (B, H, T, dh)
      return y.reshape(b, t, self.heads, dh).transpose(1, 2)

    q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
    scores = q @ k.transpose(-2, -1) / math.sqrt(dh)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return self.o(out.transpose(1, 2).reshape(b, t, d))

  def forward(self, x):
    x = x + self.attention(self.ln1(x))
    return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class _TorchDecoder(torch.nn.Module):
  def __init__(self, vocab: int, seq: int, d: int, heads: int, layers: int, hidden: int):
    super().__init__()
    self.embed = torch.nn.Embedding(vocab, d)
    self.pos = torch.nn.Parameter(torch.randn(seq, d) * 0.02)
    self.blocks = torch.nn.ModuleList(_TorchBlock(d, heads, hidden) for _ in range(layers))
    self.ln = torch.nn.LayerNorm(d)
    self.head = torch.nn.Linear(d, vocab)

  def forward(self, tokens):
    x = self.embed(tokens) + self.pos[: tokens.shape[1]]
    for block in self.blocks:
      x = block(x)
    return self.head(self.ln(x))


class _FlaxBlock(nn.Module):
  heads: int
  hidden: int

  def _ln(self, name):
    # torch's LayerNorm: eps 1e-5, the variance as mean((x - mean)**2).
    return nn.LayerNorm(epsilon=1e-5, use_fast_variance=False, name=name)

  @nn.compact
  def __call__(self, x):
    b, t, d = x.shape
    dh = d // self.heads

    def split(y):
      return y.reshape(b, t, self.heads, dh).transpose(0, 2, 1, 3)

    h = self._ln("ln1")(x)
    q, k, v = (split(nn.Dense(d, use_bias=False, name=n)(h)) for n in ("q", "k", "v"))
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(dh)
    causal = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(causal, scores, -jnp.inf)
    out = jax.nn.softmax(scores, axis=-1) @ v
    x = x + nn.Dense(d, name="o")(out.transpose(0, 2, 1, 3).reshape(b, t, d))
    h = nn.Dense(self.hidden, name="fc1")(self._ln("ln2")(x))
    return x + nn.Dense(d, name="fc2")(jax.nn.gelu(h, approximate=False))


class _FlaxDecoder(nn.Module):
  vocab: int
  seq: int
  d: int
  heads: int
  layers: int
  hidden: int

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab, self.d, name="embed")(tokens)
    x = x + self.param("pos", nn.initializers.zeros, (self.seq, self.d))[: tokens.shape[1]]
    for i in range(self.layers):
      x = _FlaxBlock(self.heads, self.hidden, name=f"blocks_{i}")(x)
    x = nn.LayerNorm(epsilon=1e-5, use_fast_variance=False, name="ln")(x)
    return nn.Dense(self.vocab, name="head")(x)


def _decoder_layout(layers: int):
  layout = [
    ("pos", ("params", "pos"), "same"),
    ("embed.weight", ("params", "embed", "embedding"), "same"),
  ]
  for i in range(layers):
    block, path = f"blocks.{i}", ("params", f"blocks_{i}")
    for ln in ("ln1",):
      layout += [
        (f"{block}.{ln}.weight", (*path, ln, "scale"), "same"),
        (f"{block}.{ln}.bias", (*path, ln, "bias"), "same"),
      ]
    for lin in ("q", "k", "v"):
      layout += [(f"{block}.{lin}.weight", (*path, lin, "kernel"), "dense")]
    layout += [
      (f"{block}.o.weight", (*path, "o", "kernel"), "dense"),
      (f"{block}.o.bias", (*path, "o", "bias"), "same"),
    ]
    layout += [
      (f"{block}.ln2.weight", (*path, "ln2", "scale"), "same"),
      (f"{block}.ln2.bias", (*path, "ln2", "bias"), "same"),
    ]
    for lin in ("fc1", "fc2"):
      layout += [
        (f"{block}.{lin}.weight", (*path, lin, "kernel"), "dense"),
        (f"{block}.{lin}.bias", (*path, lin, "bias"), "same"),
      ]
  layout += [
    ("ln.weight", ("params", "ln", "scale"), "same"),
    ("ln.bias", ("params", "ln", "bias"), "same"),
    ("head.weight", ("params", "head", "kernel"), "dense"),
    ("head.bias", ("params", "head", "bias"), "same"),
  ]
  return layout


def _copy_batches(seed: int, vocab: int, seq: int, batch: int):
  """Tokens whose second half repeats the first; the target is the next token."""

  def batch_at(step: int):
    rng = np.random.default_rng([seed, step])
    half = rng.integers(0, vocab, (batch, seq // 2 + 1))
    tokens = np.concatenate([half, half[:, :-1]], axis=1)[:, : seq + 1]
    return tokens[:, :-1].astype(np.int64), tokens[:, 1:].astype(np.int64)

  return batch_at


def transformer(
  seed: int = 5,
  vocab: int = 16,
  seq: int = 8,
  d: int = 32,
  heads: int = 4,
  layers: int = 2,
  hidden: int = 64,
  batch: int = 16,
) -> Pair:
  """A 2-layer decoder-only Transformer (d_model 32, 4 heads, pre-LN, causal
  self-attention, GELU MLP) predicting the next token of sequences whose second
  half copies the first. Float32 throughout."""
  torch.manual_seed(seed)
  module = _TorchDecoder(vocab, seq, d, heads, layers, hidden)
  layout = _decoder_layout(layers)
  assert [n for n, _, _ in layout] == [n for n, _ in module.named_parameters()]
  flax_module = _FlaxDecoder(vocab, seq, d, heads, layers, hidden)

  def torch_loss(m, batch, autocast_dtype=None):
    x, y = (torch.from_numpy(a) for a in batch)
    logits = m(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))

  def jax_loss(params, batch):
    x, y = batch
    logits = flax_module.apply(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(
      logits.reshape(-1, vocab), y.reshape(-1)
    ).mean()

  return Pair(
    "transformer",
    module,
    _copy_weights(module, layout),
    layout,
    torch_loss,
    jax_loss,
    _copy_batches(seed, vocab, seq, batch),
  )


# ---------------------------------------------------------------------------------------
# A GAN: a discriminator and a generator, each its own optimizer, stepping one after the other.


class _TorchGan(torch.nn.Module):
  def __init__(self):
    super().__init__()
    # D's output layer has no bias: one scalar that crosses zero while training
    # makes the suite's per-tensor relative difference meaningless there.
    linear = torch.nn.Linear
    self.d = torch.nn.Sequential(linear(3, 16), torch.nn.ReLU(), linear(16, 1, bias=False))
    self.g = _torch_dense_stack((2, 16, 3))


def _jax_mlp(p: dict, x: jax.Array) -> jax.Array:
  """torch's ``Linear -> ReLU -> Linear`` on weights in torch's layout (the
  last bias, if any)."""
  out = jax.nn.relu(x @ p["0.weight"].T + p["0.bias"]) @ p["2.weight"].T
  return out + p["2.bias"] if "2.bias" in p else out


def gan(seed: int = 5) -> Pair:
  """A least-squares GAN learning a shifted 3-d Gaussian from 2-d noise:
  ``D: Linear(3,16) -> ReLU -> Linear(16,1,bias=False)`` (parameters ``d.*``) and
  ``G: Linear(2,16) -> ReLU -> Linear(16,3)`` (``g.*``). Stage 0, D's loss
  ``(D(real) - 1)**2 / 2 + D(G(z).detach())**2 / 2``; stage 1, G's loss
  ``(D(G(z)) - 1)**2 / 2`` through the D just stepped (batch means)."""
  torch.manual_seed(seed)
  module = _TorchGan()
  layout = [(name, tuple(name.split(".", 1)), "same") for name, _ in module.named_parameters()]

  def batch_at(step: int):
    rng = np.random.default_rng([seed, step])
    real = rng.standard_normal((16, 3)) + np.array([1.0, -2.0, 0.5])
    return real.astype(np.float32), rng.standard_normal((16, 2)).astype(np.float32)

  def torch_loss_d(m, batch, autocast_dtype=None):
    real, z = (torch.from_numpy(a) for a in batch)
    fake = m.g(z).detach()
    return 0.5 * ((m.d(real) - 1) ** 2).mean() + 0.5 * (m.d(fake) ** 2).mean()

  def torch_loss_g(m, batch, autocast_dtype=None):
    _, z = (torch.from_numpy(a) for a in batch)
    return 0.5 * ((m.d(m.g(z)) - 1) ** 2).mean()

  def jax_loss_d(params, batch):
    real, z = batch
    fake = jax.lax.stop_gradient(_jax_mlp(params["g"], z))
    d = params["d"]
    return 0.5 * jnp.mean((_jax_mlp(d, real) - 1) ** 2) + 0.5 * jnp.mean(_jax_mlp(d, fake) ** 2)

  def jax_loss_g(params, batch):
    _, z = batch
    return 0.5 * jnp.mean((_jax_mlp(params["d"], _jax_mlp(params["g"], z)) - 1) ** 2)

  return Pair(
    "gan",
    module,
    _copy_weights(module, layout),
    layout,
    torch_loss_d,
    jax_loss_d,
    batch_at,
    stages=((torch_loss_d, jax_loss_d), (torch_loss_g, jax_loss_g)),
  )


MODELS = {
  "linear10": linear10,
  "two_layer": two_layer,
  "mlp_digits": mlp_digits,
  "cnn_digits": cnn_digits,
  "vectors": vectors,
  "transformer": transformer,
  "gan": gan,
}


def tree_to_torch_layout(pair: Pair, tree: Any) -> dict[str, np.ndarray]:
  """:meth:`Pair.to_torch_layout` for any params-shaped tree (device arrays ok)."""
  return pair.to_torch_layout(jax.device_get(tree))
