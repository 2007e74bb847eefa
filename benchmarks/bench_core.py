"""jaxamp's core costs in one run: step time and compile time, as ratios to plain Adam.

Everything runs in this one process, each contender interleaved with plain
``optax.adam`` (round-robin, one call or one compile each in turn), so that a
ratio compares measurements taken under the same load. The ratio is that of
the medians.

Step time (``step`` part): one jitted optimizer step,
``step(params, opt_state, grads) -> (params, opt_state)`` with
``donate_argnums=(0, 1)``, on 25M float32 params in 200 leaves of lognormal
sizes (``lognormal/25m/200`` of benchmarks/model_shapes.py, fixed seed) and
float32 gradients that are an input of the step (not donated, reused):

  adam                   plain optax.adam, tx.update + optax.apply_updates (ratio 1)
  apply_scaled_updates   jaxamp.apply_scaled_updates(dynamic_loss_scale(adam), ...)
  optax form             dynamic_loss_scale(adam): tx.update + optax.apply_updates

Each jaxamp contender runs a ``finite`` row and a ``skip`` row (one inf in the
middle leaf's gradient, so every step is skipped); each row has its own params
and state, and every ratio is to the finite plain-Adam step. Each round runs
the rows in a new random order (fixed seed). Each step is
compiled first (``.lower(...).compile()``), 2 warm-up rounds are left out,
and every call ends in ``jax.block_until_ready``. Besides wall time, each row
gives the process's CPU time and its minor page faults per step (the fresh
pages of a temporary buffer XLA allocates on every call).

Compile time (``compile-lm`` and ``compile-tree`` parts): wall time, and the
process's CPU time (all threads), of
``jax.jit(step, donate_argnums=(0, 1)).lower(...).compile()``: tracing,
lowering and XLA's compile of a fresh step function each time, with JAX's
persistent compilation cache off, so that no program is reused. One untimed
compile of each contender first (of the LM itself; of 6 leaves of the tree's
shapes) warms JAX's own caches (its jitted ``jnp`` helpers, which every
contender shares; jaxamp nests no ``jax.jit`` of its own in a step);
``--cold`` clears them before every compile instead (``jax.clear_caches()``).
On a loaded machine the CPU ratio is the steadier one. The median of
``--compile-repeats``, interleaved:

  compile-lm    a whole training step of the 17M decoder LM of
                benchmarks/bench_whole_step.py (vocab 8192, width 384, 6 layers,
                6 heads, context 256, batch 8, float16 compute): forward, grad,
                update. The jaxamp steps differentiate ``jaxamp.scale_loss``.
  compile-tree  the update alone (as in the step part) on 3,000 small float32
                leaves: 500 copies of a 32-128-32 MLP layer pair's 6 params
                (4.7M params).

For each compiled step the table also gives, from its optimized HLO, the
fusions (kernels), ``copy`` instructions, ``while`` and ``conditional`` ops,
the temporaries (``memory_analysis()``) and how many of the donated buffers
the outputs reuse (``--hlo-dir DIR`` writes each compiled HLO there).

  PYTHONPATH=. python benchmarks/bench_core.py                       # everything, about 10 min on 2 cores
  PYTHONPATH=. python benchmarks/bench_core.py --quick               # smoke: small trees, 3 repeats
  PYTHONPATH=. python benchmarks/bench_core.py --parts step --repeats 100 --json out.json

To measure another revision, put its ``jaxamp`` first on the path and check
the ``jaxamp from`` line of the header:
``git worktree add /tmp/before REV && PYTHONPATH=/tmp/before python benchmarks/bench_core.py``.
``JAXAMP_XLA_OFF=in_place`` (or ``all``) measures jaxamp with its compiler
workarounds off (jaxamp/_xla/__init__.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import results_file
from model_shapes import MIXES, describe

import jaxamp

LR = 1e-3
SCALE = 2.0**16  # dynamic_loss_scale's default initial scale, written out
CONTENDERS = ("adam", "apply_scaled_updates", "optax form")
PARTS = ("step", "compile-lm", "compile-tree")
TARGETS = {  # issue 40: step ratios to the finite plain-Adam step, compile ratios
  ("step", "apply_scaled_updates", "finite"): 1.0,
  ("step", "optax form", "finite"): 1.5,
  ("step", "apply_scaled_updates", "skip"): 0.35,
  ("step", "optax form", "skip"): 0.35,
  ("compile", "apply_scaled_updates"): 1.3,
  ("compile", "optax form"): 1.3,
}


STEP_HEADER = (
  "| contender | grads | median ms | p10-p90 ms | / adam | CPU ms | / adam, CPU | faults | target "
  "| fusions / copies / whiles / conds | temp MiB | aliased |"
)
COMPILE_HEADER = (
  "| contender | wall s | all wall s | / adam | CPU s | / adam, CPU | target "
  "| fusions / copies / whiles / conds | temp MiB | aliased |"
)


def small_layers(n_leaves: int) -> list[tuple[int, ...]]:
  """``n_leaves`` small leaves: copies of a 32-128-32 MLP layer pair's params."""
  pair = [(32, 32), (32,), (32, 128), (128,), (128, 32), (32,)]
  return [pair[i % len(pair)] for i in range(n_leaves)]


# ----------------------------------------------------------------- steps


def make_tx(contender: str) -> optax.GradientTransformation:
  adam = optax.adam(LR)
  return adam if contender == "adam" else jaxamp.dynamic_loss_scale(adam, init_scale=SCALE)


def update_step(contender: str, tx: optax.GradientTransformation) -> Callable:
  """A fresh ``(params, opt_state, grads) -> (params, opt_state)`` function."""
  if contender == "apply_scaled_updates":

    def step(params, opt_state, grads):
      return jaxamp.apply_scaled_updates(tx, grads, opt_state, params)

  else:  # plain adam and the optax form: the same two calls

    def step(params, opt_state, grads):
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

  return step


def lm_step(contender: str, tx: optax.GradientTransformation, model: Any) -> Callable:
  """A fresh whole training step ``(params, opt_state, tokens) -> (params, opt_state, loss)``."""
  from bench_whole_step import cross_entropy

  def loss_fn(params, tokens):
    return cross_entropy(model.apply({"params": params}, tokens), tokens, jnp.float32(1.0))

  if contender == "adam":

    def step(params, opt_state, tokens):
      loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    return step

  def step(params, opt_state, tokens):
    scaled_loss_fn = lambda p: jaxamp.scale_loss(loss_fn(p, tokens), opt_state)
    loss, grads = jax.value_and_grad(scaled_loss_fn)(params)
    if contender == "apply_scaled_updates":
      params, opt_state = jaxamp.apply_scaled_updates(tx, grads, opt_state, params)
    else:
      updates, opt_state = tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
    return params, opt_state, loss

  return step


# ------------------------------------------------------------- HLO facts


def kernel_counts(text: str) -> dict[str, int]:
  """The ops of an optimized HLO module's kernel-level computations (the entry,
  loop bodies, branches), by opcode: a fusion's own computation is left out,
  so a ``copy`` counted is a kernel that copies a buffer, not a transpose
  inside a fusion."""
  fused = set(re.findall(r"calls=%([\w.\-]+)", text))
  counts: dict[str, int] = {}
  inside = False
  for line in text.splitlines():
    header = re.match(r"^(?:ENTRY )?%([\w.\-]+) \(.*\{\s*$", line)
    if header:
      inside = header.group(1) not in fused
      continue
    op = re.match(r"^\s+(?:ROOT )?%\S+ = .+? ([a-z][a-z0-9-]*)\(", line) if inside else None
    if op:
      counts[op.group(1)] = counts.get(op.group(1), 0) + 1
  return counts


def hlo_facts(compiled: Any) -> dict[str, Any]:
  """Kernel counts, temporaries and aliased buffers of a compiled step."""
  text = compiled.as_text() or ""
  count = kernel_counts(text)
  memory = compiled.memory_analysis()
  return {
    "fusions": count.get("fusion", 0),
    "copies": count.get("copy", 0),
    "whiles": count.get("while", 0),
    "conditionals": count.get("conditional", 0),
    "temp_mib": None if memory is None else memory.temp_size_in_bytes / 2**20,
    "aliased": len(re.findall(r"\(\d+, \{[^}]*\}, (?:may|must)-alias\)", text.split("\n", 1)[0])),
  }


def facts_note(facts: dict[str, Any]) -> str:
  temp = "-" if facts["temp_mib"] is None else f"{facts['temp_mib']:.1f}"
  return (
    f"{facts['fusions']} / {facts['copies']} / {facts['whiles']} / {facts['conditionals']} "
    f"| {temp} | {facts['aliased']}"
  )


def dump_hlo(directory: str | None, name: str, compiled: Any) -> None:
  if directory:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, re.sub(r"[^a-z0-9]+", "_", name.lower()) + ".hlo.txt")
    with open(path, "w") as f:
      f.write(compiled.as_text() or "")


# ------------------------------------------------------------ step time


def make_tree(shapes: list, seed: int, scale: float = 1.0) -> list[np.ndarray]:
  rng = np.random.default_rng(seed)
  return [rng.standard_normal(s, np.float32) * np.float32(scale) for s in shapes]


def run_steps(mix: str, repeats: int, hlo_dir: str | None) -> tuple[list[dict], dict]:
  shapes = MIXES[mix]()
  params_np = make_tree(shapes, 0)
  finite = make_tree(shapes, 1, scale=4.0)
  skipped = [g.copy() for g in finite]
  skipped[len(shapes) // 2].reshape(-1)[skipped[len(shapes) // 2].size // 2] = np.inf
  grads = {"finite": [jnp.asarray(g) for g in finite], "skip": [jnp.asarray(g) for g in skipped]}
  # A skip row halves the scale each call: it must stay a normal float32.
  assert repeats + 2 < 120, "at most 117 repeats: the skip rows' scale would go subnormal"
  rows, compiled, facts = [], {}, {}
  for name in CONTENDERS:
    tx = make_tx(name)
    params = [jnp.asarray(p) for p in params_np]
    start = time.perf_counter()
    step = jax.jit(update_step(name, tx), donate_argnums=(0, 1))
    compiled[name] = step.lower(params, tx.init(params), grads["finite"]).compile()
    print(f"  step {mix}, {name}: compiled in {time.perf_counter() - start:.1f} s", flush=True)
    facts[name] = hlo_facts(compiled[name])
    dump_hlo(hlo_dir, f"step {name}", compiled[name])
    for which in ("finite",) if name == "adam" else ("finite", "skip"):
      params = [jnp.asarray(p) for p in params_np]  # each row's own buffers
      rows.append({"contender": name, "grads": which, "state": [params, tx.init(params)]})
  times: dict[int, list[float]] = {i: [] for i in range(len(rows))}
  cpu: dict[int, list[float]] = {i: [] for i in range(len(rows))}
  faults: dict[int, list[int]] = {i: [] for i in range(len(rows))}
  order = np.random.default_rng(0)
  for _ in range(repeats + 2):  # the first two are warm-up
    # Each round in a fresh order: a step runs slower after some others (the
    # optax form's temporaries), and a fixed order would charge that to one row.
    for i in map(int, order.permutation(len(rows))):
      row = rows[i]
      params, opt_state = row["state"]
      start_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      start, start_cpu = time.perf_counter(), time.process_time()
      out = compiled[row["contender"]](params, opt_state, grads[row["grads"]])
      jax.block_until_ready(out)
      times[i].append(time.perf_counter() - start)
      cpu[i].append(time.process_time() - start_cpu)
      faults[i].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start_faults)
      row["state"] = list(out)
  base, base_cpu = statistics.median(times[0][2:]), statistics.median(cpu[0][2:])
  table = []
  for i, row in enumerate(rows):
    ms = np.asarray(times[i][2:]) * 1e3
    table.append(
      {
        "contender": row["contender"],
        "grads": row["grads"],
        "median_ms": float(np.median(ms)),
        "p10_ms": float(np.percentile(ms, 10)),
        "p90_ms": float(np.percentile(ms, 90)),
        "ratio": float(np.median(ms)) / (base * 1e3),
        "cpu_ms": statistics.median(cpu[i][2:]) * 1e3,
        "cpu_ratio": statistics.median(cpu[i][2:]) / base_cpu,
        "page_faults": statistics.median(faults[i][2:]),
        "hlo": facts[row["contender"]],
      }
    )
  return table, {"mix": mix, "tree": describe(shapes)}


# ---------------------------------------------------------- compile time


def compile_seconds(step: Callable, args: tuple, cold: bool) -> tuple[float, float, Any]:
  """Wall and process CPU seconds (every thread: XLA compiles on several) of one compile."""
  if cold:
    jax.clear_caches()  # nothing JAX traced or lowered before is reused
  wall, cpu = time.perf_counter(), time.process_time()
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile()
  return time.perf_counter() - wall, time.process_time() - cpu, compiled


Builder = Callable[[str], tuple[Callable, tuple]]


def run_compiles(
  part: str, repeats: int, builder: Builder, warm: Builder, hlo_dir: str | None, cold: bool
) -> list[dict]:
  """``repeats`` compiles of each contender's ``builder`` step, interleaved,
  after one untimed compile of each ``warm`` step (the same code on shapes
  that warm JAX's own caches)."""
  for name in CONTENDERS:
    step, args = warm(name)
    w, _, _ = compile_seconds(step, args, cold)
    print(f"  {part}, {name}: warm-up compile {w:.2f} s", flush=True)
  wall: dict[str, list[float]] = {name: [] for name in CONTENDERS}
  cpu: dict[str, list[float]] = {name: [] for name in CONTENDERS}
  facts = {}
  for _ in range(repeats):
    for name in CONTENDERS:
      step, args = builder(name)
      w, c, compiled = compile_seconds(step, args, cold)
      if name not in facts:
        facts[name] = hlo_facts(compiled)
        dump_hlo(hlo_dir, f"{part} {name}", compiled)
      wall[name].append(w)
      cpu[name].append(c)
      print(f"  {part}, {name}: compiled in {w:.2f} s ({c:.2f} s of CPU)", flush=True)
  base_wall, base_cpu = statistics.median(wall["adam"]), statistics.median(cpu["adam"])
  return [
    {
      "contender": name,
      "median_s": statistics.median(wall[name]),
      "all_s": wall[name],
      "ratio": statistics.median(wall[name]) / base_wall,
      "median_cpu_s": statistics.median(cpu[name]),
      "all_cpu_s": cpu[name],
      "cpu_ratio": statistics.median(cpu[name]) / base_cpu,
      "hlo": facts[name],
    }
    for name in CONTENDERS
  ]


def lm_shapes(quick: bool) -> tuple[Any, Any, jax.ShapeDtypeStruct, str]:
  """The decoder LM of bench_whole_step.py: its model, param shapes, tokens and a description."""
  from bench_whole_step import LinenGPT

  if quick:
    vocab, seq, width, layers, heads, batch = 512, 32, 64, 2, 2, 2
  else:
    vocab, seq, width, layers, heads, batch = 8192, 256, 384, 6, 6, 8
  model = LinenGPT(vocab, seq + 1, width, layers, heads)
  tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
  params = jax.eval_shape(lambda t: model.init(jax.random.key(0), t)["params"], tokens)
  n = sum(x.size for x in jax.tree.leaves(params))
  what = (
    f"decoder LM, vocab {vocab}, width {width}, {layers} layers, {heads} heads, context {seq}, "
    f"batch {batch}: {n / 1e6:.1f}M params in {len(jax.tree.leaves(params))} leaves"
  )
  return model, params, tokens, what


def lm_builder(quick: bool) -> tuple[Builder, str]:
  model, params, tokens, what = lm_shapes(quick)

  def build(name: str) -> tuple[Callable, tuple]:
    tx = make_tx(name)
    return lm_step(name, tx, model), (params, jax.eval_shape(tx.init, params), tokens)

  return build, what


def tree_builder(n_leaves: int) -> tuple[Builder, str]:
  shapes = small_layers(n_leaves)
  params = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]

  def build(name: str) -> tuple[Callable, tuple]:
    tx = make_tx(name)
    return update_step(name, tx), (params, jax.eval_shape(tx.init, params), params)

  return build, f"update only, {describe(shapes)}"


# ------------------------------------------------------------------ driver


def cpu_flags() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      flags = next(line for line in f if line.startswith("flags")).split()
  except (OSError, StopIteration):
    return ""
  return ",".join(f for f in ("avx2", "avx512f", "avx512_bf16", "f16c", "fma") if f in flags)


def revision(path: str) -> str:
  """The git commit of the jaxamp being measured, ``+dirty`` with uncommitted changes."""
  try:
    root = os.path.dirname(path)
    rev = subprocess.run(
      ["git", "-C", root, "rev-parse", "--short", "HEAD"],
      capture_output=True,
      text=True,
      check=True,
    ).stdout.strip()
    dirty = subprocess.run(
      ["git", "-C", root, "status", "--porcelain", "--", "."],
      capture_output=True,
      text=True,
      check=False,
    ).stdout.strip()
    return rev + ("+dirty" if dirty else "")
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def save(path: str | None, result: dict[str, Any]) -> None:
  """Writes the figures so far (after each part: a run cut short keeps them)."""
  if path:
    with open(path, "w") as f:
      json.dump(result, f, indent=1)


def target_note(key: tuple, ratio: float) -> str:
  limit = TARGETS.get(key)
  return "" if limit is None else f"<= {limit}: {'met' if ratio <= limit else 'NOT met'}"


def main() -> None:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawTextHelpFormatter
  )
  parser.add_argument("--parts", default=",".join(PARTS), help=f"of: {', '.join(PARTS)}")
  parser.add_argument("--mix", default="lognormal/25m/200", help="the step part's tree")
  parser.add_argument("--repeats", type=int, default=50, help="timed steps per row")
  parser.add_argument("--compile-repeats", type=int, default=3)
  parser.add_argument("--leaves", type=int, default=3000, help="the compile-tree part's leaves")
  parser.add_argument("--quick", action="store_true", help="smoke: 1M params, tiny LM, 3 repeats")
  parser.add_argument(
    "--cold", action="store_true", help="clear JAX's in-memory caches before each compile"
  )
  parser.add_argument("--json", metavar="PATH", help="write every figure there")
  parser.add_argument("--hlo-dir", metavar="DIR", help="write each compiled step's HLO there")
  args = parser.parse_args()
  if args.quick:
    args.mix, args.repeats, args.compile_repeats, args.leaves = "equal/1m/4", 3, 1, 60
  parts = args.parts.split(",")
  unknown = set(parts) - set(PARTS)
  if unknown:
    parser.error(f"unknown parts {sorted(unknown)}; of: {', '.join(PARTS)}")
  # Every compile is measured afresh: no program comes from a cache on disk.
  jax.config.update("jax_enable_compilation_cache", False)
  jax.jit(lambda x: x + 1).lower(1.0).compile()  # backend start-up, outside every timing
  hardware = {
    **results_file.machine(),  # cpu, cores, device, jax, date: as every results file
    "cpu_flags": cpu_flags(),
    "optax": optax.__version__,
    "python": platform.python_version(),
    "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
  }
  meta = {
    "jaxamp_path": os.path.dirname(jaxamp.__file__),
    "jaxamp_revision": revision(jaxamp.__file__),
    "jaxamp_xla_off": os.environ.get("JAXAMP_XLA_OFF", ""),
    "load_average_start": os.getloadavg(),
    "started": time.strftime("%Y-%m-%d %H:%M:%S"),
  }
  print(
    f"# {hardware['cpu']} [{hardware['cpu_flags']}], {hardware['cores']} cores, "
    f"{hardware['device']}, jax {jax.__version__}, optax {optax.__version__}\n"
    f"# jaxamp from {meta['jaxamp_path']} ({meta['jaxamp_revision']}), "
    f"JAXAMP_XLA_OFF={meta['jaxamp_xla_off']!r}, load average {os.getloadavg()[0]:.2f}",
    flush=True,
  )
  result: dict[str, Any] = {
    "command": results_file.command(),
    "hardware": hardware,
    "meta": meta,
    "args": vars(args),
  }
  tables = []  # printed as each part ends, and all again at the end
  if "step" in parts:
    table, info = run_steps(args.mix, args.repeats, args.hlo_dir)
    result["step"] = {**info, "repeats": args.repeats, "rows": table}
    title = (
      f"\n## Step time: {info['mix']} ({info['tree']}), float32 grads, "
      f"median of {args.repeats}, ratio to the finite adam step\n"
    )
    lines = [title, STEP_HEADER, "|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|"]
    for row in table:
      note = target_note(("step", row["contender"], row["grads"]), row["ratio"])
      lines.append(
        f"| {row['contender']} | {row['grads']} | {row['median_ms']:.1f} | "
        f"{row['p10_ms']:.1f}-{row['p90_ms']:.1f} | {row['ratio']:.2f} | "
        f"{row['cpu_ms']:.1f} | {row['cpu_ratio']:.2f} | {row['page_faults']:.0f} | {note} | "
        f"{facts_note(row['hlo'])} |"
      )
    tables.append("\n".join(lines))
    print(tables[-1], flush=True)
    save(args.json, result)
  builders = []
  if "compile-lm" in parts:
    build, what = lm_builder(args.quick)
    builders.append(("compile-lm", build, build, what))
  if "compile-tree" in parts:
    # 6 leaves hold each of the 3,000's shapes: enough to warm JAX's caches.
    build, what = tree_builder(args.leaves)
    builders.append(("compile-tree", build, tree_builder(6)[0], what))
  for part, build, warm, what in builders:
    table = run_compiles(part, args.compile_repeats, build, warm, args.hlo_dir, args.cold)
    result[part] = {"what": what, "repeats": args.compile_repeats, "rows": table}
    cold = " (caches cleared)" if args.cold else ""
    title = f"\n## Compile time, {part}: {what}; median of {args.compile_repeats}{cold}\n"
    lines = [title, COMPILE_HEADER, "|---|---:|---|---:|---:|---:|---|---|---:|---:|"]
    for row in table:
      every = ", ".join(f"{s:.2f}" for s in row["all_s"])
      note = target_note(("compile", row["contender"]), row["ratio"])
      lines.append(
        f"| {row['contender']} | {row['median_s']:.2f} | {every} | {row['ratio']:.2f} | "
        f"{row['median_cpu_s']:.2f} | {row['cpu_ratio']:.2f} | {note} | {facts_note(row['hlo'])} |"
      )
    tables.append("\n".join(lines))
    print(tables[-1], flush=True)
    save(args.json, result)
  meta["load_average_end"] = os.getloadavg()
  print("\n# All parts" + "".join(f"\n{table}" for table in tables))
  print(f"\n# load average at the end {os.getloadavg()[0]:.2f}")
  save(args.json, result)


if __name__ == "__main__":
  main()
