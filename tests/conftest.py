import json
import pathlib

import pytest

HERE = pathlib.Path(__file__).resolve().parent
FIXTURES = HERE / "data" / "torch_fixtures.json"  # copy of shared/torch_reference/fixtures.json
SHARED_FIXTURES = HERE.parents[1] / "shared" / "torch_reference" / "fixtures.json"


@pytest.fixture(scope="session")
def torch_fixtures():
  """The exact torch trajectories of ``shared/torch_reference/fixtures.json``."""
  return {f["name"]: f for f in json.loads(FIXTURES.read_text())}
