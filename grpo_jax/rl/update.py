"""UPDATE: the train state, the optimizer and the jitted policy update.

`update_step` is one pure jitted function: it splits a mini-batch into
micro-batches, accumulates the gradient of the loss normalised by the WHOLE
mini-batch's token/sequence counts (so token-mean is exact whatever the
split), and applies the optax update.

The core is shared with supervised fine-tuning (`sft.sft_step`, STaR):
`micro_batch_sum` (strided micro-batches, gradients summed in a scan) and
`apply_gradients` (optax, the next TrainState, the layout's constraint;
a non-finite update is not applied, `nonfinite.py`).
Both jitted steps take the optimizer as an `optimizer.OptimizerSpec`, a value: equal
specs share one compiled program, however many times the optimizer is made
(STaR makes a fresh one every outer iteration).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from grpo_jax.rl import nonfinite, packing
from grpo_jax.rl.optimizer import as_optax
from grpo_jax.algorithms import logprobs as logprobs_lib
from grpo_jax.algorithms import losses
from grpo_jax.models.config import ModelConfig
from grpo_jax.models import lora
from grpo_jax.models.transformer import cast

Params = Any


class TrainState(NamedTuple):
  step: jax.Array          # int32 scalar: optimizer updates run (one not
                           # applied as non-finite counts too)
  params: Params           # master weights (config.model.param_dtype); with
                           # LoRA the adapters only (models/lora.py)
  opt_state: Any
  key: jax.Array           # uint32 PRNG key data (checkpointable)


@dataclasses.dataclass(frozen=True)
class LossSettings:
  """The static (hashable) part of the update; from config.rl / config.model.

  loss: the policy loss and what it reads (losses.PolicyLossSpec); the KL
  schedule (β = 0: no KL term and no reference model); the Dr. GRPO length
  normaliser; and how the trainer's forward runs (temperature, log-prob
  chunk, remat, dtype, attention)."""
  loss: losses.PolicyLossSpec = losses.PolicyLossSpec()
  kl_beta: float = 0.0
  kl_start_step: int = 0
  kl_ramp_steps: int = 0
  max_len_norm: int = 0
  temperature: float = 1.0
  chunk: int = 256
  remat: str = "none"
  compute_dtype: str = "float32"
  attention: str = "auto"
  lora_scale: float = 0.0    # α/r of the adapters (model.lora; 0: off)

  @property
  def use_kl(self) -> bool:
    return self.kl_beta > 0

  @classmethod
  def from_config(cls, config) -> "LossSettings":
    rl = config.rl
    return cls(loss=losses.PolicyLossSpec.from_config(rl),
               kl_beta=rl.kl_beta, kl_start_step=rl.kl_start_step,
               kl_ramp_steps=rl.kl_ramp_steps, max_len_norm=rl.max_len_norm,
               temperature=config.sampling.temperature or 1.0,
               chunk=config.model.logprob_chunk, remat=config.model.remat,
               compute_dtype=config.model.compute_dtype,
               attention=config.model.attention,
               lora_scale=lora.LoraSpec.from_config(config).scale)


class PackedUpdateBatch(NamedTuple):
  """A mini-batch of sequences packed into rows (`packing.py`): `rows`, and
  the per-token fields of its N*M sequence slots in slot order (empty slots
  all zero, mask 0), strided by micro-batch like `rows`."""
  rows: packing.PackedRows
  mask_nt: jax.Array
  old_logp_nt: jax.Array
  ref_logp_nt: jax.Array
  adv_n: jax.Array
  is_weight_nt: Optional[jax.Array] = None


class UpdateBatch(NamedTuple):
  """One mini-batch of N completion rows (S = P + T columns)."""
  tokens_ns: jax.Array
  positions_ns: jax.Array
  valid_ns: jax.Array
  mask_nt: jax.Array
  old_logp_nt: jax.Array
  ref_logp_nt: jax.Array     # zeros when β = 0 (never read)
  adv_n: jax.Array           # [N] outcome or [N, T] process advantages
  is_weight_nt: Optional[jax.Array] = None   # rollout-correction weights


# ----------------------------------------------------------------------------
# The train state.
# ----------------------------------------------------------------------------

def init_state(params: Params, optimizer, seed: int) -> TrainState:
  """Step 0, fresh optimizer state (`optimizer`: OptimizerSpec or optax)."""
  return TrainState(jnp.zeros((), jnp.int32), params,
                    as_optax(optimizer).init(params),
                    jax.random.key_data(jax.random.key(seed)))


# ----------------------------------------------------------------------------
# Log-probs and the loss.
# ----------------------------------------------------------------------------

def completion_logprobs(model_config: ModelConfig, params: Params,
                        tokens_ns, positions_ns, valid_ns, num_completion: int,
                        s: LossSettings, group_size: int = 1, layout=None):
  """log π(token) and entropy over the last `num_completion` columns, (N, T),
  temperature-scaled exactly as the sampler's log-probs. group_size > 1:
  rows come in groups of that many sharing one prompt, run once per group.
  With a `sharding.Layout`, the decoder's activations are pinned to it (rows
  over the batch axes), so each chip computes only its rows."""
  return logprobs_lib.sequence_logprobs(
      model_config, cast(params, s.compute_dtype), tokens_ns, positions_ns,
      valid_ns, completion_len=num_completion, chunk_size=s.chunk,
      temperature=s.temperature, remat=s.remat, group_size=group_size,
      attention=s.attention,
      constrain=None if layout is None else layout.constrain)


def policy_tree(params: Params, base: Params | None, s: LossSettings
                ) -> Params:
  """The decoder's parameters: `params` itself, or with LoRA (a `base`
  given) the frozen base with the adapters `params` attached. The gradient
  is taken w.r.t. `params` only, so it never reaches the base."""
  return params if base is None else lora.attach(base, params, s.lora_scale)


def loss_fn(params: Params, model_config: ModelConfig, batch: UpdateBatch,
            norm: losses.Normalisers, kl_beta, s: LossSettings,
            group_size: int = 1, layout=None, base: Params | None = None):
  T = batch.mask_nt.shape[1]
  params = policy_tree(params, base, s)
  logp, entropy = completion_logprobs(model_config, params, batch.tokens_ns,
                                      batch.positions_ns, batch.valid_ns, T, s,
                                      group_size, layout)
  return policy_loss(logp, entropy, batch, norm, kl_beta, s)


def policy_loss(logp_nt, entropy_nt, batch, norm: losses.Normalisers,
                kl_beta, s: LossSettings):
  """The configured loss of given log-probs; `batch` an UpdateBatch or a
  PackedUpdateBatch (its per-token fields are [N, T] either way)."""
  return losses.policy_loss(
      logp_nt, batch.old_logp_nt, batch.adv_n, batch.mask_nt,
      batch.ref_logp_nt if s.use_kl else None, spec=s.loss, kl_beta=kl_beta,
      norm=norm, entropy_nt=entropy_nt, is_weight_nt=batch.is_weight_nt)


def global_normalisers(mask_nt: jax.Array, s: LossSettings
                       ) -> losses.Normalisers:
  return losses.normalisers(mask_nt, s.max_len_norm or None)


def micro_group_size(group_size: int, num_micro: int, rows: int = 0,
                     layout=None) -> int:
  """Rows per prompt inside each strided micro-batch (1: no sharing).

  Micro-batch i takes rows i, i+M, ... of a batch of groups of `group_size`
  consecutive rows; when M divides the group size, it holds group_size / M
  consecutive rows of every group, which still share their prompt.
  With a `sharding.Layout`, sharing also needs the `rows` / group_size
  prompts to split over its batch shards: otherwise every chip would run
  every prompt (and keep their activations) instead of its own rows'."""
  if group_size > 1 and group_size % num_micro == 0:
    if layout is not None and (rows // group_size) % layout.batch_shards:
      return 1
    return group_size // num_micro
  return 1


def micro_batches(batch, num_micro: int):
  """Every [n, ...] field -> [M, n/M, ...]: micro-batch i holds rows i, i+M,
  i+2M, ... (M = num_micro), so rows split over the batch mesh axes stay
  split inside every micro-batch (contiguous blocks would each live on a few
  devices and be resharded every step)."""
  split = lambda x: jnp.swapaxes(
      x.reshape(x.shape[0] // num_micro, num_micro, *x.shape[1:]), 0, 1)
  return jax.tree.map(split, batch)


def micro_batch_sum(grad_fn, params, batch, num_micro: int, combine=None):
  """Runs `grad_fn(params, micro_batch) -> ((loss, aux), grads)` on each of
  `num_micro` strided micro-batches in a scan and returns the summed
  (loss, aux, grads); aux of two micro-batches merges with `combine` (None:
  no aux). With each micro-batch's loss normalised by the WHOLE batch, the
  sums are exactly the whole batch's loss and gradient."""
  micro = micro_batches(batch, num_micro)

  def body(carry, mb):
    loss, aux, grads = carry
    (l, a), g = grad_fn(params, mb)
    return (loss + l, None if combine is None else combine(aux, a),
            jax.tree.map(jnp.add, grads, g)), None

  (l0, a0), g0 = grad_fn(params, jax.tree.map(lambda x: x[0], micro))
  rest = jax.tree.map(lambda x: x[1:], micro)
  (loss, aux, grads), _ = jax.lax.scan(body, (l0, a0, g0), rest)
  return loss, aux, grads


def apply_gradients(state: TrainState, grads, loss, optimizer, model_config,
                    layout=None) -> tuple[TrainState, dict]:
  """The optax update of `grads` applied: the next TrainState (step + 1) and
  {"grad_norm", nonfinite.CODE}. An update whose loss, gradient norm or new
  parameters are not all finite is not applied: params and optimizer state
  stay as they were (`nonfinite.py`). With a `sharding.Layout` the state
  keeps the placed state's shardings."""
  tx = as_optax(optimizer)
  grad_norm = optax.tree.norm(grads)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  code = nonfinite.first_nonfinite(loss, grad_norm, params)
  params, opt_state = nonfinite.keep_if(code == 0, (params, opt_state),
                                        (state.params, state.opt_state))
  new_state = TrainState(state.step + 1, params, opt_state, state.key)
  if layout is not None:
    new_state = layout.constrain_state(model_config, tx, new_state)
  return new_state, {"grad_norm": grad_norm, nonfinite.CODE: code}


def accumulate_gradients(params, model_config, batch: UpdateBatch,
                         num_micro: int, kl_beta, s: LossSettings,
                         group_size: int = 1, layout=None,
                         base: Params | None = None):
  """Sum of micro-batch gradients of the loss normalised by the whole batch:
  exactly the gradient of the full batch's loss (REFERENCE: token-mean).
  group_size: the batch's rows come in groups of that many consecutive rows
  with one prompt (1: no such structure); see `micro_group_size`.
  layout: see `completion_logprobs`; base: see `policy_tree`."""
  norm = global_normalisers(batch.mask_nt, s)
  group = micro_group_size(group_size, num_micro, batch.mask_nt.shape[0],
                           layout)
  grad_fn = jax.value_and_grad(
      functools.partial(loss_fn, model_config=model_config, norm=norm,
                        kl_beta=kl_beta, s=s, group_size=group,
                        layout=layout, base=base),
      has_aux=True)
  loss, metrics, grads = micro_batch_sum(
      lambda p, mb: grad_fn(p, batch=mb), params, batch, num_micro,
      losses.accumulate_metrics)
  return grads, loss, metrics


@functools.partial(jax.jit, static_argnames=("model_config", "optimizer",
                                             "num_micro", "s", "layout",
                                             "group_size"),
                   donate_argnames=("state",))
def update_step(state: TrainState, batch: UpdateBatch | PackedUpdateBatch,
                model_config: ModelConfig, optimizer, num_micro: int,
                s: LossSettings, layout=None, group_size: int = 1,
                base: Params | None = None) -> tuple[TrainState, dict]:
  """One optimizer update on one mini-batch. The state is donated; with a
  `sharding.Layout` the new state keeps the placed state's shardings.
  `optimizer`: an OptimizerSpec (or an optax transformation, which compiles
  once per object).
  group_size > 1: the rows are whole groups of that many consecutive rows
  sharing a prompt (each prompt's forward/backward then runs once).
  A PackedUpdateBatch (`pack_update_batch`): num_micro is its number of
  micro-batches (`packing.pack_rows`), group_size is not read.
  base: with LoRA, the frozen base (compute dtype, not donated) and
  state.params the adapters, the only leaves updated (`policy_tree`)."""
  kl_beta = losses.kl_beta_schedule(state.step, beta=s.kl_beta,
                                    start_step=s.kl_start_step,
                                    ramp_steps=s.kl_ramp_steps)
  if isinstance(batch, PackedUpdateBatch):
    grads, loss, metrics = accumulate_packed_gradients(
        state.params, model_config, batch, num_micro, kl_beta, s, layout,
        base)
  else:
    grads, loss, metrics = accumulate_gradients(
        state.params, model_config, batch, num_micro, kl_beta, s, group_size,
        layout, base)
  state, checked = apply_gradients(state, grads, loss, optimizer,
                                   model_config, layout)
  return state, {**metrics, "loss": loss, **checked, "kl_beta": kl_beta}


# ----------------------------------------------------------------------------
# Packed sequences (packing.py): the same loss on log-probs gathered back
# into sequence slots, so every aggregation stays exact.
# ----------------------------------------------------------------------------

def pack_update_batch(batch: UpdateBatch, rows: packing.PackedRows
                      ) -> PackedUpdateBatch:
  """An UpdateBatch's per-token fields moved into the slots of `rows`
  (`packing.pack_rows` of the same batch); its row arrays are not needed."""
  take = lambda x: None if x is None else packing.gather_slots(
      jnp.asarray(x), jnp.asarray(rows.row_n))
  return PackedUpdateBatch(rows, take(batch.mask_nt), take(batch.old_logp_nt),
                           take(batch.ref_logp_nt), take(batch.adv_n),
                           take(batch.is_weight_nt))


def packed_logprobs(model_config: ModelConfig, params: Params,
                    rows: packing.PackedRows, s: LossSettings, layout=None):
  """`packing.packed_logprobs` with the loss settings' dtype and head.
  layout: see `completion_logprobs`."""
  return packing.packed_logprobs(
      model_config, cast(params, s.compute_dtype), rows, chunk_size=s.chunk,
      temperature=s.temperature, remat=s.remat, attention=s.attention,
      constrain=None if layout is None else layout.constrain)


def packed_loss_fn(params: Params, model_config: ModelConfig,
                   batch: PackedUpdateBatch, norm: losses.Normalisers,
                   kl_beta, s: LossSettings, layout=None,
                   base: Params | None = None):
  params = policy_tree(params, base, s)
  logp, entropy = packed_logprobs(model_config, params, batch.rows, s, layout)
  return policy_loss(logp, entropy, batch, norm, kl_beta, s)


def accumulate_packed_gradients(params, model_config,
                                batch: PackedUpdateBatch, num_micro: int,
                                kl_beta, s: LossSettings, layout=None,
                                base: Params | None = None):
  """`accumulate_gradients` of a packed mini-batch: the normalisers of all
  its slots (empty ones count nothing), the micro-batches summed.
  layout: see `completion_logprobs`."""
  norm = global_normalisers(batch.mask_nt, s)
  grad_fn = jax.value_and_grad(
      functools.partial(packed_loss_fn, model_config=model_config, norm=norm,
                        kl_beta=kl_beta, s=s, layout=layout, base=base),
      has_aux=True)
  loss, metrics, grads = micro_batch_sum(
      lambda p, mb: grad_fn(p, batch=mb), params, batch, num_micro,
      losses.accumulate_metrics)
  return grads, loss, metrics


def micro_batch_rows(mini: int, seq_len: int, micro_batch_size: int = 0,
                     token_budget: int = 0) -> int:
  """Rows per micro-batch: micro_batch_size if set; else the largest divisor
  of the mini-batch whose rows hold at most `token_budget` tokens (at least
  one row); else the whole mini-batch."""
  if micro_batch_size:
    return micro_batch_size
  if not token_budget:
    return mini
  most = max(1, token_budget // seq_len)
  return max(d for d in range(1, min(mini, most) + 1) if mini % d == 0)


def _join_micro_batches(x):
  """[M, n/M, ...] -> [n, ...]: the inverse of `micro_batches`."""
  return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])


@functools.partial(jax.jit, static_argnames=("model_config", "num_completion",
                                             "s", "group_size", "num_micro",
                                             "layout"))
def score_logprobs(params: Params, tokens_ns, positions_ns, valid_ns,
                   model_config: ModelConfig, num_completion: int,
                   s: LossSettings, group_size: int = 1,
                   num_micro: int = 1, layout=None,
                   base: Params | None = None) -> jax.Array:
  """Token log-probs of given completions (π_ref, or π_old recomputed),
  `num_micro` strided micro-batches at a time (as the update splits rows).
  layout: see `completion_logprobs`; base: see `policy_tree`."""
  params = cast(policy_tree(params, base, s), s.compute_dtype)   # once
  group = micro_group_size(group_size, num_micro, tokens_ns.shape[0], layout)
  if num_micro == 1:
    return completion_logprobs(model_config, params, tokens_ns, positions_ns,
                               valid_ns, num_completion, s, group, layout)[0]
  cols = micro_batches((tokens_ns, positions_ns, valid_ns), num_micro)
  logp = jax.lax.map(lambda xs: completion_logprobs(
      model_config, params, *xs, num_completion, s, group, layout)[0], cols)
  return _join_micro_batches(logp)


@functools.partial(jax.jit, static_argnames=("model_config", "s", "num_micro",
                                             "num_rows", "layout"))
def score_packed(params: Params, rows: packing.PackedRows,
                 model_config: ModelConfig, s: LossSettings, num_micro: int,
                 num_rows: int, layout=None, base: Params | None = None
                 ) -> jax.Array:
  """`score_logprobs` of packed sequences: token log-probs [num_rows, T] in
  the padded rows' layout, 0 in rows and columns that were not packed.
  layout: see `completion_logprobs`; the result's rows are split as the
  padded rows are."""
  params = cast(policy_tree(params, base, s), s.compute_dtype)
  logp = jax.lax.map(
      lambda r: packed_logprobs(model_config, params, r, s, layout)[0],
      micro_batches(rows, num_micro))
  logp_nt = packing.scatter_slots(_join_micro_batches(logp), rows.row_n,
                                  num_rows)
  return logp_nt if layout is None else layout.constrain(logp_nt,
                                                         ("batch", None))
