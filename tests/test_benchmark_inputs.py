"""The benchmarks' model trees are the published architectures' parameter counts."""

import math
import pathlib
import sys

import jax
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


def test_core_benchmark_trees_are_the_sizes_it_describes():
  # benchmarks/bench_core.py: 25M params in 200 lognormal leaves, 3,000 small
  # leaves, and the 17M decoder LM, whose count is worked out by hand from its
  # architecture: embeddings 8192*384 + 257*384, six blocks of two LayerNorms
  # (4*384), four attention projections (4*(384*384 + 384)) and an MLP
  # (384*1536 + 1536 + 1536*384 + 384), a final LayerNorm (2*384) and an
  # untied head without bias (384*8192).
  import bench_core

  assert len(bench_core.small_layers(3000)) == 3000
  assert max(math.prod(s) for s in bench_core.small_layers(3000)) <= 4096
  block = 4 * 384 + 4 * (384 * 384 + 384) + 384 * 1536 + 1536 + 1536 * 384 + 384
  expected = 8192 * 384 + 257 * 384 + 6 * block + 2 * 384 + 384 * 8192
  _, params, _, _ = bench_core.lm_shapes(quick=False)
  leaves = jax.tree.leaves(params)
  assert sum(x.size for x in leaves) == expected == 17_037_696
  assert len(leaves) == 2 + 6 * 16 + 2 + 1  # embeddings, 16 arrays a block, LayerNorm, head
