"""Shared by the examples: scikit-learn's digits data set and the training-curve plot.

The digits (1797 8x8 images, 10 classes) ship with scikit-learn: nothing is
downloaded.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


def load_digits_split(seed: int = 0, test_fraction: float = 0.2):
  """Returns ``(x_train, y_train, x_test, y_test)``: float32 pixels in [0, 1], int32 labels."""
  from sklearn.datasets import load_digits

  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  y = digits.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(x))
  n_test = round(len(x) * test_fraction)
  test, train = order[:n_test], order[n_test:]
  return x[train], y[train], x[test], y[test]


def batch_indices(n: int, batch_size: int, steps: int, seed: int) -> Iterator[np.ndarray]:
  """``steps`` batches of indices into ``n`` examples, reshuffled every epoch."""
  rng = np.random.default_rng(seed)
  order, position = rng.permutation(n), 0
  for _ in range(steps):
    if position + batch_size > n:
      order, position = rng.permutation(n), 0
    yield order[position : position + batch_size]
    position += batch_size


def plot_curves(path: str, losses, scales, skipped, title: str) -> None:
  """Saves a PNG with the loss (top) and the loss scale with skipped steps (bottom)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  losses, scales, skipped = map(np.asarray, (losses, scales, skipped))
  steps = np.arange(1, len(losses) + 1)
  fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(7, 5))
  top.plot(steps, losses, lw=0.8)
  top.set_yscale("log")
  top.set_ylabel("training loss (unscaled)")
  top.set_title(title)
  bottom.step(steps, scales, where="post", lw=1.0, label="loss scale after the step")
  if skipped.any():
    bottom.plot(steps[skipped], scales[skipped], "rv", ms=4, label="skipped step")
  bottom.set_yscale("log", base=2)
  bottom.set_ylabel("loss scale")
  bottom.set_xlabel("step")
  bottom.legend(loc="best", fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
