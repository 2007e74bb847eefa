"""Paired optimizers (torch.optim and optax) and their states in one layout.

| torch                               | optax                                 |
|-------------------------------------|---------------------------------------|
| ``SGD(lr)``                         | ``sgd(lr)``                           |
| ``SGD(lr, momentum=m)``             | ``sgd(lr, momentum=m)`` (trace)       |
| ``Adam(lr)`` (``fused=`` optional)  | ``adam(lr)`` (eps 1e-8 in both)       |
| ``AdamW(lr, weight_decay=wd)``      | ``adamw(lr, weight_decay=wd)``        |

Several torch optimizers over disjoint parameter sets become one
``optax.multi_transform``. States are compared as ``{kind: {torch_name: array}}``
with kinds ``momentum_buffer``, ``exp_avg``, ``exp_avg_sq`` and ``step``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
import optax
import torch

from parity.models import Pair, _numpy, to_torch_tensor


@dataclasses.dataclass(frozen=True)
class OptSpec:
  """One optimizer over the parameters whose torch names start with ``prefix``."""

  kind: str  # "sgd", "adam", "adamw"
  lr: float
  momentum: float = 0.0
  weight_decay: float = 0.0
  fused: bool = False
  prefix: str = ""


def owned(spec: OptSpec, pair: Pair) -> list[str]:
  return [name for name in pair.names if name.startswith(spec.prefix)]


def make_torch(spec: OptSpec, pair: Pair) -> torch.optim.Optimizer:
  named = dict(pair.torch_module.named_parameters())
  params = [named[name] for name in owned(spec, pair)]
  if spec.kind == "sgd":
    return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum)
  if spec.kind == "adam":
    return torch.optim.Adam(params, lr=spec.lr, fused=spec.fused or None)
  if spec.kind == "adamw":
    return torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay)
  raise ValueError(spec.kind)


def make_single_optax(spec: OptSpec) -> optax.GradientTransformation:
  if spec.kind == "sgd":
    return optax.sgd(spec.lr, momentum=spec.momentum or None)
  if spec.kind == "adam":
    return optax.adam(spec.lr)
  if spec.kind == "adamw":
    return optax.adamw(spec.lr, weight_decay=spec.weight_decay)
  raise ValueError(spec.kind)


def make_optax(specs: tuple[OptSpec, ...], pair: Pair) -> optax.GradientTransformation:
  """One optax transformation standing for all of ``specs``."""
  if len(specs) == 1:
    return make_single_optax(specs[0])
  labels = {}
  for i, spec in enumerate(specs):
    for name in owned(spec, pair):
      labels[name] = f"opt{i}"
  return optax.multi_transform(
    {f"opt{i}": make_single_optax(spec) for i, spec in enumerate(specs)}, pair.tree_of(labels)
  )


# ---------------------------------------------------------------------------------------
# States in one layout.


def torch_state(opt: torch.optim.Optimizer, pair: Pair) -> dict[str, dict[str, np.ndarray]]:
  """``{kind: {torch_name: array}}``; a parameter never stepped has no entry."""
  names = {id(p): name for name, p in pair.torch_module.named_parameters()}
  out: dict[str, dict[str, np.ndarray]] = {}
  for p, state in opt.state.items():
    for kind, value in state.items():
      out.setdefault(kind, {})[names[id(p)]] = _numpy(value) if torch.is_tensor(value) else value
  return out


def _is_state_node(x: Any) -> bool:
  return isinstance(x, (optax.TraceState, optax.ScaleByAdamState))


def jax_state(inner_state: Any, pair: Pair) -> dict:
  """The optax state in :func:`torch_state`'s layout (``step`` per parameter).

  ``pair`` is anything with ``to_torch_layout`` for params-shaped trees: a
  :class:`~parity.models.Pair`, or a :class:`~parity.models.NamedLayout`.
  """
  nodes = [
    n
    for n in jax.tree.leaves(jax.device_get(inner_state), is_leaf=_is_state_node)
    if _is_state_node(n)
  ]
  out: dict[str, dict[str, np.ndarray]] = {}
  for node in nodes:
    if isinstance(node, optax.TraceState):
      out.setdefault("momentum_buffer", {}).update(pair.to_torch_layout(node.trace))
    else:
      mu = pair.to_torch_layout(node.mu)
      out.setdefault("exp_avg", {}).update(mu)
      out.setdefault("exp_avg_sq", {}).update(pair.to_torch_layout(node.nu))
      out.setdefault("step", {}).update({name: np.asarray(node.count, np.float32) for name in mu})
  return out


def load_torch_state(opt: torch.optim.Optimizer, pair: Pair, state: dict) -> None:
  """Loads a :func:`jax_state` into a torch optimizer (resuming a JAX run).

  An Adam parameter whose optax count is 0 was never stepped: torch has no
  state for it then, and none is loaded.
  """
  sd = opt.state_dict()
  index = {}
  names = {id(p): name for name, p in pair.torch_module.named_parameters()}
  for group_sd, group in zip(sd["param_groups"], opt.param_groups):
    for i, p in zip(group_sd["params"], group["params"]):
      index[names[id(p)]] = i
  loaded = {}
  for name, i in index.items():
    entry = {kind: values[name] for kind, values in state.items() if name in values}
    if "step" in entry and float(entry["step"]) == 0.0:
      continue
    if "momentum_buffer" in entry and not _torch_has_momentum(opt):
      continue
    loaded[i] = {
      kind: torch.tensor(float(value)) if kind == "step" else to_torch_tensor(value)
      for kind, value in entry.items()
    }
  sd["state"] = loaded
  opt.load_state_dict(sd)


def _torch_has_momentum(opt: torch.optim.Optimizer) -> bool:
  return bool(opt.param_groups[0].get("momentum", 0.0))


def jax_inner_state_from_torch(
  tx: optax.GradientTransformation, params: Any, pair: Pair, state: dict
) -> Any:
  """An optax state for ``tx`` holding a :func:`torch_state` (resuming a torch run).

  ``pair`` converts params-shaped trees, as in :func:`jax_state`.
  """
  fresh = tx.init(params)

  def fill(node):
    if isinstance(node, optax.TraceState):
      return node._replace(trace=_fill_tree(node.trace, pair, state.get("momentum_buffer", {})))
    if isinstance(node, optax.ScaleByAdamState):
      mu = _fill_tree(node.mu, pair, state.get("exp_avg", {}))
      names = [n for n in pair.to_torch_layout(node.mu)]
      steps = {float(state.get("step", {}).get(n, 0.0)) for n in names}
      (count,) = steps  # one count per optimizer, as torch steps all its params together
      return node._replace(
        count=np.asarray(count, np.int32),
        mu=mu,
        nu=_fill_tree(node.nu, pair, state.get("exp_avg_sq", {})),
      )
    return node

  return jax.tree.map(fill, fresh, is_leaf=_is_state_node)


def _fill_tree(tree: Any, pair: Pair, values: dict[str, np.ndarray]) -> Any:
  """Replaces the leaves of a params-shaped tree by ``values`` (torch layout)."""
  current = pair.to_torch_layout(tree)
  merged = {name: values.get(name, current.get(name)) for name in pair.names}
  filled = pair.from_torch_layout(
    {n: (v if v is not None else np.zeros(1)) for n, v in merged.items()}
  )
  return jax.tree.map(
    lambda old, new: old if isinstance(old, optax.MaskedNode) else new,
    tree,
    filled,
    is_leaf=lambda x: isinstance(x, optax.MaskedNode),
  )
