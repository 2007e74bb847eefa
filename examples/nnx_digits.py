"""Trains an MLP on scikit-learn's digits with Flax NNX in float16, with jaxamp.

The model computes in float16 with float32 parameters; the loss is computed in
float32 from the logits. With ``--autocast`` the model is the unmodified
float32 MLP and ``jaxamp.autocast`` runs it with torch's autocast policy
(matmuls in float16, the loss's log-softmax in float32), as a torch loop does
under ``torch.autocast("cuda", float16)``. The loss is scaled by jaxamp's dynamic loss scale,
updates with inf/NaN gradients are skipped, and the step returns the scale
metrics as arrays so that logging syncs with the host only every
``--log-every`` steps::

  python examples/nnx_digits.py --steps 2000 --out nnx_digits.png
  python examples/nnx_digits.py --steps 2000 --autocast --out nnx_autocast.png
"""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _digits import batch_indices, load_digits_split, plot_curves
from flax import nnx
from tqdm import tqdm

import jaxamp
from jaxamp import flax_utils


class MLP(nnx.Module):
  """ReLU layers computing in ``dtype`` on float32 parameters."""

  def __init__(self, depth: int, width: int, dtype, rngs: nnx.Rngs):
    sizes = [64] + [width] * depth
    self.hidden = nnx.List(
      [
        nnx.Linear(n_in, n_out, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        for n_in, n_out in itertools.pairwise(sizes)
      ]
    )
    self.head = nnx.Linear(width, 10, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
    self.dtype = dtype

  def __call__(self, x):
    x = x.astype(self.dtype)
    for layer in self.hidden:
      x = jax.nn.relu(layer(x))
    return self.head(x)  # logits in `dtype`


def loss_fn(model: MLP, x, y):
  logits = model(x).astype(jnp.float32)  # the loss in float32, not float16
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@nnx.jit(static_argnames="autocast")
def train_step(model: MLP, optimizer: nnx.Optimizer, x, y, autocast=False):
  # with torch.autocast("cuda", dtype=torch.float16): ... around the forward and the loss
  fn = jaxamp.autocast(loss_fn, jnp.float16, enabled=autocast)
  grad_fn = flax_utils.scaled_value_and_grad(fn, optimizer)
  loss, grads = grad_fn(model, x, y)  # unscaled loss, grads of the scaled loss
  flax_utils.update(optimizer, model, grads)  # unscales; skips the update on inf/NaN
  return loss, flax_utils.loss_scale_metrics(optimizer)


@nnx.jit
def accuracy(model: MLP, x, y):
  return jnp.mean(jnp.argmax(model(x), axis=-1) == y)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=2000)
  parser.add_argument("--out", default="nnx_digits.png", help="PNG of the loss and scale")
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--depth", type=int, default=4, help="hidden layers")
  parser.add_argument("--width", type=int, default=128)
  parser.add_argument("--lr", type=float, default=1e-3)
  parser.add_argument("--growth-interval", type=int, default=200)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--log-every", type=int, default=25)
  parser.add_argument(
    "--autocast", action="store_true", help="a float32 model under jaxamp.autocast"
  )
  args = parser.parse_args(argv)

  x_train, y_train, x_test, y_test = load_digits_split(args.seed)
  dtype = jnp.float32 if args.autocast else jnp.float16  # autocast casts per op
  model = MLP(args.depth, args.width, dtype, nnx.Rngs(args.seed))
  mode = "jaxamp.autocast" if args.autocast else "float16"
  tx = jaxamp.dynamic_loss_scale(optax.adam(args.lr), growth_interval=args.growth_interval)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  history = []  # device arrays; fetched once at the end
  batches = batch_indices(len(x_train), args.batch_size, args.steps, args.seed)
  progress = tqdm(batches, total=args.steps, desc=f"nnx digits ({mode})")
  for step, idx in enumerate(progress, start=1):
    loss, metrics = train_step(model, optimizer, x_train[idx], y_train[idx], args.autocast)
    history.append((loss, metrics["loss_scale"], metrics["skipped"]))
    if step % args.log_every == 0 or step == args.steps:
      progress.set_postfix(
        loss=f"{float(loss):.4f}",
        scale=f"{float(metrics['loss_scale']):g}",
        skipped=int(metrics["skipped_steps"]),
      )
  progress.close()

  losses, scales, skipped = (np.asarray(a) for a in zip(*jax.device_get(history)))
  test_accuracy = float(accuracy(model, x_test, y_test))
  skipped_steps = int(flax_utils.loss_scale_metrics(optimizer)["skipped_steps"])
  print(
    f"test accuracy {test_accuracy:.4f}; {skipped_steps} of {int(optimizer.step[...])} "
    f"updates skipped (optimizer.step counts both); final scale {scales[-1]:g}"
  )
  plot_curves(args.out, losses, scales, skipped, f"NNX MLP on digits, {mode} + jaxamp")
  print(f"wrote {args.out}")
  return {"test_accuracy": test_accuracy, "skipped_steps": skipped_steps, "losses": losses}


if __name__ == "__main__":
  main()
