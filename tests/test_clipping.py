"""``jaxamp.clip_grad_norm`` and ``jaxamp.ops.clip_by_torch_norm`` against torch's
``clip_grad_norm_``, run live, for every kind of ``norm_type`` torch accepts."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import jaxamp

GRADS = [np.array([3.0, -4.0, 0.0], np.float32), np.array([0.5, 1.0], np.float32)]
# Every kind of p torch's vector_norm has: the max, the min, the count of non-zeros,
# 1, 2, other positive and negative p; and the strings float() takes.
NORM_TYPES = [
  2.0,
  1.0,
  3.5,
  0.5,
  float("inf"),
  float("-inf"),
  0.0,
  0,
  -1.0,
  -2.0,
  "inf",
  "-inf",
  "2",
]


def _torch_clip(grads, max_norm, norm_type):
  params = [torch.nn.Parameter(torch.zeros(len(g))) for g in grads]
  for p, g in zip(params, grads):
    p.grad = torch.tensor(g)
  norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
  return [p.grad.numpy() for p in params], norm.numpy()


@pytest.mark.torch
@pytest.mark.parametrize("norm_type", NORM_TYPES, ids=repr)
@pytest.mark.parametrize("max_norm", [1.0, 100.0])
def test_clip_grad_norm_matches_torch(norm_type, max_norm):
  want_grads, want_norm = _torch_clip(GRADS, max_norm, norm_type)
  grads, norm = jaxamp.clip_grad_norm({"a": GRADS[0], "b": GRADS[1]}, max_norm, norm_type)
  np.testing.assert_allclose(np.asarray(norm), want_norm, rtol=1e-6)
  for got, want in zip((grads["a"], grads["b"]), want_grads):
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-7)


@pytest.mark.torch
def test_clip_grad_norm_minus_inf_is_the_minimum_and_leaves_grads():
  """torch's -inf norm is the smallest |g|: 0.5 here, below max_norm 1, so nothing is
  clipped (jaxamp returned 1.0, sum(x**-inf)**-0, and scaled the grads)."""
  grads, norm = jaxamp.clip_grad_norm({"b": GRADS[1]}, 1.0, float("-inf"))
  _, want_norm = _torch_clip([GRADS[1]], 1.0, float("-inf"))
  assert float(norm) == float(want_norm) == 0.5
  np.testing.assert_array_equal(np.asarray(grads["b"]), GRADS[1])


@pytest.mark.torch
def test_clip_grad_norm_zero_counts_nonzero_entries():
  """torch's 0 "norm" is the number of non-zero entries (jaxamp raised a bare
  ZeroDivisionError from 1 / 0)."""
  _, norm = jaxamp.clip_grad_norm({"a": GRADS[0], "b": GRADS[1]}, 1.0, 0)
  _, want_norm = _torch_clip(GRADS, 1.0, 0)
  assert float(norm) == float(want_norm) == 2.0  # two leaves with 2 non-zeros each: [2, 2]


@pytest.mark.torch
@pytest.mark.parametrize("norm_type", ["inf", "-inf", "2"])
def test_clip_grad_norm_takes_a_string_as_torch(norm_type):
  """torch calls float(norm_type) ("inf" is its documented spelling of the max norm);
  jaxamp raised a TypeError."""
  _, norm = jaxamp.clip_grad_norm({"a": GRADS[0]}, 1.0, norm_type)
  _, want_norm = _torch_clip([GRADS[0]], 1.0, norm_type)
  assert float(norm) == float(want_norm)


def test_clip_grad_norm_refuses_what_float_refuses():
  with pytest.raises(ValueError, match="could not convert string to float"):
    jaxamp.clip_grad_norm({"a": jnp.ones(2)}, 1.0, "two")
  with pytest.raises(ValueError, match="could not convert string to float"):
    jaxamp.ops.clip_by_torch_norm(1.0, "two")


@pytest.mark.torch
@pytest.mark.parametrize("norm_type", ["inf", float("-inf"), 0])
def test_clip_by_torch_norm_matches_torch(norm_type):
  tx = optax.chain(jaxamp.ops.clip_by_torch_norm(1.0, norm_type), optax.sgd(1.0))
  params = {"a": jnp.zeros(3), "b": jnp.zeros(2)}
  updates, state = tx.update({"a": GRADS[0], "b": GRADS[1]}, tx.init(params), params)
  want_grads, want_norm = _torch_clip(GRADS, 1.0, norm_type)
  np.testing.assert_allclose(np.asarray(state[0].total_norm), want_norm, rtol=1e-6)
  for got, want in zip((updates["a"], updates["b"]), want_grads):
    np.testing.assert_allclose(-np.asarray(got), want, rtol=1e-6, atol=1e-7)


# timm's utils/agc.py (v1.0), the formula torch programs call through
# timm.utils.dispatch_clip_grad(..., mode="agc"), copied as written.
def _timm_unitwise_norm(x, norm_type=2.0):
  if x.ndim <= 1:
    return x.norm(norm_type)
  return x.norm(norm_type, dim=tuple(range(1, x.ndim)), keepdim=True)


def _timm_adaptive_clip_grad(parameters, clip_factor=0.01, eps=1e-3, norm_type=2.0):
  for p in parameters:
    p_data, g_data = p.detach(), p.grad.detach()
    max_norm = _timm_unitwise_norm(p_data, norm_type=norm_type).clamp_(min=eps).mul_(clip_factor)
    grad_norm = _timm_unitwise_norm(g_data, norm_type=norm_type)
    clipped_grad = g_data * (max_norm / grad_norm.clamp(min=1e-6))
    new_grads = torch.where(grad_norm < max_norm, g_data, clipped_grad)
    p.grad.detach().copy_(new_grads)


@pytest.mark.torch
@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("form", ["function", "optax"])
def test_adaptive_clip_matches_timm_in_torch_layout(norm_type, form):
  # A Linear weight (out, in), its bias, a Conv2d kernel (out, in, h, w) and a
  # positional embedding (1, tokens, width): no single optax axis fits them all.
  rng = np.random.default_rng(0)
  shapes = [(6, 5), (6,), (4, 3, 3, 3), (1, 7, 8)]
  params = [rng.standard_normal(s).astype(np.float32) for s in shapes]
  grads = [(rng.standard_normal(s) * rng.choice([1e-4, 1.0])).astype(np.float32) for s in shapes]
  torch_params = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in params]
  for p, g in zip(torch_params, grads):
    p.grad = torch.from_numpy(g.copy())
  _timm_adaptive_clip_grad(torch_params, 0.02, 1e-3, norm_type)
  want = [p.grad.numpy() for p in torch_params]
  jparams, jgrads = [jnp.asarray(p) for p in params], [jnp.asarray(g) for g in grads]
  if form == "function":
    got = jaxamp.ops.adaptive_clip_grad(jgrads, jparams, 0.02, 1e-3, norm_type)
  else:
    tx = jaxamp.ops.adaptive_clip_by_torch_layout(0.02, 1e-3, norm_type)
    got, _ = tx.update(jgrads, tx.init(jparams), jparams)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), w, rtol=2e-6, atol=0)
  assert any(not np.array_equal(w, g) for w, g in zip(want, grads))  # some were clipped
  assert any(np.array_equal(w, g) for w, g in zip(want, grads))  # some were kept


def test_adaptive_clip_by_torch_layout_needs_params():
  tx = jaxamp.ops.adaptive_clip_by_torch_layout()
  with pytest.raises(ValueError, match="pass params"):
    tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)}))


@pytest.mark.torch
@pytest.mark.parametrize("form", ["optax", "grad_scaler"])
def test_value_clipping_matches_torch_clip_grad_value(form):
  """torch's AMP loop: ``scaler.unscale_``, ``clip_grad_value_(params, 0.1)``, ``step``;
  jaxamp: ``optax.clip(0.1)`` chained inside the scaler, or ``jnp.clip`` after
  ``unscale_`` (docs/index.md, docs/porting.md). SGD with lr 1, so the update is the
  clipped gradient."""
  rng = np.random.default_rng(1)
  scale = 1024.0
  grads = [(rng.standard_normal(s) * 0.2 * scale).astype(np.float32) for s in [(5, 3), (7,)]]
  params = [torch.nn.Parameter(torch.zeros(g.shape)) for g in grads]
  opt = torch.optim.SGD(params, lr=1.0)
  scaler = torch.amp.GradScaler("cpu", init_scale=scale)
  scaler.scale(torch.tensor(1.0))  # the loss's backward gave grads
  for p, g in zip(params, grads):
    p.grad = torch.from_numpy(g.copy())
  scaler.unscale_(opt)
  torch.nn.utils.clip_grad_value_(params, 0.1)
  scaler.step(opt)
  want = [p.detach().numpy() for p in params]
  jgrads, zeros = [jnp.asarray(g) for g in grads], [jnp.zeros(g.shape) for g in grads]
  if form == "optax":
    tx = jaxamp.dynamic_loss_scale(optax.chain(optax.clip(0.1), optax.sgd(1.0)), init_scale=scale)
    updates, _ = tx.update(jgrads, tx.init(zeros), zeros)
    got = optax.apply_updates(zeros, updates)
  else:
    jscaler = jaxamp.GradScaler(init_scale=scale)
    jscaler.scale(jnp.float32(1.0))
    jopt = jaxamp.Optimizer(optax.sgd(1.0), zeros, grads=jgrads)
    jscaler.unscale_(jopt)
    jopt.grads = [jnp.clip(g, -0.1, 0.1) for g in jopt.grads]
    jscaler.step(jopt)
    got = jopt.params
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), w)
  assert any((np.abs(w) == 0.1).any() for w in want)  # some were clipped
  assert any(((np.abs(w) < 0.1) & (w != 0)).any() for w in want)  # some were kept
