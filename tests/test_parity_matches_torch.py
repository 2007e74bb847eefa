"""The parity suite run as tests: every scenario, through every jaxamp API that
can express it, against torch run live; plus checks that the comparisons can
fail, and the CLI's bad-input messages."""

import dataclasses
import functools
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # parity/ is not an installed package

import jax
import jax.numpy as jnp
import optax

import jaxamp
from parity import __main__ as cli
from parity import engine, models, optimizers, scenarios

pytestmark = pytest.mark.torch

RUNS = [
  pytest.param(s, api, id=f"{s.name}[{api}]")
  for s in scenarios.SCENARIOS
  for api in ("optax", "grad_scaler")
  if api in s.apis
]


@functools.cache
def _run(name: str, api: str) -> engine.Result:
  """One run per scenario and API per session, shared by the tests below."""
  return engine.run(scenarios.REGISTRY[name], api)


@pytest.mark.slow
@pytest.mark.parametrize("scenario,api", RUNS)
def test_parity_scenario_matches_torch(scenario, api):
  result = _run(scenario.name, api)
  assert result.scale_match and result.tracker_match and result.skips_match, result.failures
  if scenario.scaler.get("enabled", True):
    assert result.unscale_bits_match is True, result.failures
  assert result.max_param_diff <= scenario.param_rtol, result.failures
  assert result.passed, result.failures


def test_parity_registry_covers_every_required_piece():
  by_name = scenarios.REGISTRY
  covered = {n for s in scenarios.SCENARIOS for n in s.spec}
  assert {
    7,
    8,
    9,
    10,
    11,
    12,
    13,
    18,
    26,
    27,
    28,
    29,
    30,
    32,
    33,
    35,
    43,
    44,
    53,
    54,
    55,
    59,
  } <= covered
  kinds = {o.kind for s in scenarios.SCENARIOS for o in s.optimizers}
  momentum = any(o.momentum for s in scenarios.SCENARIOS for o in s.optimizers)
  assert kinds == {"sgd", "adam", "adamw"} and momentum
  assert {s.resume[1] for s in scenarios.SCENARIOS if s.resume} == {"jax", "torch"}
  assert by_name["mlp_digits"].steps >= 200 and by_name["cnn_digits"].steps >= 200
  assert by_name["mlp_digits_fp16"].autocast == "float16"


def test_parity_registry_covers_the_training_loop_pieces():
  both = ("optax", "grad_scaler")
  by_name = scenarios.REGISTRY
  # An overflow inside an accumulation window, with more windows after it.
  acc = by_name["two_layer_accumulation_overflow_window"]
  assert acc.accumulate == 4 and acc.divide_loss and acc.apis == both
  assert min(step for step, _ in acc.micro_inject) >= 1 and acc.steps >= 6
  # Schedules with early skips, counted as torch's scheduler.step() counts.
  for name, kind in (
    ("two_layer_warmup_lambda_lr_early_skips", "warmup"),
    ("two_layer_onecycle_early_skips", "onecycle"),
  ):
    s = by_name[name]
    assert s.optimizers[0].schedule[0] == kind and s.apis == both
    assert s.jaxamp_options == {"schedule_counts": "iterations"}
    assert {0, 1, 2, 3} <= set(s.inject)
  # Several optimizers in the optax form, each skipped on its own gradients.
  for name in ("two_layer_param_labels_one_layer_inf", "two_layer_per_optimizer_skip"):
    assert len(by_name[name].optimizers) == 2 and by_name[name].apis == both
  assert by_name["two_layer_grad_penalty"].grad_penalty
  assert by_name["vector_scale_above_2_126"].scaler["init_scale"] > 2.0**126
  assert by_name["vector_clip_torch_formula"].clip_torch
  assert by_name["transformer_decoder"].model is models.transformer
  long = [s for s in scenarios.SCENARIOS if s.steps >= 1000]
  assert long and all(s.scaler["growth_interval"] <= 10 and len(s.inject) >= 20 for s in long)


@pytest.mark.slow
def test_parity_long_run_has_several_growth_and_backoff_cycles():
  result = _run("two_layer_long_growth_backoff", "optax")
  log2 = np.log2(result.curves["torch_scale"])
  changes = np.diff(log2)
  assert (changes > 0).sum() >= 100 and (changes < 0).sum() >= 30
  assert result.curves["jax_scale"] == result.curves["torch_scale"]


@pytest.mark.slow
def test_parity_scale_above_2_126_unscales_with_a_subnormal_reciprocal():
  result = _run("vector_scale_above_2_126", "grad_scaler")
  scales = np.float32(result.curves["torch_scale"])
  assert np.all(scales > np.float32(2.0**126))
  assert np.all(np.float32(1.0) / scales < np.finfo(np.float32).tiny)  # subnormal inv_scale
  assert result.unscale_bits_match is True and result.flushed_elements == 0


# ---------------------------------------------------------------------------------------
# The reference side is driven as torch was measured (numbers from docs/torch_semantics.md,
# not from us).


def test_parity_torch_side_reproduces_spec_trajectory_b():
  result = _run("linear_non_dyadic", "optax")
  scales = result.curves["torch_scale"]
  assert scales[2] == 4.5
  assert scales[3] == 1.350000023841858
  assert scales[9:12] == [0.6075000166893005, 0.1822500079870224, 0.05467500165104866]
  assert scales[14] == 0.08201250433921814
  assert scales[17] == 0.12301875650882721
  assert result.curves["jax_scale"] == scales


def test_parity_torch_side_reproduces_spec_growth_cap():
  result = _run("linear_growth_cap", "grad_scaler")
  assert result.curves["torch_scale"] == [
    8.507059173023462e37,
    1.7014118346046923e38,
    1.7014118346046923e38,
    1.7014118346046923e38,
    1.7014118346046923e38,
  ]
  assert result.passed, result.failures


def test_parity_torch_side_reproduces_spec_unvalidated_setters():
  result = _run("linear_setters_unvalidated", "grad_scaler")
  assert result.curves["torch_scale"][:4] == [2.0, 1.0, 4.0, 16.0]
  assert result.curves["jax_scale"] == result.curves["torch_scale"]


# ---------------------------------------------------------------------------------------
# The comparisons can fail: a jaxamp that is wrong in one way is caught.


_real_dynamic_loss_scale = jaxamp.dynamic_loss_scale


def _float32_factors(inner, **kwargs):
  """jaxamp given float32-rounded factors: what a pure float32 port computes."""
  for key in ("growth_factor", "backoff_factor"):
    if key in kwargs:
      kwargs[key] = np.float32(kwargs[key])
  return _real_dynamic_loss_scale(inner, **kwargs)


def _blind_to_inf(inner, **kwargs):
  """jaxamp fed gradients with inf/NaN replaced: it can no longer skip."""
  tx = _real_dynamic_loss_scale(inner, **kwargs)

  def update(grads, state, params=None, **extra):
    grads = jax.tree.map(lambda g: jnp.nan_to_num(g, posinf=1.0, neginf=-1.0), grads)
    return tx.update(grads, state, params, **extra)

  return optax.GradientTransformationExtraArgs(tx.init, update)


@pytest.mark.slow
def test_parity_detects_a_float32_scale_update(monkeypatch):
  monkeypatch.setattr(jaxamp, "dynamic_loss_scale", _float32_factors)
  result = engine.run(scenarios.REGISTRY["linear_non_dyadic"], "optax")
  assert not result.scale_match and not result.passed
  # 4.5 * f32(0.3) = 1.3500000536441803 rounds to torch's 1.350000023841858 at step 3;
  # the first backoff that differs is 2.025 * 0.3 at step 9 (docs/torch_semantics.md §5.2).
  assert result.failures[0].startswith("step 9: scale")


@pytest.mark.slow
def test_parity_detects_unscaling_by_division(monkeypatch):
  def divide(grads, loss_scale):
    return jax.tree.map(lambda g: g / loss_scale, grads), ~jaxamp.ops.all_finite(grads)

  monkeypatch.setattr(jaxamp.ops, "unscale_and_check", divide)
  result = engine.run(scenarios.REGISTRY["linear_non_dyadic"], "optax")
  assert result.unscale_bits_match is False and not result.passed
  assert result.scale_match and result.skips_match


@pytest.mark.slow
def test_parity_detects_a_missed_skip(monkeypatch):
  monkeypatch.setattr(jaxamp, "dynamic_loss_scale", _blind_to_inf)
  result = engine.run(scenarios.REGISTRY["linear_trajectory_a"], "optax")
  assert not result.skips_match and not result.passed
  assert result.failures[0].startswith("step 4: scale")
  assert any("step 4: skip decisions" in f for f in result.failures)


@pytest.mark.slow
def test_parity_detects_schedules_that_pause_on_skipped_steps():
  # schedule_counts="applied" (optax's default): after the four skipped first
  # steps the warmup is four steps behind torch's LambdaLR.
  scenario = dataclasses.replace(
    scenarios.REGISTRY["two_layer_warmup_lambda_lr_early_skips"], jaxamp_options={}
  )
  result = engine.run(scenario, "optax")
  assert result.scale_match and result.skips_match and not result.passed
  assert result.failures[0].startswith("step 4: parameter")


@pytest.mark.slow
def test_parity_detects_optax_clipping_formula():
  # optax.clip_by_global_norm's max_norm / norm against torch's max_norm / (norm + 1e-6):
  # 2.5e-4 apart at these small norms, caught in the momentum buffers.
  scenario = dataclasses.replace(scenarios.REGISTRY["vector_clip_torch_formula"], clip_torch=False)
  result = engine.run(scenario, "grad_scaler")
  assert not result.passed and result.max_state_diff > 1e-4


@pytest.mark.slow
def test_parity_schedule_check_catches_torchs_formula_in_float32(monkeypatch):
  # OneCycleLR's cosine written as torch writes it, evaluated in float32, cancels
  # near the phase ends: the check before training reports it.
  def naive(start, end, step, start_step, end_step):
    pct = (step - start_step) / (end_step - start_step)
    return end + (start - end) / 2.0 * (jnp.cos(jnp.pi * pct) + 1.0)

  spec = scenarios.REGISTRY["two_layer_onecycle_early_skips"].optimizers[0]
  assert optimizers.schedule_mismatch(spec, 40)[0] <= engine.SCHEDULE_RTOL
  monkeypatch.setattr(optimizers, "_cos_anneal", naive)
  worst, what = optimizers.schedule_mismatch(spec, 40)
  assert worst > engine.SCHEDULE_RTOL and what.startswith("lr at step")


@pytest.mark.slow
def test_parity_resume_loads_the_other_frameworks_checkpoint(monkeypatch):
  calls = []
  original = engine.TorchRun.resume

  def spy(self, checkpoint):
    calls.append(checkpoint["scaler"])
    return original(self, checkpoint)

  monkeypatch.setattr(engine.TorchRun, "resume", spy)
  result = engine.run(scenarios.REGISTRY["two_layer_adam_save_jax_resume_torch"], "optax")
  assert result.passed, result.failures
  # After 5 steps (inf at 3): 3.0 -> 4.5 at step 2, 4.5 * 0.3 at step 3, tracker 1.
  assert calls == [
    {
      "scale": 1.350000023841858,
      "growth_factor": 1.5,
      "backoff_factor": 0.3,
      "growth_interval": 3,
      "_growth_tracker": 1,
    }
  ]


def test_parity_relative_difference_needs_the_same_nonfinite_entries():
  a = np.array([1.0, np.nan, -np.inf], np.float32)
  assert engine.relative_difference(a, a.copy()) == 0.0
  assert engine.relative_difference(a, np.array([1.0, np.nan, np.inf], np.float32)) == np.inf
  assert engine.relative_difference(a, np.array([1.0, 0.0, -np.inf], np.float32)) == np.inf
  assert engine.relative_difference(np.array([1.0, 2.0]), np.array([1.0, 4.0])) == 0.5


# ---------------------------------------------------------------------------------------
# The command line.


def test_parity_cli_unknown_scenario_is_a_clear_error(capsys):
  assert cli.main(["--scenario", "linear_non_dyadik", "--no-png"]) == 2
  err = capsys.readouterr().err
  assert "unknown scenario 'linear_non_dyadik'" in err
  assert "Did you mean: linear_non_dyadic" in err
  assert "Traceback" not in err


def test_parity_cli_unwritable_output_is_a_clear_error(tmp_path, capsys):
  blocker = tmp_path / "file"
  blocker.write_text("")
  assert cli.main(["--scenario", "linear_noop_growth", "--png", str(blocker / "x.png")]) == 2
  assert "cannot write the PNG to" in capsys.readouterr().err
  assert cli.main(["--scenario", "linear_noop_growth", "--no-png", "--json", str(tmp_path)]) == 2
  assert "is a directory" in capsys.readouterr().err


def test_parity_cli_without_torch_is_a_clear_error(tmp_path):
  (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT])}
  done = subprocess.run(
    [sys.executable, "-m", "parity", "--no-png"],
    cwd=ROOT,
    env=env,
    check=False,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert done.returncode == 2
  assert "torch is not installed" in done.stderr
  assert "pip install -e '.[parity]'" in done.stderr
  assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_parity_cli_writes_table_json_and_png(tmp_path, capsys):
  out_json, out_png = tmp_path / "r" / "results.json", tmp_path / "p" / "curves.png"
  code = cli.main(
    [
      "--scenario",
      "linear_noop_growth",
      "--no-progress",
      "--json",
      str(out_json),
      "--png",
      str(out_png),
    ]
  )
  out = capsys.readouterr().out
  assert code == 0
  assert "linear_noop_growth  dynamic_loss_scale  4" in out
  assert "linear_noop_growth  GradScaler          4" in out
  assert "2 of 2 runs match torch." in out
  data = json.loads(out_json.read_text())
  assert data["passed"] is True
  assert [r["api"] for r in data["runs"]] == ["optax", "grad_scaler"]
  assert data["runs"][0]["curves"]["torch_scale"] == [1.0, 1.0, 1.0, 1.0]
  assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert (out_png.parent / "curves_steps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert len(data["runs"][0]["curves"]["param_diff"]) == 4


@pytest.mark.slow
def test_parity_cli_exits_1_on_a_mismatch(monkeypatch, capsys):
  monkeypatch.setattr(jaxamp, "dynamic_loss_scale", _float32_factors)
  code = cli.main(
    ["--scenario", "linear_non_dyadic", "--api", "optax", "--no-png", "--no-progress"]
  )
  assert code == 1
  assert "FAIL linear_non_dyadic [dynamic_loss_scale]" in capsys.readouterr().out


def test_parity_cli_list_names_every_scenario(capsys):
  assert cli.main(["--list"]) == 0
  out = capsys.readouterr().out
  for name in scenarios.REGISTRY:
    assert f"{name}  [" in out


def test_parity_script_runs_python_m_parity():
  script = pathlib.Path(ROOT, "scripts", "parity.sh").read_text()
  assert script.startswith("#!/usr/bin/env bash\n")
  assert 'source "$(dirname "$0")/_venv.sh" parity\n' in script
  assert script.rstrip().endswith('exec .venv/bin/python -m parity "$@"')


def test_parity_flush_to_zero_model_explains_only_subnormal_differences():
  scaled = np.array([1e-40, 3e-39, 2.0, -5e-39], np.float32)
  scale = np.float32(2.0**-115)
  inv = np.float32(2.0**115)
  torch_like = (scaled * inv).astype(np.float32)  # torch keeps subnormal inputs
  jax_like = np.array([0.0, 0.0, 2.0 * 2.0**115, -0.0], np.float32)
  assert engine._explained_by_flush(jax_like, torch_like, scaled, scale)
  # A difference at a normal element is not explained by flushing.
  wrong = jax_like.copy()
  wrong[2] = np.nextafter(wrong[2], np.float32(0))
  assert not engine._explained_by_flush(wrong, torch_like, scaled, scale)
  # Nor is a flushed value where jaxamp should have kept torch's bits.
  assert not engine._explained_by_flush(jax_like, torch_like, scaled, np.float32(1.0))


def test_parity_flush_to_zero_model_keeps_a_subnormal_reciprocal():
  # Above 2**126 inv_scale is subnormal; jaxamp computes torch's correctly
  # rounded g * inv_scale, flushing only a subnormal result.
  scale = np.float32(1e38)
  inv = np.float32(1.0 / np.float64(scale))
  assert 0 < inv < np.finfo(np.float32).tiny
  scaled = np.array([1e36, -3.0, 0.5], np.float32)
  torch_like = (scaled * inv).astype(np.float32)
  model, involved = engine.flush_to_zero_unscale(scaled, scale)
  assert model[0] == torch_like[0] != 0 and model[1] == torch_like[1] != 0
  assert model[2] == 0 and torch_like[2] != 0  # 5e-39: subnormal, flushed
  assert involved.all()  # the reciprocal is subnormal: every element is marked


@pytest.mark.slow
def test_parity_subnormal_scenarios_are_flagged_not_hidden():
  for name in ("linear_backoff_to_zero", "vector_subnormal_scale"):
    result = engine.run(scenarios.REGISTRY[name], "optax")
    assert result.passed and result.scale_match and result.skips_match
    assert result.flushed_elements > 0
  # Without the flag, the same run fails on the unscaled bits.
  plain = dataclasses.replace(scenarios.REGISTRY["vector_subnormal_scale"], subnormals=False)
  result = engine.run(plain, "optax")
  assert not result.passed and result.unscale_bits_match is False
