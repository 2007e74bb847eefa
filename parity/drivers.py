"""The jaxamp side of a scenario, one driver per public API.

``OptaxDriver`` uses ``jaxamp.dynamic_loss_scale`` as a user would: gradients
of ``jaxamp.scale_loss(loss, opt_state)``, then ``tx.update`` and
``optax.apply_updates``, both jitted. A scripted injection converts the JAX
gradients to torch's layout, writes the same value at the same place, and
converts back (transposes only, exact).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp
from parity.models import Pair
from parity.optimizers import jax_inner_state_from_torch, jax_state, make_optax


def _inner(scenario, pair: Pair) -> optax.GradientTransformation:
  inner = make_optax(scenario.optimizers, pair)
  if scenario.clip is not None:
    # torch.nn.utils.clip_grad_norm_ after unscale_: clipping sees unscaled grads.
    inner = optax.chain(optax.clip_by_global_norm(scenario.clip), inner)
  return inner


class OptaxDriver:
  """``jaxamp.dynamic_loss_scale`` around the paired optax optimizer.

  The optax wrapper has no ``update(new_scale=...)``; a scripted new scale is
  written into the state after the update, with the growth tracker the step
  started with (torch's ``update(new_scale)`` leaves the tracker alone).
  """

  def __init__(self, scenario, pair: Pair):
    self.scenario, self.pair = scenario, pair
    self.n_optimizers = len(scenario.optimizers)
    self.tx = jaxamp.dynamic_loss_scale(_inner(scenario, pair), **scenario.scaler)
    self.params = pair.params
    self.opt_state = self.tx.init(self.params)
    if scenario.initial_tracker is not None:
      self.opt_state = self.opt_state._replace(
          growth_tracker=jnp.asarray(scenario.initial_tracker, jnp.int32)
      )
    loss_fn = pair.jax_loss

    def scaled_grads(params, opt_state, batch):
      def scaled_loss(p):
        loss = loss_fn(p, batch)
        return jaxamp.scale_loss(loss, opt_state), loss

      (_, loss), grads = jax.value_and_grad(scaled_loss, has_aux=True)(params)
      return grads, loss

    def apply(grads, opt_state, params):
      updates, opt_state = self.tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    self._scaled_grads = jax.jit(scaled_grads)
    self._apply = jax.jit(apply)
    self._unscale = jax.jit(jaxamp.unscale_and_check)

  def step(self, step: int) -> dict[str, Any]:
    sc = self.scenario
    scale_used = np.asarray(jaxamp.get_loss_scale(self.opt_state))
    grads, losses = None, []
    for micro in range(sc.accumulate):
      g, loss = self._scaled_grads(
          self.params, self.opt_state, self.pair.batch(step * sc.accumulate + micro)
      )
      grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
      losses.append(float(loss))
    injections = sc.inject.get(step, ())
    if injections:
      arrays = self.pair.to_torch_layout(jax.device_get(grads))
      for name, index, value in injections:
        arrays[name] = arrays[name].copy()
        arrays[name].reshape(-1)[index] = value
      grads = self.pair.from_torch_layout(arrays)
    tracker_before = self.opt_state.growth_tracker
    self.params, self.opt_state = self._apply(grads, self.opt_state, self.params)
    new_scale = sc.new_scale.get(step)
    if new_scale is not None:
      self.opt_state = self.opt_state._replace(
          loss_scale=jnp.asarray(np.float32(new_scale)), growth_tracker=tracker_before
      )
    state = jax.device_get(self.opt_state)
    return {
        "loss": float(np.mean(losses)),
        "scale_used": scale_used,
        "found": [bool(state.found_inf)] * self.n_optimizers,
        "scale": np.asarray(state.loss_scale),
        "tracker": int(state.growth_tracker),
        "params": self.pair.to_torch_layout(jax.device_get(self.params)),
    }

  def unscale_torch_grads(self, scaled: dict, scale: np.float32):
    """``jaxamp.unscale_and_check`` on torch's scaled gradients."""
    present = {n: v for n, v in scaled.items() if v is not None}
    grads = {n: jnp.asarray(v) for n, v in present.items()}
    unscaled, found = self._unscale(grads, jnp.asarray(scale, jnp.float32))
    return jax.device_get(unscaled), bool(found)

  def state(self) -> dict:
    return jax_state(self.opt_state.inner_state, self.pair, self.scenario.optimizers)

  def checkpoint(self) -> dict:
    """A torch-style checkpoint (scaler state_dict, params, optimizer state)."""
    s = self.scenario.scaler
    return {
        "scaler": {
            "scale": float(self.opt_state.loss_scale),
            "growth_factor": s.get("growth_factor", 2.0),
            "backoff_factor": s.get("backoff_factor", 0.5),
            "growth_interval": s.get("growth_interval", 2000),
            "_growth_tracker": int(self.opt_state.growth_tracker),
        },
        "params": self.pair.to_torch_layout(jax.device_get(self.params)),
        "optimizer": self.state(),
    }

  def resume(self, checkpoint: dict) -> None:
    """Continues from a torch checkpoint: fresh state, then the saved values."""
    params = self.pair.from_torch_layout(checkpoint["params"])
    fresh = self.tx.init(params)
    inner = jax_inner_state_from_torch(
        _inner(self.scenario, self.pair), params, self.pair, checkpoint["optimizer"]
    )
    self.params = params
    self.opt_state = fresh._replace(
        loss_scale=jnp.asarray(np.float32(checkpoint["scaler"]["scale"])),
        growth_tracker=jnp.asarray(checkpoint["scaler"]["_growth_tracker"], jnp.int32),
        inner_state=inner,
    )


def make(api: str, scenario, pair: Pair):
  if api == "optax":
    return OptaxDriver(scenario, pair)
  raise ValueError(f"unknown api {api!r}")
