"""Opt-in protections beyond torch: clamps, hysteresis, skip limit, diagnostics."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

PARAMS = {"encoder": {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}, "head": jnp.ones(3)}


def _grads(poison=None, value=1.0):
  grads = jax.tree.map(lambda p: jnp.full(p.shape, value), PARAMS)
  if poison == "encoder/b":
    grads["encoder"]["b"] = grads["encoder"]["b"].at[0].set(jnp.nan)
  elif poison == "head":
    grads["head"] = grads["head"].at[2].set(-jnp.inf)
  return grads


def _run(tx, flags, params=PARAMS):
  """Runs a jitted update per flag (True: inf in the grads); returns the states."""
  state = tx.init(params)
  update = jax.jit(tx.update)
  states = []
  for flag in flags:
    _, state = update(_grads("head" if flag else None), state, params)
    states.append(jaxamp.find_loss_scale_state(state))
  return states


def _deepspeed_reference(init, factor, window, hysteresis, consecutive, flags):
  """DeepSpeed's DynamicLossScaler.update_scale (runtime/fp16/loss_scaler.py),
  transcribed: scales after each update (power-of-two factor, so exact)."""
  scale, cur_hysteresis, last_overflow, scales = init, hysteresis, -1, []
  for it, overflow in enumerate(flags):
    if overflow:
      if hysteresis == 1 or cur_hysteresis == 1:
        scale = scale / factor
      else:
        cur_hysteresis -= 1
      last_overflow = it
    else:
      if consecutive:
        cur_hysteresis = hysteresis
      if (it - last_overflow) % window == 0:
        if not consecutive:
          cur_hysteresis = hysteresis
        scale *= factor
    scales.append(scale)
  return scales


FLAGS = [1, 1, 0, 1, 1, 1, 0, 0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
@pytest.mark.parametrize("consecutive", [False, True])
def test_dynamic_loss_scale_hysteresis_matches_deepspeed_step_by_step(hysteresis, consecutive):
  tx = jaxamp.dynamic_loss_scale(
      optax.sgd(0.1), init_scale=1024.0, growth_interval=3, hysteresis=hysteresis,
      consecutive_hysteresis=consecutive,
  )
  scales = [float(s.loss_scale) for s in _run(tx, FLAGS)]
  assert scales == _deepspeed_reference(1024.0, 2.0, 3, hysteresis, consecutive, FLAGS)


def test_dynamic_loss_scale_hysteresis_semantics_spelled_out():
  # hysteresis 2: the first overflow is absorbed (skipped, tracker reset, no
  # backoff), the second backs off; without consecutive_hysteresis the budget
  # refills only on growth, so a later single overflow backs off at once.
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=64.0, growth_interval=2, hysteresis=2)
  states = _run(tx, [1, 0, 1, 0, 0, 1])
  assert [float(s.loss_scale) for s in states] == [64.0, 64.0, 32.0, 32.0, 64.0, 64.0]
  assert [int(s.hysteresis_tracker) for s in states] == [1, 1, 1, 1, 2, 1]
  assert [bool(s.found_inf) for s in states] == [True, False, True, False, False, True]
  assert [int(s.growth_tracker) for s in states] == [0, 1, 0, 1, 0, 0]


def test_dynamic_loss_scale_min_loss_scale_floors_backoff():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0, min_loss_scale=2.0)
  assert [float(s.loss_scale) for s in _run(tx, [1, 1, 1, 1])] == [4.0, 2.0, 2.0, 2.0]
  # Without it the scale collapses (torch): 8 * 0.5**200 is 0.
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0)
  state = tx.init(PARAMS)
  for _ in range(200):
    _, state = jax.jit(tx.update)(_grads("head"), state, PARAMS)
  assert float(state.loss_scale) == 0.0


def test_dynamic_loss_scale_max_loss_scale_caps_growth():
  tx = jaxamp.dynamic_loss_scale(
      optax.sgd(0.1), init_scale=4.0, growth_interval=1, growth_factor=3.0, max_loss_scale=30.0
  )
  assert [float(s.loss_scale) for s in _run(tx, [0, 0, 0, 0])] == [12.0, 30.0, 30.0, 30.0]


def test_dynamic_loss_scale_counts_skipped_steps():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1))
  states = _run(tx, [1, 1, 0, 1, 0, 0])
  assert [int(s.skipped_steps) for s in states] == [1, 2, 2, 3, 3, 3]
  assert [int(s.consecutive_skipped_steps) for s in states] == [1, 2, 0, 1, 0, 0]
  assert [int(s.update_count) for s in states] == [1, 2, 3, 4, 5, 6]


def test_dynamic_loss_scale_max_consecutive_skips_raises_inside_jit():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0, max_consecutive_skips=3)
  state = tx.init(PARAMS)
  update = jax.jit(tx.update)
  for flag in [1, 1, 0, 1, 1]:  # never 3 in a row: no error
    _, state = update(_grads("head" if flag else None), state, PARAMS)
  jax.block_until_ready(state)
  assert int(state.consecutive_skipped_steps) == 2
  with pytest.raises(
      RuntimeError, match=r"(?s)3 consecutive optimizer steps were skipped.*update 6.*0\.25"
  ):
    jax.block_until_ready(update(_grads("head"), state, PARAMS))


def test_dynamic_loss_scale_detect_unscale_overflow():
  # docs/torch_semantics.md §3.2: bf16 3e38 at scale 0.5 becomes inf after unscaling; torch steps.
  params = {"w": jnp.ones(2, jnp.bfloat16)}
  grads = {"w": jnp.array([3e38, 1.0], jnp.bfloat16)}
  for detect, skipped in ((False, False), (True, True)):
    tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=0.5, detect_unscale_overflow=detect)
    updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
    assert bool(state.found_inf) == skipped
    assert bool(np.all(np.asarray(updates["w"], np.float32) == 0)) == skipped


def test_nonfinite_leaf_paths_names_the_leaves_of_the_last_skipped_step():
  tx = jaxamp.dynamic_loss_scale(optax.adam(1e-3))
  state = tx.init(PARAMS)
  update = jax.jit(tx.update)
  assert jaxamp.nonfinite_leaf_paths(state, PARAMS) == []
  _, state = update(_grads("encoder/b"), state, PARAMS)
  assert jaxamp.nonfinite_leaf_paths(state, PARAMS) == ["['encoder']['b']"]
  _, state = update(_grads(), state, PARAMS)  # a finite step keeps the last report
  assert jaxamp.nonfinite_leaf_paths(state, PARAMS) == ["['encoder']['b']"]
  _, state = update(_grads("head"), state, PARAMS)
  assert jaxamp.nonfinite_leaf_paths(state, PARAMS) == ["['head']"]
  with pytest.raises(ValueError, match="params has 1 leaves but the jaxamp state tracks 3"):
    jaxamp.nonfinite_leaf_paths(state, {"w": jnp.ones(2)})


def test_dynamic_loss_scale_options_inside_inject_hyperparams():
  tx = optax.inject_hyperparams(jaxamp.dynamic_loss_scale)(
      optax.sgd(0.1), init_scale=16.0, growth_interval=2, hysteresis=2,
      min_loss_scale=4.0, max_loss_scale=32.0, max_consecutive_skips=10,
  )
  flags = [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0]
  scales = [float(jaxamp.get_loss_scale(s)) for s in _states(tx, flags)]
  # hysteresis 2 absorbs the first overflow; then 8, 4, floor 4; growth caps at 32.
  assert scales == [16.0, 8.0, 4.0, 4.0, 4.0, 4.0, 8.0, 8.0, 16.0, 16.0, 32.0]


def _states(tx, flags):
  state = tx.init(PARAMS)
  update = jax.jit(tx.update)
  out = []
  for flag in flags:
    _, state = update(_grads("head" if flag else None), state, PARAMS)
    out.append(state)
  return out


def test_dynamic_loss_scale_defaults_are_torch():
  # The options off: torch's trajectory A (docs/torch_semantics.md §5.1) with inf at 4, 8, 9.
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0, growth_interval=3)
  scales = [float(s.loss_scale) for s in _run(tx, [i in (4, 8, 9) for i in range(16)])]
  assert scales == [8, 8, 16, 16, 8, 8, 8, 16, 8, 4, 4, 4, 8, 8, 8, 16]


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(min_loss_scale=8.0, max_loss_scale=4.0), ValueError, "must not be above"),
        (dict(min_loss_scale=0.0), ValueError, "min_loss_scale must be a finite positive"),
        (dict(max_loss_scale=float("inf")), ValueError, "max_loss_scale must be a finite"),
        (dict(max_loss_scale=1e39), ValueError, "max_loss_scale must be a finite"),
        (dict(init_scale=2.0, min_loss_scale=4.0), ValueError, "below min_loss_scale"),
        (dict(init_scale=64.0, max_loss_scale=4.0), ValueError, "above max_loss_scale"),
        (dict(hysteresis=0), ValueError, "hysteresis must be >= 1"),
        (dict(hysteresis=1.5), TypeError, "hysteresis must be an int"),
        (dict(max_consecutive_skips=0), ValueError, "max_consecutive_skips must be >= 1"),
        (dict(max_consecutive_skips=True), TypeError, "max_consecutive_skips must be an int"),
    ],
)
def test_dynamic_loss_scale_rejects_inconsistent_options(kwargs, error, message):
  with pytest.raises(error, match=message):
    jaxamp.dynamic_loss_scale(optax.sgd(0.1), **kwargs)
