"""jaxamp's states through flax.serialization (msgpack), orbax's neighbour in
Flax programs: saved mid-run, restored into a fresh state, training resumes
bit for bit as if never stopped."""

import subprocess
import sys

import flax.serialization
import jax
import jax.numpy as jnp
import optax
import pytest
from flax.training import train_state
from helpers import bits

import jaxamp


def _grads(i):
  g = {"w": jnp.array([1.0, -2.0]) * (i + 1), "b": jnp.array([0.5]) * i}
  return jax.tree.map(lambda x: x.at[0].set(jnp.inf), g) if i % 3 == 1 else g


def _run(tx, state, params, steps):
  step = jax.jit(lambda g, s, p: jaxamp.apply_scaled_updates(tx, g, s, p))
  for i in steps:
    params, state = step(_grads(i), state, params)
  return params, state


@pytest.mark.parametrize(
  "make",
  [
    lambda: jaxamp.dynamic_loss_scale(optax.adam(0.1), init_scale=8.0, growth_interval=2),
    lambda: jaxamp.accumulate_gradients(jaxamp.dynamic_loss_scale(optax.sgd(0.1)), 2),
    lambda: jaxamp.dynamic_loss_scale(
      optax.inject_hyperparams(optax.adamw)(learning_rate=optax.linear_schedule(0.1, 0.0, 9)),
      schedule_counts="iterations",
    ),
  ],
  ids=["adam", "accumulate", "inject_hyperparams"],
)
def test_serialization_msgpack_round_trip_resumes_bit_for_bit(make):
  tx, params = make(), {"w": jnp.ones(2), "b": jnp.zeros(1)}
  whole = _run(tx, tx.init(params), params, range(6))
  params, state = _run(tx, tx.init(params), params, range(3))
  restored = flax.serialization.from_bytes(tx.init(params), flax.serialization.to_bytes(state))
  assert bits(restored) == bits(state)
  assert bits(_run(tx, restored, params, range(3, 6))) == bits(whole)


def test_serialization_msgpack_of_linen_train_state():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=4.0)
  state = train_state.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=tx)
  state = state.apply_gradients(grads={"w": jnp.array([jnp.inf, 1.0])})
  data = flax.serialization.to_bytes(state)
  fresh = train_state.TrainState.create(apply_fn=None, params={"w": jnp.zeros(2)}, tx=tx)
  restored = flax.serialization.from_bytes(fresh, data)
  assert float(jaxamp.get_loss_scale(restored.opt_state)) == 2.0
  assert bits(restored.params) == bits(state.params)


def test_serialization_works_when_flax_is_imported_after_jaxamp():
  code = (
    "import jax.numpy as jnp, optax, jaxamp\n"
    "import flax.serialization as s\n"
    "tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1))\n"
    "state = tx.init({'w': jnp.ones(2)})\n"
    "print(float(s.from_bytes(state, s.to_bytes(state)).loss_scale))\n"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "65536.0"
