"""torch's x86 CPU float32 arithmetic in jnp: SLEEF's ``expf`` and ``logf``, the
vector lanes' summation order, and an exact FMA to build them with.

torch's vectorised CPU kernels compute ``Vectorized<float>::exp`` and ``log``
with SLEEF (``Sleef_expf8_u10``, ``Sleef_logf8_u10`` under AVX2, the ``16``
forms under AVX512), whose polynomials are evaluated with fused multiply-adds,
and reduce a row with ``vec::map_reduce_all``: one accumulator vector of
``lanes`` floats, the vectors added in sequence, then the lanes folded in
halves. XLA's ``exp``, ``log`` and ``reduce_sum`` round otherwise, and XLA's CPU
backend contracts ``a * b + c`` into an FMA where the CPU has one, so the FMA
here is exact by construction (error-free transforms, whose products are exact
and so the same contracted or not). docs/autocast.md, "Cross-entropy at
float32 bits", has the measurements.
"""

from __future__ import annotations

import functools
import os
import platform
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# torch's DispatchStub picks AVX512 on these CPU features, else AVX2 on the second set
_AVX512 = frozenset({"avx512vl", "avx512bw", "avx512dq", "fma"})
_AVX2 = frozenset({"avx2", "fma"})


@functools.cache
def cpu_flags() -> frozenset[str]:
  """The feature flags of this machine's x86 CPU (``/proc/cpuinfo``); empty on
  another CPU or without ``/proc/cpuinfo``."""
  if platform.machine().lower() not in ("x86_64", "amd64"):
    return frozenset()
  try:
    with open("/proc/cpuinfo") as f:
      return frozenset(
        next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
      )
  except OSError:
    return frozenset()


@functools.cache
def torch_cpu_lanes() -> int | None:
  """The float32 vector width of torch's CPU kernels on this machine: 16 where
  torch dispatches to AVX512, 8 for AVX2, None where it runs other code (no
  FMA, not x86, ``ATEN_CPU_CAPABILITY=default``, no ``/proc/cpuinfo``).
  ``ATEN_CPU_CAPABILITY`` chooses as it does for torch."""
  chosen = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
  if chosen in ("avx512", "avx2", "default"):
    return {"avx512": 16, "avx2": 8}.get(chosen)
  if _AVX512 <= cpu_flags():
    return 16
  return 8 if _AVX2 <= cpu_flags() else None


def bits(x: Any) -> Any:
  """The bits of float32 ``x`` as int32."""
  return lax.bitcast_convert_type(x, jnp.int32)


def _from_bits(i: Any) -> Any:
  return lax.bitcast_convert_type(i, jnp.float32)


def _two_sum(a: Any, b: Any) -> tuple[Any, Any]:
  """``(s, e)``: ``s = a + b`` rounded, ``s + e == a + b`` exactly (Knuth)."""
  s = a + b
  bb = s - a
  return s, (a - (s - bb)) + (b - bb)


def _two_prod(a: Any, b: Any) -> tuple[Any, Any]:
  """``(p, e)``: ``p = a * b`` rounded, ``p + e == a * b`` exactly (Dekker). The
  halves are cut from the bits (12 significant bits each), so every partial
  product is exact and an FMA contraction of any of them changes nothing."""
  p = a * b
  ah = _from_bits(bits(a) & np.int32(-4096))
  bh = _from_bits(bits(b) & np.int32(-4096))
  al, bl = a - ah, b - bh
  return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl


def _opaque(x: Any) -> Any:
  """``x`` as a float32 XLA cannot see the value of: its algebraic simplifier
  rewrites ``(a + C) - C`` and the like with a constant ``C``, which the
  error-free transforms must not have."""
  return lax.optimization_barrier(jnp.asarray(x, jnp.float32))


def fma(a: Any, b: Any, c: Any) -> Any:
  """``a * b + c`` rounded once, in float32 (Boldo and Melquiond's emulation:
  the product split exactly, its high part added to ``c`` exactly, the two low
  parts added rounding to odd, then one rounding to nearest); where ``a * b +
  c`` is not finite, that (an infinite input's result)."""
  a, b, c = (_opaque(x) if np.ndim(x) == 0 else x for x in (a, b, c))
  uh, ul = _two_prod(a, b)
  th, tl = _two_sum(c, uh)
  vh, vl = _two_sum(tl, ul)
  vh_bits = bits(vh)
  away = jnp.where((vh < 0) == (vl < 0), np.int32(1), np.int32(-1))
  v = jnp.where((vl != 0) & ((vh_bits & 1) == 0), _from_bits(vh_bits + away), vh)
  plain = a * b + c
  return jnp.where(jnp.isfinite(plain), th + v, plain)


def _pow2(q: Any) -> Any:
  return _from_bits((q + 127) << 23)


_EXP_POLY = tuple(
  np.float32(c)
  for c in (
    0.000198527617612853646278381,
    0.00139304355252534151077271,
    0.00833336077630519866943359,
    0.0416664853692054748535156,
    0.166666671633720397949219,
    0.5,
  )
)


def _expf(d: Any) -> Any:
  """SLEEF's ``xexpf`` (1.0 ulp): ``2**q * p(s)``, ``s = d - q * log(2)`` in two
  FMAs, ``p`` a degree-7 polynomial by FMAs."""
  q = jnp.round(
    d * np.float32(1.442695040888963407359924681001892137426645954152985934135449406931)
  )
  qi = q.astype(jnp.int32)
  # q * 0.693145751953125 is exact (at most 8 and 12 significant bits): one rounding, as the FMA
  s = d - q * _opaque(0.693145751953125)
  s = fma(q, np.float32(-1.428606765330187045e-06), s)
  u: Any = _EXP_POLY[0]
  for c in _EXP_POLY[1:]:
    u = fma(u, s, c)
  u = np.float32(1.0) + fma(s * s, u, s)
  u = u * _pow2(qi >> 1) * _pow2(qi - (qi >> 1))
  u = jnp.where(d < -104, np.float32(0.0), u)
  return jnp.where(d > 100, np.float32(np.inf), u)


def _logf(d: Any) -> Any:
  """SLEEF's ``xlogf_u1`` (1.0 ulp) for positive normal ``d``: ``e * log(2) +
  2 atanh(x)``, ``x = (m - 1) / (m + 1)`` in double-float arithmetic with FMAs."""
  e = ((bits(d * np.float32(1.0 / 0.75)) >> 23) & 0xFF) - 0x7F
  m = _from_bits(bits(d) - (e << 23))
  ef = e.astype(jnp.float32)
  hi, lo = np.float32(0.69314718246459960938), np.float32(-1.904654323148236017e-09)
  sx = hi * ef
  sy = fma(lo, ef, fma(hi, ef, -sx))
  nx, ny = _two_sum(_opaque(-1.0), m)
  dx, dy = _two_sum(_opaque(1.0), m)
  t = np.float32(1.0) / dx
  qx = nx * t
  qy = fma(-dy, t, fma(-dx, t, np.float32(1.0)))
  qy = fma(qx, qy, fma(ny, t, fma(t, nx, -qx)))
  x2 = qx * qx
  p = fma(fma(np.float32(0.3027294874), x2, np.float32(0.3996108174)), x2, np.float32(0.6666694880))
  yx, yy = qx * np.float32(2.0), qy * np.float32(2.0)
  rx = sx + yx
  ry = (((sx - rx) + yx) + sy) + yy
  w = (x2 * qx) * p
  r2x = rx + w
  r = r2x + (((rx - r2x) + w) + ry)
  r = jnp.where(d == np.float32(np.inf), np.float32(np.inf), r)
  r = jnp.where((d < 0) | jnp.isnan(d), np.float32(np.nan), r)
  return jnp.where(d == 0, np.float32(-np.inf), r)


@jax.custom_jvp
def exp(x: Any) -> Any:
  """``exp`` as torch's vectorised CPU kernels round it (float32)."""
  return _expf(x)


@exp.defjvp
def _exp_jvp(primals: Any, tangents: Any) -> Any:
  y = exp(primals[0])
  return y, y * tangents[0]


@jax.custom_jvp
def log(x: Any) -> Any:
  """``log`` as torch's vectorised CPU kernels round it (float32, positive
  normal inputs, zero, infinity and NaN; subnormals are not modelled)."""
  return _logf(x)


@log.defjvp
def _log_jvp(primals: Any, tangents: Any) -> Any:
  return log(primals[0]), tangents[0] / primals[0]


def row_sum(x: Any, lanes: int) -> Any:
  """The sum over the last axis in ``vec::map_reduce_all``'s order: a row of at
  least ``lanes`` elements accumulates its vectors of ``lanes`` in sequence
  (the tail's ``r`` elements into lanes ``0:r``), then folds the lanes in halves
  (lane ``i`` plus lane ``i + lanes/2``, ...); a shorter row adds its elements
  in sequence."""
  n = x.shape[-1]
  if n < lanes:
    total = x[..., 0]
    for i in range(1, n):
      total = total + x[..., i]
    return total
  full = n - n % lanes
  blocks = jnp.moveaxis(x[..., :full].reshape(*x.shape[:-1], full // lanes, lanes), -2, 0)
  acc, _ = lax.scan(lambda acc, v: (acc + v, None), blocks[0], blocks[1:])
  if n > full:
    r = n - full
    acc = jnp.concatenate([acc[..., :r] + x[..., full:], acc[..., r:]], axis=-1)
  while acc.shape[-1] > 1:
    half = acc.shape[-1] // 2
    acc = acc[..., :half] + acc[..., half:]
  return acc[..., 0]
