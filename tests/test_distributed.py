"""One skip decision for all devices and processes (jit with shardings,
``shard_map``, ``pmap``, two ``jax.distributed`` processes, torch DDP).

The bad-input errors run here on one device. Everything that needs 8 devices or
2 processes runs in fresh processes (``tests/distributed_checks.py``), which
report what they measured as JSON; the assertions are all in this file.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import distributed_checks as dc
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_docs import shown_outputs

import jaxamp

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHECKS = pathlib.Path(dc.__file__)
SCALER = {"init_scale": 4.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2}
# The 8-device runs: inf at step 1 in one shard (device 5), clean steps 0, 2, 3.
# torch's rule by hand (init 4, x0.5 on inf, x2 after 2 clean steps):
EXPECTED_FOUND = [False, True, False, False]
EXPECTED_SCALES = [4.0, 2.0, 2.0, 4.0]
EXPECTED_TRACKERS = [1, 0, 1, 0]
DEVICES = [str(d) for d in range(8)]


# --------------------------------------------------------------------------
# Bad input, on this process's single device


def _one_device_mesh():
  return jax.make_mesh((1,), ("data",))


def _sharded_params(mesh):
  return {"w": jax.device_put(jnp.ones(4), NamedSharding(mesh, P("data")))}


def test_dynamic_loss_scale_axis_name_raises_when_axis_unbound_under_jit():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), axis_name="data", **SCALER)
  params = {"w": jnp.ones(4)}
  state = tx.init(params)
  with pytest.raises(ValueError, match=r"axis_name='data' is not bound here.*shard_map"):
    jax.jit(tx.update)(params, state, params)


def test_dynamic_loss_scale_axis_name_raises_when_axis_not_in_shard_map_mesh():
  # Before the check in _distributed.py, psum raised a bare AssertionError here.
  mesh = _one_device_mesh()
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), axis_name="model", **SCALER)
  params = _sharded_params(mesh)
  state = jax.device_put(tx.init(params), NamedSharding(mesh, P()))
  step = jax.shard_map(
    lambda g, s: tx.update(g, s, g),
    mesh=mesh,
    in_specs=(P("data"), P()),
    out_specs=(P("data"), P()),
  )
  with pytest.raises(ValueError, match=r"axis_name='model' is not bound.*unbound axis name: model"):
    step(params, state)


def test_dynamic_loss_scale_axis_name_raises_when_one_of_several_axes_unbound():
  mesh = _one_device_mesh()
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), axis_name=("data", "model"), **SCALER)
  params = _sharded_params(mesh)
  state = jax.device_put(tx.init(params), NamedSharding(mesh, P()))
  step = jax.shard_map(
    lambda g, s: tx.update(g, s, g),
    mesh=mesh,
    in_specs=(P("data"), P()),
    out_specs=(P("data"), P()),
  )
  with pytest.raises(ValueError, match=r"not bound.*unbound axis name: model"):
    step(params, state)


def test_dynamic_loss_scale_axis_name_raises_when_state_varies_over_axis():
  mesh = _one_device_mesh()
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), axis_name="data", **SCALER)
  params = _sharded_params(mesh)
  state = jax.device_put(tx.init(params), NamedSharding(mesh, P()))

  def body(g, s):
    s = s._replace(growth_tracker=lax.pcast(s.growth_tracker, "data", to="varying"))
    return tx.update(g, s, g)

  step = jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P()), out_specs=(P("data"), P()))
  with pytest.raises(ValueError, match=r"replicated over \('data',\).*growth_tracker varies"):
    step(params, state)


def test_dynamic_loss_scale_axis_name_raises_when_state_passed_per_device():
  # One scale per device (as a run without axis_name leaves them), given to
  # shard_map with P('data'): the state is not replicated.
  mesh = _one_device_mesh()
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), axis_name="data", **SCALER)
  params = _sharded_params(mesh)
  state = jax.device_put(tx.init(params), NamedSharding(mesh, P()))
  per_device = state._replace(
    loss_scale=jax.device_put(jnp.full((1,), 4.0), NamedSharding(mesh, P("data")))
  )
  specs = jax.tree.map(lambda _: P(), state)._replace(loss_scale=P("data"))

  def body(g, s):
    return tx.update(g, s._replace(loss_scale=s.loss_scale[0]), g)

  step = jax.shard_map(body, mesh=mesh, in_specs=(P("data"), specs), out_specs=(P("data"), P()))
  with pytest.raises(ValueError, match=r"must be replicated.*loss_scale varies over \['data'\]"):
    step(params, per_device)


def test_dynamic_loss_scale_axis_name_raises_under_pmap_over_another_axis():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), axis_name="batch", **SCALER)
  params = jnp.ones((1, 4))
  state = jax.pmap(tx.init)(params)
  step = jax.pmap(lambda g, s: tx.update(g, s, g), axis_name="data")
  with pytest.raises(ValueError, match=r"axis_name='batch' is not bound"):
    step(params, state)


@pytest.mark.slow
def test_dynamic_loss_scale_axis_name_on_one_device_equals_no_axis_name():
  mesh = _one_device_mesh()
  params = _sharded_params(mesh)
  grads = [jnp.array([4.0, -8.0, 2.0, 1.0]), jnp.array([1.0, jnp.inf, 0.0, 0.0])]
  results = []
  for axis_name in ("data", None):
    tx = jaxamp.dynamic_loss_scale(optax.adam(0.1), axis_name=axis_name, **SCALER)
    with jax.set_mesh(mesh):
      state = jax.jit(tx.init)(params)  # Adam's moments sharded like params
    specs = jax.tree.map(lambda x: x.sharding.spec, state)
    step = jax.jit(
      jax.shard_map(
        lambda g, s, tx=tx: tx.update(g, s, g),
        mesh=mesh,
        in_specs=(P("data"), specs),
        out_specs=(P("data"), specs),
        check_vma=axis_name is not None,
      )
    )
    trace = []
    for g in grads:
      g = {"w": jax.device_put(g, NamedSharding(mesh, P("data")))}
      updates, state = step(g, state)
      trace.append(
        (np.asarray(updates["w"]).tobytes(), float(state.loss_scale), bool(state.found_inf))
      )
    results.append(trace)
  assert results[0] == results[1]
  assert [t[1:] for t in results[0]] == [(4.0, False), (2.0, True)]


# --------------------------------------------------------------------------
# Fresh processes


def _env(**extra):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
  env["JAX_PLATFORMS"] = "cpu"
  env.update(extra)
  return env


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_pair(mode, tmp_path, timeout=240):
  """Starts two workers of ``mode`` on one loopback port; their JSON results."""
  port = _free_port()
  outs = [tmp_path / f"{mode}-{i}.json" for i in range(2)]
  procs = [
    subprocess.Popen(
      [sys.executable, str(CHECKS), mode, str(i), str(port), str(outs[i])],
      env=_env(),
      cwd=ROOT,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  logs, deadline = [], time.monotonic() + timeout
  try:
    for proc in procs:
      logs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
  except subprocess.TimeoutExpired:
    for proc in procs:
      proc.kill()
      proc.wait()
    pytest.fail(f"{mode}: the two processes did not finish within {timeout} s")
  for i, proc in enumerate(procs):
    assert proc.returncode == 0, f"{mode} {i} exited {proc.returncode}:\n{logs[i][-4000:]}"
  return [json.loads(out.read_text()) for out in outs]


@pytest.fixture(scope="module")
def devices(tmp_path_factory):
  """The measurements of ``distributed_checks.py devices`` on 8 CPU devices."""
  out = tmp_path_factory.mktemp("devices") / "devices.json"
  proc = subprocess.run(
    [sys.executable, str(CHECKS), "devices", str(out)],
    check=False,
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    env=_env(XLA_FLAGS="--xla_force_host_platform_device_count=8"),
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(out.read_text())


def _check(devices, name):
  check = devices["checks"][name]
  assert check["ok"], check.get("traceback")
  return check["result"]


@pytest.fixture(scope="module")
def jax_processes(tmp_path_factory):
  return _run_pair("jax-worker", tmp_path_factory.mktemp("jax"))


def _mode(processes, name):
  results = []
  for process in processes:
    assert process[name]["ok"], process[name].get("traceback")
    results.append(process[name]["result"])
  return results


# --------------------------------------------------------------------------
# jax.jit with NamedSharding over 8 devices


# jax.make_mesh (Explicit), Mesh (Auto); Explicit with each step under jax.set_mesh,
# in the optax form's loop and, with the skip limit, its lax.cond
JIT_RUNS = [
  "jit_sharded",
  "jit_sharded_auto_axes",
  "jit_sharded_in_mesh",
  "jit_sharded_in_mesh_skip_limit",
]


@pytest.mark.slow
@pytest.mark.parametrize("run", JIT_RUNS)
def test_dynamic_loss_scale_jit_sharded_skips_every_shard_on_inf_in_one_shard(devices, run):
  steps = _check(devices, run)["steps"]
  assert [s["found_inf"] for s in steps] == EXPECTED_FOUND
  for step, scale in zip(steps, EXPECTED_SCALES):
    assert step["scale_per_device"] == {d: [scale] for d in DEVICES}
  for i, step in enumerate(steps):
    for leaf in ("w", "m", "r"):
      before, after = step["params_before"][leaf], step["params_after"][leaf]
      assert sorted(before) == DEVICES
      if EXPECTED_FOUND[i]:
        assert after == before, (i, leaf)  # every shard untouched, bit for bit
      else:
        assert all(after[d] != before[d] for d in DEVICES), (i, leaf)  # a real step
    if EXPECTED_FOUND[i]:
      assert step["mu_after"] == step["mu_before"]


@pytest.mark.slow
@pytest.mark.parametrize("run", JIT_RUNS)
def test_dynamic_loss_scale_jit_sharded_keeps_param_shardings_and_replicates_state(devices, run):
  result = _check(devices, run)
  param_specs = {"w": "P('data',)", "m": "P('data',)", "r": "P()"}
  assert result["param_specs"] == param_specs
  # With Auto axes, jit(tx.init) leaves the fresh state on one device (JAX's
  # choice, plain optax.adam too); the first update returns it laid out.
  states = [result] if run == "jit_sharded" else []
  if run == "jit_sharded_auto_axes":
    assert result["state_specs"]["loss_scale"] == "SingleDeviceSharding"
  for step in result["steps"]:
    assert step["param_specs"] == param_specs
    assert step["update_specs"] == param_specs
    assert step["state_scalars_fully_replicated"] == [True] * 5
    states.append(step)
  for step in states:
    specs = step["state_specs"]
    assert specs["mu"] == specs["nu"] == param_specs
    for field in (
      "loss_scale",
      "growth_tracker",
      "found_inf",
      "skipped_steps",
      "consecutive_skipped_steps",
    ):
      assert specs[field] == "P()", field


@pytest.mark.slow
def test_accumulate_gradients_in_an_explicit_mesh_skips_the_window_with_inf(devices):
  # The window's held steps return zeros typed as the updates, Explicit
  # sharding included (jax.set_mesh makes it part of the type).
  result = _check(devices, "accumulate_in_mesh")
  first, second, third, fourth = result["params_after"]
  initial = _check(devices, "jit_sharded")["steps"][0]["params_before"]  # the same params
  assert first == second == initial  # held, then skipped
  assert third == second and fourth != third  # held, then applied
  assert result["specs"] == {"w": "P('data',)", "m": "P('data',)", "r": "P()"}


# --------------------------------------------------------------------------
# shard_map over 8 devices


@pytest.mark.slow
def test_dynamic_loss_scale_shard_map_axis_name_all_devices_skip_on_inf_on_one_device(devices):
  steps = _check(devices, "shard_map_axis_name")["steps"]
  assert len(steps) == 4
  for i, step in enumerate(steps):
    assert step["found_inf_per_device"] == [EXPECTED_FOUND[i]] * 8
    assert step["scale_per_device"] == [EXPECTED_SCALES[i]] * 8
    assert step["tracker_per_device"] == [EXPECTED_TRACKERS[i]] * 8
    for leaf in ("w", "m"):
      before, after = step["params_before"][leaf], step["params_after"][leaf]
      if EXPECTED_FOUND[i]:
        assert after == before, (i, leaf)
      else:
        assert all(after[d] != before[d] for d in DEVICES), (i, leaf)


@pytest.mark.slow
def test_dynamic_loss_scale_shard_map_axis_name_state_can_be_returned_replicated(devices):
  result = _check(devices, "shard_map_replicated_out_axis_name")
  assert result["error"] is None
  assert result["scale_per_device"] == {d: [2.0] for d in DEVICES}


@pytest.mark.slow
@pytest.mark.parametrize(
  "check", ["shard_map_no_axis_name", "shard_map_replicated_out_no_axis_name"]
)
def test_dynamic_loss_scale_shard_map_without_axis_name_is_refused(devices, check):
  # Per-device gradients and no axis_name: each device would skip on its own
  # (device 5 alone, with its own backed-off scale). jaxamp refuses it at trace
  # time, naming the axis, before JAX's own replication check would.
  result = devices["checks"][check]
  if result["ok"]:  # shard_map_replicated_out reports the error it caught
    error = result["result"]["error"]
    text = f"{error['type']}: {error['message']}"
  else:
    text = result["traceback"]
  assert "ValueError: jaxamp: the gradients differ between the devices" in text
  assert "Build it with axis_name='data'" in text


@pytest.mark.slow
def test_dynamic_loss_scale_shard_map_pmean_gradients_agree_without_axis_name(devices):
  # Gradients all-reduced before the update carry the inf to every device.
  result = _check(devices, "shard_map_pmean_no_axis_name")
  assert result["found_inf_per_device"] == [True] * 8
  assert result["scale_per_device"] == [2.0] * 8
  assert result["params_after"] == result["params_before"]


@pytest.mark.slow
def test_dynamic_loss_scale_shard_map_2d_mesh_needs_every_varying_axis(devices):
  # (4, 2) mesh, inf on the device at data=2, model=1.
  both = _check(devices, "mesh_2d_both_axes")
  assert both["found_inf"] == [[True, True]] * 4
  assert both["scale"] == [[2.0, 2.0]] * 4
  data_only = _check(devices, "mesh_2d_data_axis_only")
  assert data_only["found_inf"] == [[False, True]] * 4  # only the model=1 column agrees
  assert data_only["scale"] == [[4.0, 2.0]] * 4


@pytest.mark.slow
def test_dynamic_loss_scale_shard_map_errors_on_8_devices(devices):
  errors = _check(devices, "shard_map_errors")
  unbound = errors["unbound_axis_in_shard_map"]
  assert unbound["type"] == "ValueError"
  assert "axis_name='model' is not bound" in unbound["message"]
  varies = errors["state_varies"]
  assert varies["type"] == "ValueError"
  assert "loss_scale varies over ['data']" in varies["message"]


# --------------------------------------------------------------------------
# pmap over 8 devices


@pytest.mark.slow
def test_dynamic_loss_scale_pmap_axis_name_all_devices_skip_on_inf_on_one_device(devices):
  assert devices["has_pmap"], "jax.pmap is gone: update docs/distributed.md and this test"
  result = _check(devices, "pmap_axis_name")
  assert result["found_inf_per_device"] == [True] * 8
  assert result["scale_per_device"] == [2.0] * 8
  assert result["params_after"] == result["params_before"]


@pytest.mark.slow
def test_dynamic_loss_scale_pmap_without_axis_name_devices_diverge(devices):
  result = _check(devices, "pmap_no_axis_name")
  assert result["found_inf_per_device"] == [d == 5 for d in range(8)]
  assert result["scale_per_device"] == [2.0 if d == 5 else 4.0 for d in range(8)]
  before, after = result["params_before"], result["params_after"]
  for i in range(16):  # 2 values per device
    assert (after[i] == before[i]) == (i // 2 == 5), i


@pytest.mark.slow
def test_dynamic_loss_scale_pmap_unbound_axis_raises(devices):
  error = _check(devices, "pmap_unbound")
  assert error["type"] == "ValueError"
  assert "axis_name='batch' is not bound" in error["message"]


# --------------------------------------------------------------------------
# Two processes (jax.distributed, gloo), one device each


def _scenario_fixture(torch_fixtures):
  """torch's single-process trajectory for the same configuration and schedule."""
  fixture = torch_fixtures["odd_factors"]
  assert {k: fixture[k] for k in dc.CONFIG} == dc.CONFIG
  iters = fixture["iters"]
  assert len(iters) == dc.STEPS
  assert tuple(it["i"] for it in iters if it["injected"] != 0) == dc.INF_STEPS
  return iters


def _assert_processes_agree(histories):
  first, second = histories
  for key in ("scale", "tracker", "found_inf", "params_after"):
    assert [h[key] for h in first] == [h[key] for h in second], key


@pytest.mark.slow
def test_dynamic_loss_scale_two_processes_data_parallel_skip_same_steps(
  jax_processes, torch_fixtures
):
  iters = _scenario_fixture(torch_fixtures)
  for process_id, process in enumerate(jax_processes):
    assert (process["process_id"], process["process_count"]) == (process_id, 2)
    assert process["device_count"] == 2 and process["collectives"] == "gloo"
  results = _mode(jax_processes, "data_parallel_jit")
  histories = [r["history"] for r in results]
  _assert_processes_agree(histories)  # identical scales, skips and params (bits)
  for result in results:
    assert result["scale_spec"] == "P()"
    assert set(result["param_specs"].values()) == {"P()"}
  for history in histories:
    assert [i for i, h in enumerate(history) if h["found_inf"]] == list(dc.INF_STEPS)
    assert [h["scale"] for h in history] == [it["scale_after"] for it in iters]
    assert [h["tracker"] for h in history] == [it["growth_tracker_after"] for it in iters]
    assert history[-1]["skipped_steps"] == len(dc.INF_STEPS)
    for i, h in enumerate(history):
      changed = h["params_after"] != h["params_before"]
      assert changed == (i not in dc.INF_STEPS), i


@pytest.mark.slow
def test_dynamic_loss_scale_two_processes_sharded_axis_name_all_skip(jax_processes, torch_fixtures):
  # ZeRO-style: the inf lands in process 0's half of the gradient only.
  iters = _scenario_fixture(torch_fixtures)
  histories = [r["history"] for r in _mode(jax_processes, "sharded_axis_name")]
  for key in ("scale", "tracker", "found_inf"):
    assert [h[key] for h in histories[0]] == [h[key] for h in histories[1]], key
  for history in histories:
    assert [i for i, h in enumerate(history) if h["found_inf"]] == list(dc.INF_STEPS)
    assert [h["scale"] for h in history] == [it["scale_after"] for it in iters]
    for i, h in enumerate(history):  # this process's half of the parameters
      assert (h["params_after"] != h["params_before"]) == (i not in dc.INF_STEPS), i


@pytest.mark.slow
def test_dynamic_loss_scale_two_processes_sharded_without_axis_name_diverge(jax_processes):
  first, second = (r["history"] for r in _mode(jax_processes, "sharded_no_axis_name"))
  assert [i for i, h in enumerate(first) if h["found_inf"]] == list(dc.INF_STEPS)
  assert not any(h["found_inf"] for h in second)  # its half was finite
  assert first[-1]["scale"] == 0.12301875650882721  # as with axis_name
  assert second[-1]["scale"] == 34.171875  # 3 * 1.5**6: six growths, no backoff
  # Gradients summed across different scales: the parameters blow up.
  for history in (first, second):
    assert _largest(history[-1]["params_after"]) > 1e3


@pytest.mark.slow
def test_dynamic_loss_scale_two_processes_sharded_axis_name_params_stay_small(jax_processes):
  for result in _mode(jax_processes, "sharded_axis_name"):
    assert _largest(result["history"][-1]["params_after"]) < 2.0


def _largest(params):
  return max(abs(v) for values in params.values() for v in values)


# --------------------------------------------------------------------------
# docs/distributed.md


DOC = ROOT / "docs" / "distributed.md"
RUN_DOC = (
  "import contextlib, io, json, re, sys\n"
  "text = open(sys.argv[1]).read()\n"
  "blocks = re.findall(r'```python\\n(.*?)```', text, flags=re.S)\n"
  "assert len(blocks) == 5, len(blocks)\n"
  "scope, printed = {}, []\n"
  "for block in blocks:\n"
  "  with contextlib.redirect_stdout(io.StringIO()) as out:\n"
  "    exec(compile(block, sys.argv[1], 'exec'), scope)\n"
  "  printed.append(out.getvalue())\n"
  "import jax\n"
  "print(json.dumps({'devices': jax.device_count(), 'printed': printed}))\n"
)


@pytest.mark.slow
@pytest.mark.parametrize("count", [1, 8])
def test_distributed_doc_python_examples_run(count):
  proc = subprocess.run(
    [sys.executable, "-c", RUN_DOC, str(DOC)],
    check=False,
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    env=_env(XLA_FLAGS=f"--xla_force_host_platform_device_count={count}"),
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  ran = json.loads(proc.stdout)
  assert ran["devices"] == count
  # each block prints what the page shows under it, on 1 device and on 8
  shown = shown_outputs(DOC)
  assert None not in shown, "a python block of docs/distributed.md does not say what it prints"
  assert ran["printed"] == shown, "docs/distributed.md shows another output than it prints"


# --------------------------------------------------------------------------
# torch DistributedDataParallel (gloo) and torch.amp.GradScaler, two processes


@pytest.mark.slow
@pytest.mark.torch
def test_dynamic_loss_scale_two_processes_data_parallel_matches_torch(jax_processes, tmp_path):
  torch_ranks = _run_pair("torch-worker", tmp_path)
  torch_histories = [r["history"] for r in torch_ranks]
  _assert_processes_agree(torch_histories)
  (jax_history, _) = (r["history"] for r in _mode(jax_processes, "data_parallel_jit"))
  (torch_history, _) = torch_histories
  for key in ("scale", "tracker", "found_inf"):
    assert [h[key] for h in jax_history] == [h[key] for h in torch_history], key
  assert [i for i, h in enumerate(torch_history) if h["found_inf"]] == list(dc.INF_STEPS)
  for i, h in enumerate(torch_history):
    assert (h["params_after"] != h["params_before"]) == (i not in dc.INF_STEPS), i
  for leaf in ("w1", "b1", "w2", "b2"):  # autodiff and all-reduce order differ in the last bits
    np.testing.assert_allclose(
      jax_history[-1]["params_after"][leaf],
      torch_history[-1]["params_after"][leaf],
      rtol=0,
      atol=1e-6,
      err_msg=leaf,
    )
