"""The float64-then-round product, emulated in float32, against numpy float64."""

from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxamp._torch.exact import multiply_by_f64_words, multiply_exact


def _f64_words(factors):
  words = np.asarray(factors, np.float64).view(np.uint64)
  hi = (words >> np.uint64(32)).astype(np.uint32).view(np.int32)
  lo = (words & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.int32)
  return hi, lo


def _reference(scales, factors):
  with np.errstate(all="ignore"):
    return (np.asarray(scales, np.float32).astype(np.float64) * factors).astype(np.float32)


def _assert_bit_equal(actual, expected):
  actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
  same = (actual.view(np.uint32) == expected.view(np.uint32)) | (
    np.isnan(actual) & np.isnan(expected)
  )
  bad = np.flatnonzero(~same)
  assert bad.size == 0, f"{bad.size} mismatches, e.g. {actual[bad[:5]]} vs {expected[bad[:5]]}"


@pytest.mark.slow
def test_multiply_exact_matches_float64_reference_on_random_pairs():
  rng = np.random.default_rng(20261130)
  n = 50_000
  # Scales: uniform over all float32 bit patterns (subnormals, both signs, up to
  # FLT_MAX), plus scales near the float32 limits and typical loss scales.
  all_bits = rng.integers(0, 0x7F800000, n, dtype=np.int64).astype(np.uint32).view(np.float32)
  near_max = np.float32(np.finfo(np.float32).max) / rng.uniform(1, 8, n).astype(np.float32)
  near_min = (rng.integers(1, 1 << 25, n) * np.float64(2.0**-149)).astype(np.float32)
  typical = np.float32(2.0) ** rng.integers(-30, 40, n).astype(np.float32) * rng.choice(
    np.array([1, 3, 1.5, 0.3, 7], np.float32), n
  )
  scales = np.concatenate([all_bits, near_max, near_min, typical])
  scales = np.where(rng.random(scales.size) < 0.1, -scales, scales).astype(np.float32)
  m = scales.size
  factors = np.concatenate(
    [
      rng.uniform(0.0, 1.0, m // 4),  # non-dyadic backoffs
      rng.uniform(1.0, 3.0, m // 4),  # non-dyadic growths
      np.exp(rng.uniform(-120, 120, m // 4)),  # far from 1: overflow/underflow
      rng.integers(0, 2**63, m - 3 * (m // 4), dtype=np.uint64).view(np.float64),
    ]
  )
  factors = np.where(np.isfinite(factors), factors, 0.3)[rng.permutation(m)]
  assert m >= 100_000

  hi, lo = _f64_words(factors)
  actual = jax.jit(jax.vmap(multiply_by_f64_words))(scales, hi, lo)
  expected = _reference(scales, factors)
  _assert_bit_equal(actual, expected)
  # The test must exercise the hard cases, not only the easy ones.
  with np.errstate(all="ignore"):
    pure_f32 = (scales * factors.astype(np.float32)).astype(np.float32)
  assert np.sum(pure_f32.view(np.uint32) != expected.view(np.uint32)) > 10_000
  assert np.sum((expected != 0) & (np.abs(expected) < 2.0**-126)) > 1_000  # subnormal
  assert np.sum(np.isinf(expected)) > 1_000


@pytest.mark.parametrize(
  "scale,factor",
  [
    (3.0, 0.3),
    (2.0**127, 2.0),
    (1.7e38, 2),
    (3e38, 2.0),
    (2.0**-149, 0.5),  # a tie, rounds to even: 0
    (2.0**-149, 0.75),
    (3 * 2.0**-149, 0.5),
    (8.0, 1e39),  # a factor beyond float32 range
    (1.0, 1.00000001),  # a growth too close to 1 is a no-op
    (-4.0, 2.0),
    (0.0, 2.0),
    (-0.0, 0.5),
    (np.inf, 0.5),
    (-np.inf, 2.0),
    (np.nan, 2.0),
    (np.inf, 0.0),
    (5e-324 * 0 + 1.5, 5e-324),  # a subnormal float64 factor
  ],
)
def test_multiply_exact_special_values(scale, factor):
  actual = jax.jit(lambda s: multiply_exact(s, factor))(jnp.float32(scale))
  _assert_bit_equal(actual, _reference(np.float32(scale), factor))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16, jnp.int32])
def test_multiply_exact_traced_factor_uses_its_own_value(dtype):
  rng = np.random.default_rng(1)
  scales = rng.uniform(0.001, 1e6, 2000).astype(np.float32)
  if dtype == jnp.int32:
    factors = rng.integers(1, 100, 2000)
  else:
    factors = rng.uniform(0.01, 4.0, 2000)
  factors = np.asarray(jnp.asarray(factors, dtype).astype(jnp.float32)).astype(np.float64)
  actual = jax.jit(jax.vmap(multiply_exact))(scales, jnp.asarray(factors, dtype))
  _assert_bit_equal(actual, _reference(scales, factors))


@pytest.mark.slow
def test_multiply_exact_python_float_equals_word_path():
  # A Python float factor goes through the same unpacking as the word path.
  for factor in (0.3, 1.5, 1.1, 0.9, 1e-30, 7.0):
    hi, lo = _f64_words([factor])
    a = multiply_exact(jnp.float32(3.0), factor)
    b = multiply_by_f64_words(jnp.float32(3.0), hi[0], lo[0])
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.slow
def test_multiply_exact_rounds_twice_like_torch_near_float32_ties():
  # torch rounds the float64 product, then casts to float32. Where the float64
  # product lands on a float32 tie this differs from rounding once (docs/torch_semantics.md §5.4:
  # 2.593742609024048 * 0.9 -> 2.3343682289123535, rounding once gives ...84673).
  rng = np.random.default_rng(7)
  n = 50_000
  scales = rng.uniform(1.0, 2.0, n).astype(np.float32) * np.float32(2.0) ** rng.integers(
    -100, 100, n
  ).astype(np.float32)
  targets = (rng.uniform(0.5, 4.0, n).astype(np.float32)).astype(np.float64)
  ties = targets + np.spacing(targets.astype(np.float32)).astype(np.float64) / 2
  factors = ties * (1 + rng.integers(-4, 5, n) * 2.0**-53) / scales.astype(np.float64)
  hi, lo = _f64_words(factors)
  actual = jax.jit(jax.vmap(multiply_by_f64_words))(scales, hi, lo)
  expected = _reference(scales, factors)
  _assert_bit_equal(actual, expected)
  # Rounding the exact product once would differ in some of these cases.
  once = [_round_once_to_f32(s, f) for s, f in zip(scales[:3000], factors[:3000])]
  assert sum(o != e for o, e in zip(once, expected[:3000])) > 10


def _round_once_to_f32(scale, factor):
  """The exact product rounded once to float32 (nearest, ties to even)."""
  exact = Fraction(float(scale)) * Fraction(float(factor))
  guess = np.float32(float(exact))
  candidates = [
    np.nextafter(guess, np.float32(-np.inf)),
    guess,
    np.nextafter(guess, np.float32(np.inf)),
  ]
  return min(
    candidates,
    key=lambda c: (abs(Fraction(float(c)) - exact), int(np.asarray(c).view(np.uint32)) & 1),
  )


@pytest.mark.slow
def test_multiply_exact_in_x64_mode_with_float64_factor():
  # With jax_enable_x64, int sums would default to int64; the emulation must
  # stay int32, and a float64 factor array is used with its full value.
  with jax.enable_x64(True):
    scale = jnp.float32(2.593742609024048)
    for factor in (0.9, jnp.float64(0.9)):
      result = jax.jit(multiply_exact)(scale, factor)
      assert result.dtype == jnp.float32 and result.shape == ()
      assert float(result) == 2.3343682289123535  # torch (docs/torch_semantics.md §5.4)


@pytest.mark.slow
def test_multiply_exact_either_selects_the_factor_before_multiplying():
  from jaxamp._torch.exact import multiply_exact_either

  rng = np.random.default_rng(11)
  scales = rng.uniform(1e-30, 1e30, 500).astype(np.float32)
  for first, second in ((0.3, 1.5), (0.5, 2.0), (1e39, 1.1), (jnp.float32(0.3), 1.5)):
    # use_first traced, as the scale update's found_inf is: one program selects
    # at run time, for both values.
    either = jax.jit(
      jax.vmap(lambda s, u, a=first, b=second: multiply_exact_either(s, u, a, b), (0, None))
    )
    for use_first in (True, False):
      factor = first if use_first else second
      # The product with the chosen factor, multiply_exact's result (its own tests
      # check it against this float64 reference on every kind of scale).
      direct = _reference(scales, np.float64(factor))
      assert np.asarray(either(scales, jnp.bool_(use_first))).tobytes() == direct.tobytes()


@pytest.mark.slow
def test_power_of_two_factors_match_float64_reference_on_every_kind_of_scale():
  # torch's default factors, 2.0 and 0.5, take the short path: every float32
  # class (subnormal, normal, near overflow, zero, inf, NaN, both signs) and
  # exponents that overflow, underflow and round to a subnormal.
  from jaxamp._torch.exact import _power_of_two_exponent, multiply_exact_either

  rng = np.random.default_rng(20261201)
  edges = np.array(
    [0, 1, 2, 3, 0x3FFFFF, 0x400000, 0x400001, 0x7FFFFF, 0x800000, 0x800001, 0xC00000,
     0x3F800000, 0x7F7FFFFF, 0x7F800000, 0x7FC00000],
    np.uint32,
  )  # fmt: skip
  bits = np.concatenate([rng.integers(0, 1 << 32, 20_000, dtype=np.uint64), edges, edges | 1 << 31])
  scales = bits.astype(np.uint32).view(np.float32)
  for factor in (2.0, 0.5, 4, 2.0**-20, 2.0**100, 2.0**-149, 2.0**-1074, np.float32(0.25)):
    assert _power_of_two_exponent(factor) is not None
    actual = jax.jit(jax.vmap(lambda s, f=factor: multiply_exact(s, f)))(scales)
    _assert_bit_equal(actual, _reference(scales, np.float64(factor)))
    either = jax.jit(jax.vmap(lambda s, f=factor: multiply_exact_either(s, True, f, 2.0)))(scales)
    _assert_bit_equal(either, _reference(scales, np.float64(factor)))
  for factor in (0.3, 3.0, -2.0, 0.0, np.inf, True, jnp.float32(2.0)):
    assert _power_of_two_exponent(factor) is None


@pytest.mark.slow
def test_bit_tests_of_a_subnormal_hold_in_a_fused_kernel():
  # XLA CPU runs with denormals-are-zero, and LLVM rewrites the integer test
  # `bits & 0x7FFFFFFF != 0` of a bitcast float as `x != 0.0` where the select
  # that consumes it also returns x: then a subnormal x reads as zero.
  from jaxamp._torch.exact import float_bits
  from jaxamp._torch.unscale import inverse_scale

  subnormal = jnp.float32(2.0**-149)
  nonzero = jax.jit(lambda x, y: jnp.where((float_bits(x) & 0x7FFFFFFF) != 0, y, x))
  assert float(nonzero(subnormal, jnp.float32(3.0))) == 3.0
  # update_loss_scale's found_inf test, in the shape that read a subnormal as zero before
  from jaxamp._torch.scale_rule import _is_nonzero

  found = jax.jit(lambda f: jnp.where(_is_nonzero(f), jnp.float32(5.0), f))(subnormal)
  assert float(found) == 5.0
  for kernel, expected in (
    (lambda s, u: jnp.where(u, multiply_exact(s, 0.5), s), _reference(subnormal, 0.5)),
    (lambda s, u: jnp.where(u, multiply_exact(s, 0.3), s), _reference(subnormal, 0.3)),
    (lambda s, u: jnp.where(u, inverse_scale(s), s), np.float32(np.inf)),
  ):
    _assert_bit_equal(jax.jit(kernel)(subnormal, jnp.bool_(True)), expected)


@pytest.mark.slow
@pytest.mark.parametrize("factor", [0.3, 2.0, 0.5, 1e-30])
def test_every_nan_scale_stays_nan(factor):
  # Signalling NaNs included: 0x7F800001 differs from inf's bits in the lowest bit only.
  patterns = np.array([0x7F800001, 0xFF800001, 0x7FC00000, 0x7FFFFFFF, 0x7FA00000], np.uint32)
  actual = jax.jit(jax.vmap(lambda s: multiply_exact(s, factor)))(patterns.view(np.float32))
  assert np.isnan(np.asarray(actual)).all()
