"""Many-device and many-process runs for ``tests/test_distributed.py``.

Each mode runs in a fresh Python process, so that ``XLA_FLAGS`` (8 fake CPU
devices) or ``jax.distributed.initialize`` apply before JAX starts. A run only
measures: it writes what it saw as JSON (scales, skip flags, float32 values as
exact Python floats, shardings, error messages) and the tests assert on it.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
    python tests/distributed_checks.py devices OUT.json
  python tests/distributed_checks.py jax-worker PROCESS_ID PORT OUT.json    # x2
  python tests/distributed_checks.py torch-worker RANK PORT OUT.json        # x2

The two-process scenario (both frameworks): torch fixture ``odd_factors``'s
scaler configuration and inf schedule, a 4-8-2 tanh MLP, SGD with momentum,
8 rows per step split 4 + 4 between the two processes, and the inf written into
a target of process 1's rows only.
"""

from __future__ import annotations

import contextlib
import json
import sys
import traceback

import numpy as np

CONFIG = {"init_scale": 3.0, "growth_factor": 1.5, "backoff_factor": 0.3, "growth_interval": 3}
STEPS = 19
INF_STEPS = (3, 9, 10, 11)  # as fixture "odd_factors"
LR, MOMENTUM = 0.05, 0.9
ROWS_PER_PROCESS = 4
TIMEOUT_S = 60


def init_params() -> dict[str, np.ndarray]:
  """The MLP's float32 weights in JAX layout (``x @ w1 + b1``)."""
  rng = np.random.default_rng(7)
  shapes = {"w1": (4, 8), "b1": (8,), "w2": (8, 2), "b2": (2,)}
  return {k: (0.5 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}


def batch(step: int, process: int) -> tuple[np.ndarray, np.ndarray]:
  """Rows ``4 * process ... 4 * process + 3`` of step ``step``'s global batch."""
  rng = np.random.default_rng(1000 + step)
  x = rng.standard_normal((2 * ROWS_PER_PROCESS, 4)).astype(np.float32)
  y = rng.standard_normal((2 * ROWS_PER_PROCESS, 2)).astype(np.float32)
  if step in INF_STEPS:
    y[ROWS_PER_PROCESS, 0] = np.inf  # the first row of process 1
  rows = slice(process * ROWS_PER_PROCESS, (process + 1) * ROWS_PER_PROCESS)
  return x[rows], y[rows]


def _floats(x) -> list:
  """float32 values as Python floats (exact, and exact through JSON)."""
  return np.asarray(x, np.float32).astype(np.float64).ravel().tolist()


def _spec(spec) -> str:
  """A PartitionSpec as text, trailing ``None`` dropped: ``P(None,)`` -> ``P()``."""
  axes = list(spec)
  while axes and axes[-1] is None:
    axes.pop()
  return "P(" + ", ".join(repr(a) for a in axes) + ("," if len(axes) == 1 else "") + ")"


def _replicated(spec) -> bool:
  return all(axis is None for axis in spec)


def _error(fn):
  """``{"type", "message"}`` of the exception ``fn()`` raises, or None."""
  try:
    fn()
  except Exception as error:  # noqa: BLE001 - the test reads type and text
    return {"type": type(error).__name__, "message": str(error)}
  return None


# --------------------------------------------------------------------------
# 8 devices in one process


def _devices_checks() -> dict:
  import jax
  import jax.numpy as jnp
  import optax
  from jax import lax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxamp

  assert jax.device_count() == 8, jax.devices()
  mesh = jax.make_mesh((8,), ("data",))  # Explicit axes (jax.make_mesh's default)
  auto_mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))  # Auto axes
  scaler = {"init_scale": 4.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2}
  inf_step, inf_index = 1, 10  # w[10] lives on device 5 (2 elements per device)

  def put(x, spec, on=mesh):
    return jax.device_put(jnp.asarray(x), NamedSharding(on, spec))

  def params(on=mesh):
    return {
      "w": put(np.linspace(-1, 1, 16, dtype=np.float32), P("data"), on),
      "m": put(np.arange(32, dtype=np.float32).reshape(8, 4) / 8, P("data", None), on),
      "r": put(np.array([1.0, 2.0, 3.0], np.float32), P(), on),
    }

  def grads(step, on=mesh):
    w = np.full(16, 0.25, np.float32) * scaler["init_scale"]
    if step == inf_step:
      w[inf_index] = np.inf
    return {
      "w": put(w, P("data"), on),
      "m": put(np.full((8, 4), -0.5, np.float32), P("data", None), on),
      "r": put(np.array([0.1, 0.2, 0.3], np.float32), P(), on),
    }

  def shards(x):
    """Per device (by id): the shard's values."""
    return {str(s.device.id): _floats(s.data) for s in x.addressable_shards}

  def sharding(x):
    if isinstance(x.sharding, NamedSharding):
      return _spec(x.sharding.spec)
    return type(x.sharding).__name__

  def specs(tree):
    return jax.tree.map(sharding, tree)

  scalars = (
    "loss_scale",
    "growth_tracker",
    "found_inf",
    "skipped_steps",
    "consecutive_skipped_steps",
  )

  def state_spec_strings(state):
    adam = state.inner_state[0]
    return {
      **{f: sharding(getattr(state, f)) for f in scalars},
      "mu": specs(adam.mu),
      "nu": specs(adam.nu),
    }

  def init(tx, p):
    with jax.set_mesh(mesh):
      return jax.jit(tx.init)(p)

  checks = {}

  def jit_sharded(on, in_mesh=False, **options):
    """The optax form under jit; ``in_mesh``: every step under ``jax.set_mesh``,
    where an Explicit axis makes each value's sharding part of its type."""
    tx = jaxamp.dynamic_loss_scale(optax.adam(0.1), **scaler, **options)
    p = params(on)
    if on is mesh:
      state = init(tx, p)  # Explicit axes: jit needs the mesh context
    else:
      state = jax.jit(tx.init)(p)

    @jax.jit
    def step(p, state, g):
      updates, state = tx.update(g, state, p)
      return optax.apply_updates(p, updates), updates, state

    out = {"param_specs": specs(p), "state_specs": state_spec_strings(state), "steps": []}
    for i in range(4):
      with jax.set_mesh(on) if in_mesh else contextlib.nullcontext():
        new_p, updates, new_state = step(p, state, grads(i, on))
      out["steps"].append(
        {
          "param_specs": specs(new_p),
          "update_specs": specs(updates),
          "state_specs": state_spec_strings(new_state),
          "state_scalars_fully_replicated": [
            getattr(new_state, f).sharding.is_fully_replicated for f in scalars
          ],
          "scale_per_device": shards(new_state.loss_scale),
          "found_inf": bool(new_state.found_inf),
          "params_before": {k: shards(v) for k, v in p.items()},
          "params_after": {k: shards(v) for k, v in new_p.items()},
          "mu_before": shards(state.inner_state[0].mu["w"]),
          "mu_after": shards(new_state.inner_state[0].mu["w"]),
        }
      )
      p, state = new_p, new_state
    return out

  def accumulate_in_mesh():
    """accumulate_gradients(dynamic_loss_scale(adam), 2) under jax.set_mesh, Explicit
    axes: the first window holds the inf (skipped), the second applies."""
    tx = jaxamp.accumulate_gradients(jaxamp.dynamic_loss_scale(optax.adam(0.1), **scaler), 2)
    p = params()
    state = init(tx, p)

    @jax.jit
    def step(p, state, g):
      updates, state = tx.update(g, state, p)
      return optax.apply_updates(p, updates), state

    after = []
    with jax.set_mesh(mesh):
      for i in range(4):  # grads(1) holds the inf
        p, state = step(p, state, grads(i))
        after.append({k: shards(v) for k, v in p.items()})
    return {"params_after": after, "specs": specs(p)}

  def shard_map_run(axis_name):
    """Per-device scale and found_inf stacked (out spec P('data')), params per shard."""
    tx = jaxamp.dynamic_loss_scale(optax.adam(0.1), axis_name=axis_name, **scaler)
    p = params()
    state = init(tx, p)
    state_specs = jax.tree.map(lambda x: x.sharding.spec, state)
    param_specs = jax.tree.map(lambda x: x.sharding.spec, p)

    def body(p, state, g):
      updates, state = tx.update(g, state, p)
      per_device = (state.loss_scale[None], state.found_inf[None], state.growth_tracker[None])
      return optax.apply_updates(p, updates), per_device, state

    # The state comes back per device (P('data') after stacking), since without
    # axis_name it really differs between devices.
    def stacked_body(p, state, g):
      new_p, per_device, state = body(p, state, g)
      return new_p, per_device, jax.tree.map(lambda x: x[None], state)

    step = jax.jit(
      jax.shard_map(
        stacked_body,
        mesh=mesh,
        in_specs=(param_specs, state_specs, param_specs),
        out_specs=(param_specs, P("data"), P("data")),
      )
    )
    out = {"steps": []}
    # Without axis_name the devices disagree after the inf step, so there is no
    # single state to continue with: that run is the inf step alone.
    for i in range(4) if axis_name is not None else [inf_step]:
      new_p, (scale, found, tracker), stacked = step(p, state, grads(i))
      out["steps"].append(
        {
          "scale_per_device": _floats(scale),
          "found_inf_per_device": np.asarray(found).tolist(),
          "tracker_per_device": np.asarray(tracker).tolist(),
          "params_before": {k: shards(v) for k, v in p.items() if k != "r"},
          "params_after": {k: shards(v) for k, v in new_p.items() if k != "r"},
        }
      )
      state = jax.tree.map(
        lambda x, old, s: put(
          np.asarray(x)[0] if _replicated(s) else np.asarray(x).reshape(old.shape), s
        ),
        stacked,
        state,
        state_specs,
      )
      p = new_p
    return out

  def shard_map_replicated_out(axis_name):
    """Whether out_specs P() for the state traces: JAX checks replication."""
    tx = jaxamp.dynamic_loss_scale(optax.adam(0.1), axis_name=axis_name, **scaler)
    p = params()
    state = init(tx, p)
    state_specs = jax.tree.map(lambda x: x.sharding.spec, state)
    param_specs = jax.tree.map(lambda x: x.sharding.spec, p)

    def body(p, state, g):
      updates, state = tx.update(g, state, p)
      return optax.apply_updates(p, updates), state

    step = jax.jit(
      jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(param_specs, state_specs, param_specs),
        out_specs=(param_specs, state_specs),
      )
    )
    result = {}
    result["error"] = _error(lambda: step(p, state, grads(inf_step)))
    if result["error"] is None:
      _, new_state = step(p, state, grads(inf_step))
      result["scale_per_device"] = shards(new_state.loss_scale)
    return result

  def shard_map_errors():
    p = params()
    param_specs = jax.tree.map(lambda x: x.sharding.spec, p)

    def run(tx, state_specs, state):
      def body(p, state, g):
        updates, state = tx.update(g, state, p)
        return optax.apply_updates(p, updates), state

      return jax.jit(
        jax.shard_map(
          body,
          mesh=mesh,
          in_specs=(param_specs, state_specs, param_specs),
          out_specs=(param_specs, state_specs),
        )
      )(p, state, grads(0))

    wrong = jaxamp.dynamic_loss_scale(optax.sgd(0.1), axis_name="model", **scaler)
    state = init(wrong, p)
    unbound = _error(lambda: run(wrong, jax.tree.map(lambda x: x.sharding.spec, state), state))
    # Per-device scales, as a shard_map run without axis_name would return them,
    # passed back with P('data'): each device gets its own scale.
    tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), axis_name="data", **scaler)
    state = init(tx, p)
    state_specs = jax.tree.map(lambda x: x.sharding.spec, state)
    per_device = state._replace(loss_scale=put(np.full(8, 4.0, np.float32), P("data")))
    per_device_specs = state_specs._replace(loss_scale=P("data"))

    def squeeze(s):
      return s._replace(loss_scale=s.loss_scale[0])

    def run_checked():
      def body(p, state, g):
        updates, state = tx.update(g, squeeze(state), p)
        return optax.apply_updates(p, updates), state.loss_scale

      return jax.jit(
        jax.shard_map(
          body,
          mesh=mesh,
          in_specs=(param_specs, per_device_specs, param_specs),
          out_specs=(param_specs, P()),
        )
      )(p, per_device, grads(0))

    return {"unbound_axis_in_shard_map": unbound, "state_varies": _error(run_checked)}

  def mesh_2d(axis_name):
    """A (4, 2) mesh, a (8, 4) weight sharded over both axes, inf on one device."""
    mesh2 = jax.make_mesh((4, 2), ("data", "model"))
    spec = P("data", "model")
    w = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh2, spec))
    g = np.full((8, 4), 0.5, np.float32)
    g[5, 3] = np.inf  # rows 4-5 -> data 2, columns 2-3 -> model 1
    g = jax.device_put(jnp.asarray(g), NamedSharding(mesh2, spec))
    tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), axis_name=axis_name, **scaler)
    with jax.set_mesh(mesh2):
      state = jax.jit(tx.init)(w)

    def body(w, state, g):
      _, state = tx.update(g, state, w)
      return state.loss_scale.reshape(1, 1), state.found_inf.reshape(1, 1)

    step = jax.jit(
      jax.shard_map(
        body,
        mesh=mesh2,
        in_specs=(spec, P(), spec),
        out_specs=(spec, spec),
      )
    )
    scale, found = step(w, state, g)
    return {"scale": np.asarray(scale).tolist(), "found_inf": np.asarray(found).tolist()}

  def shard_map_pmean_no_axis_name():
    """Replicated params, one row per device, gradients pmean-ed before the
    update, no axis_name; the inf is in device 5's row only."""
    tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), **scaler)
    w = put(np.ones(3, np.float32), P())
    state = init(tx, w)
    x = np.ones((8, 3), np.float32)
    x[5, 0] = np.inf

    def body(w, state, x):
      grads = jax.grad(lambda w: jaxamp.scale_loss(jnp.sum(w * x), state))(w)
      grads = lax.pmean(grads, "data")
      updates, state = tx.update(grads, state, w)
      return optax.apply_updates(w, updates), state

    new_w, new_state = jax.jit(
      jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(), P(), P("data")),
        out_specs=(P(), P()),
      )
    )(w, state, put(x, P("data")))
    return {
      "found_inf_per_device": [bool(s.data) for s in new_state.found_inf.addressable_shards],
      "scale_per_device": [float(s.data) for s in new_state.loss_scale.addressable_shards],
      "params_before": shards(w),
      "params_after": shards(new_w),
    }

  def pmap_run(axis_name):
    tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), axis_name=axis_name, **scaler)
    p = jnp.linspace(-1, 1, 16, dtype=jnp.float32).reshape(8, 2)
    g = np.full((8, 2), 1.0, np.float32)
    g[5, 1] = np.inf
    state = jax.pmap(tx.init, axis_name="data")(p)

    def body(p, state, g):
      updates, state = tx.update(g, state, p)
      return optax.apply_updates(p, updates), state

    new_p, new_state = jax.pmap(body, axis_name="data")(p, state, jnp.asarray(g))
    return {
      "scale_per_device": _floats(new_state.loss_scale),
      "found_inf_per_device": np.asarray(new_state.found_inf).tolist(),
      "params_before": _floats(p),
      "params_after": _floats(new_p),
    }

  def pmap_unbound():
    tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), axis_name="batch", **scaler)
    p = jnp.ones((8, 2))
    state = jax.pmap(tx.init)(p)
    return _error(lambda: jax.pmap(lambda p, s: tx.update(p, s, p), axis_name="data")(p, state))

  runs = {
    "jit_sharded": lambda: jit_sharded(mesh),
    "jit_sharded_auto_axes": lambda: jit_sharded(auto_mesh),
    "jit_sharded_in_mesh": lambda: jit_sharded(mesh, in_mesh=True),
    "accumulate_in_mesh": accumulate_in_mesh,
    # with the skip limit the step is a lax.cond, whose skipped branch makes zeros
    "jit_sharded_in_mesh_skip_limit": lambda: jit_sharded(
      mesh, in_mesh=True, max_consecutive_skips=3
    ),
    "shard_map_axis_name": lambda: shard_map_run("data"),
    "shard_map_no_axis_name": lambda: shard_map_run(None),
    "shard_map_replicated_out_axis_name": lambda: shard_map_replicated_out("data"),
    "shard_map_replicated_out_no_axis_name": lambda: shard_map_replicated_out(None),
    "shard_map_errors": shard_map_errors,
    "shard_map_pmean_no_axis_name": shard_map_pmean_no_axis_name,
    "mesh_2d_both_axes": lambda: mesh_2d(("data", "model")),
    "mesh_2d_data_axis_only": lambda: mesh_2d("data"),
    "pmap_axis_name": lambda: pmap_run("data"),
    "pmap_no_axis_name": lambda: pmap_run(None),
    "pmap_unbound": pmap_unbound,
  }
  for name, run in runs.items():
    try:
      checks[name] = {"ok": True, "result": run()}
    except Exception:  # noqa: BLE001 - reported per check, asserted by the test
      checks[name] = {"ok": False, "traceback": traceback.format_exc()}
  return {"jax": jax.__version__, "has_pmap": hasattr(jax, "pmap"), "checks": checks}


# --------------------------------------------------------------------------
# Two JAX processes (jax.distributed, gloo CPU collectives), one device each


def _jax_worker(process_id: int, port: int) -> dict:
  import jax

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=2,
    process_id=process_id,
    initialization_timeout=TIMEOUT_S,
    heartbeat_timeout_seconds=TIMEOUT_S,
    shutdown_timeout_seconds=TIMEOUT_S,
  )
  import jax.numpy as jnp
  import optax
  from jax import lax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxamp

  mesh = jax.make_mesh((2,), ("data",))
  rows = NamedSharding(mesh, P("data"))

  def global_array(local, sharding):
    return jax.make_array_from_process_local_data(sharding, local)

  def loss_fn(p, x, y):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)

  def local_values(tree):
    """This process's own shard of every leaf, in float32 values."""
    return {k: _floats(v.addressable_data(0)) for k, v in tree.items()}

  def record(state):
    return {
      "scale": float(state.loss_scale.addressable_data(0)),
      "tracker": int(state.growth_tracker.addressable_data(0)),
      "found_inf": bool(state.found_inf.addressable_data(0)),
      "skipped_steps": int(state.skipped_steps.addressable_data(0)),
    }

  def data_parallel_jit():
    """Replicated params, rows sharded over the processes, plain jax.jit."""
    tx = jaxamp.dynamic_loss_scale(optax.sgd(LR, momentum=MOMENTUM), **CONFIG)
    replicated = NamedSharding(mesh, P())
    params = {k: global_array(v, replicated) for k, v in init_params().items()}
    with jax.set_mesh(mesh):
      state = jax.jit(tx.init)(params)

    @jax.jit
    def step(params, state, x, y):
      grads = jax.grad(lambda p: jaxamp.scale_loss(loss_fn(p, x, y), state))(params)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    history = []
    for i in range(STEPS):
      x, y = batch(i, process_id)
      params_before = local_values(params)
      params, state = step(params, state, global_array(x, rows), global_array(y, rows))
      history.append(
        {**record(state), "params_before": params_before, "params_after": local_values(params)}
      )
    return {
      "history": history,
      "param_specs": {k: _spec(v.sharding.spec) for k, v in params.items()},
      "scale_spec": _spec(state.loss_scale.sharding.spec),
    }

  def sharded_shard_map(axis_name):
    """ZeRO-style: each process holds half of every parameter and its optimizer
    state; gradients are summed with psum_scatter, so each process sees only
    its half of them. The inf goes into process 1's local gradient of w1[0, 0],
    which lands in process 0's half."""
    tx = jaxamp.dynamic_loss_scale(optax.sgd(LR, momentum=MOMENTUM), axis_name=axis_name, **CONFIG)
    halves = {k: v.reshape(2, -1)[process_id].reshape(-1) for k, v in init_params().items()}
    shapes = {k: v.shape for k, v in init_params().items()}
    params = {k: global_array(v, rows) for k, v in halves.items()}  # flat, sharded
    with jax.set_mesh(mesh):
      state = jax.jit(tx.init)(params)
    state_specs = jax.tree.map(lambda x: x.sharding.spec, state)

    def body(params, state, x, y, inject):
      full = {
        k: lax.all_gather(v, "data", tiled=True).reshape(shapes[k]) for k, v in params.items()
      }
      grads = jax.grad(lambda p: jaxamp.scale_loss(loss_fn(p, x, y), state))(full)
      grads["w1"] = grads["w1"].at[0, 0].set(jnp.where(inject[0], jnp.inf, grads["w1"][0, 0]))
      grads = {k: lax.psum_scatter(g.reshape(-1), "data", tiled=True) / 2 for k, g in grads.items()}
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), jax.tree.map(lambda v: v[None], state)

    step = jax.jit(
      jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P("data"), state_specs, P("data"), P("data"), P("data")),
        out_specs=(P("data"), P("data")),
        check_vma=axis_name is not None,
      )
    )
    history = []
    for i in range(STEPS):
      x, y = batch(i, process_id)
      y = np.where(np.isfinite(y), y, 0.0).astype(np.float32)  # inf goes in the gradient here
      inject = np.array([process_id == 1 and i in INF_STEPS])
      params_before = local_values(params)
      params, stacked = step(
        params, state, global_array(x, rows), global_array(y, rows), global_array(inject, rows)
      )
      local = jax.tree.map(lambda v: v.addressable_data(0)[0], stacked)
      history.append(
        {
          "scale": float(local.loss_scale),
          "tracker": int(local.growth_tracker),
          "found_inf": bool(local.found_inf),
          "skipped_steps": int(local.skipped_steps),
          "params_before": params_before,
          "params_after": local_values(params),
        }
      )
      # Each process continues from its own state (they differ without axis_name).
      state = jax.tree.map(
        lambda v, s: global_array(np.asarray(v.addressable_data(0)[0]), NamedSharding(mesh, s)),
        stacked,
        state_specs,
      )
    return {"history": history}

  result = {
    "process_id": process_id,
    "process_count": jax.process_count(),
    "device_count": jax.device_count(),
    "collectives": jax.config.jax_cpu_collectives_implementation,
  }
  for name, run in (
    ("data_parallel_jit", data_parallel_jit),
    ("sharded_axis_name", lambda: sharded_shard_map("data")),
    ("sharded_no_axis_name", lambda: sharded_shard_map(None)),
  ):
    try:
      result[name] = {"ok": True, "result": run()}
    except Exception:  # noqa: BLE001
      result[name] = {"ok": False, "traceback": traceback.format_exc()}
  jax.distributed.shutdown()
  return result


# --------------------------------------------------------------------------
# Two torch processes: DistributedDataParallel (gloo) and torch.amp.GradScaler


def _torch_worker(rank: int, port: int) -> dict:
  import datetime

  import torch
  import torch.distributed as dist

  torch.manual_seed(0)
  dist.init_process_group(
    "gloo",
    init_method=f"tcp://127.0.0.1:{port}",
    rank=rank,
    world_size=2,
    timeout=datetime.timedelta(seconds=TIMEOUT_S),
  )
  p = init_params()
  model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
  with torch.no_grad():
    model[0].weight.copy_(torch.from_numpy(p["w1"].T.copy()))
    model[0].bias.copy_(torch.from_numpy(p["b1"]))
    model[2].weight.copy_(torch.from_numpy(p["w2"].T.copy()))
    model[2].bias.copy_(torch.from_numpy(p["b2"]))
  ddp = torch.nn.parallel.DistributedDataParallel(model)
  optimizer = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
  scaler = torch.amp.GradScaler(
    "cpu",
    init_scale=CONFIG["init_scale"],
    growth_factor=CONFIG["growth_factor"],
    backoff_factor=CONFIG["backoff_factor"],
    growth_interval=CONFIG["growth_interval"],
  )

  def jax_layout():
    return {
      "w1": _floats(model[0].weight.detach().numpy().T),
      "b1": _floats(model[0].bias.detach()),
      "w2": _floats(model[2].weight.detach().numpy().T),
      "b2": _floats(model[2].bias.detach()),
    }

  history = []
  for i in range(STEPS):
    x, y = (torch.from_numpy(a) for a in batch(i, rank))
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(ddp(x), y)
    scaler.scale(loss).backward()
    params_before = jax_layout()
    scaler.step(optimizer)
    found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    found_inf = sum(v.item() for v in found.values()) != 0
    scaler.update()
    history.append(
      {
        "scale": scaler.get_scale(),
        "tracker": int(scaler._get_growth_tracker()),
        "found_inf": found_inf,
        "params_before": params_before,
        "params_after": jax_layout(),
      }
    )
  dist.destroy_process_group()
  return {"rank": rank, "torch": torch.__version__, "history": history}


def main(argv: list[str]) -> None:
  mode = argv[1]
  if mode == "devices":
    result, out = _devices_checks(), argv[2]
  elif mode == "jax-worker":
    result, out = _jax_worker(int(argv[2]), int(argv[3])), argv[4]
  elif mode == "torch-worker":
    result, out = _torch_worker(int(argv[2]), int(argv[3])), argv[4]
  else:
    raise SystemExit(f"unknown mode {mode!r}")
  with open(out, "w") as f:
    json.dump(result, f)


if __name__ == "__main__":
  main(sys.argv)
