"""A forgotten ``lax.pmean`` of the gradients under ``jax.shard_map``: refused.

With ``axis_name``, the scaler shares its skip decision over the devices, but the
gradients are the caller's to average. Inside ``shard_map`` JAX types every value
with the mesh axes it varies over; a gradient that varies over ``axis_name`` while
its parameter does not would step each device's copy of a replicated parameter
differently. The cases run in a fresh process with 4 CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=4``), which writes what it saw
as JSON; the tests assert on it:

  XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
    python tests/test_seams_distributed.py OUT.json
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

DEVICES = 4


def _error(fn):
  try:
    fn()
  except Exception as error:  # noqa: BLE001 - the test reads type and text
    return {"type": type(error).__name__, "message": str(error)}
  return None


def _cases() -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax import lax
  from jax.sharding import Mesh
  from jax.sharding import PartitionSpec as P

  import jaxamp
  from jaxamp import _engine as engine

  mesh = Mesh(np.array(jax.devices()), ("data",))
  x = jnp.arange(4.0 * DEVICES * 3).reshape(4 * DEVICES, 3) / 10  # 4 rows per device
  params = {"w": jnp.ones(3), "b": jnp.zeros(())}
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), axis_name="data")
  state = tx.init(params)

  def loss(p, x):
    return jnp.mean((x @ p["w"] + p["b"]) ** 2)

  def checked(step, param_spec=None, args=(params, x)):
    """The error of tracing ``step(params, x)`` (the gradients) and the engine's check
    of them against the parameters, inside shard_map; None if there is none."""

    def body(params, x):
      params, grads = step(params, x)
      engine.check(grads, state.loss_scale, state.config, state, params)
      return jnp.zeros(())

    specs = (P() if param_spec is None else param_spec, P("data"))
    run = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P())
    return _error(lambda: jax.jit(run).trace(*args))

  def per_device(params, x):  # each device's own gradient: of its copy, made varying
    return params, jax.grad(loss)(lax.pcast(params, "data", to="varying"), x)

  def averaged(params, x):
    params, grads = per_device(params, x)
    return params, lax.pmean(grads, "data")

  def on_purpose(params, x):  # each device steps its own copy: the parameters varying
    params = lax.pcast(params, "data", to="varying")
    return params, jax.grad(loss)(params, x)

  def zero_style(params, x):  # each device holds a slice of w; its gradient varies with it
    return params, jax.grad(lambda p: jnp.sum(p["w"] * x[0, 0]))(params)

  out = {
    "forgotten_pmean": checked(per_device),
    "pmean": checked(averaged),
    "params_varying_on_purpose": checked(on_purpose),
    "sharded_params": checked(
      zero_style, param_spec=P("data"), args=({"w": jnp.ones(DEVICES * 3)}, x)
    ),
  }

  # Through the public steps (the engine's check gets the parameters), against
  # plain optax's Adam on the same averaged gradients.
  adam = jaxamp.dynamic_loss_scale(optax.adam(0.1), axis_name="data")
  adam_state = adam.init(params)
  state_specs = jax.tree.map(lambda _: P(), adam_state)
  plain = optax.adam(0.1)
  plain_specs = jax.tree.map(lambda _: P(), plain.init(params))

  def public_step(front_end, grads_of):
    def body(params, opt_state, x):
      grads = grads_of(params, x)[1]
      if front_end == "plain":
        updates, opt_state = plain.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state
      grads = jax.tree.map(lambda g: g * opt_state.loss_scale, grads)  # of loss * scale
      if front_end == "apply_scaled_updates":
        return jaxamp.apply_scaled_updates(adam, grads, opt_state, params)
      updates, opt_state = adam.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    specs = plain_specs if front_end == "plain" else state_specs
    run = jax.shard_map(body, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs))
    return jax.jit(run)

  expected, _ = public_step("plain", averaged)(params, plain.init(params), x)
  for front_end in ("apply_scaled_updates", "update"):
    out[f"{front_end}_forgotten_pmean"] = _error(
      lambda f=front_end: public_step(f, per_device)(params, adam_state, x)
    )
    stepped, _ = public_step(front_end, averaged)(params, adam_state, x)
    out[f"{front_end}_pmean_max_diff"] = max(
      float(jnp.max(jnp.abs(a - b)))
      for a, b in zip(jax.tree.leaves(stepped), jax.tree.leaves(expected))
    )

  # What JAX does with the gradient of a replicated parameter taken inside
  # shard_map (docs/distributed.md): it sums it over the devices itself.
  def inside(params, x):
    summed = jax.grad(loss)(params, x)
    averaged = jax.grad(lambda p, x: lax.pmean(loss(p, x), "data"))(params, x)
    pmean_of_summed = lax.pmean(summed, "data")
    return summed, averaged, pmean_of_summed, checked_inside(summed, params)

  def checked_inside(grads, params):
    engine.check(grads, state.loss_scale, state.config, state, params)
    return jnp.zeros(())

  summed, averaged, pmean_of_summed, _ = jax.jit(
    jax.shard_map(inside, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
  )(params, x)
  shards = x.reshape(DEVICES, 4, 3)
  per_shard = [jax.grad(loss)(params, s) for s in shards]
  out["inside"] = {
    "summed": np.asarray(summed["w"]).tolist(),
    "averaged": np.asarray(averaged["w"]).tolist(),
    "pmean_of_summed": np.asarray(pmean_of_summed["w"]).tolist(),
    "sum_of_shards": np.asarray(sum(g["w"] for g in per_shard)).tolist(),
    "mean_of_shards": np.asarray(sum(g["w"] for g in per_shard) / DEVICES).tolist(),
  }
  return out


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
  out = tmp_path_factory.mktemp("seams") / "out.json"
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}")
  root = pathlib.Path(__file__).parent.parent
  env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
  proc = subprocess.run(
    [sys.executable, __file__, str(out)],
    check=False,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  return json.loads(out.read_text())


def test_check_refuses_forgotten_pmean_naming_the_fix(seen):
  error = seen["forgotten_pmean"]
  assert error is not None and error["type"] == "ValueError"
  first_line = error["message"].splitlines()[0]
  assert first_line.startswith("jaxamp: average the gradients over the devices")
  assert "grads = lax.pmean(grads, 'data')" in first_line
  assert "['b'] varies over ['data']" in error["message"]  # the first leaf it saw


@pytest.mark.parametrize("case", ["pmean", "params_varying_on_purpose", "sharded_params"])
def test_check_accepts_averaged_sharded_or_deliberately_varying(seen, case):
  assert seen[case] is None


def test_shard_map_gradient_of_replicated_params_is_summed_by_jax(seen):
  # Not a forgotten pmean: JAX's types make the gradient of a replicated
  # parameter the sum over the devices (accepted by the check); pmean leaves it
  # as it is; the gradient of the pmean of the loss is the mean.
  inside = seen["inside"]
  assert inside["summed"] == pytest.approx(inside["sum_of_shards"], rel=1e-6)
  assert inside["pmean_of_summed"] == inside["summed"]
  assert inside["averaged"] == pytest.approx(inside["mean_of_shards"], rel=1e-6)


@pytest.mark.parametrize("front_end", ["apply_scaled_updates", "update"])
def test_public_steps_refuse_forgotten_pmean_before_jax_does(seen, front_end):
  # Without the check, JAX refuses the program later, naming jaxamp's internals
  # (apply_scaled_updates: "cond branches must have equal output types") or the
  # out_specs (tx.update), never the forgotten pmean.
  error = seen[f"{front_end}_forgotten_pmean"]
  assert error is not None and error["type"] == "ValueError"
  assert error["message"].startswith("jaxamp: average the gradients over the devices")


@pytest.mark.parametrize("front_end", ["apply_scaled_updates", "update"])
def test_public_steps_with_pmean_step_as_plain_adam_on_the_mean_gradient(seen, front_end):
  # Within an ulp (of values near 1): XLA fuses plain optax's update with the code
  # around it, a checked one it cannot (docs/optax.md, "At scale 1").
  assert seen[f"{front_end}_pmean_max_diff"] <= 2**-23


if __name__ == "__main__":
  pathlib.Path(sys.argv[1]).write_text(json.dumps(_cases()))
