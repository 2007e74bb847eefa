"""Reading the scale from an optimizer state: ``get_loss_scale``, ``scale_loss`` and
the placements of ``dynamic_loss_scale`` they refuse (issue #30)."""

import copy
import pickle

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from flax.training import train_state
from helpers import bits

import jaxamp

PARAMS = {"w": jnp.ones(3), "b": jnp.ones(2)}


def _scaler(init_scale=8.0):
  return jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=init_scale)


def _readers():
  """get_loss_scale and scale_loss, eagerly and jitted."""
  return {
    "get_loss_scale": jaxamp.get_loss_scale,
    "get_loss_scale-jit": jax.jit(jaxamp.get_loss_scale),
    "scale_loss": lambda s: jaxamp.scale_loss(jnp.float32(1.0), s),
    "scale_loss-jit": jax.jit(lambda s: jaxamp.scale_loss(jnp.float32(1.0), s)),
  }


ACCEPTED = {
  "bare": _scaler,
  "first-in-chain": lambda: optax.chain(_scaler(), optax.add_decayed_weights(1e-4)),
  "first-in-nested-chain": lambda: optax.chain(optax.chain(_scaler()), optax.identity()),
  "inject_hyperparams": lambda: optax.inject_hyperparams(jaxamp.dynamic_loss_scale)(
    optax.sgd(0.1), init_scale=8.0
  ),
  "accumulate_gradients": lambda: jaxamp.accumulate_gradients(_scaler(), 2),
  "multi_transform": lambda: optax.multi_transform(
    {"a": _scaler(), "b": optax.set_to_zero()}, {"w": "a", "b": "b"}
  ),
}

REFUSED = {
  "clip-in-front": (
    lambda: optax.chain(optax.clip_by_global_norm(1.0), _scaler()),
    (
      r"^jaxamp: a transformation is chained in front of dynamic_loss_scale.*"
      r"dynamic_loss_scale\(optax.chain\(transformation, optimizer\)\)"
    ),
  ),
  "stateful-in-front-under-accumulation": (
    lambda: jaxamp.accumulate_gradients(optax.chain(optax.trace(0.9), _scaler()), 2),
    r"^jaxamp: a transformation is chained in front of dynamic_loss_scale",
  ),
  "MultiSteps-around": (
    lambda: optax.MultiSteps(_scaler(), 2),
    (
      r"^jaxamp: optax.MultiSteps is around dynamic_loss_scale.*"
      r"jaxamp.accumulate_gradients\(jaxamp.dynamic_loss_scale\(inner\), k\)"
    ),
  ),
  "stacked": (
    lambda: jaxamp.dynamic_loss_scale(_scaler()),
    r"^jaxamp: a dynamic_loss_scale is wrapped inside another.*one dynamic_loss_scale only",
  ),
  "stacked-deep": (
    lambda: jaxamp.dynamic_loss_scale(optax.chain(optax.sgd(0.1), _scaler())),
    r"^jaxamp: a dynamic_loss_scale is wrapped inside another",
  ),
}


@pytest.mark.parametrize("placement", ACCEPTED)
def test_get_loss_scale_reads_scale_where_scaler_sees_grads_as_given(placement):
  state = ACCEPTED[placement]().init(PARAMS)
  for name, read in _readers().items():
    assert float(read(state)) == 8.0, name


@pytest.mark.parametrize("placement", REFUSED)
def test_get_loss_scale_refuses_scaler_that_does_not_see_grads_as_given(placement):
  make, message = REFUSED[placement]
  state = make().init(PARAMS)
  before = bits(state)
  for name, read in _readers().items():
    with pytest.raises(ValueError, match=message):
      read(state)
    assert bits(state) == before, name


@pytest.mark.parametrize("placement", ["clip-in-front", "MultiSteps-around", "stacked"])
def test_get_loss_scale_refuses_misplaced_scaler_in_nnx_optimizer_and_train_state(placement):
  make, message = REFUSED[placement]
  model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, make(), wrt=nnx.Param)
  state = train_state.TrainState.create(
    apply_fn=None, params=nnx.state(model, nnx.Param), tx=make()
  )
  for holder in (optimizer, optimizer.opt_state, state):
    with pytest.raises(ValueError, match=message):
      jaxamp.get_loss_scale(holder)
    with pytest.raises(ValueError, match=message):
      jaxamp.scale_loss(jnp.float32(1.0), holder)


def test_get_loss_scale_clip_in_front_would_clip_scaled_gradients():
  """Why the refusal: the clip in front sees the gradients times the scale, so the
  update is not the one of the same clip inside (the supported placement)."""
  grads = jax.tree.map(lambda p: 1024.0 * 0.5 * p, PARAMS)  # scaled by 1024
  inside = jaxamp.dynamic_loss_scale(
    optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0)), init_scale=1024.0
  )
  in_front = optax.chain(
    optax.clip_by_global_norm(1.0), jaxamp.dynamic_loss_scale(optax.sgd(1.0), init_scale=1024.0)
  )
  want, _ = inside.update(grads, inside.init(PARAMS), PARAMS)
  got, _ = in_front.update(grads, in_front.init(PARAMS), PARAMS)
  assert bits(got) != bits(want)
  with pytest.raises(ValueError, match="chained in front"):
    jaxamp.get_loss_scale(in_front.init(PARAMS))


def test_get_loss_scale_read_outside_jit_survives_a_donating_step():
  tx = _scaler()
  state = tx.init(PARAMS)

  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  donating = jax.jit(step, donate_argnums=(0, 1))
  scale = jaxamp.get_loss_scale(state)
  params, state = donating(
    jax.tree.map(jnp.copy, PARAMS), state, jax.tree.map(jnp.ones_like, PARAMS)
  )
  assert state.loss_scale.is_deleted() is False
  assert float(scale) == 8.0  # the buffer read before the step is not the donated one
  scale = jaxamp.get_loss_scale(state)
  donating(params, state, jax.tree.map(jnp.ones_like, PARAMS))
  assert float(scale) == 8.0


def test_get_loss_scale_inside_jit_is_the_traced_value_itself():
  state = _scaler().init(PARAMS)
  jaxpr = jax.make_jaxpr(jaxamp.get_loss_scale)(state)
  assert jaxpr.eqns == []  # no copy: the output is the input
  assert jaxpr.jaxpr.outvars[0] in jaxpr.jaxpr.invars


def test_injected_scaler_init_state_can_be_donated():
  """``optax.inject_hyperparams(jaxamp.dynamic_loss_scale)``'s initial state holds
  no buffer twice (its loss_scale was the injected init_scale's own array, so a
  jitted step donating the state failed: "Attempt to donate the same buffer twice")."""
  tx = optax.inject_hyperparams(jaxamp.dynamic_loss_scale, hyperparam_dtype=jnp.float32)(
    optax.sgd(0.1), init_scale=8.0, hysteresis=2
  )
  state = tx.init(PARAMS)
  pointers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(state)]
  assert len(set(pointers)) == len(pointers)

  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  donating = jax.jit(step, donate_argnums=(0, 1))
  _, state = donating(jax.tree.map(jnp.copy, PARAMS), state, jax.tree.map(jnp.ones_like, PARAMS))
  assert float(jaxamp.get_loss_scale(state)) == 8.0


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_injected_scaler_state_copy_is_accepted_by_its_transformation(how):
  """A deep copy or a pickle of an ``inject_hyperparams(dynamic_loss_scale)`` state
  updates as the state itself (the copy's ``<injected>`` placeholders used to differ
  from the transformation's: "this state was made by ... another configuration")."""
  tx = optax.inject_hyperparams(jaxamp.dynamic_loss_scale, hyperparam_dtype=jnp.float32)(
    optax.sgd(0.1), init_scale=8.0
  )
  state = tx.init(PARAMS)
  copied = copy.deepcopy(state) if how == "deepcopy" else pickle.loads(pickle.dumps(state))
  grads = jax.tree.map(jnp.ones_like, PARAMS)
  assert bits(tx.update(grads, copied, PARAMS)) == bits(tx.update(grads, state, PARAMS))
