"""``jaxamp.GradScaler``'s opt-in protections: the optax wrapper's options, torch-style."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

PARAMS = {"encoder": {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}, "head": jnp.ones(3)}


def _bits(tree):
  return [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(tree)]


def _grads(poison=None, value=1.0, params=PARAMS):
  grads = jax.tree.map(lambda p: jnp.full(p.shape, value, p.dtype), params)
  if poison == "encoder/b":
    grads["encoder"]["b"] = grads["encoder"]["b"].at[0].set(jnp.nan)
  elif poison == "head":
    grads["head"] = grads["head"].at[2].set(-jnp.inf)
  return grads


def _started(**kwargs):
  """A scaler that has scaled (so that its methods may run), and one optimizer."""
  scaler = jaxamp.GradScaler(**kwargs)
  scaler.scale(jnp.float32(1.0))
  return scaler, jaxamp.Optimizer(optax.sgd(0.1), PARAMS)


@jax.jit
def _iteration(scaler, opt, grads):
  opt.grads = grads
  scaler.step(opt)
  scaler.update()
  return scaler, opt


def _run(flags, **kwargs):
  """One jitted iteration per flag (True: inf in the grads); the scaler after each."""
  scaler, opt = _started(**kwargs)
  after = []
  for flag in flags:
    scaler, opt = _iteration(scaler, opt, _grads("head" if flag else None))
    after.append(scaler)
  return after


# ---------------------------------------------------------------------------------
# Each option, step by step (hand-derived values).
# ---------------------------------------------------------------------------------


def test_grad_scaler_defaults_keep_torch_rule_and_count_updates():
  # torch's trajectory A (docs/torch_semantics.md §5.1), inf at updates 4, 8, 9.
  flags = [i in (4, 8, 9) for i in range(16)]
  scalers = _run(flags, init_scale=8.0, growth_interval=3)
  assert [s.get_scale() for s in scalers] == [8, 8, 16, 16, 8, 8, 8, 16, 8, 4, 4, 4, 8, 8, 8, 16]
  assert [int(s.hysteresis_tracker) for s in scalers] == [1] * 16
  scalers = _run([1, 1, 0, 1, 0, 0])
  assert [int(s.skipped_updates) for s in scalers] == [1, 2, 2, 3, 3, 3]
  assert [int(s.consecutive_skipped_updates) for s in scalers] == [1, 2, 0, 1, 0, 0]
  assert [int(s.update_count) for s in scalers] == [1, 2, 3, 4, 5, 6]
  assert all(s.skipped_updates.dtype == jnp.int32 for s in scalers)


def test_grad_scaler_hysteresis_absorbs_overflows_but_still_skips():
  # hysteresis 2: the first overflow is absorbed (skipped, tracker reset, no
  # backoff), the second backs off; the budget refills only on growth.
  scaler, opt = _started(init_scale=64.0, growth_interval=2, hysteresis=2)
  scales, hyst, growth, params = [], [], [], []
  for flag in [1, 0, 1, 0, 0, 1]:
    scaler, opt = _iteration(scaler, opt, _grads("head" if flag else None))
    scales.append(scaler.get_scale())
    hyst.append(int(scaler.hysteresis_tracker))
    growth.append(scaler._get_growth_tracker())
    params.append(float(opt.params["head"][0]))
  assert scales == [64.0, 64.0, 32.0, 32.0, 64.0, 64.0]
  assert hyst == [1, 1, 1, 1, 2, 1]
  assert growth == [0, 1, 0, 1, 0, 0]
  # grads of 1 unscaled by the scale before each update; sgd(0.1) on clean updates only
  expected, value = [], 1.0
  for flag, scale in zip([1, 0, 1, 0, 0, 1], [64.0, 64.0, 64.0, 32.0, 32.0, 64.0]):
    if not flag:
      value = float(np.float32(value) - np.float32(0.1) * np.float32(1.0 / scale))
    expected.append(value)
  assert params == expected


@pytest.mark.parametrize(
  "consecutive, scales, trackers",
  [(False, [64.0, 64.0, 32.0, 16.0], [1, 1, 1, 1]), (True, [64.0, 64.0, 64.0, 32.0], [1, 2, 1, 1])],
)
def test_grad_scaler_consecutive_hysteresis_refills_on_every_clean_update(
  consecutive, scales, trackers
):
  scalers = _run(
    [1, 0, 1, 1],
    init_scale=64.0,
    growth_interval=3,
    hysteresis=2,
    consecutive_hysteresis=consecutive,
  )
  assert [s.get_scale() for s in scalers] == scales
  assert [int(s.hysteresis_tracker) for s in scalers] == trackers


def test_grad_scaler_min_loss_scale_floors_backoff():
  scalers = _run([1, 1, 1, 1], init_scale=8.0, min_loss_scale=2.0)
  assert [s.get_scale() for s in scalers] == [4.0, 2.0, 2.0, 2.0]


def test_grad_scaler_max_loss_scale_caps_growth():
  scalers = _run(
    [0, 0, 0, 0], init_scale=4.0, growth_interval=1, growth_factor=3.0, max_loss_scale=30.0
  )
  assert [s.get_scale() for s in scalers] == [12.0, 30.0, 30.0, 30.0]


@pytest.mark.parametrize("detect", [False, True])
@pytest.mark.parametrize("explicit_unscale", [False, True])
def test_grad_scaler_detect_unscale_overflow_per_optimizer(detect, explicit_unscale):
  # docs/torch_semantics.md §3.2: bf16 3e38 at scale 0.5 becomes inf once unscaled; torch steps.
  scaler = jaxamp.GradScaler(init_scale=0.5, detect_unscale_overflow=detect)
  scaler.scale(jnp.float32(1.0))
  opt1 = jaxamp.Optimizer(optax.sgd(0.1), {"w": jnp.ones(2, jnp.bfloat16)})
  opt2 = jaxamp.Optimizer(optax.sgd(0.1), {"v": jnp.ones(2, jnp.bfloat16)})
  opt1.grads = {"w": jnp.array([3e38, 1.0], jnp.bfloat16)}
  opt2.grads = {"v": jnp.array([1.0, 1.0], jnp.bfloat16)}
  if explicit_unscale:
    scaler.unscale_(opt1)
    scaler.unscale_(opt2)
  scaler.step(opt1)
  scaler.step(opt2)
  scaler.update()
  assert bool(jnp.all(opt1.params["w"] == 1.0)) == detect  # skipped only when detected
  tx = optax.sgd(0.1)  # opt2 steps with its grads unscaled by hand (1 / 0.5 = 2)
  updates, _ = tx.update({"v": jnp.full(2, 2.0, jnp.bfloat16)}, tx.init(opt2.params))
  assert _bits(opt2.params) == _bits(optax.apply_updates({"v": jnp.ones(2, jnp.bfloat16)}, updates))
  assert scaler.get_scale() == (0.25 if detect else 0.5)
  assert int(scaler.skipped_updates) == int(detect)
  assert scaler.nonfinite_leaf_paths(opt1) == (["['w']"] if detect else [])
  assert scaler.nonfinite_leaf_paths(opt2) == []


def test_grad_scaler_counts_one_skip_per_update_with_two_optimizers():
  scaler = jaxamp.GradScaler(init_scale=8.0, max_consecutive_skips=3)
  scaler.scale(jnp.float32(1.0))
  opt1 = jaxamp.Optimizer(optax.sgd(0.1), {"w": jnp.ones(2)})
  opt2 = jaxamp.Optimizer(optax.sgd(0.1), {"v": jnp.ones(2)})
  for inf1, inf2 in [(True, True), (False, True)]:  # one bad optimizer is enough
    opt1.grads = {"w": jnp.array([jnp.inf if inf1 else 1.0, 1.0])}
    opt2.grads = {"v": jnp.array([jnp.inf if inf2 else 1.0, 1.0])}
    scaler.step(opt1)
    scaler.step(opt2)
    scaler.update()
  assert int(scaler.skipped_updates) == int(scaler.consecutive_skipped_updates) == 2
  assert int(scaler.update_count) == 2
  assert scaler.get_scale() == 2.0  # one backoff per update


# ---------------------------------------------------------------------------------
# max_consecutive_skips.
# ---------------------------------------------------------------------------------

SKIP_LIMIT_ERROR = r"(?s)3 consecutive optimizer steps were skipped.*update 6.*0\.25"


def test_grad_scaler_max_consecutive_skips_raises_from_a_jitted_iteration():
  scaler, opt = _started(init_scale=8.0, max_consecutive_skips=3)
  for flag in [1, 1, 0, 1, 1]:  # never 3 in a row: no error
    scaler, opt = _iteration(scaler, opt, _grads("head" if flag else None))
  jax.block_until_ready((scaler, opt))
  assert int(scaler.consecutive_skipped_updates) == 2
  with pytest.raises(RuntimeError, match=SKIP_LIMIT_ERROR):
    jax.block_until_ready(_iteration(scaler, opt, _grads("head")))


def test_grad_scaler_max_consecutive_skips_outside_jit_changes_nothing():
  scaler, opt = _started(init_scale=8.0, max_consecutive_skips=3)
  for flag in [1, 1, 0, 1, 1]:
    opt.grads = _grads("head" if flag else None)
    scaler.step(opt)
    scaler.update()
  opt.grads = _grads("head")
  scaler.step(opt)
  before = jax.tree.flatten(scaler)
  with pytest.raises(RuntimeError, match=SKIP_LIMIT_ERROR):
    scaler.update()
  after = jax.tree.flatten(scaler)
  assert after[1] == before[1] and _bits(after[0]) == _bits(before[0])
  assert scaler.get_scale() == 0.5 and int(scaler.consecutive_skipped_updates) == 2


# ---------------------------------------------------------------------------------
# The same trajectory as dynamic_loss_scale: the loss-scale state bit for bit.
# ---------------------------------------------------------------------------------

OPTION_SETS = {
  "defaults": {"init_scale": 4.0, "growth_interval": 2},
  "bounds_hysteresis": {
    "init_scale": 16.0,
    "growth_interval": 2,
    "hysteresis": 3,
    "min_loss_scale": 0.25,
    "max_loss_scale": 64.0,
    "max_consecutive_skips": 50,
  },
  "consecutive_odd_factors": {
    "init_scale": 8.0,
    "growth_interval": 1,
    "growth_factor": 3.0,
    "backoff_factor": 0.3,
    "hysteresis": 2,
    "consecutive_hysteresis": True,
    "min_loss_scale": 0.7,
  },
  "detect": {
    "init_scale": 0.5,
    "growth_interval": 1,
    "hysteresis": 2,
    "max_loss_scale": 0.5,
    "min_loss_scale": 2.0**-10,
    "detect_unscale_overflow": True,
  },
}


def _poisoned(grads, kind, leaf):
  """kind 0: as is; 1: inf; 2: NaN; 3: 3e38, which overflows when unscaled below 1."""
  if kind == 0:
    return grads
  value = {1: jnp.inf, 2: jnp.nan, 3: 3e38}[kind]
  leaves, treedef = jax.tree.flatten(grads)
  leaves[leaf] = leaves[leaf].reshape(-1).at[0].set(value).reshape(leaves[leaf].shape)
  return jax.tree.unflatten(treedef, leaves)


@pytest.mark.parametrize("name", sorted(OPTION_SETS))
def test_grad_scaler_matches_dynamic_loss_scale_with_options(name):
  kwargs = OPTION_SETS[name]
  inner = optax.adam(0.01)
  tx = jaxamp.dynamic_loss_scale(inner, **kwargs)
  state = tx.init(PARAMS)
  core_params = PARAMS
  core_update = jax.jit(tx.update)
  scaler, opt = _started(**kwargs)
  opt = jaxamp.Optimizer(inner, PARAMS)
  rng = np.random.default_rng(5)
  detected_only_by_unscaling = 0
  for i in range(40):
    raw = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), PARAMS)
    scale = jaxamp.get_loss_scale(state)
    grads = jax.tree.map(lambda g, scale=scale: g * scale, raw)
    kind = int(rng.choice(4, p=[0.5, 0.2, 0.1, 0.2]))
    grads = _poisoned(grads, kind, int(rng.integers(3)))
    updates, state = core_update(grads, state, core_params)
    core_params = optax.apply_updates(core_params, updates)
    if kind == 3 and bool(state.found_inf):
      detected_only_by_unscaling += 1
    scaler, opt = _iteration(scaler, opt, grads)

    assert _bits(scaler.loss_scale) == _bits(state.loss_scale), i
    assert int(scaler.growth_tracker) == int(state.growth_tracker), i
    assert int(scaler.hysteresis_tracker) == int(state.hysteresis_tracker), i
    assert int(scaler.skipped_updates) == int(state.skipped_steps), i
    assert int(scaler.consecutive_skipped_updates) == int(state.consecutive_skipped_steps), i
    assert int(scaler.update_count) == int(state.update_count), i
    assert _bits(opt.nonfinite_leaves) == _bits(state.nonfinite_leaves), i
    # Adam's own arithmetic runs in two XLA programs that fuse it differently
    # (FMA contraction): equal to the last few bits, not bit for bit.
    for ours, core in zip(jax.tree.leaves((opt.params, opt.opt_state)),
                          jax.tree.leaves((core_params, state.inner_state))):
      np.testing.assert_allclose(np.asarray(ours), np.asarray(core), rtol=1e-5, atol=1e-7)
  assert int(state.skipped_steps) >= 8  # the options were exercised
  assert (detected_only_by_unscaling > 0) == (name == "detect")
  if "min_loss_scale" in kwargs:
    assert scaler.get_scale() >= kwargs["min_loss_scale"]


def test_grad_scaler_jitted_iteration_with_options_compiles_once_without_transfers():
  kwargs = {
    "init_scale": 8.0,
    "growth_interval": 2,
    "min_loss_scale": 1.0,
    "max_loss_scale": 16.0,
    "hysteresis": 2,
    "consecutive_hysteresis": True,
    "max_consecutive_skips": 5,
    "detect_unscale_overflow": True,
  }
  scaler = jaxamp.GradScaler(**kwargs)
  opt = jaxamp.Optimizer(optax.adam(0.1), {"w": jnp.array([1.0, -2.0, 3.0])})
  traces = []

  @jax.jit
  def train_step(scaler, opt, x, inject):
    traces.append(1)
    opt.zero_grad()
    opt.grads = jax.grad(lambda p: scaler.scale(jnp.sum((p["w"] * x) ** 2)))(opt.params)
    opt.grads = {"w": opt.grads["w"].at[0].multiply(inject)}
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    return scaler, opt

  x = jnp.array([0.5, 1.0, 1.5])
  injections = [jnp.float32(v) for v in (1, jnp.inf, 1, 1, 1, 1, jnp.nan, jnp.inf, jnp.inf, 1)]
  scales = []
  with jax.transfer_guard("disallow"):
    for inject in injections:
      scaler, opt = train_step(scaler, opt, x, inject)
      scales.append(scaler.loss_scale)
  assert len(traces) == 1
  # hysteresis 2 refilled on every clean update: one overflow is absorbed, two
  # in a row back off; growth every 2 clean updates, capped at 16, floored at 1.
  assert [float(s) for s in scales] == [8, 8, 8, 16, 16, 16, 16, 8, 4, 4]
  assert int(scaler.skipped_updates) == 4 and int(scaler.update_count) == 10
  assert scaler.nonfinite_leaf_paths(opt) == ["['w']"]


# ---------------------------------------------------------------------------------
# Decisions: new_scale, state dicts, diagnostics, disabled, bad options.
# ---------------------------------------------------------------------------------


def test_grad_scaler_update_new_scale_leaves_hysteresis_and_counters():
  scaler, opt = _started(init_scale=8.0, hysteresis=3, max_loss_scale=16.0)
  scaler, opt = _iteration(scaler, opt, _grads("head"))
  assert int(scaler.hysteresis_tracker) == 2 and int(scaler.skipped_updates) == 1
  opt.grads = _grads("head")
  scaler.step(opt)
  scaler.update(new_scale=64.0)  # ignores the flags, not clamped
  assert scaler.get_scale() == 64.0
  assert int(scaler.hysteresis_tracker) == 2
  assert int(scaler.skipped_updates) == 1 and int(scaler.update_count) == 1
  scaler, opt = _iteration(scaler, opt, _grads())  # the bound applies again
  assert scaler.get_scale() == 16.0


def test_grad_scaler_state_dict_keeps_torch_keys_and_load_keeps_option_state():
  scaler, opt = _started(init_scale=8.0, hysteresis=3, min_loss_scale=1.0)
  scaler, opt = _iteration(scaler, opt, _grads("head"))
  sd = scaler.state_dict()
  assert sd == {
    "scale": 8.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2000,
    "_growth_tracker": 0,
  }
  scaler.load_state_dict({**sd, "scale": 0.5})  # below the floor: loaded as given
  assert scaler.get_scale() == 0.5
  assert int(scaler.hysteresis_tracker) == 2 and int(scaler.skipped_updates) == 1
  scaler, opt = _iteration(scaler, opt, _grads("head"))
  assert scaler.get_scale() == 1.0  # absorbed overflow, then clamped to the floor


def test_grad_scaler_nonfinite_leaf_paths_per_optimizer():
  scaler, opt = _started()
  assert scaler.nonfinite_leaf_paths(opt) == []
  scaler, opt = _iteration(scaler, opt, _grads("encoder/b"))
  assert scaler.nonfinite_leaf_paths(opt) == ["['encoder']['b']"]
  scaler, opt = _iteration(scaler, opt, _grads())  # a clean step keeps the last report
  assert scaler.nonfinite_leaf_paths(opt) == ["['encoder']['b']"]
  scaler, opt = _iteration(scaler, opt, _grads("head"))
  assert scaler.nonfinite_leaf_paths(opt) == ["['head']"]
  # A None gradient (a frozen leaf) counts as finite; unscale_ alone records too.
  opt.grads = {"encoder": {"w": None, "b": _grads("encoder/b")["encoder"]["b"]}, "head": None}
  scaler.unscale_(opt)
  scaler.update()
  assert scaler.nonfinite_leaf_paths(opt) == ["['encoder']['b']"]
  with pytest.raises(TypeError, match="expects a jaxamp.Optimizer"):
    scaler.nonfinite_leaf_paths(optax.sgd(0.1))


def test_grad_scaler_options_survive_pytree_round_trips():
  scaler, _ = _started(init_scale=8.0, min_loss_scale=4.0, hysteresis=2)
  rebuilt = jax.tree.map(lambda x: x, scaler)
  assert jax.tree.structure(rebuilt) == jax.tree.structure(scaler)
  opt = jaxamp.Optimizer(optax.sgd(0.1), PARAMS)
  for _ in range(4):
    rebuilt, opt = _iteration(rebuilt, opt, _grads("head"))
  assert rebuilt.get_scale() == 4.0  # absorbed, 4, floor, floor
  assert jax.tree.structure(rebuilt) == jax.tree.structure(scaler)


def test_grad_scaler_disabled_ignores_options():
  scaler = jaxamp.GradScaler(enabled=False, hysteresis=0, max_consecutive_skips=0)
  opt = jaxamp.Optimizer(optax.sgd(1.0), {"w": jnp.array([1.0])})
  opt.grads = {"w": jnp.array([jnp.inf])}
  scaler.step(opt)
  scaler.update()
  assert opt.params["w"].tolist() == [-float("inf")]
  assert int(scaler.skipped_updates) == int(scaler.update_count) == 0
  assert int(scaler.hysteresis_tracker) == 1
  assert scaler.nonfinite_leaf_paths(opt) == []
  assert scaler.state_dict() == {}


@pytest.mark.parametrize(
  "kwargs,error,message",
  [
    ({"min_loss_scale": 8.0, "max_loss_scale": 4.0}, ValueError, "must not be above"),
    ({"min_loss_scale": 0.0}, ValueError, "min_loss_scale must be a finite positive"),
    ({"max_loss_scale": float("inf")}, ValueError, "max_loss_scale must be a finite"),
    ({"max_loss_scale": 1e39}, ValueError, "max_loss_scale must be a finite"),
    ({"init_scale": 2.0, "min_loss_scale": 4.0}, ValueError, "below min_loss_scale"),
    ({"init_scale": 64.0, "max_loss_scale": 4.0}, ValueError, "above max_loss_scale"),
    ({"hysteresis": 0}, ValueError, "hysteresis must be >= 1"),
    ({"hysteresis": 1.5}, TypeError, "hysteresis must be an int"),
    ({"max_consecutive_skips": 0}, ValueError, "max_consecutive_skips must be >= 1"),
    ({"max_consecutive_skips": True}, TypeError, "max_consecutive_skips must be an int"),
    ({"min_loss_scale": True}, TypeError, "min_loss_scale must be a real Python number"),
    ({"min_loss_scale": jnp.float32(2.0)}, TypeError, "static Python numbers"),
    ({"hysteresis": jnp.int32(2)}, TypeError, "static Python numbers"),
  ],
)
def test_grad_scaler_rejects_bad_options(kwargs, error, message):
  with pytest.raises(error, match=message):
    jaxamp.GradScaler(**kwargs)
  # the optax wrapper rejects the same values, with the same message
  if "static Python numbers" not in message and "real Python number" not in message:
    with pytest.raises(error, match=message):
      jaxamp.dynamic_loss_scale(optax.sgd(0.1), **kwargs)


def test_grad_scaler_options_are_keyword_only():
  with pytest.raises(TypeError):
    jaxamp.GradScaler(2.0**16, 2.0, 0.5, 2000, True, 2.0)
