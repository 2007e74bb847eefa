"""Outside jit: a ported torch loop with jaxamp.GradScaler, and dynamic_loss_scale's update.

The README's first GradScaler loop (two Linear(10, 10) layers, Adam) run op by
op, as a torch loop is, the same with ``unscale_`` and clipping (torch's
gradient-clipping recipe), and ``tx.update`` of ``dynamic_loss_scale(adam)``
called outside ``jit``: median wall time of one iteration, waiting for the
result, after three warm-up iterations.

  PYTHONPATH=. python benchmarks/bench_eager.py
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import optax

import jaxamp


def linear(p, x):
  return x @ p["w"].T + p["b"]


def loss_fn(params, x, y):
  return jnp.mean((linear(params["l2"], jax.nn.relu(linear(params["l1"], x))) - y) ** 2)


def main():
  k1, k2 = jax.random.split(jax.random.key(0))
  params = {
    "l1": {"w": jax.random.normal(k1, (10, 10)) / 3, "b": jnp.zeros(10)},
    "l2": {"w": jax.random.normal(k2, (10, 10)) / 3, "b": jnp.zeros(10)},
  }
  x, y = jnp.ones((4, 10)), jnp.zeros((4, 10))
  scaler, opt = jaxamp.GradScaler(), jaxamp.Optimizer(optax.adam(1e-3), params)

  def grad_scaler_iteration():
    opt.zero_grad()
    opt.grads = jax.grad(lambda p: scaler.scale(loss_fn(p, x, y)))(opt.params)
    scaler.step(opt)
    scaler.update()
    jax.block_until_ready(opt.params)

  def grad_scaler_iteration_clipped():
    opt.zero_grad()
    opt.grads = jax.grad(lambda p: scaler.scale(loss_fn(p, x, y)))(opt.params)
    scaler.unscale_(opt)
    opt.grads, _ = jaxamp.clip_grad_norm(opt.grads, 1.0)
    scaler.step(opt)
    scaler.update()
    jax.block_until_ready(opt.params)

  tx = jaxamp.dynamic_loss_scale(optax.adam(1e-3))
  state = [tx.init(params)]
  grads = jax.tree.map(jnp.ones_like, params)

  def optax_update():
    updates, state[0] = tx.update(grads, state[0], params)
    jax.block_until_ready(updates)

  for name, run in [
    ("GradScaler iteration", grad_scaler_iteration),
    ("GradScaler iteration, unscale_ and clipping", grad_scaler_iteration_clipped),
    ("dynamic_loss_scale update", optax_update),
  ]:
    for _ in range(3):
      run()
    times = []
    for _ in range(60):
      start = time.perf_counter()
      run()
      times.append(time.perf_counter() - start)
    print(f"{name}: {statistics.median(times) * 1e3:.1f} ms")


if __name__ == "__main__":
  main()
