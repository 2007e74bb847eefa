"""Misuse of every public entry point: a clear error, raised before anything changes.

The promise tested here (README, docs/protections.md): bad input or misuse gets a
clear error whose first line names the problem and the fix, raised before
anything is modified; a failing call leaves every object it was given
bit-identical (diagnostics such as ``Optimizer.nonfinite_leaves`` included) and
destroys no donated buffer the caller cannot get back; nothing deadlocks; a
configuration jaxamp cannot handle correctly is refused, never approximated.

Most cases are one table (``CASES``): each builds its inputs, makes one bad
call, and the test checks the error type, words of the first line of its
message, and that every input is bit-identical afterwards.
"""

import functools
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax.experimental import checkify

import jaxamp
from jaxamp import flax_utils

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAN, INF = float("nan"), float("inf")

# --------------------------------------------------------------------------
# Snapshots: every leaf's bytes, dtype and shape, the tree structure, and the
# Python attributes that are not leaves.


def _leaf(leaf):
  if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
    array = np.asarray(leaf)  # raises on a deleted (donated) buffer
    return ("array", str(array.dtype), array.shape, array.tobytes())
  return ("value", type(leaf).__name__, repr(leaf))


def snapshot(obj):
  """Everything observable about ``obj``, comparable with ``==``."""
  try:
    extra = ()
    if isinstance(obj, (nnx.Module, nnx.Optimizer)):
      obj = nnx.state(obj)
    elif isinstance(obj, jaxamp.GradScaler):
      extra = (obj._scaled, obj._init_growth_tracker, obj.state_dict(), repr(obj))
    elif isinstance(obj, jaxamp.Optimizer):
      extra = (obj._key, id(obj.tx))
    leaves, treedef = jax.tree.flatten(obj, is_leaf=lambda x: x is None)
    return (type(obj).__name__, treedef, [_leaf(x) for x in leaves], extra)
  except Exception as error:  # noqa: BLE001 - a leaked tracer, a deleted buffer
    return ("unreadable", type(error).__name__, str(error)[:200])


def first_line(error):
  text = str(error)
  return text.splitlines()[0] if text else ""


# --------------------------------------------------------------------------
# Builders


def _params():
  return {"w": jnp.array([1.0, 2.0]), "b": jnp.array([0.5, -0.5, 0.25])}


def _grads(params=None, bad=None):
  grads = jax.tree.map(lambda p: jnp.full_like(p, 2.0), params or _params())
  if bad is not None:
    grads[bad] = grads[bad].at[0].set(jnp.inf)
  return grads


def _tx(**kwargs):
  return jaxamp.dynamic_loss_scale(optax.adam(1e-2), init_scale=4.0, **kwargs)


def _optax(tx=None, **kwargs):
  tx = tx or _tx(**kwargs)
  params = _params()
  return tx, params, tx.init(params), _grads(params)


def _scaler(scaled=True, **kwargs):
  scaler = jaxamp.GradScaler(init_scale=4.0, **kwargs)
  opt = jaxamp.Optimizer(optax.adam(1e-2), _params())
  opt.grads = _grads(opt.params, bad="b")  # a step that would change nonfinite_leaves
  if scaled:
    scaler.scale(jnp.float32(1.0))
  return scaler, opt


def _train_state(tx=None):
  return train_state.TrainState.create(apply_fn=None, params=_params(), tx=tx or _tx())


def _nnx(tx=None):
  model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, tx or _tx(), wrt=nnx.Param)
  grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
  return model, optimizer, grads


def _sd(**changes):
  sd = {
    "scale": 4.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2000,
    "_growth_tracker": 0,
  }
  sd.update(changes)
  return {k: v for k, v in sd.items() if v is not _DROP}


_DROP = object()


def _on_optax(call, tx=None):
  """A case on an optax setup: ``call(tx, params, state, grads)``."""

  def make():
    tx_, params, state, grads = _optax(tx() if tx else None)
    return functools.partial(call, tx_, params, state, grads), [params, state, grads]

  return make


def _on_state(call, state=None):
  """A case on an optax state alone: ``call(state)``."""

  def make():
    opt_state = state() if state else _optax()[2]
    return functools.partial(call, opt_state), [opt_state]

  return make


def _on_scaler_dict(sd):
  def make():
    scaler, opt = _scaler()
    return functools.partial(scaler.load_state_dict, sd), [scaler, opt, sd]

  return make


def _on_state_dict(sd):
  def make():
    state = _optax()[2]
    return functools.partial(jaxamp.load_state_dict, state, sd), [state, sd]

  return make


def _plain_dict_state():
  return {k: v for k, v in _optax()[2]._asdict().items() if k != "config"}


class _ExtraArgsTx:
  """An optimizer whose update takes one keyword argument, ``lr``, and raises on others."""

  @staticmethod
  def make():
    def init(params):
      return optax.EmptyState()

    def update(updates, state, params=None, *, lr=0.1):
      return jax.tree.map(lambda g: -lr * g, updates), state

    return optax.GradientTransformationExtraArgs(init, update)


# --------------------------------------------------------------------------
# The table: (id, make) where make() returns (call, inputs, error type, pattern)


CASES = []


def case(name, exc, pattern):
  def register(make):
    CASES.append(pytest.param(make, exc, pattern, id=name))
    return make

  return register


def _both_fronts(name, kwargs, exc, pattern, *, scaler_exc=None, scaler_pattern=None):
  """A hyperparameter case for dynamic_loss_scale and GradScaler."""
  inner = optax.sgd(0.1)
  CASES.append(
    pytest.param(
      lambda: (lambda: jaxamp.dynamic_loss_scale(inner, **kwargs), [inner]),
      exc,
      pattern,
      id=f"dynamic_loss_scale-{name}",
    )
  )
  CASES.append(
    pytest.param(
      lambda: (lambda: jaxamp.GradScaler(**kwargs), []),
      scaler_exc or exc,
      scaler_pattern or pattern,
      id=f"GradScaler-{name}",
    )
  )


_POSITIVE = r"jaxamp: init_scale must be a finite positive number"
_both_fronts("init_scale-0", {"init_scale": 0.0}, ValueError, _POSITIVE)
_both_fronts("init_scale-negative", {"init_scale": -2.0}, ValueError, _POSITIVE)
_both_fronts("init_scale-nan", {"init_scale": NAN}, ValueError, _POSITIVE)
_both_fronts("init_scale-inf", {"init_scale": INF}, ValueError, _POSITIVE)
_both_fronts("init_scale-1e-50", {"init_scale": 1e-50}, ValueError, _POSITIVE)
_both_fronts("init_scale-1e39", {"init_scale": 1e39}, ValueError, r"without overflow.*init_scale")
_both_fronts("init_scale-10**400", {"init_scale": 10**400}, ValueError, r"overflow.*init_scale")
_both_fronts(
  "init_scale-None", {"init_scale": None}, TypeError, r"jaxamp: init_scale must be a fin"
)
_both_fronts(
  "init_scale-str", {"init_scale": "1.0"}, TypeError, r"jaxamp: init_scale must be a real"
)
_both_fronts(
  "init_scale-vector",
  {"init_scale": np.array([1.0, 2.0])},
  ValueError,
  r"jaxamp: a hyperparameter must be a scalar",
  scaler_exc=TypeError,
  scaler_pattern=r"jaxamp: init_scale must be .*static Python numbers",
)
_both_fronts(
  "growth_factor-str", {"growth_factor": "2"}, TypeError, r"growth_factor must be a real"
)
_both_fronts(
  "growth_factor-complex", {"growth_factor": 2 + 0j}, TypeError, r"growth_factor must be"
)
_both_fronts("growth_factor-1", {"growth_factor": 1.0}, ValueError, r"growth factor must be > 1\.0")
_both_fronts("growth_factor-nan", {"growth_factor": NAN}, ValueError, r"growth factor must be > 1")
_both_fronts("growth_factor-inf", {"growth_factor": INF}, ValueError, r"growth factor must be > 1")
_both_fronts("growth_factor-None", {"growth_factor": None}, TypeError, r"growth_factor .*must be")
_both_fronts("backoff_factor-1", {"backoff_factor": 1.0}, ValueError, r"backoff factor must be < 1")
_both_fronts("backoff_factor-0", {"backoff_factor": 0.0}, ValueError, r"backoff factor must be > 0")
_both_fronts("backoff_factor-nan", {"backoff_factor": NAN}, ValueError, r"backoff factor must be")
_both_fronts(
  "growth_interval-2.5", {"growth_interval": 2.5}, TypeError, r"growth_interval must be an int"
)
_both_fronts(
  "growth_interval-bool", {"growth_interval": True}, TypeError, r"growth_interval must be"
)
_both_fronts(
  "growth_interval-2**32+3-array",
  {"growth_interval": np.array(2**32 + 3)},
  ValueError,
  r"growth_interval=4294967299 does not fit the int32 counters",
  scaler_exc=TypeError,
  scaler_pattern=r"growth_interval must be an int.*static Python numbers",
)
_both_fronts("hysteresis-0", {"hysteresis": 0}, ValueError, r"jaxamp: hysteresis must be >= 1")
_both_fronts(
  "hysteresis-2**40", {"hysteresis": 2**40}, ValueError, r"hysteresis=1099511627776 does"
)
_both_fronts("hysteresis-1.5", {"hysteresis": 1.5}, TypeError, r"jaxamp: hysteresis must be an int")
_both_fronts(
  "max_consecutive_skips-0", {"max_consecutive_skips": 0}, ValueError, r"skips must be >="
)
_both_fronts(
  "max_consecutive_skips-2**40", {"max_consecutive_skips": 2**40}, ValueError, r"does not fit"
)
_BOUND = r"jaxamp: {} must be a finite positive float32 number of at least"
_both_fronts(
  "min_loss_scale-subnormal", {"min_loss_scale": 1e-40}, ValueError, _BOUND.format("min_loss_scale")
)
_both_fronts(
  "max_loss_scale-subnormal", {"max_loss_scale": 1e-40}, ValueError, _BOUND.format("max_loss_scale")
)
_both_fronts(
  "min_loss_scale-0", {"min_loss_scale": 0.0}, ValueError, _BOUND.format("min_loss_scale")
)
_both_fronts(
  "min_loss_scale-nan", {"min_loss_scale": NAN}, ValueError, _BOUND.format("min_loss_scale")
)
_both_fronts(
  "max_loss_scale-inf", {"max_loss_scale": INF}, ValueError, _BOUND.format("max_loss_scale")
)
_both_fronts(
  "min-above-max",
  {"min_loss_scale": 8.0, "max_loss_scale": 4.0, "init_scale": 6.0},
  ValueError,
  r"min_loss_scale \(8\.0\) must not be above max_loss_scale",
)
_both_fronts(
  "init-below-min",
  {"init_scale": 1.0, "min_loss_scale": 2.0},
  ValueError,
  r"init_scale 1.0 is below",
)
_both_fronts(
  "init-above-max",
  {"init_scale": 8.0, "max_loss_scale": 2.0},
  ValueError,
  r"init_scale 8.0 is above",
)
_both_fronts(
  "consecutive_hysteresis-str",
  {"consecutive_hysteresis": "no"},
  TypeError,
  r"jaxamp: consecutive_hysteresis must be True or False",
)
_both_fronts(
  "detect_unscale_overflow-int",
  {"detect_unscale_overflow": 1},
  TypeError,
  r"jaxamp: detect_unscale_overflow must be True or False",
)
_both_fronts("enabled-str", {"enabled": "no"}, TypeError, r"jaxamp: enabled must be True or False")


@case("dynamic_loss_scale-hysteresis-vector", ValueError, r"must be a scalar")
def _():
  return lambda: jaxamp.dynamic_loss_scale(optax.sgd(0.1), hysteresis=np.array([1, 2])), []


@case("dynamic_loss_scale-growth_interval-vector", ValueError, r"must be a scalar")
def _():
  return lambda: jaxamp.dynamic_loss_scale(optax.sgd(0.1), growth_interval=np.array([1, 2])), []


for _name, _axis in [("0", 0), ("empty", ()), ("mixed", ("data", 1)), ("list", ["data"])]:
  CASES.append(
    pytest.param(
      functools.partial(
        lambda axis: (lambda: jaxamp.dynamic_loss_scale(optax.sgd(0.1), axis_name=axis), []), _axis
      ),
      TypeError,
      r"jaxamp: axis_name must be a mesh axis name",
      id=f"dynamic_loss_scale-axis_name-{_name}",
    )
  )


@case("dynamic_loss_scale-inner-None", TypeError, r"wraps an optax.GradientTransformation")
def _():
  return lambda: jaxamp.dynamic_loss_scale(None), []


@case("dynamic_loss_scale-inner-uncalled", TypeError, r"wraps an optax.GradientTransformation")
def _():
  return lambda: jaxamp.dynamic_loss_scale(optax.adam), []


@case("GradScaler-device-not-a-string", TypeError, r'device must be a string such as "cuda"')
def _():
  return lambda: jaxamp.GradScaler(device=None), []


@case("GradScaler-step-stacked-scaler", ValueError, r"holds a jaxamp.dynamic_loss_scale, a second")
def _():
  scaler = jaxamp.GradScaler(init_scale=4.0)
  opt = jaxamp.Optimizer(jaxamp.dynamic_loss_scale(optax.sgd(1.0)), _params())
  opt.grads = _grads(opt.params)
  scaler.scale(jnp.float32(1.0))
  return lambda: scaler.step(opt), [scaler, opt]


@case(
  "GradScaler-unscale_-stacked-scaler", ValueError, r"holds a jaxamp.dynamic_loss_scale, a second"
)
def _():
  scaler = jaxamp.GradScaler(init_scale=4.0)
  opt = jaxamp.Optimizer(jaxamp.dynamic_loss_scale(optax.sgd(1.0)), _params())
  opt.grads = _grads(opt.params)
  scaler.scale(jnp.float32(1.0))
  return lambda: scaler.unscale_(opt), [scaler, opt]


@case("GradScaler-init_scale-jax-array", TypeError, r"static Python numbers")
def _():
  scale = jnp.float32(2.0)
  return lambda: jaxamp.GradScaler(init_scale=scale), [scale]


@case(
  "inject_hyperparams-bfloat16-hyperparams", TypeError, r"arrived as bfloat16.*hyperparam_dtype"
)
def _():
  tx = optax.inject_hyperparams(jaxamp.dynamic_loss_scale)(optax.sgd(0.1), init_scale=4.0)
  params = {"w": jnp.ones(2, jnp.bfloat16)}
  return lambda: tx.init(params), [params]


@case("inject_hyperparams-growth_interval-float", TypeError, r"growth_interval must be an int")
def _():
  tx = optax.inject_hyperparams(jaxamp.dynamic_loss_scale)(optax.sgd(0.1), growth_interval=2.5)
  params = {"w": jnp.ones(2)}
  return lambda: tx.init(params), [params]


# -- tx.update ---------------------------------------------------------------


@case("update-inner-state-as-state", TypeError, r"got a .* as its state, not a DynamicLossScale")
def _():
  tx, params, state, grads = _optax()
  return lambda: tx.update(grads, state.inner_state, params), [params, state, grads]


@case("update-orbax-plain-dict-as-state", TypeError, r"got a dict as its state.*restore")
def _():
  tx, params, state, grads = _optax()
  plain = {k: v for k, v in state._asdict().items() if k != "config"}
  return lambda: tx.update(grads, plain, params), [params, plain, grads]


@case("update-state-of-another-config", ValueError, r"built with another configuration")
def _():
  tx, params, _, grads = _optax()
  other = _tx(growth_interval=7).init(params)
  return lambda: tx.update(grads, other, params), [params, other, grads]


@case("update-int-gradient", TypeError, r"gradient leaf \['w'\] has dtype int32")
def _():
  tx, params, state, grads = _optax()
  grads["w"] = jnp.array([1, 2], jnp.int32)
  return lambda: tx.update(grads, state, params), [params, state, grads]


@case("update-gradient-tree-mismatch", ValueError, r"gradient tree does not match the param")
def _():
  tx, params, state, grads = _optax()
  grads = {"w": grads["w"], "c": grads["b"]}
  return lambda: tx.update(grads, state, params), [params, state, grads]


for _shape in [(1,), ()]:
  CASES.append(
    pytest.param(
      _on_optax(
        functools.partial(
          lambda shape, tx, p, s, g: tx.update({**g, "w": jnp.ones(shape)}, s, p), _shape
        )
      ),
      ValueError,
      r"jaxamp: the gradient of \['w'\] has shape .* but the parameter has shape \(2,\)",
      id=f"update-gradient-shape-{_shape}",
    )
  )


@case("update-gradient-shape-without-params", ValueError, r"\['w'\]")
def _():
  tx, params, state, grads = _optax()
  grads["w"] = jnp.ones(1)
  return lambda: tx.update(grads, state), [params, state, grads]


@case("update-extra-leaf-without-params", ValueError, r"gradient tree has 3 array leaves")
def _():
  tx, params, state, grads = _optax()
  grads["c"] = jnp.ones(2)
  return lambda: tx.update(grads, state), [params, state, grads]


@case(
  "update-skip-limit-eager", RuntimeError, r"jaxamp: 1 consecutive optimizer steps were skipped"
)
def _():
  tx, params, state, _ = _optax(max_consecutive_skips=1)
  grads = _grads(params, bad="w")
  return lambda: jax.block_until_ready(tx.update(grads, state, params)), [params, state, grads]


# -- apply_scaled_updates ------------------------------------------------------


@case(
  "apply_scaled_updates-axis_name-other", ValueError, r"axis_name='other' but .*axis_name='data'"
)
def _():
  tx, params, state, grads = _optax(axis_name="data")
  call = lambda: jaxamp.apply_scaled_updates(tx, grads, state, params, axis_name="other")
  return call, [params, state, grads]


@case("apply_scaled_updates-axis_name-not-in-tx", ValueError, r"axis_name='data' but .*=None")
def _():
  tx, params, state, grads = _optax()
  call = lambda: jaxamp.apply_scaled_updates(tx, grads, state, params, axis_name="data")
  return call, [params, state, grads]


for _name, _front in [
  ("clip_by_global_norm", optax.clip_by_global_norm(1.0)),
  ("add_decayed_weights", optax.add_decayed_weights(0.1)),
]:
  CASES.append(
    pytest.param(
      _on_optax(
        lambda tx, p, s, g: jaxamp.apply_scaled_updates(tx, g, s, p),
        functools.partial(lambda front: optax.chain(front, _tx()), _front),
      ),
      ValueError,
      r"does not see the gradients as given.*Move them inside the scaler: jaxamp.dynamic_loss_scale",
      id=f"apply_scaled_updates-{_name}-in-front",
    )
  )


@case("apply_scaled_updates-MultiSteps-around", ValueError, r"does not see the gradients as given")
def _():
  tx, params, state, grads = _optax(optax.MultiSteps(_tx(), 2))
  return lambda: jaxamp.apply_scaled_updates(tx, grads, state, params), [params, state, grads]


@case("apply_scaled_updates-multi_transform", ValueError, r"does not see the gradients as given")
def _():
  tx = optax.multi_transform({"a": _tx()}, {"w": "a", "b": "a"})
  tx, params, state, grads = _optax(tx)
  return lambda: jaxamp.apply_scaled_updates(tx, grads, state, params), [params, state, grads]


@case("apply_scaled_updates-no-jaxamp-state", ValueError, r"found no DynamicLossScaleState")
def _():
  tx, params, state, grads = _optax(optax.adam(1e-2))
  return lambda: jaxamp.apply_scaled_updates(tx, grads, state, params), [params, state, grads]


@case("apply_scaled_updates-two-jaxamp-states", ValueError, r"found 2 DynamicLossScaleState")
def _():
  tx, params, state, grads = _optax(optax.chain(_tx(), _tx()))
  return lambda: jaxamp.apply_scaled_updates(tx, grads, state, params), [params, state, grads]


for _shape in [(1,), ()]:
  CASES.append(
    pytest.param(
      _on_optax(
        functools.partial(
          lambda shape, tx, p, s, g: jaxamp.apply_scaled_updates(
            tx, {**g, "w": jnp.ones(shape)}, s, p
          ),
          _shape,
        )
      ),
      ValueError,
      r"the gradient of \['w'\] has shape",
      id=f"apply_scaled_updates-gradient-shape-{_shape}",
    )
  )


@case("apply_scaled_updates-int-gradient", TypeError, r"gradient leaf \['b'\] has dtype int32")
def _():
  tx, params, state, grads = _optax()
  grads["b"] = jnp.zeros(3, jnp.int32)
  return lambda: jaxamp.apply_scaled_updates(tx, grads, state, params), [params, state, grads]


@case("apply_scaled_updates-grads-None", ValueError, r"gradient tree does not match")
def _():
  tx, params, state, _ = _optax()
  return lambda: jaxamp.apply_scaled_updates(tx, None, state, params), [params, state]


@case("apply_scaled_updates-tx-None", TypeError, r"jaxamp.*tx")
def _():
  _, params, state, grads = _optax()
  return lambda: jaxamp.apply_scaled_updates(None, grads, state, params), [params, state, grads]


@case("apply_scaled_updates-state-of-another-tx", ValueError, r"built with another configuration")
def _():
  tx, params, _, grads = _optax()
  other = _tx(backoff_factor=0.25).init(params)
  return lambda: jaxamp.apply_scaled_updates(tx, grads, other, params), [params, other, grads]


@case("apply_scaled_updates-inner-state", ValueError, r"found no DynamicLossScaleState")
def _():
  tx, params, state, grads = _optax()
  inner = state.inner_state
  return lambda: jaxamp.apply_scaled_updates(tx, grads, inner, params), [params, inner, grads]


# -- flax_utils ----------------------------------------------------------------


@case("apply_gradients-grads-None", TypeError, r"jaxamp: flax_utils.apply_gradients got grads=None")
def _():
  state = _train_state()
  return lambda: flax_utils.apply_gradients(state, grads=None), [state]


@case("apply_gradients-axis_name-other", ValueError, r"axis_name='other' but .*axis_name='data'")
def _():
  state = _train_state(_tx(axis_name="data"))
  grads = _grads()
  return lambda: flax_utils.apply_gradients(state, grads=grads, axis_name="other"), [state, grads]


@case("apply_gradients-clip-in-front", ValueError, r"does not see the gradients as given")
def _():
  state = _train_state(optax.chain(optax.clip_by_global_norm(1.0), _tx()))
  grads = _grads()
  return lambda: flax_utils.apply_gradients(state, grads=grads), [state, grads]


@case("apply_gradients-gradient-shape", ValueError, r"the gradient of \['w'\] has shape \(1,\)")
def _():
  state = _train_state()
  grads = {**_grads(), "w": jnp.ones(1)}
  return lambda: flax_utils.apply_gradients(state, grads=grads), [state, grads]


@case("apply_gradients-optax-state", TypeError, r"takes a flax TrainState")
def _():
  _, _, state, grads = _optax()
  return lambda: flax_utils.apply_gradients(state, grads=grads), [state, grads]


@case("apply_gradients-no-jaxamp", ValueError, r"found no DynamicLossScaleState")
def _():
  state = _train_state(optax.adam(1e-2))
  grads = _grads()
  return lambda: flax_utils.apply_gradients(state, grads=grads), [state, grads]


@case("nnx-update-axis_name-other", ValueError, r"axis_name='other' but .*axis_name='data'")
def _():
  model, optimizer, grads = _nnx(_tx(axis_name="data"))
  call = lambda: flax_utils.update(optimizer, model, grads, axis_name="other")
  return call, [model, optimizer, grads]


@case("nnx-update-optimizer-is-model", TypeError, r"flax_utils.update takes an nnx.Optimizer first")
def _():
  model, optimizer, grads = _nnx()
  return lambda: flax_utils.update(model, model, grads), [model, optimizer, grads]


@case("nnx-update-model-swapped", TypeError, r"takes the nnx.Module second")
def _():
  model, optimizer, grads = _nnx()
  return lambda: flax_utils.update(optimizer, grads, model), [model, optimizer, grads]


@case("nnx-update-grads-None", TypeError, r"flax_utils.update got grads=None")
def _():
  model, optimizer, _ = _nnx()
  return lambda: flax_utils.update(optimizer, model, None), [model, optimizer]


@case(
  "nnx-update-gradient-shape", ValueError, r"the gradient of \['(kernel|bias)'\] has shape \(1,\)"
)
def _():
  model, optimizer, grads = _nnx()
  bad = jax.tree.map(lambda g: jnp.ones((1,), g.dtype), grads)
  return lambda: flax_utils.update(optimizer, model, bad), [model, optimizer, bad]


@case("nnx-update-clip-in-front", ValueError, r"does not see the gradients as given")
def _():
  model, optimizer, grads = _nnx(optax.chain(optax.clip_by_global_norm(1.0), _tx()))
  return lambda: flax_utils.update(optimizer, model, grads), [model, optimizer, grads]


@case("nnx-update-no-jaxamp", ValueError, r"found no DynamicLossScaleState")
def _():
  model, optimizer, grads = _nnx(optax.adam(1e-2))
  return lambda: flax_utils.update(optimizer, model, grads), [model, optimizer, grads]


@case("scaled_value_and_grad-no-jaxamp", ValueError, r"found no DynamicLossScaleState")
def _():
  return lambda: flax_utils.scaled_value_and_grad(lambda p: jnp.sum(p), None), []


def _value_and_grad_case(loss_fn, has_aux=False):
  def make():
    _, params, state, _ = _optax()
    fn = flax_utils.scaled_value_and_grad(loss_fn, state, has_aux=has_aux)
    return lambda: fn(params), [params, state]

  return make


for _name, _fn, _exc, _pattern in [
  ("float16", lambda p: jnp.sum(p["w"]).astype(jnp.float16), TypeError, r"the loss is float16"),
  ("vector", lambda p: p["w"] * 2, ValueError, r"the loss must be a scalar, got shape \(2,\)"),
  ("tuple", lambda p: (jnp.sum(p["w"]), 1), TypeError, r"returned a tuple.*pass has_aux=True"),
  ("int", lambda p: jnp.int32(1), TypeError, r"the loss has dtype int32"),
]:
  CASES.append(
    pytest.param(_value_and_grad_case(_fn), _exc, _pattern, id=f"scaled_value_and_grad-{_name}")
  )


@case(
  "scaled_value_and_grad-has_aux-not-pair", TypeError, r"has_aux=True .* must return \(loss, aux\)"
)
def _():
  return _value_and_grad_case(lambda p: jnp.sum(p["w"]), has_aux=True)()


@case("scaled_value_and_grad-captured-in-jit", ValueError, r"loss scale is a constant inside")
def _():
  model, optimizer, _ = _nnx()
  fn = flax_utils.scaled_value_and_grad(lambda m, x: jnp.sum(m(x)), optimizer)
  x = jnp.ones((1, 2))
  return lambda: jax.jit(lambda x: fn(model, x)[0])(x), [model, optimizer, x]


@case("loss_scale_metrics-no-jaxamp", ValueError, r"found no DynamicLossScaleState")
def _():
  state = optax.adam(1e-2).init(_params())
  return lambda: flax_utils.loss_scale_metrics(state), [state]


# -- checkpoints ------------------------------------------------------------------

_BAD_SCALES = [
  ("nan", NAN),
  ("inf", INF),
  ("-inf", -INF),
  ("0", 0.0),
  ("negative", -1.0),
  ("1e-50", 1e-50),
]
for _name, _scale in _BAD_SCALES:
  CASES.append(
    pytest.param(
      _on_state_dict(_sd(scale=_scale)),
      ValueError,
      r"jaxamp: the state dict's scale must be a finite positive number",
      id=f"load_state_dict-scale-{_name}",
    )
  )
  CASES.append(
    pytest.param(
      _on_scaler_dict(_sd(scale=_scale)),
      ValueError,
      r"jaxamp: the state dict's scale must be a finite positive number",
      id=f"GradScaler.load_state_dict-scale-{_name}",
    )
  )

_BAD_DICTS = [
  ("scale-1e39", _sd(scale=1e39), RuntimeError, r"without overflow.*scale=1e\+39"),
  ("scale-10**400", _sd(scale=10**400), RuntimeError, r"without overflow"),
  ("scale-bool", _sd(scale=True), TypeError, r"entry 'scale' must be a real"),
  ("scale-str", _sd(scale="4.0"), TypeError, r"entry 'scale' must be a real"),
  ("missing-key", _sd(_growth_tracker=_DROP), KeyError, r"_growth_tracker.*lacks"),
  ("extra-key", _sd(hysteresis=2), ValueError, r"unexpected state dict keys \['hysteresis'\]"),
  ("empty", {}, RuntimeError, r"The source state dict is empty"),
  ("tracker-2**31", _sd(_growth_tracker=2**31), RuntimeError, r"int without overflow"),
  ("tracker-float", _sd(_growth_tracker=1.5), TypeError, r"'_growth_tracker' must be an int"),
  ("interval-float", _sd(growth_interval=2.5), TypeError, r"'growth_interval' must be an int"),
]
for _name, _dict, _exc, _pattern in _BAD_DICTS:
  CASES.append(pytest.param(_on_state_dict(_dict), _exc, _pattern, id=f"load_state_dict-{_name}"))
  CASES.append(
    pytest.param(_on_scaler_dict(_dict), _exc, _pattern, id=f"GradScaler.load_state_dict-{_name}")
  )


@case("load_state_dict-not-a-mapping", TypeError, r"a state dict must be a mapping")
def _():
  state = _optax()[2]
  items = list(_sd().items())
  return lambda: jaxamp.load_state_dict(state, items), [state, items]


@case("load_state_dict-other-growth_factor", ValueError, r"state dict has growth_factor=3.0 but")
def _():
  state, sd = _optax()[2], _sd(growth_factor=3.0)
  return lambda: jaxamp.load_state_dict(state, sd), [state, sd]


@case("load_state_dict-nnx-optimizer", TypeError, r"takes the optimizer state itself")
def _():
  model, optimizer, _ = _nnx()
  sd = _sd()
  return lambda: jaxamp.load_state_dict(optimizer, sd), [model, optimizer, sd]


@case("load_state_dict-two-jaxamp-states", ValueError, r"found 2 DynamicLossScaleState")
def _():
  state, sd = _optax(optax.chain(_tx(), _tx()))[2], _sd()
  return lambda: jaxamp.load_state_dict(state, sd), [state, sd]


@case("state_dict-no-jaxamp", ValueError, r"found no DynamicLossScaleState")
def _():
  state = optax.adam(1e-2).init(_params())
  return lambda: jaxamp.state_dict(state), [state]


@case("state_dict-other-growth_factor", ValueError, r"the call has growth_factor=3.0 but")
def _():
  state = _optax()[2]
  return lambda: jaxamp.state_dict(state, growth_factor=3.0), [state]


@case("state_dict-array-hyperparameter", ValueError, r"growth_factor was given .* as an array")
def _():
  state = _optax(_tx(growth_factor=jnp.float32(2.0)))[2]
  return lambda: jaxamp.state_dict(state), [state]


# -- GradScaler, wrong orders and bad arguments ----------------------------------------


def _scaler_case(action, scaled=True, before=None, **kwargs):
  def make():
    scaler, opt = _scaler(scaled, **kwargs)
    if before is not None:
      before(scaler, opt)
    return functools.partial(action, scaler, opt), [scaler, opt]

  return make


def _unscale(s, o):
  s.unscale_(o)


def _step(s, o):
  s.step(o)


_ORDER = [
  ("unscale_-before-scale", False, None, _unscale, r"Attempted unscale_ but _scale is None"),
  ("step-before-scale", False, None, _step, r"Attempted step but _scale is None"),
  ("update-before-scale", False, None, lambda s, o: s.update(), r"Attempted update but _scale"),
  ("unscale_-twice", True, _unscale, _unscale, r"unscale_\(\) has already been called"),
  ("unscale_-after-step", True, _step, _unscale, r"unscale_\(\) is being called after step"),
  ("step-twice", True, _step, _step, r"step\(\) has already been called since the last update"),
  (
    "update-without-step",
    True,
    None,
    lambda s, o: s.update(),
    r"No inf checks were recorded prior",
  ),
]
for _name, _scaled, _before, _action, _pattern in _ORDER:
  CASES.append(
    pytest.param(
      _scaler_case(_action, _scaled, _before), RuntimeError, _pattern, id=f"GradScaler-{_name}"
    )
  )


def _set_grads(value):
  def before(scaler, opt):
    opt.grads = value(opt) if callable(value) else value

  return before


_STEP_ARGUMENTS = [
  ("closure", lambda s, o: s.step(o, closure=lambda: 0.0), RuntimeError, r"Closure use is not"),
  ("not-an-optimizer", lambda s, o: s.step(o.params), TypeError, r"expects a jaxamp.Optimizer"),
  ("unscale_-None", lambda s, o: s.unscale_(None), TypeError, r"expects a jaxamp.Optimizer"),
  (
    "nonfinite_leaf_paths-not-an-optimizer",
    lambda s, o: s.nonfinite_leaf_paths(o.params),
    TypeError,
    r"expects a jaxamp.Optimizer",
  ),
  ("scale-str", lambda s, o: s.scale("loss"), ValueError, r"outputs must be a Tensor"),
  (
    "new_scale-0",
    lambda s, o: s.update(new_scale=0.0),
    ValueError,
    r"new_scale must be finite and",
  ),
  ("new_scale-negative", lambda s, o: s.update(new_scale=-1.0), ValueError, r"new_scale must be"),
  ("new_scale-nan", lambda s, o: s.update(new_scale=NAN), ValueError, r"new_scale must be finite"),
  ("new_scale-1e-50", lambda s, o: s.update(new_scale=1e-50), ValueError, r"new_scale must be"),
  ("new_scale-1e39", lambda s, o: s.update(new_scale=1e39), RuntimeError, r"without overflow"),
  ("new_scale-int", lambda s, o: s.update(new_scale=2), TypeError, r"new_scale must be a float"),
  ("new_scale-str", lambda s, o: s.update(new_scale="2"), TypeError, r"new_scale must be a float"),
  (
    "new_scale-vector",
    lambda s, o: s.update(new_scale=np.ones(2)),
    ValueError,
    r"new_scale should be a float",
  ),
  (
    "set_growth_factor-str",
    lambda s, o: s.set_growth_factor("2"),
    TypeError,
    r"growth_factor must",
  ),
  (
    "set_backoff_factor-None",
    lambda s, o: s.set_backoff_factor(None),
    TypeError,
    r"backoff_factor",
  ),
  (
    "set_growth_interval-2.5",
    lambda s, o: s.set_growth_interval(2.5),
    TypeError,
    r"growth_interval must be an int",
  ),
]
for _name, _action, _exc, _pattern in _STEP_ARGUMENTS:
  CASES.append(pytest.param(_scaler_case(_action), _exc, _pattern, id=f"GradScaler-{_name}"))


def _step_bad_extra_args():
  scaler = jaxamp.GradScaler(init_scale=4.0)
  opt = jaxamp.Optimizer(_ExtraArgsTx.make(), _params())
  opt.grads = _grads(opt.params, bad="b")
  scaler.scale(jnp.float32(1.0))
  return lambda: scaler.step(opt, bogus=1), [scaler, opt]


CASES.append(
  pytest.param(
    _step_bad_extra_args,
    TypeError,
    r"unexpected keyword argument 'bogus'",
    id="GradScaler-step-bad-extra-args",
  )
)

for _name, _grads_of, _exc, _pattern in [
  ("None-leaf", lambda o: {"w": None, "b": o.grads["b"]}, Exception, r"jaxamp.*\['w'\].*None"),
  (
    "shape-(1,)",
    lambda o: {**o.grads, "w": jnp.ones(1)},
    ValueError,
    r"gradient of \['w'\] has shape",
  ),
  (
    "shape-()",
    lambda o: {**o.grads, "w": jnp.ones(())},
    ValueError,
    r"gradient of \['w'\] has shape",
  ),
  ("int", lambda o: {**o.grads, "w": jnp.ones(2, jnp.int32)}, TypeError, r"leaf \['w'\] has dtype"),
]:
  CASES.append(
    pytest.param(
      _scaler_case(_step, before=_set_grads(_grads_of)),
      _exc,
      _pattern,
      id=f"GradScaler-step-grads-{_name}",
    )
  )
  if _name != "int":  # unscale_ only unscales; the other layouts matter at step
    continue
  CASES.append(
    pytest.param(
      _scaler_case(_unscale, before=_set_grads(_grads_of)),
      _exc,
      _pattern,
      id=f"GradScaler-unscale_-grads-{_name}",
    )
  )


@case("GradScaler-skip-limit-eager", RuntimeError, r"jaxamp: 1 consecutive optimizer steps were")
def _():
  scaler, opt = _scaler(max_consecutive_skips=1)
  scaler.step(opt)
  return lambda: scaler.update(), [scaler, opt]


def _captured_iteration(scaler):
  def iteration(opt):
    opt.grads = jax.grad(lambda p: scaler.scale(jnp.sum(p["w"] ** 2)))(opt.params)
    scaler.step(opt)
    scaler.update()
    return opt

  return iteration


@case("GradScaler-captured-by-jit", RuntimeError, r"jaxamp: .*GradScaler.*(jit|traced)")
def _():
  scaler, opt = _scaler()
  return lambda: jax.jit(_captured_iteration(scaler))(opt), [scaler, opt]


@case("GradScaler-scale-captured-by-jit", RuntimeError, r"jaxamp: .*GradScaler.*(jit|traced)")
def _():
  scaler, opt = _scaler()
  grad_fn = jax.jit(jax.grad(lambda p: scaler.scale(jnp.sum(p["w"] ** 2))))
  return lambda: grad_fn(opt.params), [scaler, opt]


@case("Optimizer-tx-None", TypeError, r"jaxamp.Optimizer takes an optax.GradientTransformation")
def _():
  params = _params()
  return lambda: jaxamp.Optimizer(None, params), [params]


@case("Optimizer-tx-uncalled", TypeError, r"jaxamp.Optimizer takes an optax.GradientTransformation")
def _():
  params = _params()
  return lambda: jaxamp.Optimizer(optax.adam, params), [params]


# -- building blocks and state access ----------------------------------------------


def _block(call, *inputs):
  return lambda: (functools.partial(call, *inputs), list(inputs))


_S, _T, _F = jnp.float32(4.0), jnp.int32(1), jnp.bool_(False)
_BLOCKS = [
  (
    "unscale_and_check-int",
    _block(jaxamp.ops.unscale_and_check, {"w": jnp.ones(2, jnp.int32)}, _S),
    TypeError,
    r"gradient leaf \['w'\] has dtype int32",
  ),
  (
    "unscale_and_check-scale-str",
    _block(jaxamp.ops.unscale_and_check, {"w": jnp.ones(2)}, "2.0"),
    TypeError,
    r"jaxamp: .*loss_scale",
  ),
  (
    "unscale_and_check-scale-vector",
    _block(jaxamp.ops.unscale_and_check, {"w": jnp.ones(2)}, jnp.ones(2)),
    ValueError,
    r"jaxamp: .*loss_scale.*scalar",
  ),
  (
    "inverse_scale-vector",
    _block(jaxamp.ops.inverse_scale, jnp.ones(2)),
    ValueError,
    r"jaxamp: .*scalar",
  ),
  (
    "all_finite-str-leaf",
    _block(jaxamp.ops.all_finite, {"w": "x"}),
    TypeError,
    r"jaxamp: .*\['w'\]",
  ),
  (
    "update_loss_scale-growth_interval-2.5",
    _block(functools.partial(jaxamp.ops.update_loss_scale, growth_interval=2.5), _S, _T, _F),
    TypeError,
    r"jaxamp: growth_interval must be an int, got float 2.5",
  ),
  (
    "update_loss_scale-growth_interval-2**32+3",
    _block(
      functools.partial(jaxamp.ops.update_loss_scale, growth_interval=np.array(2**32 + 3)),
      _S,
      _T,
      _F,
    ),
    ValueError,
    r"growth_interval=4294967299 does not fit",
  ),
  (
    "update_loss_scale-growth_interval-float-array",
    _block(
      functools.partial(jaxamp.ops.update_loss_scale, growth_interval=jnp.float32(3)), _S, _T, _F
    ),
    TypeError,
    r"growth_interval must be an int",
  ),
  (
    "update_loss_scale-growth_factor-str",
    _block(functools.partial(jaxamp.ops.update_loss_scale, growth_factor="2"), _S, _T, _F),
    TypeError,
    r"growth_factor must be a real",
  ),
  (
    "update_loss_scale-backoff_factor-vector",
    _block(functools.partial(jaxamp.ops.update_loss_scale, backoff_factor=jnp.ones(2)), _S, _T, _F),
    ValueError,
    r"backoff_factor must be a scalar",
  ),
  (
    "update_loss_scale-tracker-float",
    _block(jaxamp.ops.update_loss_scale, _S, 1.5, _F),
    TypeError,
    r"growth_tracker must be an int32 scalar",
  ),
  (
    "update_loss_scale-scale-vector",
    _block(jaxamp.ops.update_loss_scale, jnp.ones(2), _T, _F),
    ValueError,
    r"loss_scale must be a float32 scalar",
  ),
  (
    "update_loss_scale-found_inf-vector",
    _block(jaxamp.ops.update_loss_scale, _S, _T, jnp.array([True, False])),
    ValueError,
    r"found_inf must be a bool scalar.*jnp.any",
  ),
  (
    "get_loss_scale-None",
    _block(jaxamp.get_loss_scale, None),
    ValueError,
    r"found no DynamicLossScaleState",
  ),
  (
    "find_loss_scale_state-orbax-dict",
    _on_state(jaxamp.ops.find_loss_scale_state, _plain_dict_state),
    ValueError,
    r"found no DynamicLossScaleState",
  ),
  (
    "scale_loss-str",
    _on_state(lambda s: jaxamp.scale_loss("x", s)),
    TypeError,
    r"scale_loss got a loss of type str",
  ),
  (
    "scale_loss-int",
    _on_state(lambda s: jaxamp.scale_loss(jnp.int32(3), s)),
    TypeError,
    r"scale_loss got a loss of dtype int32",
  ),
  (
    "nonfinite_leaf_paths-other-params",
    _on_state(lambda s: jaxamp.ops.nonfinite_leaf_paths(s, {"w": jnp.ones(2)})),
    ValueError,
    r"params has 1 leaves but the jaxamp state tracks 2",
  ),
]
for _name, _make, _exc, _pattern in _BLOCKS:
  CASES.append(pytest.param(_make, _exc, _pattern, id=_name))


def test_the_table_is_large():
  assert len(CASES) >= 80
  assert len({p.id for p in CASES}) == len(CASES)


@pytest.mark.parametrize(("make", "exc", "pattern"), CASES)
def test_misuse_is_refused_before_anything_changes(make, exc, pattern):
  call, inputs = make()
  before = [snapshot(x) for x in inputs]
  with pytest.raises(Exception) as info:
    call()
  error = info.value
  after = [snapshot(x) for x in inputs]
  problems = [
    f"input {i} ({b[0]}) changed" for i, (b, a) in enumerate(zip(before, after)) if a != b
  ]
  if not isinstance(error, exc):
    problems.append(f"raised {type(error).__name__}, not {exc.__name__}")
  if not re.search(pattern, first_line(error)):
    problems.append(f"first line does not match {pattern!r}")
  assert not problems, f"{problems}: {type(error).__name__}: {first_line(error)}"


# --------------------------------------------------------------------------
# Donated buffers: the skip limit inside a jitted, donating step


def _donating_steps(max_consecutive_skips):
  tx = _tx(max_consecutive_skips=max_consecutive_skips)
  params = _params()
  return tx, params, tx.init(params)


@pytest.mark.slow
def test_skip_limit_in_a_donating_checkified_step_leaves_valid_params_and_state():
  # The README's pattern, step(params, opt_state, grads) -> (params, opt_state)
  # with donate_argnums=(0, 1), checkified as docs/protections.md says: the
  # step that reaches the limit completes, the caller holds what it returned
  # (the last finite step's params and state, counters advanced), and
  # err.throw() raises with jaxamp's text first.
  tx, params, state = _donating_steps(max_consecutive_skips=2)
  step = jax.jit(
    checkify.checkify(lambda p, s, g: jaxamp.apply_scaled_updates(tx, g, s, p)),
    donate_argnums=(0, 1),
  )
  err, (params, state) = step(params, state, _grads())
  err.throw()  # a finite step: no error
  finite_params, finite_inner = snapshot(params), snapshot(state.inner_state)
  for _ in range(2):
    err, (params, state) = step(params, state, _grads(bad="w"))
  with pytest.raises(checkify.JaxRuntimeError) as info:
    err.throw()
  assert re.match(
    r"jaxamp: 2 consecutive optimizer steps were skipped .* at update 3, with the loss "
    r"scale now 1\.0\. The params and optimizer state this step returned are valid",
    first_line(info.value),
  ), first_line(info.value)
  assert snapshot(params) == finite_params
  assert snapshot(state.inner_state) == finite_inner
  assert int(state.consecutive_skipped_steps) == 2
  # What it returned is usable: a finite step trains on from it.
  err, (params, state) = step(params, state, _grads())
  assert err.get() is None and int(state.consecutive_skipped_steps) == 0
  assert snapshot(params) != finite_params


@pytest.mark.parametrize("front_end", ["optax form", "inject_hyperparams"])
def test_skip_limit_under_checkify_is_an_error_value_in_every_form(front_end):
  tx = _tx(max_consecutive_skips=1)
  if front_end == "inject_hyperparams":
    tx = optax.inject_hyperparams(jaxamp.dynamic_loss_scale)(
      optax.sgd(0.1), max_consecutive_skips=1
    )
  params = _params()
  state = tx.init(params)
  update = jax.jit(checkify.checkify(lambda s, g: tx.update(g, s, params)))
  err, _ = update(state, _grads())
  assert err.get() is None
  err, (updates, state) = update(state, _grads(bad="w"))
  assert re.match(r"jaxamp: 1 consecutive optimizer steps were skipped", err.get())
  assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))


@pytest.mark.slow
def test_skip_limit_under_vmap_reports_the_member_that_reached_it():
  tx = _tx(max_consecutive_skips=1)
  params = _params()
  states = jax.vmap(tx.init)(jax.tree.map(lambda x: jnp.stack([x, x]), params))
  grads = jax.tree.map(lambda g, b: jnp.stack([g, b]), _grads(), _grads(bad="w"))
  update = jax.vmap(lambda g, s: tx.update(g, s, params))
  err, _ = jax.jit(checkify.checkify(update))(grads, states)
  assert re.match(r"jaxamp: 1 consecutive optimizer steps were skipped .* at update 1,", err.get())
  err, _ = jax.jit(checkify.checkify(update))(
    jax.tree.map(lambda g: jnp.stack([g, g]), _grads()), states
  )
  assert err.get() is None


def test_skip_limit_in_a_plain_jit_step_fails_the_computation_and_names_the_fix():
  # Without checkify the computation fails (JAX's error; jaxamp's text follows
  # in it, with the checkify advice for donated buffers).
  tx, params, state = _donating_steps(max_consecutive_skips=1)
  step = jax.jit(lambda p, s, g: jaxamp.apply_scaled_updates(tx, g, s, p), donate_argnums=(0, 1))
  with pytest.raises(jax.errors.JaxRuntimeError) as info:
    jax.block_until_ready(step(params, state, _grads(bad="w")))
  text = str(info.value)
  assert "jaxamp: 1 consecutive optimizer steps were skipped" in text
  assert "wrap the jitted step in jax.experimental.checkify.checkify" in text


# --------------------------------------------------------------------------
# Mixed-dtype params with inject_hyperparams(adam) inside the scaler


def _mixed():
  params = {"w": jnp.array([1.0, -2.0], jnp.bfloat16), "norm": jnp.array([0.5, 3.0])}
  grads = {"w": jnp.array([8.0, -4.0], jnp.bfloat16), "norm": jnp.array([2.0, 6.0])}
  return optax.inject_hyperparams(optax.adam)(1e-3), params, grads


def _plain_optax_reference(inner, params, grads, scale):
  unscaled = jax.tree.map(lambda g: (g.astype(jnp.float32) * (1 / scale)).astype(g.dtype), grads)
  updates, state = inner.update(unscaled, inner.init(params), params)
  return optax.apply_updates(params, updates), state


@pytest.mark.slow
@pytest.mark.parametrize("api", ["tx.update", "apply_scaled_updates", "GradScaler"])
def test_mixed_dtype_params_with_injected_adam_work_as_plain_optax(api):
  inner, params, grads = _mixed()
  expected_params, expected_state = _plain_optax_reference(inner, params, grads, 4.0)
  if api == "GradScaler":
    scaler = jaxamp.GradScaler(init_scale=4.0)
    opt = jaxamp.Optimizer(inner, params)
    scaler.scale(jnp.float32(1.0))
    opt.grads = grads
    scaler.step(opt)
    scaler.update()
    new_params, inner_state = opt.params, opt.opt_state
  else:
    tx = jaxamp.dynamic_loss_scale(inner, init_scale=4.0)
    state = tx.init(params)
    if api == "tx.update":
      updates, state = tx.update(grads, state, params)
      new_params = optax.apply_updates(params, updates)
    else:
      new_params, state = jaxamp.apply_scaled_updates(tx, grads, state, params)
    inner_state = state.inner_state
  for got, want in zip(jax.tree.leaves(new_params), jax.tree.leaves(expected_params)):
    assert got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-6)
  assert jax.tree.structure(inner_state) == jax.tree.structure(expected_state)
  for got, want in zip(jax.tree.leaves(inner_state), jax.tree.leaves(expected_state)):
    assert got.dtype == want.dtype


# --------------------------------------------------------------------------
# Two threads sharing one GradScaler


@pytest.mark.slow
def test_two_threads_sharing_a_grad_scaler_are_counted_or_refused():
  scaler = jaxamp.GradScaler(init_scale=4.0, growth_interval=10**6)
  errors = []

  def work():
    opt = jaxamp.Optimizer(optax.sgd(0.1), {"w": jnp.ones(2)})
    try:
      for _ in range(100):
        scaler.scale(jnp.float32(1.0))
        opt.grads = {"w": jnp.ones(2)}
        scaler.step(opt)
        scaler.update()
    except Exception as error:  # noqa: BLE001 - inspected below
      errors.append(error)

  threads = [threading.Thread(target=work) for _ in range(2)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(timeout=120)
  assert not any(thread.is_alive() for thread in threads), "deadlock"
  if errors:
    assert all(isinstance(e, RuntimeError) for e in errors), errors
    assert all(re.search(r"jaxamp: .*thread", first_line(e)) for e in errors), errors
  else:
    assert int(scaler.update_count) == 200


# --------------------------------------------------------------------------
# Eager calls compile nothing after a warm-up


def _eager_injected_update():
  tx = optax.inject_hyperparams(jaxamp.dynamic_loss_scale)(optax.sgd(0.1), init_scale=4.0)
  params = {"w": jnp.ones(3)}
  state = tx.init(params)

  def call(value):
    nonlocal state
    _, state = tx.update({"w": jnp.full(3, value)}, state, params)
    jax.block_until_ready(state)

  return call


def _eager_numpy_extra_args():
  tx = jaxamp.dynamic_loss_scale(_ExtraArgsTx.make(), init_scale=4.0)
  params = {"w": jnp.ones(3)}
  state = tx.init(params)

  def call(value):
    nonlocal state
    _, state = tx.update({"w": jnp.full(3, value)}, state, params, lr=np.float32(value))
    jax.block_until_ready(state)

  return call


def _eager_apply_scaled_updates():
  tx = _tx()
  params = {"w": jnp.ones(3)}
  state = tx.init(params)

  def call(value):
    nonlocal params, state
    params, state = jaxamp.apply_scaled_updates(tx, {"w": jnp.full(3, value)}, state, params)
    jax.block_until_ready(params)

  return call


def _eager_apply_gradients():
  state = train_state.TrainState.create(apply_fn=None, params={"w": jnp.ones(3)}, tx=_tx())

  def call(value):
    nonlocal state
    state = flax_utils.apply_gradients(state, grads={"w": jnp.full(3, value)})
    jax.block_until_ready(state.params)

  return call


def _eager_nnx_update():
  model, optimizer, grads = _nnx()

  def call(value):
    flax_utils.update(optimizer, model, jax.tree.map(lambda g: jnp.full_like(g, value), grads))
    jax.block_until_ready(nnx.state(model))

  return call


def _eager_grad_scaler_with_skip_limit():
  scaler = jaxamp.GradScaler(init_scale=4.0, max_consecutive_skips=100)
  opt = jaxamp.Optimizer(optax.sgd(0.1), {"w": jnp.ones(3)})

  def call(value):
    scaler.scale(jnp.float32(1.0))
    opt.grads = {"w": jnp.full(3, value)}
    scaler.step(opt)
    scaler.update()
    jax.block_until_ready(scaler.loss_scale)

  return call


@pytest.mark.slow
@pytest.mark.parametrize(
  "make",
  [
    _eager_injected_update,
    _eager_numpy_extra_args,
    _eager_apply_scaled_updates,
    _eager_apply_gradients,
    _eager_nnx_update,
    _eager_grad_scaler_with_skip_limit,
  ],
  ids=lambda f: f.__name__.removeprefix("_eager_"),
)
def test_eager_calls_compile_nothing_after_a_warm_up(make, backend_compiles):
  call = make()
  call(1.0)
  call(float("inf"))
  backend_compiles.clear()
  for value in (2.0, float("nan"), 0.5):
    call(value)
  assert backend_compiles == []


# --------------------------------------------------------------------------
# shard_map over 4 host devices, in a fresh process with a timeout


_SHARD_MAP_SCRIPT = textwrap.dedent(
  """
  import json, sys
  import jax, jax.numpy as jnp, numpy as np, optax
  from jax.sharding import NamedSharding, PartitionSpec as P
  from flax.training import train_state
  import jaxamp
  from jaxamp import flax_utils

  assert jax.device_count() == 4
  mesh = jax.make_mesh((4,), ("data",))
  out = {}
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.5), init_scale=4.0, axis_name="data")
  shard = NamedSharding(mesh, P("data"))
  params = {"w": jax.device_put(jnp.ones(8), shard)}
  state = jax.device_put(tx.init({"w": jnp.ones(8)}), NamedSharding(mesh, P()))

  def refused(fn):
    step = jax.jit(jax.shard_map(lambda p, s, g: fn({"w": p}, s, g), mesh=mesh,
                                 in_specs=(P("data"), P(), P("data")), out_specs=(P(), P()),
                                 check_vma=False))
    try:
      step(params["w"], state, jax.device_put(jnp.ones(8), shard))
    except ValueError as error:
      return str(error).splitlines()[0]
    return None

  out["asu_other"] = refused(
      lambda p, s, g: jaxamp.apply_scaled_updates(tx, {"w": g}, s, p, axis_name="other"))
  def via_train_state(p, s, g):
    ts = train_state.TrainState(step=0, apply_fn=None, params=p, tx=tx, opt_state=s)
    ts = flax_utils.apply_gradients(ts, grads={"w": g}, axis_name="other")
    return ts.params, ts.opt_state
  out["flax_other"] = refused(via_train_state)

  # inf in the shard of device 2 only: every device must skip.
  grads = jax.device_put(jnp.ones(8).at[5].set(jnp.inf), shard)
  def per_device(fn):
    def wrapped(p, s, g):
      p, s = fn(p, s, g)
      return p["w"], s.loss_scale[None], s.found_inf[None]
    specs = (P("data"), P("data"), P("data"))
    return jax.jit(jax.shard_map(wrapped, mesh=mesh, in_specs=(P("data"), P(), P("data")),
                                 out_specs=specs))
  for name, fn in [
      ("asu_default", lambda p, s, g: jaxamp.apply_scaled_updates(tx, {"w": g}, s, {"w": p})),
      ("asu_same", lambda p, s, g: jaxamp.apply_scaled_updates(tx, {"w": g}, s, {"w": p},
                                                               axis_name="data")),
      ("tx_update", lambda p, s, g: (lambda u, s2: (optax.apply_updates({"w": p}, u), s2))(
          *tx.update({"w": g}, s, {"w": p}))),
  ]:
    w, scales, found = per_device(fn)(params["w"], state, grads)
    out[name] = {"w": np.asarray(w).tolist(), "scales": np.asarray(scales).tolist(),
                 "found": np.asarray(found).tolist()}
  # No axis_name anywhere, per-device gradients, the usual specs: the devices
  # would skip different steps; it must be refused, not diverge.
  plain = jaxamp.dynamic_loss_scale(optax.sgd(0.5), init_scale=4.0)
  plain_state = jax.device_put(plain.init({"w": jnp.ones(8)}), NamedSharding(mesh, P()))
  def no_axis(p, s, g):
    new_p, new_s = jaxamp.apply_scaled_updates(plain, {"w": g}, s, {"w": p})
    return new_p["w"], new_s
  try:
    jax.jit(jax.shard_map(no_axis, mesh=mesh, in_specs=(P("data"), P(), P("data")),
                          out_specs=(P("data"), P())))(params["w"], plain_state, grads)
    out["no_axis"] = None
  except Exception as error:
    out["no_axis"] = [type(error).__name__, str(error).splitlines()[0]]
  json.dump(out, open(sys.argv[1], "w"))
  """
)


@pytest.fixture(scope="module")
def shard_map_results(tmp_path_factory):
  """The measurements of ``_SHARD_MAP_SCRIPT`` on 4 host devices (a fresh process)."""
  tmp_path = tmp_path_factory.mktemp("shard_map")
  script, out = tmp_path / "shard_map_check.py", tmp_path / "out.json"
  script.write_text(_SHARD_MAP_SCRIPT)
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(
    PYTHONPATH=str(ROOT),
    JAX_PLATFORMS="cpu",
    XLA_FLAGS="--xla_force_host_platform_device_count=4",
  )
  try:
    proc = subprocess.run(
      [sys.executable, str(script), str(out)],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=240,
      check=False,
    )
  except subprocess.TimeoutExpired:
    pytest.fail("the shard_map checks did not finish within 240 s (a deadlock?)")
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("key", ["asu_other", "flax_other"])
def test_shard_map_mismatched_axis_name_is_refused(shard_map_results, key):
  line = shard_map_results[key]
  assert line is not None, f"{key}: a mismatched axis_name was not refused"
  assert re.search(r"axis_name='other' but .*axis_name='data'", line), line


@pytest.mark.slow
@pytest.mark.parametrize("key", ["asu_default", "asu_same", "tx_update"])
def test_shard_map_inf_on_one_device_skips_on_all(shard_map_results, key):
  result = shard_map_results[key]
  assert result["w"] == [1.0] * 8  # skipped on every device
  assert set(result["found"]) == {True}
  assert set(result["scales"]) == {2.0}


@pytest.mark.slow
def test_shard_map_per_device_gradients_without_axis_name_are_refused(shard_map_results):
  # Each device would check only its own gradients and skip on its own.
  result = shard_map_results["no_axis"]
  assert result is not None, "accepted: the devices may skip different steps"
  kind, line = result
  assert kind == "ValueError" and re.search(r"jaxamp: .*axis_name", line), result
