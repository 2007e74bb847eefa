"""A benchmark's figures as a results file, with the command and the machine that made them.

Every script that README.md or docs/ quotes takes ``--json PATH``; run it with
``--json benchmarks/results/NAME.json`` to replace the file the docs cite.
tests/test_doc_figures.py then fails until the figures the docs state are the
file's (rounded as written), and the paragraph names the file's machine.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from typing import Any

import jax

# The environment variables that change what a benchmark measures.
SETTINGS = ("GLIBC_TUNABLES", "JAXAMP_XLA_OFF", "XLA_FLAGS")


def cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
  """The CPU, its cores, JAX's device ("XLA CPU" or the accelerator's kind), jax, today."""
  device = jax.devices()[0]
  return {
    "cpu": cpu_model(),
    "cores": os.cpu_count(),
    "device": "XLA CPU" if device.platform == "cpu" else device.device_kind,
    "jax": jax.__version__,
    "date": time.strftime("%Y-%m-%d"),
  }


def command() -> str:
  """This run's command line, with the settings that change what it measures."""
  settings = [f"{name}={shlex.quote(os.environ[name])}" for name in SETTINGS if name in os.environ]
  return " ".join([*settings, "PYTHONPATH=.:benchmarks python", shlex.join(sys.argv)])


def write(path: str | None, figures: dict[str, Any]) -> None:
  """Writes ``figures`` to ``path`` (if given) beside the command and the machine."""
  if path:
    with open(path, "w") as f:
      json.dump({"command": command(), "hardware": machine(), **figures}, f, indent=1)
      f.write("\n")
