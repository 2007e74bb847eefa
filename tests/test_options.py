"""The options: the opt-in protections beyond torch (clamps, hysteresis, skip
limit, diagnostics), and the front-ends' signatures and docs of them.

The behaviour both front-ends share is tested once, parametrized by front-end
(``dynamic_loss_scale`` through ``tx.update``; ``GradScaler`` + ``Optimizer``
through scale/step/update), with hand-derived or reference values. What only
one front-end has follows, per front-end.
"""

import dataclasses
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
  FRONT_ENDS,
  PARAMS,
  bits,
  filled,
  jitted_unscale_loop,
  make_grads,
  run_front_end,
)

import jaxamp
from jaxamp._config import LossScaleConfig

CLEAN = filled(PARAMS)
HEAD_INF = ("head", 2, -jnp.inf)
ENCODER_B_NAN = ("encoder/b", 0, jnp.nan)
SKIP_LIMIT_ERROR = r"(?s)3 consecutive optimizer steps were skipped.*update 6.*0\.25"

front_ends = pytest.mark.parametrize("front_end", FRONT_ENDS)


def _scales(steps):
  return [float(s.loss_scale) for s in steps]


# ---------------------------------------------------------------------------------
# Common to both front-ends.
# ---------------------------------------------------------------------------------


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


@pytest.mark.slow
@front_ends
@pytest.mark.parametrize("hysteresis", [1, 2, 3])
@pytest.mark.parametrize("consecutive", [False, True])
def test_hysteresis_matches_deepspeed_step_by_step(front_end, hysteresis, consecutive):
  options = {
    "init_scale": 1024.0,
    "growth_interval": 3,
    "hysteresis": hysteresis,
    "consecutive_hysteresis": consecutive,
  }
  scales = _scales(run_front_end(front_end, options, FLAGS))
  assert scales == _deepspeed_reference(1024.0, 2.0, 3, hysteresis, consecutive, FLAGS)


@front_ends
def test_hysteresis_absorbs_overflows_but_still_skips(front_end):
  # hysteresis 2: the first overflow is absorbed (skipped, tracker reset, no
  # backoff), the second backs off; without consecutive_hysteresis the budget
  # refills only on growth, so a later single overflow backs off at once.
  flags = [1, 0, 1, 0, 0, 1]
  options = {"init_scale": 64.0, "growth_interval": 2, "hysteresis": 2}
  steps = run_front_end(front_end, options, flags)
  assert _scales(steps) == [64.0, 64.0, 32.0, 32.0, 64.0, 64.0]
  assert [s.hysteresis_tracker for s in steps] == [1, 1, 1, 1, 2, 1]
  assert [s.found_inf for s in steps] == [True, False, True, False, False, True]
  assert [s.growth_tracker for s in steps] == [0, 1, 0, 1, 0, 0]
  # grads of 1 unscaled by the scale before each update; sgd(0.1) on clean updates only
  expected, value = [], 1.0
  for flag, scale in zip(flags, [64.0, 64.0, 64.0, 32.0, 32.0, 64.0]):
    if not flag:
      value = float(np.float32(value) - np.float32(0.1) * np.float32(1.0 / scale))
    expected.append(value)
  assert [float(s.params["head"][0]) for s in steps] == expected


@front_ends
@pytest.mark.parametrize(
  "consecutive, scales, trackers",
  [(False, [64.0, 64.0, 32.0, 16.0], [1, 1, 1, 1]), (True, [64.0, 64.0, 64.0, 32.0], [1, 2, 1, 1])],
)
def test_consecutive_hysteresis_refills_on_every_clean_step(
  front_end, consecutive, scales, trackers
):
  options = {
    "init_scale": 64.0,
    "growth_interval": 3,
    "hysteresis": 2,
    "consecutive_hysteresis": consecutive,
  }
  steps = run_front_end(front_end, options, [1, 0, 1, 1])
  assert _scales(steps) == scales
  assert [s.hysteresis_tracker for s in steps] == trackers


@front_ends
def test_min_loss_scale_floors_backoff(front_end):
  steps = run_front_end(front_end, {"init_scale": 8.0, "min_loss_scale": 2.0}, [1, 1, 1, 1])
  assert _scales(steps) == [4.0, 2.0, 2.0, 2.0]


@pytest.mark.slow
@front_ends
def test_min_loss_scale_unset_lets_the_scale_collapse_to_zero(front_end):
  # Without it the scale collapses (torch): 8 * 0.5**200 is 0.
  steps = run_front_end(front_end, {"init_scale": 8.0}, [1] * 200)
  assert float(steps[-1].loss_scale) == 0.0


@pytest.mark.slow
@front_ends
def test_max_loss_scale_caps_growth(front_end):
  options = {"init_scale": 4.0, "growth_interval": 1, "growth_factor": 3.0, "max_loss_scale": 30.0}
  assert _scales(run_front_end(front_end, options, [0, 0, 0, 0])) == [12.0, 30.0, 30.0, 30.0]


@front_ends
def test_default_options_keep_torchs_trajectory_a(front_end):
  # The options off: torch's trajectory A (docs/torch_semantics.md §5.1) with inf at updates 4, 8, 9.
  flags = [i in (4, 8, 9) for i in range(16)]
  steps = run_front_end(front_end, {"init_scale": 8.0, "growth_interval": 3}, flags)
  assert _scales(steps) == [8, 8, 16, 16, 8, 8, 8, 16, 8, 4, 4, 4, 8, 8, 8, 16]
  assert [s.hysteresis_tracker for s in steps] == [1] * 16


@pytest.mark.slow
@front_ends
def test_skip_counters_count_skipped_steps_and_updates(front_end):
  # optax: skipped_steps, consecutive_skipped_steps; GradScaler: the *_updates twins.
  steps = run_front_end(front_end, {}, [1, 1, 0, 1, 0, 0])
  assert [int(s.skipped) for s in steps] == [1, 2, 2, 3, 3, 3]
  assert [int(s.consecutive_skipped) for s in steps] == [1, 2, 0, 1, 0, 0]
  assert [int(s.update_count) for s in steps] == [1, 2, 3, 4, 5, 6]
  assert all(s.skipped.dtype == jnp.int32 for s in steps)


@pytest.mark.slow
@front_ends
def test_max_consecutive_skips_raises_from_a_jitted_step(front_end):
  options = {"init_scale": 8.0, "max_consecutive_skips": 3}
  steps = run_front_end(front_end, options, [1, 1, 0, 1, 1])  # never 3 in a row: no error
  assert int(steps[-1].consecutive_skipped) == 2
  with pytest.raises(RuntimeError, match=SKIP_LIMIT_ERROR):
    run_front_end(front_end, options, [1, 1, 0, 1, 1, 1])


@front_ends
@pytest.mark.parametrize("detect", [False, True])
def test_detect_unscale_overflow_skips_only_when_enabled(front_end, detect):
  # docs/torch_semantics.md §3.2: bf16 3e38 at scale 0.5 becomes inf after unscaling; torch steps.
  params = {"w": jnp.ones(2, jnp.bfloat16)}
  step = {"w": jnp.array([3e38, 1.0], jnp.bfloat16)}
  options = {"init_scale": 0.5, "detect_unscale_overflow": detect}
  (s,) = run_front_end(front_end, options, [step], params=params)
  assert s.found_inf == detect
  assert bool(jnp.all(s.params["w"] == 1.0)) == detect  # skipped only when detected
  if s.updates is not None:  # optax shows the updates: zeros on a skip
    assert bool(np.all(np.asarray(s.updates["w"], np.float32) == 0)) == detect
  assert float(s.loss_scale) == (0.25 if detect else 0.5)
  assert int(s.skipped) == int(detect)
  assert s.nonfinite_leaf_paths == (["['w']"] if detect else [])


@pytest.mark.slow
@front_ends
@pytest.mark.parametrize("inner", [optax.sgd(0.1), optax.adam(1e-3)], ids=["sgd", "adam"])
def test_nonfinite_leaf_paths_name_the_leaves_of_the_last_skipped_step(front_end, inner):
  sequence = [make_grads(CLEAN, poison=ENCODER_B_NAN), CLEAN, make_grads(CLEAN, poison=HEAD_INF)]
  steps = run_front_end(front_end, {}, sequence, inner=inner)
  # a finite step keeps the last report
  assert [s.nonfinite_leaf_paths for s in steps] == [
    ["['encoder']['b']"],
    ["['encoder']['b']"],
    ["['head']"],
  ]


# Where the front-ends differ, each expectation is (error, message) or None for
# "accepted". dynamic_loss_scale takes array options (optax.inject_hyperparams
# passes them, traced); GradScaler keeps its options as static Python numbers.
BAD_OPTIONS = [
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
]
BAD_FOR_GRAD_SCALER_ONLY = [
  ({"min_loss_scale": jnp.float32(2.0)}, TypeError, "static Python numbers"),
  ({"hysteresis": jnp.int32(2)}, TypeError, "static Python numbers"),
]


def _construct(front_end, options):
  if front_end == "optax":
    return jaxamp.dynamic_loss_scale(optax.sgd(0.1), **options)
  return jaxamp.GradScaler(**options)


@front_ends
@pytest.mark.parametrize("kwargs,error,message", BAD_OPTIONS)
def test_options_reject_inconsistent_values_with_the_same_message(
  front_end, kwargs, error, message
):
  with pytest.raises(error, match=message):
    _construct(front_end, kwargs)


@pytest.mark.parametrize("kwargs,error,message", BAD_FOR_GRAD_SCALER_ONLY)
def test_options_as_arrays_rejected_by_grad_scaler_accepted_by_dynamic_loss_scale(
  kwargs, error, message
):
  with pytest.raises(error, match=message):
    jaxamp.GradScaler(**kwargs)
  jaxamp.dynamic_loss_scale(optax.sgd(0.1), **kwargs)


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_options_reject_a_bool_min_loss_scale(front_end):
  with pytest.raises(TypeError, match="min_loss_scale must be a real"):
    _construct(front_end, {"min_loss_scale": True})


# ---------------------------------------------------------------------------------
# dynamic_loss_scale only.
# ---------------------------------------------------------------------------------


def test_dynamic_loss_scale_nonfinite_leaf_paths_empty_before_a_skip_and_checks_params():
  tx = jaxamp.dynamic_loss_scale(optax.adam(1e-3))
  state = tx.init(PARAMS)
  assert jaxamp.ops.nonfinite_leaf_paths(state, PARAMS) == []
  _, state = jax.jit(tx.update)(make_grads(CLEAN, poison=HEAD_INF), state, PARAMS)
  assert jaxamp.ops.nonfinite_leaf_paths(state, PARAMS) == ["['head']"]
  with pytest.raises(ValueError, match="params has 1 leaves but the jaxamp state tracks 3"):
    jaxamp.ops.nonfinite_leaf_paths(state, {"w": jnp.ones(2)})


@pytest.mark.slow
def test_dynamic_loss_scale_options_inside_inject_hyperparams():
  tx = optax.inject_hyperparams(jaxamp.dynamic_loss_scale)(
    optax.sgd(0.1),
    init_scale=16.0,
    growth_interval=2,
    hysteresis=2,
    min_loss_scale=4.0,
    max_loss_scale=32.0,
    max_consecutive_skips=10,
  )
  state = tx.init(PARAMS)
  update = jax.jit(tx.update)
  scales = []
  for flag in [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0]:
    _, state = update(make_grads(CLEAN, poison=HEAD_INF if flag else None), state, PARAMS)
    scales.append(float(jaxamp.get_loss_scale(state)))
  # hysteresis 2 absorbs the first overflow; then 8, 4, floor 4; growth caps at 32.
  assert scales == [16.0, 8.0, 4.0, 4.0, 4.0, 4.0, 8.0, 8.0, 16.0, 16.0, 32.0]


# ---------------------------------------------------------------------------------
# GradScaler only: several optimizers, eager calls, new_scale, state dicts,
# pytrees, disabled, keyword-only options; and its agreement with the optax wrapper.
# ---------------------------------------------------------------------------------


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


def _flagged(flag):
  return make_grads(CLEAN, poison=HEAD_INF if flag else None)


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
  assert bits(opt2.params) == bits(optax.apply_updates({"v": jnp.ones(2, jnp.bfloat16)}, updates))
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


def test_grad_scaler_max_consecutive_skips_outside_jit_changes_nothing():
  scaler, opt = _started(init_scale=8.0, max_consecutive_skips=3)
  for flag in [1, 1, 0, 1, 1]:
    opt.grads = _flagged(flag)
    scaler.step(opt)
    scaler.update()
  opt.grads = _flagged(True)
  scaler.step(opt)
  before = jax.tree.flatten(scaler)
  with pytest.raises(RuntimeError, match=SKIP_LIMIT_ERROR):
    scaler.update()
  after = jax.tree.flatten(scaler)
  assert after[1] == before[1] and bits(after[0]) == bits(before[0])
  assert scaler.get_scale() == 0.5 and int(scaler.consecutive_skipped_updates) == 2


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


@pytest.mark.slow
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
    # kind 0: as is; 1: inf; 2: NaN; 3: 3e38, which overflows when unscaled below 1.
    kind = int(rng.choice(4, p=[0.5, 0.2, 0.1, 0.2]))
    leaf = int(rng.integers(3))
    poison = None if kind == 0 else (leaf, 0, {1: jnp.inf, 2: jnp.nan, 3: 3e38}[kind])
    g = make_grads(raw, scale=scale, poison=poison)
    updates, state = core_update(g, state, core_params)
    core_params = optax.apply_updates(core_params, updates)
    if kind == 3 and bool(state.found_inf):
      detected_only_by_unscaling += 1
    scaler, opt = _iteration(scaler, opt, g)

    assert bits(scaler.loss_scale) == bits(state.loss_scale), i
    assert int(scaler.growth_tracker) == int(state.growth_tracker), i
    assert int(scaler.hysteresis_tracker) == int(state.hysteresis_tracker), i
    assert int(scaler.skipped_updates) == int(state.skipped_steps), i
    assert int(scaler.consecutive_skipped_updates) == int(state.consecutive_skipped_steps), i
    assert int(scaler.update_count) == int(state.update_count), i
    assert bits(opt.nonfinite_leaves) == bits(state.nonfinite_leaves), i
    # Adam's own arithmetic runs in two XLA programs that fuse it differently
    # (FMA contraction): equal to the last few bits, not bit for bit.
    for ours, core in zip(
      jax.tree.leaves((opt.params, opt.opt_state)),
      jax.tree.leaves((core_params, state.inner_state)),
    ):
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
  injections = [jnp.float32(v) for v in (1, jnp.inf, 1, 1, 1, 1, jnp.nan, jnp.inf, jnp.inf, 1)]
  scaler, opt, scales, traces = jitted_unscale_loop(jaxamp.GradScaler(**kwargs), injections)
  assert traces == 1
  # hysteresis 2 refilled on every clean update: one overflow is absorbed, two
  # in a row back off; growth every 2 clean updates, capped at 16, floored at 1.
  assert [float(s) for s in scales] == [8, 8, 8, 16, 16, 16, 16, 8, 4, 4]
  assert int(scaler.skipped_updates) == 4 and int(scaler.update_count) == 10
  assert scaler.nonfinite_leaf_paths(opt) == ["['w']"]


def test_grad_scaler_update_new_scale_leaves_hysteresis_and_counters():
  scaler, opt = _started(init_scale=8.0, hysteresis=3, max_loss_scale=16.0)
  scaler, opt = _iteration(scaler, opt, _flagged(True))
  assert int(scaler.hysteresis_tracker) == 2 and int(scaler.skipped_updates) == 1
  opt.grads = _flagged(True)
  scaler.step(opt)
  scaler.update(new_scale=64.0)  # ignores the flags, not clamped
  assert scaler.get_scale() == 64.0
  assert int(scaler.hysteresis_tracker) == 2
  assert int(scaler.skipped_updates) == 1 and int(scaler.update_count) == 1
  scaler, opt = _iteration(scaler, opt, CLEAN)  # the bound applies again
  assert scaler.get_scale() == 16.0


@pytest.mark.slow
def test_grad_scaler_state_dict_keeps_torch_keys_and_load_keeps_option_state():
  scaler, opt = _started(init_scale=8.0, hysteresis=3, min_loss_scale=1.0)
  scaler, opt = _iteration(scaler, opt, _flagged(True))
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
  scaler, opt = _iteration(scaler, opt, _flagged(True))
  assert scaler.get_scale() == 1.0  # absorbed overflow, then clamped to the floor


def test_grad_scaler_nonfinite_leaf_paths_per_optimizer():
  scaler, opt = _started()
  assert scaler.nonfinite_leaf_paths(opt) == []
  scaler, opt = _iteration(scaler, opt, make_grads(CLEAN, poison=ENCODER_B_NAN))
  assert scaler.nonfinite_leaf_paths(opt) == ["['encoder']['b']"]
  # A None gradient (a frozen leaf) counts as finite; unscale_ alone records too.
  opt.grads = {
    "encoder": {"w": None, "b": make_grads(CLEAN, poison=ENCODER_B_NAN)["encoder"]["b"]},
    "head": None,
  }
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
    rebuilt, opt = _iteration(rebuilt, opt, _flagged(True))
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


def test_grad_scaler_options_are_keyword_only():
  with pytest.raises(TypeError, match=r"GradScaler\(\): too many positional arguments"):
    jaxamp.GradScaler("cuda", 2.0**16, 2.0, 0.5, 2000, True, 2.0)


# ---------------------------------------------------------------------------------
# The signatures, written out in each front-end, against LossScaleConfig's fields.
# ---------------------------------------------------------------------------------

FIELDS = dataclasses.fields(LossScaleConfig)
# torch's five, which GradScaler takes by position after the device, as torch.
TORCH_POSITIONAL = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled")
GRAD_SCALER_FIELDS = [f for f in FIELDS if f.name not in ("axis_name", "param_labels")]
# torch's semantics in a torch port (docs/porting.md, "Schedules"); optax's in the optax form.
GRAD_SCALER_DEFAULTS = {"schedule_counts": "iterations"}


def _options(front_end):
  parameters = list(inspect.signature(front_end).parameters.values())
  first = parameters[0]
  assert (first.name, first.kind) == (
    ("inner", first.POSITIONAL_OR_KEYWORD)
    if front_end is jaxamp.dynamic_loss_scale
    else ("device", first.POSITIONAL_OR_KEYWORD)
  )
  return parameters[1:]


def _args_entries(doc):
  """The ``Args:`` entries of a Google-style docstring, in order, repeats kept."""
  match = re.search(r"^( *)Args:\n(.*?)(?=^\1\S|\Z)", doc, flags=re.MULTILINE | re.DOTALL)
  body = inspect.cleandoc("\n" + match.group(2))
  entries = re.findall(r"^(\w+):(.*(?:\n .*)*)", body, flags=re.MULTILINE)
  return [(name, " ".join(text.split())) for name, text in entries]


def test_args_entries_reads_every_entry_and_keeps_repeats():
  doc = "Sums.\n\n  Args:\n    a: the first\n      line two.\n    a: again.\n\n  Returns:\n    x\n"
  assert _args_entries(doc) == [("a", "the first line two."), ("a", "again.")]


def test_dynamic_loss_scale_signature_is_loss_scale_config():
  options = _options(jaxamp.dynamic_loss_scale)
  assert [p.name for p in options] == [f.name for f in FIELDS]
  for parameter, field in zip(options, FIELDS):
    assert parameter.kind is parameter.KEYWORD_ONLY, field.name
    assert repr(parameter.default) == repr(field.default), field.name
    assert parameter.annotation == field.type, field.name


def test_grad_scaler_signature_is_loss_scale_config_as_torch_takes_it():
  # Python numbers only: the field's type without jax.Array.
  options = _options(jaxamp.GradScaler)
  assert [p.name for p in options] == [f.name for f in GRAD_SCALER_FIELDS]
  assert [p.name for p in options if p.kind is p.POSITIONAL_OR_KEYWORD] == list(TORCH_POSITIONAL)
  assert all(p.kind is p.KEYWORD_ONLY for p in options[len(TORCH_POSITIONAL) :])
  for parameter, field in zip(options, GRAD_SCALER_FIELDS):
    default = GRAD_SCALER_DEFAULTS.get(field.name, field.default)
    assert repr(parameter.default) == repr(default), field.name
    assert parameter.annotation == field.type.replace(" | jax.Array", ""), field.name


def test_front_ends_document_each_argument_once_in_the_same_words():
  optax_form = _args_entries(inspect.getdoc(jaxamp.dynamic_loss_scale))
  torch_form = _args_entries(inspect.getdoc(jaxamp.GradScaler.__init__))
  assert "Args:" not in inspect.getdoc(jaxamp.GradScaler)  # the constructor's, only
  assert [name for name, _ in optax_form] == ["inner", *(f.name for f in FIELDS)]
  assert [name for name, _ in torch_form] == ["device", *(f.name for f in GRAD_SCALER_FIELDS)]
  shared = dict(optax_form)
  for name, text in torch_form[1:]:
    assert text == shared[name], name


def test_front_ends_name_an_unknown_keyword():
  # Python's own message for the optax form; the torch form's names the class
  # called (its constructor is ScalerState's) and every argument it takes.
  with pytest.raises(
    TypeError, match="dynamic_loss_scale.. got an unexpected keyword argument 'growth_intervall'"
  ):
    jaxamp.dynamic_loss_scale(optax.sgd(0.1), growth_intervall=100)
  with pytest.raises(
    TypeError,
    match=r"^jaxamp: GradScaler\(\): got an unexpected keyword argument 'growth_intervall'\. "
    r"Its arguments are: device, init_scale, growth_factor, .*, schedule_counts\.$",
  ):
    jaxamp.GradScaler(growth_intervall=100)
