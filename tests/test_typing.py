"""A user's type checker sees the front-ends' arguments: mypy on code that calls them."""

import os
import pathlib
import re
import subprocess
import sys
import tempfile

import pytest

import jaxamp

pytest.importorskip("mypy")  # pinned in the lint extra; scripts/lint.sh installs it

ACCEPTED = """\
import optax
import jaxamp

tx = jaxamp.dynamic_loss_scale(optax.adam(1e-3), growth_interval=100)
groups = jaxamp.dynamic_loss_scale({"a": optax.sgd(0.1)}, param_labels={"w": "a"})
scaler = jaxamp.GradScaler(growth_interval=100)
on_cuda = jaxamp.GradScaler("cuda", init_scale=2.0**10, hysteresis=2)
torch_cuda_amp = jaxamp.GradScaler(2.0**16, 2.0, 0.5, 2000, True)
"""
MISSPELT = """\
import optax
import jaxamp

tx = jaxamp.dynamic_loss_scale(optax.adam(1e-3), growth_intervall=100)
scaler = jaxamp.GradScaler(growth_intervall=100)
"""


@pytest.mark.slow
def test_mypy_accepts_the_front_ends_arguments_and_reports_a_misspelt_one(tmp_path):
  # The jaxamp beside the files comes first on mypy's path: the one under test,
  # not whichever is installed.
  (tmp_path / "jaxamp").symlink_to(pathlib.Path(jaxamp.__file__).parent)
  (tmp_path / "accepted.py").write_text(ACCEPTED)
  (tmp_path / "misspelt.py").write_text(MISSPELT)
  cache = pathlib.Path(tempfile.gettempdir()) / f"jaxamp-test-mypy-cache-{os.getuid()}"
  command = [sys.executable, "-m", "mypy", "--ignore-missing-imports", "--follow-imports=silent"]
  command += ["--cache-dir", str(cache), "--no-error-summary", "accepted.py", "misspelt.py"]
  out = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, check=False)
  assert out.returncode == 1, out.stdout + out.stderr  # 1: errors found; 2: mypy failed
  errors = re.findall(r"^(\w+\.py):(\d+): error: (.*)$", out.stdout, flags=re.MULTILINE)
  assert [(path, int(line)) for path, line, _ in errors] == [("misspelt.py", 4), ("misspelt.py", 5)]
  for (_, _, message), name in zip(errors, ["dynamic_loss_scale", "GradScaler"]):
    assert message.startswith(f'Unexpected keyword argument "growth_intervall" for "{name}"')
