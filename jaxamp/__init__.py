"""jaxamp: torch's automatic-mixed-precision GradScaler for JAX, bit for bit.

The names a training loop uses. Low-level primitives are in :mod:`jaxamp.ops`,
the Flax helpers in :mod:`jaxamp.flax_utils`.
"""

from jaxamp import ops
from jaxamp._autocast import autocast, autocast_disabled
from jaxamp._frontends.accumulation import AccumulateGradientsState, accumulate_gradients
from jaxamp._frontends.checkpoint import load_state_dict, state_dict
from jaxamp._frontends.fused import apply_scaled_updates
from jaxamp._frontends.grad_scaler import GradScaler
from jaxamp._frontends.optimizer import Optimizer
from jaxamp._frontends.serialization import register_with_flax
from jaxamp._frontends.state_access import get_loss_scale, scale_loss
from jaxamp._frontends.transform import DynamicLossScaleState, dynamic_loss_scale
from jaxamp._torch.clipping import clip_grad_norm

register_with_flax()

__version__ = "0.2.0"

__all__ = [
  "AccumulateGradientsState",
  "DynamicLossScaleState",
  "GradScaler",
  "Optimizer",
  "accumulate_gradients",
  "apply_scaled_updates",
  "autocast",
  "autocast_disabled",
  "clip_grad_norm",
  "dynamic_loss_scale",
  "get_loss_scale",
  "load_state_dict",
  "ops",
  "scale_loss",
  "state_dict",
]


def __getattr__(name: str) -> object:
  # The primitives were top-level names before 0.2; an old import names the new one.
  if name in ops.__all__:
    raise AttributeError(
      f"jaxamp.{name} moved to jaxamp.ops.{name} in 0.2.0: use jaxamp.ops.{name} "
      f"(from jaxamp.ops import {name})."
    )
  raise AttributeError(f"module 'jaxamp' has no attribute {name!r}")
