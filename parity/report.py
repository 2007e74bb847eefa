"""The parity report: a text table, a JSON file and a PNG of the curves."""

from __future__ import annotations

import json
import math
import pathlib

from parity.engine import Result

_API_NAMES = {"optax": "dynamic_loss_scale", "grad_scaler": "GradScaler"}


def _mark(ok: bool | None) -> str:
  return "n/a" if ok is None else ("yes" if ok else "NO")


def _unscale_mark(r: Result) -> str:
  if r.flushed_elements and r.unscale_bits_match is not False:
    return "yes, FTZ*"
  return _mark(r.unscale_bits_match)


def _diff(value: float, tolerance: float) -> str:
  return f"{value:.1e} / {tolerance:.0e}" if math.isfinite(value) else f"inf / {tolerance:.0e}"


def table(results: list[Result]) -> str:
  """One row per run; the columns that must match exactly, then the tolerances."""
  header = (
    "scenario",
    "api",
    "steps",
    "scale",
    "tracker",
    "skips",
    "unscale bits",
    "param diff / tol",
    "state diff / tol",
    "verdict",
  )
  rows = [header]
  for r in results:
    rows.append(
      (
        r.scenario,
        _API_NAMES[r.api],
        str(r.steps),
        _mark(r.scale_match),
        _mark(r.tracker_match),
        _mark(r.skips_match),
        _unscale_mark(r),
        _diff(r.max_param_diff, r.param_rtol),
        _diff(r.max_state_diff, r.state_rtol),
        "PASS" if r.passed else "FAIL",
      )
    )
  widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
  lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
  lines.insert(1, "  ".join("-" * w for w in widths))
  failed = [r for r in results if not r.passed]
  lines.append("")
  lines.append(f"{len(results) - len(failed)} of {len(results)} runs match torch.")
  flushed = [r for r in results if r.flushed_elements]
  if flushed:
    lines.append(
      "* FTZ: XLA flushes float32 subnormals to zero, torch keeps them (a documented "
      "divergence, README 'Exactness'). In these runs the unscaled gradients equal torch's "
      "bit for bit except where a subnormal is involved, and there they equal torch's "
      "arithmetic with flush-to-zero bit for bit; a parameter fed by flushed gradients may then differ from "
      "torch's (not failed). Flushed elements: "
      + ", ".join(f"{r.scenario} [{_API_NAMES[r.api]}] {r.flushed_elements}" for r in flushed)
    )
  for r in failed:
    lines.append(f"FAIL {r.scenario} [{_API_NAMES[r.api]}]:")
    lines.extend(f"  {message}" for message in r.failures)
  return "\n".join(lines)


def to_json(results: list[Result]) -> dict:
  def finite(x: float):
    return x if math.isfinite(x) else str(x)

  return {
    "passed": all(r.passed for r in results),
    "runs": [
      {
        "scenario": r.scenario,
        "api": r.api,
        "steps": r.steps,
        "passed": r.passed,
        "scale_match": r.scale_match,
        "tracker_match": r.tracker_match,
        "skips_match": r.skips_match,
        "unscale_bits_match": r.unscale_bits_match,
        "max_param_diff": finite(r.max_param_diff),
        "param_rtol": r.param_rtol,
        "max_state_diff": finite(r.max_state_diff),
        "state_rtol": r.state_rtol,
        "skipped_steps": r.skipped_steps,
        "flushed_elements": r.flushed_elements,
        "seconds": round(r.seconds, 3),
        "failures": r.failures,
        "curves": {k: [finite(v) for v in vs] for k, vs in r.curves.items()},
      }
      for r in results
    ],
  }


def write_json(results: list[Result], path: pathlib.Path) -> None:
  path.write_text(json.dumps(to_json(results), indent=1) + "\n")


def write_png(results: list[Result], plotted: set[str], path: pathlib.Path) -> None:
  """Scale trajectories (log scale) and loss curves, torch and jaxamp side by side."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  names = [n for n in dict.fromkeys(r.scenario for r in results) if n in plotted]
  if not names:
    names = list(dict.fromkeys(r.scenario for r in results))[:4]
  fig, axes = plt.subplots(len(names), 2, figsize=(12, 3.2 * len(names)), squeeze=False)
  styles = {"optax": ("--", "tab:orange"), "grad_scaler": (":", "tab:green")}
  for row, name in zip(axes, names):
    runs = [r for r in results if r.scenario == name]
    for ax, key, label in ((row[0], "scale", "loss scale"), (row[1], "loss", "loss")):
      ax.plot(
        runs[0].curves[f"torch_{key}"], "-", color="tab:blue", lw=2.5, alpha=0.6, label="torch"
      )
      for r in runs:
        style, color = styles[r.api]
        ax.plot(
          r.curves[f"jax_{key}"], style, color=color, lw=1.5, label=f"jaxamp {_API_NAMES[r.api]}"
        )
      ax.set_yscale("log")
      ax.set_title(f"{name}: {label}")
      ax.set_xlabel("step")
      ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=80)
  plt.close(fig)
