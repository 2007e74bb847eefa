"""jaxamp._autocast.cpu_math: an exact FMA, SLEEF's expf and logf, torch's lane
order, each against a reference computed here in float64 (no torch)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxamp._autocast import cpu_math

F32 = np.float32


def _fma64(a, b, c):
  """``a * b + c`` rounded once to float32: the float32 product is exact in
  float64, and the float64 sum is off a float32 midpoint but in a case in 2**29."""
  return (np.asarray(a, np.float64) * np.asarray(b, np.float64) + c).astype(F32)


def _triples(n=200_000):
  rng = np.random.default_rng(0)
  a, b = (rng.standard_normal(n).astype(F32) for _ in range(2))
  near = (-(a.astype(np.float64) * b) * (1 + 1e-6 * rng.standard_normal(n))).astype(F32)
  return a, b, np.where(np.arange(n) % 2 == 0, near, rng.standard_normal(n).astype(F32))


def test_fma_rounds_once_under_jit_and_eagerly():
  a, b, c = _triples()
  want = _fma64(a, b, c)
  assert np.mean(want != (a * b + c)) > 0.1  # half the cases cancel: rounding twice differs
  np.testing.assert_array_equal(np.asarray(jax.jit(cpu_math.fma)(a, b, c)), want)
  np.testing.assert_array_equal(np.asarray(cpu_math.fma(a[:1000], b[:1000], c[:1000])), want[:1000])


@pytest.mark.parametrize("constant", ["a", "b", "c"])
def test_fma_with_a_constant_operand_rounds_once_under_jit(constant):
  # XLA's simplifier rewrites (x + C) - C with a constant C: the FMA hides its constants
  a, b, c = _triples()
  k = F32(0.00833336077630519866943359)
  args = {"a": (k, b, c), "b": (a, k, c), "c": (a, b, k)}[constant]
  f = {
    "a": lambda b, c: cpu_math.fma(k, b, c),
    "b": lambda a, c: cpu_math.fma(a, k, c),
    "c": lambda a, b: cpu_math.fma(a, b, k),
  }[constant]
  ours = jax.jit(f)(*(v for v in args if np.ndim(v)))
  np.testing.assert_array_equal(np.asarray(ours), _fma64(*args))


def _expf64(d):
  """SLEEF's xexpf step by step, each FMA rounded once (``_fma64``)."""
  q = np.rint(d * F32(1.442695040888963407359924681001892137426645954152985934135449406931))
  s = _fma64(q, F32(-0.693145751953125), d)
  s = _fma64(q, F32(-1.428606765330187045e-06), s)
  u = F32(0.000198527617612853646278381)
  for c in cpu_math._EXP_POLY[1:]:
    u = _fma64(u, s, c)
  u = F32(1.0) + _fma64(s * s, u, s)
  return np.ldexp(u.astype(np.float64), q.astype(np.int32)).astype(F32)


def test_exp_is_sleef_expf_where_the_result_is_normal():
  rng = np.random.default_rng(1)
  d = np.concatenate([rng.uniform(-87, 0, 400_000), rng.uniform(0, 88, 100_000)]).astype(F32)
  ours = np.asarray(jax.jit(cpu_math.exp)(d))
  want = _expf64(d)
  np.testing.assert_array_equal(ours, want)
  assert np.mean(np.asarray(jax.jit(jnp.exp)(d)) == want) < 1.0  # XLA's exp rounds otherwise


def test_log_is_within_an_ulp_and_correctly_rounded_nearly_always():
  # SLEEF's logf_u1 is itself within 1 ulp; torch's outputs pin its bits
  # (tests/test_autocast_fused.py); here: no gross error, and its special values
  rng = np.random.default_rng(2)
  x = np.exp(rng.uniform(-80, 80, 200_000)).astype(F32)
  ours = np.asarray(jax.jit(cpu_math.log)(x))
  exact = np.log(x.astype(np.float64)).astype(F32)
  ulps = np.abs(ours.view(np.int32).astype(np.int64) - exact.view(np.int32))
  assert ulps.max() <= 1 and np.mean(ulps == 0) > 0.99
  special = np.array([0.0, np.inf, -1.0, np.nan], F32)
  np.testing.assert_array_equal(
    np.asarray(cpu_math.log(special)), [-np.inf, np.inf, np.nan, np.nan]
  )


def _lane_sum64(row, lanes):
  """torch's vec::map_reduce_all order, written out per element."""
  if len(row) < lanes:
    total = row[0]
    for v in row[1:]:
      total = F32(total + v)
    return total
  acc = list(row[:lanes])
  for k in range(lanes, len(row)):
    acc[k % lanes] = F32(acc[k % lanes] + row[k])
  while len(acc) > 1:
    half = len(acc) // 2
    acc = [F32(acc[i] + acc[i + half]) for i in range(half)]
  return acc[0]


@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("n", [3, 8, 13, 64, 100])
def test_row_sum_adds_in_the_vector_lanes_order(lanes, n):
  e = np.random.default_rng(n).uniform(0, 1, (64, n)).astype(F32)
  ours = np.asarray(jax.jit(lambda e: cpu_math.row_sum(e, lanes))(e))
  np.testing.assert_array_equal(ours, [_lane_sum64(row, lanes) for row in e])


def test_torch_cpu_lanes_follows_aten_cpu_capability(monkeypatch):
  for value, lanes in (("avx512", 16), ("avx2", 8), ("default", None)):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", value)
    cpu_math.torch_cpu_lanes.cache_clear()
    assert cpu_math.torch_cpu_lanes() == lanes
  cpu_math.torch_cpu_lanes.cache_clear()
