"""Trains an MLP on scikit-learn's digits with Flax linen in float16, with jaxamp.

The same setup as ``nnx_digits.py`` with a linen module and a ``TrainState``:
float16 compute on float32 parameters, the loss in float32, jaxamp's dynamic
loss scale, and scale metrics returned from the jitted step as arrays::

  python examples/linen_digits.py --steps 2000 --out linen_digits.png
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _digits import batch_indices, load_digits_split, plot_curves
from flax.training import train_state
from tqdm import tqdm

import jaxamp
from jaxamp import flax_utils


class MLP(nn.Module):
  """ReLU layers computing in ``dtype`` on float32 parameters."""

  depth: int
  width: int
  dtype: jnp.dtype = jnp.float16

  @nn.compact
  def __call__(self, x):
    x = x.astype(self.dtype)
    for _ in range(self.depth):
      x = jax.nn.relu(nn.Dense(self.width, dtype=self.dtype, param_dtype=jnp.float32)(x))
    return nn.Dense(10, dtype=self.dtype, param_dtype=jnp.float32)(x)  # logits in `dtype`


@jax.jit
def train_step(state: train_state.TrainState, x, y):
  def loss_fn(params):
    logits = state.apply_fn({"params": params}, x).astype(jnp.float32)  # loss in float32
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  loss, grads = flax_utils.scaled_value_and_grad(loss_fn, state)(state.params)
  state = flax_utils.apply_gradients(state, grads=grads)  # unscales; skips on inf/NaN
  return state, loss, flax_utils.loss_scale_metrics(state)


@jax.jit
def accuracy(state: train_state.TrainState, x, y):
  logits = state.apply_fn({"params": state.params}, x)
  return jnp.mean(jnp.argmax(logits, axis=-1) == y)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=2000)
  parser.add_argument("--out", default="linen_digits.png", help="PNG of the loss and scale")
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--depth", type=int, default=4, help="hidden layers")
  parser.add_argument("--width", type=int, default=128)
  parser.add_argument("--lr", type=float, default=1e-3)
  parser.add_argument("--growth-interval", type=int, default=200)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--log-every", type=int, default=25)
  args = parser.parse_args(argv)

  x_train, y_train, x_test, y_test = load_digits_split(args.seed)
  model = MLP(args.depth, args.width)
  params = model.init(jax.random.key(args.seed), x_train[:1])["params"]
  tx = jaxamp.dynamic_loss_scale(optax.adam(args.lr), growth_interval=args.growth_interval)
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  history = []  # device arrays; fetched once at the end
  batches = batch_indices(len(x_train), args.batch_size, args.steps, args.seed)
  progress = tqdm(batches, total=args.steps, desc="linen digits (float16)")
  for step, idx in enumerate(progress, start=1):
    state, loss, metrics = train_step(state, x_train[idx], y_train[idx])
    history.append((loss, metrics["loss_scale"], metrics["skipped"]))
    if step % args.log_every == 0 or step == args.steps:
      progress.set_postfix(
        loss=f"{float(loss):.4f}",
        scale=f"{float(metrics['loss_scale']):g}",
        skipped=int(metrics["skipped_steps"]),
      )
  progress.close()

  losses, scales, skipped = (np.asarray(a) for a in zip(*jax.device_get(history)))
  test_accuracy = float(accuracy(state, x_test, y_test))
  skipped_steps = int(flax_utils.loss_scale_metrics(state)["skipped_steps"])
  print(
    f"test accuracy {test_accuracy:.4f}; {skipped_steps} of {int(state.step)} "
    f"updates skipped (state.step counts both); final scale {scales[-1]:g}"
  )
  plot_curves(args.out, losses, scales, skipped, "linen MLP on digits, float16 + jaxamp")
  print(f"wrote {args.out}")
  return {"test_accuracy": test_accuracy, "skipped_steps": skipped_steps, "losses": losses}


if __name__ == "__main__":
  main()
