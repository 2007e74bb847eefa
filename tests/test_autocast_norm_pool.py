"""``jaxamp.autocast`` on batch norm and average pooling, against torch run live
(docs/autocast.md, "Batch norm and average pooling").

torch's ``batch_norm`` and pools are on no autocast list: a half input gives a half
output, computed in float32 and rounded once; the float32 weights and running
statistics stay float32. jaxamp runs Flax's and Equinox's ``BatchNorm`` as one fused
op, the same way; a batch norm written out runs primitive by primitive, so its float32
scale and bias promote the output to float32. Flax's ``avg_pool`` rounds at each add
of the window and at the division, where torch's kernel rounds once. These tests hold
the page to what torch and jaxamp do.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flax import linen, nnx
from jax import lax
from test_autocast_layers import HALVES, _cuda_autocast, _name

import jaxamp

pytestmark = pytest.mark.torch

C = 4
BATCH_NORMS = ("linen", "nnx", "equinox", "written_out")


def _images(scale=1.0, shape=(8, 6, 6, C)):
  return jnp.asarray(np.random.default_rng(0).standard_normal(shape) * scale, jnp.float32)


def _batch_norm(lib):
  """``(fn, params)``: ``fn(params, x) -> (y, running_var)``, the library's batch
  norm in training mode on NHWC ``x``."""
  if lib == "linen":
    module = linen.BatchNorm(use_running_average=False, epsilon=1e-5)

    def fn(variables, x):
      y, updated = module.apply(variables, x, mutable=["batch_stats"])
      return y, updated["batch_stats"]["var"]

    return fn, module.init(jax.random.key(0), _images())
  if lib == "nnx":
    graphdef, state = nnx.split(nnx.BatchNorm(C, epsilon=1e-5, rngs=nnx.Rngs(0)))

    def fn(state, x):
      module = nnx.merge(graphdef, state)
      return module(x), module.var[...]

    return fn, state
  if lib == "equinox":
    module, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(C, "batch", eps=1e-5, mode="batch")

    def fn(state, x):
      flat = x.reshape(-1, C)
      y, new = jax.vmap(module, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
        flat, state
      )
      return y.reshape(x.shape), new.get(module.batch_state_index)[1]

    return fn, state

  def fn(params, x):  # written out, with float32 weight and bias as torch's module holds them
    mean, var = x.mean((0, 1, 2)), x.var((0, 1, 2))
    return (x - mean) * lax.rsqrt(var + 1e-5) * params["weight"] + params["bias"], var

  return fn, {"weight": jnp.ones(C), "bias": jnp.zeros(C)}


def _after_matmul(fn, inputs):
  """``fn`` on half inputs under autocast (``x`` multiplied by the identity first)."""
  return (lambda p, x: fn(p, x @ jnp.eye(C))) if inputs == "half" else fn


@functools.cache
def torch_batch_norm_dtypes(inputs, half, policy):
  """torch's ``BatchNorm2d`` under autocast: the output's and the running
  variance's dtypes, on float32 inputs or on half ones (after a matmul)."""
  dtype = HALVES[half][1]
  module = torch.nn.BatchNorm2d(C)
  if policy == "cpu":
    x = torch.randn(8, C, 6, 6)
    with torch.autocast("cpu", dtype):
      if inputs == "half":
        x = (x.transpose(1, 3) @ torch.eye(C)).transpose(1, 3)
      y = module(x)
    return _name(y.dtype), _name(module.running_var.dtype)
  params = dict(module.state_dict())
  with _cuda_autocast(dtype):
    cuda = {k: torch.empty_like(v, device="cuda") for k, v in params.items()}
    x = torch.empty(8, C, 6, 6, device="cuda")
    if inputs == "half":
      x = (x.transpose(1, 3) @ torch.empty(C, C, device="cuda")).transpose(1, 3)
    # training mode without running statistics: fake tensors cannot update them in place
    y = F.batch_norm(x, None, None, cuda["weight"], cuda["bias"], training=True)
  return _name(y.dtype), _name(cuda["running_var"].dtype)


@pytest.mark.parametrize("policy", ["cpu", "cuda"])
@pytest.mark.parametrize("half", sorted(HALVES))
@pytest.mark.parametrize("inputs", ["float32", "half"])
@pytest.mark.parametrize("lib", BATCH_NORMS)
def test_batch_norm_dtypes_against_torch(lib, inputs, half, policy):
  fn, params = _batch_norm(lib)
  run = jaxamp.autocast(_after_matmul(fn, inputs), HALVES[half][0], policy=policy)
  y, running_var = jax.eval_shape(run, params, _images())
  theirs, theirs_stats = torch_batch_norm_dtypes(inputs, half, policy)
  # torch: the input's dtype out, float32 statistics
  assert (theirs, theirs_stats) == (inputs if inputs == "float32" else half, "float32")
  # jaxamp: the libraries' layers as torch's; written out, the float32 scale and bias
  # promote the output to float32 (the documented difference); float32 running
  # statistics (a written-out batch norm has none)
  assert _name(y.dtype) == ("float32" if lib == "written_out" else theirs)
  assert lib == "written_out" or _name(running_var.dtype) == "float32"


def _torch_batch_norm(x, dtype):
  """torch's BatchNorm2d in training mode on ``x`` (NHWC) cast to ``dtype``: the output
  as float32 (NHWC) and the running variance."""
  module = torch.nn.BatchNorm2d(C)
  with torch.autocast("cpu", dtype):
    y = module(torch.tensor(np.asarray(x)).permute(0, 3, 1, 2).to(dtype))
  assert y.dtype == dtype
  return y.detach().float().permute(0, 2, 3, 1).numpy(), module.running_var.numpy()


@pytest.mark.parametrize("policy", ["cpu", "cuda"])
@pytest.mark.parametrize("half", sorted(HALVES))
@pytest.mark.parametrize("lib", ["linen", "nnx", "equinox"])
def test_library_batch_norm_values_against_torch(lib, half, policy):
  jdtype, tdtype = HALVES[half]
  # activations of magnitude 300: x * x overflows float16, as Flax's fast variance
  # would square them if run primitive by primitive in the half dtype
  x = _images(scale=300.0).astype(jdtype).astype(jnp.float32)
  theirs, theirs_var = _torch_batch_norm(x, tdtype)
  assert np.isfinite(theirs).all() and np.isfinite(theirs_var).all()
  batch_norm, params = _batch_norm(lib)
  y, var = jaxamp.autocast(_after_matmul(batch_norm, "half"), jdtype, policy=policy)(params, x)
  assert y.dtype == jdtype and var.dtype == jnp.float32
  assert bool(jnp.isfinite(var).all())
  # computed in float32 and rounded once, as torch: within one rounding of torch's
  # half output (their float32 sums differ in order)
  ulp = 2.0 ** -jnp.finfo(jdtype).nmant
  np.testing.assert_allclose(np.asarray(y.astype(jnp.float32)), theirs, rtol=ulp, atol=ulp)


@pytest.mark.parametrize("policy", ["cpu", "cuda"])
def test_equinox_batch_norm_with_autocast_inside_vmap_keeps_float32_statistics(policy):
  # vmap outside autocast: the per-example trace's input and statistics have the
  # same shape, and the statistics come through the batch axis' psum
  x = _images(scale=300.0).astype(jnp.float16).astype(jnp.float32)
  theirs, _ = _torch_batch_norm(x, torch.float16)
  module, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(C, "batch", eps=1e-5, mode="batch")
  per_example = jaxamp.autocast(lambda row, state: module(row @ jnp.eye(C), state), policy=policy)
  y, new = jax.vmap(per_example, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
    x.reshape(-1, C), state
  )
  mean, var = new.get(module.batch_state_index)
  assert y.dtype == jnp.float16 and mean.dtype == var.dtype == jnp.float32
  assert bool(jnp.isfinite(var).all())
  ulp = 2.0**-10
  y = np.asarray(y.astype(jnp.float32)).reshape(x.shape)
  np.testing.assert_allclose(y, theirs, rtol=ulp, atol=ulp)


def test_fast_variance_written_out_overflows_float16_under_the_cpu_policy():
  # the control for the test above: the arithmetic of Flax's fast variance, written
  # out, runs primitive by primitive in float16 and squares 300 to inf
  x = _images(scale=300.0)

  def fast_variance(x):
    h = x @ jnp.eye(C)
    return (h * h).mean((0, 1, 2)) - h.mean((0, 1, 2)) ** 2

  assert bool(jnp.isinf(jaxamp.autocast(fast_variance, policy="cpu")(x)).all())


def _pool_inputs(half):
  """Half values (NHWC, as float32) and the same values as a torch NCHW half tensor."""
  x = _images(scale=3.0, shape=(32, 14, 14, C)).astype(HALVES[half][0]).astype(jnp.float32)
  return x, torch.tensor(np.asarray(x)).to(HALVES[half][1]).permute(0, 3, 1, 2)


@pytest.mark.parametrize("policy", ["cpu", "cuda"])
@pytest.mark.parametrize("half", sorted(HALVES))
def test_average_pooling_against_torch(half, policy):
  jdtype, tdtype = HALVES[half]
  x, xt = _pool_inputs(half)
  with torch.autocast("cpu", tdtype):
    pooled_t = F.avg_pool2d(xt, 7).permute(0, 2, 3, 1).float().numpy()
    global_t = F.adaptive_avg_pool2d(xt, 1).flatten(1)
  assert _name(global_t.dtype) == half
  global_t = global_t.float().numpy()
  with _cuda_autocast(tdtype):
    xc = torch.empty(32, C, 14, 14, device="cuda") @ torch.empty(14, 14, device="cuda")
    assert _name(F.avg_pool2d(xc, 7).dtype) == _name(F.adaptive_avg_pool2d(xc, 1).dtype) == half

  def run(fn):
    return jaxamp.autocast(lambda x: fn(x @ jnp.eye(C)), jdtype, policy=policy)(x)

  pooled = run(lambda h: linen.avg_pool(h, (7, 7), (7, 7)))
  global_mean = run(lambda h: h.mean(axis=(1, 2)))
  # dtypes: avg_pool half, as torch's; the mean half on cpu, float32 on cuda
  assert pooled.dtype == jdtype
  assert global_mean.dtype == (jdtype if policy == "cpu" else jnp.float32)
  # values: torch rounds once; Flax's avg_pool rounds at each add and at the division
  same = np.asarray(pooled.astype(jnp.float32)) == pooled_t
  assert 0.05 < same.mean() < 0.6, same.mean()
  same_global = np.asarray(global_mean.astype(jdtype).astype(jnp.float32)) == global_t
  if policy == "cpu":  # summed in float32 and rounded, then divided and rounded again
    assert 0.3 < same_global.mean() < 1, same_global.mean()
  else:  # float32 throughout: rounded to the half dtype, torch's
    assert same_global.all()
  # the pool in float32, rounded once to the half dtype: torch's values
  pooled_f32 = run(
    lambda h: jaxamp.autocast_disabled(lambda h: linen.avg_pool(h, (7, 7), (7, 7)))(h).astype(
      jdtype
    )
  )
  assert pooled_f32.dtype == jdtype
  np.testing.assert_array_equal(np.asarray(pooled_f32.astype(jnp.float32)), pooled_t)


def test_max_pool_with_an_array_init_value_is_not_differentiable_under_autocast_as_under_jit():
  w, x = jnp.eye(C), _images(shape=(1, 4, 4, C))

  def loss(w, x, init=None):  # a 2x2 max pool after a matmul; init None: an array
    h = x @ w
    init = jnp.array(-jnp.inf, h.dtype) if init is None else init
    return lax.reduce_window(h, init, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID").sum()

  array_init = loss
  for fn in (jax.jit(array_init), jaxamp.autocast(array_init)):
    with pytest.raises(ValueError, match="Linearization failed"):
      jax.grad(fn)(w, x)
  assert jax.grad(array_init)(w, x).dtype == jnp.float32  # eager JAX differentiates it
  # a Python scalar init, Flax's max_pool and Equinox's MaxPool2d: differentiable
  pools = [
    functools.partial(loss, init=-jnp.inf),
    lambda w, x: linen.max_pool(x @ w, (2, 2), (2, 2)).sum(),
    lambda w, x: jax.vmap(eqx.nn.MaxPool2d(2, 2))(jnp.moveaxis(x @ w, -1, 1)).sum(),
  ]
  for fn in pools:
    reference = jax.grad(fn)(w, x)
    grads = jax.grad(jaxamp.autocast(fn))(w, x)
    assert grads.dtype == jnp.float32 and grads.shape == reference.shape
