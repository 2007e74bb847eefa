"""jaxamp.flax_utils in NNX (nnx.Optimizer, nnx.jit) and linen (TrainState, jax.jit) steps."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from helpers import bits

import jaxamp
from jaxamp import flax_utils

DTYPES = [jnp.float16, jnp.bfloat16, jnp.float32]
X = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(4, 3)
Y = jnp.array([0, 1, 1, 0])


class _NnxMlp(nnx.Module):
  def __init__(self, dtype, rngs):
    self.hidden = nnx.Linear(3, 5, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
    self.out = nnx.Linear(5, 2, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)

  def __call__(self, x):
    return self.out(jax.nn.relu(self.hidden(x)))


class _LinenMlp(nn.Module):
  dtype: jnp.dtype

  @nn.compact
  def __call__(self, x):
    x = jax.nn.relu(nn.Dense(5, dtype=self.dtype, param_dtype=jnp.float32)(x))
    return nn.Dense(2, dtype=self.dtype, param_dtype=jnp.float32)(x)


def _cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()


def _nnx_loss(model, x, y):
  return _cross_entropy(model(x), y)


def _nnx_setup(dtype=jnp.float32, tx=None):
  model = _NnxMlp(dtype, nnx.Rngs(0))
  tx = tx if tx is not None else jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0)
  return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def _linen_state(dtype=jnp.float32, tx=None):
  model = _LinenMlp(dtype)
  params = model.init(jax.random.key(0), X)["params"]
  tx = tx if tx is not None else jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0)
  return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def _linen_loss_fn(state):
  def loss_fn(params, x, y):
    return _cross_entropy(state.apply_fn({"params": params}, x), y)

  return loss_fn


# ---------------------------------------------------------------- values


@pytest.mark.slow
def test_scaled_value_and_grad_returns_unscaled_loss_and_scaled_grads_nnx():
  model, optimizer = _nnx_setup()
  loss, grads = flax_utils.scaled_value_and_grad(_nnx_loss, optimizer)(model, X, Y)
  expected_loss, plain_grads = nnx.value_and_grad(_nnx_loss)(model, X, Y)
  assert loss.dtype == jnp.float32
  assert loss == expected_loss
  # Scaling by a power of two is exact in float32: the grads are exactly 8x.
  for got, plain in zip(jax.tree.leaves(grads), jax.tree.leaves(plain_grads)):
    np.testing.assert_array_equal(got, 8.0 * plain)


@pytest.mark.slow
def test_scaled_value_and_grad_returns_unscaled_loss_and_scaled_grads_linen():
  state = _linen_state()
  loss_fn = _linen_loss_fn(state)
  loss, grads = flax_utils.scaled_value_and_grad(loss_fn, state)(state.params, X, Y)
  expected_loss, plain_grads = jax.value_and_grad(loss_fn)(state.params, X, Y)
  assert loss == expected_loss
  for got, plain in zip(jax.tree.leaves(grads), jax.tree.leaves(plain_grads)):
    np.testing.assert_array_equal(got, 8.0 * plain)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_value_and_grad_matches_hand_scaled_loss_low_precision(dtype):
  model, optimizer = _nnx_setup(dtype)
  _, grads = flax_utils.scaled_value_and_grad(_nnx_loss, optimizer)(model, X, Y)
  hand = nnx.grad(lambda m: _nnx_loss(m, X, Y) * jnp.float32(8.0))(model)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(hand)):
    assert got.dtype == jnp.float32  # float32 params get float32 grads
    np.testing.assert_array_equal(got, want)


def test_scaled_value_and_grad_returns_aux_and_differentiates_argnums():
  state = _linen_state()

  def loss_fn(x, params):
    logits = state.apply_fn({"params": params}, x)
    return _cross_entropy(logits, Y), {"logits": logits}

  fn = flax_utils.scaled_value_and_grad(loss_fn, state, argnums=1, has_aux=True)
  (loss, aux), grads = fn(X, state.params)
  assert aux["logits"].shape == (4, 2)
  assert loss == _cross_entropy(aux["logits"], Y)
  assert jax.tree.structure(grads) == jax.tree.structure(state.params)


@pytest.mark.slow
def test_scaled_value_and_grad_accepts_bfloat16_loss():
  model, optimizer = _nnx_setup(jnp.bfloat16)

  def loss_fn(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

  loss, grads = flax_utils.scaled_value_and_grad(loss_fn, optimizer)(model, X, Y)
  assert loss.dtype == jnp.bfloat16
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


def test_scaled_value_and_grad_accepts_bare_optax_state():
  params = {"w": jnp.array([1.0, 2.0])}
  opt_state = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=4.0).init(params)
  loss, grads = flax_utils.scaled_value_and_grad(lambda p: jnp.sum(p["w"] ** 2), opt_state)(params)
  assert loss == 5.0
  np.testing.assert_array_equal(grads["w"], [8.0, 16.0])


# ---------------------------------------------------------------- jit, no recompile


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_value_and_grad_nnx_jit_traces_once(dtype):
  model, optimizer = _nnx_setup(dtype)
  traces = []

  @nnx.jit
  def train_step(model, optimizer, x, y):
    traces.append(1)
    loss, grads = flax_utils.scaled_value_and_grad(_nnx_loss, optimizer)(model, x, y)
    optimizer.update(model, grads)
    return loss, flax_utils.loss_scale_metrics(optimizer)

  losses = []
  for _ in range(4):
    expected = _nnx_loss(model, X, Y)
    loss, metrics = train_step(model, optimizer, X, Y)
    # unscaled (a scaled loss would be 8x); jit may fuse low-precision math differently
    np.testing.assert_allclose(loss, expected, rtol=1e-3)
    losses.append(float(loss))
  assert len(traces) == 1
  assert losses[-1] < losses[0]  # the updates were applied
  assert metrics["loss_scale"].dtype == jnp.float32
  assert int(optimizer.step[...]) == 4


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_value_and_grad_linen_jit_traces_once(dtype):
  state = _linen_state(dtype)
  traces = []

  @jax.jit
  def train_step(state, x, y):
    traces.append(1)
    loss_fn = _linen_loss_fn(state)
    loss, grads = flax_utils.scaled_value_and_grad(loss_fn, state)(state.params, x, y)
    state = state.apply_gradients(grads=grads)
    return state, loss, flax_utils.loss_scale_metrics(state)

  losses = []
  for _ in range(4):
    expected = _linen_loss_fn(state)(state.params, X, Y)
    state, loss, metrics = train_step(state, X, Y)
    # unscaled (a scaled loss would be 8x); jit may fuse low-precision math differently
    np.testing.assert_allclose(loss, expected, rtol=1e-3)
    losses.append(float(loss))
  assert len(traces) == 1
  assert losses[-1] < losses[0]
  assert int(state.step) == 4
  assert int(metrics["skipped_steps"]) == 0


@pytest.mark.slow
def test_scaled_value_and_grad_reads_the_current_scale_under_jit():
  # growth_interval=1 doubles the scale every step; lr 0 keeps the params fixed,
  # so each step's grads must be exactly twice the previous step's.
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.0), init_scale=8.0, growth_interval=1)
  model, optimizer = _nnx_setup(jnp.float32, tx)

  @nnx.jit
  def train_step(model, optimizer, x, y):
    _, grads = flax_utils.scaled_value_and_grad(_nnx_loss, optimizer)(model, x, y)
    optimizer.update(model, grads)
    return grads, flax_utils.loss_scale_metrics(optimizer)["loss_scale"]

  grads1, scale1 = train_step(model, optimizer, X, Y)
  grads2, scale2 = train_step(model, optimizer, X, Y)
  assert (float(scale1), float(scale2)) == (16.0, 32.0)
  for g1, g2 in zip(jax.tree.leaves(grads1), jax.tree.leaves(grads2)):
    np.testing.assert_array_equal(g2, 2.0 * g1)


# ---------------------------------------------------------------- metrics


@pytest.mark.slow
def test_loss_scale_metrics_reports_a_skipped_step_nnx():
  model, optimizer = _nnx_setup(
    jnp.float16,
    jaxamp.dynamic_loss_scale(optax.sgd(0.1)),  # scale 65536
  )
  kernel_before = np.asarray(model.hidden.kernel[...])

  @nnx.jit
  def train_step(model, optimizer, x, y):
    _, grads = flax_utils.scaled_value_and_grad(_nnx_loss, optimizer)(model, x, y)
    optimizer.update(model, grads)
    return flax_utils.loss_scale_metrics(optimizer)

  metrics = train_step(model, optimizer, 1e4 * X, Y)  # float16 grads overflow
  assert {k: v.item() for k, v in metrics.items()} == {
    "loss_scale": 32768.0,
    "skipped": True,
    "skipped_steps": 1,
    "consecutive_skipped_steps": 1,
  }
  np.testing.assert_array_equal(model.hidden.kernel[...], kernel_before)
  assert int(optimizer.step[...]) == 1  # nnx counts the skipped update too

  metrics = train_step(model, optimizer, X, Y)
  assert not metrics["skipped"]
  assert int(metrics["skipped_steps"]) == 1
  assert int(metrics["consecutive_skipped_steps"]) == 0
  assert int(optimizer.step[...]) == 2


def test_loss_scale_metrics_dtypes_and_shapes_linen():
  metrics = flax_utils.loss_scale_metrics(_linen_state())
  assert {k: (v.dtype, v.shape) for k, v in metrics.items()} == {
    "loss_scale": (jnp.float32, ()),
    "skipped": (jnp.bool_, ()),
    "skipped_steps": (jnp.int32, ()),
    "consecutive_skipped_steps": (jnp.int32, ()),
  }


def test_loss_scale_metrics_read_outside_jit_survive_a_donating_step():
  """Issue #31, item 5: the metrics read between two steps that donate the state
  stay readable (they were the state's own buffers, deleted by the donation)."""
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0)
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  step = jax.jit(lambda s, g: tx.update(g, s, params)[1], donate_argnums=0)
  state = step(state, {"w": jnp.array([1.0, jnp.inf, 1.0])})  # skipped: scale 4
  metrics = flax_utils.loss_scale_metrics(state)
  own = state.loss_scale
  step(state, {"w": jnp.ones(3)})
  assert own.is_deleted()  # control: the donation deleted the state's buffers
  assert {k: v.item() for k, v in metrics.items()} == {
    "loss_scale": 4.0,
    "skipped": True,
    "skipped_steps": 1,
    "consecutive_skipped_steps": 1,
  }


# ---------------------------------------------------------------- fast update paths

# Added to the scaled grads, step by step: 0 leaves them as they are.
POISON = [0.0, 0.0, np.inf, 0.0, np.nan, -np.inf, 0.0, 0.0, 0.0]


def _adam_tx():
  return jaxamp.dynamic_loss_scale(optax.adam(1e-2), init_scale=2.0**10, growth_interval=2)


def _poisoned(grads, poison):
  return jax.tree.map(lambda g: g + poison.astype(g.dtype), grads)


def _assert_same_update(ours, flax_own, skipped, before):
  """Scale state and counters bitwise; params/moments to XLA's fusion noise."""
  ours_scale, theirs_scale = (
    jaxamp.ops.find_loss_scale_state(x)._replace(inner_state=None) for x in (ours[1], flax_own[1])
  )
  assert bits(ours_scale) == bits(theirs_scale)
  if skipped:  # the params and Adam's moments are left exactly as they were
    assert bits(ours[0]) == bits(before)
  for x, y in zip(jax.tree.leaves(ours), jax.tree.leaves(flax_own)):
    np.testing.assert_allclose(
      np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=1e-5, atol=1e-7
    )


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_update_matches_nnx_optimizer_update(dtype):
  models = [_nnx_setup(dtype, _adam_tx()) for _ in range(2)]

  @nnx.jit(static_argnums=4)
  def train_step(model, optimizer, poison, x, fast):
    _, grads = flax_utils.scaled_value_and_grad(_nnx_loss, optimizer)(model, x, Y)
    grads = _poisoned(grads, poison)
    if fast:
      flax_utils.update(optimizer, model, grads)
    else:
      optimizer.update(model, grads)

  for i, poison in enumerate(POISON):
    x = X * (1.0 + i / 4)
    before = nnx.state(models[0][0], nnx.Param)
    before = jax.tree.map(np.asarray, before)
    train_step(*models[0], jnp.float32(poison), x, True)
    train_step(*models[1], jnp.float32(poison), x, False)
    (m0, o0), (m1, o1) = models
    _assert_same_update(
      (nnx.state(m0, nnx.Param), nnx.as_pure(o0.opt_state)),
      (nnx.state(m1, nnx.Param), nnx.as_pure(o1.opt_state)),
      skipped=poison != 0.0,
      before=before,
    )
    assert int(o0.step[...]) == int(o1.step[...]) == i + 1
  assert int(o0.opt_state.skipped_steps[...]) == 3


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_gradients_matches_train_state_apply_gradients(dtype):
  # step as an int32 array from the start (TrainState.create gives a Python
  # int, which would make the second call a second trace in either path).
  states = [_linen_state(dtype, _adam_tx()).replace(step=jnp.int32(0)) for _ in range(2)]

  def train_step(state, poison, x, fast):
    _, grads = flax_utils.scaled_value_and_grad(_linen_loss_fn(state), state)(state.params, x, Y)
    grads = _poisoned(grads, poison)
    if fast:
      return flax_utils.apply_gradients(state, grads=grads)
    return state.apply_gradients(grads=grads)

  steps = [
    jax.jit(lambda s, p, x: train_step(s, p, x, True), donate_argnums=0),
    jax.jit(lambda s, p, x: train_step(s, p, x, False)),
  ]
  for i, poison in enumerate(POISON):
    x = X * (1.0 + i / 4)
    before = jax.tree.map(np.asarray, states[0].params)
    states = [step(s, jnp.float32(poison), x) for step, s in zip(steps, states)]
    _assert_same_update(
      (states[0].params, states[0].opt_state),
      (states[1].params, states[1].opt_state),
      skipped=poison != 0.0,
      before=before,
    )
    assert int(states[0].step) == int(states[1].step) == i + 1
  assert int(states[0].opt_state.skipped_steps) == 3
  assert steps[0]._cache_size() == 1


@pytest.mark.slow
def test_apply_gradients_replaces_extra_fields_and_overwrites_with_gradient():
  from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT

  class _State(train_state.TrainState):
    note: jax.Array

  params = {"params": {"w": jnp.ones(2)}, OVERWRITE_WITH_GRADIENT: {"amax": jnp.zeros(3)}}
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.5), init_scale=4.0)
  state = _State.create(apply_fn=None, params=params, tx=tx, note=jnp.int32(0))
  grads = {"params": {"w": jnp.array([2.0, -2.0])}, OVERWRITE_WITH_GRADIENT: {"amax": jnp.ones(3)}}
  ours = flax_utils.apply_gradients(state, grads=grads, note=jnp.int32(7))
  theirs = state.apply_gradients(grads=grads, note=jnp.int32(7))
  assert jax.tree.structure(ours) == jax.tree.structure(theirs)
  for x, y in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
    np.testing.assert_array_equal(x, y)
  assert ours.params["params"]["w"].tolist() == [0.75, 1.25]
  assert ours.params[OVERWRITE_WITH_GRADIENT]["amax"].tolist() == [1.0, 1.0, 1.0]
  assert int(ours.note) == 7


@pytest.mark.slow
def test_apply_gradients_with_donated_state_compiles_without_copies():
  shapes = [(64, 33), (37,), (8, 8, 3)]
  params = {f"p{i}": jnp.ones(s) for i, s in enumerate(shapes)}
  state = train_state.TrainState.create(apply_fn=None, params=params, tx=_adam_tx())
  step = jax.jit(lambda s, g: flax_utils.apply_gradients(s, grads=g), donate_argnums=0)
  hlo = step.lower(state, params).compile().as_text()
  sizes = {f"f32[{','.join(map(str, s))}]" for s in shapes}
  copies = [
    line
    for line in hlo.splitlines()
    if " copy(" in line and any(f"= {size}" in line for size in sizes)
  ]
  # (tests/test_performance_properties.py shows this check does see the copies
  # of a crosswise donation.)
  assert copies == []


def test_flax_utils_fast_paths_reject_optimizers_without_jaxamp_state_or_behind_multisteps():
  model, optimizer = _nnx_setup(tx=optax.adam(1e-3))
  grads = nnx.state(model, nnx.Param)
  with pytest.raises(ValueError, match="found no DynamicLossScaleState"):
    flax_utils.update(optimizer, model, grads)
  state = _linen_state(tx=optax.sgd(0.1))
  with pytest.raises(ValueError, match="found no DynamicLossScaleState"):
    flax_utils.apply_gradients(state, grads=state.params)
  state = _linen_state(tx=optax.MultiSteps(_adam_tx(), 2))
  with pytest.raises(ValueError, match="optax.MultiSteps around it"):
    flax_utils.apply_gradients(state, grads=state.params)


# ---------------------------------------------------------------- bad input


def test_scaled_value_and_grad_rejects_optimizer_without_jaxamp_state():
  _, optimizer = _nnx_setup(tx=optax.adam(1e-3))
  with pytest.raises(ValueError, match="found no DynamicLossScaleState"):
    flax_utils.scaled_value_and_grad(_nnx_loss, optimizer)


def test_loss_scale_metrics_rejects_state_without_jaxamp_state():
  with pytest.raises(ValueError, match="found no DynamicLossScaleState"):
    flax_utils.loss_scale_metrics(_linen_state(tx=optax.sgd(0.1)))


def test_scaled_value_and_grad_rejects_non_scalar_loss():
  model, optimizer = _nnx_setup()

  def loss_fn(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y)

  with pytest.raises(ValueError, match=r"must be a scalar, got shape \(4,\).*jnp.mean"):
    flax_utils.scaled_value_and_grad(loss_fn, optimizer)(model, X, Y)


def test_scaled_value_and_grad_rejects_integer_loss():
  params = {"w": jnp.ones(2)}
  opt_state = jaxamp.dynamic_loss_scale(optax.sgd(0.1)).init(params)
  with pytest.raises(TypeError, match="dtype int32; it must be a floating-point"):
    flax_utils.scaled_value_and_grad(lambda p: jnp.int32(3), opt_state)(params)


@pytest.mark.slow
def test_scaled_value_and_grad_rejects_float16_loss_with_fix():
  model, optimizer = _nnx_setup(jnp.float16)

  def loss_fn(model, x, y):  # the cross-entropy computed on float16 logits
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

  with pytest.raises(TypeError, match=r"loss is float16.*logits.astype\(jnp.float32\)"):
    flax_utils.scaled_value_and_grad(loss_fn, optimizer)(model, X, Y)


def test_scaled_value_and_grad_float16_loss_really_overflows_at_the_default_scale():
  # Why the float16 loss is refused: the gradient seed is the scale in float16.
  grad = jax.grad(lambda w: (w.astype(jnp.float16) * 2).astype(jnp.float32) * 65536.0)
  assert jnp.isinf(grad(jnp.float32(1.0)))


def test_scaled_value_and_grad_rejects_tuple_without_has_aux():
  model, optimizer = _nnx_setup()

  def loss_fn(model, x, y):
    return _nnx_loss(model, x, y), {"n": 4}

  with pytest.raises(TypeError, match="returned a tuple.*pass has_aux=True"):
    flax_utils.scaled_value_and_grad(loss_fn, optimizer)(model, X, Y)


def test_scaled_value_and_grad_rejects_missing_aux():
  model, optimizer = _nnx_setup()
  with pytest.raises(TypeError, match=r"has_aux=True the loss function must return \(loss, aux\)"):
    flax_utils.scaled_value_and_grad(_nnx_loss, optimizer, has_aux=True)(model, X, Y)


def test_scaled_value_and_grad_rejects_optimizer_captured_outside_jit():
  model, optimizer = _nnx_setup()
  grad_fn = flax_utils.scaled_value_and_grad(_nnx_loss, optimizer)  # outside the step

  @nnx.jit
  def train_step(model, optimizer, x, y):
    _, grads = grad_fn(model, x, y)
    optimizer.update(model, grads)

  with pytest.raises(ValueError, match="captured from outside the jitted function"):
    train_step(model, optimizer, X, Y)


def test_scaled_value_and_grad_rejects_train_state_captured_outside_jit():
  state = _linen_state()
  grad_fn = flax_utils.scaled_value_and_grad(_linen_loss_fn(state), state)
  with pytest.raises(ValueError, match="captured from outside the jitted function"):
    jax.jit(grad_fn)(state.params, X, Y)
