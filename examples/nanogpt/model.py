"""nanoGPT's GPT (``model.py``) in JAX, with its parameters in torch's names and layout.

A port of karpathy/nanoGPT's ``model.py`` at commit
3adf61e154c3fe3fca428ad6bc3818b27a3b8291 (MIT License, Copyright (c) 2022
Andrej Karpathy). The parameters are a flat dict keyed by the names of torch's
``model.named_parameters()`` (``transformer.h.0.attn.c_attn.weight``, ...), each
in torch's layout (a Linear's ``weight`` is ``(out, in)``), so a torch
``state_dict`` loads as it is. The token embedding is tied to ``lm_head``, as
upstream (``lm_head.weight`` is ``transformer.wte.weight``).

The model is written in float32, as upstream: the float16 computation is
``jaxamp.autocast``'s, in ``train.py``, as torch's ``autocast`` is upstream's.
Attention is upstream's manual path (what ``scaled_dot_product_attention``
computes, written out; torch's fused kernel rounds differently: at
initialisation the two losses differ by about 4e-6). Not ported: dropout (pretraining uses 0.0), ``from_pretrained``
(it needs ``transformers``), ``generate``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  block_size: int = 1024
  vocab_size: int = 50304  # GPT-2 vocab_size of 50257, padded up to nearest multiple of 64
  n_layer: int = 12
  n_head: int = 12
  n_embd: int = 768
  dropout: float = 0.0
  bias: bool = True  # True: bias in Linears and LayerNorms, like GPT-2


def layer_norm(params, name, x):
  """``F.layer_norm(x, ..., weight, bias, 1e-5)``, bias optional as upstream's ``LayerNorm``."""
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  y = (x - mean) * jax.lax.rsqrt(var + 1e-5) * params[f"{name}.weight"]
  bias = params.get(f"{name}.bias")
  return y if bias is None else y + bias


def linear(params, name, x):
  """``nn.Linear``: ``x @ weight.T + bias`` (autocast rounds it once, as torch)."""
  y = x @ params[f"{name}.weight"].T
  bias = params.get(f"{name}.bias")
  return y if bias is None else y + bias


def causal_self_attention(params, name, x, config):
  B, T, C = x.shape  # batch size, sequence length, embedding dimensionality (n_embd)
  q, k, v = jnp.split(linear(params, f"{name}.c_attn", x), 3, axis=2)
  hs = C // config.n_head
  k = k.reshape(B, T, config.n_head, hs).transpose(0, 2, 1, 3)  # (B, nh, T, hs)
  q = q.reshape(B, T, config.n_head, hs).transpose(0, 2, 1, 3)  # (B, nh, T, hs)
  v = v.reshape(B, T, config.n_head, hs).transpose(0, 2, 1, 3)  # (B, nh, T, hs)
  # causal self-attention: (B, nh, T, hs) x (B, nh, hs, T) -> (B, nh, T, T)
  att = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(hs))
  mask = jnp.tril(jnp.ones((T, T), bool))
  att = jnp.where(mask, att, -jnp.inf)
  att = jax.nn.softmax(att, axis=-1)
  y = att @ v  # (B, nh, T, T) x (B, nh, T, hs) -> (B, nh, T, hs)
  y = y.transpose(0, 2, 1, 3).reshape(B, T, C)  # re-assemble all head outputs side by side
  return linear(params, f"{name}.c_proj", y)


def mlp(params, name, x):
  x = linear(params, f"{name}.c_fc", x)
  x = jax.nn.gelu(x, approximate=False)  # nn.GELU(): the exact, erf form
  return linear(params, f"{name}.c_proj", x)


def block(params, name, x, config):
  x = x + causal_self_attention(
    params, f"{name}.attn", layer_norm(params, f"{name}.ln_1", x), config
  )
  return x + mlp(params, f"{name}.mlp", layer_norm(params, f"{name}.ln_2", x))


def cross_entropy(logits, targets, ignore_index=-1):
  """``F.cross_entropy(..., ignore_index=-1)``: the mean over the targets kept."""
  keep = targets != ignore_index
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(keep, targets, 0))
  return jnp.sum(jnp.where(keep, losses, 0.0)) / jnp.sum(keep)


def gpt(params, idx, targets=None, *, config: GPTConfig):
  """``GPT.forward``: ``(logits, loss)``; ``loss`` is ``None`` without targets."""
  _b, t = idx.shape
  assert t <= config.block_size, (
    f"Cannot forward sequence of length {t}, block size is only {config.block_size}"
  )
  pos = jnp.arange(t)
  tok_emb = params["transformer.wte.weight"][idx]  # token embeddings of shape (b, t, n_embd)
  pos_emb = params["transformer.wpe.weight"][pos]  # position embeddings of shape (t, n_embd)
  x = tok_emb + pos_emb
  for i in range(config.n_layer):
    x = block(params, f"transformer.h.{i}", x, config)
  x = layer_norm(params, "transformer.ln_f", x)
  lm_head = params["transformer.wte.weight"]  # weight tying
  if targets is None:
    return x[:, -1:, :] @ lm_head.T, None  # only the last position, as upstream
  logits = x @ lm_head.T
  # under jaxamp.autocast, optax's cross-entropy is torch's cross_entropy:
  # float32, from the half logits (docs/autocast.md, "Fused ops")
  loss = cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
  return logits, loss


def init_params(key, config: GPTConfig):
  """Upstream's ``_init_weights``: N(0, 0.02) weights and embeddings, zero biases,
  unit LayerNorm weights, and the residual projections at 0.02 / sqrt(2 n_layer)."""
  assert config.dropout == 0.0, "dropout is not ported (pretraining uses 0.0)"
  C = config.n_embd
  shapes = {
    "transformer.wte.weight": (config.vocab_size, C),
    "transformer.wpe.weight": (config.block_size, C),
  }
  for i in range(config.n_layer):
    h = f"transformer.h.{i}"
    shapes |= {
      f"{h}.ln_1.weight": (C,),
      f"{h}.attn.c_attn.weight": (3 * C, C),
      f"{h}.attn.c_proj.weight": (C, C),
      f"{h}.ln_2.weight": (C,),
      f"{h}.mlp.c_fc.weight": (4 * C, C),
      f"{h}.mlp.c_proj.weight": (C, 4 * C),
    }
    if config.bias:
      shapes |= {
        f"{h}.ln_1.bias": (C,),
        f"{h}.attn.c_attn.bias": (3 * C,),
        f"{h}.attn.c_proj.bias": (C,),
        f"{h}.ln_2.bias": (C,),
        f"{h}.mlp.c_fc.bias": (4 * C,),
        f"{h}.mlp.c_proj.bias": (C,),
      }
  shapes["transformer.ln_f.weight"] = (C,)
  if config.bias:
    shapes["transformer.ln_f.bias"] = (C,)
  params = {}
  for (name, shape), k in zip(shapes.items(), jax.random.split(key, len(shapes))):
    if name.endswith("c_proj.weight"):  # the special scaled init of the residual projections
      params[name] = 0.02 / math.sqrt(2 * config.n_layer) * jax.random.normal(k, shape)
    elif name.endswith(".bias"):
      params[name] = jnp.zeros(shape)
    elif ".ln_" in name:
      params[name] = jnp.ones(shape)
    else:
      params[name] = 0.02 * jax.random.normal(k, shape)
  return params


def get_num_params(params, non_embedding=True):
  n_params = sum(p.size for p in params.values())
  if non_embedding:
    n_params -= params["transformer.wpe.weight"].size
  return n_params


def configure_optimizers(params, weight_decay, learning_rate, betas):
  """Upstream's two AdamW parameter groups (weight decay on the >= 2-D
  parameters: matmul weights and embeddings; none on biases and LayerNorms)
  as one ``optax.adamw`` with a decay mask: one torch optimizer, one skip
  decision (docs/porting.md, "Parameter groups in one optimizer").

  ``inject_hyperparams`` puts the learning rate in the state, where the
  training loop sets it each iteration as upstream's ``param_group['lr'] = lr``
  (docs/porting.md, "Setting the learning rate by hand"). ``mask`` must be
  static there: a callable hyperparameter is otherwise taken for a schedule.
  """
  decay = {name: p.ndim >= 2 for name, p in params.items()}
  n_decay = sum(p.size for name, p in params.items() if decay[name])
  n_nodecay = sum(p.size for name, p in params.items() if not decay[name])
  print(f"num decayed parameter tensors: {sum(decay.values())}, with {n_decay:,} parameters")
  print(
    f"num non-decayed parameter tensors: {len(decay) - sum(decay.values())}, with {n_nodecay:,} parameters"
  )
  adamw = optax.inject_hyperparams(optax.adamw, static_args=("mask",))
  return adamw(
    learning_rate=learning_rate, b1=betas[0], b2=betas[1], weight_decay=weight_decay, mask=decay
  )
