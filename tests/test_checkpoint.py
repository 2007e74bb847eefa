"""torch-format state dicts (GradScaler and optax form), torch interop and orbax."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import torch
from flax import nnx
from helpers import bits

import jaxamp

HYPER = {"growth_factor": 1.5, "backoff_factor": 0.3, "growth_interval": 3}
FIRST, SECOND = [0, 0, 0, 1, 0], [0, 0, 1, 0, 0, 0]
LR = 2.0**-6  # a power of two: the SGD update is one rounding in both frameworks
# docs/torch_semantics.md §6.44, measured on torch 2.13.
AFTER_FIRST = {"scale": 1.350000023841858, **HYPER, "_growth_tracker": 1}
AFTER_SECOND = {"scale": 0.9112499952316284, **HYPER, "_growth_tracker": 0}
KEYS = ["scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"]


def _scaled_grads(params, scale, flag):
  """The same scaled gradients for both frameworks: f32(2 p) * f32(scale), inf injected."""
  grads = (np.float32(2.0) * np.asarray(params, np.float32)) * np.float32(scale)
  if flag:
    grads[0] = np.inf
  return grads


def _torch_run(scaler, param, flags):
  optimizer = torch.optim.SGD([param], lr=LR)
  for flag in flags:
    scaler.scale(torch.tensor(1.0))
    param.grad = torch.from_numpy(_scaled_grads(param.detach().numpy(), scaler.get_scale(), flag))
    scaler.step(optimizer)
    scaler.update()


def _jax_run(scaler, opt, flags):
  for flag in flags:
    scaler.scale(jnp.float32(1.0))
    opt.grads = jnp.asarray(_scaled_grads(opt.params, scaler.get_scale(), flag))
    scaler.step(opt)
    scaler.update()


def _optax_run(tx, params, state, flags):
  for flag in flags:
    grads = jnp.asarray(_scaled_grads(params, jaxamp.get_loss_scale(state), flag))
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def _torch_save_load(state_dict, tmp_path):
  path = tmp_path / "scaler.pt"
  torch.save(state_dict, path)
  return torch.load(path)


def _start():
  return np.array([0.5, 0.25], np.float32)


@pytest.mark.slow
@pytest.mark.torch
def test_grad_scaler_resumes_from_torch_state_dict_matches_torch(tmp_path):
  t_scaler = torch.amp.GradScaler("cpu", init_scale=3.0, **HYPER)
  t_param = torch.nn.Parameter(torch.from_numpy(_start()))
  _torch_run(t_scaler, t_param, FIRST)
  saved = t_scaler.state_dict()
  assert saved == AFTER_FIRST and list(saved) == KEYS
  loaded = _torch_save_load(saved, tmp_path)

  scaler = jaxamp.GradScaler()
  scaler.load_state_dict(loaded)
  assert scaler.get_scale() == 1.350000023841858  # before its first scale(), as torch
  assert scaler.state_dict() == AFTER_FIRST
  opt = jaxamp.Optimizer(optax.sgd(LR), jnp.asarray(t_param.detach().numpy().copy()))
  _jax_run(scaler, opt, SECOND)
  _torch_run(t_scaler, t_param, SECOND)
  assert t_scaler.state_dict() == AFTER_SECOND
  assert scaler.state_dict() == AFTER_SECOND
  assert np.asarray(opt.params).tobytes() == t_param.detach().numpy().tobytes()


@pytest.mark.slow
@pytest.mark.torch
def test_torch_resumes_from_grad_scaler_state_dict_matches_torch(tmp_path):
  scaler = jaxamp.GradScaler(init_scale=3.0, **HYPER)
  opt = jaxamp.Optimizer(optax.sgd(LR), jnp.asarray(_start()))
  _jax_run(scaler, opt, FIRST)
  saved = scaler.state_dict()
  assert saved == AFTER_FIRST and list(saved) == KEYS
  assert [type(v) for v in saved.values()] == [float, float, float, int, int]

  t_scaler = torch.amp.GradScaler("cpu")
  t_scaler.load_state_dict(_torch_save_load(saved, tmp_path))
  t_param = torch.nn.Parameter(torch.from_numpy(np.asarray(opt.params).copy()))
  _torch_run(t_scaler, t_param, SECOND)
  _jax_run(scaler, opt, SECOND)
  assert scaler.state_dict() == t_scaler.state_dict() == AFTER_SECOND
  assert np.asarray(opt.params).tobytes() == t_param.detach().numpy().tobytes()


@pytest.mark.slow
@pytest.mark.torch
def test_optax_state_resumes_from_torch_state_dict_matches_torch(tmp_path):
  t_scaler = torch.amp.GradScaler("cpu", init_scale=3.0, **HYPER)
  t_param = torch.nn.Parameter(torch.from_numpy(_start()))
  _torch_run(t_scaler, t_param, FIRST)
  loaded = _torch_save_load(t_scaler.state_dict(), tmp_path)

  tx = jaxamp.dynamic_loss_scale(optax.sgd(LR), **HYPER)
  params = jnp.asarray(t_param.detach().numpy().copy())
  state = jaxamp.load_state_dict(tx.init(params), loaded, **HYPER)
  assert jaxamp.state_dict(state, **HYPER) == AFTER_FIRST
  params, state = _optax_run(tx, params, state, SECOND)
  _torch_run(t_scaler, t_param, SECOND)
  assert jaxamp.state_dict(state, **HYPER) == t_scaler.state_dict() == AFTER_SECOND
  assert np.asarray(params).tobytes() == t_param.detach().numpy().tobytes()


@pytest.mark.torch
def test_torch_resumes_from_optax_state_dict_matches_torch(tmp_path):
  tx = jaxamp.dynamic_loss_scale(optax.sgd(LR), init_scale=3.0, **HYPER)
  params = jnp.asarray(_start())
  params, state = _optax_run(tx, params, tx.init(params), FIRST)
  saved = jaxamp.state_dict(state, **HYPER)
  assert saved == AFTER_FIRST and list(saved) == KEYS

  t_scaler = torch.amp.GradScaler("cpu")
  t_scaler.load_state_dict(_torch_save_load(saved, tmp_path))
  t_param = torch.nn.Parameter(torch.from_numpy(np.asarray(params).copy()))
  _torch_run(t_scaler, t_param, SECOND)
  params, state = _optax_run(tx, params, state, SECOND)
  assert jaxamp.state_dict(state, **HYPER) == t_scaler.state_dict() == AFTER_SECOND
  assert np.asarray(params).tobytes() == t_param.detach().numpy().tobytes()


def test_grad_scaler_load_state_dict_into_used_scaler():
  """docs/torch_semantics.md §6.45: the values replace the scaler's; the stages are kept."""
  scaler = jaxamp.GradScaler(init_scale=100.0)
  scaler.scale(jnp.float32(1.0))
  scaler.load_state_dict(
    {
      "scale": 0.1,
      "growth_factor": 3.0,
      "backoff_factor": 0.25,
      "growth_interval": 7,
      "_growth_tracker": 5,
    }
  )
  assert scaler.get_scale() == 0.10000000149011612
  assert scaler.state_dict() == {
    "scale": 0.10000000149011612,
    "growth_factor": 3.0,
    "backoff_factor": 0.25,
    "growth_interval": 7,
    "_growth_tracker": 5,
  }


GOOD = {
  "scale": 2.0,
  "growth_factor": 2.0,
  "backoff_factor": 0.5,
  "growth_interval": 10,
  "_growth_tracker": 3,
}


@pytest.mark.parametrize(
  "bad, error, match",
  [
    (
      {},
      RuntimeError,
      "The source state dict is empty, possibly because it was saved from a disabled",
    ),
    ({"scale": 2.0}, KeyError, "growth_factor"),
    ({**GOOD, "extra": 1}, ValueError, "unexpected state dict keys"),
    ({**GOOD, "scale": "2.0"}, TypeError, "'scale' must be a real Python number"),
    ({**GOOD, "scale": True}, TypeError, "'scale' must be a real Python number"),
    ({**GOOD, "growth_interval": 2.5}, TypeError, "'growth_interval' must be an int"),
    ({**GOOD, "_growth_tracker": 1.0}, TypeError, "'_growth_tracker' must be an int"),
    (
      {**GOOD, "scale": 1e39},
      RuntimeError,
      "value cannot be converted to type float without overflow",
    ),
    (
      {**GOOD, "_growth_tracker": 2**31},
      RuntimeError,
      "value cannot be converted to type int without overflow",
    ),
    ({**GOOD, "_growth_tracker": -(2**31) - 1}, RuntimeError, "type int without overflow"),
    ([("scale", 2.0)], TypeError, "must be a mapping"),
    # torch loads these; a NaN or zero scale then skips (or zeroes) every later step.
    *[
      ({**GOOD, "scale": bad}, ValueError, "scale must be a finite positive number")
      for bad in (float("nan"), float("inf"), -float("inf"), 0.0, -2.0, 1e-50)
    ],
  ],
)
def test_load_state_dict_bad_input_raises_and_loads_nothing(bad, error, match):
  scaler = jaxamp.GradScaler(init_scale=8.0)
  scaler.scale(jnp.float32(1.0))
  before = scaler.state_dict()
  with pytest.raises(error, match=match):
    scaler.load_state_dict(bad)
  assert scaler.state_dict() == before  # torch would have applied "scale" already

  state = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0).init(jnp.ones(2))
  with pytest.raises(error, match=match):
    jaxamp.load_state_dict(state, bad)


def test_load_state_dict_accepts_numpy_numbers_and_extremes():
  values = {
    "scale": np.float64(0.1),
    "growth_factor": np.float32(2.0),
    "backoff_factor": 0.5,
    "growth_interval": np.int64(10),
    "_growth_tracker": 2**31 - 1,
  }
  scaler = jaxamp.GradScaler()
  scaler.load_state_dict(values)
  saved = scaler.state_dict()
  assert saved == {
    "scale": 0.1,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 10,
    "_growth_tracker": 2**31 - 1,
  }
  assert [type(v) for v in saved.values()] == [float, float, float, int, int]
  scaler.scale(jnp.float32(1.0))
  assert scaler.get_scale() == 0.10000000149011612


def test_load_state_dict_checks_given_hyperparameters():
  state = jaxamp.dynamic_loss_scale(optax.sgd(0.1), growth_interval=10).init(jnp.ones(2))
  with pytest.raises(ValueError, match="growth_factor=1.5 but the optimizer uses 2.0"):
    jaxamp.load_state_dict(state, GOOD, growth_factor=1.5)
  loaded = jaxamp.load_state_dict(state, GOOD, growth_factor=2.0, growth_interval=10)
  assert jaxamp.state_dict(loaded, growth_interval=10) == GOOD


@pytest.mark.parametrize("front", ["load", "save"])
def test_checkpoint_functions_refuse_hyperparameters_not_in_use(front):
  # The state records what its transformation was built with: a dict (or a
  # keyword) with other values would continue the run with other hyperparameters.
  state = jaxamp.dynamic_loss_scale(optax.sgd(0.1), growth_factor=3.0).init(jnp.ones(2))
  before = jax.tree.leaves(state)
  with pytest.raises(ValueError, match="growth_factor=2.0 but the optimizer uses 3.0"):
    if front == "load":
      jaxamp.load_state_dict(state, GOOD)
    else:
      jaxamp.state_dict(state, growth_factor=2.0)
  assert jax.tree.leaves(state) == before
  assert jaxamp.state_dict(state)["growth_factor"] == 3.0


def test_state_dict_records_the_hyperparameters_of_inject_hyperparams():
  tx = optax.inject_hyperparams(jaxamp.dynamic_loss_scale)(
    optax.sgd(0.1), growth_factor=3.0, growth_interval=10
  )
  state = tx.init(jnp.ones(2))
  state.hyperparams["growth_interval"] = jnp.asarray(7)
  saved = jaxamp.state_dict(state)
  assert (saved["growth_factor"], saved["growth_interval"]) == (3.0, 7)
  with pytest.raises(ValueError, match="growth_interval=10 but the optimizer uses 7"):
    jaxamp.load_state_dict(state, {**saved, "growth_interval": 10})


def test_state_dict_refuses_an_unrecordable_array_hyperparameter():
  state = jaxamp.dynamic_loss_scale(optax.sgd(0.1), growth_factor=jnp.float32(3.0)).init(
    jnp.ones(2)
  )
  with pytest.raises(ValueError, match="growth_factor was given to dynamic_loss_scale as an array"):
    jaxamp.state_dict(state)


def test_load_state_dict_keeps_other_fields_and_structure():
  tx = optax.chain(
    optax.add_decayed_weights(1e-4),
    jaxamp.dynamic_loss_scale(optax.adam(0.1), growth_interval=10),
  )
  params = {"w": jnp.array([1.0, 2.0])}
  state = tx.init(params)
  _, state = tx.update({"w": jnp.array([jnp.inf, 1.0])}, state, params)
  loaded = jaxamp.load_state_dict(state, GOOD)
  assert jax.tree.structure(loaded) == jax.tree.structure(state)
  old, new = jaxamp.ops.find_loss_scale_state(state), jaxamp.ops.find_loss_scale_state(loaded)
  assert float(new.loss_scale) == 2.0 and int(new.growth_tracker) == 3
  assert new.loss_scale.dtype == jnp.float32 and new.growth_tracker.dtype == jnp.int32
  assert int(new.skipped_steps) == int(old.skipped_steps) == 1
  assert bool(new.found_inf)
  assert jax.tree.leaves(new.inner_state) == jax.tree.leaves(old.inner_state)


def test_load_state_dict_takes_the_state_not_its_holder():
  model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, jaxamp.dynamic_loss_scale(optax.sgd(0.1)), wrt=nnx.Param)
  with pytest.raises(TypeError, match="optimizer.opt_state"):
    jaxamp.load_state_dict(optimizer, GOOD)


def test_load_state_dict_keeps_nnx_variables():
  model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), growth_interval=10)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  loaded = jaxamp.load_state_dict(optimizer.opt_state, GOOD)
  assert jax.tree.structure(loaded) == jax.tree.structure(optimizer.opt_state)
  field = jaxamp.ops.find_loss_scale_state(loaded).loss_scale
  assert type(field) is type(jaxamp.ops.find_loss_scale_state(optimizer.opt_state).loss_scale)
  assert isinstance(field, nnx.Variable)
  optimizer.opt_state = loaded
  assert jaxamp.state_dict(optimizer, growth_interval=10) == GOOD


def _nnx_model_and_optimizer():
  model = nnx.Sequential(
    nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(8, 2, rngs=nnx.Rngs(1))
  )
  tx = jaxamp.dynamic_loss_scale(optax.adam(1e-2), init_scale=2.0**10, growth_interval=2)
  return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


@nnx.jit
def _nnx_step(model, optimizer, x, y, inject):
  def loss_fn(model):
    return jaxamp.scale_loss(jnp.mean((model(x) - y) ** 2), optimizer)

  grads = nnx.grad(loss_fn)(model)
  grads = jax.tree.map(lambda g: g * inject, grads)
  optimizer.update(model, grads)


@pytest.mark.slow
def test_orbax_checkpoint_of_nnx_optimizer_resumes_bit_identically(tmp_path):
  rng = np.random.default_rng(0)
  batches = [
    (
      jnp.asarray(rng.normal(size=(5, 4)), jnp.float32),
      jnp.asarray(rng.normal(size=(5, 2)), jnp.float32),
    )
    for _ in range(8)
  ]
  injections = [jnp.float32(v) for v in (1, jnp.inf, 1, 1, 1, jnp.nan, 1, 1)]

  model, optimizer = _nnx_model_and_optimizer()
  for (x, y), inject in zip(batches[:4], injections[:4]):
    _nnx_step(model, optimizer, x, y, inject)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(
    tmp_path / "ckpt", {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
  )
  checkpointer.wait_until_finished()
  for (x, y), inject in zip(batches[4:], injections[4:]):
    _nnx_step(model, optimizer, x, y, inject)

  # A fresh process would rebuild the objects abstractly and restore from disk.
  abstract_model, abstract_optimizer = nnx.eval_shape(_nnx_model_and_optimizer)
  model_def, model_state = nnx.split(abstract_model)
  optimizer_def, optimizer_state = nnx.split(abstract_optimizer)
  restored = checkpointer.restore(
    tmp_path / "ckpt", {"model": model_state, "optimizer": optimizer_state}
  )
  checkpointer.close()
  model2 = nnx.merge(model_def, restored["model"])
  optimizer2 = nnx.merge(optimizer_def, restored["optimizer"])
  saved = jaxamp.state_dict(optimizer2, growth_interval=2)
  # 1024 (tracker 1); inf: 512; 512 (tracker 1); grown: 1024 (tracker 0).
  assert saved["scale"] == 1024.0 and saved["_growth_tracker"] == 0
  assert isinstance(jaxamp.ops.find_loss_scale_state(optimizer2).loss_scale, nnx.Variable)
  for (x, y), inject in zip(batches[4:], injections[4:]):
    _nnx_step(model2, optimizer2, x, y, inject)

  assert bits(nnx.state((model2, optimizer2))) == bits(nnx.state((model, optimizer)))
  assert len(bits(nnx.state((model2, optimizer2)))) > 10
  final = jaxamp.state_dict(optimizer2, growth_interval=2)
  assert final == jaxamp.state_dict(optimizer, growth_interval=2)
  # 1024 (tracker 1); nan: 512; 512 (tracker 1); grown: 1024 (tracker 0).
  assert (final["scale"], final["_growth_tracker"]) == (1024.0, 0)
