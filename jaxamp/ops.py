"""Low-level primitives: torch's arithmetic as functions, for building your own step.

What :func:`jaxamp.dynamic_loss_scale` and :class:`jaxamp.GradScaler` use, bit for
bit as torch's kernels: the scale update, the unscale and check, ``inv_scale``,
clipping by a torch norm or adaptively (AGC) in torch's layout, and diagnostics of the last skipped step.
"""

from jaxamp._frontends.state_access import find_loss_scale_state, nonfinite_leaf_paths
from jaxamp._torch.clipping import (
  ClipGradNormState,
  adaptive_clip_by_torch_layout,
  adaptive_clip_grad,
  clip_by_torch_norm,
)
from jaxamp._torch.finite import all_finite
from jaxamp._torch.scale_rule import update_loss_scale
from jaxamp._torch.unscale import inverse_scale, unscale_and_check

__all__ = [
  "ClipGradNormState",
  "adaptive_clip_by_torch_layout",
  "adaptive_clip_grad",
  "all_finite",
  "clip_by_torch_norm",
  "find_loss_scale_state",
  "inverse_scale",
  "nonfinite_leaf_paths",
  "unscale_and_check",
  "update_loss_scale",
]
