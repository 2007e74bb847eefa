"""How far torch drifts from *itself* when only the summation order changes.

``python -m parity.noise_floor [SCENARIO ...]`` runs the torch side of each
scenario twice, with 1 and with 2 intra-op threads (different reduction orders
in the convolution and matrix kernels), and prints the largest relative
parameter and optimizer-state differences over the run, measured as the suite
measures jaxamp against torch. This is the evidence behind the tolerances of
the real-data scenarios (docs/parity.md): a tolerance below this floor would
fail torch against torch.
"""

from __future__ import annotations

import sys

import torch

from parity import engine, scenarios


def _torch_history(scenario, threads: int) -> list[tuple[dict, dict]]:
  torch.set_num_threads(threads)
  run = engine.TorchRun(scenario, scenario.model())
  history = []
  for step in range(scenario.steps):
    history.append((run.step(step)["params"], run.state()))
  return history


def noise_floor(scenario) -> tuple[float, float]:
  """``(max parameter difference, max state difference)``, 1 vs 2 threads."""
  one, two = _torch_history(scenario, 1), _torch_history(scenario, 2)
  torch.set_num_threads(1)
  params = states = 0.0
  for (p1, s1), (p2, s2) in zip(one, two):
    for name, value in p1.items():
      params = max(params, engine.relative_difference(value, p2[name]))
    for kind, values in s1.items():
      if kind == "step":
        continue
      for name, value in values.items():
        states = max(states, engine.relative_difference(value, s2[kind][name]))
  return params, states


def main(argv: list[str]) -> int:
  names = argv or ["mlp_digits", "cnn_digits"]
  for name in names:
    params, states = noise_floor(scenarios.REGISTRY[name])
    print(f"{name}: torch 1 vs 2 threads: parameters {params:.2e}, states {states:.2e}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
