"""The jaxamp side of a scenario, one driver per public API.

``OptaxDriver`` uses ``jaxamp.dynamic_loss_scale`` as a user would: gradients
of ``jaxamp.scale_loss(loss, opt_state)``, then ``tx.update`` and
``optax.apply_updates``, both jitted. ``GradScalerDriver`` ports the torch loop
line by line: ``scaler.scale``, ``scaler.unscale_``, clipping, ``scaler.step``
per ``jaxamp.Optimizer``, ``scaler.update``, jitted as one iteration.

A scripted injection converts the JAX gradients to torch's layout, writes the
same value at the same place, and converts back (transposes only, exact).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp
from parity.models import NamedLayout, Pair
from parity.optimizers import (
  jax_inner_state_from_torch,
  jax_state,
  make_optax,
  make_single_optax,
  owned,
)


def _nonfinite_only(scenario) -> None:
  """With accumulation, injections go into one micro-batch's gradients, which are
  then summed: the same as torch's write into ``.grad`` only for inf/NaN."""
  if scenario.accumulate == 1:
    return
  groups = [*scenario.inject.values(), *scenario.micro_inject.values()]
  if any(np.isfinite(value) for group in groups for _, _, value in group):
    raise ValueError(f"{scenario.name}: with accumulation only inf/NaN can be injected")


def _loss_fn(scenario, pair: Pair, scale_of, scale_loss):
  """The loss a step differentiates, as the torch side builds it: divided by
  ``accumulate`` if asked, plus torch's gradient penalty if asked.

  ``scale_of()`` is the scale (``jaxamp.get_loss_scale(state)`` or, inside
  ``jit``, ``scaler.get_scale()``) and ``scale_loss(loss)`` multiplies by it.
  """
  divisor = scenario.accumulate if scenario.divide_loss else 1

  def plain(params, batch):
    loss = pair.jax_loss(params, batch)
    return loss / divisor if divisor != 1 else loss

  if not scenario.grad_penalty:
    return plain

  def with_penalty(params, batch):
    loss = plain(params, batch)
    scaled_grad_params = jax.grad(lambda p: scale_loss(plain(p, batch)))(params)
    inv_scale = 1.0 / scale_of()
    grad_params = [_leaf(scaled_grad_params, path) * inv_scale for _, path, _ in pair.layout]
    grad_norm = 0
    for grad in grad_params:  # torch's order: model.parameters()
      grad_norm = grad_norm + jnp.sum(grad**2)
    return loss + jnp.sqrt(grad_norm)

  return with_penalty


# What a staged scenario may set: the rest is the single-loss loop's.
_STAGED_FIELDS = {
  "name",
  "doc",
  "model",
  "optimizers",
  "steps",
  "scaler",
  "inject",
  "jaxamp_options",
}
_REPORT_FIELDS = {"param_rtol", "state_rtol", "spec", "apis", "plot"}


def _check_staged(scenario, pair: Pair) -> None:
  """A staged pair (optimizers that step one after the other) runs the plain
  loop only: one optimizer per stage, injections after each stage's backward."""
  extras = []
  for f in dataclasses.fields(scenario):
    if f.name in _STAGED_FIELDS | _REPORT_FIELDS:
      continue
    default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
    if getattr(scenario, f.name) != default:
      extras.append(f.name)
  if extras or len(scenario.optimizers) != len(pair.stages):
    raise ValueError(
      f"{scenario.name}: a staged pair takes one optimizer per stage and none of {extras}"
    )


def _stage_names(scenario, pair: Pair, stage: int) -> set[str]:
  return set(owned(scenario.optimizers[stage], pair))


def _leaf(tree: Any, path) -> Any:
  for key in path:
    tree = tree[key]
  return tree


def _inject(pair: Pair, grads: Any, injections) -> Any:
  """``grads`` with the scripted values written at torch-layout positions."""
  if not injections:
    return grads
  arrays = pair.to_torch_layout(jax.device_get(grads))
  for name, index, value in injections:
    arrays[name] = arrays[name].copy()
    arrays[name].reshape(-1)[index] = value
  return pair.from_torch_layout(arrays)


def _scaler_state_dict(scenario, scale: float, tracker: int) -> dict:
  """torch's five ``state_dict`` keys for this scenario's hyperparameters."""
  s = scenario.scaler
  return {
    "scale": scale,
    "growth_factor": s.get("growth_factor", 2.0),
    "backoff_factor": s.get("backoff_factor", 0.5),
    "growth_interval": s.get("growth_interval", 2000),
    "_growth_tracker": tracker,
  }


def _labels(scenario, pair: Pair) -> Any:
  """A params-shaped tree of labels ``opt<i>``, one per torch optimizer."""
  labels = {}
  for i, spec in enumerate(scenario.optimizers):
    for name in owned(spec, pair):
      labels[name] = f"opt{i}"
  return pair.tree_of(labels)


def _inner(scenario, pair: Pair) -> tuple[Any, Any]:
  """What the wrapper wraps, and its ``param_labels``: one transformation, or,
  for several torch optimizers, ``{label: tx}`` with the labels (torch's
  per-optimizer skip)."""
  if len(scenario.optimizers) > 1:
    if scenario.clip is not None:
      raise ValueError(f"{scenario.name}: clipping with several optimizers is not paired")
    groups = {f"opt{i}": make_single_optax(spec) for i, spec in enumerate(scenario.optimizers)}
    return groups, _labels(scenario, pair)
  inner = make_optax(scenario.optimizers, pair)
  if scenario.clip is not None:
    # torch.nn.utils.clip_grad_norm_ after unscale_: clipping sees unscaled grads.
    clip = jaxamp.ops.clip_by_torch_norm if scenario.clip_torch else optax.clip_by_global_norm
    inner = optax.chain(clip(scenario.clip), inner)
  return inner, None


def _inner_tx(scenario, pair: Pair) -> optax.GradientTransformation:
  """The transformation whose state is the wrapper's ``inner_state``."""
  inner, labels = _inner(scenario, pair)
  return inner if labels is None else optax.multi_transform(inner, labels)


def _is_scale_state(x: Any) -> bool:
  return isinstance(x, jaxamp.DynamicLossScaleState)


def _replace_scale_state(opt_state: Any, **fields) -> Any:
  """``opt_state`` with fields of its ``DynamicLossScaleState`` replaced."""
  return jax.tree.map(
    lambda x: x._replace(**fields) if _is_scale_state(x) else x,
    opt_state,
    is_leaf=_is_scale_state,
  )


class OptaxDriver:
  """``jaxamp.dynamic_loss_scale`` around the paired optax optimizer.

  The optax wrapper has no ``update(new_scale=...)``; a scripted new scale is
  written into the state after the update, with the growth tracker the step
  started with (torch's ``update(new_scale)`` leaves the tracker alone).
  """

  def __init__(self, scenario, pair: Pair):
    self.scenario, self.pair = scenario, pair
    _nonfinite_only(scenario)
    self.n_optimizers = len(scenario.optimizers)
    inner, labels = _inner(scenario, pair)
    options = dict(scenario.jaxamp_options)
    if labels is not None:
      options["param_labels"] = labels
    self.tx = jaxamp.dynamic_loss_scale(inner, **scenario.scaler, **options)
    if scenario.accumulate > 1:  # torch's .grad accumulation, one scale update per window
      if scenario.resume is not None:
        raise ValueError(f"{scenario.name}: resuming with accumulation is not paired")
      self.tx = jaxamp.accumulate_gradients(self.tx, scenario.accumulate)
    # Which optimizer each gradient leaf belongs to (jax.tree.leaves order).
    owner = {n: i for i, spec in enumerate(scenario.optimizers) for n in owned(spec, pair)}
    self._leaf_owner = [owner[n] for n in jax.tree.leaves(pair.tree_of({n: n for n in owner}))]
    self.params = pair.params
    self.opt_state = self.tx.init(self.params)
    if scenario.initial_tracker is not None:
      self.opt_state = jaxamp.load_state_dict(
        self.opt_state,
        _scaler_state_dict(
          scenario,
          float(scenario.scaler.get("init_scale", 2.0**16)),
          scenario.initial_tracker,
        ),
      )

    def scaled_grads(params, opt_state, batch):
      loss_fn = _loss_fn(
        scenario,
        pair,
        lambda: jaxamp.get_loss_scale(opt_state),
        lambda loss: jaxamp.scale_loss(loss, opt_state),
      )

      def scaled_loss(p):
        loss = loss_fn(p, batch)
        return jaxamp.scale_loss(loss, opt_state), loss

      (_, loss), grads = jax.value_and_grad(scaled_loss, has_aux=True)(params)
      return grads, loss

    def apply(grads, opt_state, params):
      if scenario.accumulate > 1:  # jaxamp's fast path for accumulation
        return jaxamp.apply_scaled_updates(self.tx, grads, opt_state, params)
      updates, opt_state = self.tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    self._scaled_grads = jax.jit(scaled_grads)
    self._apply = jax.jit(apply)
    self._unscale = jax.jit(jaxamp.ops.unscale_and_check)
    if pair.stages:
      _check_staged(scenario, pair)
      self._names = pair.tree_of({n: n for n in pair.names})

      def stage_grads(params, opt_state, batch, stage):
        def scaled_loss(p):
          loss = pair.stages[stage][1](p, batch)
          return jaxamp.scale_loss(loss, opt_state), loss

        (_, loss), grads = jax.value_and_grad(scaled_loss, has_aux=True)(params)
        return grads, loss

      def apply_stage(grads, opt_state, params, update_scale):
        # update_scale=False but for the last stage: torch's step() without update().
        updates, opt_state = self.tx.update(grads, opt_state, params, update_scale=update_scale)
        new = jax.tree.map(lambda p, u: p if u is None else p + u, params, updates)
        return new, opt_state

      self._stage_grads = jax.jit(stage_grads, static_argnums=3)
      self._apply_stage = jax.jit(apply_stage, static_argnums=3)

  def _scale_state(self) -> jaxamp.DynamicLossScaleState:
    return jaxamp.ops.find_loss_scale_state(self.opt_state)

  def _record(self, losses, scale_used, found, state) -> dict[str, Any]:
    """One iteration's record, from the scale state read after it."""
    return {
      "loss": float(np.mean(losses)),
      "scale_used": scale_used,
      "found": found,
      "scale": np.asarray(state.loss_scale),
      "tracker": int(state.growth_tracker),
      "params": self.pair.to_torch_layout(jax.device_get(self.params)),
    }

  def _staged_step(self, step: int) -> dict[str, Any]:
    """Each stage: the gradients of its scaled loss at the current params,
    ``None`` for the other optimizers' leaves, ``tx.update(...,
    update_scale=False)``; the last stage's update advances the scale."""
    sc, batch = self.scenario, self.pair.batch(step)
    scale_used = np.asarray(jaxamp.get_loss_scale(self.opt_state))
    losses, found = [], []
    for stage in range(len(self.pair.stages)):
      grads, loss = self._stage_grads(self.params, self.opt_state, batch, stage)
      losses.append(float(loss))
      names = _stage_names(sc, self.pair, stage)
      grads = _inject(self.pair, grads, [i for i in sc.inject.get(step, ()) if i[0] in names])
      grads = jax.tree.map(lambda g, n, names=names: g if n in names else None, grads, self._names)
      last = stage == len(self.pair.stages) - 1
      self.params, self.opt_state = self._apply_stage(grads, self.opt_state, self.params, last)
      state = jax.device_get(self._scale_state())
      # This iteration's flags of the stage's own leaves (a finite iteration keeps older ones).
      own = [bool(f) for f, o in zip(state.nonfinite_leaves, self._leaf_owner) if o == stage]
      found.append(bool(state.found_inf) and any(own))
    return self._record(losses, scale_used, found, state)

  def step(self, step: int) -> dict[str, Any]:
    if self.pair.stages:
      return self._staged_step(step)
    sc = self.scenario
    scale_used = np.asarray(jaxamp.get_loss_scale(self.opt_state))
    tracker_before = self._scale_state().growth_tracker
    losses = []
    # One call of the transformation per micro-batch; with accumulate_gradients
    # the inner update runs on the window's last.
    for micro in range(sc.accumulate):
      grads, loss = self._scaled_grads(
        self.params, self.opt_state, self.pair.batch(step * sc.accumulate + micro)
      )
      losses.append(float(loss))
      injections = sc.micro_inject.get((step, micro), ())
      if micro == sc.accumulate - 1:
        injections = (*injections, *sc.inject.get(step, ()))
      grads = _inject(self.pair, grads, injections)
      self.params, self.opt_state = self._apply(grads, self.opt_state, self.params)
    new_scale = sc.new_scale.get(step)
    if new_scale is not None:
      self.opt_state = _replace_scale_state(
        self.opt_state,
        loss_scale=jnp.asarray(np.float32(new_scale)),
        growth_tracker=tracker_before,
      )
    state = jax.device_get(self._scale_state())
    found = [bool(state.found_inf)] * self.n_optimizers
    if self.n_optimizers > 1:  # param_labels: each group skips on its own leaves
      found = [
        bool(state.found_inf)
        and any(bool(flag) for flag, o in zip(state.nonfinite_leaves, self._leaf_owner) if o == i)
        for i in range(self.n_optimizers)
      ]
    return self._record(losses, scale_used, found, state)

  def unscale_torch_grads(self, scaled: dict, scale: np.float32):
    """``jaxamp.ops.unscale_and_check`` on torch's scaled gradients."""
    present = {n: v for n, v in scaled.items() if v is not None}
    grads = {n: jnp.asarray(v) for n, v in present.items()}
    unscaled, found = self._unscale(grads, jnp.asarray(scale, jnp.float32))
    return jax.device_get(unscaled), bool(found)

  def state(self) -> dict:
    return jax_state(self._scale_state().inner_state, self.pair)

  def checkpoint(self) -> dict:
    """A torch-style checkpoint (scaler state_dict, params, optimizer state)."""
    s = self.scenario.scaler
    hyper = {k: s[k] for k in ("growth_factor", "backoff_factor", "growth_interval") if k in s}
    return {
      "scaler": jaxamp.state_dict(self._scale_state(), **hyper),
      "params": self.pair.to_torch_layout(jax.device_get(self.params)),
      "optimizer": self.state(),
    }

  def resume(self, checkpoint: dict) -> None:
    """Continues from a torch checkpoint: fresh state, then the saved values."""
    params = self.pair.from_torch_layout(checkpoint["params"])
    fresh = self.tx.init(params)
    inner = jax_inner_state_from_torch(
      _inner_tx(self.scenario, self.pair), params, self.pair, checkpoint["optimizer"]
    )
    self.params = params
    self.opt_state = jaxamp.load_state_dict(fresh._replace(inner_state=inner), checkpoint["scaler"])


class GradScalerDriver:
  """``jaxamp.GradScaler`` and one ``jaxamp.Optimizer`` per torch optimizer.

  Each optimizer holds only the parameters its torch twin owns, as a flat
  ``{torch_name: leaf}`` dict, so skip decisions are per optimizer as in torch.
  Clipping is done between ``unscale_`` and ``step`` with optax's global-norm
  formula, or torch's (``jaxamp.clip_grad_norm``), as a torch user calls
  ``clip_grad_norm_`` there. Accumulation: ``zero_grad(set_to_none=False)``,
  then ``opt.accumulate`` per micro-batch.
  """

  def __init__(self, scenario, pair: Pair):
    self.scenario, self.pair = scenario, pair
    _nonfinite_only(scenario)
    self.scaler = jaxamp.GradScaler(**scenario.scaler, **scenario.jaxamp_options)
    if scenario.initial_tracker is not None:
      self.scaler.load_state_dict(
        _scaler_state_dict(
          scenario,
          float(scenario.scaler.get("init_scale", 2.0**16)),
          scenario.initial_tracker,
        )
      )
    self.layouts = [NamedLayout(pair, owned(spec, pair)) for spec in scenario.optimizers]
    self.optimizers = [
      jaxamp.Optimizer(make_single_optax(spec), layout.take(pair.params))
      for spec, layout in zip(scenario.optimizers, self.layouts)
    ]

    def scaled_grads(scaler, params, batch):
      # get_scale() inside jit is the traced scale (the penalty's 1 / get_scale()).
      loss_fn = _loss_fn(scenario, pair, scaler.get_scale, scaler.scale)

      def scaled_loss(p):
        loss = loss_fn(p, batch)
        return scaler.scale(loss), loss

      (_, loss), grads = jax.value_and_grad(scaled_loss, has_aux=True)(params)
      return grads, loss, scaler

    def accumulate(optimizers, grads):
      for opt, layout in zip(optimizers, self.layouts):
        opt.accumulate(layout.take(grads))
      return optimizers

    def iterate(scaler, optimizers, grads, update, late_inject, unstepped):
      if grads is not None:  # None: accumulated into opt.grads already
        for opt, layout in zip(optimizers, self.layouts):
          opt.grads = layout.take(grads)
      if scenario.clip is not None or scenario.explicit_unscale:
        for opt in optimizers:
          scaler.unscale_(opt)
      for name, position, value in late_inject:
        for opt in optimizers:
          if name in opt.grads:
            g = opt.grads[name]
            opt.grads = {**opt.grads, name: g.reshape(-1).at[position].set(value).reshape(g.shape)}
      if scenario.clip is not None and scenario.clip_torch:
        clipped, _ = jaxamp.clip_grad_norm([opt.grads for opt in optimizers], scenario.clip)
        for opt, g in zip(optimizers, clipped):
          opt.grads = g
      elif scenario.clip is not None:
        clip = optax.clip_by_global_norm(scenario.clip)
        clipped, _ = clip.update([opt.grads for opt in optimizers], clip.init(None))
        for opt, g in zip(optimizers, clipped):
          opt.grads = g
      for i, opt in enumerate(optimizers):
        if i not in unstepped:
          scaler.step(opt)
      found = [_found_inf(scaler, opt) for opt in optimizers]
      if update:
        scaler.update()
      return scaler, optimizers, found

    self._scaled_grads = jax.jit(scaled_grads)
    self._accumulate = jax.jit(accumulate)
    self._iterate = jax.jit(iterate, static_argnums=(3, 4, 5))
    if pair.stages:
      _check_staged(scenario, pair)

      def stage_grads(scaler, params, batch, stage):
        def scaled_loss(p):
          loss = pair.stages[stage][1](p, batch)
          return scaler.scale(loss), loss

        (_, loss), grads = jax.value_and_grad(scaled_loss, has_aux=True)(params)
        return grads, loss, scaler

      def step_stage(scaler, optimizers, grads, stage, update):
        opt = optimizers[stage]
        opt.grads = self.layouts[stage].take(grads)
        scaler.step(opt)
        found = _found_inf(scaler, opt)
        if update:
          scaler.update()
        return scaler, optimizers, found

      self._stage_grads = jax.jit(stage_grads, static_argnums=3)
      self._step_stage = jax.jit(step_stage, static_argnums=(3, 4))

  def _full_params(self) -> Any:
    named = {}
    for opt in self.optimizers:
      named.update(opt.params)
    return self.pair.tree_of(named)

  def _staged_step(self, step: int) -> dict[str, Any]:
    """torch's loop: per stage ``opt.zero_grad()``, the gradients of
    ``scaler.scale(loss)`` at the current params, ``scaler.step(opt)``; one
    ``scaler.update()`` after the last."""
    sc, batch = self.scenario, self.pair.batch(step)
    self._scaler_used = self.scaler
    scale_used = np.float32(self.scaler.get_scale())
    losses, found = [], []
    for stage, opt in enumerate(self.optimizers):
      opt.zero_grad()
      grads, loss, self.scaler = self._stage_grads(self.scaler, self._full_params(), batch, stage)
      losses.append(float(loss))
      names = _stage_names(sc, self.pair, stage)
      grads = _inject(self.pair, grads, [i for i in sc.inject.get(step, ()) if i[0] in names])
      last = stage == len(self.optimizers) - 1
      self.scaler, self.optimizers, flag = self._step_stage(
        self.scaler, self.optimizers, grads, stage, last
      )
      found.append(bool(flag))
    return {
      "loss": float(np.mean(losses)),
      "scale_used": scale_used,
      "found": found,
      "scale": np.float32(self.scaler.get_scale()),
      "tracker": self.scaler._get_growth_tracker(),
      "params": self._params_torch_layout(),
    }

  def step(self, step: int) -> dict[str, Any]:
    if self.pair.stages:
      return self._staged_step(step)
    sc = self.scenario
    accumulating = sc.accumulate > 1
    for opt in self.optimizers:
      opt.zero_grad(set_to_none=not accumulating)
    for name, value in sc.setters.get(step, {}).items():
      getattr(self.scaler, f"set_{name}")(value)
    params = self._full_params()
    grads, losses = None, []
    for micro in range(sc.accumulate):
      grads, loss, self.scaler = self._scaled_grads(
        self.scaler, params, self.pair.batch(step * sc.accumulate + micro)
      )
      losses.append(float(loss))
      injections = sc.micro_inject.get((step, micro), ())
      if micro == sc.accumulate - 1:
        injections = (*injections, *sc.inject.get(step, ()))
      grads = _inject(self.pair, grads, injections)
      if accumulating:  # each backward adds into .grad
        self.optimizers = self._accumulate(self.optimizers, grads)
        grads = None
    scale_used = np.float32(self.scaler.get_scale())
    new_scale = sc.new_scale.get(step)
    self._scaler_used = self.scaler  # the jitted iteration returns a new scaler
    late = tuple(
      (name, self.pair.flax_position(name, index), value)
      for name, index, value in sc.late_inject.get(step, ())
    )
    self.scaler, self.optimizers, found = self._iterate(
      self.scaler,
      self.optimizers,
      grads,
      new_scale is None,
      late,
      tuple(sc.unstepped.get(step, ())),
    )
    if new_scale is not None:
      self.scaler.update(new_scale=float(new_scale))
    return {
      "loss": float(np.mean(losses)),
      "scale_used": scale_used,
      "found": [None if f is None else bool(f) for f in found],
      "scale": np.float32(self.scaler.get_scale()),
      "tracker": self.scaler._get_growth_tracker(),
      "params": self._params_torch_layout(),
    }

  def _params_torch_layout(self) -> dict:
    out = {}
    for opt, layout in zip(self.optimizers, self.layouts):
      out.update(layout.to_torch_layout(jax.device_get(opt.params)))
    return out

  def unscale_torch_grads(self, scaled: dict, scale: np.float32):
    """``GradScaler.unscale_`` on torch's scaled gradients, in a copy of the
    scaler as it was before this step's update.

    ``scale`` is torch's; the copy unscales with its own scale, which the
    scale comparison checks to be bit-equal to it.
    """
    del scale
    scaler = jax.tree.map(lambda x: x, self._scaler_used)
    unscaled, found = {}, False
    for layout in self.layouts:
      if not all(name in scaled for name in layout.names):
        continue  # an optimizer torch left untouched this step
      grads = layout.from_torch_layout(scaled)
      probe = jaxamp.Optimizer(optax.identity(), grads, grads=grads)
      scaler.unscale_(probe)
      unscaled.update(layout.to_torch_layout(jax.device_get(probe.grads)))
      found = found or _found_inf(scaler, probe)
    return unscaled, bool(found)

  def state(self) -> dict:
    merged: dict = {}
    for opt, layout in zip(self.optimizers, self.layouts):
      for kind, values in jax_state(opt.opt_state, layout).items():
        merged.setdefault(kind, {}).update(values)
    return merged

  def checkpoint(self) -> dict:
    return {
      "scaler": self.scaler.state_dict(),
      "params": self._params_torch_layout(),
      "optimizer": self.state(),
    }

  def resume(self, checkpoint: dict) -> None:
    """A fresh ``jaxamp.GradScaler()`` and fresh optimizers loaded from a torch checkpoint."""
    self.scaler = jaxamp.GradScaler()
    self.scaler.load_state_dict(checkpoint["scaler"])
    self.optimizers = []
    for spec, layout in zip(self.scenario.optimizers, self.layouts):
      tx = make_single_optax(spec)
      params = layout.from_torch_layout(checkpoint["params"])
      opt_state = jax_inner_state_from_torch(tx, params, layout, checkpoint["optimizer"])
      self.optimizers.append(jaxamp.Optimizer(tx, params, opt_state=opt_state))


def _found_inf(scaler, optimizer) -> Any:
  """The found_inf ``scaler`` recorded for ``optimizer`` this iteration (private
  state, read as torch's ``_per_optimizer_states`` is); False when disabled,
  None when the optimizer recorded none (neither unscaled nor stepped)."""
  if not scaler.is_enabled():
    return False
  record = scaler._states.get(optimizer._key)
  return None if record is None else record.found_inf


def make(api: str, scenario, pair: Pair):
  if api == "optax":
    return OptaxDriver(scenario, pair)
  if api == "grad_scaler":
    return GradScalerDriver(scenario, pair)
  raise ValueError(f"unknown api {api!r}")
