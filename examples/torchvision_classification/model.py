"""torchvision's ResNet (``BasicBlock``) in JAX, shrunk to run on a CPU in seconds,
with its parameters and buffers in torch's names and layout.

The structure of ``torchvision.models.resnet.ResNet`` (BSD-3-Clause, Copyright
(c) Soumith Chintala 2016): a 7x7 stride-2 stem convolution, BatchNorm, ReLU
and a 3x3 stride-2 max pool, then stages of ``BasicBlock`` (conv3x3, BN, ReLU,
conv3x3, BN, the identity or a 1x1 stride-2 ``downsample`` added, ReLU), an
average pool and ``fc``, with torchvision's initialisation. Shrunk: two stages
of one block each, ``WIDTHS`` channels (torchvision's resnet18 has four stages
of two blocks, 64 to 512 channels). The parameters are a flat dict keyed by
torch's ``named_parameters()`` names (``layer1.0.conv1.weight``), in torch's
layout (convolution weights ``(out, in, kh, kw)``, images NCHW); the buffers
(BatchNorm's ``running_mean``, ``running_var``, ``num_batches_tracked``) are a
second dict keyed by ``named_buffers()`` names, so that the two together are a
torch ``state_dict``.

The model is written in float32; the float16 computation is
``jaxamp.autocast``'s (``train.py``). BatchNorm and the average pool are
torch's CPU kernels under autocast: statistics and sums in float32, the result
rounded once to the half dtype (``half``), where the same ops written out
would each round in half (``docs/autocast.md``: ``batch_norm`` keeps its input
dtype on CPU).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

import jaxamp

WIDTHS = (8, 16)  # channels of the two stages (one BasicBlock each)
BN_MOMENTUM, BN_EPS = 0.1, 1e-5  # nn.BatchNorm2d's defaults


def conv2d(x, w, stride=1, padding=0):
  """``nn.Conv2d(..., bias=False)`` on NCHW images with OIHW weights.

  A half ``x`` (a BatchNorm's rounded output) is cast up to the weight's
  float32, exactly: ``lax`` takes one dtype, and autocast casts both to half.
  """
  pad = [(padding, padding)] * 2
  dims = ("NCHW", "OIHW", "NCHW")
  return lax.conv_general_dilated(
    x.astype(w.dtype), w, (stride, stride), pad, dimension_numbers=dims
  )


def _batch_norm_f32(x, weight, bias, mean, var, num, train):
  """BatchNorm's arithmetic in float32: the normalised output and the new running stats."""
  if train:
    batch_mean = jnp.mean(x, axis=(0, 2, 3))
    batch_var = jnp.var(x, axis=(0, 2, 3))  # biased, to normalise
    n = x.size // x.shape[1]
    mean = (1 - BN_MOMENTUM) * mean + BN_MOMENTUM * batch_mean
    var = (1 - BN_MOMENTUM) * var + BN_MOMENTUM * batch_var * (n / (n - 1))  # unbiased, to track
    num = num + 1
    use_mean, use_var = batch_mean, batch_var
  else:
    use_mean, use_var = mean, var
  scale = lax.rsqrt(use_var + BN_EPS) * weight
  y = (x - use_mean[None, :, None, None]) * scale[None, :, None, None] + bias[None, :, None, None]
  return y, mean, var, num


def batch_norm(params, buffers, name, x, train, half):
  """``nn.BatchNorm2d``; returns the output and ``buffers`` with ``name``'s stats updated in training.

  ``half``: the autocast dtype (torch's kernel takes a half input, computes in
  float32 and returns half), or ``None`` outside autocast.
  """
  y, mean, var, num = jaxamp.autocast_disabled(functools.partial(_batch_norm_f32, train=train))(
    x,
    params[f"{name}.weight"],
    params[f"{name}.bias"],
    buffers[f"{name}.running_mean"],
    buffers[f"{name}.running_var"],
    buffers[f"{name}.num_batches_tracked"],
  )
  new = {
    f"{name}.running_mean": mean,
    f"{name}.running_var": var,
    f"{name}.num_batches_tracked": num,
  }
  return (y if half is None else y.astype(half)), {**buffers, **new}


def max_pool(x):
  """``nn.MaxPool2d(kernel_size=3, stride=2, padding=1)``."""
  pad = ((0, 0), (0, 0), (1, 1), (1, 1))
  return lax.reduce_window(x, -jnp.inf, lax.max, (1, 1, 3, 3), (1, 1, 2, 2), pad)


def _mean_f32(x):
  return jnp.mean(x, axis=(2, 3))


def basic_block(params, buffers, name, x, stride, train, half):
  """torchvision's ``BasicBlock`` (expansion 1)."""
  identity = x
  out = conv2d(x, params[f"{name}.conv1.weight"], stride, 1)
  out, buffers = batch_norm(params, buffers, f"{name}.bn1", out, train, half)
  out = jax.nn.relu(out)
  out = conv2d(out, params[f"{name}.conv2.weight"], 1, 1)
  out, buffers = batch_norm(params, buffers, f"{name}.bn2", out, train, half)
  if f"{name}.downsample.0.weight" in params:
    identity = conv2d(x, params[f"{name}.downsample.0.weight"], stride, 0)
    identity, buffers = batch_norm(params, buffers, f"{name}.downsample.1", identity, train, half)
  return jax.nn.relu(out + identity), buffers


def resnet(params, buffers, x, train=True, half=None):
  """The forward pass: ``(logits, buffers)``, the buffers updated when ``train``."""
  x = conv2d(x, params["conv1.weight"], 2, 3)
  x, buffers = batch_norm(params, buffers, "bn1", x, train, half)
  x = max_pool(jax.nn.relu(x))
  for stage in range(len(WIDTHS)):
    x, buffers = basic_block(
      params, buffers, f"layer{stage + 1}.0", x, 1 if stage == 0 else 2, train, half
    )
  x = jaxamp.autocast_disabled(_mean_f32)(x)  # nn.AdaptiveAvgPool2d((1, 1)), flattened
  x = x if half is None else x.astype(half)
  return x @ params["fc.weight"].T + params["fc.bias"], buffers


def is_norm(name):
  """Whether a parameter belongs to a normalisation layer (torchvision's ``norm_classes``)."""
  module = name.rsplit(".", 1)[0]
  return module.split(".")[-1].startswith("bn") or module.endswith("downsample.1")


def init_params(key, num_classes, in_channels=3):
  """torchvision's initialisation: ``(params, buffers)``.

  Convolutions ``kaiming_normal_(mode="fan_out", nonlinearity="relu")``,
  BatchNorm weight 1 and bias 0, ``fc`` as ``nn.Linear``'s default
  (uniform in +-1/sqrt(in_features)).
  """
  shapes = {"conv1.weight": (WIDTHS[0], in_channels, 7, 7)}
  norms = {"bn1": WIDTHS[0]}  # BatchNorm name -> channels
  inplanes = WIDTHS[0]
  for stage, planes in enumerate(WIDTHS):
    name = f"layer{stage + 1}.0"
    shapes[f"{name}.conv1.weight"] = (planes, inplanes, 3, 3)
    shapes[f"{name}.conv2.weight"] = (planes, planes, 3, 3)
    norms.update({f"{name}.bn1": planes, f"{name}.bn2": planes})
    if stage > 0 or inplanes != planes:
      shapes[f"{name}.downsample.0.weight"] = (planes, inplanes, 1, 1)
      norms[f"{name}.downsample.1"] = planes
    inplanes = planes
  keys = iter(jax.random.split(key, len(shapes) + 2))
  params = {}
  for name, shape in shapes.items():
    std = math.sqrt(2.0 / (shape[0] * shape[2] * shape[3]))
    params[name] = std * jax.random.normal(next(keys), shape, jnp.float32)
  buffers = {}
  for name, channels in norms.items():
    params[f"{name}.weight"] = jnp.ones(channels)
    params[f"{name}.bias"] = jnp.zeros(channels)
    buffers[f"{name}.running_mean"] = jnp.zeros(channels)
    buffers[f"{name}.running_var"] = jnp.ones(channels)
    buffers[f"{name}.num_batches_tracked"] = jnp.zeros((), jnp.int32)
  bound = 1 / math.sqrt(inplanes)
  params["fc.weight"] = jax.random.uniform(
    next(keys), (num_classes, inplanes), jnp.float32, -bound, bound
  )
  params["fc.bias"] = jax.random.uniform(next(keys), (num_classes,), jnp.float32, -bound, bound)
  return params, buffers
