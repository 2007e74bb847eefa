"""jaxamp.flax_utils where Flax programs meet it: fp8 layers beside the scaler, one step
for float32 and float16 (``enabled=False``, ``scales_loss``), ``DynamicScale``'s
``axis_name``. Each compares with Flax, optax or ``jax.value_and_grad`` run live."""

import json
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT as FP8
from flax.nnx import bridge
from flax.training import train_state
from helpers import bits, compilation_cache_env

import jaxamp
from jaxamp import flax_utils

X = jax.random.normal(jax.random.key(0), (16, 4))
Y = X.sum(axis=1, keepdims=True)
# Per step, the factor on the targets: 1e4 makes the float16 backward overflow.
TARGETS = [1.0, 1.0, 1e4, 1.0, 1.0]
SKIPPED = [False, False, True, False, False]


def _fp8_dense(features):
  # float32 compute: Flax's fp8 dot in float16 overflows its float16 output
  # (docs/precision.md); the float16 layer after it is what the scaler is for.
  return nn.Dense(features, dtype=jnp.float32, dot_general_cls=nn.Fp8DirectDotGeneralOp)


class _LinenFp8(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(1, dtype=jnp.float16)(nn.relu(_fp8_dense(8)(x)))


def _linen_fp8_state(tx):
  model = _LinenFp8()
  variables = model.init(jax.random.key(1), X)
  return train_state.TrainState.create(apply_fn=model.apply, params=variables, tx=tx)


@jax.jit
def _linen_grads(state, factor):
  def loss_fn(variables):
    return jnp.mean((state.apply_fn(variables, X).astype(jnp.float32) - factor * Y) ** 2)

  return flax_utils.scaled_value_and_grad(loss_fn, state)(state.params)[1]


def _assert_same_step(ours, theirs):
  """fp8's state, the scale and the counters bit for bit; params and Adam's moments to
  the fused update's last bits (apply_scaled_updates; tests/test_flax_utils.py)."""
  assert bits(ours.params[FP8]) == bits(theirs.params[FP8])
  assert bits(jaxamp.ops.find_loss_scale_state(ours.opt_state)._replace(inner_state=None)) == bits(
    jaxamp.ops.find_loss_scale_state(theirs.opt_state)._replace(inner_state=None)
  )
  _assert_close(ours, theirs)


def _assert_close(ours, theirs):
  for x, y in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
    np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=1e-5)


def _finite(tree):
  return all(bool(jnp.isfinite(leaf).all()) for leaf in jax.tree.leaves(tree))


# ---------------------------------------------------------------- fp8


@pytest.mark.slow
def test_apply_gradients_fp8_state_written_as_flax_and_kept_on_a_skipped_step():
  state = _linen_fp8_state(jaxamp.dynamic_loss_scale(optax.adam(1e-2), init_scale=2.0**10))
  ours_step = jax.jit(flax_utils.apply_gradients)
  flax_step = jax.jit(lambda state, grads: state.apply_gradients(grads=grads))
  for factor, skipped in zip(TARGETS, SKIPPED):
    grads = _linen_grads(state, factor)
    ours, theirs = ours_step(state, grads=grads), flax_step(state, grads)
    assert bool(ours.opt_state.found_inf) == skipped
    if skipped:  # params, the optimizer's state and fp8's kept bit for bit
      assert bits(ours.params) == bits(state.params)
      assert bits(ours.opt_state.inner_state) == bits(state.opt_state.inner_state)
      assert not _finite(grads[FP8])  # Flax writes the inf into an amax history:
      assert not _finite(theirs.params[FP8])
    else:
      _assert_same_step(ours, theirs)
    state = ours
  assert _finite(state.params)
  assert float(state.opt_state.loss_scale) == 2.0**9


@pytest.mark.slow
def test_apply_gradients_fp8_disabled_scaler_matches_plain_train_state():
  ours = _linen_fp8_state(jaxamp.dynamic_loss_scale(optax.adam(1e-2), enabled=False))
  plain = _linen_fp8_state(optax.adam(1e-2))

  @jax.jit
  def plain_grads(state):
    def loss_fn(variables):
      return jnp.mean((state.apply_fn(variables, X).astype(jnp.float32) - Y) ** 2)

    return jax.grad(loss_fn)(state.params)

  for _ in range(3):
    grads = _linen_grads(ours, 1.0)
    assert bits(grads) == bits(plain_grads(plain))
    ours = jax.jit(flax_utils.apply_gradients)(ours, grads=grads)
    plain = jax.jit(lambda state, grads: state.apply_gradients(grads=grads))(
      plain, plain_grads(plain)
    )
    assert bits(ours.params) == bits(plain.params)
    assert bits(ours.opt_state.inner_state) == bits(plain.opt_state)


@pytest.mark.slow
def test_apply_gradients_fp8_within_an_accumulation_window_keeps_an_overflowing_micro_batch():
  tx = jaxamp.accumulate_gradients(jaxamp.dynamic_loss_scale(optax.adam(1e-2), init_scale=4.0), 2)
  state = _linen_fp8_state(tx)
  flax_step = jax.jit(lambda state, grads: state.apply_gradients(grads=grads))
  # windows: (clean, clean), (overflow, clean): skipped at its end, (clean, clean)
  kept = [False, False, True, True, False, False]
  for factor, keeps in zip([1.0, 1.0, 1e30, 1.0, 1.0, 1.0], kept):
    grads = _linen_grads(state, factor)
    ours, theirs = jax.jit(flax_utils.apply_gradients)(state, grads=grads), flax_step(state, grads)
    if keeps:  # the overflowing micro-batch, then the end of its window
      assert bits(ours.params[FP8]) == bits(state.params[FP8])
      assert bits(ours.params[FP8]) != bits(theirs.params[FP8])
    else:
      _assert_same_step(ours, theirs)
    state = ours
  assert int(state.opt_state.inner_state.skipped_steps) == 1
  assert _finite(state.params)


def _trained(model):
  return nnx.state(model, nnx.Any(nnx.Param, flax_utils.FP8_STATE))


class _NnxFp8(nnx.Module):
  def __init__(self):
    self.fp8 = bridge.ToNNX(_fp8_dense(8), rngs=nnx.Rngs(0))
    bridge.lazy_init(self.fp8, X)
    self.out = nnx.Linear(8, 1, dtype=jnp.float16, rngs=nnx.Rngs(1))

  def __call__(self, x):
    return self.out(nnx.relu(self.fp8(x)))


@nnx.jit(static_argnums=3)
def _nnx_fp8_step(model, optimizer, factor, ours):
  def loss_fn(model):
    return jnp.mean((model(X).astype(jnp.float32) - factor * Y) ** 2)

  with_fp8 = nnx.DiffState(0, nnx.Any(nnx.Param, flax_utils.FP8_STATE))
  _, grads = flax_utils.scaled_value_and_grad(loss_fn, optimizer, argnums=with_fp8)(model)
  if ours:
    flax_utils.update(optimizer, model, grads)
  else:  # NNX writes nothing of fp8's: the user writes it beside optimizer.update
    optimizer.update(model, grads)
    nnx.update(model, nnx.state(grads, flax_utils.FP8_STATE))


@pytest.mark.slow
def test_nnx_update_fp8_state_written_and_kept_on_a_skipped_step():
  tx = jaxamp.dynamic_loss_scale(optax.adam(1e-2), init_scale=2.0**10)
  (ours, ours_opt), (flax, flax_opt) = [
    (m, nnx.Optimizer(m, tx, wrt=nnx.Param)) for m in (_NnxFp8(), _NnxFp8())
  ]
  for factor, skipped in zip(TARGETS, SKIPPED):
    before = bits(_trained(ours))
    _nnx_fp8_step(ours, ours_opt, factor, True)
    _nnx_fp8_step(flax, flax_opt, factor, False)
    assert bool(ours_opt.opt_state.found_inf[...]) == skipped
    if skipped:
      assert bits(_trained(ours)) == before
      assert not _finite(nnx.state(flax, flax_utils.FP8_STATE))
      nnx.update(flax, _trained(ours))  # go on from the same point
    else:
      assert bits(nnx.state(ours, flax_utils.FP8_STATE)) == bits(
        nnx.state(flax, flax_utils.FP8_STATE)
      )
      _assert_close(nnx.state(ours, nnx.Param), nnx.state(flax, nnx.Param))
      _assert_close(nnx.state(ours_opt), nnx.state(flax_opt))


def test_nnx_update_refuses_an_optimizer_that_steps_fp8_state():
  model = _NnxFp8()
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Any(nnx.Param, flax_utils.FP8_STATE))
  grads = jax.tree.map(jnp.ones_like, nnx.state(model, optimizer.wrt))
  before = bits(_trained(model)), bits(nnx.state(optimizer))
  with pytest.raises(ValueError, match=r"^jaxamp: the optimizer's wrt selects fp8.*wrt=nnx.Param"):
    flax_utils.update(optimizer, model, grads)
  assert (bits(_trained(model)), bits(nnx.state(optimizer))) == before


# ---------------------------------------------------------------- one step, float32 and float16


def test_scales_loss_says_whether_a_scaler_is_on_for_every_holder():
  txs = {
    "on": jaxamp.dynamic_loss_scale(optax.sgd(0.1)),
    "off": jaxamp.dynamic_loss_scale(optax.sgd(0.1), enabled=False),
    "none": optax.sgd(0.1),
    "chained": optax.chain(jaxamp.dynamic_loss_scale(optax.sgd(0.1)), optax.identity()),
  }
  expected = {"on": True, "off": False, "none": False, "chained": True}
  for name, tx in txs.items():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    state = train_state.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=tx)
    for holder in (optimizer, state, state.opt_state):
      assert flax_utils.scales_loss(holder) is expected[name], (name, type(holder))
    # a Python bool inside jit too: the branch of a step is chosen as it is traced
    assert jax.jit(lambda s: jnp.int32(flax_utils.scales_loss(s)))(state) == expected[name]
  twice = optax.chain(
    jaxamp.dynamic_loss_scale(optax.sgd(0.1)), jaxamp.dynamic_loss_scale(optax.sgd(0.1))
  )
  with pytest.raises(ValueError, match="^jaxamp: found 2 DynamicLossScaleState"):
    flax_utils.scales_loss(twice.init({"w": jnp.ones(2)}))


class _LinenMlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(8, dtype=jnp.float16)(x))
    return nn.Dense(1, dtype=jnp.float16)(x)


@pytest.mark.slow
def test_disabled_scaler_steps_as_plain_flax_linen():
  model = _LinenMlp()
  params = model.init(jax.random.key(1), X)["params"]
  ours = train_state.TrainState.create(
    apply_fn=model.apply,
    params=params,
    tx=jaxamp.dynamic_loss_scale(optax.adam(1e-2), enabled=False),
  )
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))

  def loss_fn(params, state):
    return jnp.mean((state.apply_fn({"params": params}, X).astype(jnp.float32) - Y) ** 2)

  @jax.jit
  def ours_step(state):
    loss, grads = flax_utils.scaled_value_and_grad(loss_fn, state)(state.params, state)
    return loss, grads, flax_utils.apply_gradients(state, grads=grads)

  @jax.jit
  def plain_step(state):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, state)
    return loss, grads, state.apply_gradients(grads=grads)

  for _ in range(3):
    loss, grads, ours = ours_step(ours)
    plain_loss, plain_grads, plain = plain_step(plain)
    assert bits((loss, grads, ours.params)) == bits((plain_loss, plain_grads, plain.params))
    assert bits(ours.opt_state.inner_state) == bits(plain.opt_state)
  assert not flax_utils.scales_loss(ours) and float(jaxamp.get_loss_scale(ours)) == 1.0


@pytest.mark.slow
def test_disabled_scaler_steps_as_plain_flax_nnx():
  def build(tx):
    model = nnx.Linear(4, 1, dtype=jnp.float16, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  ours = build(jaxamp.dynamic_loss_scale(optax.adam(1e-2), enabled=False))
  plain = build(optax.adam(1e-2))

  def loss_fn(model):
    return jnp.mean((model(X).astype(jnp.float32) - Y) ** 2)

  @nnx.jit(static_argnums=2)
  def step(model, optimizer, jaxamp_helpers):
    if jaxamp_helpers:
      loss, grads = flax_utils.scaled_value_and_grad(loss_fn, optimizer)(model)
      flax_utils.update(optimizer, model, grads)
    else:
      loss, grads = nnx.value_and_grad(loss_fn)(model)
      optimizer.update(model, grads)
    return loss, grads

  for _ in range(3):
    assert bits(step(*ours, True)) == bits(step(*plain, False))
    assert bits(nnx.state(ours[0])) == bits(nnx.state(plain[0]))
    assert bits(nnx.as_pure(ours[1].opt_state.inner_state)) == bits(nnx.as_pure(plain[1].opt_state))


def test_helpers_without_a_scaler_name_enabled_false_and_change_nothing():
  model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
  state = train_state.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1))
  before = bits((nnx.state(model), nnx.state(optimizer), state))
  calls = {
    "update": lambda: flax_utils.update(optimizer, model, grads),
    "apply_gradients": lambda: flax_utils.apply_gradients(state, grads=state.params),
    "scaled_value_and_grad": lambda: flax_utils.scaled_value_and_grad(jnp.sum, state),
  }
  for name, call in calls.items():
    with pytest.raises(ValueError, match=rf"^jaxamp: flax_utils.{name} found no .*enabled=False"):
      call()
  assert bits((nnx.state(model), nnx.state(optimizer), state)) == before


# ---------------------------------------------------------------- axis_name

# Two host devices, in a fresh process (XLA_FLAGS must be set before JAX starts).
_AXIS_NAME_RUN = textwrap.dedent(
  """
  import json, sys
  import jax, jax.numpy as jnp, numpy as np, optax
  from flax.training import dynamic_scale, train_state
  from jax import lax
  from jax.sharding import PartitionSpec as P
  import jaxamp
  from jaxamp import flax_utils

  x = jnp.arange(16.0).reshape(2, 8) / 16  # one row of 8 per device
  params = {"w": jnp.linspace(-1.0, 1.0, 8)}

  def loss_fn(params, x, factor):  # as Flax's examples: float16 compute, float32 loss
    pred = x.astype(jnp.float16) * params["w"].astype(jnp.float16)
    return jnp.mean(pred.astype(jnp.float32) ** 2) * factor

  def state_of(tx):
    return train_state.TrainState.create(apply_fn=None, params=params, tx=tx)

  def train_step(state, x, factor):  # one step for float32 and float16
    loss, grads = flax_utils.scaled_value_and_grad(loss_fn, state, axis_name="batch")(
      state.params, x, factor)
    return flax_utils.apply_gradients(state, grads=grads), grads

  def plain_step(state, x, factor):  # Flax's float32 branch
    grads = lax.pmean(jax.grad(loss_fn)(state.params, x, factor), "batch")
    return state.apply_gradients(grads=grads), grads

  def flax_scaled_step(ds, p, x, factor):  # Flax's float16 branch
    ds, is_fin, _, grads = ds.value_and_grad(loss_fn, axis_name="batch")(p, x, factor)
    return ds, is_fin

  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("batch",))  # Auto axes

  def run(fn, how):  # fn once per device: its state replicated, x and factor split
    if how == "shard_map":
      return jax.jit(jax.shard_map(lambda s, x, k: fn(s, x[0], k[0]), mesh=mesh,
                                   in_specs=(P(), P("batch"), P("batch")), out_specs=P()))
    def call(*args):
      out = jax.pmap(fn, axis_name="batch", in_axes=(None, 0, 0))(*args)
      replicas.extend(len({np.asarray(a[i]).tobytes() for i in range(2)}) == 1
                      for a in jax.tree.leaves(out))
      return jax.tree.map(lambda a: a[0], out)
    return call

  out, replicas = {}, []
  factors = jnp.array([[1.0, 1.0], [1.0, jnp.inf], [1.0, 1.0]])  # inf on device 1 at step 1
  for how in ("pmap", "shard_map"):
    off = state_of(jaxamp.dynamic_loss_scale(optax.sgd(0.1), enabled=False))
    plain = state_of(optax.sgd(0.1))
    same = []
    for _ in range(2):
      off, g_off = run(train_step, how)(off, x, jnp.ones(2))
      plain, g_plain = run(plain_step, how)(plain, x, jnp.ones(2))
      same.append(np.asarray(g_off["w"]).tobytes() == np.asarray(g_plain["w"]).tobytes()
                  and np.asarray(off.params["w"]).tobytes() == np.asarray(plain.params["w"]).tobytes())
    on = state_of(jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=4.0))
    ds = dynamic_scale.DynamicScale(scale=4.0)
    skipped, flax_finite, scales = [], [], []
    for k in factors:
      on, _ = run(train_step, how)(on, x, k)
      ds, is_fin = run(lambda ds, x, k: flax_scaled_step(ds, params, x, k), how)(ds, x, k)
      skipped.append(bool(on.opt_state.found_inf))
      flax_finite.append(bool(is_fin))
      scales.append(float(on.opt_state.loss_scale))
    out[how] = {"same_as_plain": same, "skipped": skipped, "flax_finite": flax_finite,
                "scales": scales, "params_finite": bool(jnp.isfinite(on.params["w"]).all())}
  out["pmap_replicas_agree"] = all(replicas) and len(replicas) > 0
  json.dump(out, open(sys.argv[1], "w"))
  """
)


@pytest.mark.slow
def test_scaled_value_and_grad_axis_name_averages_as_dynamic_scale_under_pmap_and_shard_map(
  tmp_path,
):
  env = {
    **compilation_cache_env("flax_seams"),
    "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    "JAX_PLATFORMS": "cpu",
    "PYTHONPATH": str(__import__("pathlib").Path(__file__).resolve().parents[1]),
  }
  out = tmp_path / "out.json"
  run = subprocess.run(
    [sys.executable, "-c", _AXIS_NAME_RUN, str(out)],
    env=env,
    capture_output=True,
    check=False,
    text=True,
    timeout=300,
  )
  assert run.returncode == 0, run.stderr[-3000:]
  seen_by = json.loads(out.read_text())
  assert seen_by.pop("pmap_replicas_agree")
  for how, seen in seen_by.items():
    assert seen["same_as_plain"] == [True, True], how  # float32: jax.grad + lax.pmean's bits
    assert seen["skipped"] == [False, True, False], how  # both devices skip the inf on one
    assert seen["flax_finite"] == [True, False, True], how
    assert seen["scales"] == [4.0, 2.0, 2.0], how
    assert seen["params_finite"], how


def test_scaled_value_and_grad_axis_name_unbound_is_refused():
  state = train_state.TrainState.create(
    apply_fn=None, params={"w": jnp.ones(2)}, tx=jaxamp.dynamic_loss_scale(optax.sgd(0.1))
  )

  def step(state):
    loss_fn = lambda p: jnp.sum(p["w"])
    return flax_utils.scaled_value_and_grad(loss_fn, state, axis_name="batch")(state.params)

  with pytest.raises(ValueError, match=r"^jaxamp: axis_name='batch' is not bound here"):
    jax.jit(step)(state)


# ---------------------------------------------------------------- docs/precision.md


@pytest.mark.slow
def test_docs_precision_python_blocks_run(capsys):
  from test_docs import DOCS, python_blocks, shown_outputs

  path = DOCS / "precision.md"
  blocks, shown = python_blocks(path), shown_outputs(path)
  assert len(blocks) == len(shown) == 3 and all(shown)
  namespace = {"__name__": "docs_precision"}
  for number, (block, text) in enumerate(zip(blocks, shown), 1):
    capsys.readouterr()
    exec(compile(block, f"docs/precision.md (python block {number})", "exec"), namespace)  # noqa: S102
    assert capsys.readouterr().out == text, f"python block {number} prints another output"
  # the fp8 example: the overflowing step skipped, its inf kept out of fp8's state
  assert "step 1: skipped=True, fp8 state given finite=False, kept finite=True" in shown[2]
