"""At scale 1 with finite gradients, jaxamp is plain optax, bit for bit.

The identity table: every optimizer of optax's contract suite
(tests/test_optax_contract.py), the optax.contrib optimizers people train with
(schedule-free, Prodigy, DoG, Muon, SAM), ``optax.MultiSteps`` inside the
scaler, a real chain (gradient clipping, then AdamW with an injected schedule)
and ``optax.lookahead``, on four trees (one small leaf; several leaves over
2 MiB; 32 small leaves; bfloat16 and float32 leaves mixed), three jitted steps
in each form, each step from plain optax's params and state:

- ``update``: ``jax.jit(dynamic_loss_scale(tx, init_scale=1.0).update)`` returns
  ``jax.jit(tx.update)``'s updates and inner state, bit for bit;
- ``fused``: ``jaxamp.apply_scaled_updates``, jitted, against ``tx.update`` and
  ``optax.apply_updates`` jitted as one function: params and inner state agree
  to the last bits, measured, not asserted (its docstring);
- ``grad_scaler``: a jitted ``jaxamp.GradScaler(init_scale=1.0)`` iteration on a
  ``jaxamp.Optimizer`` returns ``fused``'s reference, bit for bit.

The suite runs ``update``. ``JAXAMP_IDENTITY_TABLE=path`` runs the three forms
and writes the table as Markdown to ``path`` (a cell: "bit-identical", or the
largest difference over the float leaves and steps in units in the last place,
of the values and of the leaf's largest magnitude); the test prints nothing.
Also here: optax's own ``test_optimization`` (10,000 steps on a parabola and on
Rosenbrock's function), vendored with the contract suite, with every optimizer
wrapped.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import pathlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest
from absl.testing import absltest, parameterized
from optax._src import alias, test_utils, update
from test_optax_contract import (
  _OPTIMIZERS_UNDER_TEST,
  _assert_refuses_complex,
  _get_opt,
  _setup_parabola,
  _setup_rosenbrock,
)

import jaxamp

pytestmark = pytest.mark.slow


@functools.partial(jax.jit, static_argnums=(0, 1))
def _steps(step, n, params, state):
  return jax.lax.fori_loop(0, n, lambda _, carry: step(*carry), (params, state))


class AliasTest(parameterized.TestCase):
  """optax's test_optimization, vendored with tests/test_optax_contract.py (same
  license and adaptations)."""

  @parameterized.product(
    _OPTIMIZERS_UNDER_TEST,
    target=(_setup_parabola, _setup_rosenbrock),
    dtype=(jnp.float32, jnp.complex64),
  )
  def test_optimization(self, opt_name, opt_kwargs, target, dtype):
    if opt_name in (
      "fromage",
      "noisy_sgd",
      "sm3",
      "optimistic_gradient_descent",
      "optimistic_adam",
      "lion",
      "rprop",
      "adadelta",
      "adan",
      "polyak_sgd",
      "sign_sgd",
      "signum",
    ) and jnp.iscomplexobj(dtype):
      raise absltest.SkipTest(f"{opt_name} does not support complex parameters.")

    if opt_name in ("sign_sgd", "signum") and target is _setup_rosenbrock:
      raise absltest.SkipTest(
        f"{opt_name} requires learning rate scheduling to solve the Rosenbrockfunction"
      )

    opt = _get_opt(self, opt_name)(**opt_kwargs)
    initial_params, final_params, objective = target(dtype)

    @jax.jit
    def step(params, state):
      value, updates = jax.value_and_grad(objective)(params)
      # Complex gradients need to be conjugated before being added to parameters
      # https://gist.github.com/wdphy16/118aef6fb5f82c49790d7678cf87da29
      updates = jax.tree.map(lambda x: x.conj(), updates)
      if opt_name == "polyak_sgd":
        update_kwargs = {"value": value}
      else:
        update_kwargs = {}
      updates, state = opt.update(updates, state, params, **update_kwargs)
      params = update.apply_updates(params, updates)
      return params, state

    params = initial_params
    state = opt.init(params)

    with self.subTest("Test that tree_map_params works"):
      # A no-op change, to verify that tree map works.
      state = optax.tree.map_params(opt, lambda v: v, state)

    if jnp.iscomplexobj(dtype):  # jaxamp: refused, as torch's GradScaler does
      grads = jax.grad(objective)(params).conj()
      _assert_refuses_complex(self, opt, params, state, grads)
      return

    with self.subTest("Test that optimization works"):
      params, state = step(params, state)
      with test_utils.log_compilations() as compilation_logs:
        params, state = step(params, state)
      self.assertEmpty(compilation_logs, 'Optimizer recompiles on second call to "update".')
      # jaxamp: the other 9,998 steps in one program, not one dispatch each.
      params, state = _steps(step, 10000 - 2, params, state)

      if opt_name in ("adadelta", "adafactor") and opt_kwargs.get("learning_rate") is None:
        raise absltest.SkipTest(
          f"{opt_name} needs a non-None learning rate for numerically stable"
          " optimization in practice."
        )
      test_utils.assert_trees_all_close(params, final_params, rtol=3e-2, atol=3e-2)

    with self.subTest("Test that the optimizer doesn't recompile on 2nd call"):
      params = initial_params
      state = opt.init(params)
      params, state = step(params, state)
      with test_utils.log_compilations() as compilation_logs:
        _ = step(params, state)
      self.assertEmpty(compilation_logs, 'Optimizer recompiles on second call to "update".')


# ---------------------------------------------------------------------------------
# The identity table.
# ---------------------------------------------------------------------------------

_STEPS = 3
_NEVER_GROWS = 2**31 - 1  # the scale stays 1 however many steps


def _scaled(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  return jaxamp.dynamic_loss_scale(tx, init_scale=1.0, growth_interval=_NEVER_GROWS)


def _contract_optimizer(name: str, kwargs: dict) -> Callable[[], optax.GradientTransformation]:
  def make():
    if name == "optimistic_adam":  # deprecated by optax, and every warning is an error
      with pytest.warns(DeprecationWarning, match="optimistic_adam_v2"):
        return alias.optimistic_adam(**kwargs)
    return getattr(alias, name)(**kwargs)

  return make


def _label(name: str, kwargs: dict) -> str:
  if name in ("adadelta", "adafactor", "rmsprop"):  # twice in the contract suite
    return f"{name}({', '.join(f'{k}={v}' for k, v in kwargs.items())})"
  return name


def _lookahead(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  return optax.lookahead(tx, sync_period=2, slow_step_size=0.5)


def _sam() -> optax.GradientTransformation:
  # Its transparent mode, which takes no extra arguments.
  adversarial = optax.chain(optax.contrib.normalize(), optax.sgd(0.05))
  return optax.contrib.sam(optax.sgd(0.1), adversarial, sync_period=2)


def _clipped_adamw() -> optax.GradientTransformation:
  schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=2, decay_steps=10)
  return optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.inject_hyperparams(optax.adamw)(learning_rate=schedule, weight_decay=1e-4),
  )


# label -> (plain optax, the same with the scaler; None: dynamic_loss_scale(plain)).
_OPTIMIZERS: dict[str, tuple[Callable[[], Any], Callable[[], Any] | None]] = {
  **{
    _label(c["opt_name"], c["opt_kwargs"]): (
      _contract_optimizer(c["opt_name"], c["opt_kwargs"]),
      None,
    )
    for c in _OPTIMIZERS_UNDER_TEST
  },
  "contrib.schedule_free_adamw": (
    lambda: optax.contrib.schedule_free_adamw(1e-2, warmup_steps=2, weight_decay=1e-4),
    None,
  ),
  "contrib.schedule_free_sgd": (lambda: optax.contrib.schedule_free_sgd(0.1, warmup_steps=2), None),
  "contrib.prodigy": (lambda: optax.contrib.prodigy(1.0), None),
  "contrib.dog": (lambda: optax.contrib.dog(1.0), None),
  "contrib.muon": (lambda: optax.contrib.muon(1e-2), None),
  "contrib.sam": (_sam, None),
  "MultiSteps(adam, 2)": (
    lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2).gradient_transformation(),
    None,
  ),
  "chain(clip_by_global_norm, inject_hyperparams(adamw)(schedule))": (_clipped_adamw, None),
  # optax.lookahead's params are LookaheadParams, its gradients the fast
  # params' tree, and its updates LookaheadParams again.
  "lookahead(adam)": (lambda: _lookahead(optax.adam(1e-2)), None),
  "lookahead(adam), the scaler around adam": (
    lambda: _lookahead(optax.adam(1e-2)),
    lambda: _lookahead(_scaled(optax.adam(1e-2))),
  ),
}
_LOOKAHEAD = ("lookahead(adam)", "lookahead(adam), the scaler around adam")


def _tree(name: str) -> dict[str, jax.Array]:
  """The initial params of each tree: fixed values."""
  rng = np.random.default_rng(0)

  def leaf(shape, dtype=jnp.float32):
    return jnp.asarray(rng.normal(size=shape).astype(np.float32), dtype)

  if name == "1 leaf":
    return {"w": leaf((16, 32))}
  if name == "2 MiB":  # over the 1 MiB from which the deleted in-place loop ran
    return {"w1": leaf((512, 1024)), "b1": leaf((1024,)), "w2": leaf((1024, 16))}
  if name == f"{_MANY} leaves":  # Muon's 2-D and its AdamW's 1-D leaves
    return {f"layer{i:03d}": {"w": leaf((6, 8)), "b": leaf((8,))} for i in range(_MANY // 2)}
  if name == "bfloat16 mixed":
    return {
      "w1": leaf((64, 48), jnp.bfloat16),
      "b1": leaf((48,)),
      "w2": leaf((48, 32), jnp.bfloat16),
    }
  raise AssertionError(name)


# Compile time grows with the leaves, and dominates the test's; 32 are two of
# jaxamp's finite-check groups of same-size leaves (jaxamp/_torch/finite.py) per shape.
_MANY = 32
_TREES = ("1 leaf", "2 MiB", f"{_MANY} leaves", "bfloat16 mixed")
_FORMS = ("update", "fused", "grad_scaler")


@functools.cache
def _targets(tree: str) -> list:
  params, rng = _tree(tree), np.random.default_rng(1)
  return [
    jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
    for _ in range(_STEPS)
  ]


def _problem(tree: str, name: str) -> tuple[Any, list]:
  """``(params, [target] * steps)`` for the optimizer ``name``: each step's
  loss is half the squared distance to its target, so that the gradients
  differ from step to step."""
  params = _tree(tree)
  if name in _LOOKAHEAD:  # the gradients are the fast params'
    params = optax.LookaheadParams.init_synced(params)
  return params, _targets(tree)


def _fast(params: Any) -> Any:
  return params.fast if isinstance(params, optax.LookaheadParams) else params


@jax.jit
def _value_and_grad(params, target):
  def loss(params):
    squares = jax.tree.map(
      lambda p, t: jnp.sum(jnp.square((p - t).astype(jnp.float32))), params, target
    )
    return 0.5 * sum(jax.tree.leaves(squares))

  return jax.value_and_grad(loss)(params)


_apply_updates = jax.jit(optax.apply_updates)


def _extra(name: str, value: jax.Array) -> dict[str, jax.Array]:
  return {"value": value} if name == "polyak_sgd" else {}


def _ordered(x: np.ndarray) -> np.ndarray:
  """The float ``x``'s bits as integers in the floats' order: consecutive
  floats differ by 1, and -0.0 is 0.0."""
  bits = x.view(np.dtype(f"int{8 * x.dtype.itemsize}")).astype(np.int64)
  magnitude = bits & ((1 << (8 * x.dtype.itemsize - 1)) - 1)
  return np.where(bits < 0, -magnitude, magnitude)


class _Difference(NamedTuple):
  """How far a tree is from another: ``ulps``, the largest difference of two
  values in units in the last place of the values themselves (large where
  they are small: a value that cancels to near 0), and ``scaled``, in units
  in the last place of the leaf's largest magnitude. Both 0 only for the same
  bits; inf for a NaN against a number, another tree, dtype or integer."""

  ulps: float = 0.0
  scaled: float = 0.0

  def worse(self, other: _Difference) -> _Difference:
    return _Difference(max(self.ulps, other.ulps), max(self.scaled, other.scaled))


_OTHER = _Difference(float("inf"), float("inf"))


def _difference(got: Any, want: Any) -> _Difference:
  got, want = optax.tree.unwrap_random_key_data((got, want))
  if jax.tree.structure(got) != jax.tree.structure(want):
    return _OTHER
  worst = _Difference()
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
      return _OTHER
    if a.tobytes() == b.tobytes():
      continue
    if not jnp.issubdtype(a.dtype, jnp.floating):
      return _OTHER
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    nan = np.isnan(b32)
    if (np.isnan(a32) != nan).any():
      return _OTHER
    ulps = np.abs(_ordered(a) - _ordered(b))[~nan]
    largest = np.max(np.abs(b32[~nan]), initial=0.0)
    spacing = float(np.spacing(largest.astype(a.dtype)))
    scaled = np.abs(a32 - b32)[~nan] / spacing
    # NaN payloads or +0.0 against -0.0 alone: other bits, as the smallest difference.
    leaf = _Difference(max(float(np.max(ulps, initial=0)), 0.5), float(np.max(scaled, initial=0)))
    worst = worst.worse(leaf)
  return worst


class _Programs(NamedTuple):
  plain: optax.GradientTransformation
  scaled: optax.GradientTransformation
  plain_update: Callable  # jax.jit(tx.update)
  scaled_update: Callable  # jax.jit(scaled.update)
  plain_step: Callable  # tx.update and optax.apply_updates in one jax.jit
  fused: Callable  # jaxamp.apply_scaled_updates(scaled, ...), jitted
  grad_scaler_step: Callable  # a GradScaler iteration, jitted


def _programs(name: str) -> _Programs:
  """An optimizer's jitted functions, new closures for each test: JAX keeps a
  function's compiled programs while the function lives (a module's, or a
  module's with the optimizer as a static argument: for good), and those of
  every optimizer and tree would take gigabytes."""
  make, make_scaled = _OPTIMIZERS[name]
  plain = make()
  scaled = _scaled(make()) if make_scaled is None else make_scaled()

  def plain_step(grads, state, params, value):
    updates, state = plain.update(grads, state, params, **_extra(name, value))
    return optax.apply_updates(params, updates), state

  def grad_scaler_step(scaler, optimizer, grads, value):
    optimizer.grads = grads
    scaler.step(optimizer, **_extra(name, value))
    scaler.update()
    return scaler, optimizer

  return _Programs(
    plain,
    scaled,
    jax.jit(lambda g, s, p, v: plain.update(g, s, p, **_extra(name, v))),
    jax.jit(lambda g, s, p, v: scaled.update(g, s, p, **_extra(name, v))),
    jax.jit(plain_step),
    jax.jit(lambda g, s, p, v: jaxamp.apply_scaled_updates(scaled, g, s, p, **_extra(name, v))),
    jax.jit(grad_scaler_step),
  )


def _holding(scaled_state: Any, inner_state: Any) -> Any:
  """``scaled_state`` with plain optax's ``inner_state`` in the scaler's place."""
  if isinstance(scaled_state, optax.LookaheadState):  # the scaler around the fast optimizer
    fast = scaled_state.fast_state._replace(inner_state=inner_state.fast_state)
    return scaled_state._replace(fast_state=fast)
  return scaled_state._replace(inner_state=inner_state)


def _held(scaled_state: Any) -> Any:
  """The optimizer's state inside ``scaled_state``, laid out as plain optax's."""
  if isinstance(scaled_state, optax.LookaheadState):
    return scaled_state._replace(fast_state=scaled_state.fast_state.inner_state)
  return scaled_state.inner_state


def _assert_scale_one(scaled_state: Any) -> None:
  state = jaxamp.ops.find_loss_scale_state(scaled_state)
  assert not bool(state.found_inf), "a finite step was skipped"
  assert float(state.loss_scale) == 1.0


def _differences(
  programs: _Programs, name: str, tree: str, forms: tuple[str, ...]
) -> dict[str, Any]:
  """Each form's largest ``_Difference`` from plain optax over the steps, or
  the error a lookahead form refuses with. Every step starts each form from
  plain optax's params and inner state: a difference is that step's own, not
  an earlier one's carried on."""
  params, targets = _problem(tree, name)
  state, scaled_state = programs.plain.init(params), programs.scaled.init(params)
  scaler = jaxamp.GradScaler(init_scale=1.0, growth_interval=_NEVER_GROWS)
  optimizer = jaxamp.Optimizer(programs.plain, params)
  worst: dict[str, Any] = dict.fromkeys(forms, _Difference())

  def update(grads, value, want):
    nonlocal scaled_state
    held = _holding(scaled_state, state)
    got, scaled_state = programs.scaled_update(grads, held, params, value)
    _assert_scale_one(scaled_state)
    return _difference((got, _held(scaled_state)), want)

  def fused(grads, value, want):
    nonlocal scaled_state
    held = _holding(scaled_state, state)
    got, scaled_state = programs.fused(grads, held, params, value)
    _assert_scale_one(scaled_state)
    return _difference((got, _held(scaled_state)), want)

  def grad_scaler(grads, value, want):
    nonlocal scaler, optimizer
    optimizer.params, optimizer.opt_state = params, state
    scaler.scale(jnp.float32(1.0))
    scaler, optimizer = programs.grad_scaler_step(scaler, optimizer, grads, value)
    assert float(scaler.loss_scale) == 1.0
    return _difference((optimizer.params, optimizer.opt_state), want)

  run = {"update": update, "fused": fused, "grad_scaler": grad_scaler}
  for target in targets:
    value, grads = _value_and_grad(_fast(params), target)
    updates, new_state = programs.plain_update(grads, state, params, value)
    if forms != ("update",):
      stepped = programs.plain_step(grads, state, params, value)
    for form, so_far in list(worst.items()):
      if isinstance(so_far, ValueError):
        continue
      want = (updates, new_state) if form == "update" else stepped
      try:
        worst[form] = so_far.worse(run[form](grads, value, want))
      except ValueError as error:
        if name not in _LOOKAHEAD:
          raise
        worst[form] = error
    params, state = _apply_updates(params, updates), new_state
  return worst


def _optax_refuses(programs: _Programs, name: str, tree: str) -> str | None:
  """Why plain optax cannot update ``tree`` (bfloat16 leaves), or None."""
  params, (target, *_) = _problem(tree, name)
  value, grads = _value_and_grad(_fast(params), target)
  try:
    programs.plain_update(grads, programs.plain.init(params), params, value)
  except (TypeError, ValueError) as error:
    return f"optax raises {type(error).__name__}"
  return None


def _cell(result: Any) -> str:
  if isinstance(result, ValueError):
    return "refused (ValueError)"
  if result == _Difference():
    return "bit-identical"
  if result == _OTHER:
    return "another tree or dtype"
  return f"{result.ulps:.3g} ulp ({result.scaled:.3g} of the leaf's largest)"


# The table's cells: {(optimizer, tree, form): text}.
_CELLS: dict[tuple[str, str, str], str] = {}


@pytest.mark.parametrize("tree", _TREES)
@pytest.mark.parametrize("name", list(_OPTIMIZERS))
def test_scale_one_is_plain_optax_bit_for_bit(name, tree):
  # Each form compiles its programs for each optimizer and tree: the table's
  # three take three times the update's alone, which the suite runs.
  table = os.environ.get("JAXAMP_IDENTITY_TABLE")
  forms = _FORMS if table else ("update",)
  programs = _programs(name)
  refused = _optax_refuses(programs, name, tree) if tree == "bfloat16 mixed" else None
  if refused is not None:
    cells = dict.fromkeys(forms, f"n/a: {refused}")
  else:
    results = _differences(programs, name, tree, forms)
    cells = {form: _cell(result) for form, result in results.items()}
  if table:
    _CELLS.update({(name, tree, form): cell for form, cell in cells.items()})
    _write_table(table)
  if name in _LOOKAHEAD:
    # Measured, not asserted: the scaler refuses LookaheadParams, and around it
    # lookahead is plain optax with a conditional update (the next test).
    return
  identical = {"bit-identical", f"n/a: {refused}"}
  # apply_scaled_updates fuses the step into its branch, where XLA CPU contracts
  # the optimizer's own arithmetic otherwise (its docstring: "to the last
  # bits"): measured for the table, not asserted.
  assert cells["update"] in identical, cells
  assert cells.get("grad_scaler", "bit-identical") in identical, cells


def _behind_a_cond(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """``tx`` with its update in a ``lax.cond`` on finite gradients, in plain JAX."""

  def update(grads, state, params=None):
    def skip(grads, state, params):
      return jax.tree.map(jnp.zeros_like, grads), state

    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    return jax.lax.cond(finite, tx.update, skip, grads, state, params)

  return optax.GradientTransformation(tx.init, update)


@pytest.mark.parametrize("tree", ["1 leaf", "2 MiB"])
def test_lookahead_around_the_scaler_is_lookahead_around_a_cond_bit_for_bit(tree):
  # At lookahead's synchronisation the branch's boundary keeps XLA CPU from
  # contracting the inner update into lookahead's arithmetic, as it does
  # without one (up to 128 ulp of the update leaf's largest, one of the
  # params'): any conditional update does so, and the scaler adds nothing else.
  name = "lookahead(adam), the scaler around adam"
  params, targets = _problem(tree, name)
  scaled = _programs(name).scaled
  reference = _lookahead(_behind_a_cond(optax.adam(1e-2)))
  reference_update, scaled_update = jax.jit(reference.update), jax.jit(scaled.update)
  state, scaled_state = reference.init(params), scaled.init(params)
  for target in targets:
    _, grads = _value_and_grad(params.fast, target)
    got, scaled_state = scaled_update(grads, _holding(scaled_state, state), params)
    updates, state = reference_update(grads, state, params)
    _assert_scale_one(scaled_state)
    assert _difference((got, _held(scaled_state)), (updates, state)) == _Difference()
    params = _apply_updates(params, updates)


def _write_table(path: str) -> None:
  """The cells so far, merged with those other test processes (pytest-xdist
  workers) wrote to ``path.json``, as Markdown to ``path``. An earlier run's
  cells stay in ``path.json`` until replaced: delete it to start afresh."""
  saved = pathlib.Path(f"{path}.json")
  with open(f"{path}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    cells = json.loads(saved.read_text()) if saved.exists() else {}
    cells.update({"\t".join(key): cell for key, cell in _CELLS.items()})
    saved.write_text(json.dumps(cells, indent=0))
    lines = []
    for form in _FORMS:
      rows = [[cells.get(f"{name}\t{tree}\t{form}", "") for tree in _TREES] for name in _OPTIMIZERS]
      if not any(map(any, rows)):
        continue
      lines += [f"### {form}", "", "| optimizer | " + " | ".join(_TREES) + " |"]
      lines += ["|---" * (len(_TREES) + 1) + "|"]
      lines += [
        f"| {name} | " + " | ".join(row) + " |" for name, row in zip(_OPTIMIZERS, rows) if any(row)
      ]
      lines.append("")
    pathlib.Path(path).write_text("\n".join(lines))
