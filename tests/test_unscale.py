"""``unscale_and_check`` against torch's unscale kernel (docs/torch_semantics.md §3.1, §3.2, §5.8)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import bits

import jaxamp

GRADS = [1.0, 10.0, 100.0, 12345.0]

# docs/torch_semantics.md §5.8, measured on torch 2.13: (scale, dtype, torch's unscaled grads).
TORCH_5_8 = [
  (3.0, jnp.float32, [0.3333333432674408, 3.3333334922790527, 33.333335876464844, 4115.0]),
  (3.0, jnp.float16, [0.333251953125, 3.333984375, 33.34375, 4116.0]),
  (3.0, jnp.bfloat16, [0.333984375, 3.328125, 33.25, 4128.0]),
  (
    196608.0,
    jnp.float32,
    [5.086263172415784e-06, 5.086263263365254e-05, 0.0005086263408884406, 0.0627899169921875],
  ),
  (0.1, jnp.float32, [10.0, 100.0, 1000.0, 123450.0]),
  (0.1, jnp.float16, [10.0, 100.0, 1000.0, float("inf")]),
  (
    7.0,
    jnp.float32,
    [0.1428571492433548, 1.4285714626312256, 14.285715103149414, 1763.571533203125],
  ),
]


@pytest.mark.parametrize("scale,dtype,expected", TORCH_5_8)
def test_unscale_and_check_matches_torch_unscale(scale, dtype, expected):
  grads = {"g": jnp.asarray(GRADS, dtype)}
  unscaled, found_inf = jax.jit(jaxamp.ops.unscale_and_check)(grads, jnp.float32(scale))
  assert unscaled["g"].dtype == dtype
  want = np.asarray(jnp.asarray(expected, dtype))
  assert np.asarray(unscaled["g"]).tobytes() == want.tobytes()
  assert not bool(found_inf)  # the fp16 overflow to inf is not detected, as in torch


def test_unscale_and_check_float64_matches_torch():
  with jax.enable_x64(True):
    grads = jnp.asarray(GRADS, jnp.float64)
    unscaled, _ = jax.jit(jaxamp.ops.unscale_and_check)(grads, jnp.float32(3.0))
    expected = [0.3333333432674408, 3.333333432674408, 33.33333432674408, 4115.000122636557]
    assert unscaled.dtype == jnp.float64
    assert np.asarray(unscaled).tobytes() == np.asarray(expected, np.float64).tobytes()


def test_unscale_and_check_multiplies_by_reciprocal_not_divides():
  # docs/torch_semantics.md §3.2: with scale 3, about a third of float32 grads differ from g / 3.
  grads = np.random.default_rng(0).normal(0, 300, 100_000).astype(np.float32)
  unscaled, _ = jaxamp.ops.unscale_and_check(jnp.asarray(grads), jnp.float32(3.0))
  inv = np.float32(1.0 / np.float64(np.float32(3.0)))
  assert np.asarray(unscaled).tobytes() == (grads * inv).tobytes()
  assert np.sum(np.asarray(unscaled) != grads / np.float32(3.0)) > 20_000


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("position", [0, "middle", -1])
@pytest.mark.parametrize("size", [1, 7, 1000, 100_003])
def test_unscale_and_check_detects_any_non_finite(dtype, bad, position, size):
  grads = np.ones(size, np.float32)
  index = size // 2 if position == "middle" else position
  grads[index] = bad
  clean = {"a": jnp.ones((3, 4), dtype), "b": None}
  tree = dict(clean, c=jnp.asarray(grads, dtype))
  check = jax.jit(jaxamp.ops.unscale_and_check)
  assert bool(check(tree, jnp.float32(4.0))[1])
  assert not bool(check(clean, jnp.float32(4.0))[1])


def test_unscale_and_check_detects_on_scaled_input_not_on_product():
  # docs/torch_semantics.md §3.2: bf16 3e38 at scale 0.5 becomes inf after unscaling, unnoticed.
  grads = jnp.asarray([3e38], jnp.bfloat16)
  unscaled, found_inf = jax.jit(jaxamp.ops.unscale_and_check)(grads, jnp.float32(0.5))
  assert np.isinf(np.asarray(unscaled, np.float32)[0]) and not bool(found_inf)


def test_unscale_and_check_unscales_even_when_not_finite():
  # Scenario 25: grads [8, 16, inf] at scale 4 -> [2, 4, inf].
  unscaled, found_inf = jaxamp.ops.unscale_and_check(jnp.array([8.0, 16.0, np.inf]), jnp.float32(4))
  assert unscaled.tolist() == [2.0, 4.0, np.inf] and bool(found_inf)


def test_unscale_and_check_inverse_one_passes_values_through():
  # inv == 1: torch leaves the values untouched: -0.0 and a subnormal keep their
  # bits (XLA would flush a subnormal times 1.0 to zero).
  grads = np.array([-0.0, 1e-40, 3.0, np.nan], np.float32)
  unscaled, _ = jax.jit(jaxamp.ops.unscale_and_check)(jnp.asarray(grads), jnp.float32(1.0))
  assert np.asarray(unscaled).tobytes() == grads.tobytes()


def test_unscale_and_check_none_leaves_and_empty_trees():
  unscaled, found_inf = jaxamp.ops.unscale_and_check({"a": None, "b": [jnp.ones(2) * 4]}, 2.0)
  assert unscaled["a"] is None and unscaled["b"][0].tolist() == [2.0, 2.0]
  assert not bool(found_inf)
  assert jaxamp.ops.unscale_and_check({}, 2.0)[0] == {}


@pytest.mark.parametrize(
  "leaf,kind",
  [
    (jnp.ones(2, jnp.int32), "dtype int32"),
    (jnp.ones(2, bool), "dtype bool"),
    (jnp.ones(2, jnp.complex64), "dtype complex64"),
    (3.0, "type float"),
  ],
)
def test_unscale_and_check_rejects_non_float_leaves(leaf, kind):
  with pytest.raises(TypeError, match=rf"gradient leaf \['w'\]\[1\] has {kind}"):
    jaxamp.ops.unscale_and_check({"w": [jnp.ones(2), leaf]}, 2.0)


def test_inverse_scale_matches_float64_reciprocal():
  rng = np.random.default_rng(3)
  scales = np.concatenate(
    [
      rng.integers(0x00800000, 0x7E800000, 100_000).astype(np.uint32).view(np.float32),
      np.float32([3.0, 7.0, 0.1, 65536.0, 2.0**-126, 2.0**126]),
    ]
  )
  expected = (1.0 / scales.astype(np.float64)).astype(np.float32)
  actual = np.asarray(jax.jit(jax.vmap(jaxamp.ops.inverse_scale))(scales))
  assert actual.tobytes() == expected.tobytes()


def test_inverse_scale_of_subnormal_scale_matches_torch():
  # docs/torch_semantics.md §3.1: 2^-127 -> 1.7014118346046923e+38 (finite); 1e-39 -> inf.
  scales = np.float32([2.0**-127, 1e-39, 2.0**-149, 4e-39, -(2.0**-127)])
  with np.errstate(all="ignore"):
    expected = (1.0 / scales.astype(np.float64)).astype(np.float32)
  actual = np.asarray(jax.jit(jax.vmap(jaxamp.ops.inverse_scale))(scales))
  assert actual.tobytes() == expected.tobytes()
  assert actual[0] == np.float32(1.7014118346046923e38) and np.isinf(actual[1])


def test_inverse_scale_above_2_126_is_torchs_subnormal_reciprocal():
  # torch's inv_scale is f32(1 / f64(scale)): subnormal above 2**126, which XLA
  # arithmetic would flush to zero; jaxamp builds it from the bits.
  rng = np.random.default_rng(7)
  bits = rng.integers(253 << 23, 255 << 23, size=100_000, dtype=np.int64).astype(np.int32)
  bits[:3] = [np.float32(2.0**126).view(np.int32), np.float32(2.0**127).view(np.int32), 0x7F7FFFFF]
  scales = bits.view(np.float32)
  ours = np.asarray(jax.jit(jax.vmap(jaxamp.ops.inverse_scale))(jnp.asarray(scales)))
  expected = (1.0 / scales.astype(np.float64)).astype(np.float32)
  assert ours.tobytes() == expected.tobytes()
  assert float(jaxamp.ops.inverse_scale(jnp.float32(2.0**127))) == 2.0**-127


@pytest.mark.torch
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # float16 results are all 0 here
@pytest.mark.parametrize("scale", [2.0**126 * 1.5, 1e38, 2.0**127, 3.4e38])
def test_unscale_at_scales_above_2_126_matches_torch(scale, dtype):
  # Every gradient whose unscaled value is a normal float is torch's correctly
  # rounded g * inv_scale, bit for bit; the remaining divergence is that XLA
  # flushes results below 2**-126 to zero, where torch keeps the subnormal.
  import torch

  rng = np.random.default_rng(3)
  grads = (rng.standard_normal(4096) * 10.0 ** rng.uniform(-5, 38, 4096)).astype(np.float32)
  scale32 = np.float32(scale)
  t_grads = torch.tensor(grads).to(getattr(torch, dtype))
  grads = t_grads.float().numpy().copy()  # as the dtype holds them (torch unscales in place)
  found = torch.zeros(1)
  inv = torch.full((1,), 1.0 / float(scale32), dtype=torch.float32)
  torch._amp_foreach_non_finite_check_and_unscale_([t_grads], found, inv)
  expected = t_grads.float().numpy()
  ours = jaxamp.ops.unscale_and_check(
    jnp.asarray(grads, getattr(jnp, dtype)), jnp.float32(scale32)
  )[0]
  ours = np.asarray(ours.astype(jnp.float32))
  # Where torch's float32 product g * inv is subnormal, XLA flushes it to zero:
  # the one remaining divergence. A bfloat16 result of exactly 2**-126 may be
  # such a product rounded up, so it is left out of the exact comparison.
  tiny = np.finfo(np.float32).tiny
  normal = np.abs(expected) > tiny if dtype == "bfloat16" else np.abs(expected) >= tiny
  assert normal.sum() > 1000
  assert ours[normal].tobytes() == expected[normal].tobytes()
  assert np.all((ours[~normal] == 0.0) | (ours[~normal] == expected[~normal]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("jit", [False, True])
def test_leaf_finite_flags_of_many_same_shape_leaves(dtype, jit):
  # Same-size leaves are checked together (one variadic reduction per 8):
  # every leaf's flag must still be its own, wherever the inf/NaN sits.
  from jaxamp._torch.unscale import leaf_finite_flags

  rng = np.random.default_rng(0)
  shapes = [(3, 5)] * 12 + [(5, 3), (15,)] * 3 + [(1, 15)] + [(7,)] * 3 + [()] * 9
  shapes += [(2, 0)] * 2 + [(4, 4)]
  leaves = [np.array(rng.normal(size=s) * 1e3, np.float32) for s in shapes]
  bad = {1: np.inf, 8: np.nan, 9: -np.inf, 17: np.nan, 20: np.inf, 25: np.nan, 33: -np.inf}
  for i, value in bad.items():
    leaves[i].reshape(-1)[-1] = value
  tree = [jnp.asarray(x, dtype) for x in leaves]
  flags = (jax.jit(leaf_finite_flags) if jit else leaf_finite_flags)(tree)
  expected = [bool(np.all(np.isfinite(np.asarray(x, np.float32)))) for x in tree]
  assert np.asarray(flags).tolist() == expected
  assert expected.count(False) == len(bad)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("jit", [False, True])
def test_leaf_finite_flags_of_leaves_alone_wherever_the_inf_sits(dtype, jit):
  # A leaf whose size no other leaf has is checked as two halves (plus the
  # last element of an odd size): an inf/NaN in either half or at the odd end
  # must clear its flag, and only its own.
  from jaxamp._torch.unscale import leaf_finite_flags

  check = jax.jit(leaf_finite_flags) if jit else leaf_finite_flags
  sizes = [1, 2, 3, 8, 9, 1001, 4096]
  rng = np.random.default_rng(1)
  clean = [np.array(rng.normal(size=n) * 1e3, np.float32) for n in sizes]
  assert np.asarray(check([jnp.asarray(x, dtype) for x in clean])).all()
  for k, n in enumerate(sizes):
    for position in sorted({0, n // 2 - 1, n // 2, n - 1} - {-1}):
      for value in (np.inf, -np.inf, np.nan):
        leaves = [x.copy() for x in clean]
        leaves[k][position] = value
        flags = np.asarray(check([jnp.asarray(x, dtype) for x in leaves]))
        assert flags.tolist() == [i != k for i in range(len(sizes))], (n, position, value)


def test_leaf_finite_flags_outside_jit_compiles_once(backend_compiles):
  # The variadic reductions are built from one cached function per arity, so
  # a second eager call with the same shapes compiles nothing (a new lambda
  # per call made every GradScaler.unscale_ recompile them).
  from jaxamp._torch.unscale import leaf_finite_flags

  tree = [
    jnp.ones((33, 5)),
    jnp.ones(7),
    jnp.ones((4, 4)),
    jnp.ones((4, 4)),
    jnp.ones((), jnp.float16),
  ]
  assert np.asarray(leaf_finite_flags(tree)).all()
  poisoned = [x.at[0].set(jnp.inf) if x.ndim == 1 else x for x in tree]
  backend_compiles.clear()
  flags = leaf_finite_flags(poisoned)
  assert np.asarray(flags).tolist() == [True, False, True, True, True]
  assert backend_compiles == []


def _every_finite(dtype):
  """Every finite value of a 16-bit float dtype, once (as a 1-D array)."""
  values = np.arange(2**16, dtype=np.uint16).view(jnp.dtype(dtype))
  return values[np.isfinite(values.astype(np.float32))]


def _recorder():
  """An inner optimizer whose state is the unscaled gradients it last received."""
  return optax.GradientTransformation(
    lambda params: jax.tree.map(jnp.zeros_like, params),
    lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads),
  )


def _jitted_state_step(tx, front_end):
  """``(grads, state, params) -> state`` of one jitted step through ``front_end``."""
  if front_end == "apply_scaled_updates":
    return jax.jit(lambda g, s, p: jaxamp.apply_scaled_updates(tx, g, s, p)[1])
  return jax.jit(lambda g, s, p: tx.update(g, s, p)[1])


@pytest.mark.torch
@pytest.mark.parametrize("front_end", ["apply_scaled_updates", "tx.update"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("scale", [1.0, 3.0, 2.0**16, 1e-3, 2.0**127, 3.4e38])
def test_applied_step_unscales_every_finite_half_value_as_torch(scale, dtype, front_end):
  # What the inner optimizer of an applied step receives, for every finite
  # float16/bfloat16 gradient, against torch's kernel on the same values.
  import torch

  grads = _every_finite(dtype)
  t_grads = torch.from_numpy(grads.view(np.uint16).astype(np.int16)).view(getattr(torch, dtype))
  inv = torch.full((1,), 1.0 / float(np.float32(scale)), dtype=torch.float32)
  torch._amp_foreach_non_finite_check_and_unscale_([t_grads], torch.zeros(1), inv)
  expected = t_grads.view(torch.int16).numpy().view(np.uint16)

  tx = jaxamp.dynamic_loss_scale(_recorder(), init_scale=scale)
  params = {"g": jnp.zeros(grads.shape, dtype)}
  state = tx.init(params)
  g = {"g": jnp.asarray(grads)}
  step = _jitted_state_step(tx, front_end)
  state = step(g, state, params)
  assert not bool(state.found_inf)
  ours = np.asarray(state.inner_state["g"]).view(np.uint16)
  if dtype == "float16":  # every product XLA flushes is below float16's smallest subnormal
    assert ours.tobytes() == expected.tobytes()
  else:  # XLA reads subnormal gradients as zero and flushes float32 products
    # below 2**-126, both of which bfloat16 holds (docs/torch_semantics.md)
    tiny = np.finfo(np.float32).tiny
    values = expected.view(jnp.bfloat16).astype(np.float32)
    normal = (np.abs(values) > tiny) & (np.abs(grads.astype(np.float32)) >= tiny)
    assert normal.sum() > 10000
    assert ours[normal].tobytes() == expected[normal].tobytes()
    rest = ours[~normal].view(jnp.bfloat16).astype(np.float32)
    assert np.all((rest == 0) | (ours[~normal] == expected[~normal]))


@pytest.mark.slow
@pytest.mark.parametrize("front_end", ["apply_scaled_updates", "tx.update"])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize(
  "inner",
  [optax.adam(1e-3), optax.sgd(0.1, momentum=0.9), optax.adamw(1e-3, weight_decay=0.1)],
  ids=["adam", "sgd_momentum", "adamw"],
)
def test_applied_step_optimizes_the_half_grads_as_rounded(inner, dtype, front_end):
  # The inner optimizer's arithmetic starts from the unscaled gradients
  # rounded to their dtype, as torch materialises them: its state equals the
  # state it reaches from those gradients materialised, bit for bit (the
  # unrounded float32 product never reaches it, guard or not).
  rng = np.random.default_rng(0)
  shapes = {"a": (256, 130), "b": (1001,)}
  grads = {k: jnp.asarray(rng.standard_normal(s) * 300, dtype) for k, s in shapes.items()}
  params = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()}
  tx = jaxamp.dynamic_loss_scale(inner, init_scale=3.0)
  step = _jitted_state_step(tx, front_end)
  ours = step(grads, tx.init(params), params).inner_state
  unscaled, _ = jaxamp.ops.unscale_and_check(grads, jnp.float32(3.0))
  unscaled = jax.tree.map(np.asarray, unscaled)  # materialised
  expected = jax.jit(inner.update)(unscaled, inner.init(params), params)[1]
  assert bits(ours) == bits(expected)
