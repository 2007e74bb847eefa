"""nanoGPT's ``train.py`` ported to JAX with jaxamp: float16 autocast, GradScaler,
gradient accumulation, clipping after ``unscale_``, and the cosine schedule.

A port of karpathy/nanoGPT's ``train.py`` at commit
3adf61e154c3fe3fca428ad6bc3818b27a3b8291 (MIT License, Copyright (c) 2022
Andrej Karpathy), written from jaxamp's porting guide (docs/porting.md,
docs/grad_scaler.md). The loop keeps upstream's names and order; what each
torch line became:

  ctx = torch.amp.autocast(device_type, dtype) -> jaxamp.autocast(loss_fn, dtype, policy=...)
  scaler = torch.cuda.amp.GradScaler(enabled=(dtype == 'float16'))
                                               -> jaxamp.GradScaler(enabled=(dtype == 'float16'))
  optimizer = model.configure_optimizers(...)  -> opt = jaxamp.Optimizer(configure_optimizers(...), params)
  param_group['lr'] = lr                       -> opt.opt_state.hyperparams['learning_rate'] = lr
  scaler.scale(loss).backward()                -> opt.accumulate(jax.grad(scaled loss)(opt.params))
  scaler.unscale_(optimizer)                   -> scaler.unscale_(opt)
  clip_grad_norm_(model.parameters(), clip)    -> opt.grads, _ = jaxamp.clip_grad_norm(opt.grads, clip)
  scaler.step(optimizer); scaler.update()      -> scaler.step(opt); scaler.update()
  optimizer.zero_grad(set_to_none=True)        -> opt.zero_grad(set_to_none=False) (one jitted structure)
  torch.compile(model)                         -> jax.jit of the micro-step and of the optimizer step

Differences from upstream: autocast also runs on CPU (``policy="cpu"``, torch's
CPU lists), where upstream turns it off, so that a CPU run exercises float16;
``dtype`` defaults to float16 (upstream prefers bfloat16 where CUDA has it,
which needs no scaler); the scaler's ``init_scale`` and ``growth_interval``
are configurable (upstream leaves torch's defaults, which are these
defaults); the checkpoint also holds the scaler's ``state_dict()`` (upstream's
omits it, so a resumed float16 run restarts at scale 65536). Not ported: DDP,
``init_from='gpt2*'``, wandb, MFU, dropout. The default dataset is a small
synthetic one (``data/<dataset>/train.bin`` is read when the dataset has one)::

  python -m examples.nanogpt.train --max_iters=200 --n_layer=2 --n_head=2 --n_embd=64 \
    --block_size=32 --batch_size=8 --gradient_accumulation_steps=2 --eval_interval=100
"""

from __future__ import annotations

import ast
import math
import os
import pickle
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxamp

if __package__:
  from .model import GPTConfig, configure_optimizers, get_num_params, gpt, init_params
else:  # run as a script
  from model import GPTConfig, configure_optimizers, get_num_params, gpt, init_params

# -----------------------------------------------------------------------------
# default config values, upstream's (a gpt2 124M on OpenWebText), but for the
# dataset and the scaler lines
DEFAULTS = {
  # I/O
  "out_dir": "out",
  "eval_interval": 2000,
  "log_interval": 1,
  "eval_iters": 200,
  "eval_only": False,  # if True, script exits right after the first eval
  "always_save_checkpoint": True,  # if True, always save a checkpoint after each eval
  "init_from": "scratch",  # 'scratch' or 'resume'
  # data
  "dataset": "synthetic",  # or a folder of data/ holding train.bin and val.bin
  "gradient_accumulation_steps": 5 * 8,  # used to simulate larger batch sizes
  "batch_size": 12,  # if gradient_accumulation_steps > 1, this is the micro-batch size
  "block_size": 1024,
  # model
  "n_layer": 12,
  "n_head": 12,
  "n_embd": 768,
  "dropout": 0.0,
  "bias": False,  # do we use bias inside LayerNorm and Linear layers?
  "vocab_size": None,  # the dataset's (meta.pkl), else GPT-2's 50304
  # adamw optimizer
  "learning_rate": 6e-4,  # max learning rate
  "max_iters": 600000,  # total number of training iterations
  "weight_decay": 1e-1,
  "beta1": 0.9,
  "beta2": 0.95,
  "grad_clip": 1.0,  # clip gradients at this value, or disable if == 0.0
  # learning rate decay settings
  "decay_lr": True,  # whether to decay the learning rate
  "warmup_iters": 2000,  # how many steps to warm up for
  "lr_decay_iters": 600000,  # should be ~= max_iters per Chinchilla
  "min_lr": 6e-5,  # minimum learning rate, should be ~= learning_rate/10 per Chinchilla
  # system
  "dtype": "float16",  # 'float32', 'bfloat16', or 'float16', the latter will auto implement a GradScaler
  "init_scale": 2.0**16,  # the GradScaler's, torch's defaults
  "growth_interval": 2000,
  "seed": 1337,
}
PTDTYPE = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def configure(argv):
  """Upstream's configurator.py: ``--key=value`` overrides, values as Python literals."""
  config = dict(DEFAULTS)
  for arg in argv:
    assert arg.startswith("--") and "=" in arg, f"expected --key=value, got {arg!r}"
    key, val = arg[2:].split("=", 1)
    assert key in config, f"Unknown config key: {key}"
    try:
      val = ast.literal_eval(val)
    except (SyntaxError, ValueError):
      pass  # a string
    config[key] = val
  return config


def get_lr(it, c):
  """Upstream's learning rate decay scheduler (cosine with warmup)."""
  # 1) linear warmup for warmup_iters steps
  if it < c["warmup_iters"]:
    return c["learning_rate"] * (it + 1) / (c["warmup_iters"] + 1)
  # 2) if it > lr_decay_iters, return min learning rate
  if it > c["lr_decay_iters"]:
    return c["min_lr"]
  # 3) in between, use cosine decay down to min learning rate
  decay_ratio = (it - c["warmup_iters"]) / (c["lr_decay_iters"] - c["warmup_iters"])
  assert 0 <= decay_ratio <= 1
  coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # coeff ranges 0..1
  return c["min_lr"] + coeff * (c["learning_rate"] - c["min_lr"])


def synthetic_tokens(n, vocab_size, seed=0):
  """A token stream from a fixed sparse Markov chain: learnable, needs no download."""
  rng = np.random.default_rng(seed)
  successors = rng.integers(0, vocab_size, (vocab_size, 3))
  tokens = np.empty(n, np.uint16)
  tokens[0] = 0
  for i, choice in enumerate(rng.integers(0, 3, n - 1), 1):
    tokens[i] = successors[tokens[i - 1], choice]
  return tokens


def make_get_batch(c):
  """Upstream's poor man's data loader, with a seeded NumPy generator."""
  data_dir = os.path.join("data", c["dataset"])
  rng = np.random.default_rng(c["seed"])
  if c["dataset"] == "synthetic":
    vocab = c["vocab_size"] or 64
    splits = {
      "train": synthetic_tokens(200_000, vocab, 0),
      "val": synthetic_tokens(20_000, vocab, 1),
    }

  def get_batch(split):
    if c["dataset"] == "synthetic":
      data = splits[split]
    else:
      data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
    ix = rng.integers(0, len(data) - c["block_size"], c["batch_size"])
    x = np.stack([data[i : i + c["block_size"]].astype(np.int32) for i in ix])
    y = np.stack([data[i + 1 : i + 1 + c["block_size"]].astype(np.int32) for i in ix])
    return x, y

  return get_batch


def train(c, get_batch, params=None, log=print):
  """Upstream's training loop; returns its history (per iteration) and final state.

  Args:
    c: the config (``DEFAULTS`` with overrides).
    get_batch: ``get_batch(split)`` giving ``(x, y)`` int arrays of ``(batch_size, block_size)``.
    params: initial parameters (torch's names and layout), else ``init_params``.
    log: where the log lines go.
  """
  K = c["gradient_accumulation_steps"]
  device_type = "cpu" if jax.default_backend() == "cpu" else "cuda"  # for jaxamp.autocast's policy
  ptdtype = PTDTYPE[c["dtype"]]

  # model init
  vocab_size = c["vocab_size"] or (64 if c["dataset"] == "synthetic" else 50304)
  model_args = {
    "n_layer": c["n_layer"],
    "n_head": c["n_head"],
    "n_embd": c["n_embd"],
    "block_size": c["block_size"],
    "bias": c["bias"],
    "vocab_size": vocab_size,
    "dropout": c["dropout"],
  }
  iter_num, best_val_loss, checkpoint = 0, 1e9, None
  if c["init_from"] == "resume":
    with open(os.path.join(c["out_dir"], "ckpt.pkl"), "rb") as f:
      checkpoint = pickle.load(f)
    model_args = checkpoint["model_args"]
    params = checkpoint["model"]
    iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
  gptconf = GPTConfig(**model_args)
  if params is None:
    params = init_params(jax.random.key(c["seed"]), gptconf)
  params = jax.tree.map(jnp.asarray, params)
  log(f"number of parameters: {get_num_params(params) / 1e6:.2f}M")

  # initialize a GradScaler. If enabled=False scaler is a no-op
  scaler = jaxamp.GradScaler(
    init_scale=c["init_scale"],
    growth_interval=c["growth_interval"],
    enabled=(c["dtype"] == "float16"),
  )
  # optimizer
  tx = configure_optimizers(params, c["weight_decay"], c["learning_rate"], (c["beta1"], c["beta2"]))
  opt = jaxamp.Optimizer(tx, params)
  if checkpoint is not None:
    opt.opt_state = jax.tree.map(jnp.asarray, checkpoint["optimizer"])
    scaler.load_state_dict(checkpoint["scaler"])
  checkpoint = None

  def loss_fn(params, X, Y):
    _logits, loss = gpt(params, X, Y, config=gptconf)
    return loss

  # with ctx: the model's matmuls in float16 (or bfloat16), torch's autocast lists
  if c["dtype"] == "float32":
    forward = loss_fn
  else:
    forward = jaxamp.autocast(loss_fn, ptdtype, policy="cpu" if device_type == "cpu" else "cuda")

  @jax.jit
  def micro_step(scaler, opt, X, Y):
    def scaled_loss(params):
      loss = forward(params, X, Y) / K  # scale the loss to account for gradient accumulation
      return scaler.scale(loss), loss

    # backward pass, with gradient scaling if training in fp16; adds into opt.grads as .grad
    grads, loss = jax.grad(scaled_loss, has_aux=True)(opt.params)
    opt.accumulate(grads)
    return scaler, opt, loss

  @jax.jit
  def optimizer_step(scaler, opt, lr):
    # for param_group in optimizer.param_groups: param_group['lr'] = lr
    opt.opt_state.hyperparams["learning_rate"] = lr
    # clip the gradient
    if c["grad_clip"] != 0.0:
      scaler.unscale_(opt)
      opt.grads, _ = jaxamp.clip_grad_norm(opt.grads, c["grad_clip"])
    # step the optimizer and scaler if training in fp16
    scaler.step(opt)
    scaler.update()
    # zeros rather than None: the next micro_step keeps its compiled structure
    opt.zero_grad(set_to_none=False)
    return scaler, opt

  @jax.jit
  def eval_loss(params, X, Y):
    return forward(params, X, Y)

  # helps estimate an arbitrarily accurate loss over either split using many batches
  def estimate_loss(params):
    out = {}
    for split in ["train", "val"]:
      losses = [eval_loss(params, *get_batch(split)) for _ in range(c["eval_iters"])]
      out[split] = float(np.mean(jax.device_get(losses)))
    return out

  history = {"loss": [], "scale": [], "skipped": [], "lr": []}
  X, Y = get_batch("train")  # fetch the very first batch
  t0 = time.time()
  opt.zero_grad(set_to_none=False)
  while True:
    # determine the learning rate for this iteration (set in optimizer_step)
    lr = get_lr(iter_num, c) if c["decay_lr"] else c["learning_rate"]

    # evaluate the loss on train/val sets and write checkpoints (eval_interval=0: never)
    if c["eval_interval"] and iter_num % c["eval_interval"] == 0:
      losses = estimate_loss(opt.params)
      log(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
      if losses["val"] < best_val_loss or c["always_save_checkpoint"]:
        best_val_loss = losses["val"]
        if iter_num > 0:
          checkpoint = {
            "model": jax.device_get(opt.params),
            "optimizer": jax.device_get(opt.opt_state),
            "scaler": scaler.state_dict(),
            "model_args": model_args,
            "iter_num": iter_num,
            "best_val_loss": best_val_loss,
            "config": c,
          }
          log(f"saving checkpoint to {c['out_dir']}")
          os.makedirs(c["out_dir"], exist_ok=True)
          with open(os.path.join(c["out_dir"], "ckpt.pkl"), "wb") as f:
            pickle.dump(checkpoint, f)
    if iter_num == 0 and c["eval_only"]:
      break

    # forward backward update, with gradient accumulation to simulate larger batch size
    # and using the GradScaler if data type is float16
    for _micro_step in range(K):
      scaler, opt, loss = micro_step(scaler, opt, X, Y)
      X, Y = get_batch("train")
    scaler, opt = optimizer_step(scaler, opt, jnp.float32(lr))

    # arrays: nothing is read back to the host until logged
    history["loss"].append(loss * K)
    history["scale"].append(scaler.loss_scale)
    history["skipped"].append(scaler.skipped_updates)
    history["lr"].append(lr)

    # timing and logging
    t1 = time.time()
    dt = t1 - t0
    t0 = t1
    if iter_num % c["log_interval"] == 0:
      # get loss as float. note: this is a host sync point
      lossf = float(loss) * K
      log(
        f"iter {iter_num}: loss {lossf:.4f}, scale {scaler.get_scale():g}, time {dt * 1000:.2f}ms"
      )
    iter_num += 1

    # termination conditions
    if iter_num > c["max_iters"]:
      break

  skipped = np.diff(np.asarray(jax.device_get(history["skipped"])), prepend=0)
  return {
    "loss": np.asarray(jax.device_get(history["loss"])),
    "scale": np.asarray(jax.device_get(history["scale"])),
    "skipped": skipped.astype(bool),
    "lr": np.asarray(history["lr"]),
    "params": opt.params,
    "scaler": scaler,
    "opt": opt,
  }


def main(argv=None):
  """Runs the loop with ``--key=value`` overrides of ``DEFAULTS``; returns its history.

  Args:
    argv: the overrides (``sys.argv[1:]`` when ``None``).
  """
  c = configure(sys.argv[1:] if argv is None else argv)
  result = train(c, make_get_batch(c))
  log = result["loss"]
  print(
    f"done: loss {log[0]:.4f} -> {log[-1]:.4f}, {int(result['skipped'].sum())} skipped "
    f"of {len(log)} iterations, final scale {result['scale'][-1]:g}"
  )
  return result


if __name__ == "__main__":
  main()
