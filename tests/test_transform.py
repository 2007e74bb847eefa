"""Contract tests of ``dynamic_loss_scale``: jit, dtypes, composition, errors."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import bits, make_grads, needs_workaround

import jaxamp

PARAMS = {"w": jnp.arange(6.0).reshape(2, 3) / 7, "b": jnp.ones(3)}


GRADS = {"w": jnp.full((2, 3), 0.5), "b": jnp.linspace(-1, 1, 3)}


def _scaled_grads(scale_factor=1.0, inf=False, dtype=jnp.float32):
  """GRADS times ``scale_factor`` as ``dtype``; with ``inf``, b[1] is inf."""
  poison = ("b", 1, jnp.inf) if inf else None
  return make_grads(GRADS, scale=scale_factor, dtype=dtype, poison=poison)


@pytest.mark.parametrize(
  "inner",
  [optax.sgd(0.1), optax.sgd(0.1, momentum=0.9), optax.adam(1e-2), optax.adamw(1e-2)],
  ids=["sgd", "momentum", "adam", "adamw"],
)
def test_dynamic_loss_scale_keeps_inner_state_on_inf(inner):
  tx = jaxamp.dynamic_loss_scale(inner, init_scale=4.0)
  state = tx.init(PARAMS)
  update = jax.jit(tx.update)
  _, state = update(_scaled_grads(4.0), state, PARAMS)  # a real step first: non-trivial state
  before = bits(state.inner_state)
  updates, after = update(_scaled_grads(4.0, inf=True), state, PARAMS)
  assert bits(after.inner_state) == before
  assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
  assert bool(after.found_inf) and float(after.loss_scale) == 2.0


def test_dynamic_loss_scale_skipped_step_does_not_run_inner_update():
  calls = []

  def update_fn(updates, state, params=None):
    calls.append(1)
    return jax.debug.callback(lambda: calls.append("ran")) or updates, state

  tx = jaxamp.dynamic_loss_scale(optax.GradientTransformation(lambda p: (), update_fn))
  state = tx.init(PARAMS)
  jax.block_until_ready(jax.jit(tx.update)(_scaled_grads(inf=True), state, PARAMS))
  assert "ran" not in calls  # traced, but never executed: lax.cond picked skip
  jax.block_until_ready(jax.jit(tx.update)(_scaled_grads(), state, PARAMS))
  assert "ran" in calls


def test_dynamic_loss_scale_jit_no_recompile_and_no_host_sync():
  traces = []
  tx = jaxamp.dynamic_loss_scale(optax.adam(1e-3), init_scale=2.0**10, growth_interval=3)

  @jax.jit
  def train_step(params, opt_state, grads):
    traces.append(1)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params, state = PARAMS, tx.init(PARAMS)
  clean = jax.device_put(_scaled_grads(2.0**10))
  bad = jax.device_put(_scaled_grads(2.0**10, inf=True))
  params, state = train_step(params, state, clean)  # compile once
  with jax.transfer_guard("disallow"):
    for grads in [clean, bad, clean, clean, clean, bad, clean]:
      params, state = train_step(params, state, grads)
  assert len(traces) == 1
  assert float(state.loss_scale) == 2.0**9 and int(state.skipped_steps) == 2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_dynamic_loss_scale_updates_keep_grad_dtypes(dtype):
  params = jax.tree.map(lambda x: x.astype(dtype), PARAMS)
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0)
  state = tx.init(params)
  for inf in (False, True):
    updates, state = jax.jit(tx.update)(_scaled_grads(8.0, inf, dtype), state, params)
    assert all(u.dtype == dtype for u in jax.tree.leaves(updates))
    assert state.loss_scale.dtype == jnp.float32
  assert float(state.loss_scale) == 4.0


@pytest.mark.slow
def test_dynamic_loss_scale_low_precision_grads_with_float32_params():
  # optax.apply_if_finite fails here (its cond branches disagree on dtypes).
  tx = jaxamp.dynamic_loss_scale(optax.adam(1e-3), init_scale=8.0)
  state = tx.init(PARAMS)
  for dtype in (jnp.float16, jnp.bfloat16):
    for inf in (False, True):
      updates, state = jax.jit(tx.update)(_scaled_grads(8.0, inf, dtype), state, PARAMS)
      assert jax.tree.map(lambda u: u.shape, updates) == jax.tree.map(lambda p: p.shape, PARAMS)


def test_dynamic_loss_scale_none_leaves_pass_through():
  params = {"w": jnp.ones(3), "frozen": None}
  tx = jaxamp.dynamic_loss_scale(optax.sgd(1.0), init_scale=2.0)
  state = tx.init(params)
  updates, state = jax.jit(tx.update)({"w": jnp.full(3, 2.0), "frozen": None}, state, params)
  assert updates["frozen"] is None and updates["w"].tolist() == [-1.0] * 3


def test_dynamic_loss_scale_state_round_trips_through_tree_map_and_cond():
  tx = jaxamp.dynamic_loss_scale(optax.adam(1e-3), init_scale=3.0, growth_interval=5)
  state = tx.init(PARAMS)
  state = state._replace(
    loss_scale=jnp.float32(0.75),
    growth_tracker=jnp.int32(3),
    found_inf=jnp.bool_(True),
    skipped_steps=jnp.int32(9),
    consecutive_skipped_steps=jnp.int32(2),
    hysteresis_tracker=jnp.int32(4),
    update_count=jnp.int32(17),
    nonfinite_leaves=jnp.array([True, False]),
  )
  _, state = tx.update(_scaled_grads(0.75), state, PARAMS)  # non-default inner state too
  mapped = jax.tree.map(lambda x: x, state)
  assert type(mapped) is jaxamp.DynamicLossScaleState and bits(mapped) == bits(state)
  through_cond = jax.jit(lambda s: jax.lax.cond(True, lambda: s, lambda: s))(state)
  assert bits(through_cond) == bits(state)
  assert jax.tree.map(
    lambda x: (x.dtype, x.shape, getattr(x, "weak_type", False)), through_cond
  ) == (jax.tree.map(lambda x: (x.dtype, x.shape, getattr(x, "weak_type", False)), state))


def test_dynamic_loss_scale_forwards_extra_args():
  seen = {}

  def update_fn(updates, state, params=None, *, lr_scale):
    seen["lr_scale"] = lr_scale
    return jax.tree.map(lambda g: -lr_scale * g, updates), state

  tx = jaxamp.dynamic_loss_scale(
    optax.GradientTransformationExtraArgs(lambda p: (), update_fn), init_scale=2.0
  )
  updates, _ = tx.update(_scaled_grads(2.0), tx.init(PARAMS), PARAMS, lr_scale=3.0)
  assert seen["lr_scale"] == 3.0 and updates["w"].tolist() == [[-1.5] * 3] * 2


def test_dynamic_loss_scale_disabled_is_identity_scaler():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(1.0), init_scale=8.0, enabled=False, growth_factor=0.5)
  state = tx.init(PARAMS)
  assert float(jaxamp.get_loss_scale(state)) == 1.0
  updates, state = jax.jit(tx.update)(_scaled_grads(inf=True), state, PARAMS)
  assert np.isneginf(np.asarray(updates["b"])[1])  # applied as given, like torch
  assert float(state.loss_scale) == 1.0 and not bool(state.found_inf)


def test_dynamic_loss_scale_chain_clipping_sees_unscaled_grads():
  # docs/torch_semantics.md §5.10: scale 1024, p=[3,4], loss sum(p^2)/2: unscale_ -> [3, 4] ->
  # clip to norm 1 -> [0.6, 0.8] (torch: [0.5999999046325684, 0.7999998331069946])
  # -> step lr 1 -> params [2.4000000953674316, 3.200000286102295].
  tx = jaxamp.dynamic_loss_scale(
    optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0)), init_scale=1024.0
  )
  params = jnp.array([3.0, 4.0])
  state = tx.init(params)
  grads = jax.grad(lambda p: jaxamp.scale_loss(jnp.sum(p**2) / 2, state))(params)
  assert grads.tolist() == [3072.0, 4096.0]
  updates, state = jax.jit(tx.update)(grads, state, params)
  params = optax.apply_updates(params, updates)
  np.testing.assert_allclose(params, [2.4000000953674316, 3.200000286102295], rtol=1e-7)
  assert float(state.loss_scale) == 1024.0 and int(state.growth_tracker) == 1


@pytest.mark.slow
def test_dynamic_loss_scale_inside_inject_hyperparams():
  tx = optax.inject_hyperparams(jaxamp.dynamic_loss_scale)(
    optax.sgd(0.1), init_scale=3.0, growth_factor=1.5, backoff_factor=0.3, growth_interval=3
  )
  state = tx.init(PARAMS)
  update = jax.jit(tx.update)
  scales = []
  for inf in [0, 0, 0, 1, 0]:
    _, state = update(_scaled_grads(inf=bool(inf)), state, PARAMS)
    scales.append(float(jaxamp.get_loss_scale(state)))
  # docs/torch_semantics.md §5.2 (trajectory B); the factors arrive traced as float32: 1.5 exactly,
  # 0.3 as float32(0.3), whose product with 4.5 rounds to the same float32.
  assert scales == [3.0, 3.0, 4.5, 1.350000023841858, 1.350000023841858]
  # Changing a hyperparameter in the state takes effect without recompiling.
  state.hyperparams["backoff_factor"] = jnp.float32(0.5)
  _, state = update(_scaled_grads(inf=True), state, PARAMS)
  assert float(jaxamp.get_loss_scale(state)) == np.float32(1.350000023841858) / 2


@pytest.mark.slow
def test_dynamic_loss_scale_inject_hyperparams_with_float16_params():
  params16 = jax.tree.map(lambda x: x.astype(jnp.float16), PARAMS)
  tx = optax.inject_hyperparams(jaxamp.dynamic_loss_scale, hyperparam_dtype=jnp.float32)(
    optax.sgd(0.1)
  )
  state = tx.init(params16)
  assert float(jaxamp.get_loss_scale(state)) == 65536.0
  updates, state = jax.jit(tx.update)(_scaled_grads(dtype=jnp.float16), state, params16)
  assert all(u.dtype == jnp.float16 for u in jax.tree.leaves(updates))
  # Without hyperparam_dtype, optax casts init_scale=65536 to float16 (= inf).
  bad = optax.inject_hyperparams(jaxamp.dynamic_loss_scale)(optax.sgd(0.1))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)  # numpy: 65536 overflows float16
    with pytest.raises(TypeError, match="init_scale arrived as float16.*hyperparam_dtype"):
      bad.init(params16)


def test_dynamic_loss_scale_multisteps_keeps_scale_within_window():
  # MultiSteps outside: the scale changes once per optimizer step, as torch's
  # accumulate-then-step loop (scale(loss).backward() k times, one step/update).
  k = 3
  tx = optax.MultiSteps(
    jaxamp.dynamic_loss_scale(optax.sgd(1.0), init_scale=4.0, growth_interval=1), k
  )
  params = jnp.zeros(2)
  state = tx.init(params)
  update = jax.jit(tx.update)
  seen_scales = []
  micro_grads = [jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0]), jnp.array([5.0, 6.0])]
  for step in range(2):
    for g in micro_grads:
      scale = jaxamp.ops.find_loss_scale_state(state).loss_scale  # get_loss_scale refuses
      seen_scales.append(float(scale))
      updates, state = update(g * scale, state, params)
      params = optax.apply_updates(params, updates)
  assert seen_scales == [4.0] * 3 + [8.0] * 3
  # Two optimizer steps, each with the mean unscaled gradient [3, 4].
  assert params.tolist() == [-6.0, -8.0]


@pytest.mark.slow
def test_dynamic_loss_scale_multisteps_inf_in_one_micro_step_skips_the_window():
  tx = optax.MultiSteps(jaxamp.dynamic_loss_scale(optax.sgd(1.0), init_scale=4.0), 2)
  params = jnp.zeros(2)
  state = tx.init(params)
  for g in (jnp.array([jnp.inf, 1.0]), jnp.array([1.0, 1.0])):
    updates, state = jax.jit(tx.update)(g, state, params)
    params = optax.apply_updates(params, updates)
  assert params.tolist() == [0.0, 0.0]
  assert float(jaxamp.ops.find_loss_scale_state(state).loss_scale) == 2.0


@pytest.mark.slow
def test_dynamic_loss_scale_with_nnx_optimizer():
  from flax import nnx

  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(
    model, jaxamp.dynamic_loss_scale(optax.adam(1e-2), init_scale=256.0), wrt=nnx.Param
  )
  x = jnp.ones((4, 3))
  traces = []

  @nnx.jit
  def train_step(model, optimizer, x, poison):
    traces.append(1)

    def loss_fn(model):
      return jaxamp.scale_loss(jnp.mean(model(x) ** 2) * poison, optimizer.opt_state)

    grads = nnx.grad(loss_fn)(model)
    optimizer.update(model, grads)
    return jaxamp.get_loss_scale(optimizer.opt_state)

  kernel = np.asarray(model.kernel[...])
  assert float(train_step(model, optimizer, x, 1.0)) == 256.0
  moved = np.asarray(model.kernel[...])
  assert not np.array_equal(moved, kernel)
  assert float(train_step(model, optimizer, x, jnp.inf)) == 128.0
  assert np.array_equal(np.asarray(model.kernel[...]), moved)  # skipped
  assert float(jaxamp.get_loss_scale(optimizer)) == 128.0
  assert len(traces) == 1


@pytest.mark.slow
def test_dynamic_loss_scale_with_train_state():
  from flax.training import train_state

  state = train_state.TrainState.create(
    apply_fn=None, params=PARAMS, tx=jaxamp.dynamic_loss_scale(optax.sgd(0.5), init_scale=2.0)
  )
  state = jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, _scaled_grads(2.0))
  np.testing.assert_array_equal(state.params["w"], PARAMS["w"] - 0.25)
  state = jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, _scaled_grads(2.0, inf=True))
  np.testing.assert_array_equal(state.params["w"], PARAMS["w"] - 0.25)
  assert float(jaxamp.get_loss_scale(state)) == 1.0


def test_get_loss_scale_finds_state_anywhere():
  inner = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=512.0)
  holders = [
    inner,
    optax.chain(inner, optax.add_decayed_weights(1e-4)),
    optax.multi_transform({"a": inner, "b": optax.set_to_zero()}, {"w": "a", "b": "b"}),
    optax.inject_hyperparams(jaxamp.dynamic_loss_scale)(optax.sgd(0.1), init_scale=512.0),
    jaxamp.accumulate_gradients(inner, 4),
  ]
  for tx in holders:
    assert float(jaxamp.get_loss_scale(tx.init(PARAMS))) == 512.0


def test_get_loss_scale_errors_when_none_or_several():
  with pytest.raises(ValueError, match="found no DynamicLossScaleState"):
    jaxamp.get_loss_scale(optax.adam(1e-3).init(PARAMS))
  two = optax.chain(
    jaxamp.dynamic_loss_scale(optax.sgd(0.1)), jaxamp.dynamic_loss_scale(optax.sgd(0.1))
  )
  with pytest.raises(ValueError, match="found 2 DynamicLossScaleState"):
    jaxamp.get_loss_scale(two.init(PARAMS))


def test_scale_loss_multiplies_in_float32():
  state = jaxamp.dynamic_loss_scale(optax.sgd(0.1)).init(PARAMS)
  with pytest.warns(UserWarning, match="jaxamp: scale_loss got a float16 loss"):
    scaled = jaxamp.scale_loss(jnp.float16(2.0), state)
  assert scaled.dtype == jnp.float32 and float(scaled) == 131072.0  # float16 would be inf


@pytest.mark.parametrize(
  "kwargs,error,message",
  [
    ({"growth_factor": 1.0}, ValueError, r"The growth factor must be > 1\.0\."),
    ({"growth_factor": 1.0, "backoff_factor": 1.0}, ValueError, "The growth factor"),
    ({"growth_factor": float("nan")}, ValueError, "The growth factor"),
    ({"backoff_factor": 1.0}, ValueError, r"The backoff factor must be < 1\.0\."),
    ({"backoff_factor": 0.0}, ValueError, r"backoff factor must be > 0\.0"),
    ({"init_scale": 0.0}, ValueError, "init_scale must be a finite positive"),
    ({"init_scale": -2.0}, ValueError, "init_scale must be a finite positive"),
    ({"init_scale": float("inf")}, ValueError, "init_scale must be a finite positive"),
    ({"init_scale": 1e-46}, ValueError, r"float32: 0\.0"),
    ({"init_scale": 1e39}, ValueError, "without overflow"),
    ({"growth_interval": 2.5}, TypeError, "growth_interval must be an int"),
    ({"growth_interval": True}, TypeError, "growth_interval must be an int"),
    ({"growth_interval": jnp.float32(3)}, TypeError, "growth_interval must be an int"),
  ],
)
def test_dynamic_loss_scale_rejects_invalid_hyperparameters(kwargs, error, message):
  with pytest.raises(error, match=message):
    jaxamp.dynamic_loss_scale(optax.sgd(0.1), **kwargs)


@pytest.mark.slow
def test_dynamic_loss_scale_accepts_torch_edge_intervals():
  for interval in (0, -1, 2**40):
    tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0, growth_interval=interval)
    state = tx.init(PARAMS)
    for _ in range(3):
      _, state = tx.update(_scaled_grads(), state, PARAMS)
    assert float(state.loss_scale) == 8.0 and int(state.growth_tracker) == 3


@pytest.mark.parametrize(
  "bad,message",
  [
    ({"w": jnp.ones((2, 3), jnp.int32), "b": jnp.ones(3)}, r"leaf \['w'\] has dtype int32"),
    ({"w": jnp.ones((2, 3)), "b": jnp.ones(3, bool)}, r"leaf \['b'\] has dtype bool"),
    ({"w": jnp.ones((2, 3), jnp.complex64), "b": jnp.ones(3)}, "dtype complex64"),
  ],
)
def test_dynamic_loss_scale_rejects_non_float_grads(bad, message):
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1))
  with pytest.raises(TypeError, match=message):
    tx.update(bad, tx.init(PARAMS), PARAMS)


def test_dynamic_loss_scale_rejects_grads_of_another_tree():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1))
  with pytest.raises(ValueError, match="gradient tree does not match the parameter tree"):
    tx.update({"w": jnp.ones((2, 3))}, tx.init(PARAMS), PARAMS)
  # Without params (optax allows it), the leaf count is still checked.
  with pytest.raises(ValueError, match="gradient tree has 1 array leaves.*with 2"):
    tx.update({"w": jnp.ones((2, 3))}, tx.init(PARAMS))


@pytest.mark.slow
def test_dynamic_loss_scale_traced_hyperparameters_are_not_validated_but_work():
  def run(growth):
    tx = jaxamp.dynamic_loss_scale(
      optax.sgd(0.1), init_scale=2.0, growth_factor=growth, growth_interval=1
    )
    _, state = tx.update(_scaled_grads(), tx.init(PARAMS), PARAMS)
    return state.loss_scale

  assert float(jax.jit(run)(jnp.float32(1.5))) == 3.0


@needs_workaround("compile_cache")
def test_dynamic_loss_scale_update_outside_jit_compiles_once(backend_compiles):
  # Outside jit the whole update is jitted once per shapes: a lax.cond of
  # fresh closures would compile on every call (hundreds of ms a step).
  tx = jaxamp.dynamic_loss_scale(optax.adam(1e-3), init_scale=4.0)
  params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
  state = tx.init(params)
  grads = [{"w": jnp.full((3, 2), v), "b": jnp.ones(2)} for v in (1.0, jnp.inf, 2.0)]
  _, state = tx.update(grads[0], state, params)
  backend_compiles.clear()
  for g in grads[1:]:
    _, state = tx.update(g, state, params)
  assert backend_compiles == []
  assert int(state.skipped_steps) == 1 and float(state.loss_scale) == 2.0


def test_optax_form_skips_a_first_step_whose_update_widens_the_state():
  # optax's Adam under inject_hyperparams widens a bfloat16 parameter's moments
  # on its first update: the inner update returns other types than it takes
  # (no in-place loop can carry them). A skipped first step returns them typed
  # as an applied one would, the values untouched, and zero updates.
  params = {"w": jnp.array([1.0, -2.0], jnp.bfloat16), "norm": jnp.array([0.5, 3.0])}
  tx = jaxamp.dynamic_loss_scale(optax.inject_hyperparams(optax.adam)(1e-3), init_scale=4.0)
  state = tx.init(params)
  finite = {"w": jnp.array([8.0, -4.0], jnp.bfloat16), "norm": jnp.array([2.0, 6.0])}
  bad = {**finite, "w": jnp.array([jnp.inf, -4.0], jnp.bfloat16)}
  step = jax.jit(tx.update)
  applied_updates, applied = step(finite, state, params)
  updates, skipped = step(bad, state, params)
  assert bool(skipped.found_inf) and not bool(applied.found_inf)
  widened = [a.dtype != i.dtype for a, i in zip(*map(jax.tree.leaves, (applied, state)))]
  assert any(widened)  # the case this test is about
  for got, want in zip(jax.tree.leaves(updates), jax.tree.leaves(applied_updates)):
    assert got.dtype == want.dtype and not np.any(np.asarray(got, np.float32))
  leaves = map(jax.tree.leaves, (skipped.inner_state, applied.inner_state, state.inner_state))
  for got, typed, value in zip(*leaves):
    assert got.dtype == typed.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float64), np.asarray(value, np.float64))


@pytest.mark.slow
@pytest.mark.parametrize("nesting", ["vmap_of_jit", "checkify_of_vmap"])
def test_optax_form_under_vmap_applies_and_skips_each_member_as_alone(nesting):
  # A vmapped jitted update batches the step's loop; checkify cannot check a
  # batched loop, so a vmapped update traced under checkify takes a lax.cond.
  from jax.experimental import checkify

  tx = jaxamp.dynamic_loss_scale(optax.adam(1e-3), init_scale=4.0)
  params = {"w": jnp.array([1.0, -2.0, 3.0])}
  grads = {"w": jnp.array([[4.0, 8.0, -4.0], [jnp.inf, 1.0, 1.0]])}
  states = jax.vmap(tx.init)({"w": jnp.stack([params["w"]] * 2)})
  update = lambda g, s: tx.update(g, s, params)
  if nesting == "vmap_of_jit":
    batched = jax.vmap(jax.jit(update))(grads, states)
  else:
    err, batched = jax.jit(checkify.checkify(jax.vmap(update)))(grads, states)
    err.throw()
  for member in range(2):
    pick = lambda tree, m=member: jax.tree.map(lambda x: x[m], tree)
    assert bits(pick(batched)) == bits(jax.jit(update)(*pick((grads, states)))), member
