"""A stateful differential fuzzer: ``jaxamp.GradScaler`` + ``jaxamp.Optimizer`` against
``torch.amp.GradScaler("cpu")`` + ``torch.optim``, call for call (issue #30).

Hypothesis drives both libraries side by side through random sequences of valid and
invalid calls: ``scale`` of nested outputs, gradients with inf/NaN injected,
``unscale_``, clipping, ``step``, ``update()``/``update(new_scale)``, state dicts loaded
both ways, accumulation, ``zero_grad``, setters, copies and pickles of scalers and
optimizers (the copy then continues), and worker threads running an iteration, some
raising in the middle. After every call: the same calls succeed or fail with the same
exception family (torch's asserts are jaxamp's ``RuntimeError``); the same scale bits,
growth tracker, per-optimizer stages and gradients; parameters within float32
rounding; and a call jaxamp refuses changes nothing. The deliberate differences it
maps are in docs/torch_semantics.md (§1.4, §1.6, §1.10, §1.13).
"""

from __future__ import annotations

import copy
import pickle
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from fuzzing import fuzz_settings
from helpers import bits
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import jaxamp

pytestmark = [pytest.mark.fuzz, pytest.mark.torch]

LR = 0.1
# One transformation object per kind, shared by every example: jaxamp compiles a step
# per transformation, so fresh ones would compile again in each example.
TRANSFORMS = {
  "sgd": optax.sgd(LR),
  "momentum": optax.sgd(LR, momentum=0.9),
  "adam": optax.adam(LR),
}
GRAD_VALUES = np.array([0.0, 0.5, -1.0, 2.0, -3.25, 0.125, 7.0], np.float32)
POISONS = (np.inf, -np.inf, np.nan)
NORM_TYPES = (2.0, 1.0, 3.5, 0.5, float("inf"), float("-inf"), 0.0, -1.0, "inf", "-inf", 2)
RTOL, ATOL = 1e-5, 1e-6
# Adam's m / sqrt(v) is ill-conditioned when gradients change sign: optax and torch,
# both in float32 with their own order of operations, drift apart by up to 1.3e-5
# after 30 steps at lr 0.1 (measured over 200 random runs of the values below).
ADAM_ATOL = 5e-5
TWO_THREADS = "is being used from two threads"
NONE_GRADIENT = re.compile(r"^jaxamp: the gradient of \S+ is None")


class UserError(Exception):
  """What the user's own code raises between two scaler calls."""


class Outcome:
  """One side's result of a call: its return value, or the exception it raised."""

  def __init__(self, fn):
    self.value, self.error = None, None
    try:
      self.value = fn()
    except Exception as error:  # noqa: BLE001 (compared with the other side's)
      self.error = error


def _family(torch_error: BaseException) -> type[BaseException]:
  """The exception type jaxamp raises for ``torch_error``: a RuntimeError where torch
  asserts (so ``python -O`` keeps the check), else torch's own type."""
  if isinstance(torch_error, AssertionError):
    return RuntimeError
  if isinstance(torch_error, UserError):
    return UserError
  for family in (RuntimeError, ValueError, KeyError, TypeError, AttributeError):
    if isinstance(torch_error, family):
      return family
  return type(torch_error)


def _stage(jax_scaler, jax_opt, torch_scaler, torch_opt) -> tuple[str, str]:
  """Each library's stage (READY/UNSCALED/STEPPED) for one optimizer pair: jaxamp's
  from its record (keyed by the optimizer's identity key), torch's from
  ``_per_optimizer_states[id(optimizer)]`` (read without creating the entry)."""
  record = jax_scaler._states.get(jax_opt._key)
  jax_stage = "READY" if record is None else record.stage.name
  states = getattr(torch_scaler, "_per_optimizer_states", {})
  entry = states.get(id(torch_opt)) if id(torch_opt) in states else None
  torch_stage = "READY" if entry is None else entry["stage"].name
  return jax_stage, torch_stage


def _same_floats(a, b, *, exact: bool, what: str, atol: float = ATOL) -> None:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  assert a.shape == b.shape, (what, a.shape, b.shape)
  if exact:
    nan = np.isnan(a)
    np.testing.assert_array_equal(nan, np.isnan(b), err_msg=what)
    assert bits(np.where(nan, 0, a)) == bits(np.where(nan, 0, b)), (what, a, b)
  else:
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=atol, equal_nan=True, err_msg=what)


class GradScalerMachine(RuleBasedStateMachine):
  """Both libraries' scaler and optimizers, driven by the same calls."""

  # -- setup -----------------------------------------------------------------------

  @initialize(
    enabled=st.integers(0, 4).map(bool),
    init_scale=st.sampled_from([1.0, 2.0, 3.0, 0.75, 1024.0, 2.0**16, 2.0**-3]),
    growth_factor=st.sampled_from([2.0, 1.5, 4.0]),
    backoff_factor=st.sampled_from([0.5, 0.25, 0.75]),
    growth_interval=st.sampled_from([1, 2, 3, 2000]),
    optimizers=st.lists(
      st.tuples(
        st.sampled_from(sorted(TRANSFORMS)),
        st.lists(st.sampled_from([2, 3]), min_size=1, max_size=3),
      ),
      min_size=1,
      max_size=3,
    ),
    seed=st.integers(0, 2**16),
  )
  def setup(
    self, enabled, init_scale, growth_factor, backoff_factor, growth_interval, optimizers, seed
  ):
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    options = {
      "init_scale": init_scale,
      "growth_factor": growth_factor,
      "backoff_factor": backoff_factor,
      "growth_interval": growth_interval,
      "enabled": enabled,
    }
    self.jax_scaler = jaxamp.GradScaler(**options)
    self.torch_scaler = torch.amp.GradScaler("cpu", **options)
    self.jax_opts, self.torch_opts, self.kinds, self.replaced = [], [], [], []
    for kind, sizes in optimizers:
      values = [rng.normal(size=n).astype(np.float32) for n in sizes]
      params = {f"p{k}": jnp.asarray(v) for k, v in enumerate(values)}
      self.jax_opts.append(jaxamp.Optimizer(TRANSFORMS[kind], params))
      torch_params = [torch.nn.Parameter(torch.tensor(v)) for v in values]
      if kind == "sgd":
        self.torch_opts.append(torch.optim.SGD(torch_params, lr=LR))
      elif kind == "momentum":
        self.torch_opts.append(torch.optim.SGD(torch_params, lr=LR, momentum=0.9))
      else:
        self.torch_opts.append(torch.optim.Adam(torch_params, lr=LR))
      # jaxamp's grads start as zeros like params (one pytree structure throughout).
      for p in torch_params:
        p.grad = torch.zeros_like(p)
      self.kinds.append(kind)
    # Whether the main thread is inside an iteration on the jaxamp scaler (it then
    # owns it, and a worker thread's calls are refused).
    self.main_owns = False

  # -- helpers ------------------------------------------------------------------------

  @property
  def enabled(self) -> bool:
    return self.jax_scaler.is_enabled()

  def snapshot(self):
    """Everything a jaxamp call could change, as bytes and static data."""
    scaler = self.jax_scaler
    leaves, treedef = jax.tree.flatten((scaler, tuple(self.jax_opts)))
    extra = (scaler._scaled, scaler._init_growth_tracker, scaler.__dict__.get("_owner"))
    return treedef, bits(leaves), extra, [o._key for o in self.jax_opts]

  def both(self, jax_fn, torch_fn, *, families=None):
    """Calls jaxamp, then torch; checks that both succeed or both fail (with the
    same family of exception) and that a refused jaxamp call changed nothing."""
    before = self.snapshot()
    jax_out = Outcome(jax_fn)
    if jax_out.error is not None:
      assert self.snapshot() == before, (
        f"the refused call changed jaxamp's objects: {jax_out.error!r}"
      )
    torch_out = Outcome(torch_fn)
    self.compare(jax_out, torch_out, families)
    return jax_out, torch_out

  @staticmethod
  def compare(jax_out, torch_out, families=None):
    if torch_out.error is None:
      assert jax_out.error is None, f"jaxamp raised {jax_out.error!r}; torch succeeded"
      return
    assert jax_out.error is not None, f"torch raised {torch_out.error!r}; jaxamp succeeded"
    family = (families or {}).get(type(torch_out.error)) or _family(torch_out.error)
    assert isinstance(jax_out.error, family), (jax_out.error, torch_out.error)

  def torch_params(self, i):
    return self.torch_opts[i].param_groups[0]["params"]

  def jax_grad_leaves(self, i):
    opt = self.jax_opts[i]
    if opt.grads is None:
      return [None] * len(opt.params)
    return [opt.grads[k] for k in sorted(opt.params)]

  def draw_grads(self, data, i, *, scaled=True):
    """One optimizer's gradients as NumPy arrays (``None``: no gradient), times the
    scale, with inf/NaN injected into random leaves."""
    scale = np.float32(self.jax_scaler.get_scale()) if scaled else np.float32(1.0)
    grads = []
    for p in self.torch_params(i):
      n = p.numel()
      picks = data.draw(st.lists(st.integers(0, len(GRAD_VALUES) - 1), min_size=n, max_size=n))
      g = GRAD_VALUES[picks] * scale
      poison = data.draw(st.sampled_from((None,) * 6 + POISONS))
      if poison is not None:
        g[data.draw(st.integers(0, n - 1))] = poison
      grads.append(g.astype(np.float32))
    return grads

  def set_grads(self, i, grads):
    keys = sorted(self.jax_opts[i].params)
    if all(g is None for g in grads):
      self.jax_opts[i].grads = None
    else:
      self.jax_opts[i].grads = {
        k: None if g is None else jnp.asarray(g) for k, g in zip(keys, grads)
      }
    for p, g in zip(self.torch_params(i), grads):
      p.grad = None if g is None else torch.tensor(g)

  # -- the calls ------------------------------------------------------------------------

  @rule(data=st.data())
  def scale(self, data):
    kind = data.draw(
      st.sampled_from(
        ["f32", "f16", "f32_vector", "f16_vector", "list", "tuple", "nested", "empty"]
        + ["float", "none", "list_with_float", "tuple_with_none", "dict"]
      )
    )
    value = data.draw(st.sampled_from([1.0, 2.0, 0.5, -3.0, 1000.0, 0.0]))

    def make(lib):
      array = (
        (lambda v, d: jnp.asarray(v, d))
        if lib == "jax"
        else (lambda v, d: torch.tensor(v, dtype=d))
      )
      f32 = jnp.float32 if lib == "jax" else torch.float32
      f16 = jnp.float16 if lib == "jax" else torch.float16
      return {
        "f32": lambda: array(value, f32),
        "f16": lambda: array(value, f16),
        "f32_vector": lambda: array([value, 1.5], f32),
        "f16_vector": lambda: array([value, 1.5], f16),
        "list": lambda: [array(value, f32), array([value], f16)],
        "tuple": lambda: (array(value, f32),),
        "nested": lambda: [array(value, f32), (array(2.0, f16), [array([value, 3.0], f32)])],
        "empty": list,
        "float": lambda: value,
        "none": lambda: None,
        # The bad element first: torch raises before scaling anything (a tensor
        # first would initialise its scale, which jaxamp's refusal does not change).
        "list_with_float": lambda: [value, array(value, f32)],
        "tuple_with_none": lambda: (None, array(value, f32)),
        "dict": lambda: {"loss": array(value, f32)},
      }[kind]()

    jax_in, torch_in = make("jax"), make("torch")
    if self.enabled and kind == "dict":
      # Deliberate difference (§1.4): torch turns an iterable other than a list or a
      # tuple (here a dict) into a lazy map and scales nothing; jaxamp refuses it.
      before = self.snapshot()
      jax_out = Outcome(lambda: self.jax_scaler.scale(jax_in))
      assert isinstance(jax_out.error, ValueError), jax_out.error
      assert self.snapshot() == before
      assert isinstance(self.torch_scaler.scale(torch_in), map)
      return
    jax_out, torch_out = self.both(
      lambda: self.jax_scaler.scale(jax_in), lambda: self.torch_scaler.scale(torch_in)
    )
    if not self.enabled:
      assert jax_out.value is jax_in and torch_out.value is torch_in
      return
    if jax_out.error is None:
      self.main_owns = True
      jax_leaves, jax_def = jax.tree.flatten(jax_out.value)
      torch_leaves = jax.tree.leaves(torch_out.value)
      assert len(jax_leaves) == len(torch_leaves), (jax_out.value, torch_out.value)
      assert jax_def == jax.tree.structure(torch_out.value), (jax_out.value, torch_out.value)
      for a, t in zip(jax_leaves, torch_leaves):
        assert str(a.dtype) == str(t.dtype).removeprefix("torch."), (a.dtype, t.dtype)
        _same_floats(np.asarray(a, np.float32), t.float().numpy(), exact=True, what="scale()")

  @rule(data=st.data())
  def assign_grads(self, data):
    """``loss.backward()`` into zeroed or fresh grads: the scaled gradients, as given."""
    i = data.draw(st.integers(0, len(self.jax_opts) - 1))
    grads = self.draw_grads(data, i)
    shape = data.draw(st.sampled_from(["all"] * 8 + ["none", "some_none"]))
    if shape == "none":
      grads = [None] * len(grads)
    elif shape == "some_none" and len(grads) > 1:
      grads[data.draw(st.integers(0, len(grads) - 1))] = None
    self.set_grads(i, grads)

  @rule(data=st.data())
  def accumulate(self, data):
    """A second ``backward()``: jaxamp's ``Optimizer.accumulate`` vs torch's ``.grad +=``."""
    i = data.draw(st.integers(0, len(self.jax_opts) - 1))
    grads = self.draw_grads(data, i)
    keys = sorted(self.jax_opts[i].params)

    def torch_accumulate():
      for p, g in zip(self.torch_params(i), grads):
        if p.grad is None:
          p.grad = torch.tensor(g)
        else:
          p.grad += torch.tensor(g)

    self.both(
      lambda: self.jax_opts[i].accumulate({k: jnp.asarray(g) for k, g in zip(keys, grads)}),
      torch_accumulate,
    )

  @rule(data=st.data())
  def zero_grad(self, data):
    i = data.draw(st.integers(0, len(self.jax_opts) - 1))
    set_to_none = data.draw(st.booleans())
    self.both(
      lambda: self.jax_opts[i].zero_grad(set_to_none=set_to_none),
      lambda: self.torch_opts[i].zero_grad(set_to_none=set_to_none),
    )
    if not set_to_none:
      # Deliberate difference (docs/torch_semantics.md §1.13): jaxamp zeroes every
      # gradient (one pytree structure), torch keeps a None gradient None.
      for p in self.torch_params(i):
        if p.grad is None:
          p.grad = torch.zeros_like(p)

  @rule(data=st.data())
  def unscale_(self, data):
    i = data.draw(st.integers(0, len(self.jax_opts) - 1))
    jax_out, _ = self.both(
      lambda: self.jax_scaler.unscale_(self.jax_opts[i]),
      lambda: self.torch_scaler.unscale_(self.torch_opts[i]),
    )
    if jax_out.error is None and self.enabled:
      self.main_owns = True
      self.check_grads(i, exact=True)

  @rule(
    data=st.data(),
    max_norm=st.sampled_from([0.5, 1.0, 10.0, 1e4]),
    norm_type=st.sampled_from(NORM_TYPES),
  )
  def clip(self, data, max_norm, norm_type):
    """``clip_grad_norm_`` of one optimizer's gradients (scaled or not)."""
    i = data.draw(st.integers(0, len(self.jax_opts) - 1))
    opt = self.jax_opts[i]

    def jax_clip():
      grads, norm = jaxamp.clip_grad_norm(opt.grads, max_norm, norm_type)
      opt.grads = grads
      return norm

    jax_out, torch_out = self.both(
      jax_clip,
      lambda: torch.nn.utils.clip_grad_norm_(self.torch_params(i), max_norm, norm_type),
    )
    if jax_out.error is None:
      what = f"clip_grad_norm norm_type={norm_type!r}"
      _same_floats(jax_out.value, torch_out.value.numpy(), exact=False, what=what)
      self.check_grads(i, exact=False)

  @rule(data=st.data())
  def step(self, data):
    i = data.draw(st.integers(0, len(self.jax_opts) - 1))
    closure = data.draw(st.integers(0, 9)) == 0
    kwargs = {"closure": lambda: None} if closure else {}
    missing = any(g is None for g in self.jax_grad_leaves(i))
    stage_before = _stage(self.jax_scaler, self.jax_opts[i], self.torch_scaler, self.torch_opts[i])
    before = self.snapshot()
    jax_out = Outcome(lambda: self.jax_scaler.step(self.jax_opts[i], **kwargs))
    if isinstance(jax_out.error, ValueError) and NONE_GRADIENT.match(str(jax_out.error)):
      # Deliberate difference (§1.13): an optimizer whose state holds a parameter (optax's
      # Adam) cannot skip it, so jaxamp refuses a step with a None gradient for it,
      # where torch steps the other parameters.
      assert missing, jax_out.error
      assert self.snapshot() == before
      return
    if jax_out.error is not None:
      assert self.snapshot() == before, (
        f"the refused step changed jaxamp's objects: {jax_out.error!r}"
      )
    torch_out = Outcome(lambda: self.torch_scaler.step(self.torch_opts[i], **kwargs))
    self.compare(jax_out, torch_out)
    if jax_out.error is None and self.enabled:
      self.main_owns = True
    refused_from_ready = stage_before == ("READY", "READY")
    if refused_from_ready and str(torch_out.error).startswith("No inf checks"):
      # Deliberate difference (§1.6): jaxamp's refused step leaves the stage READY,
      # torch leaves an UNSCALED entry with no checks.
      entry = self.torch_scaler._per_optimizer_states.get(id(self.torch_opts[i]))
      assert entry is not None and not entry["found_inf_per_device"]
      del self.torch_scaler._per_optimizer_states[id(self.torch_opts[i])]

  @rule(data=st.data())
  def update(self, data):
    kind = data.draw(st.sampled_from(["none"] * 6 + ["float", "array", "int"]))
    new = data.draw(st.sampled_from([1.0, 2.0**10, 3.0, 0.5, 2.0**-20]))
    jax_arg, torch_arg, families = None, None, None
    if kind == "float":
      jax_arg = torch_arg = new
    elif kind == "array":
      jax_arg, torch_arg = jnp.float32(new), torch.tensor(new, dtype=torch.float32)
    elif kind == "int":
      # torch: AttributeError ('int' object has no attribute 'device'); jaxamp: TypeError.
      jax_arg = torch_arg = int(new) or 1
      families = {AttributeError: TypeError}
    jax_out, _ = self.both(
      lambda: self.jax_scaler.update(jax_arg),
      lambda: self.torch_scaler.update(torch_arg),
      families=families,
    )
    if jax_out.error is None:
      self.main_owns = False

  @rule(data=st.data())
  def setters(self, data):
    name = data.draw(st.sampled_from(["growth_factor", "backoff_factor", "growth_interval"]))
    value = data.draw(
      st.sampled_from(
        {"growth_factor": [2.0, 3.0], "backoff_factor": [0.5, 0.25]}.get(name, [1, 2, 5])
      )
    )
    self.both(
      lambda: getattr(self.jax_scaler, f"set_{name}")(value),
      lambda: getattr(self.torch_scaler, f"set_{name}")(value),
    )

  @rule(data=st.data())
  def state_dicts(self, data):
    source = data.draw(st.sampled_from(["torch", "jax", "changed", "empty", "no_scale", "none"]))
    if source == "none":
      self.both(self.jax_scaler.state_dict, self.torch_scaler.state_dict)
      return
    sd = (self.torch_scaler if source == "torch" else self.jax_scaler).state_dict()
    if source in ("changed", "no_scale") and sd:
      sd = dict(sd)
      sd["scale"] = data.draw(st.sampled_from([1.0, 2.0**10, 3.0, 0.5]))
      sd["_growth_tracker"] = data.draw(st.integers(0, 5))
      if source == "no_scale":
        del sd["scale"]  # torch reads "scale" first: a KeyError before any change
    if source == "empty":
      sd = {}
    self.both(
      lambda: self.jax_scaler.load_state_dict(dict(sd)),
      lambda: self.torch_scaler.load_state_dict(dict(sd)),
    )

  @rule(how=st.sampled_from(["deepcopy", "pickle", "copy"]))
  def copy_scaler(self, how):
    """A copy of the scaler continues instead of the original, on both sides."""
    fn = {
      "deepcopy": copy.deepcopy,
      "copy": copy.copy,
      "pickle": lambda x: pickle.loads(pickle.dumps(x)),
    }[how]
    jax_out, torch_out = self.both(lambda: fn(self.jax_scaler), lambda: fn(self.torch_scaler))
    if jax_out.error is None:
      self.jax_scaler, self.torch_scaler = jax_out.value, torch_out.value
      self.main_owns = False  # a copy starts unowned

  @rule(data=st.data())
  def copy_optimizer(self, data):
    """A deep copy of one optimizer continues instead of it: a new optimizer to the
    scaler (torch keys its records by ``id(optimizer)``)."""
    i = data.draw(st.integers(0, len(self.jax_opts) - 1))
    originals = self.torch_params(i)
    jax_out, torch_out = self.both(
      lambda: copy.deepcopy(self.jax_opts[i]), lambda: copy.deepcopy(self.torch_opts[i])
    )
    # The original stays alive: torch keys its records by id(), which a new object
    # could otherwise reuse, taking over the original's stage.
    self.replaced.append(self.torch_opts[i])
    self.jax_opts[i], self.torch_opts[i] = jax_out.value, torch_out.value
    # Deliberate difference (§1.13): torch's Parameter.__deepcopy__ drops .grad,
    # jaxamp's copy keeps opt.grads; give torch's copy the same gradients.
    for original, copied in zip(originals, self.torch_params(i)):
      copied.grad = None if original.grad is None else original.grad.clone()

  @rule(data=st.data())
  def worker_iteration(self, data):
    """A worker thread runs an iteration (scale, grads, maybe unscale_, step, update),
    or raises in the middle of it (the user's code); then the main thread continues."""
    i = data.draw(st.integers(0, len(self.jax_opts) - 1))
    grads = self.draw_grads(data, i)
    unscale = data.draw(st.booleans())
    raise_at = data.draw(st.sampled_from([None, None, "scale", "unscale_", "step"]))

    def calls(scaler, opt, lib):
      loss = jnp.float32(2.0) if lib == "jax" else torch.tensor(2.0)
      keys = sorted(self.jax_opts[i].params)
      seq = [("scale", lambda: scaler.scale(loss))]

      def assign():
        if lib == "jax":
          opt.grads = {k: jnp.asarray(g) for k, g in zip(keys, grads)}
        else:
          for p, g in zip(opt.param_groups[0]["params"], grads):
            p.grad = torch.tensor(g)

      seq.append(("grads", assign))
      if unscale:
        seq.append(("unscale_", lambda: scaler.unscale_(opt)))
      seq += [("step", lambda: scaler.step(opt)), ("update", scaler.update)]
      if raise_at is not None:
        at = [name for name, _ in seq].index(raise_at if raise_at in dict(seq) else "step")
        seq.insert(at + 1, ("user", lambda: (_ for _ in ()).throw(UserError("user code"))))
      return seq

    def run(seq, out, snapshot=None):
      for name, fn in seq:
        before = snapshot() if snapshot else None
        outcome = Outcome(fn)
        if outcome.error is not None and snapshot and name != "user":
          assert snapshot() == before, f"the refused {name} changed jaxamp's objects"
        out.append((name, outcome))
        if outcome.error is not None:
          return

    def in_thread(seq, snapshot=None):
      out = []
      worker = threading.Thread(target=run, args=(seq, out, snapshot))
      worker.start()
      worker.join()
      return out

    jax_calls = in_thread(calls(self.jax_scaler, self.jax_opts[i], "jax"), self.snapshot)
    if self.enabled and self.main_owns:
      # The main thread is inside an iteration: jaxamp refuses the worker's first call
      # (torch would interleave the two iterations), and changes nothing.
      (name, outcome), *_ = jax_calls
      assert len(jax_calls) == 1 and name == "scale", jax_calls
      assert isinstance(outcome.error, RuntimeError) and TWO_THREADS in str(outcome.error)
      return
    torch_calls = in_thread(calls(self.torch_scaler, self.torch_opts[i], "torch"))
    assert [n for n, _ in jax_calls] == [n for n, _ in torch_calls], (jax_calls, torch_calls)
    for (_, jax_out), (_, torch_out) in zip(jax_calls, torch_calls):
      self.compare(jax_out, torch_out)
    # The worker has ended, whether or not its iteration did: the main thread can go on.
    self.main_owns = False

  # -- invariants ------------------------------------------------------------------------

  def check_grads(self, i, *, exact):
    torch_grads = [p.grad for p in self.torch_params(i)]
    for k, (a, t) in enumerate(zip(self.jax_grad_leaves(i), torch_grads)):
      assert (a is None) == (t is None), (i, k, a, t)
      if a is not None:
        _same_floats(a, t.numpy(), exact=exact, what=f"grads of optimizer {i}, leaf {k}")

  @invariant()
  def same_state(self):
    if not hasattr(self, "jax_scaler"):
      return
    js, ts = self.jax_scaler, self.torch_scaler
    assert js.is_enabled() == ts.is_enabled()
    jax_scale, torch_scale = js.get_scale(), ts.get_scale()
    assert bits(np.float32(jax_scale)) == bits(np.float32(torch_scale)), (jax_scale, torch_scale)
    assert js._get_growth_tracker() == ts._get_growth_tracker()
    if js.is_enabled():
      assert js._scaled == (ts._scale is not None)
    for getter in ("get_growth_factor", "get_backoff_factor", "get_growth_interval"):
      jax_out = Outcome(getattr(js, getter))
      torch_out = Outcome(getattr(ts, getter))
      self.compare(jax_out, torch_out)
      assert jax_out.value == torch_out.value, (getter, jax_out.value, torch_out.value)
    for i, (jo, to) in enumerate(zip(self.jax_opts, self.torch_opts)):
      jax_stage, torch_stage = _stage(js, jo, ts, to)
      assert jax_stage == torch_stage, (i, jax_stage, torch_stage)
      for k, (a, t) in enumerate(zip(jax.tree.leaves(jo.params), self.torch_params(i))):
        atol = ADAM_ATOL if self.kinds[i] == "adam" else ATOL
        what = f"params of optimizer {i} ({self.kinds[i]}), leaf {k}"
        _same_floats(a, t.detach().numpy(), exact=False, what=what, atol=atol)
      self.check_grads(i, exact=False)


GradScalerMachine.TestCase.settings = fuzz_settings(
  ci_examples=30, stateful_step_count=30, report_multiple_bugs=False
)
TestGradScalerMatchesTorch = GradScalerMachine.TestCase
