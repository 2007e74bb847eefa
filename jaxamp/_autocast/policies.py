"""torch's autocast op lists as JAX primitives: which primitive runs in which dtype.

docs/autocast.md has torch's lists (CUDA from torch's op reference, CPU as
measured on torch 2.13) and the torch-op-to-primitive table these sets encode.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

HALF = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
F32 = np.dtype(jnp.float32)

# torch's "lower precision" list: every matmul-like torch op (mm, matmul, linear, bmm,
# baddbmm, addmm, addbmm, einsum, tensordot, conv*) traces to one of these two.
LOWER = frozenset({"dot_general", "conv_general_dilated"})

# Primitives with no half kernels in JAX (LAPACK, FFT): float32 in both
# policies (torch's CPU list has cholesky, inverse, linalg_*, fft_*).
_LINALG = frozenset(
  {"cholesky", "lu", "qr", "svd", "eigh", "eig", "triangular_solve", "householder_product", "fft"}
)

# torch's CUDA float32 list, as JAX primitives: torch 2.13's AT_FORALL_FP32 and
# AT_FORALL_FP32_SET_OPT_DTYPE (ATen/autocast_mode.h; docs/autocast.md has the table).
# Not exp2 or cumlogsumexp: torch's exp2 and logcumsumexp are on none of its lists.
# fmt: off
FP32_CUDA = frozenset({
  "exp", "expm1", "log", "log1p", "pow", "integer_pow", "square", "rsqrt", "reduce_sum",
  "reduce_prod", "cumsum", "cumprod", "erf_inv", "acos", "asin", "cosh", "sinh", "tan",
}) | _LINALG
# fmt: on

# torch's CPU float32 list, as JAX primitives: prod is the only op of that list
# that is one primitive (the losses, cdist, ... decompose into ops that run in
# their input types on CPU too).
FP32_CPU = frozenset({"reduce_prod"}) | _LINALG

POLICIES = {"cuda": FP32_CUDA, "cpu": FP32_CPU}

# Reductions that, run in a half dtype, accumulate in float32 and round once
# (torch's "opmath"; jnp.sum of a float16 array does the same).
ACCUMULATE_F32 = frozenset({"reduce_sum", "cumsum", "cumlogsumexp", "reduce_prod", "cumprod"})

# Primitives always run as traced: bit-level ones, and host callbacks (their result
# dtypes were declared when traced).
EXACT_DTYPE = frozenset(
  {"bitcast_convert_type", "reduce_precision", "nextafter", "pure_callback", "io_callback"}
)

# The JAX libraries' linear and conv layers, (file, qualified name): an add of the
# output's shape inside one is its bias (docs/autocast.md, rule 1).
BIAS_LAYERS = frozenset(
  {
    ("flax/linen/linear.py", "Dense.__call__"),
    ("flax/linen/linear.py", "DenseGeneral.__call__"),
    ("flax/linen/linear.py", "_Conv.__call__"),
    ("flax/nnx/nn/linear.py", "Linear.__call__"),
    ("flax/nnx/nn/linear.py", "LinearGeneral.__call__"),
    ("flax/nnx/nn/linear.py", "Conv.__call__"),
    ("equinox/nn/_linear.py", "Linear.__call__"),
    ("equinox/nn/_conv.py", "Conv.__call__"),
  }
)

# torch's fused ops, by the (file, qualified name) frame of their equations'
# tracebacks (docs/autocast.md, "Fused ops: computed in float32, rounded once").
FUSED_FUNCTIONS = {
  ("jax/_src/nn/functions.py", "softmax"): "softmax",
  ("jax/_src/nn/functions.py", "log_softmax"): "log_softmax",
  ("jax/_src/nn/functions.py", "gelu"): "gelu",
  ("jax/_src/nn/functions.py", "standardize"): "layer_norm",
  ("flax/nnx/nn/normalization.py", "LayerNorm.__call__"): "layer_norm",
  ("flax/linen/normalization.py", "LayerNorm.__call__"): "layer_norm",
  ("equinox/nn/_normalisation.py", "LayerNorm.__call__"): "layer_norm",
  ("flax/nnx/nn/normalization.py", "RMSNorm.__call__"): "rms_norm",
  ("flax/linen/normalization.py", "RMSNorm.__call__"): "rms_norm",
  ("equinox/nn/_normalisation.py", "RMSNorm.__call__"): "rms_norm",
  ("flax/nnx/nn/normalization.py", "BatchNorm.__call__"): "batch_norm",
  ("flax/linen/normalization.py", "BatchNorm.__call__"): "batch_norm",
  ("equinox/nn/_batch_norm.py", "BatchNorm.__call__"): "batch_norm",
  ("jax/_src/ops/special.py", "logsumexp"): "logsumexp",
  ("optax/losses/_regression.py", "huber_loss"): "huber_loss",
  ("jax/_src/image/scale.py", "resize"): "upsample",
  ("jax/_src/image/scale.py", "scale_and_translate"): "upsample",
  ("optax/losses/_classification.py", "softmax_cross_entropy"): "cross_entropy",
  ("optax/losses/_classification.py", "softmax_cross_entropy_with_integer_labels"): (
    "cross_entropy"
  ),
}

# The fused ops whose result is float32 under each policy (torch 2.13's float32
# lists as compiled, tests/test_autocast_layers.py); the others return their
# input's half dtype.
FUSED_F32 = {
  "cuda": frozenset(
    {
      "softmax",
      "log_softmax",
      "layer_norm",
      "rms_norm",
      "logsumexp",
      "cross_entropy",
      "huber_loss",
      "upsample",
    }
  ),
  "cpu": frozenset({"cross_entropy", "huber_loss"}),
}

# Fused ops that also return statistics (a batch norm's running mean and variance):
# an output its half input reaches only through a reduction stays float32, as torch's.
FUSED_STATISTICS = frozenset({"batch_norm"})

# Fused ops whose JAX form has matmuls (jax.image.resize's weights): with no half
# input they run in float32 as written, not with the matmuls in the half dtype.
FUSED_NO_LOWER = frozenset({"upsample"})
