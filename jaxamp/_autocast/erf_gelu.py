"""torch's CPU erf GELU: its vectorised kernel's, and oneDNN's on AVX-512 CPUs.

torch's ``gelu`` (``approximate="none"``) computes with its own vectorised
kernel (:func:`vectorised`: Abramowitz and Stegun's ``erf``), except that it
hands a contiguous bfloat16 tensor of more than one element to oneDNN's
``eltwise_gelu_erf`` where oneDNN finds AVX-512 (``avx512_core``: the F, BW, VL
and DQ extensions). oneDNN 3.12, the version torch 2.13 ships, evaluates a
piecewise minimax polynomial of ``erf(x / sqrt(2))`` there
(``gelu_erf_minimax_approx_compute_vector_fwd`` in
``src/cpu/x64/injectors/jit_uni_eltwise_injector.cpp``): 24 pieces indexed by
the bits of ``|x|``, degree 5, by fused multiply-adds, then ``(x * (1 + p)) *
0.5`` (:func:`onednn`). The two differ below about -3.5, on subnormal inputs
and from ``2**127`` (docs/autocast.md, "GELU on AVX-512 CPUs").
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._autocast import cpu_math

# oneDNN's ``gelu_erf_minimax_polynomial`` table (Apache License 2.0, Copyright
# Intel Corporation), coefficient of |x|**degree by piece, as float32 bits;
# piece 23 (|x| above 5.5425) is 1, piece 24 only NaN reaches.
# fmt: off
_POLYNOMIAL = np.array([
  # degree 0
  0xA6F2CB94, 0x32827792, 0x3381CC0C, 0x34523D4A, 0x351AC44D,
  0x35F36D88, 0x36EE8229, 0x37B8A3BB, 0x3867A213, 0x3940033B,
  0x3A2A5A1D, 0x3AE35863, 0x3B7828F2, 0x3C08B14B, 0x3C515ED3,
  0xBB503236, 0xBD8D8E5E, 0xBE8ABCD9, 0xBF0C19A2, 0xBECCB328,
  0x3E176CED, 0x3F470D99, 0x3F7ABB28, 0x3F800000, 0x00000000,
  # degree 1
  0x3F4C422A, 0x3F4C421F, 0x3F4C4207, 0x3F4C41CB, 0x3F4C413B,
  0x3F4C3FAD, 0x3F4C3A2F, 0x3F4C2D40, 0x3F4C146A, 0x3F4BC341,
  0x3F4AD08C, 0x3F48F8CF, 0x3F45FAC7, 0x3F404E07, 0x3F3B980F,
  0x3F48DFF3, 0x3F78B21B, 0x3FBB0704, 0x40019C32, 0x3FE536D6,
  0x3F81331E, 0x3E6C8684, 0x3C98F936, 0x00000000, 0x3F800000,
  # degree 2
  0xB62173F4, 0x3735E4CF, 0x37F2FF89, 0x388C23BE, 0x3917535C,
  0x39AB2AB0, 0x3A60FADB, 0x3AF9B960, 0x3B6E5491, 0x3C0A4EC5,
  0x3CA5AA8C, 0x3D2138D9, 0x3D8737D4, 0x3DDFB660, 0x3E0F27AB,
  0x3D94004B, 0xBE0EFDEB, 0xBF1D96C3, 0xBF89DB58, 0xBF6D9897,
  0xBEF69FB8, 0xBDC4F8A8, 0xBBDE6422, 0x00000000, 0x00000000,
  # degree 3
  0xBE081A19, 0xBE084570, 0xBE08639B, 0xBE089837, 0xBE08F409,
  0xBE09AB95, 0xBE0B66D0, 0xBE0E400A, 0xBE124DF8, 0xBE1BDE02,
  0xBE2F19C9, 0xBE4931BF, 0xBE685FBC, 0xBE89C95F, 0xBE96CBCA,
  0xBE8044AA, 0xBE0550F2, 0x3DCFD6A1, 0x3E94C826, 0x3E79345F,
  0x3DECEC91, 0x3CA46568, 0x3AA1E00A, 0x00000000, 0x00000000,
  # degree 4
  0xBA3D61DB, 0x39F097A3, 0x3A5845DC, 0x3AB1FA35, 0x3B0CEFB8,
  0x3B653AB6, 0x3BCAE527, 0x3C221712, 0x3C6C5840, 0x3CC0A703,
  0x3D1DCC19, 0x3D63656D, 0x3D955907, 0x3DBF9910, 0x3DD53F69,
  0x3DB7DCEF, 0x3D639EBE, 0xBA6EDE48, 0xBD22BE69, 0xBD041CF1,
  0xBC64F5AB, 0xBB097A32, 0xB8EBF380, 0x00000000, 0x00000000,
  # degree 5
  0x3CB7D80C, 0x3C9B6050, 0x3C978D11, 0x3C92E850, 0x3C8D058B,
  0x3C848454, 0x3C6CD623, 0x3C4C824B, 0x3C2A7935, 0x3BE0B390,
  0x3B0651AC, 0xBB232F53, 0xBBD42FA0, 0xBC2C5366, 0xBC492C9E,
  0xBC2A7AA6, 0xBBD55D04, 0xBA823A76, 0x3B102AA8, 0x3AE25A7E,
  0x3A31F792, 0x38B84375, 0x3689BB5A, 0x00000000, 0x00000000,
], dtype=np.uint32).view(np.float32).reshape(6, 25)
# fmt: on
_INDEX_BIAS = np.int32(np.uint32(0xC21FFFFF).view(np.int32))
# about 5.5425, from where erf(x / sqrt(2)) is 1 in float32
_RIGHT_BOUND = np.uint32(0x40B15CEE).view(np.float32)

# oneDNN's avx512_core, on which torch hands a bfloat16 GELU to it
_AVX512_CORE = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})


@functools.cache
def runs_bfloat16_gelu() -> bool:
  """Whether torch's CPU ``gelu`` of a bfloat16 tensor runs oneDNN's kernel on
  this machine: an x86 CPU with AVX-512 (oneDNN's ``avx512_core``), whatever
  ``ATEN_CPU_CAPABILITY`` says."""
  return _AVX512_CORE <= cpu_math.cpu_flags()


def _erf_half_scale(x: Any) -> Any:
  """oneDNN's ``erf(x / sqrt(2))`` in float32."""
  magnitude = jnp.abs(x)
  piece = lax.shift_right_arithmetic(cpu_math.bits(magnitude) + _INDEX_BIAS, np.int32(21))
  piece = jnp.clip(piece, 1, 24)
  piece = jnp.where(magnitude > _RIGHT_BOUND, 23, piece)
  p = jnp.take(_POLYNOMIAL[5], piece, mode="clip")
  for degree in (4, 3, 2, 1, 0):
    p = cpu_math.fma(p, magnitude, jnp.take(_POLYNOMIAL[degree], piece, mode="clip"))
  return jnp.where(jnp.signbit(x), -p, p)


def _erf(z: Any) -> Any:
  """torch's CPU ``Vectorized<float>::erf``: Abramowitz and Stegun 7.1.26
  (absolute error 1.5e-7) in float32, with its polynomial's fused
  multiply-adds. Its ``exp`` (SLEEF's) and ``1 / (1 + p|z|)`` (an FMA) are
  XLA's here: a half GELU rounds the same, every value of either half dtype
  checked, faster than the float32 bits (BENCHMARKS.md, "autocast's fused
  ops")."""
  fma = cpu_math.fma
  t = 1.0 / (np.float32(0.3275911) * jnp.abs(z) + 1.0)
  r = np.float32(1.061405429)
  for c in (-1.453152027, 1.421413741, -0.284496736, 0.254829592):
    r = fma(r, t, np.float32(c))
  e = fma(-jnp.exp(-(z * z)) * t, r, np.float32(1.0))
  return jnp.where(jnp.signbit(z), -e, e)


def vectorised(x: Any) -> Any:
  """torch's vectorised CPU kernel's erf GELU of float32 ``x``, in float32:
  ``x * 0.5 * (1 + erf(x / sqrt(2)))``."""
  return x * 0.5 * (1.0 + _erf(x * np.float32(math.sqrt(0.5))))


@jax.custom_jvp
def onednn(x: Any) -> Any:
  """oneDNN's erf GELU of float32 ``x``, in float32, differentiated as
  :func:`vectorised`.

  Examples:
    >>> import jax.numpy as jnp
    >>> from jaxamp._autocast import erf_gelu
    >>> erf_gelu.onednn(jnp.float32(-5.0))  # the exact value is -1.43e-06
    Array(-1.1920929e-06, dtype=float32)
    >>> erf_gelu.vectorised(jnp.float32(-5.0))
    Array(-1.4901161e-06, dtype=float32)
  """
  return (x * (1.0 + _erf_half_scale(x))) * np.float32(0.5)


@onednn.defjvp
def _onednn_jvp(primals: Any, tangents: Any) -> Any:
  return onednn(primals[0]), jax.jvp(vectorised, primals, tangents)[1]


def torch_cpu(x: Any, dtype: Any) -> Any:
  """The erf GELU of float32 ``x`` as torch's CPU ``gelu`` computes it on this
  machine for a contiguous tensor of ``x``'s shape and ``dtype``."""
  if np.dtype(dtype) == jnp.bfloat16 and np.size(x) > 1 and runs_bfloat16_gelu():
    return onednn(x)
  return vectorised(x)
