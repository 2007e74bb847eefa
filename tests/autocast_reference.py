"""What computing an op in float32 and rounding once can give, whichever kernel computes it.

torch's CPU kernels are not the same everywhere: its own vectorised kernels
differ with ``ATEN_CPU_CAPABILITY`` (default, AVX2, AVX512), and it hands some
ops to oneDNN on some CPUs (a bfloat16 GELU on AVX-512); XLA's kernels are
others again. So the autocast tests compare neither with the other bit for
bit. Each op has a float64 reference value ``r`` on the half input it was
given, and an error bound ``err`` that any float32 evaluation of the op (the
formula as written, elementary functions within ``K`` units of float32
rounding) stays within; a result rounded once to a half dtype is then within
``err`` plus half a half ulp of ``r`` (:func:`within`).
Both jaxamp and torch, run live, are held to it: torch's results show the
bound holds for the kernel torch ran here, jaxamp's that it rounds once. An
op computed primitive by primitive in the half dtype, rounding at each step,
falls outside it (the tests' controls).
"""

from __future__ import annotations

import math

import numpy as np
import scipy.special

U = 2.0**-24  # float32's unit roundoff
# The error of a float32 elementary function, in U: torch's SLEEF functions are
# within 1 ulp (2U), its vectorised erf (Abramowitz and Stegun 7.1.26) within
# 1.5e-7 (2.5U) before its float32 arithmetic; XLA CPU's measured over 400,000
# arguments: tanh 4.3U, erf 5.3U, exp 1.4U, log 1.6U, rsqrt 2.6U, erfc 2.7U
# (absolute).
K = 8
EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7}  # the half dtypes' machine epsilon
TINY = {"float16": 2.0**-24, "bfloat16": 2.0**-133}  # their smallest subnormals
LARGEST = {"float16": 65504.0, "bfloat16": float.fromhex("0x1.fep127")}
# XLA's CPU backend flushes float32 subnormals to zero (docs/exactness.md)
FLUSH = 2.0**-125


def spacing(v, half):
  """The gap between ``|v|`` and the next larger value of ``half``."""
  exponent = np.floor(np.log2(np.maximum(np.abs(v), TINY[half])))
  return np.maximum(EPS[half] * 2.0**exponent, TINY[half])


def within(v, r, err, half=None):
  """Elementwise: whether ``v`` is a float32 value within ``err`` of ``r``
  rounded once to ``half`` (None: float32, not rounded). Infinities where ``r``
  is infinite, or may round past the half dtype's largest value; NaN where
  ``r`` is NaN."""
  v = np.asarray(v, np.float64)
  err = err + FLUSH
  ok = np.abs(v - r) <= err + (0.0 if half is None else spacing(v, half) / 2)
  if half is not None:
    overflow = LARGEST[half] + spacing(LARGEST[half], half) / 2
    ok |= np.isinf(v) & (np.sign(v) == np.sign(r)) & (np.abs(r) + err >= overflow)
  return ok | (np.isinf(v) & (v == r)) | (np.isnan(v) & np.isnan(r))


def _shifted(x, axis):
  d = x - x.max(axis, keepdims=True)
  # exp(d)'s error, that of d, the sum's: relative, of the sum
  total_err = U * (x.shape[axis] + K + 2 + np.abs(d).max(axis, keepdims=True))
  return d, np.exp(d).sum(axis, keepdims=True), total_err


def softmax(x, axis=-1):
  """(r, err) of ``softmax(x, axis)``."""
  d, total, total_err = _shifted(np.asarray(x, np.float64), axis)
  r = np.exp(d) / total
  return r, r * (total_err + U * (K + 2 + np.abs(d)))


def log_softmax(x, axis=-1):
  """(r, err) of ``log_softmax(x, axis)``: ``(x - max) - log(sum)``."""
  d, total, total_err = _shifted(np.asarray(x, np.float64), axis)
  log_total = np.log(total)
  r = d - log_total
  return r, total_err + U * (K * log_total + np.abs(d) + np.abs(r))


def torch_log_softmax_extra(x, half, axis=-1):
  """What torch's CPU ``log_softmax`` over the last axis of a half tensor adds
  to :func:`log_softmax`'s bound: its kernel (``_vec_log_softmax_lastdim``)
  keeps the row's sum and its log in the half dtype, two more roundings (the
  sum's, relative, moves the log by at most about ``EPS / 2``)."""
  if axis not in (-1, np.ndim(x) - 1):
    return 0.0
  _, total, _ = _shifted(np.asarray(x, np.float64), axis)
  return EPS[half] / 2 * (2 + np.log(total))


def gelu_tanh(x):
  """(r, err) of ``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3)))``:
  where ``1 + tanh`` cancels (large negative x), tanh's error is relative to
  1, not to the result."""
  x = np.asarray(x, np.float64)
  u = math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)
  t = np.tanh(u)
  r = 0.5 * x * (1 + t)
  one_plus_err = U * (K * np.abs(t) + 6 * np.abs(u) * (1 - t * t) + np.abs(1 + t))
  return r, 0.5 * np.abs(x) * one_plus_err + 3 * U * np.abs(r)


def gelu_erf(x):
  """(r, err) of ``0.5 * x * (1 + erf(x / sqrt(2)))`` (torch's form; JAX's
  ``erfc(-x / sqrt(2))`` is within this bound, without its cancellation)."""
  x = np.asarray(x, np.float64)
  z = x / math.sqrt(2)
  e = scipy.special.erf(z)
  r = 0.5 * x * scipy.special.erfc(-z)
  argument_err = 3 * np.abs(z) * 2 / math.sqrt(math.pi) * np.exp(-z * z)
  return r, 0.5 * np.abs(x) * U * (K * (1 + np.abs(e)) + argument_err) + 3 * U * np.abs(r)


def layer_norm(x, w=None, b=None, eps=1e-5):
  """(r, err) of a layer norm over the last axis, ``(x - mean) / sqrt(var +
  eps) * w + b``; the variance's bound covers ``mean(x**2) - mean**2``
  (``jax.nn.standardize``, Flax) as well as two passes."""
  x = np.asarray(x, np.float64)
  n = x.shape[-1]
  mean = x.mean(-1, keepdims=True)
  var = x.var(-1, keepdims=True)
  rho = 1 / np.sqrt(var + eps)
  y = (x - mean) * rho
  mean_err = U * (n + 1) * np.abs(x).mean(-1, keepdims=True)
  var_err = U * (n + 4) * (x * x).mean(-1, keepdims=True)
  rho_rel = 0.5 * var_err / (var + eps) + (K + 2) * U
  y_err = np.abs(y) * rho_rel + rho * (mean_err + U * np.abs(x - mean)) + U * np.abs(y)
  if w is None:
    return y, y_err
  return y * w + b, np.abs(w) * y_err + 2 * U * (np.abs(w * y) + np.abs(b))


def cross_entropy(x, labels):
  """(r, err) of the integer-label cross-entropy over the last axis,
  ``log(sum(exp(x - max))) + max - x[label]``, float32 (not rounded)."""
  x = np.asarray(x, np.float64)
  _, total, total_err = _shifted(x, -1)
  log_total, top = np.log(total)[:, 0], x.max(-1)
  picked = x[np.arange(len(x)), labels]
  r = (log_total + top) - picked
  return r, total_err[:, 0] + U * (K * log_total + 2 * (np.abs(top) + np.abs(picked) + np.abs(r)))


def accumulated(r, magnitude, terms):
  """(r, err) of a sum of ``terms`` exact products (half values multiplied in
  float32), accumulated in float32 in any order, ``magnitude`` the sum of their
  absolute values: matmul, linear and conv with the bias added inside."""
  return r, U * (terms + 1) * magnitude


def linear(x, w, b=None):
  """(r, err) of ``x @ w.T + b`` on half values (float64 arrays of them)."""
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  b = np.zeros(w.shape[0]) if b is None else np.asarray(b, np.float64)
  return accumulated(x @ w.T + b, np.abs(x) @ np.abs(w).T + np.abs(b), x.shape[-1])
