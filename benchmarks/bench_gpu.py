"""Bandwidth of jaxamp's unscale + finiteness pass on a GPU, against torch's kernel.

One command on a GPU machine (jax[cuda12] and a CUDA torch installed):

  PYTHONPATH=. python benchmarks/bench_gpu.py
  PYTHONPATH=. python benchmarks/bench_gpu.py --peak-gbps 4800   # H200, if not detected

It times ``jaxamp.ops.unscale_and_check`` (jitted) and the check alone
(``jaxamp.ops.all_finite``) on the leaf-size mixes of ``bench_step.py`` (equal and
lognormal sizes, GPT-2 small, ResNet-50 and ViT-B/16: benchmarks/model_shapes.py),
and torch's fused
``torch._amp_foreach_non_finite_check_and_unscale_`` on the same tensors, and
prints the achieved bandwidth (bytes read + written / time) against the
device's peak memory bandwidth. The pass moves at least 2 bytes per gradient
byte (read, write the unscaled copy); the check alone 1.

Then (``--whole-step``, on by default on a GPU) it runs ``bench_whole_step.py``,
the decoder language model's whole training step against the same step without
loss scaling, at a GPU size (batch 32).

On a machine without a GPU, ``--device cpu`` runs the same code small (it is a
smoke test there: the CPU numbers are not the point).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

from model_shapes import MIXES

# Peak memory bandwidth in GB/s by ``device_kind`` substring (vendor figures).
PEAK_GBPS = {
  "H200": 4800,
  "H100 SXM": 3350,
  "H100 PCIe": 2000,
  "H100": 3350,
  "A100-SXM4-80GB": 2039,
  "A100 80GB": 1935,
  "A100": 1555,
  "L40S": 864,
  "L4": 300,
  "A10G": 600,
  "V100": 900,
  "T4": 320,
  "RTX 4090": 1008,
}


def _ready(fn, *args):
  """``fn(*args)``, waited for (a benchmark callable)."""
  import jax  # imported late, as in main(): after the platform is chosen

  return jax.block_until_ready(fn(*args))


def peak_for(kind: str, given: float | None) -> float | None:
  if given:
    return given
  for key, value in PEAK_GBPS.items():
    if key.lower() in kind.lower():
      return value
  return None


def median_time(fn, repeats, inner):
  fn()  # warm-up (and compile)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(inner):
      out = fn()
    times.append((time.perf_counter() - start) / inner)
    del out
  return statistics.median(times), min(times), max(times)


def main():
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawTextHelpFormatter
  )
  parser.add_argument("--device", default="gpu", choices=["gpu", "cpu"])
  parser.add_argument(
    "--mixes",
    default=None,
    help=f"of {', '.join(MIXES)}; default: all but equal/1m/4 on GPU, equal/1m/4 on CPU",
  )
  parser.add_argument("--whole-step", action=argparse.BooleanOptionalAction, default=None)
  parser.add_argument("--dtypes", default="f32,f16,bf16")
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--inner", type=int, default=None, help="calls per timing (10 GPU, 1 CPU)")
  parser.add_argument("--peak-gbps", type=float, default=None)
  parser.add_argument("--no-torch", action="store_true")
  args = parser.parse_args()
  if args.device == "cpu":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  gpu = args.device == "gpu"
  mixes = args.mixes or (",".join(m for m in MIXES if m != "equal/1m/4") if gpu else "equal/1m/4")
  inner = args.inner or (10 if gpu else 1)

  import jax

  device = jax.devices(args.device)[0]
  kind = getattr(device, "device_kind", str(device))
  peak = peak_for(kind, args.peak_gbps)
  print(
    f"# {kind} ({device.platform}), peak {peak or '?'} GB/s, median of {args.repeats} x "
    f"{inner} calls"
  )
  print("| mix | dtype | pass | median ms | min-max ms | GB/s | % of peak |")
  print("|---|---|---|---:|---:|---:|---:|")
  for mix in mixes.split(","):
    _bandwidth(mix, args, device, peak, inner)
  if args.whole_step if args.whole_step is not None else gpu:
    import bench_whole_step

    # One compile per contender: three would not fit the 5-minute budget.
    sys.argv = [
      sys.argv[0],
      "--batch",
      "32",
      "--repeats",
      str(args.repeats),
      "--compile-repeats",
      "1",
    ]
    bench_whole_step.main()


def _bandwidth(mix, args, device, peak, inner):
  import jax
  import jax.numpy as jnp

  import jaxamp

  dtypes = {"f32": jnp.float32, "f16": jnp.float16, "bf16": jnp.bfloat16}
  unscale = jax.jit(jaxamp.ops.unscale_and_check)
  check = jax.jit(jaxamp.ops.all_finite)
  for name in args.dtypes.split(","):
    dtype = dtypes[name]
    key = jax.random.key(0)
    grads = [
      jax.device_put(jax.random.normal(jax.random.fold_in(key, i), shape, dtype), device)
      for i, shape in enumerate(MIXES[mix]())
    ]
    scale = jax.device_put(jnp.float32(65536.0), device)
    nbytes = sum(g.nbytes for g in grads)
    rows = [
      ("jaxamp unscale+check", 2, functools.partial(_ready, unscale, grads, scale)),
      ("jaxamp check only", 1, functools.partial(_ready, check, grads)),
    ]
    if not args.no_torch:
      import torch

      tdev = "cuda" if args.device == "gpu" else "cpu"
      tdtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[name]
      tgrads = [torch.randn(shape, dtype=tdtype, device=tdev) for shape in MIXES[mix]()]
      found = torch.zeros(1, device=tdev)
      inv = torch.full((1,), 1.0 / 65536.0, device=tdev)

      def torch_pass(tgrads=tgrads, found=found, inv=inv, tdev=tdev):
        torch._amp_foreach_non_finite_check_and_unscale_(tgrads, found, inv)
        if tdev == "cuda":
          torch.cuda.synchronize()

      rows.append(("torch _amp_foreach_..._unscale_", 2, torch_pass))
    results = {}
    for label, passes, fn in rows:
      med, lo, hi = median_time(fn, args.repeats, inner)
      results[label] = med
      gbps = passes * nbytes / med / 1e9
      share = f"{100 * gbps / peak:.0f}%" if peak else "?"
      print(
        f"| {mix} | {name} | {label} | {med * 1e3:.3f} | {lo * 1e3:.3f}-{hi * 1e3:.3f} "
        f"| {gbps:.0f} | {share} |",
        flush=True,
      )
    torch_label = "torch _amp_foreach_..._unscale_"
    if torch_label in results:
      ratio = results["jaxamp unscale+check"] / results[torch_label]
      print(f"| {mix} | {name} | jaxamp / torch time | {ratio:.2f} | | | |")


if __name__ == "__main__":
  main()
