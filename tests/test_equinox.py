"""Equinox as a client: whole modules (non-array leaves), None gradients (frozen
parameters, ``eqx.filter_grad``), and GradScaler/Optimizer through
``eqx.filter_jit`` and ``eqx.partition``."""

import copy
import pathlib
import pickle
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

eqx = pytest.importorskip("equinox")  # an optional extra, as flax
from helpers import bits
from test_docs import shown_outputs

import jaxamp

X = jnp.asarray(np.random.default_rng(0).normal(size=(8, 3)), jnp.float32)


def _mlp(seed=0):
  """Two linear layers and two activation functions (non-array leaves)."""
  return eqx.nn.MLP(3, 2, 4, 1, activation=jax.nn.tanh, key=jax.random.key(seed))


def _loss(model):
  return jnp.mean(jax.vmap(model)(X) ** 2)


def _trainable_spec(model):
  """Only the last layer trains (Equinox's frozen-layer example)."""
  spec = jax.tree.map(lambda _: False, model)
  return eqx.tree_at(lambda m: (m.layers[-1].weight, m.layers[-1].bias), spec, replace=(True, True))


def _frozen_grads(model, scale):
  """eqx.filter_grad of the scaled loss over the trainable part: None elsewhere."""
  diff, static = eqx.partition(model, _trainable_spec(model))

  @eqx.filter_grad
  def grad(diff):
    return _loss(eqx.combine(diff, static)) * scale

  return grad(diff)


def _reference_sgd(grads, scale, lr=0.1):
  """optax.sgd's updates from the unscaled gradients (the scale is a power of
  two: dividing is exact), None gradients passed through as optax does."""
  unscaled = jax.tree.map(lambda g: g / scale, grads)
  return optax.sgd(lr).update(unscaled, optax.sgd(lr).init(unscaled))[0]


def _array_bits(tree):
  return bits(eqx.filter(tree, eqx.is_array))


@pytest.mark.parametrize("with_params", [True, False])
def test_dynamic_loss_scale_inits_on_a_whole_equinox_module(with_params):
  model = _mlp()
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0)
  state = tx.init(model)  # activation functions among the leaves, as optax.sgd takes
  grads = eqx.filter_grad(lambda m: _loss(m) * 8.0)(model)
  assert [g for g in jax.tree.leaves(grads, is_leaf=lambda x: x is None) if g is None]
  updates, state = tx.update(grads, state, model if with_params else None)
  assert bits(updates) == bits(_reference_sgd(grads, 8.0))
  new = eqx.apply_updates(model, updates)
  assert new.activation is model.activation
  assert not bool(state.found_inf)


@pytest.mark.parametrize("init_with", ["whole", "filtered", "trainable"])
@pytest.mark.parametrize("with_params", [True, False])
def test_dynamic_loss_scale_frozen_parameters_get_no_update(init_with, with_params):
  model = _mlp()
  params = {
    "whole": model,
    "filtered": eqx.filter(model, eqx.is_array),
    "trainable": eqx.filter(model, _trainable_spec(model)),
  }[init_with]
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=4.0)
  state = tx.init(params)
  grads = _frozen_grads(model, 4.0)
  if init_with == "filtered" and not with_params:
    # Two None leaves are frozen arrays and two are functions; without params
    # the state cannot tell which: a clear error naming the fix.
    with pytest.raises(ValueError, match=r"^jaxamp: the gradient tree has 2 array leaves and 4"):
      tx.update(grads, state)
    return
  updates, state = tx.update(grads, state, params if with_params else None)
  assert bits(updates) == bits(_reference_sgd(grads, 4.0))
  new = eqx.apply_updates(model, updates)
  assert _array_bits(new.layers[0]) == _array_bits(model.layers[0])  # frozen: as it was
  assert _array_bits(new.layers[1]) != _array_bits(model.layers[1])


def test_dynamic_loss_scale_adam_on_the_trainable_part_steps_and_skips():
  """Equinox's frozen-layer pattern with Adam: the state is initialised on the
  trainable part, so optax's moments are None where the gradients are."""
  model = _mlp()
  spec = _trainable_spec(model)
  tx = jaxamp.dynamic_loss_scale(optax.adam(1e-2), init_scale=4.0)
  state = tx.init(eqx.filter(model, spec))
  reference = optax.adam(1e-2)
  ref_state = reference.init(eqx.filter(model, spec))
  grads = _frozen_grads(model, 4.0)
  updates, state = tx.update(grads, state, eqx.filter(model, spec))
  # Jitted, as jaxamp's update is: XLA's fusion moves Adam's last bit eagerly.
  ref_updates, ref_state = jax.jit(reference.update)(
    jax.tree.map(lambda g: g / 4.0, grads), ref_state, eqx.filter(model, spec)
  )
  assert bits(updates) == bits(ref_updates)
  assert bits(state.inner_state) == bits(ref_state)
  bad = eqx.tree_at(lambda g: g.layers[-1].bias, grads, replace=jnp.full(2, jnp.inf))
  _, skipped = tx.update(bad, state, eqx.filter(model, spec))
  assert bool(skipped.found_inf) and float(skipped.loss_scale) == 2.0
  assert bits(skipped.inner_state) == bits(state.inner_state)
  assert jaxamp.ops.nonfinite_leaf_paths(skipped, eqx.filter(model, spec)) == [".layers[1].bias"]


@pytest.mark.parametrize("form", ["whole", "filtered"])
def test_nonfinite_leaf_paths_names_the_leaf_of_an_equinox_module(form):
  model = _mlp()
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1))
  state = tx.init(model if form == "whole" else eqx.filter(model, eqx.is_array))
  grads = eqx.filter_grad(_loss)(model)
  grads = eqx.tree_at(lambda g: g.layers[0].weight, grads, replace=grads.layers[0].weight * jnp.nan)
  _, state = tx.update(grads, state, model)
  # Either form of the module names the same leaf, the functions never.
  for params in (model, eqx.filter(model, eqx.is_array)):
    assert jaxamp.ops.nonfinite_leaf_paths(state, params) == [".layers[0].weight"]


@pytest.mark.parametrize("jit", [False, True])
def test_apply_scaled_updates_on_a_module_with_frozen_parameters(jit):
  model = _mlp()
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=4.0)
  state = tx.init(model)
  grads = _frozen_grads(model, 4.0)
  step = eqx.filter_jit(jaxamp.apply_scaled_updates) if jit else jaxamp.apply_scaled_updates
  new, state = step(tx, grads, state, model)
  expected = eqx.apply_updates(model, _reference_sgd(grads, 4.0))
  assert _array_bits(new) == _array_bits(expected)
  assert new.activation is model.activation
  assert _array_bits(new.layers[0]) == _array_bits(model.layers[0])


def test_accumulate_gradients_on_a_whole_module_with_none_gradients():
  model = _mlp()
  tx = jaxamp.accumulate_gradients(jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=4.0), 2)
  state = tx.init(model)
  grads = _frozen_grads(model, 4.0)
  new, state = jaxamp.apply_scaled_updates(tx, grads, state, model)
  assert _array_bits(new) == _array_bits(model)  # inside the window
  new, state = jaxamp.apply_scaled_updates(tx, grads, state, model)
  total = jax.tree.map(lambda g: g + g, grads)
  expected = eqx.apply_updates(model, _reference_sgd(total, 4.0))
  assert _array_bits(new) == _array_bits(expected)
  updates, state = tx.update(grads, state, model)  # the optax form, the same state
  assert bits(updates) == bits(jax.tree.map(jnp.zeros_like, grads))


# -- GradScaler and Optimizer ------------------------------------------------------------


STATIC = eqx.filter(_mlp(), eqx.is_array, inverse=True)  # the activation functions


def _iteration(scaler, opt, stage):
  """Runs ``scaler`` and ``opt`` (params: a module, whole or its arrays) up to
  ``stage`` of torch's iteration."""
  if stage == "ready":
    return
  opt.grads = eqx.filter_grad(lambda m: scaler.scale(_loss(eqx.combine(m, STATIC))))(opt.params)
  if stage == "unscaled":
    scaler.unscale_(opt)
  elif stage == "stepped":
    scaler.step(opt)


def _round_trips(obj):
  arrays, static = eqx.partition(obj, eqx.is_array)
  yield "partition", eqx.combine(arrays, static)
  yield "filter_jit", eqx.filter_jit(lambda o: o)(obj)
  # jax.jit takes arrays only: an Optimizer of the module's arrays.
  yield "jit", jax.jit(lambda o: o)(eqx.filter(obj, eqx.is_array))


def _finish(scaler, opt, stage):
  """The rest of the iteration from ``stage``: the state machine as it was."""
  if stage == "ready":
    _iteration(scaler, opt, "scaled")
  if stage in ("ready", "scaled"):
    scaler.unscale_(opt)
  if stage != "stepped":
    scaler.step(opt)
  scaler.update()
  return float(scaler.get_scale()), _array_bits(opt.params)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["partition", "filter_jit", "jit"])
@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("stage", ["ready", "scaled", "unscaled", "stepped"])
def test_grad_scaler_and_optimizer_round_trip_equinox_transforms(stage, enabled, how):
  def fresh():
    scaler = jaxamp.GradScaler(init_scale=4.0, growth_interval=1, enabled=enabled)
    opt = jaxamp.Optimizer(optax.sgd(0.1), eqx.filter(_mlp(), eqx.is_array))
    if how != "jit":
      opt = jaxamp.Optimizer(optax.sgd(0.1), _mlp())
    _iteration(scaler, opt, stage)
    return scaler, opt

  expected = _finish(*fresh(), stage)
  pair = fresh()
  s, o = dict(_round_trips(pair))[how]
  assert jax.tree.structure((s, o)) == jax.tree.structure(pair)
  assert _finish(s, o, stage) == expected


@pytest.mark.slow
def test_grad_scaler_round_trip_keeps_the_stage_it_refuses_in():
  scaler = jaxamp.GradScaler()
  opt = jaxamp.Optimizer(optax.sgd(0.1), eqx.filter(_mlp(), eqx.is_array))
  _iteration(scaler, opt, "unscaled")
  for _, (s, o) in _round_trips((scaler, opt)):
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
      s.unscale_(o)


@pytest.mark.parametrize("enabled", [True, False])
def test_grad_scaler_and_optimizer_pickle_between_iterations(enabled):
  scaler = jaxamp.GradScaler(init_scale=4.0, growth_interval=1, enabled=enabled)
  opt = jaxamp.Optimizer(optax.sgd(0.1), eqx.filter(_mlp(), eqx.is_array))
  _iteration(scaler, opt, "stepped")
  scaler.update()
  # optax's transformations are closures that pickle cannot take: the scaler
  # is pickled, the Optimizer deep-copied.
  copies = [(pickle.loads(pickle.dumps(scaler)), copy.deepcopy(opt)), copy.deepcopy((scaler, opt))]
  expected = _finish(scaler, opt, "ready")
  for copied in copies:
    assert _finish(*copied, "ready") == expected


def test_grad_scaler_iteration_inside_filter_jit_on_a_whole_module():
  """The whole torch iteration in one eqx.filter_jit, the module (with its
  activation functions) as the Optimizer's params, passed in and returned."""

  @eqx.filter_jit
  def train_step(scaler, opt):
    opt.grads = eqx.filter_grad(lambda m: scaler.scale(_loss(m)))(opt.params)
    scaler.step(opt)
    scaler.update()
    return scaler, opt

  scaler = jaxamp.GradScaler(init_scale=4.0, growth_interval=2)
  opt = jaxamp.Optimizer(optax.sgd(0.1), _mlp())

  @eqx.filter_jit
  def reference_step(model):  # optax on the unscaled gradients (4 is exact to divide by)
    grads = eqx.filter_grad(lambda m: _loss(m) * 4.0)(model)
    return eqx.apply_updates(model, _reference_sgd(grads, 4.0))

  reference = _mlp()
  for _ in range(2):  # growth_interval=2: the scale is 4 for both
    scaler, opt = train_step(scaler, opt)
    reference = reference_step(reference)
  assert opt.params.activation is jax.nn.tanh
  assert float(scaler.get_scale()) == 8.0
  assert _array_bits(opt.params) == _array_bits(reference)


class _WithDropout(eqx.Module):
  """An MLP and a Dropout, whose ``inference`` is a Python bool leaf (not static)."""

  mlp: eqx.nn.MLP
  dropout: eqx.nn.Dropout

  def __call__(self, x):
    return self.dropout(self.mlp(x), inference=True)


@pytest.mark.parametrize("front_end", ["apply_scaled_updates", "GradScaler"])
def test_a_python_bool_leaf_comes_back_as_given_as_eqx_apply_updates_leaves_it(front_end):
  """A Python number with a None gradient (eqx.filter_grad gives one to a bool) is
  returned as it was, as eqx.apply_updates returns it: an array there would be a
  traced value in the next eqx.filter_jit trace, where Dropout tests it with ``if``."""
  model = _WithDropout(_mlp(), eqx.nn.Dropout(0.5))
  loss = lambda m: jnp.mean(jax.vmap(m)(X) ** 2)
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=4.0)

  @eqx.filter_jit
  def fused_step(model, state):
    grads = eqx.filter_grad(lambda m: jaxamp.scale_loss(loss(m), state))(model)
    return jaxamp.apply_scaled_updates(tx, grads, state, model)

  @eqx.filter_jit
  def scaler_step(scaler, opt):
    opt.grads = eqx.filter_grad(lambda m: scaler.scale(loss(m)))(opt.params)
    scaler.step(opt)
    scaler.update()
    return scaler, opt

  @eqx.filter_jit
  def reference_step(model):  # optax on the unscaled gradients (4 is exact to divide by)
    grads = eqx.filter_grad(lambda m: loss(m) * 4.0)(model)
    return eqx.apply_updates(model, _reference_sgd(grads, 4.0))

  state = tx.init(eqx.filter(model, eqx.is_array))
  scaler, opt = jaxamp.GradScaler(init_scale=4.0), jaxamp.Optimizer(optax.sgd(0.1), model)
  reference = model
  for _ in range(2):  # the second step traces again with the first's output
    if front_end == "apply_scaled_updates":
      model, state = fused_step(model, state)
    else:
      scaler, opt = scaler_step(scaler, opt)
      model = opt.params
    reference = reference_step(reference)
    assert model.dropout.inference is False and model.dropout.p == 0.5
  if front_end == "GradScaler":
    assert _array_bits(model) == _array_bits(reference)
  else:  # apply_scaled_updates agrees to the last bits: within 4 ulps of each leaf's largest
    for got, want in zip(
      *(jax.tree.leaves(eqx.filter(m, eqx.is_array)) for m in (model, reference))
    ):
      ulp = np.spacing(np.max(np.abs(np.asarray(want))))
      assert np.max(np.abs(np.asarray(got) - np.asarray(want))) <= 4 * ulp


@pytest.mark.slow
@pytest.mark.torch
def test_grad_scaler_step_with_a_none_gradient_matches_torch():
  """torch: a parameter whose .grad is None is left out of the inf check and
  not stepped; jaxamp: a None gradient is no update (optax's None)."""
  torch = pytest.importorskip("torch")
  w0, b0 = np.array([1.0, -2.0], np.float32), np.array([0.5, jnp.inf], np.float32)
  tw = torch.nn.Parameter(torch.tensor(w0))
  tb = torch.nn.Parameter(torch.tensor(b0))
  t_opt = torch.optim.SGD([tw, tb], lr=0.1)
  t_scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
  t_scaler.scale((tw**2).sum()).backward()
  assert tb.grad is None
  t_scaler.step(t_opt)
  t_scaler.update()

  scaler = jaxamp.GradScaler(init_scale=4.0)
  opt = jaxamp.Optimizer(optax.sgd(0.1), {"w": jnp.asarray(w0), "b": jnp.asarray(b0)})
  grads = jax.grad(lambda w: scaler.scale(jnp.sum(w**2)))(opt.params["w"])
  opt.grads = {"w": grads, "b": None}
  scaler.step(opt)
  scaler.update()
  assert scaler.get_scale() == t_scaler.get_scale()  # b's inf is no gradient: not skipped
  assert bits(opt.params["w"]) == bits(jnp.asarray(tw.detach().numpy()))
  assert bits(opt.params["b"]) == bits(jnp.asarray(tb.detach().numpy()))
  assert scaler.nonfinite_leaf_paths(opt) == []


def test_grad_scaler_scale_inside_autocast_is_refused_before_any_change():
  scaler = jaxamp.GradScaler(init_scale=4.0)
  opt = jaxamp.Optimizer(optax.sgd(0.1), {"w": jnp.ones(3)})

  @jaxamp.autocast
  def scaled_loss(params, scaler):
    return scaler.scale(jnp.sum(params["w"] @ params["w"]))

  def snapshot():
    leaves, treedef = jax.tree.flatten((scaler, opt))
    return treedef, bits(leaves), scaler._scaled

  before = snapshot()
  with pytest.raises(RuntimeError, match=r"^jaxamp: GradScaler.scale\(\) was called inside"):
    jax.grad(lambda p: scaled_loss(p, scaler))(opt.params)
  assert snapshot() == before
  # The fix the message names: scale what the autocast function returns.
  loss_fn = jaxamp.autocast(lambda p: jnp.sum(p["w"] @ p["w"]))
  opt.grads = jax.grad(lambda p: scaler.scale(loss_fn(p)))(opt.params)
  scaler.step(opt)
  scaler.update()
  assert opt.params["w"].tolist() == [0.800000011920929] * 3


@pytest.mark.slow
def test_docs_equinox_python_blocks_run(capsys):
  """docs/equinox.md's python blocks run in order, in one namespace, and print
  what the page says they print."""
  path = pathlib.Path(__file__).resolve().parents[1] / "docs" / "equinox.md"
  text = path.read_text()
  blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)
  outputs = shown_outputs(path)
  assert len(blocks) == len(outputs) == 5
  namespace = {"__name__": "docs_equinox"}
  for number, (block, shown) in enumerate(zip(blocks, outputs), 1):
    capsys.readouterr()
    exec(compile(block, f"equinox.md (python block {number})", "exec"), namespace)  # noqa: S102
    assert shown is not None, f"equinox.md, python block {number}, does not say what it prints"
    printed = capsys.readouterr().out
    assert printed == shown, (
      f"equinox.md, python block {number}, shows another output than it prints"
    )
