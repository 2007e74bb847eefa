"""Trains an Equinox MLP with a frozen layer on scikit-learn's digits, in float16, with jaxamp.

A port of Equinox's frozen-layer example (``examples/frozen_layer.ipynb``):
a filter spec marks the trainable leaves, ``eqx.partition`` splits the model
into its trainable and frozen parts, ``eqx.filter_grad`` differentiates the
trainable part only (``None`` for every other leaf), and the optimizer is
initialised on the trainable part. Here the first layer is frozen (fixed
random features) and the others train. The model is the unmodified float32
MLP; ``jaxamp.autocast`` runs its matmuls in float16 (torch's autocast policy),
the loss is scaled by ``jaxamp.dynamic_loss_scale``, and
``jaxamp.apply_scaled_updates`` unscales, updates the model or skips the step
on inf/NaN::

  python examples/eqx_digits.py --steps 2000 --out eqx_digits.png
"""

from __future__ import annotations

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _digits import batch_indices, load_digits_split, plot_curves
from tqdm import tqdm

import jaxamp


def loss_fn(model: eqx.nn.MLP, x, y):
  logits = jax.vmap(model)(x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def trainable_spec(model: eqx.nn.MLP):
  """True for the leaves that train: every layer's weight and bias but the first's."""
  spec = jax.tree.map(lambda _: False, model)
  trained = model.layers[1:]
  return eqx.tree_at(
    lambda m: (
      [m.layers[i + 1].weight for i in range(len(trained))]
      + [m.layers[i + 1].bias for i in range(len(trained))]
    ),
    spec,
    replace=[True] * (2 * len(trained)),
  )


def make_train_step(tx, spec):
  # with torch.autocast("cuda", dtype=torch.float16): ... around the forward and the loss
  half_loss = jaxamp.autocast(loss_fn, jnp.float16)

  @eqx.filter_jit
  def train_step(model, opt_state, x, y):
    diff_model, static_model = eqx.partition(model, spec)

    def scaled_loss(diff_model):
      loss = half_loss(eqx.combine(diff_model, static_model), x, y)
      return jaxamp.scale_loss(loss, opt_state), loss

    (_, loss), grads = eqx.filter_value_and_grad(scaled_loss, has_aux=True)(diff_model)
    model, opt_state = jaxamp.apply_scaled_updates(tx, grads, opt_state, model)
    return model, opt_state, loss

  return train_step


@eqx.filter_jit
def accuracy(model, x, y):
  return jnp.mean(jnp.argmax(jax.vmap(model)(x), axis=-1) == y)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=2000)
  parser.add_argument("--out", default="eqx_digits.png", help="PNG of the loss and scale")
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--depth", type=int, default=3, help="hidden layers")
  parser.add_argument("--width", type=int, default=128)
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--growth-interval", type=int, default=200)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--log-every", type=int, default=25)
  args = parser.parse_args(argv)

  x_train, y_train, x_test, y_test = load_digits_split(args.seed)
  key = jax.random.key(args.seed)
  model = eqx.nn.MLP(64, 10, args.width, args.depth, activation=jax.nn.relu, key=key)
  frozen_before = np.asarray(model.layers[0].weight)
  spec = trainable_spec(model)
  tx = jaxamp.dynamic_loss_scale(optax.adam(args.lr), growth_interval=args.growth_interval)
  opt_state = tx.init(eqx.filter(model, spec))  # Adam's moments for the trained leaves only
  train_step = make_train_step(tx, spec)

  history = []  # device arrays; fetched once at the end
  batches = batch_indices(len(x_train), args.batch_size, args.steps, args.seed)
  progress = tqdm(batches, total=args.steps, desc="eqx digits (jaxamp.autocast)")
  for step, idx in enumerate(progress, start=1):
    model, opt_state, loss = train_step(model, opt_state, x_train[idx], y_train[idx])
    history.append((loss, jaxamp.get_loss_scale(opt_state), opt_state.found_inf))
    if step % args.log_every == 0 or step == args.steps:
      progress.set_postfix(
        loss=f"{float(loss):.4f}",
        scale=f"{float(jaxamp.get_loss_scale(opt_state)):g}",
        skipped=int(opt_state.skipped_steps),
      )
  progress.close()

  losses, scales, skipped = (np.asarray(a) for a in zip(*jax.device_get(history)))
  test_accuracy = float(accuracy(model, x_test, y_test))
  skipped_steps = int(opt_state.skipped_steps)
  frozen_unchanged = bool(np.array_equal(np.asarray(model.layers[0].weight), frozen_before))
  print(
    f"test accuracy {test_accuracy:.4f}; {skipped_steps} of {args.steps} updates skipped; "
    f"final scale {scales[-1]:g}; first layer unchanged: {frozen_unchanged}"
  )
  plot_curves(args.out, losses, scales, skipped, "Equinox MLP on digits, frozen layer, jaxamp")
  print(f"wrote {args.out}")
  return {
    "test_accuracy": test_accuracy,
    "skipped_steps": skipped_steps,
    "losses": losses,
    "frozen_unchanged": frozen_unchanged,
  }


if __name__ == "__main__":
  main()
