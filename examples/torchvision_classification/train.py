"""torchvision's classification reference (``references/classification/train.py``)
ported to JAX with jaxamp: float16 autocast, GradScaler, clipping after
``unscale_``, label smoothing, SGD with per-group weight decay, the warmup and
main learning-rate schedulers stepped per epoch, the model EMA, and checkpoints
that hold the scaler.

A port of pytorch/vision's ``references/classification/train.py`` and
``utils.py`` (BSD-3-Clause, Copyright (c) Soumith Chintala 2016), the version
with ``torch.cuda.amp``, written from jaxamp's porting guide (docs/porting.md,
docs/grad_scaler.md, docs/autocast.md). ``train_one_epoch`` and ``main`` keep
upstream's names and order; what each torch line became:

  scaler = torch.cuda.amp.GradScaler() if args.amp else None
                              -> scaler = jaxamp.GradScaler(..., enabled=args.amp)
  with torch.cuda.amp.autocast(enabled=scaler is not None):
                              -> forward = jaxamp.autocast(loss_fn, jnp.float16, policy=..., enabled=args.amp)
  criterion = nn.CrossEntropyLoss(label_smoothing=s)
                              -> optax.softmax_cross_entropy(logits, optax.smooth_labels(one_hot, s))
  utils.set_weight_decay(model, wd, norm_weight_decay=...)
                              -> utils.set_weight_decay(params, wd, norm_weight_decay=..., is_norm=...)
  optimizer = torch.optim.SGD(parameters, lr, momentum, weight_decay, nesterov)
                              -> optimizer = jaxamp.Optimizer(utils.sgd(groups, ...)(learning_rate=lr), params)
  lr_scheduler = SequentialLR([warmup, main], milestones=[warmup_epochs]); lr_scheduler.step()
                              -> lr_scheduler = optax.join_schedules([warmup, main], [warmup_epochs]),
                                 evaluated at the epoch into the optimizer's hyperparams
  optimizer.zero_grad(); scaler.scale(loss).backward()
                              -> optimizer.zero_grad(); optimizer.grads = jax.grad(scaled loss)(optimizer.params)
  scaler.unscale_(optimizer); nn.utils.clip_grad_norm_(model.parameters(), c)
                              -> scaler.unscale_(optimizer); optimizer.grads, _ = jaxamp.clip_grad_norm(optimizer.grads, c)
  scaler.step(optimizer); scaler.update()
                              -> scaler.step(optimizer); scaler.update()
  model_ema.update_parameters(model); model_ema.n_averaged.fill_(0)
                              -> model_ema.update_parameters(optimizer.params, buffers); model_ema.n_averaged = 0
  checkpoint["scaler"] = scaler.state_dict()
                              -> the same (torch's five keys)

BatchNorm's running statistics (``buffers``) come out of the forward pass:
they update on every iteration, a skipped one included, as torch's forward
updates them whatever ``scaler.step`` then does.

Differences from upstream: the model is torchvision's ResNet shrunk
(``model.py``), the data a seeded FakeData (class templates plus noise, so it
learns), ``--opt`` ``sgd`` and ``sgd_nesterov`` only, ``--amp-init-scale`` and
``--amp-growth-interval`` added (upstream leaves torch's defaults, which are
these defaults), ``--output-dir`` empty by default (upstream's ``.`` writes a
checkpoint per epoch where it runs), checkpoints pickled (``.pkl``). On CPU,
autocast takes torch's CPU lists (``policy="cpu"``), so a CPU run exercises
float16. Not ported: DDP, RMSprop and AdamW, mixup and cutmix, the
augmentation presets, ``--transformer-embedding-decay``, torchvision's
other models::

  python -m examples.torchvision_classification.train --amp --epochs 3 -b 16 \\
    --label-smoothing 0.1 --lr-warmup-epochs 1 --lr-warmup-method linear \\
    --model-ema --model-ema-steps 4 --clip-grad-norm 1.0
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp

if __package__:
  from . import utils
  from .model import init_params, is_norm, resnet
else:  # run as a script
  import utils
  from model import init_params, is_norm, resnet


def criterion(output, target, label_smoothing):
  """``nn.CrossEntropyLoss(label_smoothing=s)``: the mean over the batch, computed in float32."""
  labels = optax.smooth_labels(jax.nn.one_hot(target, output.shape[-1]), label_smoothing)
  return jnp.mean(optax.softmax_cross_entropy(output, labels))


def train_one_epoch(
  train_step, scaler, optimizer, buffers, data_loader, epoch, args, model_ema=None, log=print
):
  """Upstream's ``train_one_epoch``; returns ``scaler, optimizer, buffers`` and the epoch's history."""
  history = {"loss": [], "scale": [], "growth_tracker": [], "skipped_updates": [], "lr": []}
  header = f"Epoch: [{epoch}]"
  for i, (image, target) in enumerate(data_loader):
    start_time = time.time()
    scaler, optimizer, buffers, loss, output = train_step(scaler, optimizer, buffers, image, target)

    if model_ema and i % args.model_ema_steps == 0:
      model_ema.update_parameters(optimizer.params, buffers)
      if epoch < args.lr_warmup_epochs:
        # Reset ema buffer to keep copying weights during warmup period
        model_ema.n_averaged = 0

    # arrays: nothing is read back to the host until logged
    history["loss"].append(loss)
    history["scale"].append(scaler.loss_scale)
    history["growth_tracker"].append(scaler.growth_tracker)
    history["skipped_updates"].append(scaler.skipped_updates)
    history["lr"].append(optimizer.opt_state.hyperparams["learning_rate"])
    if i % args.print_freq == 0:
      acc1, acc5 = utils.accuracy(output, jnp.asarray(target), topk=(1, 5))
      log(
        f"{header} [{i}/{len(data_loader)}] loss: {float(loss):.4f} acc1: {float(acc1):.1f} "
        f"acc5: {float(acc5):.1f} scale: {scaler.get_scale():g} "
        f"img/s: {image.shape[0] / (time.time() - start_time):.0f}"
      )
  return scaler, optimizer, buffers, history


def evaluate(eval_step, params, buffers, data_loader, log=print, log_suffix=""):
  """Upstream's ``evaluate``: the running statistics, no autocast; returns Acc@1."""
  totals = np.zeros(3)
  for image, target in data_loader:
    totals += np.asarray(eval_step(params, buffers, image, target)) * image.shape[0]
  loss, acc1, acc5 = totals / sum(image.shape[0] for image, _ in data_loader)
  log(f"Test: {log_suffix} Acc@1 {acc1:.3f} Acc@5 {acc5:.3f} loss {loss:.4f}")
  return acc1


def load_data(args):
  """Seeded FakeData: ``(train, test)`` lists of ``(images, targets)`` NumPy arrays.

  Each class is a random template image, each sample its template plus noise
  (``torchvision.datasets.FakeData`` draws noise alone, which nothing can
  learn). The training batches are in a new random order each epoch
  (``RandomSampler``); ``train(epoch)`` returns that epoch's batches.
  """
  rng = np.random.default_rng(args.seed)
  shape = (3, args.image_size, args.image_size)
  templates = rng.standard_normal((args.num_classes, *shape), np.float32)

  def samples(n):
    targets = rng.integers(0, args.num_classes, n)
    images = templates[targets] + args.noise * rng.standard_normal((n, *shape), np.float32)
    return images.astype(np.float32), targets.astype(np.int32)

  train_images, train_targets = samples(args.train_size)
  test_images, test_targets = samples(args.val_size)
  sampler = np.random.default_rng(args.seed + 1)

  def batches(images, targets, order):
    return [(images[order[i : i + args.batch_size]], targets[order[i : i + args.batch_size]])
            for i in range(0, len(order), args.batch_size)]  # fmt: skip

  def train(epoch):
    return batches(train_images, train_targets, sampler.permutation(args.train_size))

  return train, batches(test_images, test_targets, np.arange(args.val_size))


def make_lr_scheduler(args):
  """Upstream's schedulers as one optax schedule of the epoch: the lr of each epoch."""
  main_epochs = args.epochs - args.lr_warmup_epochs
  if args.lr_scheduler == "steplr":
    main = optax.exponential_decay(args.lr, args.lr_step_size, args.lr_gamma, staircase=True)
  elif args.lr_scheduler == "cosineannealinglr":
    main = optax.cosine_decay_schedule(args.lr, main_epochs, alpha=args.lr_min / args.lr)
  elif args.lr_scheduler == "exponentiallr":
    main = optax.exponential_decay(args.lr, 1, args.lr_gamma)
  else:
    raise RuntimeError(
      f"Invalid lr scheduler '{args.lr_scheduler}'. Only StepLR, CosineAnnealingLR and ExponentialLR are supported."
    )
  if args.lr_warmup_epochs == 0:
    return main
  start = args.lr * args.lr_warmup_decay
  if args.lr_warmup_method == "linear":  # LinearLR(start_factor=lr_warmup_decay)
    warmup = optax.linear_schedule(start, args.lr, args.lr_warmup_epochs)
  elif args.lr_warmup_method == "constant":  # ConstantLR(factor=lr_warmup_decay)
    warmup = optax.constant_schedule(start)
  else:
    raise RuntimeError(
      f"Invalid warmup lr method '{args.lr_warmup_method}'. Only linear and constant are supported."
    )
  return optax.join_schedules([warmup, main], [args.lr_warmup_epochs])  # SequentialLR


def main(args, data=None, model=None, log=print):
  """Upstream's ``main``; returns the training history and the final state.

  Args:
    args: ``get_args_parser().parse_args(...)``.
    data: ``(train, test)`` as ``load_data`` returns them, else ``load_data(args)``.
    model: initial ``(params, buffers)`` in torch's names, else ``init_params``.
    log: where the log lines go.
  """
  if args.output_dir:
    os.makedirs(args.output_dir, exist_ok=True)
  log(args)
  train_loader, test_loader = data or load_data(args)

  log("Creating model")
  params, buffers = model or init_params(jax.random.key(args.seed), args.num_classes)
  params, buffers = jax.tree.map(jnp.asarray, (params, buffers))
  half = jnp.float16 if args.amp else None
  policy = "cpu" if jax.default_backend() == "cpu" else "cuda"

  def loss_fn(params, buffers, image, target):
    output, buffers = resnet(params, buffers, image, train=True, half=half)
    return criterion(output, target, args.label_smoothing), (output, buffers)

  # with torch.cuda.amp.autocast(enabled=scaler is not None): output = model(image); loss = criterion(...)
  forward = jaxamp.autocast(loss_fn, jnp.float16, policy=policy, enabled=args.amp)

  @jax.jit
  def train_step(scaler, optimizer, buffers, image, target):
    optimizer.zero_grad()

    def scaled_loss(params):
      loss, (output, new_buffers) = forward(params, buffers, image, target)
      return scaler.scale(loss), (loss, output, new_buffers)

    # scaler.scale(loss).backward()
    optimizer.grads, (loss, output, buffers) = jax.grad(scaled_loss, has_aux=True)(optimizer.params)
    if args.clip_grad_norm is not None:
      # we should unscale the gradients of optimizer's assigned params if do gradient clipping
      scaler.unscale_(optimizer)
      optimizer.grads, _ = jaxamp.clip_grad_norm(optimizer.grads, args.clip_grad_norm)
    scaler.step(optimizer)
    scaler.update()
    return scaler, optimizer, buffers, loss, output

  @jax.jit
  def eval_step(params, buffers, image, target):
    output, _ = resnet(params, buffers, image, train=False)
    acc1, acc5 = utils.accuracy(output, target, topk=(1, 5))
    return jnp.stack([criterion(output, target, args.label_smoothing), acc1, acc5])

  custom_keys_weight_decay = []
  if args.bias_weight_decay is not None:
    custom_keys_weight_decay.append(("bias", args.bias_weight_decay))
  parameters = utils.set_weight_decay(
    params,
    args.weight_decay,
    norm_weight_decay=args.norm_weight_decay,
    custom_keys_weight_decay=custom_keys_weight_decay
    if len(custom_keys_weight_decay) > 0
    else None,
    is_norm=is_norm,
  )
  opt_name = args.opt.lower()
  if not opt_name.startswith("sgd"):
    raise RuntimeError(f"Invalid optimizer {args.opt}. Only SGD (sgd, sgd_nesterov) is ported.")
  tx = utils.sgd(parameters, list(params), args.momentum, "nesterov" in opt_name)(
    learning_rate=args.lr
  )
  optimizer = jaxamp.Optimizer(tx, params)

  scaler = jaxamp.GradScaler(
    init_scale=args.amp_init_scale, growth_interval=args.amp_growth_interval, enabled=args.amp
  )
  lr_scheduler = make_lr_scheduler(args)

  model_ema = None
  if args.model_ema:
    # Decay adjustment that aims to keep the decay independent of other hyper-parameters originally proposed at:
    # https://github.com/facebookresearch/pycls/blob/f8cd9627/pycls/core/net.py#L123
    adjust = args.world_size * args.batch_size * args.model_ema_steps / args.epochs
    alpha = 1.0 - args.model_ema_decay
    alpha = min(1.0, alpha * adjust)
    model_ema = utils.ExponentialMovingAverage(params, buffers, decay=1.0 - alpha)

  if args.resume:
    with open(args.resume, "rb") as f:
      checkpoint = pickle.load(f)
    optimizer.params = {name: jnp.asarray(checkpoint["model"][name]) for name in params}
    buffers = {name: jnp.asarray(checkpoint["model"][name]) for name in buffers}
    if not args.test_only:
      optimizer.opt_state = jax.tree.map(jnp.asarray, checkpoint["optimizer"])
    args.start_epoch = checkpoint["epoch"] + 1
    if model_ema:
      model_ema.load_state_dict(checkpoint["model_ema"])
    if args.amp:
      scaler.load_state_dict(checkpoint["scaler"])

  def ema_model():  # model_ema.module as (params, buffers): one eval_step compilation for both
    return {n: model_ema.module[n] for n in params}, {n: model_ema.module[n] for n in buffers}

  if args.test_only:
    if model_ema:
      return evaluate(eval_step, *ema_model(), test_loader, log, log_suffix="EMA")
    return evaluate(eval_step, optimizer.params, buffers, test_loader, log)

  log("Start training")
  start_time = time.time()
  history = []
  for epoch in range(args.start_epoch, args.epochs):
    # lr_scheduler.step() after the previous epoch: this epoch's lr in every param group
    optimizer.opt_state.hyperparams["learning_rate"] = jnp.float32(lr_scheduler(epoch))
    data_loader = train_loader(epoch)
    scaler, optimizer, buffers, epoch_history = train_one_epoch(
      train_step, scaler, optimizer, buffers, data_loader, epoch, args, model_ema, log
    )
    history.append(epoch_history)
    evaluate(eval_step, optimizer.params, buffers, test_loader, log)
    if model_ema:
      evaluate(eval_step, *ema_model(), test_loader, log, log_suffix="EMA")
    if args.output_dir:
      checkpoint = {
        "model": {name: np.asarray(v) for name, v in {**optimizer.params, **buffers}.items()},
        "optimizer": jax.device_get(optimizer.opt_state),
        "lr_scheduler": {"last_epoch": epoch + 1},
        "epoch": epoch,
        "args": args,
      }
      if model_ema:
        checkpoint["model_ema"] = model_ema.state_dict()
      if args.amp:
        checkpoint["scaler"] = scaler.state_dict()
      for name in (f"model_{epoch}.pkl", "checkpoint.pkl"):
        with open(os.path.join(args.output_dir, name), "wb") as f:
          pickle.dump(checkpoint, f)

  log(f"Training time {time.time() - start_time:.1f}s")
  steps = (
    {key: np.asarray(jax.device_get([v for h in history for v in h[key]])) for key in history[0]}
    if history
    else {}
  )
  return {
    **steps,
    "skipped": np.diff(steps.get("skipped_updates", np.zeros(0)), prepend=0).astype(bool),
    "params": optimizer.params,
    "buffers": buffers,
    "model_ema": model_ema,
    "scaler": scaler,
    "optimizer": optimizer,
  }


# (flags, default, type, help): upstream's, with upstream's defaults, then the port's own
OPTIONS = [
  (("-b", "--batch-size"), 32, int, "images per batch"),
  (("--epochs",), 90, int, "number of total epochs to run"),
  (("--opt",), "sgd", str, "optimizer (sgd or sgd_nesterov)"),
  (("--lr",), 0.1, float, "initial learning rate"),
  (("--momentum",), 0.9, float, "momentum"),
  (("--weight-decay", "--wd"), 1e-4, float, "weight decay"),
  (("--norm-weight-decay",), None, float, "weight decay for Normalization layers"),
  (("--bias-weight-decay",), None, float, "weight decay for bias parameters"),
  (("--label-smoothing",), 0.0, float, "label smoothing"),
  (("--lr-scheduler",), "steplr", str.lower, "steplr, cosineannealinglr or exponentiallr"),
  (("--lr-warmup-epochs",), 0, int, "the number of epochs to warmup"),
  (("--lr-warmup-method",), "constant", str, "the warmup method (linear or constant)"),
  (("--lr-warmup-decay",), 0.01, float, "the decay for lr"),
  (("--lr-step-size",), 30, int, "decrease lr every step-size epochs"),
  (("--lr-gamma",), 0.1, float, "decrease lr by a factor of lr-gamma"),
  (("--lr-min",), 0.0, float, "minimum lr of lr schedule"),
  (("--print-freq",), 10, int, "print frequency"),
  (("--output-dir",), "", str, "path to save outputs (empty: none)"),
  (("--resume",), "", str, "path of checkpoint"),
  (("--start-epoch",), 0, int, "start epoch"),
  (("--world-size",), 1, int, "number of distributed processes (in the EMA's adjustment)"),
  (("--model-ema-steps",), 32, int, "the number of iterations between EMA updates"),
  (("--model-ema-decay",), 0.99998, float, "decay factor for the EMA of the model"),
  (("--clip-grad-norm",), None, float, "the maximum gradient norm"),
  (("--amp-init-scale",), 2.0**16, float, "the GradScaler's init_scale"),
  (("--amp-growth-interval",), 2000, int, "the GradScaler's growth_interval"),
  (("--num-classes",), 10, int, "FakeData classes"),
  (("--image-size",), 32, int, "FakeData image side"),
  (("--train-size",), 1024, int, "FakeData training images"),
  (("--val-size",), 256, int, "FakeData test images"),
  (("--noise",), 1.0, float, "FakeData noise around the class templates"),
  (("--seed",), 0, int, "the data's and the initialisation's seed"),
]
SWITCHES = [
  ("--test-only", "Only test the model"),
  ("--amp", "float16 autocast and a GradScaler"),
  ("--model-ema", "track an Exponential Moving Average of the model's parameters and buffers"),
]


def get_args_parser(add_help=True):
  """Upstream's flags that the port keeps, with upstream's defaults, and the FakeData sizes."""
  parser = argparse.ArgumentParser(description="JAX Classification Training", add_help=add_help)
  for flags, default, kind, text in OPTIONS:
    parser.add_argument(*flags, default=default, type=kind, help=text)
  for flag, text in SWITCHES:
    parser.add_argument(flag, action="store_true", help=text)
  return parser


if __name__ == "__main__":
  main(get_args_parser().parse_args(sys.argv[1:]))
