"""Parameter shapes of real models, from their published architectures (arrays only).

>>> sum(math.prod(s) for s in gpt2_small())      # GPT-2 small, tied embedding
124439808
>>> sum(math.prod(s) for s in resnet50())        # torchvision resnet50, no buffers
25557032
>>> sum(math.prod(s) for s in vit_b16())         # torchvision vit_b_16
86567656
"""

from __future__ import annotations

import math

import numpy as np


def gpt2_small(vocab=50257, context=1024, width=768, layers=12):
  """GPT-2 small (Radford et al. 2019; Hugging Face ``gpt2``): 148 leaves."""
  block = [
    (width,), (width,),                      # ln_1
    (width, 3 * width), (3 * width,),        # attn.c_attn
    (width, width), (width,),                # attn.c_proj
    (width,), (width,),                      # ln_2
    (width, 4 * width), (4 * width,),        # mlp.c_fc
    (4 * width, width), (width,),            # mlp.c_proj
  ]  # fmt: skip
  return [(vocab, width), (context, width), *block * layers, (width,), (width,)]


def resnet50(classes=1000):
  """ResNet-50 (He et al. 2016; torchvision ``resnet50``): 161 leaves."""
  shapes = [(64, 3, 7, 7), (64,), (64,)]
  inputs = 64
  for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
    for block in range(blocks):
      shapes += [(width, inputs, 1, 1), (width,), (width,)]
      shapes += [(width, width, 3, 3), (width,), (width,)]
      shapes += [(4 * width, width, 1, 1), (4 * width,), (4 * width,)]
      if block == 0:
        shapes += [(4 * width, inputs, 1, 1), (4 * width,), (4 * width,)]
      inputs = 4 * width
  return shapes + [(classes, 2048), (classes,)]


def vit_b16(classes=1000, image=224, patch=16, width=768, layers=12):
  """ViT-B/16 (Dosovitskiy et al. 2021; torchvision ``vit_b_16``): 152 leaves."""
  tokens = (image // patch) ** 2 + 1
  block = [
    (width,), (width,),                      # ln_1
    (3 * width, width), (3 * width,),        # self_attention.in_proj
    (width, width), (width,),                # self_attention.out_proj
    (width,), (width,),                      # ln_2
    (4 * width, width), (4 * width,),        # mlp.0
    (width, 4 * width), (width,),            # mlp.3
  ]  # fmt: skip
  head = [(width, 3, patch, patch), (width,), (1, 1, width), (1, tokens, width)]
  return [*head, *block * layers, (width,), (width,), (classes, width), (classes,)]


def equal(n_params, n_leaves):
  """``n_leaves`` leaves of one size, ``(n_params // n_leaves // 250, 250)``."""
  return [(n_params // n_leaves // 250, 250)] * n_leaves


def lognormal(n_params, n_leaves, sigma=1.0, seed=0):
  """``n_leaves`` 1-d leaves whose sizes are lognormal (``sigma``), ``n_params`` in all."""
  weights = np.random.default_rng(seed).lognormal(0.0, sigma, n_leaves)
  sizes = np.maximum(1, np.round(weights / weights.sum() * n_params)).astype(int)
  return [(int(s),) for s in sizes]


MIXES = {
  "equal/1m/4": lambda: equal(1_000_000, 4),
  "equal/25m/200": lambda: equal(25_000_000, 200),
  "equal/25m/2000": lambda: equal(25_000_000, 2000),
  "lognormal/25m/200": lambda: lognormal(25_000_000, 200),
  "lognormal/25m/2000": lambda: lognormal(25_000_000, 2000),
  "gpt2": gpt2_small,
  "resnet50": resnet50,
  "vit_b16": vit_b16,
}


def describe(shapes):
  sizes = [math.prod(s) for s in shapes]
  return f"{sum(sizes) / 1e6:.1f}M params in {len(sizes)} leaves, {len(set(sizes))} sizes"
