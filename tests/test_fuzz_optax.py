"""A differential fuzzer: the optax form of jaxamp against torch's loop, run live (issue #30).

Each example draws a composition and runs it for a few iterations beside the torch
loop that means the same, ``torch.amp.GradScaler("cpu")`` with ``torch.optim`` SGD,
Adam or AdamW:

- front-ends: ``tx.update`` + ``optax.apply_updates``, or ``jaxamp.apply_scaled_updates``;
  eager, jitted, or jitted with the params and state donated;
- around the optimizer: ``jaxamp.dynamic_loss_scale`` alone or in
  ``optax.inject_hyperparams``; ``jaxamp.accumulate_gradients`` around it (torch
  sums ``.grad`` over the window), sometimes restored mid-run into another
  ``every_k``; ``param_labels`` (two optimizers, one scaler);
- inside it: clipping (``optax.clip_by_global_norm`` or ``jaxamp.ops.clip_by_torch_norm``;
  torch: ``unscale_`` then ``clip_grad_norm_``), ``optax.inject_hyperparams``,
  learning-rate schedules counted ``"applied"`` or ``"iterations"`` (torch: an
  ``ExponentialLR`` stepped after applied steps only, or every iteration);
- the states deep-copied or pickled between iterations;
- gradients with inf/NaN injected into random leaves at random steps.

Compositions jaxamp refuses are drawn too: a transformation chained in front of the
scaler, two scalers stacked, ``optax.MultiSteps`` around the scaler, a state restored
into a scaler with another configuration. The invariant: each composition matches
torch (the scale's bits, the growth tracker and the skipped steps exactly; params
within rtol 1e-5, atol 1e-6, Adam's within ``ADAM_ATOL``), or is refused by a
ValueError whose first line names the problem, before anything changes.
"""

from __future__ import annotations

import copy
import pickle
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from fuzzing import fuzz_settings
from helpers import bits
from hypothesis import given
from hypothesis import strategies as st

import jaxamp

pytestmark = [pytest.mark.fuzz, pytest.mark.torch]

LR = 0.1
WEIGHT_DECAY = 0.01
GAMMA = 0.5  # the schedules' decay per optimizer step (torch's ExponentialLR)
CLIP = 1.0
RTOL, ATOL = 1e-5, 1e-6
# Adam's m / sqrt(v) is ill-conditioned when the gradients change sign: optax and
# torch, each in float32 with its own order of operations, drift apart (the GradScaler
# fuzzer measured up to 1.3e-5 after 30 steps at lr 0.1).
ADAM_ATOL = 5e-5
SHAPES = ({"w": (3,), "b": (2,)}, {"enc": {"w": (2, 2)}, "head": (3,)})
LABELS = ({"w": "a", "b": "b"}, {"enc": {"w": "a"}, "head": "b"})
POISONS = (np.inf, -np.inf, np.nan)
# Scaler settings, few enough that jaxamp's compile cache is reused across examples.
INIT_SCALES = (1.0, 2.0**7, 2.0**16, 3.0)
GROWTH = ((2.0, 0.5), (1.5, 0.25), (4.0, 0.75))  # float32-representable: injectable
INTERVALS = (1, 2, 2000)

# Optax transformations shared by every example (jaxamp compiles a step per inner
# transformation object: fresh ones would compile again in each example).
_SCHEDULE = optax.exponential_decay(LR, transition_steps=1, decay_rate=GAMMA)
INNER = {
  ("sgd", False): optax.sgd(LR),
  ("sgd", True): optax.sgd(_SCHEDULE),
  ("momentum", False): optax.sgd(LR, momentum=0.9),
  ("momentum", True): optax.sgd(_SCHEDULE, momentum=0.9),
  ("adam", False): optax.adam(LR),
  ("adam", True): optax.adam(_SCHEDULE),
  ("adamw", False): optax.adamw(LR, weight_decay=WEIGHT_DECAY),
  ("adamw", True): optax.adamw(_SCHEDULE, weight_decay=WEIGHT_DECAY),
}
INJECTED = {
  ("sgd", False): optax.inject_hyperparams(optax.sgd)(learning_rate=LR),
  ("sgd", True): optax.inject_hyperparams(optax.sgd)(learning_rate=_SCHEDULE),
  ("momentum", False): optax.inject_hyperparams(optax.sgd)(learning_rate=LR, momentum=0.9),
  ("momentum", True): optax.inject_hyperparams(optax.sgd)(learning_rate=_SCHEDULE, momentum=0.9),
  ("adam", False): optax.inject_hyperparams(optax.adam)(learning_rate=LR),
  ("adam", True): optax.inject_hyperparams(optax.adam)(learning_rate=_SCHEDULE),
  ("adamw", False): optax.inject_hyperparams(optax.adamw)(
    learning_rate=LR, weight_decay=WEIGHT_DECAY
  ),
  ("adamw", True): optax.inject_hyperparams(optax.adamw)(
    learning_rate=_SCHEDULE, weight_decay=WEIGHT_DECAY
  ),
}
CLIPS = {
  "optax": optax.clip_by_global_norm(CLIP),
  "torch": jaxamp.ops.clip_by_torch_norm(CLIP),
}
_CHAINS: dict = {}


def _chained(clip: str, inner: optax.GradientTransformation) -> optax.GradientTransformation:
  key = (clip, id(inner))
  if key not in _CHAINS:
    _CHAINS[key] = optax.chain(CLIPS[clip], inner)
  return _CHAINS[key]


class Scenario(NamedTuple):
  shapes: int  # index into SHAPES
  kind: str  # sgd, momentum, adam, adamw
  kinds_b: str | None  # with param_labels: the optimizer of group "b"
  schedule: bool
  schedule_counts: str
  clip: str | None
  inject_inner: bool
  inject_scaler: bool
  init_scale: float
  growth: tuple[float, float]
  growth_interval: int
  every_k: int | None  # accumulate_gradients' window; None: no accumulation
  restore_every_k: tuple[int, int] | None  # (after this many calls, resume with this every_k)
  front_end: str  # update, fused
  mode: str  # eager, jit, donate
  copies: tuple[str, ...]  # per call: none, deepcopy, pickle
  refused: str | None  # in_front, stacked, multisteps, other_config
  grads: tuple  # per call: {leaf path: float32 array}, scaled later
  seed: int


@st.composite
def scenarios(draw) -> Scenario:
  shapes = draw(st.sampled_from(range(len(SHAPES))))
  labelled = draw(st.booleans())
  every_k = draw(st.sampled_from([None, None, 2, 3]))
  calls = draw(st.integers(2, 5)) * (every_k or 1)
  restore = None
  if every_k is not None and draw(st.booleans()):
    restore = (draw(st.integers(1, calls - 1)), draw(st.sampled_from([1, 2, 3, 4])))
  n_leaves = len(jax.tree.leaves(SHAPES[shapes], is_leaf=lambda x: isinstance(x, tuple)))
  poisoned = draw(
    st.lists(
      st.tuples(st.integers(0, calls - 1), st.integers(0, n_leaves - 1), st.sampled_from(POISONS)),
      max_size=3,
    )
  )
  refused = draw(st.sampled_from([None] * 12 + ["in_front", "stacked", "multisteps", "other"]))
  return Scenario(
    shapes=shapes,
    kind=draw(st.sampled_from(["sgd", "momentum", "adam", "adamw"])),
    kinds_b=draw(st.sampled_from(["sgd", "adam"])) if labelled else None,
    schedule=draw(st.booleans()),
    schedule_counts=draw(st.sampled_from(["applied", "iterations"])),
    clip=None if labelled else draw(st.sampled_from([None, None, "optax", "torch"])),
    inject_inner=draw(st.booleans()),
    inject_scaler=refused != "other" and draw(st.booleans()),
    init_scale=draw(st.sampled_from(INIT_SCALES)),
    growth=draw(st.sampled_from(GROWTH)),
    growth_interval=draw(st.sampled_from(INTERVALS)),
    every_k=every_k,
    restore_every_k=restore,
    front_end=draw(st.sampled_from(["update", "fused"])),
    mode=draw(st.sampled_from(["eager", "jit", "donate"])),
    copies=tuple(
      draw(st.sampled_from(["none", "none", "deepcopy", "pickle"])) for _ in range(calls)
    ),
    refused=refused,
    grads=tuple(sorted(poisoned)),
    seed=draw(st.integers(0, 2**16)),
  )


# -------------------------------------------------------------------------------------
# The jaxamp side.
# -------------------------------------------------------------------------------------


def _inner(sc: Scenario, kind: str) -> optax.GradientTransformation:
  inner = (INJECTED if sc.inject_inner else INNER)[(kind, sc.schedule)]
  return inner if sc.clip is None else _chained(sc.clip, inner)


def _scaler(sc: Scenario, every_k: int | None, *, other_config: bool = False):
  growth_factor, backoff_factor = sc.growth
  options = {
    "init_scale": sc.init_scale,
    "growth_factor": growth_factor,
    "backoff_factor": backoff_factor,
    "growth_interval": sc.growth_interval + (7 if other_config else 0),
    "schedule_counts": sc.schedule_counts,
  }
  if sc.kinds_b is not None:
    inner = {"a": _inner(sc, sc.kind), "b": _inner(sc, sc.kinds_b)}
    options["param_labels"] = LABELS[sc.shapes]
  else:
    inner = _inner(sc, sc.kind)
  if sc.inject_scaler:
    static = ("schedule_counts", "param_labels")
    make = optax.inject_hyperparams(
      jaxamp.dynamic_loss_scale, static_args=static, hyperparam_dtype=jnp.float32
    )
    tx = make(inner, **options)
  else:
    tx = jaxamp.dynamic_loss_scale(inner, **options)
  if sc.refused == "in_front":
    tx = optax.chain(CLIPS["optax"], tx)
  elif sc.refused == "stacked":
    tx = jaxamp.dynamic_loss_scale(tx)
  elif sc.refused == "multisteps":
    tx = optax.MultiSteps(tx, every_k or 2, use_grad_mean=False)
  if every_k is not None and sc.refused != "multisteps":
    tx = jaxamp.accumulate_gradients(tx, every_k)
  return tx


def _stepper(sc: Scenario, tx):
  if sc.front_end == "update":

    def step(params, state, grads):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

  else:

    def step(params, state, grads):
      return jaxamp.apply_scaled_updates(tx, grads, state, params)

  if sc.mode == "eager":
    return step
  return jax.jit(step, donate_argnums=(0, 1) if sc.mode == "donate" else ())


def _copied(how: str, state: Any) -> Any:
  if how == "deepcopy":
    return copy.deepcopy(state)
  if how == "pickle":
    return pickle.loads(pickle.dumps(state))
  return state


def _raw_grads(sc: Scenario, calls: int) -> list[dict]:
  """Per call, unscaled float32 gradients like the params, with the poisons in place."""
  rng = np.random.default_rng(sc.seed)
  out = []
  for call in range(calls):
    tree = jax.tree.map(
      lambda s: rng.normal(size=s).astype(np.float32),
      SHAPES[sc.shapes],
      is_leaf=lambda x: isinstance(x, tuple),
    )
    leaves, treedef = jax.tree.flatten(tree)
    for at, leaf, value in sc.grads:
      if at == call:
        leaves[leaf] = leaves[leaf].copy()
        leaves[leaf].reshape(-1)[rng.integers(leaves[leaf].size)] = value
    out.append(jax.tree.unflatten(treedef, leaves))
  return out


def _scaled(raw: dict, scale: np.float32) -> dict:
  """``raw`` times ``scale``, each product rounded once to float32, as both sides see it."""
  return jax.tree.map(lambda x: x * scale, raw)


def _params(sc: Scenario) -> dict:
  rng = np.random.default_rng(sc.seed + 1)
  return jax.tree.map(
    lambda s: rng.normal(size=s).astype(np.float32),
    SHAPES[sc.shapes],
    is_leaf=lambda x: isinstance(x, tuple),
  )


class Record(NamedTuple):
  scale: np.float32  # the scale the call's gradients were multiplied by
  stepped: bool  # the call ended a window (the optimizer step or skip ran)
  found_inf: bool
  growth_tracker: int
  scale_after: np.float32
  params: dict


def _calls(sc: Scenario) -> int:
  return len(sc.copies)


def _window_ends(sc: Scenario) -> list[bool]:
  """Which calls end a window, as jaxamp.accumulate_gradients counts (a state restored
  into a shorter window ends it on the next call)."""
  if sc.every_k is None:
    return [True] * _calls(sc)
  ends, mini, every_k = [], 0, sc.every_k
  for call in range(_calls(sc)):
    if sc.restore_every_k is not None and call == sc.restore_every_k[0]:
      every_k = sc.restore_every_k[1]
    end = mini >= every_k - 1
    ends.append(end)
    mini = 0 if end else mini + 1
  return ends


def run_jaxamp(sc: Scenario, raw: list[dict]) -> list[Record]:
  tx = _scaler(sc, sc.every_k)
  params = jax.tree.map(jnp.asarray, _params(sc))
  state = tx.init(params)
  step = _stepper(sc, tx)
  out = []
  for call, (how, g) in enumerate(zip(sc.copies, raw)):
    if sc.restore_every_k is not None and call == sc.restore_every_k[0]:
      tx = _scaler(sc, sc.restore_every_k[1])
      step = _stepper(sc, tx)
    scale = np.float32(jaxamp.get_loss_scale(state))
    grads = jax.tree.map(jnp.asarray, _scaled(g, scale))
    params, state = step(params, state, grads)
    state = _copied(how, state)
    inner = jaxamp.ops.find_loss_scale_state(state)
    out.append(
      Record(
        scale,
        _window_ends(sc)[call],
        bool(inner.found_inf),
        int(inner.growth_tracker),
        np.float32(inner.loss_scale),
        jax.tree.map(np.array, params),  # a copy: a donating step reuses the buffer
      )
    )
  return out


# -------------------------------------------------------------------------------------
# The torch side: the loop the composition means.
# -------------------------------------------------------------------------------------


def _torch_optimizer(kind: str, params: list) -> torch.optim.Optimizer:
  if kind == "sgd":
    return torch.optim.SGD(params, lr=LR)
  if kind == "momentum":
    return torch.optim.SGD(params, lr=LR, momentum=0.9)
  if kind == "adam":
    return torch.optim.Adam(params, lr=LR)
  return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


def run_torch(sc: Scenario, raw: list[dict], scales: list[np.float32]) -> list[Record]:
  flat, treedef = jax.tree_util.tree_flatten_with_path(_params(sc))
  tensors = [torch.nn.Parameter(torch.tensor(np.array(x))) for _, x in flat]
  if sc.kinds_b is None:
    groups = {"a": tensors}
    kinds = {"a": sc.kind}
  else:
    labels = jax.tree.leaves(LABELS[sc.shapes])
    groups = {g: [t for t, lab in zip(tensors, labels) if lab == g] for g in ("a", "b")}
    kinds = {"a": sc.kind, "b": sc.kinds_b}
  opts = {g: _torch_optimizer(kinds[g], groups[g]) for g in groups}
  scheds = {g: torch.optim.lr_scheduler.ExponentialLR(o, GAMMA) for g, o in opts.items()}
  growth_factor, backoff_factor = sc.growth
  scaler = torch.amp.GradScaler(
    "cpu",
    init_scale=sc.init_scale,
    growth_factor=growth_factor,
    backoff_factor=backoff_factor,
    growth_interval=sc.growth_interval,
  )
  scaler.scale(torch.tensor(1.0))  # initialises the scale
  out = []
  ends = _window_ends(sc)
  for call, g in enumerate(raw):
    scale = np.float32(scaler.get_scale())
    for t, leaf in zip(tensors, jax.tree.leaves(g)):
      scaled = torch.tensor(leaf * scales[call])  # the same float32 product as jaxamp's
      t.grad = scaled if t.grad is None else t.grad + scaled
    found = False
    if ends[call]:
      for name, opt in opts.items():
        if sc.clip is not None:
          scaler.unscale_(opt)
          torch.nn.utils.clip_grad_norm_(groups[name], CLIP)
        scaler.step(opt)
        found_here = sum(
          v.item() for v in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values()
        )
        found = found or bool(found_here)
        if sc.schedule and (sc.schedule_counts == "iterations" or not found_here):
          with warnings.catch_warnings():  # E29: the first optimizer.step was skipped
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
            scheds[name].step()
      scaler.update()
      for opt in opts.values():
        opt.zero_grad(set_to_none=True)
    params = jax.tree.unflatten(treedef, [t.detach().numpy().copy() for t in tensors])
    tracker = int(scaler._growth_tracker.item())
    out.append(Record(scale, ends[call], found, tracker, np.float32(scaler.get_scale()), params))
  return out


# -------------------------------------------------------------------------------------
# The fuzzer.
# -------------------------------------------------------------------------------------


def _tolerance(sc: Scenario) -> float:
  adam = {sc.kind, sc.kinds_b} & {"adam", "adamw"}
  return ADAM_ATOL if adam else ATOL


REFUSALS = {
  "in_front": r"^jaxamp: a transformation is chained in front of dynamic_loss_scale",
  "stacked": r"^jaxamp: a dynamic_loss_scale is wrapped inside another",
  "multisteps": r"^jaxamp: optax.MultiSteps is around dynamic_loss_scale.*accumulate_gradients",
  "other": r"^jaxamp: this state was made by a dynamic_loss_scale built with another",
}


def _check_refused(sc: Scenario, raw: list[dict]) -> None:
  """The composition is refused by a clear error, and nothing it was given changes."""
  tx = _scaler(sc, sc.every_k)
  params = jax.tree.map(jnp.asarray, _params(sc))
  state = tx.init(params)
  grads = jax.tree.map(jnp.asarray, raw[0])
  before = bits((params, state, grads))
  if sc.refused == "other":  # restored into a scaler built with other settings
    other = _scaler(sc._replace(refused=None), sc.every_k, other_config=True)
    state = other.init(params)
    before = bits((params, state, grads))
    call = lambda: _stepper(sc._replace(refused=None), tx)(params, state, grads)
  else:
    call = lambda: jaxamp.scale_loss(jnp.float32(1.0), state)
  with pytest.raises(ValueError, match=REFUSALS[sc.refused]):
    call()
  assert bits((params, state, grads)) == before


@fuzz_settings(9, long_examples=150)
@given(scenarios())
def test_fuzz_optax_form_matches_torch_or_refuses(sc):
  raw = _raw_grads(sc, _calls(sc))
  if sc.refused is not None:
    _check_refused(sc, raw)
    return
  ours = run_jaxamp(sc, raw)
  theirs = run_torch(sc, raw, [r.scale for r in ours])
  atol = _tolerance(sc)
  for call, (a, b) in enumerate(zip(ours, theirs)):
    where = f"call {call} of {sc}"
    assert a.scale.tobytes() == b.scale.tobytes(), f"scale {a.scale} != {b.scale}: {where}"
    if a.stepped:
      assert a.found_inf == b.found_inf, f"skip {a.found_inf} != {b.found_inf}: {where}"
    assert a.growth_tracker == b.growth_tracker, f"growth tracker: {where}"
    assert a.scale_after.tobytes() == b.scale_after.tobytes(), f"scale after: {where}"
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
      np.testing.assert_allclose(x, y, rtol=RTOL, atol=atol, err_msg=where)
