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
