"""``jaxamp.accumulate_gradients``: windows, and states restored into another window."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import bits

import jaxamp

PARAMS = {"w": jnp.ones(3)}


def _tx(every_k):
  return jaxamp.accumulate_gradients(
    jaxamp.dynamic_loss_scale(optax.sgd(0.5), init_scale=4.0), every_k
  )


def _step(front_end, tx, jit):
  if front_end == "optax":

    def step(params, state, grads):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

  else:

    def step(params, state, grads):
      return jaxamp.apply_scaled_updates(tx, grads, state, params)

  return jax.jit(step) if jit else step


@pytest.mark.slow
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("front_end", ["optax", "apply_scaled_updates"])
def test_accumulate_gradients_state_saved_mid_window_resumes_in_a_shorter_window(front_end, jit):
  """A state saved after 3 calls of a 4-call window, restored into every_k=2:
  the next call ends the window on the sum so far (4 micro-batches), and the
  windows after it are every_k=2 windows. (It used to count past the window
  and never apply an update again, silently.)"""
  grads = [{"w": jnp.full(3, 4.0 * (i + 1))} for i in range(9)]  # scaled by 4
  params, state = PARAMS, _tx(4).init(PARAMS)
  step4, step2 = _step(front_end, _tx(4), jit), _step(front_end, _tx(2), jit)
  for g in grads[:3]:
    params, state = step4(params, state, g)
  assert int(state.mini_step) == 3 and bits(params) == bits(PARAMS)
  seen = []
  for g in grads[3:]:
    params, state = step2(params, state, g)
    seen.append(np.asarray(params["w"]).tolist())
  # sgd(0.5) on the unscaled sums: (1+2+3+4), then (5+6), (7+8); the 9th opens a window.
  want = [-4.0, -4.0, -9.5, -9.5, -17.0, -17.0]
  assert seen == [[w] * 3 for w in want]
  assert int(state.mini_step) == 1


def test_accumulate_gradients_state_restored_into_a_longer_window_keeps_counting():
  """The other way (every_k=2 saved mid-window, every_k=4 resumed) needs nothing:
  the window ends after its 4th micro-batch."""
  tx2, tx4 = _tx(2), _tx(4)
  state = tx2.init(PARAMS)
  ones = {"w": jnp.full(3, 4.0)}
  _, state = tx2.update(ones, state, PARAMS)
  outs = []
  for _ in range(3):
    updates, state = tx4.update(ones, state, PARAMS)
    outs.append(float(updates["w"][0]))
  assert outs == [0.0, 0.0, -0.5 * 4.0]


@pytest.mark.parametrize("every_k", [0, 2**31, True, 2.0])
def test_accumulate_gradients_refuses_every_k_outside_int32_windows(every_k):
  with pytest.raises(ValueError, match=r"every_k must be an int from 1 to 2\*\*31 - 1"):
    jaxamp.accumulate_gradients(optax.sgd(0.1), every_k)


def test_accumulate_gradients_takes_the_largest_int32_window():
  tx = jaxamp.accumulate_gradients(optax.sgd(0.1), 2**31 - 1)
  params = {"w": jnp.ones(2)}
  updates, state = jax.jit(tx.update)({"w": jnp.ones(2)}, tx.init(params), params)
  assert updates["w"].tolist() == [0.0, 0.0] and int(state.mini_step) == 1


def _torch_windows(grads, windows, lr, init_scale):
  """torch's loop: ``.grad`` summed over each window's micro-batches (the
  last window shorter), then ``scaler.step``, ``update`` and ``zero_grad``."""
  torch = pytest.importorskip("torch")
  w = torch.nn.Parameter(torch.ones(3))
  opt = torch.optim.SGD([w], lr=lr)
  scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=1)
  out, grads = [], iter(grads)
  for size in windows:
    for _ in range(size):
      scaler.scale(torch.ones(()))  # the scale of this iteration, as a backward would use
      g = torch.from_numpy(np.asarray(next(grads)))
      w.grad = g.clone() if w.grad is None else w.grad + g
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    out.append((w.detach().numpy().copy(), scaler.get_scale()))
  return out


@pytest.mark.torch
@pytest.mark.parametrize("form", ["optax", "apply_scaled_updates"])
def test_accumulate_gradients_end_window_matches_torch_short_last_window(form):
  # Windows of 3, 3 and 1 micro-batches (every_k=3, the last ended early),
  # an inf in the second: torch's step() after fewer backward passes.
  rng = np.random.default_rng(0)
  grads = [rng.standard_normal(3).astype(np.float32) * 64 for _ in range(7)]
  grads[4][1] = np.inf
  want = _torch_windows(grads, [3, 3, 1], lr=0.1, init_scale=64.0)
  tx = jaxamp.accumulate_gradients(
    jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=64.0, growth_interval=1), 3
  )
  params = {"w": jnp.ones(3)}
  state = tx.init(params)

  @functools.partial(jax.jit, static_argnames="end")
  def step(params, state, g, end):
    if form == "optax":
      updates, state = tx.update(g, state, params, end_window=end)
      return optax.apply_updates(params, updates), state
    return jaxamp.apply_scaled_updates(tx, g, state, params, end_window=end)

  got = []
  for i, g in enumerate(grads):
    params, state = step(params, state, {"w": jnp.asarray(g)}, i == 6)
    if i in (2, 5, 6):
      got.append((np.asarray(params["w"]), float(jaxamp.get_loss_scale(state))))
  for (gw, gs), (ww, ws) in zip(got, want):
    assert gw.tobytes() == ww.tobytes() and gs == ws
  assert int(state.mini_step) == 0


def test_accumulate_gradients_end_window_traced_and_refused_without_a_window():
  tx = jaxamp.accumulate_gradients(optax.sgd(1.0), 4)
  params = {"w": jnp.zeros(1)}
  step = jax.jit(lambda g, s, end: tx.update(g, s, params, end_window=end))
  updates, state = step({"w": jnp.ones(1)}, tx.init(params), jnp.bool_(True))
  assert updates["w"].tolist() == [-1.0] and int(state.mini_step) == 0
  bare = jaxamp.dynamic_loss_scale(optax.sgd(1.0))
  with pytest.raises(TypeError, match="end_window ends a jaxamp.accumulate_gradients window"):
    bare.update({"w": jnp.ones(1)}, bare.init(params), params, end_window=True)
  with pytest.raises(TypeError, match="end_window ends a jaxamp.accumulate_gradients window"):
    jaxamp.apply_scaled_updates(
      bare, {"w": jnp.ones(1)}, bare.init(params), params, end_window=True
    )
