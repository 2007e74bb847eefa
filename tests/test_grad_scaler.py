"""``jaxamp.GradScaler``: torch's loops ported line by line, its state machine and errors."""

import copy
import pickle
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from helpers import bits, jitted_unscale_loop

import jaxamp

E6 = (
  "Attempted {} but _scale is None.  This may indicate your script did not use "
  "scaler.scale(loss or outputs) earlier in the iteration."
)
E8 = "unscale_() has already been called on this optimizer since the last update()."
E9 = "unscale_() is being called after step()."
E12 = "Closure use is not currently supported if GradScaler is enabled."
E13 = "step() has already been called since the last update()."
E14 = "No inf checks were recorded for this optimizer."
E15 = "No inf checks were recorded prior to update."


def _snapshot(scaler, *optimizers):
  """Everything a call could change, as bytes and static data."""
  leaves, treedef = jax.tree.flatten((scaler, optimizers))
  return treedef, bits(leaves), scaler._scaled


def _sum_of_squares(params):
  return jnp.sum(params["w"] ** 2)


def _fresh(init_scale=4.0, **kwargs):
  scaler = jaxamp.GradScaler(init_scale=init_scale, **kwargs)
  opt = jaxamp.Optimizer(optax.sgd(0.5), {"w": jnp.array([1.0, 2.0])})
  return scaler, opt


def _backward(scaler, opt, loss_fn=_sum_of_squares):
  opt.grads = jax.grad(lambda p: scaler.scale(loss_fn(p)))(opt.params)


# ---------------------------------------------------------------------------------
# The three loops of the reference document, against torch run live.
# ---------------------------------------------------------------------------------


def _torch_model():
  torch.manual_seed(0)
  return torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.ReLU(), torch.nn.Linear(10, 10))


def _layer_params(layer):
  return {
    "w": jnp.asarray(layer.weight.detach().numpy().copy()),
    "b": jnp.asarray(layer.bias.detach().numpy().copy()),
  }


def _forward(l1, l2, x):
  hidden = jax.nn.relu(x @ l1["w"].T + l1["b"])
  return hidden @ l2["w"].T + l2["b"]


def _mse(l1, l2, x, y):
  return jnp.mean((_forward(l1, l2, x) - y) ** 2)


def _batches(steps):
  rng = np.random.default_rng(7)
  return [
    (rng.normal(size=(8, 10)).astype(np.float32), rng.normal(size=(8, 10)).astype(np.float32))
    for _ in range(steps)
  ]


def _inject(grads, layer):
  return {**grads, "w": grads["w"].at[0, 0].set(jnp.inf)} if layer else grads


def _torch_inject(linear, flag):
  if flag:
    with torch.no_grad():
      linear.weight.grad[0, 0] = float("inf")


def _torch_clip_grad_norm(grads, max_norm):
  """torch's ``clip_grad_norm_`` formula: grads * min(1, max_norm / (norm + 1e-6))."""
  norm = optax.tree.norm(grads)
  coef = jnp.minimum(jnp.float32(max_norm) / (norm + jnp.float32(1e-6)), 1.0)
  return jax.tree.map(lambda g: g * coef, grads), norm


def _unchanged(before, after):
  return bits(before) == bits(after)


INF_STEPS = (2, 5, 6)
KWARGS = {"init_scale": 2.0**10, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2}


@pytest.mark.slow
@pytest.mark.torch
def test_grad_scaler_basic_loop_matches_torch():
  model = _torch_model()
  t_opt = torch.optim.SGD(model.parameters(), lr=0.1)
  t_scaler = torch.amp.GradScaler("cpu", **KWARGS)
  params = {"l1": _layer_params(model[0]), "l2": _layer_params(model[2])}
  scaler = jaxamp.GradScaler(**KWARGS)
  opt = jaxamp.Optimizer(optax.sgd(0.1), params)
  for i, (x, y) in enumerate(_batches(9)):
    # torch
    t_opt.zero_grad()
    t_scaler.scale(
      torch.nn.functional.mse_loss(model(torch.from_numpy(x)), torch.from_numpy(y))
    ).backward()
    _torch_inject(model[0], i in INF_STEPS)
    t_before = [p.detach().clone() for p in model.parameters()]
    t_scaler.step(t_opt)
    t_scaler.update()
    t_skipped = all(torch.equal(a, b) for a, b in zip(t_before, model.parameters()))
    # jaxamp, line by line
    opt.zero_grad()
    opt.grads = jax.grad(lambda p, x=x, y=y: scaler.scale(_mse(p["l1"], p["l2"], x, y)))(opt.params)
    opt.grads = {**opt.grads, "l1": _inject(opt.grads["l1"], i in INF_STEPS)}
    before = opt.params
    scaler.step(opt)
    scaler.update()
    assert t_skipped == (i in INF_STEPS)
    assert _unchanged(before, opt.params) == t_skipped, i
    assert scaler.get_scale() == t_scaler.get_scale(), i
    assert scaler.state_dict() == t_scaler.state_dict(), i
    for p, t in zip(
      jax.tree.leaves(opt.params), [model[0].bias, model[0].weight, model[2].bias, model[2].weight]
    ):
      np.testing.assert_allclose(np.asarray(p), t.detach().numpy(), rtol=1e-5, atol=1e-6)
  assert t_scaler.get_scale() == 1024.0  # growths at 1, 4, 8 and backoffs at 2, 5, 6


@pytest.mark.slow
@pytest.mark.torch
def test_grad_scaler_unscale_then_clip_loop_matches_torch():
  model = _torch_model()
  t_opt = torch.optim.SGD(model.parameters(), lr=0.1)
  t_scaler = torch.amp.GradScaler("cpu", **KWARGS)
  params = {"l1": _layer_params(model[0]), "l2": _layer_params(model[2])}
  scaler = jaxamp.GradScaler(**KWARGS)
  opt = jaxamp.Optimizer(optax.sgd(0.1), params)
  for i, (x, y) in enumerate(_batches(9)):
    t_opt.zero_grad()
    t_scaler.scale(
      torch.nn.functional.mse_loss(model(torch.from_numpy(x)), torch.from_numpy(y))
    ).backward()
    _torch_inject(model[0], i in INF_STEPS)
    t_scaler.unscale_(t_opt)
    t_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    t_before = [p.detach().clone() for p in model.parameters()]
    t_scaler.step(t_opt)
    t_scaler.update()
    t_skipped = all(torch.equal(a, b) for a, b in zip(t_before, model.parameters()))

    opt.zero_grad()
    opt.grads = jax.grad(lambda p, x=x, y=y: scaler.scale(_mse(p["l1"], p["l2"], x, y)))(opt.params)
    opt.grads = {**opt.grads, "l1": _inject(opt.grads["l1"], i in INF_STEPS)}
    scaler.unscale_(opt)
    opt.grads, norm = _torch_clip_grad_norm(opt.grads, max_norm=1.0)
    before = opt.params
    scaler.step(opt)
    scaler.update()

    assert t_skipped == (i in INF_STEPS)
    assert _unchanged(before, opt.params) == t_skipped, i
    assert scaler.state_dict() == t_scaler.state_dict(), i
    np.testing.assert_allclose(float(norm), t_norm.item(), rtol=1e-5)
    for p, t in zip(
      jax.tree.leaves(opt.params), [model[0].bias, model[0].weight, model[2].bias, model[2].weight]
    ):
      np.testing.assert_allclose(np.asarray(p), t.detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.torch
def test_grad_scaler_two_optimizers_loop_matches_torch():
  model = _torch_model()
  t_opt1 = torch.optim.SGD(model[0].parameters(), lr=0.01)
  t_opt2 = torch.optim.SGD(model[2].parameters(), lr=0.02)
  t_scaler = torch.amp.GradScaler("cpu", **KWARGS)
  scaler = jaxamp.GradScaler(**KWARGS)
  opt1 = jaxamp.Optimizer(optax.sgd(0.01), _layer_params(model[0]))
  opt2 = jaxamp.Optimizer(optax.sgd(0.02), _layer_params(model[2]))
  # (inf in layer 1, inf in layer 2) per iteration: each alone, both, and clean.
  flags = [(0, 0), (1, 0), (0, 0), (0, 1), (0, 0), (1, 1), (0, 0), (0, 0), (0, 0)]
  for i, ((x, y), (inf1, inf2)) in enumerate(zip(_batches(len(flags)), flags)):
    t_opt1.zero_grad()
    t_opt2.zero_grad()
    t_scaler.scale(
      torch.nn.functional.mse_loss(model(torch.from_numpy(x)), torch.from_numpy(y))
    ).backward()
    _torch_inject(model[0], inf1)
    _torch_inject(model[2], inf2)
    t_scaler.unscale_(t_opt1)
    t_scaler.unscale_(t_opt2)
    t_before = [[p.detach().clone() for p in layer.parameters()] for layer in (model[0], model[2])]
    t_scaler.step(t_opt1)
    t_scaler.step(t_opt2)
    t_scaler.update()
    t_skipped = [
      all(torch.equal(a, b) for a, b in zip(before, layer.parameters()))
      for before, layer in zip(t_before, (model[0], model[2]))
    ]

    opt1.zero_grad()
    opt2.zero_grad()
    g1, g2 = jax.grad(lambda p1, p2, x=x, y=y: scaler.scale(_mse(p1, p2, x, y)), argnums=(0, 1))(
      opt1.params, opt2.params
    )
    opt1.grads, opt2.grads = _inject(g1, inf1), _inject(g2, inf2)
    scaler.unscale_(opt1)
    scaler.unscale_(opt2)
    before = (opt1.params, opt2.params)
    scaler.step(opt1)
    scaler.step(opt2)
    scaler.update()

    assert t_skipped == [bool(inf1), bool(inf2)], i
    assert [_unchanged(before[0], opt1.params), _unchanged(before[1], opt2.params)] == t_skipped
    assert scaler.state_dict() == t_scaler.state_dict(), i
    for opt, layer in ((opt1, model[0]), (opt2, model[2])):
      np.testing.assert_allclose(
        np.asarray(opt.params["w"]), layer.weight.detach().numpy(), rtol=1e-5, atol=1e-6
      )
      np.testing.assert_allclose(
        np.asarray(opt.params["b"]), layer.bias.detach().numpy(), rtol=1e-5, atol=1e-6
      )
  # 1024 -> 512 (1) -> 256 (3) -> 128 (5: one backoff, though both saw inf) -> 256 (7).
  assert t_scaler.get_scale() == 256.0


@pytest.mark.slow
def test_grad_scaler_multiple_optimizers_spec_table():
  """docs/torch_semantics.md §5.6: per-optimizer skips, one backoff however many optimizers saw inf."""
  scaler = jaxamp.GradScaler(init_scale=8.0, growth_interval=2)
  o1 = jaxamp.Optimizer(optax.sgd(1.0), jnp.array([1.0]))
  o2 = jaxamp.Optimizer(optax.sgd(1.0), jnp.array([1.0]))
  rows = []
  for inf1, inf2 in [(0, 0), (1, 0), (0, 1), (1, 1), (0, 0), (0, 0)]:
    g1, g2 = jax.grad(lambda a, b: scaler.scale(a.sum() + b.sum()), argnums=(0, 1))(
      o1.params, o2.params
    )
    o1.grads = g1.at[0].set(jnp.inf) if inf1 else g1
    o2.grads = g2.at[0].set(jnp.nan) if inf2 else g2
    scaler.step(o1)
    scaler.step(o2)
    scaler.update()
    rows.append(
      (float(o1.params[0]), float(o2.params[0]), scaler.get_scale(), scaler._get_growth_tracker())
    )
  assert rows == [
    (0.0, 0.0, 8.0, 1),
    (0.0, -1.0, 4.0, 0),
    (-1.0, -1.0, 2.0, 0),
    (-1.0, -1.0, 1.0, 0),
    (-2.0, -2.0, 1.0, 1),
    (-3.0, -3.0, 2.0, 0),
  ]


def test_grad_scaler_untouched_optimizer_keeps_scaled_grads():
  """docs/torch_semantics.md §6.30: only o1 is recorded; o2's grads stay scaled."""
  scaler = jaxamp.GradScaler(init_scale=8.0, growth_interval=1)
  o1 = jaxamp.Optimizer(optax.sgd(1.0), jnp.array([1.0]))
  o2 = jaxamp.Optimizer(optax.sgd(1.0), jnp.array([1.0]))
  o1.grads, o2.grads = jax.grad(lambda a, b: scaler.scale(a.sum() + b.sum()), argnums=(0, 1))(
    o1.params, o2.params
  )
  scaler.step(o1)
  scaler.update()
  assert scaler.get_scale() == 16.0
  assert o2.grads.tolist() == [8.0]


# ---------------------------------------------------------------------------------
# Bit-identity with the core optax wrapper.
# ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("inner", [optax.sgd(0.1), optax.adam(0.01)], ids=["sgd", "adam"])
def test_grad_scaler_matches_dynamic_loss_scale(inner):
  kwargs = {"init_scale": 3.0, "growth_factor": 1.5, "backoff_factor": 0.3, "growth_interval": 2}
  params = {"w": jnp.array([0.5, -1.25, 3.0]), "b": jnp.array(0.75)}
  tx = jaxamp.dynamic_loss_scale(inner, **kwargs)
  state = tx.init(params)
  core_params = params
  scaler = jaxamp.GradScaler(**kwargs)
  opt = jaxamp.Optimizer(inner, params)
  rng = np.random.default_rng(3)
  for i in range(12):
    raw = {"w": rng.normal(size=3).astype(np.float32), "b": np.float32(rng.normal())}
    scale = jaxamp.get_loss_scale(state)
    grads = jax.tree.map(lambda g, scale=scale: jnp.asarray(g) * scale, raw)
    if i in (3, 7, 8):
      grads = {**grads, "w": grads["w"].at[1].set(jnp.inf if i != 8 else jnp.nan)}
    updates, state = tx.update(grads, state, core_params)
    core_params = optax.apply_updates(core_params, updates)

    scaler.scale(jnp.float32(1.0))
    assert bits(scaler.loss_scale) == bits(scale)
    opt.grads = grads
    scaler.unscale_(opt)
    expected_unscaled, found_inf = jaxamp.ops.unscale_and_check(grads, scale)
    assert bits(opt.grads) == bits(expected_unscaled)
    assert bool(scaler._states[opt._key].found_inf) == bool(found_inf) == bool(state.found_inf)
    scaler.step(opt)
    scaler.update()
    assert bits(scaler.loss_scale) == bits(state.loss_scale), i
    assert int(scaler.growth_tracker) == int(state.growth_tracker), i
    # The optimizer's own arithmetic is not torch's and not bit-defined: the
    # two APIs run it in different XLA programs, where the CPU compiler fuses
    # (and contracts into FMAs) differently; they agree to the last few bits.
    for ours, core in zip(
      jax.tree.leaves((opt.params, opt.opt_state)),
      jax.tree.leaves((core_params, state.inner_state)),
    ):
      np.testing.assert_allclose(np.asarray(ours), np.asarray(core), rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------
# The state machine and its errors.
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "call, funcname",
  [
    (lambda s, o: s.unscale_(o), "unscale_"),
    (lambda s, o: s.step(o), "step"),
    (lambda s, o: s.update(), "update"),
    (lambda s, o: s.update(2.0), "update"),
  ],
)
def test_grad_scaler_calls_before_scale_raise(call, funcname):
  scaler, opt = _fresh()
  before = _snapshot(scaler, opt)
  with pytest.raises(RuntimeError) as info:
    call(scaler, opt)
  assert str(info.value) == E6.format(funcname)
  assert _snapshot(scaler, opt) == before


def test_grad_scaler_unscale_twice_raises():
  scaler, opt = _fresh()
  _backward(scaler, opt)
  scaler.unscale_(opt)
  before = _snapshot(scaler, opt)
  with pytest.raises(RuntimeError) as info:
    scaler.unscale_(opt)
  assert str(info.value) == E8
  assert _snapshot(scaler, opt) == before
  assert opt.grads["w"].tolist() == [2.0, 4.0]  # 4 * [2, 4] unscaled once, not twice


def test_grad_scaler_unscale_after_step_raises():
  scaler, opt = _fresh()
  _backward(scaler, opt)
  scaler.step(opt)
  before = _snapshot(scaler, opt)
  with pytest.raises(RuntimeError) as info:
    scaler.unscale_(opt)
  assert str(info.value) == E9
  assert _snapshot(scaler, opt) == before


def test_grad_scaler_step_twice_raises():
  scaler, opt = _fresh()
  _backward(scaler, opt)
  scaler.step(opt)
  before = _snapshot(scaler, opt)
  with pytest.raises(RuntimeError) as info:
    scaler.step(opt)
  assert str(info.value) == E13
  assert _snapshot(scaler, opt) == before


def test_grad_scaler_update_without_inf_checks_raises():
  scaler, _opt = _fresh()
  scaler.scale(jnp.float32(1.0))
  with pytest.raises(RuntimeError) as info:
    scaler.update()
  assert str(info.value) == E15


def test_grad_scaler_update_twice_raises():
  scaler, opt = _fresh()
  _backward(scaler, opt)
  scaler.step(opt)
  scaler.update()
  before = _snapshot(scaler, opt)
  with pytest.raises(RuntimeError) as info:
    scaler.update()
  assert str(info.value) == E15
  assert _snapshot(scaler, opt) == before


def test_grad_scaler_step_with_closure_raises_even_before_scale():
  scaler, opt = _fresh()
  with pytest.raises(RuntimeError) as info:
    scaler.step(opt, closure=lambda: 1.0)
  assert str(info.value) == E12


def test_grad_scaler_step_without_grads_raises_and_changes_nothing():
  scaler, opt = _fresh()
  scaler.scale(jnp.float32(1.0))
  opt.zero_grad()
  before = _snapshot(scaler, opt)
  with pytest.raises(RuntimeError) as info:
    scaler.step(opt)
  assert str(info.value) == E14
  assert _snapshot(scaler, opt) == before  # torch would leave the optimizer UNSCALED
  with pytest.raises(RuntimeError, match=E15.replace(".", r"\.")):
    scaler.update()
  scaler.update(new_scale=4.0)  # as torch, an explicit scale needs no inf check


def test_grad_scaler_unscale_without_grads_then_step_raises():
  """docs/torch_semantics.md §6.42: unscale_ with no grads records nothing; step then raises E14."""
  scaler, opt = _fresh()
  scaler.scale(jnp.float32(1.0))
  opt.zero_grad()
  scaler.unscale_(opt)
  with pytest.raises(RuntimeError, match=E14.replace(".", r"\.")):
    scaler.step(opt)
  with pytest.raises(RuntimeError) as info:
    scaler.unscale_(opt)
  assert str(info.value) == E8


def test_grad_scaler_step_after_update_reuses_stale_grads():
  """docs/torch_semantics.md §6.40: a step after update without a new backward unscales the stale grads again."""
  scaler = jaxamp.GradScaler(init_scale=2.0)
  opt = jaxamp.Optimizer(optax.sgd(0.0), jnp.array([1.0, 2.0]))
  scaler.scale(jnp.float32(1.0))
  opt.grads = jnp.array([2.0, 4.0])
  scaler.step(opt)
  scaler.update()
  assert opt.grads.tolist() == [1.0, 2.0]
  scaler.step(opt)
  assert opt.grads.tolist() == [0.5, 1.0]


def test_grad_scaler_bad_grads_change_nothing():
  scaler, opt = _fresh()
  scaler.scale(jnp.float32(1.0))
  opt.grads = {"w": jnp.array([1, 2], jnp.int32)}
  before = _snapshot(scaler, opt)
  with pytest.raises(TypeError, match="gradient leaf"):
    scaler.step(opt)
  with pytest.raises(TypeError, match="gradient leaf"):
    scaler.unscale_(opt)
  assert _snapshot(scaler, opt) == before


def test_grad_scaler_skipped_step_keeps_params_and_state_and_unscales_grads():
  """docs/torch_semantics.md §6.25: grads [8, 16, inf] at scale 4 → [2, 4, inf]; params untouched; scale 2."""
  scaler = jaxamp.GradScaler(init_scale=4.0)
  opt = jaxamp.Optimizer(optax.adam(0.1), jnp.array([1.0, 2.0, 3.0]))
  grads = jax.grad(lambda p: scaler.scale(jnp.sum(p * p)))(opt.params)
  opt.grads = grads.at[2].set(jnp.inf)
  before = (bits(opt.params), bits(opt.opt_state))
  assert scaler.step(opt) is None
  scaler.update()
  assert opt.grads.tolist() == [2.0, 4.0, float("inf")]
  assert (bits(opt.params), bits(opt.opt_state)) == before
  assert scaler.get_scale() == 2.0


@pytest.mark.parametrize("stage", ["unscaled", "stepped"])
def test_grad_scaler_state_machine_is_enforced_while_tracing(stage):
  scaler, opt = _fresh()

  @jax.jit
  def twice(scaler, opt):
    _backward(scaler, opt)
    if stage == "unscaled":
      scaler.unscale_(opt)
      scaler.unscale_(opt)
    else:
      scaler.step(opt)
      scaler.step(opt)
    return scaler, opt

  with pytest.raises(RuntimeError) as info:
    twice(scaler, opt)
  assert str(info.value) == (E8 if stage == "unscaled" else E13)


def test_grad_scaler_stage_survives_a_jit_boundary():
  scaler, opt = _fresh()
  unscale = jax.jit(lambda s, o: (s.unscale_(o), s, o)[1:])
  _backward(scaler, opt)
  scaler, opt = unscale(scaler, opt)
  with pytest.raises(RuntimeError) as info:
    scaler.unscale_(opt)
  assert str(info.value) == E8
  scaler.step(opt)
  scaler.update()
  assert scaler.get_scale() == 4.0 and scaler._get_growth_tracker() == 1


@pytest.mark.slow
def test_grad_scaler_jitted_loop_has_no_transfers_and_compiles_once():
  injections = [jnp.float32(v) for v in (1, 1, jnp.inf, 1, 1, jnp.nan, 1, 1)]
  scaler, opt, scales, traces = jitted_unscale_loop(
    jaxamp.GradScaler(init_scale=8.0, growth_interval=2), injections
  )
  assert traces == 1
  assert [float(s) for s in scales] == [8.0, 16.0, 8.0, 8.0, 16.0, 8.0, 8.0, 16.0]

  # The same iterations called one by one, outside jit, give the same bits.
  x = jnp.array([0.5, 1.0, 1.5])  # as in jitted_unscale_loop
  eager_scaler = jaxamp.GradScaler(init_scale=8.0, growth_interval=2)
  eager_opt = jaxamp.Optimizer(optax.adam(0.1), {"w": jnp.array([1.0, -2.0, 3.0])})
  for inject in injections:
    eager_opt.zero_grad()
    eager_opt.grads = jax.grad(lambda p: eager_scaler.scale(jnp.sum((p["w"] * x) ** 2)))(
      eager_opt.params
    )
    eager_opt.grads = {"w": eager_opt.grads["w"].at[0].multiply(inject)}
    eager_scaler.unscale_(eager_opt)
    eager_scaler.step(eager_opt)
    eager_scaler.update()
  assert bits(eager_scaler) == bits(scaler)
  np.testing.assert_allclose(
    np.asarray(eager_opt.params["w"]), np.asarray(opt.params["w"]), rtol=1e-6
  )


# ---------------------------------------------------------------------------------
# scale(), update(new_scale), getters, setters, disabled.
# ---------------------------------------------------------------------------------


@pytest.mark.torch
@pytest.mark.parametrize(
  "dtype, shape",
  [
    ("float32", ()),
    ("float32", (2,)),
    ("float16", ()),
    ("float16", (2,)),
    ("bfloat16", ()),
    ("bfloat16", (2,)),
    ("int32", (2,)),
  ],
)
def test_grad_scaler_scale_dtypes_match_torch(dtype, shape):
  value = np.full(shape, 1.5, np.float32)
  for init_scale in (3.0, 65536.0, 0.1):
    t_out = torch.amp.GradScaler("cpu", init_scale=init_scale).scale(
      torch.from_numpy(value).to(getattr(torch, dtype))
    )
    out = jaxamp.GradScaler(init_scale=init_scale).scale(jnp.asarray(value).astype(dtype))
    assert str(out.dtype) == str(t_out.dtype).removeprefix("torch.")
    expected = t_out.float().numpy()
    assert np.asarray(out.astype(jnp.float32)).tobytes() == expected.tobytes()


def test_grad_scaler_scale_float16_loss_gives_float32():
  out = jaxamp.GradScaler().scale(jnp.float16(2.0))
  assert out.dtype == jnp.float32 and float(out) == 131072.0
  out = jaxamp.GradScaler().scale(jnp.array([1.0, 2.0], jnp.float16))
  assert out.dtype == jnp.float16 and np.isinf(np.asarray(out, np.float32)).all()


def test_grad_scaler_scale_containers():
  scaler = jaxamp.GradScaler(init_scale=4.0)
  out = scaler.scale([jnp.float32(1.0), (jnp.array([2.0, 3.0]), [jnp.float32(1.0)])])
  assert isinstance(out, list) and isinstance(out[1], tuple) and isinstance(out[1][1], list)
  assert jax.tree.map(float, out[0]) == 4.0
  assert out[1][0].tolist() == [8.0, 12.0]
  assert scaler.scale([]) == []


def test_grad_scaler_scale_non_array_raises_and_does_not_initialise():
  scaler = jaxamp.GradScaler(init_scale=0.1)
  for bad in (3.0, None, [jnp.float32(1.0), 3.0]):
    with pytest.raises(ValueError, match="outputs must be a Tensor or an iterable of Tensors"):
      scaler.scale(bad)
  assert scaler.get_scale() == 0.1  # still the raw init value: nothing was scaled
  with pytest.raises(RuntimeError, match="Attempted step"):
    scaler.step(jaxamp.Optimizer(optax.sgd(1.0), jnp.ones(1)))


def test_grad_scaler_get_scale_is_raw_before_first_scale():
  scaler = jaxamp.GradScaler(init_scale=0.1)
  assert scaler.get_scale() == 0.1
  assert scaler.state_dict()["scale"] == 0.1
  scaler.scale(jnp.float32(1.0))
  assert scaler.get_scale() == 0.10000000149011612
  assert jaxamp.GradScaler(init_scale=3).get_scale() == 3


@pytest.mark.parametrize(
  "new_scale, expected",
  [
    (2.5, 2.5),
    (1 / 3, 0.3333333432674408),
    (np.float64(2.5), 2.5),
    (np.float32(2.5), 2.5),
    (jnp.float32(2.5), 2.5),
    (np.asarray(1 / 3), 0.3333333432674408),
    # -1.0, which torch accepts, is now refused (test_grad_scaler_update_bad_new_scale...).
  ],
)
def test_grad_scaler_update_new_scale_sets_scale_keeps_tracker(new_scale, expected):
  scaler, opt = _fresh(growth_interval=3)
  _backward(scaler, opt)
  scaler.step(opt)
  scaler.update()
  _backward(scaler, opt)
  scaler.step(opt)
  scaler.update(new_scale)
  assert scaler.get_scale() == expected
  assert scaler._get_growth_tracker() == 1
  assert scaler._states == {}


@pytest.mark.parametrize(
  "bad, error, match",
  [
    (2, TypeError, "must be a float"),
    (True, TypeError, "must be a float"),
    (float("inf"), ValueError, "must be finite"),
    (float("nan"), ValueError, "must be finite"),
    (0.0, ValueError, "must be finite and positive"),
    (-1.0, ValueError, "must be finite and positive"),
    (1e-50, ValueError, "must be finite and positive"),
    (1e39, RuntimeError, "value cannot be converted to type float without overflow"),
    (jnp.array([2.5]), ValueError, "new_scale should be a float or a 1-element"),
    (jnp.array(2, jnp.int32), ValueError, "new_scale should be a float or a 1-element"),
    (np.asarray(1e39), RuntimeError, "without overflow"),
    (np.asarray(np.inf, np.float32), ValueError, "must be finite"),
    ("2.0", TypeError, "must be a float"),
  ],
)
def test_grad_scaler_update_bad_new_scale_raises_and_changes_nothing(bad, error, match):
  scaler, opt = _fresh()
  _backward(scaler, opt)
  scaler.step(opt)
  before = _snapshot(scaler, opt)
  with pytest.raises(error, match=match):
    scaler.update(bad)
  assert _snapshot(scaler, opt) == before
  scaler.update()
  assert scaler.get_scale() == 4.0


def test_grad_scaler_update_traced_new_scale():
  scaler, opt = _fresh()
  _backward(scaler, opt)

  @jax.jit
  def set_scale(scaler, value):
    scaler.update(new_scale=value)
    return scaler

  scaler = set_scale(scaler, jnp.float32(0.75))
  assert scaler.get_scale() == 0.75


def test_grad_scaler_setters_are_not_range_checked():
  """docs/torch_semantics.md §6.53: interval 1, growth 0.5, backoff 4.0, flags [0, 0, 1, 1] → 2, 1, 4, 16."""
  scaler = jaxamp.GradScaler(init_scale=4.0, growth_interval=1)
  scaler.set_growth_factor(0.5)
  scaler.set_backoff_factor(4.0)
  opt = jaxamp.Optimizer(optax.sgd(0.0), jnp.array([1.0]))
  scales = []
  for flag in (0, 0, 1, 1):
    opt.grads = jnp.array([jnp.inf if flag else 1.0])
    scaler.scale(jnp.float32(1.0))
    scaler.step(opt)
    scaler.update()
    scales.append(scaler.get_scale())
  assert scales == [2.0, 1.0, 4.0, 16.0]
  assert (scaler.get_growth_factor(), scaler.get_backoff_factor()) == (0.5, 4.0)
  scaler.set_growth_interval(7)
  assert scaler.get_growth_interval() == 7
  with pytest.raises(TypeError, match="must be an int"):
    scaler.set_growth_interval(2.5)
  with pytest.raises(TypeError, match="real Python number"):
    scaler.set_growth_factor(jnp.float32(2.0))


def test_grad_scaler_constructor_validates():
  with pytest.raises(ValueError, match=r"The growth factor must be > 1\.0\."):
    jaxamp.GradScaler(growth_factor=1.0)
  with pytest.raises(ValueError, match=r"The backoff factor must be < 1\.0\."):
    jaxamp.GradScaler(backoff_factor=1.0)
  with pytest.raises(ValueError, match="without overflow"):
    jaxamp.GradScaler(init_scale=1e39)
  with pytest.raises(TypeError, match='device must be a string such as "cuda"'):
    jaxamp.GradScaler(device=None)
  with pytest.raises(TypeError, match=r"GradScaler\(\): too many positional arguments"):
    jaxamp.GradScaler(2.0**16, 2.0, 0.5, 2000, True, 2.0)  # torch.cuda.amp's form: five
  jaxamp.GradScaler(growth_factor=0.5, enabled=False)  # as torch: not validated when disabled


def _scales_of_a_torch_loop(scaler, flags):
  """The scales after each iteration of a one-parameter SGD loop, inf injected on the flags."""
  p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
  opt, scales = torch.optim.SGD([p], lr=0.1), []
  for flag in flags:
    opt.zero_grad()
    scaler.scale((p * p).sum()).backward()
    if flag:
      p.grad[0] = float("inf")
    scaler.step(opt)
    scaler.update()
    scales.append(scaler.get_scale())
  return scales, p.detach().tolist()


def _scales_of_a_jaxamp_loop(scaler, flags):
  opt, scales = jaxamp.Optimizer(optax.sgd(0.1), {"p": jnp.array([1.0, 2.0])}), []
  for flag in flags:
    opt.grads = jax.grad(lambda q: scaler.scale(jnp.sum(q["p"] * q["p"])))(opt.params)
    if flag:
      opt.grads = {"p": opt.grads["p"].at[0].set(jnp.inf)}
    scaler.step(opt)
    scaler.update()
    scales.append(scaler.get_scale())
  return scales, opt.params["p"].tolist()


@pytest.mark.torch
def test_grad_scaler_device_and_positional_forms_match_torch():
  # torch.amp's GradScaler(device, init_scale, growth_factor, backoff_factor,
  # growth_interval): the device is ignored ("cuda" too: torch's CPU build disables
  # that one, a documented difference); torch.cuda.amp's form starts at init_scale.
  flags = [0, 0, 1, 0, 0, 0, 1, 1, 0, 0]
  arguments = (1024.0, 3.0, 0.25, 2)
  expected = _scales_of_a_torch_loop(torch.amp.GradScaler("cpu", *arguments), flags)
  assert expected[0][:3] == [1024.0, 3072.0, 768.0]  # the arguments were used
  forms = {
    "cpu, by position": jaxamp.GradScaler("cpu", *arguments),
    "cuda, by position": jaxamp.GradScaler("cuda", *arguments),
    "xpu, by keyword": jaxamp.GradScaler(
      device="xpu", init_scale=1024.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=2
    ),
    "torch.cuda.amp's": jaxamp.GradScaler(*arguments, True),
  }
  for form, scaler in forms.items():
    scales, params = _scales_of_a_jaxamp_loop(scaler, flags)
    assert scales == expected[0], form
    np.testing.assert_allclose(params, expected[1], rtol=1e-6, err_msg=form)  # same skips
  assert jaxamp.GradScaler(*arguments, False).state_dict() == {}  # enabled, fifth by position


def test_grad_scaler_disabled_is_a_pass_through():
  scaler = jaxamp.GradScaler(enabled=False)
  opt = jaxamp.Optimizer(optax.sgd(1.0), jnp.array([1.0]))
  loss = jnp.float32(2.0)
  assert scaler.scale(loss) is loss
  opt.grads = jnp.array([jnp.inf])
  assert scaler.unscale_(opt) is None
  scaler.step(opt)
  assert opt.params.tolist() == [-float("inf")]  # applied, as torch's disabled scaler
  assert scaler.update() is None and scaler.update(new_scale="garbage") is None
  assert scaler.get_scale() == 1.0 and not scaler.is_enabled()
  assert scaler.state_dict() == {}
  assert scaler.load_state_dict({"anything": 1}) is None
  with pytest.raises(AttributeError, match="'GradScaler' object has no attribute '_growth_factor'"):
    scaler.get_growth_factor()
  scaler.set_growth_factor(3.0)
  assert scaler.get_growth_factor() == 3.0


def test_grad_scaler_rejects_a_non_jaxamp_optimizer():
  scaler, _ = _fresh()
  scaler.scale(jnp.float32(1.0))
  with pytest.raises(TypeError, match="expects a jaxamp.Optimizer"):
    scaler.step(optax.sgd(0.1))


@pytest.mark.slow
def test_grad_scaler_eager_loop_compiles_nothing_after_the_first_iteration(backend_compiles):
  # A torch loop ported line by line runs outside jit: scaler.step's
  # lax.cond, and the unscale and check of unscale_ or step, are jitted once
  # per optimizer and shapes, not every iteration.
  params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
  scaler = jaxamp.GradScaler(init_scale=4.0)
  opt = jaxamp.Optimizer(optax.adam(1e-3), params)

  def iteration(bad, unscale_first):
    opt.zero_grad()
    loss = lambda p: jnp.sum(p["w"] ** 2) + jnp.sum(p["b"]) * bad
    opt.grads = jax.grad(lambda p: scaler.scale(loss(p)))(opt.params)
    if unscale_first:
      scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()

  for unscale_first in (False, True):
    iteration(jnp.float32(1.0), unscale_first)
    iteration(jnp.float32(jnp.inf), unscale_first)
  backend_compiles.clear()
  for bad, unscale_first in ((1.0, True), (jnp.inf, False), (1.0, False), (jnp.inf, True)):
    iteration(jnp.float32(bad), unscale_first)
  assert backend_compiles == []
  assert float(scaler.get_scale()) == 0.25  # four backoffs from 4


class _UnhashableUpdate:
  """An update function that cannot be a static jit argument (no __hash__)."""

  def __eq__(self, other):
    return self is other

  def __call__(self, updates, state, params=None, *, factor=1.0, fn=None):
    scale = factor if fn is None else fn()
    return jax.tree.map(lambda g: -scale * g, updates), state


@pytest.mark.parametrize("hashable", [True, False])
def test_grad_scaler_step_forwards_extra_args_arrays_and_callables(hashable):
  # Array extra args take the compiled path; a callable (line searches take
  # value functions) or an unhashable transformation the traced one.
  update = _UnhashableUpdate()
  if hashable:

    def update(updates, state, params=None, *, factor=1.0, fn=None):
      return _UnhashableUpdate.__call__(None, updates, state, params, factor=factor, fn=fn)

  tx = optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)
  scaler = jaxamp.GradScaler(init_scale=2.0)
  for kwargs, expected in [({"factor": jnp.float32(0.5)}, 0.5), ({"fn": lambda: 0.25}, 0.75)]:
    opt = jaxamp.Optimizer(tx, {"w": jnp.ones(2)})
    opt.grads = jax.grad(lambda p: scaler.scale(jnp.sum(p["w"])))(opt.params)  # grads 2.0
    scaler.step(opt, **kwargs)
    scaler.update()
    assert opt.params["w"].tolist() == [expected, expected]


@pytest.mark.parametrize("method", ["unscale_", "step", "update"])
def test_grad_scaler_captured_by_a_jitted_function_raises_and_changes_nothing(method):
  # Captured (not passed in and returned), its scale would be a frozen
  # constant and update() would leak a tracer into the Python object.
  scaler = jaxamp.GradScaler(init_scale=4.0)
  scaler.scale(jnp.float32(1.0))
  opt = jaxamp.Optimizer(optax.sgd(0.1), {"w": jnp.ones(2)})
  if method == "update":
    opt.grads = {"w": jnp.ones(2)}
    scaler.step(opt)
  before = (scaler.state_dict(), dict(scaler._states), bits(scaler))

  @jax.jit
  def iteration(opt, grads):
    opt.grads = grads
    if method == "update":
      scaler.update(new_scale=grads["w"][0])
    else:
      getattr(scaler, method)(opt)
    return opt

  with pytest.raises(RuntimeError) as info:
    iteration(opt, {"w": jnp.array([1.0, jnp.inf])})
  assert (
    str(info.value)
    .splitlines()[0]
    .startswith(f"jaxamp: GradScaler.{method}() ran inside a traced function on a scaler captured")
  )
  assert (scaler.state_dict(), dict(scaler._states), bits(scaler)) == before


# -- copies and pickles (docs/torch_semantics.md §1.10) ------------------------------

E23 = (
  "A GradScaler instance may only be pickled at the beginning of an iteration, or at the "
  "end after scaler.update()."
)
COPIES = {
  "deepcopy": copy.deepcopy,
  "copy": copy.copy,
  "pickle": lambda x: pickle.loads(pickle.dumps(x)),
}


def _sgd_init(params):
  return optax.EmptyState()


def _sgd_update(updates, state, params=None):
  return jax.tree.map(lambda g: -0.5 * g, updates), state


# Module-level functions, so that the transformation (and an Optimizer) pickles.
PICKLABLE_SGD = optax.GradientTransformation(_sgd_init, _sgd_update)


@pytest.mark.torch
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])  # torch's copy.copy shares params
def test_grad_scaler_step_on_a_copied_optimizer_unscales_it_matches_torch(how):
  """A copy is a new optimizer, as torch keys by id(optimizer): unscale_(a) does not
  unscale the copy, whose step unscales its own grads (it shared a's key and applied
  them still scaled)."""
  scaler = jaxamp.GradScaler(init_scale=4.0)
  a = jaxamp.Optimizer(PICKLABLE_SGD, {"w": jnp.array([1.0, 2.0])})
  a.grads = {"w": jnp.array([4.0, 8.0])}
  b = COPIES[how](a)
  scaler.scale(jnp.float32(1.0))
  scaler.unscale_(a)
  scaler.step(b)
  scaler.step(a)
  scaler.update()

  t_scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
  t_a = torch.optim.SGD([torch.nn.Parameter(torch.tensor([1.0, 2.0]))], lr=0.5)
  t_b = COPIES[how](t_a)
  for opt in (t_a, t_b):
    opt.param_groups[0]["params"][0].grad = torch.tensor([4.0, 8.0])
  t_scaler.scale(torch.tensor(1.0))
  t_scaler.unscale_(t_a)
  t_scaler.step(t_b)
  t_scaler.step(t_a)
  t_scaler.update()

  for opt, t_opt in ((a, t_a), (b, t_b)):
    want = t_opt.param_groups[0]["params"][0].detach().numpy()
    assert bits(opt.params["w"]) == bits(want)
  np.testing.assert_array_equal(np.asarray(b.params["w"]), [0.5, 1.0])  # 1 - 0.5 * 4/4


def test_optimizer_shallow_copy_is_a_new_optimizer():
  scaler = jaxamp.GradScaler(init_scale=4.0)
  a = jaxamp.Optimizer(optax.sgd(0.5), {"w": jnp.array([1.0, 2.0])})
  a.grads = {"w": jnp.array([4.0, 8.0])}
  b = copy.copy(a)
  scaler.scale(jnp.float32(1.0))
  scaler.unscale_(a)
  scaler.step(b)
  np.testing.assert_array_equal(np.asarray(b.params["w"]), [0.5, 1.0])
  np.testing.assert_array_equal(np.asarray(a.params["w"]), [1.0, 2.0])


@pytest.mark.torch
@pytest.mark.parametrize("how", ["deepcopy", "copy", "pickle"])
@pytest.mark.parametrize("stage", ["unscale_", "step"])
def test_grad_scaler_copy_with_recorded_optimizers_raises_e23_and_changes_nothing(how, stage):
  """As torch: the records name optimizers by identity, which a copy cannot keep."""
  scaler, opt = _fresh()
  scaler.scale(jnp.float32(1.0))
  opt.grads = {"w": jnp.ones(2)}
  getattr(scaler, stage)(opt)
  before = _snapshot(scaler, opt)
  with pytest.raises(RuntimeError) as info:
    COPIES[how](scaler)
  assert str(info.value).startswith(E23)
  assert _snapshot(scaler, opt) == before

  t_scaler = torch.amp.GradScaler("cpu")
  t_opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.5)
  t_opt.param_groups[0]["params"][0].grad = torch.ones(2)
  t_scaler.scale(torch.tensor(1.0))
  getattr(t_scaler, stage)(t_opt)
  with pytest.raises(AssertionError, match=re.escape(E23)):
    COPIES[how](t_scaler)
  scaler.update()
  COPIES[how](scaler)  # after update(), as torch


@pytest.mark.torch
@pytest.mark.parametrize("how", ["deepcopy", "copy", "pickle"])
def test_grad_scaler_copy_starts_before_scale_at_the_current_scale_matches_torch(how):
  """torch's copy re-creates its scale at its next scale(): E6 until then."""
  scaler, opt = _fresh(init_scale=3.0, growth_interval=1)
  t_scaler = torch.amp.GradScaler("cpu", init_scale=3.0, growth_interval=1)
  for s, loss in ((scaler, jnp.float32(1.0)), (t_scaler, torch.tensor(1.0))):
    s.scale(loss)
  opt.grads = {"w": jnp.ones(2)}
  scaler.step(opt)
  scaler.update()
  t_opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.5)
  t_opt.param_groups[0]["params"][0].grad = torch.ones(2)
  t_scaler.step(t_opt)
  t_scaler.update()
  scaler.scale(jnp.float32(1.0))
  t_scaler.scale(torch.tensor(1.0))

  copied, t_copied = COPIES[how](scaler), COPIES[how](t_scaler)
  assert t_copied._scale is None and not copied._scaled
  assert copied.state_dict() == t_copied.state_dict() == {**t_scaler.state_dict()}
  assert copied.get_scale() == t_copied.get_scale() == 6.0
  with pytest.raises(RuntimeError, match=re.escape(E6.format("unscale_"))):
    copied.unscale_(opt)
  with pytest.raises(AssertionError, match=re.escape(E6.format("unscale_"))):
    t_copied.unscale_(t_opt)
  copied.scale(jnp.float32(1.0))
  copied.step(opt)
  copied.update()
  assert copied.get_scale() == 12.0
  assert scaler.get_scale() == 6.0  # the original is its own scaler


@pytest.mark.torch
@pytest.mark.parametrize("how", ["deepcopy", "copy", "pickle"])
def test_disabled_grad_scaler_copy_keeps_its_unset_hyperparameters_matches_torch(how):
  """A disabled scaler's copy had a placeholder for growth_factor (returned it)."""
  scaler = jaxamp.GradScaler(enabled=False)
  t_scaler = torch.amp.GradScaler("cpu", enabled=False)
  copied, t_copied = COPIES[how](scaler), COPIES[how](t_scaler)
  for getter in ("get_growth_factor", "get_backoff_factor", "get_growth_interval"):
    with pytest.raises(AttributeError) as info:
      getattr(copied, getter)()
    with pytest.raises(AttributeError) as t_info:
      getattr(t_copied, getter)()
    assert str(info.value) == str(t_info.value)
  scaler.set_growth_factor(3.0)
  t_scaler.set_growth_factor(3.0)
  assert COPIES[how](scaler).get_growth_factor() == COPIES[how](t_scaler).get_growth_factor() == 3.0


@pytest.mark.parametrize("enabled", [True, False])
def test_step_with_a_none_gradient_leaf_names_it_and_changes_nothing(enabled):
  """Under a disabled scaler (opt.step()) optax raised a bare pytree-structure error."""
  scaler = jaxamp.GradScaler(enabled=enabled)
  scaler.scale(jnp.float32(1.0))
  opt = jaxamp.Optimizer(optax.adam(0.1), {"a": jnp.ones(2), "b": jnp.ones(3)})
  opt.grads = {"a": None, "b": jnp.ones(3)}
  before = _snapshot(scaler, opt)
  with pytest.raises(ValueError, match=r"^jaxamp: the gradient of \['a'\] is None"):
    scaler.step(opt)
  assert _snapshot(scaler, opt) == before


@pytest.mark.torch
def test_grad_scaler_step_after_unscale_and_zero_grad_updates_nothing_as_torch():
  # torch: unscale_ records found_inf, zero_grad() drops .grad, step() then
  # updates nothing and update() counts a clean iteration.
  w = torch.nn.Parameter(torch.ones(2))
  t_opt = torch.optim.SGD([w], lr=0.1)
  t_scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1)
  t_scaler.scale(torch.ones(()))
  w.grad = torch.ones(2)
  t_scaler.unscale_(t_opt)
  t_opt.zero_grad()
  t_scaler.step(t_opt)
  t_scaler.update()

  scaler = jaxamp.GradScaler(init_scale=4.0, growth_interval=1)
  opt = jaxamp.Optimizer(optax.sgd(0.1), {"w": jnp.ones(2)})
  scaler.scale(jnp.float32(1.0))
  opt.grads = {"w": jnp.ones(2)}
  scaler.unscale_(opt)
  opt.zero_grad()
  scaler.step(opt)
  scaler.update()
  assert opt.params["w"].tolist() == w.detach().tolist() == [1.0, 1.0]
  assert scaler.get_scale() == t_scaler.get_scale() == 8.0


def test_grad_scaler_step_refuses_a_none_gradient_momentum_cannot_skip():
  # optax's momentum would drop the leaf's trace (a state of another shape);
  # refused by name, nothing changed (it was an AttributeError from the skip).
  scaler = jaxamp.GradScaler(init_scale=4.0)
  params = {"a": jnp.ones(3), "b": jnp.ones(3)}
  opt = jaxamp.Optimizer(optax.sgd(0.1, momentum=0.9), params)
  scaler.scale(jnp.float32(1.0))
  opt.grads = {"a": None, "b": jnp.ones(3)}
  state_before = jax.tree.map(bits, opt.opt_state)
  with pytest.raises(ValueError, match=r"the gradient of \['a'\] is None"):
    scaler.step(opt)
  assert jax.tree.map(bits, opt.opt_state) == state_before
  assert opt.params is params
