import json
import pathlib

import pytest

REFERENCE = pathlib.Path(__file__).resolve().parents[2] / "shared" / "torch_reference"


@pytest.fixture(scope="session")
def torch_fixtures():
  """The exact torch trajectories of ``shared/torch_reference/fixtures.json``."""
  path = REFERENCE / "fixtures.json"
  if not path.exists():
    pytest.fail(f"torch reference fixtures not found at {path}")
  return {f["name"]: f for f in json.loads(path.read_text())}
