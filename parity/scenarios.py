"""The registry of parity scenarios.

Each scenario names the SPEC.md section 6 scenarios it reproduces (``spec``).
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
    clip: ``clip_grad_norm_`` max norm after ``unscale_`` (``clip_by_global_norm``).
    new_scale: ``{step: value}``: ``update(new_scale=value)`` at that step.
    initial_tracker: a growth tracker loaded before the first step.
    accumulate: micro-batches whose scaled gradients are summed per step.
    autocast: torch autocast dtype (the Flax model is built with the same dtype).
    resume: ``(step, "jax" | "torch")``: after ``step`` steps, the other
      framework's checkpoint is loaded into this one, which continues from it.
    param_rtol: relative tolerance for parameters and optimizer states.
    spec: the SPEC.md section 6 scenario numbers covered.
    apis: the jaxamp APIs that can express it.
    plot: whether the report draws its scale and loss curves.
  """

  name: str
  doc: str
  model: Callable[[], models.Pair]
  optimizers: tuple[OptSpec, ...] = SGD
  steps: int = 16
  scaler: dict = dataclasses.field(default_factory=dict)
  inject: dict = dataclasses.field(default_factory=dict)
  clip: float | None = None
  new_scale: dict = dataclasses.field(default_factory=dict)
  initial_tracker: int | None = None
  accumulate: int = 1
  autocast: str | None = None
  resume: tuple[int, str] | None = None
  param_rtol: float = 1e-5
  spec: tuple[int, ...] = ()
  apis: tuple[str, ...] = ("optax", "grad_scaler")
  plot: bool = False


def _at(steps, value, name="0.weight", index=0) -> dict:
  """The same injection at each of ``steps``."""
  return {s: ((name, index, value),) for s in steps}


def _factors(init, growth, backoff, interval) -> dict:
  return dict(init_scale=init, growth_factor=growth, backoff_factor=backoff,
              growth_interval=interval)


_zero_linear = functools.partial(models.linear10, zero_loss=True)

SCENARIOS: list[Scenario] = [
    Scenario(
        "linear_defaults",
        "Linear(10,10), SGD, torch's default scaler (65536, 2, 0.5, 2000); inf at step 5.",
        models.linear10, steps=12, inject=_at([5], INF), spec=(1,),
    ),
    Scenario(
        "linear_trajectory_a",
        "SPEC 5.1: init 8, growth 2, backoff 0.5, interval 3; inf at steps 4, 8, 9.",
        models.linear10, steps=16, scaler=_factors(8.0, 2.0, 0.5, 3),
        inject=_at([4, 8, 9], INF), spec=(7,),
    ),
    Scenario(
        "linear_non_dyadic",
        "SPEC 5.2: init 3, growth 1.5, backoff 0.3, interval 3; inf at 3, 9, 10, 11. "
        "The scale is f32(f64(scale) * factor), not the float32 product.",
        models.linear10, steps=18, scaler=_factors(3.0, 1.5, 0.3, 3),
        inject=_at([3, 9, 10, 11], INF), spec=(8,), plot=True,
    ),
    Scenario(
        "linear_nan",
        "SPEC 5.3: NaN at steps 0-3 and 12 (first backoff 3.0 -> 0.8999999761581421).",
        models.linear10, steps=16, scaler=_factors(3.0, 1.5, 0.3, 2),
        inject=_at([0, 1, 2, 3, 12], NAN, "0.bias", 3), spec=(9,),
    ),
    Scenario(
        "linear_growth_1_1",
        "SPEC 5.4: growth 1.1, backoff 0.9, interval 2; 20 clean steps then 3 infs.",
        models.linear10, steps=23, scaler=_factors(1.0, 1.1, 0.9, 2),
        inject=_at([20, 21, 22], INF, "0.weight", 99), spec=(10,),
    ),
    Scenario(
        "linear_neg_inf",
        "SPEC 5.5: -inf at steps 2, 4, 5 with interval 1 (growth on every clean step).",
        models.linear10, steps=7, scaler=_factors(65536.0, 2.0, 0.5, 1),
        inject=_at([2, 4, 5], -INF, "0.weight", 50), spec=(11,),
    ),
]


REGISTRY: dict[str, Scenario] = {s.name: s for s in SCENARIOS}
