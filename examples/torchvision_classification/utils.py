"""The parts of torchvision's ``references/classification/utils.py`` that training
uses, in JAX: ``set_weight_decay``, ``ExponentialMovingAverage`` and ``accuracy``.

Each keeps upstream's name, arguments and behaviour, on the flat dicts of
``model.py`` (torch's names) in the place of an ``nn.Module``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax


def set_weight_decay(
  params, weight_decay, norm_weight_decay=None, custom_keys_weight_decay=None, *, is_norm
):
  """Upstream's parameter groups: ``[{"params": [names], "weight_decay": w}, ...]``.

  A parameter goes to the first custom key it matches (a key with a dot
  matches the full name, one without the parameter's own name: ``"bias"``),
  else to ``"norm"`` if ``norm_weight_decay`` is given and ``is_norm(name)``,
  else to ``"other"``; empty groups are left out, as upstream.
  """
  groups = {"other": [], "norm": []}
  decays = {"other": weight_decay, "norm": norm_weight_decay}
  for key, decay in custom_keys_weight_decay or []:
    groups[key], decays[key] = [], decay
  custom_keys = [key for key, _ in custom_keys_weight_decay or []]
  for full_name in params:
    name = full_name.rsplit(".", 1)[-1]
    key = next((k for k in custom_keys if k == (full_name if "." in k else name)), None)
    if key is None:
      key = "norm" if norm_weight_decay is not None and is_norm(full_name) else "other"
    groups[key].append(full_name)
  return [{"params": names, "weight_decay": decays[key]} for key, names in groups.items() if names]


def sgd(param_groups, names, momentum, nesterov):
  """``torch.optim.SGD(param_groups, lr, momentum, weight_decay, nesterov)`` as one optax
  transformation, its learning rate a hyperparameter to set each epoch.

  torch adds each group's ``weight_decay * p`` to the gradient before the
  momentum (L2, not decoupled): one masked ``add_decayed_weights`` per group,
  then ``optax.sgd``, whose ``trace`` starts at zero (torch's first momentum
  buffer is the gradient itself: the same step). One transformation, so one
  skip decision, as one torch optimizer (docs/porting.md, "Parameter groups in
  one optimizer").
  """

  def build(learning_rate):
    decayed = [
      optax.add_decayed_weights(
        group["weight_decay"], mask={n: n in group["params"] for n in names}
      )
      for group in param_groups
      if group["weight_decay"]
    ]
    return optax.chain(*decayed, optax.sgd(learning_rate, momentum or None, nesterov))

  return optax.inject_hyperparams(build)


def _ema_avg(averaged, model, decay, one_minus_decay):
  """``decay * avg + (1 - decay) * model`` in float32; integer buffers truncated, as torch's ``copy_``.

  Op by op, not jitted: under ``jax.jit`` XLA CPU contracts the multiply and
  the add into one FMA (one rounding), where torch rounds the two products and
  their sum.
  """

  def avg(a, m):
    out = decay * a.astype(jnp.float32) + one_minus_decay * m.astype(jnp.float32)
    return out.astype(a.dtype)

  return jax.tree.map(avg, averaged, model)


class ExponentialMovingAverage:
  """Upstream's ``ExponentialMovingAverage``: ``torch.optim.swa_utils.AveragedModel``
  with ``use_buffers=True`` and ``ema_avg = decay * avg_model_param + (1 - decay) * model_param``.

  ``module`` averages the parameters and the buffers (BatchNorm's running
  statistics, and ``num_batches_tracked``, which torch computes in float32 and
  truncates back to an integer). The first update after ``n_averaged = 0``
  copies the model, as torch's does.
  """

  def __init__(self, params, buffers, decay):
    self.module = {**params, **buffers}
    self.decay = decay
    self.n_averaged = 0

  def update_parameters(self, params, buffers):
    model = {**params, **buffers}
    if self.n_averaged == 0:
      self.module = model
    else:
      # the two factors as torch's kernel takes them: Python floats rounded to float32
      factors = np.float32(self.decay), np.float32(1 - self.decay)
      self.module = _ema_avg(self.module, model, *factors)
    self.n_averaged += 1

  def state_dict(self):
    """torch's keys: ``n_averaged`` and ``module.<name>``."""
    module = {f"module.{name}": np.asarray(v) for name, v in self.module.items()}
    return {"n_averaged": self.n_averaged, **module}

  def load_state_dict(self, state):
    self.n_averaged = int(state["n_averaged"])
    self.module = {name: jnp.asarray(state[f"module.{name}"]) for name in self.module}


def accuracy(output, target, topk=(1,)):
  """The percentage of rows whose target is among the ``k`` top predictions, per ``k``."""
  top = jnp.argsort(-output.astype(jnp.float32), axis=1)[:, : max(topk)]
  correct = top == target[:, None]
  return [100.0 * jnp.mean(jnp.any(correct[:, :k], axis=1)) for k in topk]
