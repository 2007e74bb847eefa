"""The parity report: a text table, a JSON file, a PNG of the curves, and the
"latest report" section of docs/parity.md."""

from __future__ import annotations

import datetime
import json
import math
import os
import pathlib

from parity.engine import Result

_API_NAMES = {"optax": "dynamic_loss_scale", "grad_scaler": "GradScaler"}


def _mark(ok: bool | None) -> str:
  return "n/a" if ok is None else ("yes" if ok else "NO")


def _unscale_mark(r: Result) -> str:
  if r.flushed_elements and r.unscale_bits_match is not False:
    return "yes, FTZ*"
  return _mark(r.unscale_bits_match)


def _value(value: float) -> str:
  return f"{value:.1e}" if math.isfinite(value) else "inf"


def _diff(value: float, tolerance: float) -> str:
  return f"{_value(value)} / {tolerance:.0e}"


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
      'divergence: docs/exactness.md, "Subnormals"). In these runs the unscaled '
      "gradients equal torch's bit for bit except where a subnormal is involved, and "
      "there they equal torch's arithmetic with flush-to-zero bit for bit; a parameter "
      "fed by flushed gradients may then differ from torch's (not failed). Flushed elements: "
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


_CHECK, _CROSS = "\u2713", "\u2717"
_API_STYLE = {"optax": ("o", "tab:blue"), "grad_scaler": ("x", "tab:orange")}
# Relative differences below this are drawn at the floor, labelled "0".
_STEP_FLOOR = 1e-10
_RATIO_FLOOR = 1e-4


def steps_png_path(path: pathlib.Path) -> pathlib.Path:
  """Where the per-step panels go: next to the summary, ``NAME_steps.png``."""
  return path.with_name(f"{path.stem}_steps{path.suffix}")


def write_png(results: list[Result], path: pathlib.Path) -> list[pathlib.Path]:
  """The summary (``path``) and the per-step panels (:func:`steps_png_path`)."""
  import matplotlib

  matplotlib.use("Agg")
  steps_path = steps_png_path(path)
  _write_summary(results, path)
  _write_steps(results, steps_path)
  return [path, steps_path]


def png_metadata(grouped: dict[str, list[Result]]) -> dict[str, str]:
  """A PNG text chunk naming the scenarios drawn, so that a test can tell a
  picture that lacks one (tests/test_doc_figures.py reads docs/parity*.png)."""
  return {"Description": "parity scenarios: " + " ".join(grouped)}


def _by_scenario(results: list[Result]) -> dict[str, list[Result]]:
  grouped: dict[str, list[Result]] = {}
  for r in results:
    grouped.setdefault(r.scenario, []).append(r)
  return grouped


def _all(flags) -> str:
  flags = [f for f in flags if f is not None]
  if not flags:
    return "n/a"
  return _CHECK if all(flags) else _CROSS


def _ratio(value: float, tolerance: float) -> float:
  ratio = value / tolerance if math.isfinite(value) else math.inf
  return min(max(ratio, _RATIO_FLOOR), 30.0)


def _write_summary(results: list[Result], path: pathlib.Path) -> None:
  """One row per scenario: the exact checks as marks, the toleranced ones as markers."""
  import matplotlib.pyplot as plt

  grouped = _by_scenario(results)
  n = len(grouped)
  fig = plt.figure(figsize=(13, 1.6 + 0.24 * n))
  grid = fig.add_gridspec(1, 3, width_ratios=[5.2, 2.6, 2.6], wspace=0.05)
  text_ax = fig.add_subplot(grid[0])
  axes = [fig.add_subplot(grid[1]), fig.add_subplot(grid[2])]
  columns = [
    ("scenario", 0.0, "left"),
    ("steps", 0.60, "right"),
    ("scale", 0.69, "center"),
    ("tracker", 0.79, "center"),
    ("skips", 0.885, "center"),
    ("unscale", 0.975, "center"),
  ]
  text_ax.set_xlim(0, 1)
  text_ax.set_ylim(n - 0.5, -0.5)
  text_ax.axis("off")
  for label, x, align in columns:
    text_ax.text(x, -0.9, label, ha=align, va="bottom", fontsize=9, fontweight="bold")
  for row, (name, runs) in enumerate(grouped.items()):
    skips = f"{_all(r.skips_match for r in runs)} {runs[0].skipped_steps}"
    unscale = _all(r.unscale_bits_match for r in runs)
    if any(r.flushed_elements for r in runs) and unscale == _CHECK:
      unscale += " FTZ"
    cells = [
      name,
      str(runs[0].steps),
      _all(r.scale_match for r in runs),
      _all(r.tracker_match for r in runs),
      skips,
      unscale,
    ]
    failed = not all(r.passed for r in runs)
    for (_, x, align), cell in zip(columns, cells):
      color = "tab:red" if failed or cell.startswith(_CROSS) else "black"
      text_ax.text(x, row, cell, ha=align, va="center", fontsize=8, color=color)
    if row % 2 == 0:
      for ax in (text_ax, *axes):
        ax.axhspan(row - 0.5, row + 0.5, color="0.94", zorder=0)
  titles = ("parameters: max difference / tolerance", "optimizer state: max difference / tolerance")
  for ax, title, key in zip(axes, titles, ("param", "state")):
    for row, runs in enumerate(grouped.values()):
      for r in runs:
        marker, color = _API_STYLE[r.api]
        value, tolerance = (
          (r.max_param_diff, r.param_rtol) if key == "param" else (r.max_state_diff, r.state_rtol)
        )
        ax.plot(_ratio(value, tolerance), row, marker, color=color, ms=5, mew=1.5)
    ax.axvline(1.0, color="tab:red", lw=1.2)
    ax.axvspan(1.0, 30.0, color="tab:red", alpha=0.08)
    ax.set_xscale("log")
    ax.set_xlim(_RATIO_FLOOR / 2, 30.0)
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_yticks([])
    ax.set_xticks([_RATIO_FLOOR, 1e-3, 1e-2, 1e-1, 1.0, 10.0])
    ax.set_xticklabels(["\u22641e-4", "1e-3", "1e-2", "0.1", "tol", "10x"], fontsize=8)
    ax.tick_params(axis="x", top=True, labeltop=True, labelsize=8)
    ax.set_title(title, fontsize=9, pad=18)
    ax.grid(axis="x", color="0.85", lw=0.5)
  handles = [
    plt.Line2D([], [], ls="", marker=m, color=c, mew=1.5, label=f"jaxamp {_API_NAMES[api]}")
    for api, (m, c) in _API_STYLE.items()
  ]
  passed = sum(r.passed for r in results)
  fig.suptitle(
    f"jaxamp vs torch.amp.GradScaler: {passed} of {len(results)} runs match, "
    f"{n} scenarios.  {_CHECK}: equal at every step, bit for bit "
    "(scale, growth tracker, skip decisions, unscaled gradients)",
    fontsize=10,
    y=1 - 0.25 / (1.6 + 0.24 * n),
  )
  fig.legend(
    handles=handles,
    loc="upper right",
    ncol=2,
    fontsize=8,
    frameon=False,
    bbox_to_anchor=(0.99, 1 - 0.45 / (1.6 + 0.24 * n)),
  )
  fig.subplots_adjust(
    left=0.01, right=0.99, top=1 - 1.2 / (1.6 + 0.24 * n), bottom=0.35 / (1.6 + 0.24 * n)
  )
  fig.savefig(path, dpi=90, metadata=png_metadata(grouped))
  plt.close(fig)


def _floored(values: list[float]) -> list[float]:
  return [min(max(v, _STEP_FLOOR), 1e3) if math.isfinite(v) else 1e3 for v in values]


def _write_steps(results: list[Result], path: pathlib.Path) -> None:
  """A panel per scenario: jaxamp's difference from torch after each step, and the tolerance."""
  import matplotlib.pyplot as plt
  from matplotlib.ticker import MaxNLocator

  grouped = _by_scenario(results)
  columns = 4
  rows = math.ceil(len(grouped) / columns)
  fig, axes = plt.subplots(rows, columns, figsize=(16, 0.6 + 2.1 * rows), squeeze=False)
  for ax in axes.flat[len(grouped) :]:
    ax.axis("off")
  for ax, (name, runs) in zip(axes.flat, grouped.items()):
    steps = range(1, runs[0].steps + 1)
    skipped = [s for s, flag in zip(steps, runs[0].curves.get("skipped", ())) if flag]
    marker_size = 3 if runs[0].steps <= 30 else 0
    for r in runs:
      color = _API_STYLE[r.api][1]
      ax.plot(
        steps,
        _floored(r.curves["param_diff"]),
        "-",
        color=color,
        lw=1.0,
        marker=".",
        ms=marker_size,
      )
      ax.plot(steps, _floored(r.curves["state_diff"]), ":", color=color, lw=1.0)
    tolerances = sorted({r.param_rtol for r in runs} | {r.state_rtol for r in runs})
    for tolerance in tolerances:
      ax.axhline(tolerance, color="tab:red", ls="--", lw=1.0)
    ax.set_yscale("log")
    top = max(tolerances) * 30
    ax.plot(skipped, [top / 3] * len(skipped), "|", color="tab:red", ms=6, mew=1.0)
    ax.set_ylim(_STEP_FLOOR / 3, top)
    ticks = [_STEP_FLOOR, 1e-8, 1e-6, 1e-4, 1e-2]
    ax.set_yticks([y for y in ticks if y < max(tolerances) * 30])
    ax.set_yticklabels(["\u22641e-10" if y == _STEP_FLOOR else f"{y:.0e}" for y in ax.get_yticks()])
    ax.tick_params(labelsize=7)
    ax.minorticks_off()
    ax.set_xlim(0.5, runs[0].steps + 0.5)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=6, integer=True))
    exact = all(r.scale_match and r.tracker_match and r.skips_match for r in runs)
    verdict = "PASS" if all(r.passed for r in runs) else "FAIL"
    ax.set_title(
      f"{name}: {verdict}\nscale, tracker, skips ({len(skipped)} of {runs[0].steps}): "
      + ("equal" if exact else "DIFFER"),
      fontsize=8,
      color="black" if verdict == "PASS" else "tab:red",
    )
  handles = [
    plt.Line2D([], [], color=c, label=f"jaxamp {_API_NAMES[api]}: parameters")
    for api, (_, c) in _API_STYLE.items()
  ]
  handles += [
    plt.Line2D([], [], color=c, ls=":", label=f"jaxamp {_API_NAMES[api]}: optimizer state")
    for api, (_, c) in _API_STYLE.items()
  ]
  handles += [
    plt.Line2D([], [], color="tab:red", ls="--", label="tolerance"),
    plt.Line2D([], [], ls="", marker="|", color="tab:red", label="skipped step"),
  ]
  fig.legend(
    handles=handles,
    loc="upper center",
    ncol=6,
    fontsize=9,
    frameon=False,
    bbox_to_anchor=(0.5, 1 - 0.22 / (0.6 + 2.1 * rows)),
  )
  fig.suptitle(
    "Relative difference from torch after each step (max |jaxamp - torch| / max |torch| "
    "over each tensor; 0 drawn at the bottom)",
    fontsize=11,
    y=1 - 0.02 / (0.6 + 2.1 * rows),
  )
  fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / (0.6 + 2.1 * rows)), h_pad=1.2)
  fig.savefig(path, dpi=72, metadata=png_metadata(grouped))
  plt.close(fig)


# The section of docs/parity.md between these lines is written by
# `python -m parity --docs docs/parity.md`; everything outside them is left as it is.
DOCS_BEGIN = "<!-- latest report: written by python -m parity --docs; do not edit by hand -->"
DOCS_END = "<!-- end of the latest report -->"


def environment() -> str:
  """Where a report ran: date, cores, load, jax and torch versions (for docs/parity.md)."""
  import jax
  import torch

  load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
  return (
    f"{datetime.date.today().isoformat()}, {os.cpu_count()} CPU cores, load average "
    f"{load:.1f} at the end, jax {jax.__version__} {jax.default_backend().upper()}, "
    f"torch {torch.__version__}"
  )


def _tolerance_rows(results: list[Result]) -> list[str]:
  """Per pair of tolerances: the scenarios under it and their largest differences."""
  groups: dict[tuple[float, float], list[Result]] = {}
  for r in results:
    groups.setdefault((r.param_rtol, r.state_rtol), []).append(r)
  rows = [
    "| tolerance: parameters / states | scenarios | largest difference: parameters / states |",
    "|---|---|---|",
  ]
  for (param_rtol, state_rtol), runs in sorted(groups.items()):
    names = list(dict.fromkeys(r.scenario for r in runs))
    named = ", ".join(f"`{n}`" for n in names) if len(names) <= 3 else str(len(names))
    param = max(r.max_param_diff for r in runs)
    state = max(r.max_state_diff for r in runs)
    rows.append(
      f"| {param_rtol:.0e} / {state_rtol:.0e} | {named} | {_value(param)} / {_value(state)} |"
    )
  return rows


def docs_section(results: list[Result], where: str) -> str:
  """The "latest report" of docs/parity.md, markers included: how and where it
  ran, the table as printed, and the largest differences per tolerance."""
  seconds = sum(r.seconds for r in results)
  scenarios = len({r.scenario for r in results})
  lines = [
    DOCS_BEGIN,
    "",
    (
      "Written by `python -m parity --png docs/parity.png --docs docs/parity.md` on "
      f"{where}: {scenarios} scenarios, {len(results)} runs in {seconds:.0f} s. The "
      "table is what it prints; it drew the two pictures below."
    ),
    "",
    "```text",
    table(results),
    f"{len(results)} runs in {seconds:.0f} s.",
    "```",
    "",
    "The largest difference from torch over every step and tensor, per tolerance:",
    "",
    *_tolerance_rows(results),
    "",
    DOCS_END,
  ]
  return "\n".join(lines)


def check_docs(path: pathlib.Path) -> None:
  """Raises ``ValueError`` unless ``path`` has the section's two markers, in order."""
  text = path.read_text()
  begin, end = text.find(DOCS_BEGIN), text.find(DOCS_END)
  if begin < 0 or end < begin:
    raise ValueError(
      f"{path} has no latest-report section: put the lines {DOCS_BEGIN!r} and "
      f"{DOCS_END!r} where the report is to go."
    )


def write_docs(results: list[Result], path: pathlib.Path, where: str) -> None:
  """Replaces the section between the markers in ``path`` (see :func:`check_docs`)."""
  check_docs(path)
  text = path.read_text()
  begin, end = text.index(DOCS_BEGIN), text.index(DOCS_END) + len(DOCS_END)
  path.write_text(text[:begin] + docs_section(results, where) + text[end:])
