"""The registry of parity scenarios.

Each scenario names the scenarios of docs/torch_semantics.md §6 it reproduces (``spec``).
Tolerances: ``param_rtol`` bounds ``max |jax - torch| / max |torch|`` per
tensor, for parameters and optimizer states, after every step. It is 1e-5 for
float32 runs: both frameworks compute the same formulas but round differently
(XLA and ATen order their sums differently; optax's Adam divides by
``sqrt(nu_hat) + eps`` where torch divides by ``sqrt(nu) / sqrt(bc2) + eps``),
which leaves differences of a few float32 ulps (~1e-7) per step. A scenario
with a larger tolerance says why in its ``doc``. Scale, tracker, skip decisions
and unscaled gradients have no tolerance: they must be bit-equal.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from parity import models
from parity.optimizers import OptSpec

INF, NAN = float("inf"), float("nan")

SGD = (OptSpec("sgd", 0.05),)
MOMENTUM = (OptSpec("sgd", 0.05, momentum=0.9),)
ADAM = (OptSpec("adam", 0.01),)
ADAMW = (OptSpec("adamw", 0.01, weight_decay=0.01),)


@dataclasses.dataclass(frozen=True)
class Scenario:
  """One scripted training run, identical in torch and jaxamp.

  Attributes:
    name: the registry key (``python -m parity --scenario NAME``).
    doc: what it shows and, where not 1e-5, why its tolerance is what it is.
    model: builds the paired model (fresh each run).
    optimizers: one :class:`OptSpec` per torch optimizer.
    steps: training iterations.
    scaler: keyword arguments for both ``torch.amp.GradScaler('cpu', ...)`` and
      ``jaxamp.dynamic_loss_scale``.
    inject: ``{step: ((torch_param_name, flat_index, value), ...)}`` written into
      the scaled gradients after backward.
    clip: ``clip_grad_norm_`` max norm after ``unscale_`` (jaxamp side:
      ``optax.clip_by_global_norm``, or torch's formula with ``clip_torch``).
    clip_torch: clip with torch's formula on the jaxamp side too:
      ``jaxamp.ops.clip_by_torch_norm`` inside the wrapper, ``jaxamp.clip_grad_norm``
      on the optimizers' grads after ``unscale_``.
    explicit_unscale: call ``unscale_`` before ``step`` even without clipping.
    late_inject: as ``inject``, but written after ``unscale_`` (not re-checked).
    unstepped: ``{step: (optimizer index, ...)}`` whose ``step`` is not called.
    setters: ``{step: {"growth_factor": x, ...}}``: ``scaler.set_<name>(x)`` before it.
    new_scale: ``{step: value}``: ``update(new_scale=value)`` at that step.
    initial_tracker: a growth tracker loaded before the first step.
    accumulate: micro-batches whose scaled gradients are summed per step (one
      step is one accumulation window: torch's ``backward`` per micro-batch, then
      ``step``/``update``/``zero_grad``; jaxamp: ``jaxamp.accumulate_gradients``
      around the wrapper, ``Optimizer.accumulate`` with ``GradScaler``). With
      accumulation, ``inject`` is written after the last micro-batch's backward
      (in JAX into that micro-batch's gradients: the same for inf/NaN, the only
      values allowed then).
    micro_inject: ``{(step, micro): injections}``, as ``inject`` after that
      micro-batch's backward (inf/NaN only).
    divide_loss: each micro-batch's loss is divided by ``accumulate``, as torch's
      AMP accumulation example (``loss / iters_to_accumulate``).
    grad_penalty: torch's AMP gradient-penalty example: the unscaled gradients of
      the scaled loss (``1 / get_scale()``), their norm added to the loss, then
      the scaled total backpropagated.
    jaxamp_options: keyword arguments for jaxamp only (``schedule_counts``).
    autocast: torch autocast dtype (the Flax model is built with the same dtype).
    resume: ``(step, "jax" | "torch")``: after ``step`` steps, the other
      framework's checkpoint is loaded into this one, which continues from it.
    param_rtol: relative tolerance for parameters.
    state_rtol: relative tolerance for optimizer states (default ``param_rtol``).
    spec: the scenario numbers of docs/torch_semantics.md §6 covered (6.N).
    apis: the jaxamp APIs that can express it.
    plot: whether the report draws its scale and loss curves.
    subnormals: the run crosses float32 subnormals, which XLA flushes to zero
      and torch keeps (a documented divergence): unscaled gradients must equal
      torch's bit for bit or, where torch's input, reciprocal or result was
      subnormal, the flush-to-zero model of torch's arithmetic bit for bit;
      the parameters fed by such gradients are reported, not failed.
  """

  name: str
  doc: str
  model: Callable[[], models.Pair]
  optimizers: tuple[OptSpec, ...] = SGD
  steps: int = 16
  scaler: dict = dataclasses.field(default_factory=dict)
  inject: dict = dataclasses.field(default_factory=dict)
  clip: float | None = None
  explicit_unscale: bool = False
  late_inject: dict = dataclasses.field(default_factory=dict)
  unstepped: dict = dataclasses.field(default_factory=dict)
  setters: dict = dataclasses.field(default_factory=dict)
  new_scale: dict = dataclasses.field(default_factory=dict)
  initial_tracker: int | None = None
  accumulate: int = 1
  micro_inject: dict = dataclasses.field(default_factory=dict)
  divide_loss: bool = False
  grad_penalty: bool = False
  clip_torch: bool = False
  jaxamp_options: dict = dataclasses.field(default_factory=dict)
  autocast: str | None = None
  resume: tuple[int, str] | None = None
  param_rtol: float = 1e-5
  state_rtol: float | None = None
  spec: tuple[int, ...] = ()
  apis: tuple[str, ...] = ("optax", "grad_scaler")
  plot: bool = False
  subnormals: bool = False


def _at(steps, value, name="0.weight", index=0) -> dict:
  """The same injection at each of ``steps``."""
  return {s: ((name, index, value),) for s in steps}


def _factors(init, growth, backoff, interval) -> dict:
  return {
    "init_scale": init,
    "growth_factor": growth,
    "backoff_factor": backoff,
    "growth_interval": interval,
  }


_zero_linear = functools.partial(models.linear10, zero_loss=True)

SCENARIOS: list[Scenario] = [
  Scenario(
    "linear_defaults",
    "Linear(10,10), SGD, torch's default scaler (65536, 2, 0.5, 2000); inf at step 5.",
    models.linear10,
    steps=12,
    inject=_at([5], INF),
    spec=(1,),
  ),
  Scenario(
    "linear_trajectory_a",
    "docs/torch_semantics.md §5.1: init 8, growth 2, backoff 0.5, interval 3; inf at steps 4, 8, 9.",
    models.linear10,
    steps=16,
    scaler=_factors(8.0, 2.0, 0.5, 3),
    inject=_at([4, 8, 9], INF),
    spec=(7, 25),
  ),
  Scenario(
    "linear_non_dyadic",
    "docs/torch_semantics.md §5.2: init 3, growth 1.5, backoff 0.3, interval 3; inf at 3, 9, 10, 11. "
    "The scale is f32(f64(scale) * factor), not the float32 product.",
    models.linear10,
    steps=18,
    scaler=_factors(3.0, 1.5, 0.3, 3),
    inject=_at([3, 9, 10, 11], INF),
    spec=(8, 19),
    plot=True,
  ),
  Scenario(
    "linear_nan",
    "docs/torch_semantics.md §5.3: NaN at steps 0-3 and 12 (first backoff 3.0 -> 0.8999999761581421).",
    models.linear10,
    steps=16,
    scaler=_factors(3.0, 1.5, 0.3, 2),
    inject=_at([0, 1, 2, 3, 12], NAN, "0.bias", 3),
    spec=(9,),
  ),
  Scenario(
    "linear_growth_1_1",
    "docs/torch_semantics.md §5.4: growth 1.1, backoff 0.9, interval 2; 20 clean steps then 3 infs.",
    models.linear10,
    steps=23,
    scaler=_factors(1.0, 1.1, 0.9, 2),
    inject=_at([20, 21, 22], INF, "0.weight", 99),
    spec=(10,),
  ),
  Scenario(
    "linear_neg_inf",
    "docs/torch_semantics.md §5.5: -inf at steps 2, 4, 5 with interval 1 (growth on every clean step).",
    models.linear10,
    steps=7,
    scaler=_factors(65536.0, 2.0, 0.5, 1),
    inject=_at([2, 4, 5], -INF, "0.weight", 50),
    spec=(11,),
  ),
  Scenario(
    "linear_growth_cap",
    "docs/torch_semantics.md §6.12: init 2**125, growth 2, interval 1, zero loss: the growth that would "
    "overflow float32 is dropped and the scale stays 2**127; tracker 0 each step.",
    _zero_linear,
    steps=5,
    scaler=_factors(2.0**125, 2.0, 0.5, 1),
    spec=(12,),
  ),
  Scenario(
    "linear_growth_cap_odd",
    "docs/torch_semantics.md §6.13: init 4e37, growth 3, interval 2, zero loss: one growth then capped.",
    _zero_linear,
    steps=6,
    scaler=_factors(4e37, 3.0, 0.5, 2),
    spec=(13,),
  ),
  Scenario(
    "linear_noop_growth",
    "docs/torch_semantics.md §6.14: growth 1.00000001 rounds back to the same float32 scale.",
    models.linear10,
    steps=4,
    scaler=_factors(1.0, 1.00000001, 0.5, 1),
    spec=(14,),
  ),
  Scenario(
    "linear_backoff_to_zero",
    "docs/torch_semantics.md §6.15, §6.16: inf at every step backs 65536 off through the subnormals to 0.0 "
    "after 166 updates; the first clean step then unscales 0 * inf = NaN undetected "
    "and applies it (parameters NaN), later steps are skipped.",
    models.linear10,
    steps=170,
    scaler=_factors(65536.0, 2.0, 0.5, 2000),
    inject=_at(range(167), INF),
    spec=(15, 16),
    subnormals=True,
  ),
  Scenario(
    "vector_subnormal_scale",
    "docs/torch_semantics.md §6.17: init 1e-39 (< 1/FLT_MAX): inv_scale is inf, the unscaled grads are "
    "+-inf but found_inf is 0, so the step is taken; the scale grows.",
    lambda: models.vectors({"p": "float32"}),
    steps=2,
    scaler=_factors(1e-39, 2.0, 0.5, 1),
    spec=(17,),
    subnormals=True,
  ),
  Scenario(
    "linear_inf_scale",
    "docs/torch_semantics.md §6.18: update(new_scale=inf) at step 1; every later step is skipped, scale inf. "
    "optax only: the wrapper's state is given the inf scale directly; "
    "jaxamp.GradScaler.update rejects a non-finite new_scale on purpose.",
    models.linear10,
    steps=5,
    scaler=_factors(8.0, 2.0, 0.5, 1),
    new_scale={1: INF},
    spec=(18,),
    apis=("optax",),
  ),
  Scenario(
    "linear_nan_scale",
    "docs/torch_semantics.md §6.18: update(new_scale=nan) at step 1; every later step is skipped, scale NaN. "
    "optax only, as linear_inf_scale.",
    models.linear10,
    steps=5,
    scaler=_factors(8.0, 2.0, 0.5, 1),
    new_scale={1: NAN},
    spec=(18,),
    apis=("optax",),
  ),
  Scenario(
    "linear_update_new_scale",
    "docs/torch_semantics.md §6.43: update(new_scale=2.5) at step 2 and 1/3 at step 5 set the scale "
    "(1/3 -> 0.3333333432674408) and leave the tracker alone, even on an inf step.",
    models.linear10,
    steps=10,
    scaler=_factors(8.0, 2.0, 0.5, 3),
    new_scale={2: 2.5, 5: 1 / 3},
    inject=_at([5], INF),
    spec=(43,),
  ),
  Scenario(
    "linear_tracker_above_interval",
    "docs/torch_semantics.md §6.47: a loaded tracker 5 with interval 3 never equals it: no growth, 6, 7, ...",
    models.linear10,
    steps=4,
    scaler=_factors(8.0, 2.0, 0.5, 3),
    initial_tracker=5,
    spec=(47,),
  ),
  Scenario(
    "linear_interval_zero",
    "docs/torch_semantics.md §6.48: growth_interval 0 never grows; the tracker counts 1, 2, 3, ...",
    models.linear10,
    steps=4,
    scaler=_factors(8.0, 2.0, 0.5, 0),
    spec=(48,),
  ),
  Scenario(
    "linear_interval_negative",
    "docs/torch_semantics.md §6.48: growth_interval -1 never grows; an inf step still backs off.",
    models.linear10,
    steps=5,
    scaler=_factors(8.0, 2.0, 0.5, -1),
    inject=_at([2], INF),
    spec=(48,),
  ),
  Scenario(
    "linear_tracker_wrap",
    "docs/torch_semantics.md §6.50: tracker 2**31-1 plus one clean step wraps to -2**31 (int32).",
    models.linear10,
    steps=3,
    scaler=_factors(8.0, 2.0, 0.5, 2000),
    initial_tracker=2**31 - 1,
    spec=(50,),
  ),
  Scenario(
    "linear_grad_accumulation",
    "docs/torch_semantics.md §6.32: two scaled backward passes per step add up before one unscale/step "
    "(jaxamp.accumulate_gradients, Optimizer.accumulate); inf written after the second "
    "backward at step 3.",
    models.linear10,
    steps=8,
    scaler=_factors(4.0, 2.0, 0.5, 2),
    accumulate=2,
    inject=_at([3], INF),
    spec=(32,),
  ),
  Scenario(
    "linear_clip",
    "docs/torch_semantics.md §6.26, §6.27: unscale_ then clip_grad_norm_(1.0) (optax: clip_by_global_norm "
    "inside the wrapper); inf at steps 2 and 5 is still skipped. torch divides by "
    "norm + 1e-6, optax by norm: a relative difference of 1e-6 / norm per step.",
    models.linear10,
    steps=10,
    scaler=_factors(1024.0, 2.0, 0.5, 3),
    clip=1.0,
    inject=_at([2, 5], INF),
    spec=(26, 27),
  ),
  Scenario(
    "two_layer_accumulation_overflow_window",
    "torch's AMP accumulation example: 4 micro-batches per window, loss / 4, backward "
    "each, step/update/zero_grad at the window's end; inf in micro-batch 1 of window 2 "
    "and NaN in micro-batch 3 of window 5 skip those windows, and the next windows "
    "start from zero gradients (optax: jaxamp.accumulate_gradients(dynamic_loss_scale); "
    "GradScaler: zero_grad(set_to_none=False) + Optimizer.accumulate). One step here is "
    "one window.",
    models.two_layer,
    optimizers=MOMENTUM,
    steps=9,
    scaler=_factors(1024.0, 2.0, 0.5, 2),
    accumulate=4,
    divide_loss=True,
    micro_inject={(2, 1): (("0.weight", 5, INF),), (5, 3): (("2.bias", 1, NAN),)},
    spec=(32,),
  ),
  Scenario(
    "two_layer_warmup_lambda_lr_early_skips",
    "Adam with torch's LambdaLR linear warmup (10 steps) from the default scale 65536, "
    "inf at steps 0-3 (as a float16 run's first steps overflow) and 12: torch's "
    "scheduler.step() runs every iteration, skipped ones included, Adam's own step does "
    "not (jaxamp: schedule_counts='iterations', optax.adam(schedule)). The optax "
    "schedule's learning rates are checked against torch's before training.",
    models.two_layer,
    optimizers=(OptSpec("adam", 0.01, schedule=("warmup", 10)),),
    steps=20,
    scaler=_factors(65536.0, 2.0, 0.5, 4),
    inject=_at([0, 1, 2, 3, 12], INF),
    jaxamp_options={"schedule_counts": "iterations"},
    spec=(33, 61),
  ),
  Scenario(
    "two_layer_onecycle_early_skips",
    "momentum SGD with torch's OneCycleLR (max_lr 0.1, 40 total steps, pct_start 0.3; "
    "its defaults: cosine annealing, div_factor 25, final_div_factor 1e4, momentum cycled "
    "0.95 -> 0.85 -> 0.95), inf at steps 0-3 and 20: the schedule advances on skipped "
    "steps (jaxamp: schedule_counts='iterations', "
    "inject_hyperparams(sgd)(learning_rate=lr(count), momentum=m(count))). lr and "
    "momentum sequences are checked against torch's before training (a few float32 "
    "ulps: the schedule is float32, torch's float64).",
    models.two_layer,
    optimizers=(OptSpec("sgd", 0.1, momentum=0.9, schedule=("onecycle", 40, 0.1, 0.3)),),
    steps=40,
    scaler=_factors(65536.0, 2.0, 0.5, 5),
    inject=_at([0, 1, 2, 3, 20], INF),
    jaxamp_options={"schedule_counts": "iterations"},
    spec=(61,),
  ),
  Scenario(
    "two_layer_param_labels_one_layer_inf",
    "Several optimizers, one scaler, in both APIs: Adam on layer 0, momentum SGD on "
    "layer 2 (optax: dynamic_loss_scale({label: tx}, param_labels=...)); inf/NaN only "
    "in layer 2's gradients at steps 3, 4, 11 and 15, in layer 0's only at step 8: only "
    "that optimizer skips, the other steps, and the scale backs off once per step.",
    models.two_layer,
    optimizers=(
      OptSpec("adam", 0.01, prefix="0."),
      OptSpec("sgd", 0.05, momentum=0.9, prefix="2."),
    ),
    steps=20,
    scaler=_factors(16.0, 2.0, 0.5, 3),
    inject={
      3: (("2.weight", 7, INF),),
      4: (("2.bias", 0, -INF),),
      8: (("0.bias", 4, INF),),
      11: (("2.weight", 30, INF),),
      15: (("2.bias", 9, NAN),),
    },
    spec=(29,),
  ),
  Scenario(
    "two_layer_grad_penalty",
    "torch's AMP gradient-penalty example: autograd.grad of scaler.scale(loss) with "
    "create_graph, times inv_scale = 1 / scaler.get_scale(), their norm added to the "
    "loss, scaler.scale(loss).backward() (jaxamp: jax.grad inside the loss, "
    "1 / GradScaler.get_scale() inside jit, 1 / jaxamp.get_loss_scale(state) for optax); "
    "inf at steps 4 and 9.",
    models.two_layer,
    optimizers=MOMENTUM,
    steps=14,
    scaler=_factors(1024.0, 2.0, 0.5, 3),
    inject=_at([4, 9], INF),
    grad_penalty=True,
  ),
  Scenario(
    "vector_scale_above_2_126",
    "torch's test_grad_scale_will_not_overflow idea: init_scale 1e38 (> 2**126), so "
    "inv_scale = 1 / scale is a float32 subnormal; growth 2, interval 2: 1e38 -> 2e38, "
    "the next growth (4e38) would overflow and is dropped; inf at step 7 backs off to "
    "1e38. The unscaled gradients g * inv_scale must equal torch's bit for bit (w ~ "
    "N(0, 1e-3), so they are normal floats).",
    functools.partial(models.vectors, {"p": "float32"}, size=16, data_scale=1e-3),
    steps=12,
    scaler=_factors(1e38, 2.0, 0.5, 2),
    inject=_at([7], INF, "p", 3),
  ),
  Scenario(
    "vector_clip_torch_formula",
    "unscale_ then clip_grad_norm_(1e-3) with torch's formula on both sides: "
    "jaxamp.ops.clip_by_torch_norm inside the wrapper, jaxamp.clip_grad_norm on the "
    "optimizers' grads after GradScaler.unscale_ (max_norm / (norm + 1e-6), clamped at "
    "1); momentum SGD, inf at steps 3 and 7. The gradients are small (w ~ N(0, 1e-3), "
    "norm ~4e-3), so optax.clip_by_global_norm's max_norm / norm is 2.5e-4 off "
    "relative and the momentum buffers would fail the 1e-5 tolerance.",
    functools.partial(models.vectors, {"p": "float32"}, size=16, data_scale=1e-3),
    optimizers=MOMENTUM,
    steps=12,
    scaler=_factors(1024.0, 2.0, 0.5, 3),
    clip=1e-3,
    clip_torch=True,
    inject=_at([3, 7], INF, "p", 2),
    spec=(26, 27),
  ),
  Scenario(
    "linear_adam_skip_first",
    "docs/torch_semantics.md §6.33, §6.34: Adam with inf at steps 0 and 3: torch's state stays empty after "
    "the skipped first step (optax: count 0, zero moments), counts 0,1,2,2,3,4,5.",
    models.linear10,
    optimizers=ADAM,
    steps=7,
    scaler=_factors(1024.0, 2.0, 0.5, 2),
    inject=_at([0, 3], INF),
    spec=(33, 34),
  ),
  Scenario(
    "linear_momentum",
    "docs/torch_semantics.md §6.35: momentum SGD (0.9), init 7, backoff 0.25, interval 2, inf at 1 and 5: "
    "the momentum buffer is untouched on skipped steps.",
    models.linear10,
    optimizers=MOMENTUM,
    steps=7,
    scaler=_factors(7.0, 2.0, 0.25, 2),
    inject=_at([1, 5], INF),
    spec=(35,),
  ),
  Scenario(
    "linear_adam_fused",
    "docs/torch_semantics.md §6.36: torch's fused Adam (the _step_supports_amp_scaling path) against "
    "optax.adam; init 4, interval 1, inf at step 1. A fused step leaves .grad scaled "
    "on an inf step, so torch's unscaled grads are observed through an explicit "
    "unscale_ before step (docs/torch_semantics.md §6.36: same params and state either way).",
    models.linear10,
    optimizers=(OptSpec("adam", 0.01, fused=True),),
    steps=5,
    scaler=_factors(4.0, 2.0, 0.5, 1),
    inject=_at([1], INF),
    spec=(36,),
    explicit_unscale=True,
  ),
  Scenario(
    "linear_disabled",
    "docs/torch_semantics.md §6.55: enabled=False: scale 1, no check, the injected inf is applied and the "
    "parameters go inf/NaN the same way in both.",
    models.linear10,
    steps=4,
    scaler={"enabled": False},
    inject=_at([1], INF),
    spec=(55,),
  ),
  Scenario(
    "vector_bf16",
    "docs/torch_semantics.md §6.21: bfloat16 parameters, scale 3 (inv 1/3 is not dyadic), inf at step 2. "
    "Tolerance 2**-7 (one bfloat16 ulp): torch's SGD rounds p - lr*g once, optax "
    "rounds lr*g to bfloat16 first.",
    lambda: models.vectors({"p": "bfloat16"}),
    steps=8,
    scaler=_factors(3.0, 2.0, 0.5, 3),
    inject=_at([2], INF, "p", 1),
    param_rtol=2**-7,
    spec=(21,),
  ),
  Scenario(
    "vector_bf16_unscale_overflow",
    "docs/torch_semantics.md §6.23: a finite bfloat16 gradient 3e38 at scale 0.5 unscales to inf; "
    "found_inf is 0 (detection looks at the scaled input) and the step is taken.",
    lambda: models.vectors({"p": "bfloat16"}),
    steps=3,
    scaler=_factors(0.5, 2.0, 0.5, 2000),
    inject=_at([1], 3e38, "p", 0),
    param_rtol=2**-7,
    spec=(23,),
  ),
  Scenario(
    "vector_mixed_dtypes",
    "docs/torch_semantics.md §6.59: float32 and bfloat16 parameters in one optimizer; inf only in the "
    "bfloat16 one skips both. Tolerance 2**-7 as vector_bf16.",
    lambda: models.vectors({"p": "float32", "q": "bfloat16"}),
    steps=6,
    scaler=_factors(4.0, 2.0, 0.5, 2),
    inject=_at([2], INF, "q", 3),
    param_rtol=2**-7,
    spec=(59,),
  ),
  Scenario(
    "two_layer_inf_one_layer",
    "Linear -> ReLU -> Linear, momentum SGD, non-dyadic factors; inf, -inf and NaN "
    "written into one layer only (2.bias, then 0.weight) at scripted steps.",
    models.two_layer,
    optimizers=MOMENTUM,
    steps=16,
    scaler=_factors(3.0, 1.5, 0.3, 3),
    inject={
      2: (("2.bias", 1, INF),),
      3: (("2.bias", 0, INF),),
      7: (("0.weight", 17, -INF),),
      11: (("0.weight", 99, NAN),),
    },
    spec=(24,),
  ),
  Scenario(
    "two_layer_two_optimizers",
    "Linear -> ReLU -> Linear, momentum SGD on layer 0 and Adam on layer 2 "
    "(optax: {label: tx} with param_labels in one wrapper); inf and NaN in both "
    "layers on the same steps, so both optimizers skip together.",
    models.two_layer,
    optimizers=(
      OptSpec("sgd", 0.05, momentum=0.9, prefix="0."),
      OptSpec("adam", 0.01, prefix="2."),
    ),
    steps=12,
    scaler=_factors(8.0, 2.0, 0.5, 2),
    inject={
      3: (("0.weight", 0, INF), ("2.bias", 0, NAN)),
      8: (("0.bias", 2, -INF), ("2.weight", 5, INF)),
    },
    spec=(29,),
  ),
  Scenario(
    "two_layer_adamw_save_torch_resume_jax",
    "docs/torch_semantics.md §6.44 across frameworks: AdamW, init 3, growth 1.5, backoff 0.3, interval 3, "
    "inf at 3 and 7; after 5 steps torch's checkpoint (scaler state_dict, weights, "
    "optimizer state) is loaded into jaxamp, which continues.",
    models.two_layer,
    optimizers=ADAMW,
    steps=11,
    scaler=_factors(3.0, 1.5, 0.3, 3),
    inject=_at([3, 7], INF),
    resume=(5, "jax"),
    spec=(44,),
  ),
  Scenario(
    "two_layer_adam_save_jax_resume_torch",
    "docs/torch_semantics.md §6.44 the other way: jaxamp's checkpoint after 5 steps is loaded into a "
    "fresh GradScaler('cpu') (before its first scale()) and a fresh torch Adam.",
    models.two_layer,
    optimizers=ADAM,
    steps=11,
    scaler=_factors(3.0, 1.5, 0.3, 3),
    inject=_at([3, 7], INF),
    resume=(5, "torch"),
    spec=(44,),
  ),
  Scenario(
    "mlp_digits",
    "Real data: a 64-32-10 MLP classifying scikit-learn's digits, momentum SGD, "
    "200 steps, default scale with interval 50, inf/NaN at 4 steps.",
    models.mlp_digits,
    optimizers=(OptSpec("sgd", 0.1, momentum=0.9),),
    steps=200,
    scaler=_factors(65536.0, 2.0, 0.5, 50),
    inject={
      30: (("0.weight", 3, INF),),
      31: (("2.bias", 1, NAN),),
      120: (("2.weight", 7, -INF),),
      150: (("0.bias", 0, INF),),
    },
    plot=True,
  ),
  Scenario(
    "cnn_digits",
    "Real data: Conv2d(1,4,3) -> ReLU -> Linear on the digits, "
    "momentum SGD, 200 steps, interval 40, inf at 2 steps. Tolerances 1e-4 "
    "(parameters) and 1e-2 (momentum buffers): torch against itself, 1 against 2 "
    "intra-op threads (a different convolution summation order), drifts apart by "
    "4.6e-5 and 1.5e-3 over these 200 steps; a ReLU input near zero can flip sign "
    "with the rounding and momentum buffers are sums of cancelling gradients.",
    models.cnn_digits,
    optimizers=(OptSpec("sgd", 0.1, momentum=0.9),),
    steps=200,
    scaler=_factors(65536.0, 2.0, 0.5, 40),
    inject={60: (("0.weight", 5, INF),), 61: (("3.weight", 100, INF),)},
    param_rtol=1e-4,
    state_rtol=1e-2,
    plot=True,
  ),
  Scenario(
    "mlp_digits_fp16",
    "float16 compute: torch autocast('cpu', float16) against Flax Dense(dtype=float16, "
    "param_dtype=float32); SGD, 200 steps, scale 2**20 with interval 20, so float16 "
    "overflows happen by themselves and must be found on the same steps. Parameter "
    "tolerance 1e-2: float16 rounds to 2**-11 (4.9e-4) relative, the two frameworks "
    "round activations and gradients in different places, and the per-step gradient "
    "difference measured at step 0 is up to 1e-3 relative; over 200 steps at lr 0.1 "
    "the parameters drift apart by 1.5e-3 (measured), 1e-2 leaves 6x headroom.",
    functools.partial(models.mlp_digits, compute_dtype="float16"),
    optimizers=(OptSpec("sgd", 0.1),),
    steps=200,
    scaler=_factors(2.0**20, 2.0, 0.5, 20),
    autocast="float16",
    param_rtol=1e-2,
    plot=True,
  ),
  Scenario(
    "mlp_digits_autocast",
    "float16 compute by jaxamp.autocast: torch autocast('cpu', float16) against the "
    "unmodified float32 Flax model under jaxamp.autocast(float16, policy='cpu'), so "
    "every op has torch's dtype; otherwise mlp_digits_fp16 (SGD, 200 steps, scale "
    "2**20, interval 20: real float16 overflows, found on the same steps). Each "
    "linear adds its bias inside the float16 matmul and rounds once, as torch's, so "
    "the step-0 gradients are torch's bit for bit (measured); float32 rounding of the "
    "loss and the SGD update then flips later float16 roundings, and over 200 steps at "
    "lr 0.1 the parameters drift 2.2e-3 apart (measured; 9 skips); tolerance 1e-2 as "
    "mlp_digits_fp16.",
    models.mlp_digits_autocast,
    optimizers=(OptSpec("sgd", 0.1),),
    steps=200,
    scaler=_factors(2.0**20, 2.0, 0.5, 20),
    autocast="float16",
    param_rtol=1e-2,
  ),
  Scenario(
    "transformer_decoder",
    "A 2-layer decoder-only Transformer (d_model 32, 4 heads, causal self-attention, "
    "pre-LayerNorm, GELU MLP; q/k/v without bias) on a synthetic copy task, float32, "
    "momentum SGD, 200 steps, interval 10, inf written into a different layer every 29 "
    "steps: several growth and backoff cycles. Momentum SGD, not Adam: Adam's first "
    "step divides each gradient by its own magnitude, so elements whose gradient is "
    "rounding noise (sums that cancel) take full steps in a direction set by the "
    "rounding; measured 9e-5 apart at step 0.",
    models.transformer,
    optimizers=(OptSpec("sgd", 0.1, momentum=0.9),),
    steps=200,
    scaler=_factors(65536.0, 2.0, 0.5, 10),
    inject={
      s: ((name, 5, INF),)
      for s, name in zip(
        range(7, 200, 29),
        [
          "blocks.0.q.weight",
          "blocks.1.fc1.weight",
          "head.bias",
          "embed.weight",
          "blocks.0.ln1.weight",
          "blocks.1.o.weight",
          "pos",
        ],
      )
    },
    plot=True,
  ),
  Scenario(
    "two_layer_long_growth_backoff",
    "1,200 steps, momentum SGD (lr 0.02), growth interval 8, inf every 37 steps and NaN "
    "at 600-602: the scale grows 130 times and backs off 35 (2**10 to 2**105), tracker "
    "and skips bit-equal throughout. lr 0.02: at 0.05 the momentum buffers drift 8.1e-6 "
    "apart over the 1,200 steps, too close to 1e-5 (at 0.02: 1.4e-6).",
    models.two_layer,
    optimizers=(OptSpec("sgd", 0.02, momentum=0.9),),
    steps=1200,
    scaler=_factors(1024.0, 2.0, 0.5, 8),
    inject={
      **_at(range(20, 1200, 37), INF, "2.weight", 13),
      **_at([600, 601, 602], NAN, "0.bias", 4),
    },
    plot=True,
  ),
  Scenario(
    "two_layer_per_optimizer_skip",
    "docs/torch_semantics.md §6.29: two optimizers (momentum SGD on layer 0, Adam on layer 2), inf only in "
    "layer 0 at step 1, NaN only in layer 2 at step 2, both at step 3: each optimizer "
    "skips on its own gradients, and the scale backs off once per update. optax: "
    "dynamic_loss_scale({label: tx}, param_labels=...).",
    models.two_layer,
    optimizers=(
      OptSpec("sgd", 0.05, momentum=0.9, prefix="0."),
      OptSpec("adam", 0.01, prefix="2."),
    ),
    steps=8,
    scaler=_factors(8.0, 2.0, 0.5, 2),
    inject={
      1: (("0.weight", 3, INF),),
      2: (("2.bias", 1, NAN),),
      3: (("0.bias", 0, INF), ("2.weight", 9, NAN)),
    },
    spec=(29,),
  ),
  Scenario(
    "two_layer_untouched_optimizer",
    "docs/torch_semantics.md §6.30: at step 2 only the first optimizer is stepped: only it is recorded, the "
    "update grows normally (interval 1) and the second's parameters stay put.",
    models.two_layer,
    optimizers=(OptSpec("sgd", 0.05, prefix="0."), OptSpec("sgd", 0.05, prefix="2.")),
    steps=5,
    scaler=_factors(8.0, 2.0, 0.5, 1),
    unstepped={2: (1,)},
    spec=(30,),
    apis=("grad_scaler",),
  ),
  Scenario(
    "linear_unscale_without_step",
    "docs/torch_semantics.md §6.54: at step 2, unscale_ but no step: a clean update (the scale grows at "
    "interval 1) and the parameters stay put.",
    models.linear10,
    steps=4,
    scaler=_factors(4.0, 2.0, 0.5, 1),
    explicit_unscale=True,
    unstepped={2: (0,)},
    spec=(54,),
    apis=("grad_scaler",),
  ),
  Scenario(
    "linear_post_unscale_corruption",
    "docs/torch_semantics.md §6.28: unscale_, then an inf written into the gradient, then step: the "
    "found_inf recorded at unscale_ time is used, the step is taken (parameter -inf), "
    "and the update counts it clean.",
    models.linear10,
    steps=3,
    scaler=_factors(4.0, 2.0, 0.5, 2000),
    explicit_unscale=True,
    late_inject=_at([1], INF, "0.weight", 12),
    spec=(28,),
    apis=("grad_scaler",),
  ),
  Scenario(
    "gan",
    "Optimizers that step one after the other with one scale: a "
    "least-squares GAN, Adam on the discriminator (d.*), then Adam on the generator "
    "(g.*), whose loss reads the discriminator just stepped; torch's "
    "scaler.step(opt_d); scaler.step(opt_g); scaler.update() (optax: "
    "dynamic_loss_scale({label: tx}, param_labels=...), tx.update with None gradients "
    "for the other model and update_scale=False for the discriminator). inf/NaN in "
    "D's gradients only at steps 2 and 11, in G's only at 5 and 14, in both at 8: "
    "each optimizer skips on its own, the scale backs off once per iteration. "
    "Parameters to 1e-5 (measured 3.9e-6), Adam's moments to 2e-4: the generator's "
    "gradients pass through both models and their batch means cancel, so a few ulps "
    "of XLA's and ATen's sums weigh more; the moments differ by up to 4.1e-5 over the "
    "20 steps (measured), a missed or extra step by O(1).",
    models.gan,
    optimizers=(OptSpec("adam", 0.01, prefix="d."), OptSpec("adam", 0.01, prefix="g.")),
    steps=20,
    scaler=_factors(1024.0, 2.0, 0.5, 3),
    inject={
      2: (("d.0.weight", 4, INF),),
      5: (("g.2.bias", 1, NAN),),
      8: (("d.2.weight", 7, -INF), ("g.0.weight", 3, INF)),
      11: (("d.0.bias", 9, NAN),),
      14: (("g.0.bias", 0, INF),),
    },
    state_rtol=2e-4,
    spec=(29,),
    plot=True,
  ),
  Scenario(
    "linear_setters_unvalidated",
    "docs/torch_semantics.md §6.53: interval 1, set_growth_factor(0.5) and set_backoff_factor(4.0) before "
    "step 0 (setters are not range-checked), inf at steps 2 and 3: scale 2, 1, 4, 16.",
    models.linear10,
    steps=5,
    scaler=_factors(4.0, 2.0, 0.5, 1),
    setters={0: {"growth_factor": 0.5, "backoff_factor": 4.0}},
    inject=_at([2, 3], INF),
    spec=(53,),
    apis=("grad_scaler",),
  ),
]


REGISTRY: dict[str, Scenario] = {s.name: s for s in SCENARIOS}
