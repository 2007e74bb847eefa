"""``python -m parity``: every scenario in torch and in jaxamp, compared step by step.

Exit status: 0 when every run matches torch, 1 when one does not, 2 on bad input
(a missing dependency, an unknown scenario, an output path that cannot be written).
"""

from __future__ import annotations

import argparse
import difflib
import functools
import importlib
import os
import pathlib
import sys
import tempfile

_APIS = ("optax", "grad_scaler")
_INSTALL_HINT = (
  "Install the parity extra: pip install -e '.[parity]' (or run bash scripts/parity.sh)."
)


class BadInput(Exception):
  """A problem with the command line or the environment, reported without a traceback."""


def _parse(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog="python -m parity",
    description="Runs the same models under torch.amp.GradScaler and under jaxamp and "
    "compares scale, growth tracker, skip decisions, unscaled gradients (bit for bit), "
    "parameters and optimizer states (within stated tolerances) after every step.",
  )
  parser.add_argument(
    "--scenario",
    action="append",
    metavar="NAME",
    help="run only this scenario (repeatable); see --list",
  )
  parser.add_argument(
    "--api",
    choices=(*_APIS, "all"),
    default="all",
    help="which jaxamp API to compare (default: all that apply)",
  )
  parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
  parser.add_argument(
    "--json", metavar="PATH", type=pathlib.Path, help="also write the results as JSON"
  )
  parser.add_argument(
    "--png",
    metavar="PATH",
    type=pathlib.Path,
    default=pathlib.Path("parity_out/parity.png"),
    help="where to write the summary picture; the per-step differences go next to it, "
    "as NAME_steps.png (default: %(default)s)",
  )
  parser.add_argument("--no-png", action="store_true", help="do not draw the pictures")
  parser.add_argument(
    "--docs",
    metavar="PATH",
    type=pathlib.Path,
    help="rewrite the latest-report section of this Markdown file (docs/parity.md) with "
    "the table, where it ran and the largest differences; needs a run of every scenario",
  )
  parser.add_argument("--no-progress", action="store_true", help="no progress bar")
  return parser.parse_args(argv)


def _require(module: str, why: str, package: str | None = None) -> None:
  try:
    importlib.import_module(module)
  except ImportError as error:
    name = package or module
    raise BadInput(f"{name} is not installed ({why}): {error}. {_INSTALL_HINT}") from None


def _check_writable(path: pathlib.Path, what: str) -> None:
  """Fails early, before minutes of running, if ``path`` cannot be written."""
  if path.is_dir():
    raise BadInput(f"cannot write the {what} to {path}: it is a directory.")
  parent = path.parent if str(path.parent) else pathlib.Path(".")
  try:
    parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=parent, prefix=".parity-check-"):
      pass
    if path.exists() and not os.access(path, os.W_OK):
      raise PermissionError(f"{path} is read-only")
  except OSError as error:
    raise BadInput(f"cannot write the {what} to {path}: {error}") from None


def _steps_png(path: pathlib.Path) -> pathlib.Path:
  """Where report.write_png puts the per-step panels (report imports torch)."""
  return path.with_name(f"{path.stem}_steps{path.suffix}")


def _check_docs(args: argparse.Namespace, selected: list) -> None:
  """The docs' latest report shows every run: refuse a partial one, and a file
  without the section's markers, before minutes of running."""
  from parity import report

  if args.scenario or args.api != "all":
    raise BadInput("--docs writes the report of every run: leave out --scenario and --api.")
  _check_writable(args.docs, "latest report")
  try:
    report.check_docs(args.docs)
  except (OSError, ValueError) as error:
    raise BadInput(str(error)) from None


def _select(names: list[str] | None, registry: dict) -> list:
  if not names:
    return list(registry.values())
  unknown = [n for n in names if n not in registry]
  if unknown:
    lines = []
    for name in unknown:
      close = difflib.get_close_matches(name, registry, n=3)
      hint = f" Did you mean: {', '.join(close)}?" if close else ""
      lines.append(f"unknown scenario {name!r}.{hint}")
    lines.append("python -m parity --list shows all scenarios.")
    raise BadInput("\n".join(lines))
  return [registry[n] for n in names]


# A run's cost, in units of one step of the small models, from a full run's
# per-run times: building both models and compiling the steps, then each
# micro-batch, dearer for the larger models.
_SETUP_COST = 130.0
_STEP_COST = {"mlp_digits": 1.8, "mlp_digits_autocast": 1.8, "cnn_digits": 2.3, "transformer": 6.0}


def _model_name(scenario) -> str:
  model = scenario.model
  while isinstance(model, functools.partial):
    model = model.func
  return model.__name__


def _cost(scenario) -> float:
  """A run's cost relative to the others, estimated from the scenario's size."""
  steps = scenario.steps * scenario.accumulate
  return _SETUP_COST + steps * _STEP_COST.get(_model_name(scenario), 1.0)


def main(argv: list[str] | None = None) -> int:
  args = _parse(sys.argv[1:] if argv is None else argv)
  try:
    _require("torch", "the reference side of every scenario")
    _require("sklearn", "the digits data set", package="scikit-learn")
    from parity.scenarios import REGISTRY

    if args.list:
      for scenario in REGISTRY.values():
        apis = ", ".join(scenario.apis)
        print(f"{scenario.name}  [{apis}]\n    {scenario.doc}")
      return 0
    selected = _select(args.scenario, REGISTRY)
    if not args.no_png:
      _require("matplotlib", "the --png curves; pass --no-png to skip them")
      _check_writable(args.png, "PNG")
      _check_writable(_steps_png(args.png), "PNG of the per-step differences")
    if args.json is not None:
      _check_writable(args.json, "JSON results")
    if args.docs is not None:
      _check_docs(args, selected)
    return _run(args, selected)
  except BadInput as error:
    print(f"parity: {error}", file=sys.stderr)
    return 2


def _run(args, selected) -> int:
  from parity import engine, report

  runs = [
    (scenario, api)
    for scenario in selected
    for api in _APIS
    if api in scenario.apis and args.api in (api, "all")
  ]
  try:
    from tqdm import tqdm
  except ImportError:
    tqdm = None
  progress = None
  costs = [_cost(scenario) for scenario, _ in runs]
  if tqdm is not None and not args.no_progress:
    # Measured in estimated cost, not in runs: the long runs come last, and a
    # bar counting runs would promise an end long before it.
    progress = tqdm(
      total=sum(costs),
      file=sys.stderr,
      bar_format="{desc} {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}]",
    )
  results = []
  for number, ((scenario, api), cost) in enumerate(zip(runs, costs), 1):
    if progress is not None:
      progress.set_description(f"run {number}/{len(runs)} {scenario.name} [{api}]")
    results.append(engine.run(scenario, api))
    if progress is not None:
      progress.update(cost)
  if progress is not None:
    progress.close()
  print(report.table(results))
  seconds = sum(r.seconds for r in results)
  print(f"{len(results)} runs in {seconds:.0f} s.")
  try:
    if args.json is not None:
      report.write_json(results, args.json)
      print(f"results written to {args.json}")
    if not args.no_png:
      summary, steps = report.write_png(results, args.png)
      print(f"summary written to {summary}, per-step differences to {steps}")
    if args.docs is not None:
      report.write_docs(results, args.docs, report.environment())
      print(f"latest report written to {args.docs}")
  except OSError as error:
    raise BadInput(f"cannot write the output: {error}") from None
  return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
  try:
    sys.exit(main())
  except BrokenPipeError:  # e.g. python -m parity | head
    sys.stderr.close()
    sys.exit(1)
