"""Low-level primitives: torch's arithmetic as functions, for building your own step.

A training loop needs none of these: :func:`jaxamp.dynamic_loss_scale`,
:func:`jaxamp.apply_scaled_updates` and :class:`jaxamp.GradScaler` use them.
They are what torch's kernels compute, bit for bit: the scale update
(``_amp_update_scale_``), the unscale and check
(``_amp_foreach_non_finite_check_and_unscale_``), ``inv_scale``, clipping by a
torch norm, and diagnostics of the last skipped step.
"""

from jaxamp._frontends.state_access import find_loss_scale_state, nonfinite_leaf_paths
from jaxamp._torch.clipping import ClipGradNormState, clip_by_torch_norm
from jaxamp._torch.finite import all_finite
from jaxamp._torch.scale_rule import update_loss_scale
from jaxamp._torch.unscale import inverse_scale, unscale_and_check

__all__ = [
  "ClipGradNormState",
  "all_finite",
  "clip_by_torch_norm",
  "find_loss_scale_state",
  "inverse_scale",
  "nonfinite_leaf_paths",
  "unscale_and_check",
  "update_loss_scale",
]
