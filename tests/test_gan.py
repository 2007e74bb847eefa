"""Optimizers that step one after the other with one loss scale: a GAN (issue #31, item 2).

torch's loop, run live::

  scaler.scale(loss_d).backward(); scaler.step(opt_d)        # D steps
  scaler.scale(loss_g).backward(); scaler.step(opt_g)        # G's loss reads the new D
  scaler.update()                                            # one advance, found_infs OR-ed

against the optax form (``tx.update(..., update_scale=False)``, then ``tx.update``;
``apply_scaled_updates`` the same way; the two steps in one ``jit`` or in two) and
``jaxamp.GradScaler`` with two ``jaxamp.Optimizer``. inf/NaN are written into either
model's scaled gradients at chosen iterations. Compared after every iteration: the
scale's float32 bits, the growth tracker and each optimizer's skip exactly; Adam's step
counts exactly; params to ``PARAM_RTOL`` and Adam's moments to ``STATE_RTOL``, as
``max |jaxamp - torch| / max |torch|`` per tensor (the parity suite's measure). torch's
CPU GEMM and XLA's dot sum in different orders, and the generator's gradients pass
through both models, whose batch means cancel: the first iteration's moments (a tenth
of the gradients) already differ by 2.8e-6, and over the 12 iterations the params by at
most 3.0e-6 and the moments by 1.1e-5 (measured). A missed or extra step moves a moment
by O(1) relative and a param by the learning rate, decades above both tolerances.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import bits

import jaxamp

torch = pytest.importorskip("torch")

PARAM_RTOL = 1e-5
STATE_RTOL = 1e-4
ITERATIONS = 12
SCALER = {"init_scale": 2.0**10, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2}
# {iteration: {"d" or "g": (parameter, flat index, value)}}, written into the scaled grads.
INJECT = {
  2: {"d": ("0.weight", 3, np.inf)},
  3: {"g": ("2.bias", 1, np.nan)},
  6: {"d": ("2.weight", 0, -np.inf), "g": ("0.weight", 5, np.inf)},
  9: {"g": ("0.bias", 2, np.inf)},
}
ADAM = {"lr": 1e-2, "betas": (0.5, 0.999), "eps": 1e-8}


def _batch(iteration):
  rng = np.random.default_rng([31, iteration])
  real = (rng.standard_normal((16, 3)) + np.array([1.0, -2.0, 0.5])).astype(np.float32)
  return real, rng.standard_normal((16, 2)).astype(np.float32)


def _torch_models():
  torch.manual_seed(0)
  g = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
  d = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
  return d, g


def _numpy_params(module):
  return {name: p.detach().numpy().copy() for name, p in module.named_parameters()}


def _found_inf(scaler, opt):
  return bool(
    sum(v.item() for v in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values())
  )


def _adam_state(opt, module):
  names = {id(p): n for n, p in module.named_parameters()}
  out = {}
  for p, state in opt.state.items():
    n = names[id(p)]
    out[n] = (
      float(state["step"]),
      state["exp_avg"].numpy().copy(),
      state["exp_avg_sq"].numpy().copy(),
    )
  return out


def _torch_run():
  """torch's GAN loop (least-squares losses); per iteration what the test compares."""
  d, g = _torch_models()
  initial = _initial_params()
  opt_d = torch.optim.Adam(d.parameters(), **ADAM)
  opt_g = torch.optim.Adam(g.parameters(), **ADAM)
  scaler = torch.amp.GradScaler("cpu", **SCALER)
  modules = {"d": d, "g": g}
  trajectory = []
  for i in range(ITERATIONS):
    real, z = (torch.from_numpy(a) for a in _batch(i))
    scale_used = np.float32(scaler.get_scale())
    opt_d.zero_grad(set_to_none=True)
    fake = g(z)
    loss_d = 0.5 * ((d(real) - 1) ** 2).mean() + 0.5 * (d(fake.detach()) ** 2).mean()
    scaler.scale(loss_d).backward()
    _torch_inject(modules["d"], INJECT.get(i, {}).get("d"))
    scaler.step(opt_d)
    opt_g.zero_grad(set_to_none=True)
    loss_g = 0.5 * ((d(fake) - 1) ** 2).mean()
    scaler.scale(loss_g).backward()
    _torch_inject(modules["g"], INJECT.get(i, {}).get("g"))
    scaler.step(opt_g)
    found = [_found_inf(scaler, opt_d), _found_inf(scaler, opt_g)]
    scaler.update()
    trajectory.append(
      {
        "scale_used": scale_used,
        "scale": np.float32(scaler.get_scale()),
        "tracker": scaler._get_growth_tracker(),
        "found": found,
        "params": {"d": _numpy_params(d), "g": _numpy_params(g)},
        "adam": {"d": _adam_state(opt_d, d), "g": _adam_state(opt_g, g)},
      }
    )
  return initial, trajectory


def _torch_inject(module, injection):
  if injection is not None:
    name, index, value = injection
    with torch.no_grad():
      dict(module.named_parameters())[name].grad.view(-1)[index] = value


# -- the same GAN in JAX, params in torch's layout ---------------------------------------


def _mlp(p, x):
  hidden = jax.nn.relu(x @ p["0.weight"].T + p["0.bias"])
  return hidden @ p["2.weight"].T + p["2.bias"]


def _loss_d(d, g, real, z):
  fake = jax.lax.stop_gradient(_mlp(g, z))
  return 0.5 * jnp.mean((_mlp(d, real) - 1) ** 2) + 0.5 * jnp.mean(_mlp(d, fake) ** 2)


def _loss_g(g, d, z):
  return 0.5 * jnp.mean((_mlp(d, _mlp(g, z)) - 1) ** 2)


def _injections(params):
  """Per iteration, per model: a mask and a value to write into its scaled grads
  (arrays, so one compilation serves every iteration)."""
  out = []
  for i in range(ITERATIONS):
    masks, values = {}, {}
    for model in ("d", "g"):
      mask = {n: np.zeros(p.shape, bool) for n, p in params[model].items()}
      value = {n: np.zeros(p.shape, np.float32) for n, p in params[model].items()}
      injection = INJECT.get(i, {}).get(model)
      if injection is not None:
        name, index, v = injection
        mask[name].reshape(-1)[index] = True
        value[name].reshape(-1)[index] = v
      masks[model], values[model] = mask, value
    out.append(jax.device_put((masks, values)))
  return out


def _injected(grads, mask, value):
  return jax.tree.map(jnp.where, mask, value, grads)


def _adam():
  return optax.adam(ADAM["lr"], b1=ADAM["betas"][0], b2=ADAM["betas"][1], eps=ADAM["eps"])


def _transform():
  return jaxamp.dynamic_loss_scale(
    {"d": _adam(), "g": _adam()}, param_labels={"d": "d", "g": "g"}, **SCALER
  )


def _optax_d_step(tx, fused, params, state, real, z, masks, values):
  def scaled_loss_d(d):
    return jaxamp.scale_loss(_loss_d(d, params["g"], real, z), state)

  grads_d = _injected(jax.grad(scaled_loss_d)(params["d"]), masks["d"], values["d"])
  if fused:
    params, state = jaxamp.apply_scaled_updates(
      tx, {"d": grads_d, "g": None}, state, params, update_scale=False
    )
  else:
    updates, state = tx.update({"d": grads_d, "g": None}, state, params, update_scale=False)
    params = {**params, "d": optax.apply_updates(params["d"], updates["d"])}
  return params, state, state.found_inf  # D's own: nothing stepped before it


def _optax_g_step(tx, fused, params, state, z, masks, values):
  def scaled_loss_g(g):  # the discriminator just updated
    return jaxamp.scale_loss(_loss_g(g, params["d"], z), state)

  grads_g = _injected(jax.grad(scaled_loss_g)(params["g"]), masks["g"], values["g"])
  if fused:
    params, state = jaxamp.apply_scaled_updates(tx, {"d": None, "g": grads_g}, state, params)
  else:
    updates, state = tx.update({"d": None, "g": grads_g}, state, params)
    params = {**params, "g": optax.apply_updates(params["g"], updates["g"])}
  return params, state


def _optax_run(initial, fused, one_jit):
  tx = _transform()
  params = jax.device_put(initial)
  state = tx.init(params)
  n_d = len(jax.tree.leaves(params["d"]))

  def d_step(params, state, real, z, masks, values):
    return _optax_d_step(tx, fused, params, state, real, z, masks, values)

  def g_step(params, state, z, masks, values):
    params, state = _optax_g_step(tx, fused, params, state, z, masks, values)
    # The flags of G's leaves this iteration (they hold the last skipped one's otherwise).
    found_g = state.found_inf & jnp.any(state.nonfinite_leaves[n_d:])
    return params, state, found_g

  def iteration(params, state, real, z, masks, values):
    params, state, found_d = d_step(params, state, real, z, masks, values)
    params, state, found_g = g_step(params, state, z, masks, values)
    return params, state, found_d, found_g

  iteration_jit, d_jit, g_jit = jax.jit(iteration), jax.jit(d_step), jax.jit(g_step)
  trajectory = []
  for i, (masks, values) in enumerate(_injections(initial)):
    real, z = jax.device_put(_batch(i))
    scale_used = jax.device_get(jaxamp.get_loss_scale(state))
    with jax.transfer_guard("disallow"):  # no host read inside the iteration
      if one_jit:
        params, state, found_d, found_g = iteration_jit(params, state, real, z, masks, values)
      else:
        params, state, found_d = d_jit(params, state, real, z, masks, values)
        assert state.stepped_groups.labels == ("d",)
        params, state, found_g = g_jit(params, state, z, masks, values)
    assert state.stepped_groups.labels == ()
    inner = state.inner_state.inner_states
    trajectory.append(
      {
        "scale_used": scale_used,
        "scale": np.asarray(state.loss_scale),
        "tracker": int(state.growth_tracker),
        "found": [bool(found_d), bool(found_g)],
        "params": jax.device_get(params),
        "adam": {m: _optax_adam(inner[m].inner_state[0], m) for m in ("d", "g")},
      }
    )
  compiled = (iteration_jit,) if one_jit else (d_jit, g_jit)
  return trajectory, [f._cache_size() for f in compiled]


def _optax_adam(adam_state, model=None):
  """Adam's state by parameter name (``model``: the group's subtree of the moments)."""
  count = float(adam_state.count)
  mu, nu = (
    (adam_state.mu, adam_state.nu)
    if model is None
    else (adam_state.mu[model], adam_state.nu[model])
  )
  return {n: (count, np.asarray(mu[n]), np.asarray(nu[n])) for n in mu}


def _grad_scaler_run(initial):
  scaler = jaxamp.GradScaler(**SCALER)
  opt_d = jaxamp.Optimizer(_adam(), jax.device_put(initial["d"]))
  opt_g = jaxamp.Optimizer(_adam(), jax.device_put(initial["g"]))

  @jax.jit
  def iteration(scaler, opt_d, opt_g, real, z, masks, values):
    opt_d.zero_grad()
    grads = jax.grad(lambda d: scaler.scale(_loss_d(d, opt_g.params, real, z)))(opt_d.params)
    opt_d.grads = _injected(grads, masks["d"], values["d"])
    scaler.step(opt_d)
    opt_g.zero_grad()
    grads = jax.grad(lambda g: scaler.scale(_loss_g(g, opt_d.params, z)))(opt_g.params)
    opt_g.grads = _injected(grads, masks["g"], values["g"])
    scaler.step(opt_g)
    found = [scaler._states[opt._key].found_inf for opt in (opt_d, opt_g)]
    scaler.update()
    return scaler, opt_d, opt_g, found

  trajectory = []
  for i, (masks, values) in enumerate(_injections(initial)):
    real, z = jax.device_put(_batch(i))
    scale_used = np.float32(scaler.get_scale())
    with jax.transfer_guard("disallow"):
      scaler, opt_d, opt_g, found = iteration(scaler, opt_d, opt_g, real, z, masks, values)
    trajectory.append(
      {
        "scale_used": scale_used,
        "scale": np.float32(scaler.get_scale()),
        "tracker": scaler._get_growth_tracker(),
        "found": [bool(f) for f in found],
        "params": jax.device_get({"d": opt_d.params, "g": opt_g.params}),
        "adam": {m: _optax_adam(o.opt_state[0]) for m, o in (("d", opt_d), ("g", opt_g))},
      }
    )
  return trajectory, [iteration._cache_size()]


def _assert_close(got, want, rtol, what):
  """``max |got - want| / max |want|`` within ``rtol``, the parity suite's measure."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert np.max(np.abs(got - want)) <= rtol * np.max(np.abs(want)), what


def _assert_matches(ours, torch_trajectory):
  skipped = {"d": 0, "g": 0}
  for i, (j, t) in enumerate(zip(ours, torch_trajectory, strict=True)):
    assert bits(j["scale_used"]) == bits(t["scale_used"]), i
    assert bits(np.float32(j["scale"])) == bits(t["scale"]), (i, j["scale"], t["scale"])
    assert j["tracker"] == t["tracker"], i
    assert j["found"] == t["found"], (i, j["found"], t["found"])
    for m, found in zip(("d", "g"), t["found"]):
      skipped[m] += found
      for name, value in t["params"][m].items():
        _assert_close(j["params"][m][name], value, PARAM_RTOL, (i, m, name))
      for name, (step, mu, nu) in t["adam"][m].items():
        got_step, got_mu, got_nu = j["adam"][m][name]
        assert got_step == step, (i, m, name)
        _assert_close(got_mu, mu, STATE_RTOL, (i, m, name, "exp_avg"))
        _assert_close(got_nu, nu, STATE_RTOL, (i, m, name, "exp_avg_sq"))
  # The script exercises each case: D alone, G alone and both skipping.
  assert skipped == {"d": 2, "g": 3}


@pytest.fixture(scope="module")
def torch_gan():
  return _torch_run()


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize(
  "fused, one_jit",
  [(False, True), (True, True), (False, False), (True, False)],
  ids=[
    "update-one-jit",
    "apply_scaled_updates-one-jit",
    "update-two-jits",
    "apply_scaled_updates-two-jits",
  ],
)
def test_gan_optax_form_matches_torch(torch_gan, fused, one_jit):
  initial, torch_trajectory = torch_gan
  ours, cache_sizes = _optax_run(initial, fused, one_jit)
  _assert_matches(ours, torch_trajectory)
  assert cache_sizes == [1] * len(cache_sizes)  # no recompilation across iterations


@pytest.mark.torch
def test_gan_grad_scaler_matches_torch(torch_gan):
  initial, torch_trajectory = torch_gan
  ours, cache_sizes = _grad_scaler_run(initial)
  _assert_matches(ours, torch_trajectory)
  assert cache_sizes == [1]


def test_gan_iteration_is_one_computation_without_host_callbacks():
  """The whole optax-form iteration (both steps) traces to one jaxpr with no
  callback, so it runs without a host round trip; the controls show that the
  check sees a callback and that the transfer guard of the runs above refuses
  an implicit transfer."""
  initial = _initial_params()
  tx = _transform()
  params = jax.device_put(initial)
  state = tx.init(params)
  masks, values = _injections(initial)[0]
  real, z = jax.device_put(_batch(0))

  def iteration(params, state, with_callback=False):
    params, state, _ = _optax_d_step(tx, True, params, state, real, z, masks, values)
    if with_callback:
      jax.debug.callback(lambda x: None, state.found_inf)
    return _optax_g_step(tx, True, params, state, z, masks, values)

  jaxpr = str(jax.make_jaxpr(iteration)(params, state))
  assert "callback" not in jaxpr
  assert "callback" in str(jax.make_jaxpr(lambda p, s: iteration(p, s, True))(params, state))
  with pytest.raises(Exception, match="[Dd]isallowed"), jax.transfer_guard("disallow"):
    jax.jit(jnp.negative)(np.ones(2, np.float32))


def _initial_params():
  d, g = _torch_models()
  return {"d": _numpy_params(d), "g": _numpy_params(g)}


# -- the idle group, and misuse ------------------------------------------------------------

PARAMS = {"d": {"w": jnp.arange(3.0), "b": jnp.ones(1)}, "g": {"w": -jnp.arange(2.0)}}


def _grads(model, value=1.0):
  return jax.tree.map(lambda p: jnp.full_like(p, value), PARAMS[model])


def test_idle_group_is_not_stepped_its_state_and_params_untouched():
  """A group given None gradients is torch's optimizer whose step() is not called:
  Adam's count and moments, and its params, come back bit for bit (with zeros
  instead of None, Adam would count a step and move the params)."""
  tx = _transform()
  state = tx.init(PARAMS)
  _, state = tx.update({"d": _grads("d"), "g": _grads("g")}, state, PARAMS)  # moments nonzero
  params = jax.tree.map(jnp.copy, PARAMS)
  new_params, new_state = jax.jit(
    lambda p, s: jaxamp.apply_scaled_updates(tx, {"d": _grads("d", 2.0), "g": None}, s, p)
  )(params, state)
  idle, was = new_state.inner_state.inner_states["g"], state.inner_state.inner_states["g"]
  assert bits(idle) == bits(was)
  assert bits(new_params["g"]) == bits(PARAMS["g"])
  assert int(new_state.inner_state.inner_states["d"].inner_state[0].count) == 2
  updates, _ = tx.update({"d": None, "g": _grads("g")}, state, PARAMS)
  assert updates["d"] == {"b": None, "w": None}


def test_group_stepped_twice_before_the_scale_advances_is_refused():
  """torch refuses step() twice before update(); forgetting the iteration's
  last update (update_scale=True) is found at the next step of the first group."""
  tx = _transform()
  _, state = tx.update({"d": _grads("d"), "g": None}, tx.init(PARAMS), PARAMS, update_scale=False)
  with pytest.raises(
    ValueError, match="'d' was already stepped since the loss scale last advanced"
  ):
    jax.jit(lambda s: tx.update({"d": _grads("d"), "g": None}, s, PARAMS, update_scale=False))(
      state
    )
  with pytest.raises(ValueError, match="already stepped"):
    tx.update({"d": _grads("d"), "g": _grads("g")}, state, PARAMS)


def test_update_scale_false_needs_several_groups():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1))
  with pytest.raises(ValueError, match="needs several: build dynamic_loss_scale"):
    tx.update(_grads("d"), tx.init(PARAMS["d"]), PARAMS["d"], update_scale=False)


def test_update_scale_must_be_a_python_bool():
  tx = _transform()
  with pytest.raises(TypeError, match="update_scale must be True or False"):
    tx.update({"d": _grads("d"), "g": None}, tx.init(PARAMS), PARAMS, update_scale=jnp.array(False))


def test_all_none_gradients_advance_only_a_pending_scale():
  """Every gradient None: torch's update() alone, allowed when a step awaits it
  (the same state as the last group's update would give); refused otherwise,
  as torch's "No inf checks were recorded prior to update."."""
  tx = _transform()
  state = tx.init(PARAMS)
  none = {"d": None, "g": None}
  with pytest.raises(ValueError, match="every gradient is None, so no group steps"):
    tx.update(none, state, PARAMS)
  inf = {"d": {"w": jnp.array([1.0, jnp.inf, 1.0]), "b": jnp.ones(1)}, "g": None}
  _, pending = tx.update(inf, state, PARAMS, update_scale=False)
  with pytest.raises(ValueError, match="every gradient is None"):
    tx.update(none, pending, PARAMS, update_scale=False)
  _, advanced = tx.update(none, pending, PARAMS)
  assert advanced.stepped_groups.labels == ()
  assert float(advanced.loss_scale) == 2.0**9 and int(advanced.skipped_steps) == 1
  _, both = tx.update({**inf, "g": _grads("g", 0.0)}, state, PARAMS)
  assert bits(advanced._replace(inner_state=None)) == bits(both._replace(inner_state=None))


def test_flax_utils_update_refuses_to_hold_the_scale():
  """nnx.Optimizer keeps only the state's arrays: the record of the groups
  stepped would be dropped (measured: nnx.Optimizer.update leaves
  stepped_groups empty), so flax_utils.update refuses update_scale=False."""
  from flax import nnx

  from jaxamp import flax_utils

  model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, jaxamp.dynamic_loss_scale(optax.sgd(0.1)), wrt=nnx.Param)
  grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
  before = bits(jax.tree.leaves(nnx.state(model)))
  with pytest.raises(ValueError, match="cannot hold the scale's advance"):
    flax_utils.update(optimizer, model, grads, update_scale=False)
  assert bits(jax.tree.leaves(nnx.state(model))) == before
