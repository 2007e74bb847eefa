"""``jaxamp.scale_loss`` against ``torch.amp.GradScaler.scale``, run live.

A float16 loss keeps torch's arithmetic: the scaled loss has torch's dtype, and
its gradient starts from the scale cast to float16, inf from 65536 on, so the
steps at such a scale are skipped in both. jaxamp warns, with the fix.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

torch = pytest.importorskip("torch")

FLOAT16_LOSS = r"^jaxamp: scale_loss got a float16 loss"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@pytest.mark.torch
@pytest.mark.parametrize("shape", [(), (1,), (1, 1)], ids=["0-dim", "1", "1x1"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_scale_loss_dtype_and_value_matches_torch(dtype, shape):
  scaler = torch.amp.GradScaler("cpu")  # a 0-dim float32 scale, 65536
  want = scaler.scale(torch.full(shape, 2.0, dtype=DTYPES[dtype]))
  state = jaxamp.dynamic_loss_scale(optax.sgd(0.1)).init({"w": jnp.ones(3)})
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    got = jaxamp.scale_loss(jnp.full(shape, 2.0, dtype), state)
  assert str(got.dtype) == str(want.dtype).removeprefix("torch."), (got.dtype, want.dtype)
  assert got.shape == tuple(want.shape)
  np.testing.assert_array_equal(np.asarray(got, np.float64), want.double().numpy())
  # a 0-dim float16 loss scales to float32 131072, a 1-element one to float16 inf
  assert np.isinf(np.asarray(got, np.float64)).all() == (dtype == "float16" and shape != ())
  warned = [w for w in caught if "jaxamp: scale_loss got a float16 loss" in str(w.message)]
  assert len(warned) == (dtype == "float16")


def _torch_run(loss_in, steps):
  """A float16 linear model trained with torch's GradScaler: (skipped, scale) per step."""
  gen = torch.Generator().manual_seed(0)
  x = torch.randn(64, 8, generator=gen) * 0.01
  y = x.sum(1, keepdim=True)
  w = torch.zeros(8, 1, requires_grad=True)
  opt = torch.optim.SGD([w], lr=0.01)
  scaler = torch.amp.GradScaler("cpu", growth_interval=2)
  trace = []
  for _ in range(steps):
    opt.zero_grad()
    pred = x.half() @ w.half()
    if loss_in == "float16":
      loss = ((pred - y.half()) ** 2).mean()
    elif loss_in == "float16, cast":
      loss = ((pred - y.half()) ** 2).mean().float()
    else:
      loss = ((pred.float() - y) ** 2).mean()
    scaler.scale(loss).backward()
    scale = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    trace.append((scaler.get_scale() < scale, scaler.get_scale()))
  return trace, x.numpy(), y.numpy()


def _jaxamp_run(loss_in, steps, x, y):
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.01), growth_interval=2)
  params = {"w": jnp.zeros((8, 1))}
  opt_state = tx.init(params)
  x, y = jnp.asarray(x), jnp.asarray(y)

  def loss_fn(params):
    pred = x.astype(jnp.float16) @ params["w"].astype(jnp.float16)
    if loss_in == "float16":
      return jnp.mean((pred - y.astype(jnp.float16)) ** 2)
    if loss_in == "float16, cast":
      return jnp.mean((pred - y.astype(jnp.float16)) ** 2).astype(jnp.float32)
    return jnp.mean((pred.astype(jnp.float32) - y) ** 2)

  @jax.jit
  def step(params, opt_state):
    grads = jax.grad(lambda p: jaxamp.scale_loss(loss_fn(p), opt_state))(params)
    return jaxamp.apply_scaled_updates(tx, grads, opt_state, params)

  trace = []
  for _ in range(steps):
    params, opt_state = step(params, opt_state)
    trace.append((bool(opt_state.found_inf), float(jaxamp.get_loss_scale(opt_state))))
  return trace


@pytest.mark.torch
def test_scale_loss_float16_loss_skips_every_step_at_65536_matches_torch():
  want, x, y = _torch_run("float16", 8)
  with pytest.warns(UserWarning, match=FLOAT16_LOSS):
    got = _jaxamp_run("float16", 8, x, y)  # traced once: one warning
  assert got == want
  # Every step that starts at 65536 is skipped, and only those: growth_interval=2
  # clean steps at 32768 grow the scale back, and the next step overflows.
  starts = [65536.0] + [scale for _, scale in got[:-1]]
  assert [skipped for skipped, _ in got] == [start >= 65536 for start in starts]
  assert [i for i, (skipped, _) in enumerate(got) if skipped] == [0, 3, 6]


@pytest.mark.torch
@pytest.mark.parametrize("loss_in", ["float16, cast", "float32"])
def test_scale_loss_float32_loss_matches_torch(loss_in):
  """The loss cast to float32 after it is computed in float16 skips as the float16 loss
  (its gradient is cast back); computed in float32 from float32 values, no step is skipped."""
  want, x, y = _torch_run(loss_in, 8)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # a float32 loss does not warn
    got = _jaxamp_run(loss_in, 8, x, y)
  assert got == want
  assert any(skipped for skipped, _ in got) == (loss_in == "float16, cast")
