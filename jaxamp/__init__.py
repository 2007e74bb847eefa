"""jaxamp: torch's automatic-mixed-precision GradScaler for JAX, bit for bit."""

from jaxamp._accumulation import AccumulateGradientsState, accumulate_gradients
from jaxamp._autocast import autocast, autocast_disabled
from jaxamp._checkpoint import load_state_dict, state_dict
from jaxamp._clipping import ClipGradNormState, clip_by_torch_norm, clip_grad_norm
from jaxamp._finite import all_finite
from jaxamp._grad_scaler import GradScaler
from jaxamp._optimizer import Optimizer
from jaxamp._scale_update import update_loss_scale
from jaxamp._state_access import (
  find_loss_scale_state,
  get_loss_scale,
  nonfinite_leaf_paths,
  scale_loss,
)
from jaxamp._train_step import apply_scaled_updates
from jaxamp._transform import DynamicLossScaleState, dynamic_loss_scale
from jaxamp._unscale import inverse_scale, unscale_and_check

__version__ = "0.2.0"

__all__ = [
  "AccumulateGradientsState",
  "ClipGradNormState",
  "DynamicLossScaleState",
  "GradScaler",
  "Optimizer",
  "accumulate_gradients",
  "all_finite",
  "apply_scaled_updates",
  "autocast",
  "autocast_disabled",
  "clip_by_torch_norm",
  "clip_grad_norm",
  "dynamic_loss_scale",
  "find_loss_scale_state",
  "get_loss_scale",
  "inverse_scale",
  "load_state_dict",
  "nonfinite_leaf_paths",
  "scale_loss",
  "state_dict",
  "unscale_and_check",
  "update_loss_scale",
]
