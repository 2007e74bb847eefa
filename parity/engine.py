"""Runs one scenario in torch and in jaxamp side by side and compares every step.

Each step, in both frameworks: gradients of the scaled loss, scripted inf/NaN
written into the *scaled* gradients at the same positions, then the scaler's
step (torch: ``unscale_`` / clipping / ``step`` / ``update``; jaxamp: one
``tx.update``). After every step the suite compares:

* the scale used and the scale after, float32 bit for bit; the growth tracker
  exactly; each optimizer's skip decision exactly;
* ``jaxamp.ops.unscale_and_check`` on *torch's* scaled gradients against torch's
  unscaled ``.grad``, bit for bit, and its found-inf flag against torch's;
* parameters and optimizer states within the scenario's relative tolerance
  (``max |jax - torch| / max |torch|`` per tensor; inf/NaN positions must match
  exactly); Adam step counts exactly.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import numpy as np
import torch

from parity import drivers
from parity.models import Pair, to_torch_tensor
from parity.optimizers import (
  make_torch,
  make_torch_scheduler,
  owned,
  schedule_mismatch,
  step_torch_scheduler,
  torch_state,
)

_MAX_FAILURES = 5
# The optax schedules compute in float32 what torch computes in float64 and
# rounds to float32: a few float32 ulps (2**-23 each) apart; measured ≤ 4e-7.
SCHEDULE_RTOL = 2.0**-21

# The models are tiny: one thread is faster than several, and leaves a core to XLA.
torch.set_num_threads(1)


@dataclasses.dataclass
class Result:
  """What one scenario run found; ``passed`` is the verdict."""

  scenario: str
  api: str
  steps: int
  param_rtol: float
  state_rtol: float
  scale_match: bool = True
  tracker_match: bool = True
  skips_match: bool = True
  unscale_bits_match: bool | None = None
  max_param_diff: float = 0.0
  max_state_diff: float = 0.0
  max_schedule_diff: float = 0.0
  skipped_steps: int = 0
  flushed_elements: int = 0
  seconds: float = 0.0
  failures: list[str] = dataclasses.field(default_factory=list)
  curves: dict[str, list[float]] = dataclasses.field(default_factory=dict)

  @property
  def passed(self) -> bool:
    return not self.failures

  def fail(self, step: int, message: str) -> None:
    if len(self.failures) < _MAX_FAILURES:
      self.failures.append(f"step {step}: {message}")

  def record(self, key: str, value: float) -> None:
    self.curves.setdefault(key, []).append(float(value))


def relative_difference(jax_value: np.ndarray, torch_value: np.ndarray) -> float:
  """``max |a - b| / max |b|`` over finite entries; ``inf`` if the non-finite
  entries (NaN, +inf, -inf) are not at the same places with the same values."""
  a = np.asarray(jax_value, np.float64)
  b = np.asarray(torch_value, np.float64)
  if a.shape != b.shape:
    return math.inf
  finite_a, finite_b = np.isfinite(a), np.isfinite(b)
  if (finite_a != finite_b).any():
    return math.inf
  nonfinite = ~finite_a
  if not np.array_equal(a[nonfinite], b[nonfinite], equal_nan=True):
    return math.inf
  if not finite_a.any():
    return 0.0
  diff = np.max(np.abs(a[finite_a] - b[finite_a]))
  if diff == 0.0:
    return 0.0
  scale = np.max(np.abs(b[finite_b]))
  return float(diff / scale) if scale > 0 else math.inf


def _bits(a: np.ndarray) -> bytes:
  a = np.ascontiguousarray(a)
  return a.dtype.str.encode() + a.tobytes()


def _f32(value: float) -> np.float32:
  return np.float32(value)


def _flush(x: np.ndarray) -> np.ndarray:
  """Float32 subnormals set to (signed) zero, as XLA CPU reads and writes them."""
  x = np.asarray(x, np.float32)
  return np.where(np.abs(x) < np.finfo(np.float32).tiny, np.copysign(np.float32(0), x), x)


def _subnormal(x: np.ndarray) -> np.ndarray:
  x = np.abs(np.asarray(x, np.float32))
  return (x > 0) & (x < np.finfo(np.float32).tiny)


def flush_to_zero_unscale(scaled: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
  """torch's unscale arithmetic with XLA's flush-to-zero, and where it matters.

  Returns the flushed model's result (in ``scaled``'s dtype) and a mask of the
  elements where a subnormal (input, reciprocal or float32 product) is
  involved: only there may the model differ from torch. A subnormal
  reciprocal (a scale above 2**126) is not flushed: jaxamp builds it from the
  bits and computes torch's correctly rounded ``g * inv``; a subnormal input
  is read as zero and a subnormal product written as zero.
  """
  scaled = np.asarray(scaled)
  with np.errstate(divide="ignore"):
    inv = np.float32(1.0 / np.float64(np.float32(scale)))
  if inv == 1:
    return scaled, np.zeros(scaled.shape, bool)
  wide = scaled.astype(np.float32)
  with np.errstate(all="ignore"):
    exact = (wide * inv).astype(np.float32)
    flushed = _flush(_flush(wide) * inv)
  involved = _subnormal(wide) | _subnormal(exact) | bool(_subnormal(inv))
  return flushed.astype(scaled.dtype), involved


class TorchRun:
  """The torch side: ``torch.amp.GradScaler('cpu', ...)`` and torch.optim."""

  def __init__(self, scenario, pair: Pair):
    self.scenario, self.pair = scenario, pair
    self.scaler = torch.amp.GradScaler("cpu", **scenario.scaler)
    if scenario.initial_tracker is not None:
      self.scaler.load_state_dict(
        {**_torch_hyper(scenario), "_growth_tracker": scenario.initial_tracker}
      )
    self.optimizers = [make_torch(spec, pair) for spec in scenario.optimizers]
    self.schedulers = [
      make_torch_scheduler(spec, opt) for spec, opt in zip(scenario.optimizers, self.optimizers)
    ]
    self.named = dict(pair.torch_module.named_parameters())

  def _inject(self, injections) -> None:
    for name, index, value in injections:
      with torch.no_grad():
        self.named[name].grad.view(-1)[index] = value

  def _backward(self, batch) -> float:
    """``scaler.scale(loss).backward()`` (with the gradient penalty if asked); the loss."""
    sc, scaler, module = self.scenario, self.scaler, self.pair.torch_module
    loss = self.pair.torch_loss(module, batch, sc.autocast)
    if sc.divide_loss:
      loss = loss / sc.accumulate
    if sc.grad_penalty:  # torch's AMP example, line for line
      params = list(module.parameters())
      scaled_grad_params = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)
      inv_scale = 1.0 / scaler.get_scale()
      grad_params = [p * inv_scale for p in scaled_grad_params]
      grad_norm = 0
      for grad in grad_params:
        grad_norm = grad_norm + grad.pow(2).sum()
      grad_norm = grad_norm.sqrt()
      loss = loss + grad_norm
    scaler.scale(loss).backward()
    return loss.item()

  def step(self, step: int) -> dict[str, Any]:
    if self.pair.stages:
      return self._staged_step(step)
    sc, scaler = self.scenario, self.scaler
    for opt in self.optimizers:
      opt.zero_grad(set_to_none=True)
    for name, value in sc.setters.get(step, {}).items():
      getattr(scaler, f"set_{name}")(value)
    losses = []
    for micro in range(sc.accumulate):
      losses.append(self._backward(self.pair.batch(step * sc.accumulate + micro)))
      self._inject(sc.micro_inject.get((step, micro), ()))
    scale_used = _f32(scaler.get_scale())
    self._inject(sc.inject.get(step, ()))
    scaled = self.pair.torch_arrays("grad")
    unscaled = None
    if sc.clip is not None or sc.explicit_unscale:
      for opt in self.optimizers:
        scaler.unscale_(opt)
      unscaled = self.pair.torch_arrays("grad")
    self._inject(sc.late_inject.get(step, ()))
    if sc.clip is not None:
      torch.nn.utils.clip_grad_norm_(self.pair.torch_module.parameters(), sc.clip)
    unstepped = sc.unstepped.get(step, ())
    for i, opt in enumerate(self.optimizers):
      if i not in unstepped:
        scaler.step(opt)
    if unscaled is None:
      unscaled = self.pair.torch_arrays("grad")
    found = [self._found_inf(opt) for opt in self.optimizers]
    for i, flag in enumerate(found):
      if flag is None:  # neither unscaled nor stepped: its grads are still scaled
        for name in owned(sc.optimizers[i], self.pair):
          unscaled.pop(name, None)
    new_scale = sc.new_scale.get(step)
    if new_scale is None:
      scaler.update()
    else:
      scaler.update(new_scale=float(new_scale))
    for scheduler in self.schedulers:  # every iteration, skipped ones included
      if scheduler is not None:
        step_torch_scheduler(scheduler)
    return self._record(losses, scale_used, scaled, unscaled, found)

  def _record(self, losses, scale_used, scaled, unscaled, found) -> dict[str, Any]:
    """One iteration's record, read after ``scaler.update()``."""
    return {
      "loss": float(np.mean(losses)),
      "scale_used": scale_used,
      "scaled": scaled,
      "unscaled": unscaled,
      "found": found,
      "scale": _f32(self.scaler.get_scale()),
      "tracker": self.scaler._get_growth_tracker(),
      "params": self.pair.torch_arrays("data"),
    }

  def _staged_step(self, step: int) -> dict[str, Any]:
    """Optimizers that step one after the other (a GAN): each stage's loss,
    ``scaler.scale(loss).backward()``, its injections, ``scaler.step(opt)``;
    then one ``scaler.update()``. Each optimizer's gradients are recorded as
    its step saw them: scaled before it, unscaled after it."""
    sc, scaler, module = self.scenario, self.scaler, self.pair.torch_module
    batch = self.pair.batch(step)
    scale_used = _f32(scaler.get_scale())
    losses, scaled, unscaled = [], {}, {}
    for (torch_loss, _), spec, opt in zip(self.pair.stages, sc.optimizers, self.optimizers):
      names = owned(spec, self.pair)
      opt.zero_grad(set_to_none=True)
      loss = torch_loss(module, batch)
      scaler.scale(loss).backward()
      losses.append(loss.item())
      self._inject([i for i in sc.inject.get(step, ()) if i[0] in names])
      grads = self.pair.torch_arrays("grad")
      scaled.update({n: grads[n] for n in names})
      scaler.step(opt)
      grads = self.pair.torch_arrays("grad")
      unscaled.update({n: grads[n] for n in names})
    found = [self._found_inf(opt) for opt in self.optimizers]
    scaler.update()
    return self._record(losses, scale_used, scaled, unscaled, found)

  def _found_inf(self, opt) -> bool | None:
    """The optimizer's recorded found_inf; None if it recorded none this step."""
    if not self.scaler.is_enabled():
      return False
    record = self.scaler._per_optimizer_states.get(id(opt))  # .get: no new entry
    if record is None or not record["found_inf_per_device"]:
      return None
    return bool(sum(v.item() for v in record["found_inf_per_device"].values()))

  def state(self) -> dict:
    merged: dict = {}
    for opt in self.optimizers:
      for kind, values in torch_state(opt, self.pair).items():
        merged.setdefault(kind, {}).update(values)
    return merged

  def checkpoint(self) -> dict:
    """What a torch training script saves: scaler, model and optimizer states."""
    return {
      "scaler": self.scaler.state_dict(),
      "params": self.pair.torch_arrays("data"),
      "optimizer": self.state(),
    }

  def resume(self, checkpoint: dict) -> None:
    """A fresh scaler and fresh optimizers loaded from a (JAX) checkpoint."""
    from parity.optimizers import load_torch_state

    self.scaler = torch.amp.GradScaler("cpu")
    self.scaler.load_state_dict(checkpoint["scaler"])
    with torch.no_grad():
      for name, value in checkpoint["params"].items():
        self.named[name].copy_(to_torch_tensor(value))
    self.optimizers = [make_torch(spec, self.pair) for spec in self.scenario.optimizers]
    for opt in self.optimizers:
      load_torch_state(opt, self.pair, checkpoint["optimizer"])


def _torch_hyper(scenario) -> dict:
  s = scenario.scaler
  return {
    "scale": float(s.get("init_scale", 2.0**16)),
    "growth_factor": s.get("growth_factor", 2.0),
    "backoff_factor": s.get("backoff_factor", 0.5),
    "growth_interval": s.get("growth_interval", 2000),
  }


def _compare_state(result: Result, step: int, jax_state: dict, torch_state_: dict) -> float:
  """Checks the optimizer states; returns this step's largest relative difference."""
  step_max = 0.0
  for kind, torch_values in torch_state_.items():
    for name, t in torch_values.items():
      j = jax_state.get(kind, {}).get(name)
      if j is None:
        result.fail(step, f"optimizer state {kind}[{name}] missing in jaxamp")
        continue
      if kind == "step":
        if float(j) != float(t):
          result.fail(step, f"Adam step count {name}: jaxamp {float(j)} torch {float(t)}")
        continue
      diff = relative_difference(j, t)
      step_max = max(step_max, diff)
      result.max_state_diff = max(result.max_state_diff, diff)
      if not diff <= result.state_rtol:
        result.fail(step, f"optimizer state {kind}[{name}] differs by {diff:.3g}")
  # A parameter torch never stepped has no state: optax's must still be zero.
  for kind, jax_values in jax_state.items():
    for name, j in jax_values.items():
      if name not in torch_state_.get(kind, {}) and np.any(np.asarray(j) != 0):
        result.fail(step, f"optimizer state {kind}[{name}] moved where torch has none")
  return step_max


def _explained_by_flush(jax_value, torch_value, scaled, scale) -> bool:
  """Whether jaxamp's unscaled grads equal the flush-to-zero model bit for bit,
  and the model departs from torch only where a subnormal is involved."""
  with np.errstate(all="ignore"):  # inf scales and products are part of the model
    model, involved = flush_to_zero_unscale(np.asarray(scaled), scale)
  jax_value, torch_value = np.asarray(jax_value), np.asarray(torch_value)
  if _bits(jax_value.astype(model.dtype)) != _bits(model):
    return False
  same = model.astype(np.float32).view(np.uint32) == torch_value.astype(np.float32).view(np.uint32)
  return bool(np.all(same | involved))


def run(scenario, api: str) -> Result:
  """Runs ``scenario`` through ``api`` ("optax" or "grad_scaler") and torch."""
  start = time.perf_counter()
  pair = scenario.model()
  state_rtol = scenario.param_rtol if scenario.state_rtol is None else scenario.state_rtol
  result = Result(scenario.name, api, scenario.steps, scenario.param_rtol, state_rtol)
  for i, spec in enumerate(scenario.optimizers):
    # The optax schedule must give torch's learning rates before any training.
    worst, what = schedule_mismatch(spec, scenario.steps)
    result.max_schedule_diff = max(result.max_schedule_diff, worst)
    if not worst <= SCHEDULE_RTOL:
      result.fail(-1, f"optimizer {i}: schedule differs from torch's by {worst:.3g} ({what})")
  torch_run = TorchRun(scenario, pair)
  jax_run = drivers.make(api, scenario, pair)
  check_unscale = scenario.scaler.get("enabled", True)
  flushed: set[str] = set()  # parameters whose gradients XLA flushed at some step
  for step in range(scenario.steps):
    t = torch_run.step(step)
    j = jax_run.step(step)
    result.record("torch_loss", t["loss"])
    result.record("jax_loss", j["loss"])
    result.record("torch_scale", t["scale"])
    result.record("jax_scale", j["scale"])
    result.skipped_steps += int(any(t["found"]))
    result.record("skipped", any(t["found"]))
    if _bits(j["scale_used"]) != _bits(t["scale_used"]) or _bits(j["scale"]) != _bits(t["scale"]):
      result.scale_match = False
      result.fail(step, f"scale: jaxamp {float(j['scale'])!r} torch {float(t['scale'])!r}")
    if int(j["tracker"]) != int(t["tracker"]):
      result.tracker_match = False
      result.fail(step, f"growth tracker: jaxamp {int(j['tracker'])} torch {t['tracker']}")
    if list(j["found"]) != list(t["found"]):
      result.skips_match = False
      result.fail(step, f"skip decisions: jaxamp {j['found']} torch {t['found']}")
    if check_unscale:
      checked = {name: t["scaled"][name] for name in t["unscaled"]}
      unscaled, found = jax_run.unscale_torch_grads(checked, t["scale_used"])
      bits_ok = bool(found) == any(t["found"])
      if not bits_ok:
        result.fail(step, f"unscale_and_check found_inf {bool(found)}, torch {t['found']}")
      for name, value in t["unscaled"].items():
        if value is None or _bits(unscaled[name]) == _bits(value):
          continue
        if scenario.subnormals and _explained_by_flush(
          unscaled[name], value, t["scaled"][name], t["scale_used"]
        ):
          result.flushed_elements += int(
            np.sum(
              np.asarray(unscaled[name], np.float32).view(np.uint32)
              != np.asarray(value, np.float32).view(np.uint32)
            )
          )
          flushed.add(name)
          continue
        bits_ok = False
        result.fail(step, f"unscaled grad {name} differs from torch's bit pattern")
      result.unscale_bits_match = bits_ok and result.unscale_bits_match is not False
    step_param_diff = 0.0
    for name, value in t["params"].items():
      diff = relative_difference(j["params"][name], value)
      if name in flushed and not diff <= scenario.param_rtol:
        continue  # fed by flushed gradients: the documented divergence
      step_param_diff = max(step_param_diff, diff)
      result.max_param_diff = max(result.max_param_diff, diff)
      if not diff <= scenario.param_rtol:
        result.fail(step, f"parameter {name} differs by {diff:.3g}")
    result.record("param_diff", step_param_diff)
    result.record("state_diff", _compare_state(result, step, jax_run.state(), torch_run.state()))
    if scenario.resume is not None and scenario.resume[0] == step + 1:
      if scenario.resume[1] == "jax":
        jax_run.resume(torch_run.checkpoint())
      else:
        torch_run.resume(jax_run.checkpoint())
  result.seconds = time.perf_counter() - start
  return result
