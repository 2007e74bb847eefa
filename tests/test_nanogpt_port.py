"""The nanoGPT port (examples/nanogpt) against upstream's program, run live in torch.

The torch side is karpathy/nanoGPT at commit
3adf61e154c3fe3fca428ad6bc3818b27a3b8291 (MIT License, Copyright (c) 2022
Andrej Karpathy): ``model.py``'s GPT transcribed (``from_pretrained``,
``generate``, ``crop_block_size``, ``estimate_mfu`` left out) and
``train.py``'s inner loop (the lr set in every param group, gradient
accumulation with ``loss / gradient_accumulation_steps``,
``scaler.scale(loss).backward()``, ``unscale_``, ``clip_grad_norm_``,
``step``, ``update``, ``zero_grad(set_to_none=True)``), small, on CPU, under
``torch.autocast("cpu", dtype=torch.float16)`` (upstream's CUDA context: on
CPU upstream runs without autocast). Both start from the same weights and
see the same batches.
"""

import importlib
import inspect
import math
import pathlib
import pickle
from dataclasses import dataclass

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

ROOT = pathlib.Path(__file__).resolve().parents[1]


# -- upstream's model.py ------------------------------------------------------------


class LayerNorm(nn.Module):
  """LayerNorm but with an optional bias. PyTorch doesn't support simply bias=False"""

  def __init__(self, ndim, bias):
    super().__init__()
    self.weight = nn.Parameter(torch.ones(ndim))
    self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

  def forward(self, input):
    return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
  def __init__(self, config):
    super().__init__()
    assert config.n_embd % config.n_head == 0
    self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
    self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
    self.attn_dropout = nn.Dropout(config.dropout)
    self.resid_dropout = nn.Dropout(config.dropout)
    self.n_head = config.n_head
    self.n_embd = config.n_embd
    self.dropout = config.dropout

  def forward(self, x):
    B, T, C = x.size()
    q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
    k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
    q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
    v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
    y = F.scaled_dot_product_attention(
      q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True
    )
    y = y.transpose(1, 2).contiguous().view(B, T, C)
    return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
  def __init__(self, config):
    super().__init__()
    self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
    self.gelu = nn.GELU()
    self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
    self.dropout = nn.Dropout(config.dropout)

  def forward(self, x):
    return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
  def __init__(self, config):
    super().__init__()
    self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
    self.attn = CausalSelfAttention(config)
    self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
    self.mlp = MLP(config)

  def forward(self, x):
    x = x + self.attn(self.ln_1(x))
    return x + self.mlp(self.ln_2(x))


@dataclass
class GPTConfig:
  block_size: int = 1024
  vocab_size: int = 50304
  n_layer: int = 12
  n_head: int = 12
  n_embd: int = 768
  dropout: float = 0.0
  bias: bool = True


class GPT(nn.Module):
  def __init__(self, config):
    super().__init__()
    self.config = config
    self.transformer = nn.ModuleDict(
      dict(  # noqa: C408 (upstream's)
        wte=nn.Embedding(config.vocab_size, config.n_embd),
        wpe=nn.Embedding(config.block_size, config.n_embd),
        drop=nn.Dropout(config.dropout),
        h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
        ln_f=LayerNorm(config.n_embd, bias=config.bias),
      )
    )
    self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
    self.transformer.wte.weight = self.lm_head.weight
    self.apply(self._init_weights)
    for pn, p in self.named_parameters():
      if pn.endswith("c_proj.weight"):
        torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

  def _init_weights(self, module):
    if isinstance(module, nn.Linear):
      torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
      if module.bias is not None:
        torch.nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
      torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

  def forward(self, idx, targets=None):
    _b, t = idx.size()
    pos = torch.arange(0, t, dtype=torch.long)
    x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
    for block in self.transformer.h:
      x = block(x)
    x = self.transformer.ln_f(x)
    logits = self.lm_head(x)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
    return logits, loss

  def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
    param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
    decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
    nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
    optim_groups = [
      {"params": decay_params, "weight_decay": weight_decay},
      {"params": nodecay_params, "weight_decay": 0.0},
    ]
    fused_available = "fused" in inspect.signature(torch.optim.AdamW).parameters
    use_fused = fused_available and device_type == "cuda"
    extra_args = dict(fused=True) if use_fused else dict()  # noqa: C408 (upstream's)
    return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, **extra_args)


# -- the run ------------------------------------------------------------------------

CONFIG = {
  "eval_interval": 0,  # no evaluation: it changes nothing in training
  "gradient_accumulation_steps": 2,
  "batch_size": 4,
  "block_size": 16,
  "n_layer": 2,
  "n_head": 2,
  "n_embd": 32,
  "bias": True,
  "vocab_size": 64,
  "learning_rate": 1e-2,
  "max_iters": 39,  # upstream runs max_iters + 1 iterations
  "warmup_iters": 5,
  "lr_decay_iters": 40,
  "min_lr": 1e-3,
  # from far above the overflow threshold, growing every 3 clean steps: the scale
  # backs off, grows back into overflow and backs off again, several times
  "init_scale": 2.0**30,
  "growth_interval": 3,
}
# Measured: loss 6.8e-4 at most (losses from 4.2 down to 3.0), 1.9e-4 at the
# end; parameters 1.3e-2 normwise. At initialisation the losses differ by
# 4e-6 (torch's fused scaled_dot_product_attention against the attention
# written out, and sums in other orders); AdamW turns such differences in
# near-zero gradients into lr-sized steps, and 40 of them compound it.
LOSS_DRIFT = 2e-3
PARAM_DRIFT = 3e-2


def _torch_run(c, batches, model, get_lr):
  """Upstream's train.py loop (no eval, checkpoint or logging: they change nothing)."""
  K = c["gradient_accumulation_steps"]
  scaler = torch.amp.GradScaler(
    "cpu", init_scale=c["init_scale"], growth_interval=c["growth_interval"]
  )
  optimizer = model.configure_optimizers(
    c["weight_decay"], c["learning_rate"], (c["beta1"], c["beta2"]), "cpu"
  )
  ctx = torch.autocast("cpu", dtype=torch.float16)
  losses, scales, skipped = [], [], []
  it = iter(batches)
  X, Y = next(it)
  for iter_num in range(c["max_iters"] + 1):
    lr = get_lr(iter_num, c)  # upstream's get_lr (the port's is the same code)
    for param_group in optimizer.param_groups:
      param_group["lr"] = lr
    for _micro_step in range(K):
      with ctx:
        _logits, loss = model(torch.from_numpy(X).long(), torch.from_numpy(Y).long())
        loss = loss / K
      X, Y = next(it)
      scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), c["grad_clip"])
    before = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    losses.append(loss.item() * K)
    scales.append(scaler.get_scale())
    skipped.append(scaler.get_scale() < before)  # a skipped step backs off (hysteresis 1)
  return np.array(losses), np.array(scales, np.float32), np.array(skipped)


@pytest.mark.slow
@pytest.mark.torch
def test_nanogpt_port_matches_upstream_train_py_under_float16_autocast(monkeypatch):
  monkeypatch.syspath_prepend(str(ROOT))
  train = importlib.import_module("examples.nanogpt.train")
  c = {**train.DEFAULTS, **CONFIG}
  K = c["gradient_accumulation_steps"]
  tokens = train.synthetic_tokens(5000, c["vocab_size"])
  rng = np.random.default_rng(0)
  batches = []
  for _ in range((c["max_iters"] + 1) * K + 1):
    ix = rng.integers(0, len(tokens) - c["block_size"], c["batch_size"])
    x = np.stack([tokens[i : i + c["block_size"]] for i in ix]).astype(np.int32)
    y = np.stack([tokens[i + 1 : i + 1 + c["block_size"]] for i in ix]).astype(np.int32)
    batches.append((x, y))

  torch.manual_seed(1337)
  config = GPTConfig(
    **{k: c[k] for k in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "bias")}
  )
  model = GPT(config)
  # named_parameters lists the tied lm_head.weight once, as transformer.wte.weight
  params = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
  t_losses, t_scales, t_skipped = _torch_run(c, batches, model, train.get_lr)

  it = iter(batches)
  result = train.train(c, lambda split: next(it), params=params, log=lambda *_: None)

  assert result["scale"].dtype == np.float32
  assert result["scale"].tobytes() == t_scales.tobytes()  # the scale after every iteration
  assert result["skipped"].tolist() == t_skipped.tolist()
  steps = np.diff(np.log2(np.concatenate([[c["init_scale"]], t_scales])))
  assert (steps > 0).sum() >= 3 and (steps < 0).sum() >= 10  # growths and backoffs both
  assert 3 <= t_skipped[10:].sum() < 30  # skips after the initial backoff, and training
  drift = np.abs(result["loss"] - t_losses)
  assert drift.max() < LOSS_DRIFT, drift.max()
  assert t_losses[-1] < t_losses[0] - 0.5  # it learns
  np.testing.assert_allclose(result["lr"], [train.get_lr(i, c) for i in range(len(t_losses))])
  ours, theirs = result["params"], dict(model.named_parameters())
  # normwise over all parameters: Adam turns a tiny gradient difference near
  # zero into an lr-sized step, so elementwise differences reach the lr
  sq = [(np.asarray(ours[n]) - theirs[n].detach().numpy(), np.asarray(ours[n])) for n in ours]
  param_drift = math.sqrt(sum(np.sum(d**2) for d, _ in sq) / sum(np.sum(p**2) for _, p in sq))
  assert set(ours) == set(theirs) and param_drift < PARAM_DRIFT, param_drift
  print(
    f"scales {t_scales.tolist()}\nskipped {np.flatnonzero(t_skipped).tolist()}\n"
    f"loss drift max {drift.max():.3g} final {drift[-1]:.3g}, params {param_drift:.3g}"
  )


@pytest.mark.slow
def test_nanogpt_port_main_trains_saves_and_resumes(monkeypatch, tmp_path, capsys):
  monkeypatch.syspath_prepend(str(ROOT))
  train = importlib.import_module("examples.nanogpt.train")
  tiny = [
    "--n_layer=1",
    "--n_head=2",
    "--n_embd=16",
    "--block_size=8",
    "--batch_size=2",
    "--gradient_accumulation_steps=2",
    "--eval_interval=2",
    "--eval_iters=1",
    "--warmup_iters=1",
    "--lr_decay_iters=6",
    f"--out_dir={tmp_path}",
    "--init_scale=1e9",
    "--growth_interval=2",
  ]
  first = train.main([*tiny, "--max_iters=2"])
  assert len(first["loss"]) == 3 and np.all(np.isfinite(first["loss"]))
  assert "saving checkpoint" in capsys.readouterr().out
  # written at iteration 2's evaluation: the scaler after iteration 1, which
  # the resumed run starts from (upstream's checkpoint has no scaler)
  with open(tmp_path / "ckpt.pkl", "rb") as f:
    checkpoint = pickle.load(f)
  resumed = train.main([*tiny, "--max_iters=4", "--init_from='resume'"])
  assert len(resumed["loss"]) == 3  # iterations 2, 3 and 4
  assert checkpoint["iter_num"] == 2
  saved = checkpoint["scaler"]
  assert saved["scale"] == first["scale"][1] and saved["growth_interval"] == 2
  if resumed["skipped"][0]:
    expected = saved["scale"] / 2
  else:
    expected = saved["scale"] * (2 if saved["_growth_tracker"] + 1 == 2 else 1)
  assert resumed["scale"][0] == expected
