"""The benchmarks' model trees are the published architectures' parameter counts."""

import math
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import model_shapes


@pytest.mark.parametrize(
  ("name", "params", "leaves"),
  [
    # Hugging Face gpt2 (tied embedding), torchvision resnet50 and vit_b_16:
    # the counts their model cards and torchvision's weight tables publish.
    ("gpt2", 124_439_808, 148),
    ("resnet50", 25_557_032, 161),
    ("vit_b16", 86_567_656, 152),
  ],
)
def test_model_trees_have_the_published_parameter_counts(name, params, leaves):
  shapes = model_shapes.MIXES[name]()
  assert sum(math.prod(s) for s in shapes) == params
  assert len(shapes) == leaves


def test_lognormal_mix_has_the_requested_size_and_spread():
  sizes = [math.prod(s) for s in model_shapes.lognormal(25_000_000, 200)]
  assert len(sizes) == 200 and abs(sum(sizes) - 25_000_000) < 200
  assert max(sizes) / min(sizes) > 50  # sigma 1 over 200 draws: not equal sizes
