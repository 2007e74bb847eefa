"""A training run that checkpoints with orbax and can be killed: the child of tests/test_crash_resume.py.

Run as ``python tests/crash_resume_worker.py VARIANT CKPT_DIR LOG [--pause-at K] [--die-in-save S]``.

VARIANT is one of ``nnx`` (``nnx.Optimizer`` + ``flax_utils.update``), ``linen``
(``TrainState`` + ``flax_utils.apply_gradients``) and ``scaler`` (``jaxamp.GradScaler``
+ ``jaxamp.Optimizer``). Steps are numbered 1..STEPS; after step ``s`` with
``s % SAVE_EVERY == 0`` the whole training state is saved as orbax step ``s``
through ``ocp.CheckpointManager``. On start the run resumes from
``manager.latest_step()`` if there is one (restoring into an abstract target
built like the fresh state), else starts fresh.

The log (JSON lines, flushed at once, so a SIGKILL loses nothing written) gets
one ``step`` record per step: the loss-scale fields, the skip decision and the
bytes of every leaf of the training state (params, optimizer state, scale,
trackers, counters). ``saved`` records follow a committed save, ``restored``
the restore, ``paused`` the point where the parent is to SIGKILL it.

``--pause-at K``: in the middle of step K (the update computed, not yet logged
or saved), log ``paused`` and wait to be killed.
``--die-in-save S``: SIGKILL itself inside orbax's save of step S, after every
file of the checkpoint is written, at the commit (the rename of the temporary
directory onto its final name).

What the GradScaler variant saves: its torch-format ``state_dict()`` (five keys,
as JSON: loadable by torch) and the scaler's pytree leaves, which are the whole
loss-scale core (scale, growth tracker, hysteresis tracker, found_inf,
update_count, skipped and consecutive skipped updates): torch's state_dict has
neither the counters nor the hysteresis tracker, so loading it alone would not
resume exactly. Restored as: a fresh scaler built with the same options,
``load_state_dict(saved)``, then the saved leaves unflattened into its structure.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import jaxamp

STEPS = 40
SAVE_EVERY = 5
# Gradient multipliers at fixed steps (1 elsewhere): single overflows, NaNs and
# bursts, so that with hysteresis 2 some overflows are absorbed and some back off.
INJECT = {
  2: np.inf,
  3: np.inf,
  4: np.nan,
  9: np.inf,
  14: np.nan,
  15: np.inf,
  16: np.inf,
  22: np.inf,
  27: np.nan,
  28: np.nan,
  29: np.inf,
  33: np.inf,
  36: np.nan,
  37: np.inf,
}
OPTIONS = {"init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3}
EXTRA = {"hysteresis": 2}
IN, HIDDEN, OUT, BATCH = 6, 16, 3, 8


def batch(step: int):
  rng = np.random.default_rng(1000 + step)
  x = rng.normal(size=(BATCH, IN)).astype(np.float32) * 4.0
  y = rng.normal(size=(BATCH, OUT)).astype(np.float32)
  return jnp.asarray(x), jnp.asarray(y), jnp.float32(INJECT.get(step, 1.0))


def bits(tree) -> list[str]:
  return [np.asarray(leaf).tobytes().hex() for leaf in jax.tree.leaves(tree)]


SCALARS = (
  "loss_scale",
  "growth_tracker",
  "found_inf",
  "skipped_steps",
  "consecutive_skipped_steps",
  "hysteresis_tracker",
  "update_count",
)


def scalars(state) -> dict:
  """The loss-scale fields as Python values (nnx variables unwrapped)."""
  get = state.get if isinstance(state, dict) else lambda k: getattr(state, k)
  return {k: np.asarray(jax.tree.leaves(get(k))[0]).item() for k in SCALARS}


def tx():
  return jaxamp.dynamic_loss_scale(optax.adam(1e-2), **OPTIONS, **EXTRA)


# -- nnx --------------------------------------------------------------------------


def nnx_variant():
  from flax import nnx

  from jaxamp import flax_utils

  class MLP(nnx.Module):
    def __init__(self, rngs):
      kw = {"dtype": jnp.float16, "param_dtype": jnp.float32, "rngs": rngs}
      self.l1 = nnx.Linear(IN, HIDDEN, **kw)
      self.l2 = nnx.Linear(HIDDEN, OUT, **kw)

    def __call__(self, x):
      return self.l2(jax.nn.relu(self.l1(x)))

  def fresh():
    model = MLP(nnx.Rngs(0))
    return model, nnx.Optimizer(model, tx(), wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, x, y, inject):
    def loss_fn(model):
      return jnp.mean((model(x).astype(jnp.float32) - y) ** 2)

    loss, grads = flax_utils.scaled_value_and_grad(loss_fn, optimizer)(model)
    grads = jax.tree.map(lambda g: g * inject, grads)
    flax_utils.update(optimizer, model, grads)
    return loss

  class Run:
    def __init__(self):
      self.model, self.optimizer = fresh()

    def step(self, x, y, inject):
      train_step(self.model, self.optimizer, x, y, inject)

    def loss_scale_state(self):
      return jaxamp.ops.find_loss_scale_state(self.optimizer)

    def tree(self):
      return {"model": nnx.state(self.model), "optimizer": nnx.state(self.optimizer)}

    def save_args(self):
      return ocp.args.StandardSave(self.tree())

    def restore(self, manager, step):
      abstract_model, abstract_optimizer = nnx.eval_shape(fresh)
      model_def, model_state = nnx.split(abstract_model)
      optimizer_def, optimizer_state = nnx.split(abstract_optimizer)
      target = {"model": model_state, "optimizer": optimizer_state}
      restored = manager.restore(step, args=ocp.args.StandardRestore(target))
      self.model = nnx.merge(model_def, restored["model"])
      self.optimizer = nnx.merge(optimizer_def, restored["optimizer"])
      return {}

  return Run()


# -- linen ------------------------------------------------------------------------


def linen_variant():
  import flax.linen as nn
  from flax.training import train_state

  from jaxamp import flax_utils

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      kw = {"dtype": jnp.float16, "param_dtype": jnp.float32}
      return nn.Dense(OUT, **kw)(jax.nn.relu(nn.Dense(HIDDEN, **kw)(x)))

  model = MLP()

  def fresh():
    params = model.init(jax.random.key(0), jnp.zeros((BATCH, IN)))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx())

  @jax.jit
  def train_step(state, x, y, inject):
    def loss_fn(params):
      return jnp.mean((state.apply_fn({"params": params}, x).astype(jnp.float32) - y) ** 2)

    loss, grads = flax_utils.scaled_value_and_grad(loss_fn, state)(state.params)
    grads = jax.tree.map(lambda g: g * inject, grads)
    return flax_utils.apply_gradients(state, grads=grads), loss

  class Run:
    def __init__(self):
      self.state = fresh()

    def step(self, x, y, inject):
      self.state, _ = train_step(self.state, x, y, inject)

    def loss_scale_state(self):
      return jaxamp.ops.find_loss_scale_state(self.state)

    def tree(self):
      return self.state

    def save_args(self):
      return ocp.args.StandardSave(self.state)

    def restore(self, manager, step):
      # The target gives the structure (the state's static `config` included:
      # it has no leaves, so it is not in the checkpoint) and apply_fn/tx.
      target = jax.eval_shape(fresh)
      self.state = manager.restore(step, args=ocp.args.StandardRestore(target))
      return {}

  return Run()


# -- GradScaler -----------------------------------------------------------------------


def scaler_variant():
  def loss_fn(params, x, y):
    h = jax.nn.relu(x.astype(jnp.float16) @ params["w1"].astype(jnp.float16) + params["b1"])
    out = h @ params["w2"].astype(jnp.float16) + params["b2"]
    return jnp.mean((out.astype(jnp.float32) - y) ** 2)

  def fresh_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
      "w1": jax.random.normal(k1, (IN, HIDDEN)) / 3,
      "b1": jnp.zeros(HIDDEN),
      "w2": jax.random.normal(k2, (HIDDEN, OUT)) / 3,
      "b2": jnp.zeros(OUT),
    }

  def fresh_scaler():
    return jaxamp.GradScaler(**OPTIONS, **EXTRA)

  @jax.jit
  def train_step(scaler, opt, x, y, inject):
    opt.zero_grad()
    grads = jax.grad(lambda p: scaler.scale(loss_fn(p, x, y)))(opt.params)
    opt.grads = jax.tree.map(lambda g: g * inject, grads)
    scaler.step(opt)
    scaler.update()
    return scaler, opt

  inner = optax.adam(1e-2)

  class Run:
    def __init__(self):
      self.scaler = fresh_scaler()
      self.opt = jaxamp.Optimizer(inner, fresh_params())

    def step(self, x, y, inject):
      self.scaler, self.opt = train_step(self.scaler, self.opt, x, y, inject)

    def loss_scale_state(self):
      s = self.scaler
      return {
        "loss_scale": s.loss_scale,
        "growth_tracker": s.growth_tracker,
        "found_inf": jax.tree.leaves(s)[3],  # LossScaleCore order; checked in tree()
        "skipped_steps": s.skipped_updates,
        "consecutive_skipped_steps": s.consecutive_skipped_updates,
        "hysteresis_tracker": s.hysteresis_tracker,
        "update_count": s.update_count,
      }

    def tree(self):
      leaves = jax.tree.leaves(self.scaler)
      assert len(leaves) == 7, "after update() the scaler's leaves are its core"
      return {
        "scaler_leaves": list(leaves),
        "params": self.opt.params,
        "opt_state": self.opt.opt_state,
        "nonfinite_leaves": self.opt.nonfinite_leaves,
      }

    def save_args(self):
      return ocp.args.Composite(
        state=ocp.args.StandardSave(self.tree()),
        scaler_state_dict=ocp.args.JsonSave(self.scaler.state_dict()),
      )

    def restore(self, manager, step):
      abstract = jax.eval_shape(lambda: Run().tree())
      restored = manager.restore(
        step,
        args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract),
          scaler_state_dict=ocp.args.JsonRestore(),
        ),
      )
      saved_sd, state = restored["scaler_state_dict"], restored["state"]
      scaler = fresh_scaler()
      scaler.load_state_dict(saved_sd)
      by_state_dict_only = {
        "update_count": int(scaler.update_count),
        "skipped_updates": int(scaler.skipped_updates),
        "hysteresis_tracker": int(scaler.hysteresis_tracker),
      }
      self.scaler = jax.tree.unflatten(jax.tree.structure(scaler), state["scaler_leaves"])
      self.opt = jaxamp.Optimizer(inner, state["params"], opt_state=state["opt_state"])
      self.opt.nonfinite_leaves = state["nonfinite_leaves"]
      assert self.scaler.state_dict() == saved_sd
      return {"saved_state_dict": saved_sd, "by_state_dict_only": by_state_dict_only}

  return Run()


VARIANTS = {"nnx": nnx_variant, "linen": linen_variant, "scaler": scaler_variant}


def _die_at_commit_of(step: int) -> None:
  """SIGKILL this process when orbax commits (renames into place) checkpoint ``step``."""
  from orbax.checkpoint._src.path import async_path

  rename = async_path.rename

  async def killing_rename(src, dst):
    if os.path.basename(str(dst)) == str(step):
      log_line({"event": "dying_in_save", "step": step, "tmp": str(src)})
      os.kill(os.getpid(), signal.SIGKILL)
    return await rename(src, dst)

  async_path.rename = killing_rename


_LOG = None


def log_line(record) -> None:
  _LOG.write(json.dumps(record) + "\n")
  _LOG.flush()


def main(argv) -> None:
  global _LOG
  variant, ckpt_dir, log_path = argv[:3]
  flags = dict(zip(argv[3::2], (int(v) for v in argv[4::2])))
  pause_at, die_in_save = flags.get("--pause-at"), flags.get("--die-in-save")
  with open(log_path, "a") as _LOG:
    _run(variant, ckpt_dir, pause_at, die_in_save)


def _run(variant, ckpt_dir, pause_at, die_in_save) -> None:
  if die_in_save is not None:
    _die_at_commit_of(die_in_save)
  run = VARIANTS[variant]()
  options = ocp.CheckpointManagerOptions(save_interval_steps=SAVE_EVERY)
  with ocp.CheckpointManager(os.path.abspath(ckpt_dir), options=options) as manager:
    start = manager.latest_step()
    if start is None:
      start = 0
      log_line({"event": "fresh", "all_steps": []})
    else:
      extra = run.restore(manager, start)
      log_line(
        {
          "event": "restored",
          "step": start,
          "all_steps": sorted(manager.all_steps()),
          "bits": bits(run.tree()),
          **extra,
        }
      )
    for step in range(start + 1, STEPS + 1):
      run.step(*batch(step))
      tree = run.tree()
      jax.block_until_ready(tree)
      if step == pause_at:
        log_line({"event": "paused", "step": step})
        time.sleep(600)
      fields = scalars(run.loss_scale_state())
      log_line({"event": "step", "step": step, **fields, "bits": bits(tree)})
      if step % SAVE_EVERY == 0:
        manager.save(step, args=run.save_args())
        manager.wait_until_finished()
        log_line({"event": "saved", "step": step})
  log_line({"event": "done"})


if __name__ == "__main__":
  main(sys.argv[1:])
