"""A whole training step of a GPT-style language model: jaxamp against plain Flax.

One jitted step (forward, backward and ``optax.adam`` update, params and
optimizer state donated) of a decoder-only Transformer: token and position
embeddings, ``--layers`` pre-LayerNorm blocks (causal multi-head
self-attention, GELU MLP), a final LayerNorm and an untied LM head; float32
params, float16 compute (``dtype=float16, param_dtype=float32``), the
cross-entropy in float32, on one batch of random tokens. The default model
(vocab 8192, width 384, 6 layers, 6 heads, context 256) has about 17M params.

  PYTHONPATH=.:benchmarks python benchmarks/bench_whole_step.py            # default model, 20 repeats
  PYTHONPATH=.:benchmarks python benchmarks/bench_whole_step.py --quick    # tiny model, 3 repeats
  PYTHONPATH=.:benchmarks python benchmarks/bench_whole_step.py --layers 12 --width 768 --heads 12

Contenders, in two API families (each row's ratio is to its family's plain row):
  linen plain       TrainState(tx=optax.adam), jax.value_and_grad, state.apply_gradients
  linen jaxamp      tx=jaxamp.dynamic_loss_scale(optax.adam), flax_utils.scaled_value_and_grad,
                    state.apply_gradients
  linen jaxamp fast the same with flax_utils.apply_gradients(state, grads=grads)
  linen naive       the simplest check-then-skip step, not torch's arithmetic: the
                    loss times a fixed 65536, jaxamp.ops.all_finite(grads), then
                    state.apply_gradients on grads * (1 / 65536) inside a lax.cond
                    (tx=optax.adam). Its compile time is the least that skipping by
                    a lax.cond adds; its step time shows what jaxamp's row-major
                    gradients save (behind the conditional XLA copies every weight
                    gradient into row-major, docs/speed.md)
  nnx plain         nnx.Optimizer(model, optax.adam, wrt=nnx.Param), nnx.value_and_grad,
                    optimizer.update(model, grads), under nnx.jit
  nnx jaxamp        nnx.Optimizer(model, jaxamp.dynamic_loss_scale(optax.adam)),
                    flax_utils.scaled_value_and_grad, optimizer.update(model, grads)
  nnx jaxamp fast   the same with flax_utils.update(optimizer, model, grads)

The jaxamp steps are written as docs/flax.md shows (they also return
``flax_utils.loss_scale_metrics``). Every step takes a float32 ``poison``
scalar that multiplies the loss: 1.0 for the ``finite`` rows, inf for the
``skip`` rows, whose gradients are then all inf/NaN, so jaxamp skips the
update; the forward and backward are the same computation in both. A skip row
runs the finite row's compiled step on its own copy of the state (same initial
params). Donation: ``jax.jit(step, donate_argnums=0)`` with ``step(state, ...)
-> (state, loss, ...)`` and ``nnx.jit(step, donate_argnums=(0, 1))`` with
``step(model, optimizer, ...)``, whose donated arguments nnx.jit returns first;
the ``aliased/read/donated`` column counts, from the compiled HLO, the donated
buffers updated in place, the donated buffers the step reads, and all donated
buffers (jaxamp's ``found_inf`` is written and never read, so JAX drops it from
the step's inputs: one fewer read than donated on the jaxamp rows). Aliased
equal to read means no donated buffer is copied.

Each step is compiled with ``.lower(...).compile()`` (the ``compile s`` column:
tracing, lowering and XLA compilation, of a fresh step function each time;
the median of ``--compile-repeats`` compiles, interleaved between contenders,
as a single compile varies by 20-30% here) and the compiled step is called in
the loop. Every contender runs in this one process, interleaved step by step, with
``jax.block_until_ready`` on everything the step returns (and, for NNX,
the model's and optimizer's state); 2 warm-up rounds are
left out; median and p10-p90 over ``--repeats`` rounds. The first loss of every
finite row is printed: within a family they are the same (same params, same
batch). The ``skipped`` column is the number of updates jaxamp skipped over the
whole run (warm-up included): 0 on the finite rows, every step on the skip rows.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import time

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import results_file
from flax import nnx
from flax.training import train_state

import jaxamp
from jaxamp import flax_utils

F16, F32 = jnp.float16, jnp.float32
LR = 1e-3
NAIVE_SCALE = 65536.0
TARGETS = (
  "jaxamp step <= 1.03x its plain baseline, skipped step <= 1.0x, first-call compile <= 1.3x"
)


# ------------------------------------------------------------------ models


class LinenBlock(nn.Module):
  width: int
  heads: int

  @nn.compact
  def __call__(self, x, mask):
    kw = {"dtype": F16, "param_dtype": F32}
    h = nn.LayerNorm(**kw)(x)
    x = x + nn.MultiHeadDotProductAttention(self.heads, deterministic=True, **kw)(h, mask=mask)
    h = nn.Dense(4 * self.width, **kw)(nn.LayerNorm(**kw)(x))
    return x + nn.Dense(self.width, **kw)(nn.gelu(h))


class LinenGPT(nn.Module):
  vocab: int
  seq: int
  width: int
  layers: int
  heads: int

  @nn.compact
  def __call__(self, tokens):
    kw = {"dtype": F16, "param_dtype": F32}
    x = nn.Embed(self.vocab, self.width, **kw)(tokens)
    x = x + nn.Embed(self.seq, self.width, **kw)(jnp.arange(tokens.shape[1]))
    mask = nn.make_causal_mask(tokens)
    for _ in range(self.layers):
      x = LinenBlock(self.width, self.heads)(x, mask)
    return nn.Dense(self.vocab, use_bias=False, **kw)(nn.LayerNorm(**kw)(x))


def einsum_attention(query, key, value, *, is_causal=False, **kwargs):
  """linen's dot_product_attention (einsums, softmax), the one linen's attention runs.

  nnx.MultiHeadAttention's default without dropout calls
  jax.nn.dot_product_attention, which XLA CPU refuses in float16 (precision
  'F16_F16_F32' is not supported by dot_general); this is also the computation
  of the linen model. The causal mask comes in ``mask``.
  """
  del is_causal
  return nn.dot_product_attention(query, key, value, **kwargs)


class NnxBlock(nnx.Module):
  def __init__(self, width, heads, rngs):
    kw = {"dtype": F16, "param_dtype": F32, "rngs": rngs}
    self.ln1 = nnx.LayerNorm(width, **kw)
    self.attn = nnx.MultiHeadAttention(
      heads, width, decode=False, deterministic=True, attention_fn=einsum_attention, **kw
    )
    self.ln2 = nnx.LayerNorm(width, **kw)
    self.fc = nnx.Linear(width, 4 * width, **kw)
    self.proj = nnx.Linear(4 * width, width, **kw)

  def __call__(self, x, mask):
    x = x + self.attn(self.ln1(x), mask=mask)
    return x + self.proj(nnx.gelu(self.fc(self.ln2(x))))


class NnxGPT(nnx.Module):
  def __init__(self, vocab, seq, width, layers, heads, rngs):
    kw = {"dtype": F16, "param_dtype": F32, "rngs": rngs}
    self.tok = nnx.Embed(vocab, width, **kw)
    self.pos = nnx.Embed(seq, width, **kw)
    self.blocks = nnx.List([NnxBlock(width, heads, rngs) for _ in range(layers)])
    self.ln = nnx.LayerNorm(width, **kw)
    self.head = nnx.Linear(width, vocab, use_bias=False, **kw)

  def __call__(self, tokens):
    x = self.tok(tokens) + self.pos(jnp.arange(tokens.shape[1]))
    mask = nnx.make_causal_mask(tokens)
    for block in self.blocks:
      x = block(x, mask)
    return self.head(self.ln(x))


def cross_entropy(logits, tokens, poison):
  """Next-token cross-entropy in float32, times ``poison`` (1.0, or inf to overflow)."""
  logits = logits[:, :-1].astype(F32)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
  return loss * poison


# ----------------------------------------------------------- linen steps


def linen_step(kind):
  def loss_fn_of(state, tokens, poison):
    return lambda params: cross_entropy(state.apply_fn({"params": params}, tokens), tokens, poison)

  if kind == "plain":

    def train_step(state, tokens, poison):
      loss, grads = jax.value_and_grad(loss_fn_of(state, tokens, poison))(state.params)
      return state.apply_gradients(grads=grads), loss

  elif kind == "naive":

    def train_step(state, tokens, poison):
      loss_fn = loss_fn_of(state, tokens, poison)
      loss, grads = jax.value_and_grad(lambda p: loss_fn(p) * NAIVE_SCALE)(state.params)

      def apply(state):
        return state.apply_gradients(grads=jax.tree.map(lambda g: g * (1 / NAIVE_SCALE), grads))

      def skip(state):
        return state.replace(step=state.step + 1)

      return jax.lax.cond(jaxamp.ops.all_finite(grads), apply, skip, state), loss / NAIVE_SCALE

  else:

    def train_step(state, tokens, poison):
      loss_fn = loss_fn_of(state, tokens, poison)
      loss, grads = flax_utils.scaled_value_and_grad(loss_fn, state)(state.params)
      if kind == "fast":
        state = flax_utils.apply_gradients(state, grads=grads)
      else:
        state = state.apply_gradients(grads=grads)
      return state, loss, flax_utils.loss_scale_metrics(state)

  return jax.jit(train_step, donate_argnums=0)


class LinenRunner:
  def __init__(self, kind, cfg, params, tokens):
    model = LinenGPT(cfg.vocab, cfg.seq + 1, cfg.width, cfg.layers, cfg.heads)
    scaled = kind in ("jaxamp", "fast")
    tx = jaxamp.dynamic_loss_scale(optax.adam(LR)) if scaled else optax.adam(LR)
    self.states = [  # [finite, skip], each with its own copy of the same params
      train_state.TrainState.create(
        apply_fn=model.apply, params=jax.tree.map(jnp.array, params), tx=tx
      ).replace(step=jnp.int32(0))  # an array: the compiled step's input type
      for _ in range(1 if kind == "plain" else 2)
    ]
    self.tokens, self.kind, self.compile_times = tokens, kind, []
    self.compile()
    self.donated = len(jax.tree.leaves(self.states[0]))
    self.metrics = [None, None]

  def compile(self):
    """Traces, lowers and compiles a fresh step function (no cache can answer)."""
    start = time.perf_counter()
    self.step = linen_step(self.kind).lower(self.states[0], self.tokens, jnp.float32(1.0)).compile()
    self.compile_times.append(time.perf_counter() - start)

  def __call__(self, which, poison):
    out = self.step(self.states[which], self.tokens, poison)
    jax.block_until_ready(out)
    self.states[which] = out[0]
    if len(out) > 2:
      self.metrics[which] = out[2]
    return out[1]


# ------------------------------------------------------------- nnx steps


def nnx_loss_fn(model, tokens, poison):
  return cross_entropy(model(tokens), tokens, poison)


def nnx_step(kind):
  if kind == "plain":

    def train_step(model, optimizer, tokens, poison):
      loss, grads = nnx.value_and_grad(nnx_loss_fn)(model, tokens, poison)
      optimizer.update(model, grads)
      return loss

  else:

    def train_step(model, optimizer, tokens, poison):
      grad_fn = flax_utils.scaled_value_and_grad(nnx_loss_fn, optimizer)
      loss, grads = grad_fn(model, tokens, poison)
      if kind == "fast":
        flax_utils.update(optimizer, model, grads)
      else:
        optimizer.update(model, grads)
      return loss, flax_utils.loss_scale_metrics(optimizer)

  return nnx.jit(train_step, donate_argnums=(0, 1))


class NnxRunner:
  def __init__(self, kind, cfg, tokens):
    # One tx for both pairs: it is static in the compiled step's input tree.
    tx = optax.adam(LR) if kind == "plain" else jaxamp.dynamic_loss_scale(optax.adam(LR))
    self.pairs = []  # [finite, skip]: (model, optimizer), the same initial params
    for _ in range(1 if kind == "plain" else 2):
      model = NnxGPT(cfg.vocab, cfg.seq + 1, cfg.width, cfg.layers, cfg.heads, nnx.Rngs(0))
      self.pairs.append((model, nnx.Optimizer(model, tx, wrt=nnx.Param)))
    self.tokens, self.kind, self.compile_times = tokens, kind, []
    self.compile()
    model, optimizer = self.pairs[0]
    self.donated = len(jax.tree.leaves(nnx.state((model, optimizer))))
    self.metrics = [None, None]

  def compile(self):
    """Traces, lowers and compiles a fresh step function (no cache can answer)."""
    model, optimizer = self.pairs[0]
    start = time.perf_counter()
    self.step = nnx_step(self.kind).lower(model, optimizer, self.tokens, jnp.float32(1.0)).compile()
    self.compile_times.append(time.perf_counter() - start)

  def __call__(self, which, poison):
    model, optimizer = self.pairs[which]
    out = self.step(model, optimizer, self.tokens, poison)
    jax.block_until_ready((out, nnx.state((model, optimizer))))
    if isinstance(out, tuple):
      self.metrics[which] = out[1]
      return out[0]
    return out


def donation_counts(compiled, n_other_args=2):
  """(aliased, read): donated buffers updated in place, and donated buffers the step reads.

  From the compiled HLO module's header: ``input_output_alias`` lists the
  parameters whose buffers outputs reuse; ``entry_computation_layout`` lists
  the parameters, the donated buffers the step reads and then the
  ``n_other_args`` non-donated ones (tokens, poison). A donated buffer the step
  only writes (jaxamp's ``found_inf``) is not a parameter: JAX drops unused
  inputs.
  """
  header = (compiled.as_text() or "").split("\n", 1)[0]
  aliased = len(re.findall(r"\(\d+, \{[^}]*\}, (?:may|must)-alias\)", header))
  layout = header.split("entry_computation_layout={(", 1)[-1].split(")->", 1)[0]
  return aliased, len(re.findall(r"[a-z]+[0-9]*\[[0-9,]*\]", layout)) - n_other_args


# ------------------------------------------------------------------ driver


def main():
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawTextHelpFormatter
  )
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=256, help="context length")
  parser.add_argument("--width", type=int, default=384)
  parser.add_argument("--layers", type=int, default=6)
  parser.add_argument("--heads", type=int, default=6)
  parser.add_argument("--vocab", type=int, default=8192)
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument(
    "--compile-repeats", type=int, default=3, help="compiles per contender, interleaved; median"
  )
  parser.add_argument(
    "--quick", action="store_true", help="smoke test: a tiny model (2x32 tokens), 3 repeats"
  )
  parser.add_argument(
    "--json", metavar="PATH", help="write the figures there (benchmarks/results/)"
  )
  args = parser.parse_args()
  if args.quick:
    args.batch, args.seq, args.width, args.layers, args.heads, args.vocab = 2, 32, 64, 2, 2, 512
    args.repeats, args.compile_repeats = 3, 1
  rng = np.random.default_rng(0)
  # seq + 1 tokens per row: the model reads seq of them and predicts the next.
  tokens = jnp.asarray(rng.integers(0, args.vocab, (args.batch, args.seq + 1)), jnp.int32)
  params = LinenGPT(args.vocab, args.seq + 1, args.width, args.layers, args.heads).init(
    jax.random.key(0), tokens
  )["params"]
  n_linen = sum(x.size for x in jax.tree.leaves(params))
  n_nnx = sum(
    x.size
    for x in jax.tree.leaves(
      nnx.state(
        nnx.eval_shape(
          lambda: NnxGPT(args.vocab, args.seq + 1, args.width, args.layers, args.heads, nnx.Rngs(0))
        ),
        nnx.Param,
      )
    )
  )
  print(
    f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
    f"{jax.devices()[0].platform}, jax {jax.__version__}, optax {optax.__version__}, "
    f"flax {flax.__version__}, repeats {args.repeats}, "
    f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}\n"
    f"# GPT: vocab {args.vocab}, width {args.width}, {args.layers} layers, {args.heads} heads, "
    f"context {args.seq}, batch {args.batch}x{args.seq} tokens; params {n_linen:,} (linen), "
    f"{n_nnx:,} (nnx), float32, float16 compute, adam\n"
    f"# targets (not asserted): {TARGETS}",
    flush=True,
  )
  jax.jit(lambda x: x + 1).lower(1.0).compile()  # backend start-up, outside the first compile
  runners = {}
  for family in ("linen", "nnx"):
    for kind in ("plain", "jaxamp", "fast") + (("naive",) if family == "linen" else ()):
      name = f"{family} {'jaxamp fast' if kind == 'fast' else kind}"
      if family == "linen":
        runner = LinenRunner(kind, args, params, tokens)
      else:
        runner = NnxRunner(kind, args, tokens)
      runner.aliased, runner.read = donation_counts(runner.step)
      runner.alias_note = f"{runner.aliased}/{runner.read}/{runner.donated}"
      print(
        f"  {name}: compiled in {runner.compile_times[0]:.1f} s; donated buffers: {runner.donated}, "
        f"{runner.read} read by the step, {runner.aliased} of them updated in place",
        flush=True,
      )
      runners[name] = runner
  for _ in range(args.compile_repeats - 1):  # interleaved, as the steps are run
    for runner in runners.values():
      runner.compile()
  for name, runner in runners.items():
    runner.compile_s = statistics.median(runner.compile_times)
    times_s = ", ".join(f"{t:.1f}" for t in runner.compile_times)
    print(f"  {name}: compile times {times_s} s, median {runner.compile_s:.1f} s", flush=True)
  rows = [(name, w) for name in runners for w in ((0,) if "plain" in name else (0, 1))]
  poisons = (jnp.float32(1.0), jnp.float32(np.inf))
  times = {row: [] for row in rows}
  first_loss = {}
  for _ in range(args.repeats + 2):  # the first two are warm-up
    for name, which in rows:
      start = time.perf_counter()
      loss = runners[name](which, poisons[which])
      times[(name, which)].append(time.perf_counter() - start)
      first_loss.setdefault((name, which), float(loss))
  print()
  for name in runners:
    print(f"# first loss, {name}: {first_loss[(name, 0)]!r}")
  print(
    "\n| step | grads | median ms | p10-p90 ms | / plain | compile s | compile / plain "
    "| aliased/read/donated | skipped |"
  )
  print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
  table = []
  for name, which in rows:
    family = name.split()[0]
    base_ms = statistics.median(times[(f"{family} plain", 0)][2:]) * 1e3
    base_compile = runners[f"{family} plain"].compile_s
    runner = runners[name]
    ms = np.asarray(times[(name, which)][2:]) * 1e3
    med = float(np.median(ms))
    metrics = runner.metrics[which]
    skipped = "-" if metrics is None else f"{int(metrics['skipped_steps'])}/{args.repeats + 2}"
    print(
      f"| {name} | {'skip' if which else 'finite'} | {med:.1f} | "
      f"{np.percentile(ms, 10):.1f}-{np.percentile(ms, 90):.1f} | {med / base_ms:.3f} | "
      f"{runner.compile_s:.1f} | {runner.compile_s / base_compile:.2f} | "
      f"{runner.alias_note} | {skipped} |"
    )
    table.append(
      {
        "step": name,
        "grads": "skip" if which else "finite",
        "median_ms": med,
        "ratio": med / base_ms,
        "compile_s": runner.compile_s,
        "compile_ratio": runner.compile_s / base_compile,
      }
    )
  model = {k: getattr(args, k) for k in ("batch", "seq", "width", "layers", "heads", "vocab")}
  results_file.write(args.json, {"model": model, "params": n_linen, "rows": table})


if __name__ == "__main__":
  main()
