"""The ten exact torch trajectories of fixtures.json through ``dynamic_loss_scale``.

Each fixture injects the same scaled gradients that torch saw (inf/NaN
included), so autodiff differences cannot leak in: scales, trackers, skip
decisions and unscaled gradients must match torch bit for bit.
"""

import contextlib
import struct

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

NAMES = [
  "basic_gi3",
  "odd_factors",
  "nan_first",
  "neg_inf_gi1",
  "gf1.1_bf0.9",
  "adam_skip",
  "momentum_skip",
  "float64_params",
  "bf16_params",
  "default_65536",
]
DTYPES = {
  "torch.float32": jnp.float32,
  "torch.float64": jnp.float64,
  "torch.bfloat16": jnp.bfloat16,
}
OPTIMIZERS = {
  "sgd": lambda lr: optax.sgd(lr),
  "sgd_momentum": lambda lr: optax.sgd(lr, momentum=0.9),
  "adam": lambda lr: optax.adam(lr),
}


def _f32_hex(x):
  return struct.pack(">f", float(x)).hex()


def _scaler_kwargs(fixture):
  return {
    "init_scale": fixture["init_scale"],
    "growth_factor": fixture["growth_factor"],
    "backoff_factor": fixture["backoff_factor"],
    "growth_interval": fixture["growth_interval"],
  }


def _precision(fixture):
  return jax.enable_x64(True) if "float64" in fixture["param_dtype"] else contextlib.nullcontext()


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_dynamic_loss_scale_scales_trackers_and_unscaled_grads_match_torch_fixture(
  name, torch_fixtures
):
  fixture = torch_fixtures[name]
  with _precision(fixture):
    dtype = DTYPES[fixture["param_dtype"]]
    # optax.identity(): the updates are exactly the unscaled gradients.
    tx = jaxamp.dynamic_loss_scale(optax.identity(), **_scaler_kwargs(fixture))
    params = jnp.asarray(fixture["init_params"], dtype)
    state = tx.init(params)
    update = jax.jit(tx.update)
    for it in fixture["iters"]:
      assert _f32_hex(jaxamp.get_loss_scale(state)) == it["scale_used_hex"]
      grads = jnp.asarray(it["scaled_grad"], dtype)
      updates, state = update(grads, state, params)
      skipped = it["found_inf"] != 0
      assert bool(state.found_inf) == skipped, f"iter {it['i']}"
      if not skipped:
        want = np.asarray(jnp.asarray(it["unscaled_grad"], dtype))
        assert np.asarray(updates).tobytes() == want.tobytes(), f"iter {it['i']}"
      else:
        assert not np.any(np.asarray(updates, np.float64))  # zeros on a skipped step
      assert _f32_hex(state.loss_scale) == it["scale_after_hex"], f"iter {it['i']}"
      assert int(state.growth_tracker) == it["growth_tracker_after"], f"iter {it['i']}"
      # The building block gives torch's unscaled grads on skipped steps too.
      unscaled, found_inf = jaxamp.ops.unscale_and_check(grads, jnp.float32(it["scale_used"]))
      want = np.asarray(jnp.asarray(it["unscaled_grad"], dtype))
      assert np.asarray(unscaled).tobytes() == want.tobytes(), f"iter {it['i']}"
      assert bool(found_inf) == skipped


@pytest.mark.parametrize("name", NAMES)
def test_dynamic_loss_scale_params_and_optimizer_state_match_torch_fixture(name, torch_fixtures):
  fixture = torch_fixtures[name]
  with _precision(fixture):
    dtype = DTYPES[fixture["param_dtype"]]
    tx = jaxamp.dynamic_loss_scale(
      OPTIMIZERS[fixture["optimizer"]](fixture["lr"]), **_scaler_kwargs(fixture)
    )
    params = jnp.asarray(fixture["init_params"], dtype)
    state = tx.init(params)

    @jax.jit
    def step(params, state, grads):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    # The scaler's part (unscaled grads, skips) is bit-exact (test above); the
    # optimizers round differently: torch's SGD adds p + (-lr)*g with one fused
    # rounding, optax rounds -lr*g first (1 ulp a step); Adam's formulas
    # differ in the order of operations (a few ulps). bfloat16: within one
    # bf16 ulp (2**-7 relative).
    eps = float(jnp.finfo(dtype).eps)
    rtol = {"adam": 1e-5}.get(fixture["optimizer"], 8 * eps)
    if dtype == jnp.bfloat16:
      rtol = 2.0**-7
    for it in fixture["iters"]:
      before = np.asarray(params, np.float64)
      params, state = step(params, state, jnp.asarray(it["scaled_grad"], dtype))
      got = np.asarray(params, np.float64)
      want = np.asarray(it["params_after"], np.float64)
      if it["found_inf"]:
        assert got.tobytes() == before.tobytes(), f"iter {it['i']}: params moved on a skip"
      np.testing.assert_allclose(got, want, rtol=rtol, atol=0, err_msg=f"iter {it['i']}")
      _check_optimizer_state(fixture["optimizer"], state.inner_state, it["opt_state"], rtol)


def _check_optimizer_state(optimizer, inner_state, torch_state, rtol):
  if optimizer == "adam":
    adam = inner_state[0]
    if not torch_state:  # torch's state is empty until the first real step
      assert int(adam.count) == 0
      return
    assert int(adam.count) == int(torch_state["step"])
    np.testing.assert_allclose(adam.mu, torch_state["exp_avg"], rtol=rtol)
    np.testing.assert_allclose(adam.nu, torch_state["exp_avg_sq"], rtol=rtol)
  elif optimizer == "sgd_momentum":
    trace = inner_state[0].trace
    if torch_state.get("momentum_buffer") is None:
      assert not np.any(np.asarray(trace))
    else:
      np.testing.assert_allclose(trace, torch_state["momentum_buffer"], rtol=rtol)


def test_fixtures_vendored_copy_equals_the_shared_torch_reference():
  from conftest import FIXTURES, SHARED_FIXTURES

  if not SHARED_FIXTURES.exists():
    pytest.skip(f"no shared torch reference at {SHARED_FIXTURES} to compare the copy with")
  assert FIXTURES.read_bytes() == SHARED_FIXTURES.read_bytes()
