"""Paired optimizers (torch.optim and optax) and their states in one layout.

| torch                               | optax                                 |
|-------------------------------------|---------------------------------------|
| ``SGD(lr)``                         | ``sgd(lr)``                           |
| ``SGD(lr, momentum=m)``             | ``sgd(lr, momentum=m)`` (trace)       |
| ``Adam(lr)`` (``fused=`` optional)  | ``adam(lr)`` (eps 1e-8 in both)       |
| ``AdamW(lr, weight_decay=wd)``      | ``adamw(lr, weight_decay=wd)``        |

An optimizer may carry a learning-rate schedule (``OptSpec.schedule``): torch's
``LambdaLR`` (linear warmup) or ``OneCycleLR`` (cosine, with momentum cycling),
stepped every iteration, against an optax schedule computing the same values as
a function of the step count (``inject_hyperparams`` for the cycled momentum);
:func:`schedule_mismatch` compares the two sequences before training.

Several torch optimizers over disjoint parameter sets become one
``optax.multi_transform`` (or ``{label: tx}`` with ``param_labels``). States are compared as ``{kind: {torch_name: array}}``
with kinds ``momentum_buffer``, ``exp_avg``, ``exp_avg_sq`` and ``step``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from typing import Any

import jax
import jax.numpy as jnp
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
  schedule: tuple | None = None  # ("warmup", steps) or ("onecycle", total, max_lr, pct)


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
  lr, momentum = jax_schedules(spec)
  if momentum is not None:  # OneCycleLR cycles SGD's momentum too
    if spec.kind != "sgd":
      raise ValueError("momentum cycling is paired for SGD only")
    return optax.inject_hyperparams(optax.sgd)(learning_rate=lr, momentum=momentum)
  if spec.kind == "sgd":
    return optax.sgd(lr, momentum=spec.momentum or None)
  if spec.kind == "adam":
    return optax.adam(lr)
  if spec.kind == "adamw":
    return optax.adamw(lr, weight_decay=spec.weight_decay)
  raise ValueError(spec.kind)


# ---------------------------------------------------------------------------------------
# Learning-rate schedules: torch's LRScheduler, stepped every iteration (skipped ones
# included), and the optax schedule of the same values (schedule_counts="iterations").

_DIV_FACTOR, _FINAL_DIV_FACTOR = 25.0, 1e4  # OneCycleLR's defaults
_BASE_MOMENTUM, _MAX_MOMENTUM = 0.85, 0.95


def _warmup_factor(steps: int):
  return lambda i: min(1.0, (i + 1) / steps)


def make_torch_scheduler(spec: OptSpec, opt: torch.optim.Optimizer):
  """torch's scheduler for ``spec.schedule`` (None without one)."""
  if spec.schedule is None:
    return None
  kind, *args = spec.schedule
  if kind == "warmup":
    return torch.optim.lr_scheduler.LambdaLR(opt, _warmup_factor(args[0]))
  if kind == "onecycle":
    total, max_lr, pct = args
    return torch.optim.lr_scheduler.OneCycleLR(
      opt, max_lr=max_lr, total_steps=total, pct_start=pct
    )  # defaults: anneal_strategy="cos", div_factor 25, final_div_factor 1e4, cycle_momentum
  raise ValueError(kind)


def step_torch_scheduler(scheduler) -> None:
  """``scheduler.step()``; its warning about a step before ``optimizer.step()``
  (the first iteration skipped, docs/torch_semantics.md §6.61) is expected here."""
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()`"))
    scheduler.step()


def _cos_anneal(start_value, end_value, step, start_step, end_step):
  """OneCycleLR._annealing_cos at ``pct = (step - start_step) / (end_step - start_step)``:
  ``end + (start - end) / 2 * (cos(pi * pct) + 1)``, computed in float32 as
  ``start * c**2 + end * s**2`` with ``c, s = cos, sin(pi/2 * pct)`` (the same
  value), taken as ``sin, cos(pi/2 * (1 - pct))`` for ``pct > 1/2`` with ``1 - pct``
  from the step counts. torch's form, evaluated in float32, would cancel away
  the digits its float64 keeps (``cos(pi * pct) + 1`` near ``pct = 1``, and
  ``end + (start - end)`` near ``pct = 0``)."""
  span = end_step - start_step
  pct = (step - start_step) / span
  rest = (end_step - step) / span
  first = pct <= 0.5
  c = jnp.where(first, jnp.cos(jnp.pi / 2 * pct), jnp.sin(jnp.pi / 2 * rest))
  s = jnp.where(first, jnp.sin(jnp.pi / 2 * pct), jnp.cos(jnp.pi / 2 * rest))
  return start_value * (c * c) + end_value * (s * s)


def _onecycle(total: int, max_lr: float, pct: float):
  """OneCycleLR (two phases, cosine) as functions of the step count."""
  initial = max_lr / _DIV_FACTOR
  final = initial / _FINAL_DIV_FACTOR
  end_up = float(pct * total) - 1  # torch's phase boundaries, as floats
  end_down = float(total - 1)

  def anneal(count, up_values, down_values):
    step = count.astype(jnp.float32)
    return jnp.where(
      step <= end_up,
      _cos_anneal(*up_values, step, 0.0, end_up),
      _cos_anneal(*down_values, step, end_up, end_down),
    )

  def lr(count):
    return anneal(count, (initial, max_lr), (max_lr, final))

  def momentum(count):
    return anneal(count, (_MAX_MOMENTUM, _BASE_MOMENTUM), (_BASE_MOMENTUM, _MAX_MOMENTUM))

  return lr, momentum


def jax_schedules(spec: OptSpec):
  """``(learning_rate, momentum)`` for optax: numbers, or schedules of the count
  (``momentum`` None unless the schedule cycles it)."""
  if spec.schedule is None:
    return spec.lr, None
  kind, *args = spec.schedule
  if kind == "warmup":
    steps = args[0]
    return (
      lambda count: spec.lr * jnp.minimum(1.0, (count.astype(jnp.float32) + 1.0) / steps)
    ), None
  if kind == "onecycle":
    return _onecycle(*args)
  raise ValueError(kind)


def schedule_mismatch(spec: OptSpec, steps: int) -> tuple[float, str]:
  """The largest relative difference, over ``steps`` iterations, between torch's
  learning rates (and cycled momenta) as float32 and the optax schedule's, and
  a description. torch computes in float64 and its kernels round the result to
  float32; the optax schedule computes in float32, so one or two ulps apart."""
  if spec.schedule is None:
    return 0.0, ""
  param = torch.nn.Parameter(torch.zeros(1))
  opt = make_torch(dataclasses.replace(spec, prefix=""), _single(param))
  sched = make_torch_scheduler(spec, opt)
  torch_lr, torch_momentum = [], []
  for _ in range(steps):
    torch_lr.append(opt.param_groups[0]["lr"])
    torch_momentum.append(opt.param_groups[0].get("momentum"))
    opt.step()
    sched.step()
  lr, momentum = jax_schedules(spec)
  counts = jnp.arange(steps, dtype=jnp.int32)
  pairs = [("lr", torch_lr, np.asarray(jax.vmap(lr)(counts)))]
  if momentum is not None:
    pairs.append(("momentum", torch_momentum, np.asarray(jax.vmap(momentum)(counts))))
  worst, what = 0.0, ""
  for name, expected, got in pairs:
    expected = np.asarray(expected, np.float64).astype(np.float32)
    rel = np.abs(got.astype(np.float64) - expected) / np.abs(expected)
    if rel.max() > worst:
      i = int(rel.argmax())
      worst = float(rel.max())
      what = f"{name} at step {i}: optax {float(got[i])!r}, torch {float(expected[i])!r}"
  if not math.isfinite(worst):
    worst = math.inf
  return worst, what


class _single:
  """A stand-in ``Pair`` holding one parameter, for :func:`make_torch`."""

  def __init__(self, param):
    self.torch_module = torch.nn.ParameterDict({"p": param})
    self.names = ["p"]


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
