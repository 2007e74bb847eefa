"""``optax.lookahead`` and the loss scaler: inside it is refused, with the fix
(lookahead around the scaler) on the message's first line; that fix steps as plain
optax's lookahead does, within float32 rounding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp


def _params():
  return optax.LookaheadParams.init_synced({"w": jnp.arange(3.0), "b": jnp.ones(2)})


def _grads(step: int):
  return {"w": jnp.full(3, 0.5 + step), "b": jnp.full(2, -1.0 - step)}


@pytest.mark.parametrize("front_end", ["update", "apply_scaled_updates"])
def test_dynamic_loss_scale_around_lookahead_is_refused_naming_lookahead_around_it(front_end):
  tx = jaxamp.dynamic_loss_scale(optax.lookahead(optax.adam(0.1), 2, 0.5))
  params = _params()
  state = tx.init(params)
  before = [np.asarray(x).copy() for x in jax.tree.leaves((params, state))]
  with pytest.raises(ValueError) as info:
    if front_end == "update":
      tx.update(_grads(0), state, params)
    else:
      jaxamp.apply_scaled_updates(tx, _grads(0), state, params)
  first_line = str(info.value).splitlines()[0]
  assert first_line.startswith("jaxamp: put optax.lookahead around the loss scaler")
  assert "optax.lookahead(jaxamp.dynamic_loss_scale(inner), sync_period, slow_step_size)" in (
    first_line
  )
  after = jax.tree.leaves((params, state))
  assert all(np.array_equal(a, b) for a, b in zip(before, after))  # nothing modified


def test_lookahead_around_dynamic_loss_scale_steps_as_plain_lookahead():
  # The fix the message names, at scale 1 with finite gradients: plain optax's steps.
  plain = optax.lookahead(optax.adam(0.1), 2, 0.5)
  scaled = optax.lookahead(jaxamp.dynamic_loss_scale(optax.adam(0.1), init_scale=1.0), 2, 0.5)
  p_plain, p_scaled = _params(), _params()
  s_plain, s_scaled = plain.init(p_plain), scaled.init(p_scaled)
  for step in range(5):  # two synchronisations
    u, s_plain = plain.update(_grads(step), s_plain, p_plain)
    p_plain = optax.apply_updates(p_plain, u)
    grads = _grads(step)  # of loss * scale, at scale 1
    u, s_scaled = scaled.update(grads, s_scaled, p_scaled)
    p_scaled = optax.apply_updates(p_scaled, u)
  # Within float32 rounding, not bit for bit: at a synchronisation XLA contracts
  # lookahead's arithmetic differently around a branch (docs/optax.md, scale 1).
  for a, b in zip(jax.tree.leaves(p_plain), jax.tree.leaves(p_scaled)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=0)
  assert float(jaxamp.get_loss_scale(s_scaled)) == 1.0


def test_apply_scaled_updates_with_lookahead_around_the_scaler_names_tx_update():
  # The right layout, but apply_scaled_updates cannot fuse lookahead's own step:
  # the message names the call that runs it (the test above shows it steps as optax).
  tx = optax.lookahead(jaxamp.dynamic_loss_scale(optax.adam(0.1)), 2, 0.5)
  params = _params()
  state = tx.init(params)
  before = [np.asarray(x).copy() for x in jax.tree.leaves((params, state))]
  with pytest.raises(ValueError) as info:
    jaxamp.apply_scaled_updates(tx, _grads(0), state, params)
  first_line = str(info.value).splitlines()[0]
  assert first_line.startswith("jaxamp.apply_scaled_updates:")
  assert "optax.lookahead around it" in first_line
  assert "tx.update(grads, opt_state, params)" in first_line
  assert "Make dynamic_loss_scale the outermost" not in str(info.value)
  after = jax.tree.leaves((params, state))
  assert all(np.array_equal(a, b) for a, b in zip(before, after))
