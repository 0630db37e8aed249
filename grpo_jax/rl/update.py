"""UPDATE: the train state, the optimizer and the jitted policy update.

`update_step` is one pure jitted function: it splits a mini-batch into
micro-batches, accumulates the gradient of the loss normalised by the WHOLE
mini-batch's token/sequence counts (so token-mean is exact whatever the
split), and applies the optax update. `score_logprobs` is the one scoring
program (π_ref, or π_old recomputed), micro-batched as the update.

One batch type for both layouts: an `UpdateBatch` holds either padded rows
[prompt | completion] or, in `rows`, the same sequences packed several to a
row (`packing.py`), with its per-token fields [N, T] either way (packed:
N sequence slots, empty ones mask 0). The one branch is where the log-probs
are computed (`batch_logprobs`); the loss, the normalisers, the micro-batch
scan and the optimizer step do not know which layout they run on.

The static world of a compiled program is one hashable value, an
`UpdateProgram` (model, loss settings, optimizer, micro-batches, group
size, layout): equal values share one compile, however many times they are
made (STaR makes a fresh optimizer every outer iteration). The parameters
are one `Policy` value: the trained params and, with LoRA, the frozen base.

The core is shared with supervised fine-tuning (`sft.sft_step`, STaR):
`micro_batch_sum` (strided micro-batches, gradients summed in a scan) and
`apply_gradients` (optax, the next TrainState, the layout's constraint;
a non-finite update is not applied, `nonfinite.py`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from grpo_jax.algorithms import logprobs as logprobs_lib
from grpo_jax.algorithms import losses
from grpo_jax.models import lora, moe
from grpo_jax.models.config import ModelConfig
from grpo_jax.models.transformer import cast
from grpo_jax.rl import nonfinite, packing
from grpo_jax.rl.optimizer import as_optax

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
  moe_aux_coef: float = -1.0  # balancing loss weight (< 0: the checkpoint's)
  moe_dispatch: str = "auto"  # model.moe.dispatch

  @property
  def use_kl(self) -> bool:
    return self.kl_beta > 0

  def forward(self, layout=None, group_size: int = 1
              ) -> logprobs_lib.Forward:
    """How the trainer's forward runs: these settings, the activations
    pinned to `layout` (a `sharding.Layout`: each chip computes only its
    rows; its MoE dispatch), `group_size` rows sharing a prompt."""
    constrain, dispatch = ((None, None) if layout is None else (
        layout.constrain, layout.expert_dispatch(self.moe_dispatch)))
    return logprobs_lib.Forward(self.chunk, self.temperature, self.remat,
                                self.attention, constrain, group_size, dispatch)

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
               lora_scale=lora.LoraSpec.from_config(config).scale,
               moe_aux_coef=config.model.moe.aux_loss_coef,
               moe_dispatch=config.model.moe.dispatch)

  def aux_coef(self, model_config: ModelConfig) -> float:
    """The MoE balancing loss's weight: model.moe.aux_loss_coef, or (< 0)
    the checkpoint's `router_aux_loss_coef` (0 for a dense model)."""
    if model_config.moe is None:
      return 0.0
    if self.moe_aux_coef >= 0:
      return self.moe_aux_coef
    return model_config.moe.aux_loss_coef


class Policy(NamedTuple):
  """The decoder's parameters as one value: `params`, what is trained (the
  full weights, or with LoRA the adapters), and with LoRA the frozen `base`
  (compute dtype; None without LoRA). Gradients are taken w.r.t. `params`
  only, so they never reach the base; jitted steps donate the train state
  (`params` inside it) and never the base."""
  params: Params
  base: Params | None = None

  def tree(self, lora_scale: float) -> Params:
    """The decoder's parameter tree: `params` itself, or the base with the
    adapters `params` attached (α/r = lora_scale)."""
    if self.base is None:
      return self.params
    return lora.attach(self.base, self.params, lora_scale)


class UpdateBatch(NamedTuple):
  """One mini-batch of sequences: n padded rows of S = P + T columns
  (`tokens_ns`, `positions_ns`, `valid_ns`), or the same sequences packed
  (`rows`, `packing.pack_rows`; then the row fields are None). The per-token
  fields are [N, T]: the padded rows', or the packed batch's N*M sequence
  slots in slot order (empty slots all zero, mask 0), strided by
  micro-batch like `rows`. Scoring reads only the row fields."""
  tokens_ns: jax.Array | None = None
  positions_ns: jax.Array | None = None
  valid_ns: jax.Array | None = None
  mask_nt: jax.Array | None = None
  old_logp_nt: jax.Array | None = None
  ref_logp_nt: jax.Array | None = None   # zeros when β = 0 (never read)
  adv_n: jax.Array | None = None    # [N] outcome or [N, T] process advantages
  is_weight_nt: Optional[jax.Array] = None   # rollout-correction weights
  rows: Optional[packing.PackedRows] = None   # packed: the decoder's rows
  routes_nslc: Optional[jax.Array] = None   # replay: the sampler's experts


@dataclasses.dataclass(frozen=True)
class UpdateProgram:
  """The static world of one jitted update, SFT step or scoring program
  (hashable: equal values share one compiled program).

  loss: `LossSettings` (RL) or `sft.SFTSettings` (SFT); optimizer: an
  `optimizer.OptimizerSpec` (or an optax transformation, which compiles
  once per object; None: scoring only); num_micro: micro-batches per batch;
  group_size > 1: the padded rows are whole groups of that many consecutive
  rows sharing a prompt (its forward/backward then runs once; packed rows
  say so themselves); layout: a `sharding.Layout` (rows over its batch
  axes, the state keeping its shardings); logp_shape: scoring's result,
  [n, t] log-probs in the padded rows' layout."""
  model_config: ModelConfig
  loss: Any
  optimizer: Any = None
  num_micro: int = 1
  group_size: int = 1
  layout: Any = None
  logp_shape: tuple[int, int] = (0, 0)


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

def batch_logprobs(params: Params, batch: UpdateBatch, num_completion: int,
                   program: UpdateProgram):
  """log π(token) and entropy of the batch's completion tokens, [N, T],
  temperature-scaled exactly as the sampler's log-probs: over the last
  `num_completion` columns of padded rows (program.group_size > 1: each
  group's prompt run once), or gathered from packed rows into their
  sequence slots. With a layout each chip computes only its rows. Third:
  the MoE `transformer.Routed` (None for a dense model), the recorded
  experts replayed where the batch has them."""
  loss = program.loss
  params = cast(params, loss.compute_dtype)
  forward = loss.forward(program.layout, program.group_size)
  if batch.rows is not None:
    return packing.packed_logprobs(program.model_config, params, batch.rows,
                                   forward)
  return logprobs_lib.sequence_logprobs_routed(
      program.model_config, params, batch.tokens_ns, batch.positions_ns,
      batch.valid_ns, completion_len=num_completion, forward=forward,
      routes_nslc=batch.routes_nslc)


def loss_fn(policy: Policy, batch: UpdateBatch, norm: losses.Normalisers,
            kl_beta, program: UpdateProgram):
  """The configured loss of one (micro-)batch under `policy` and its
  metrics (program.group_size: the rows per prompt of this batch), plus
  an MoE model's weighted balancing loss (`moe.loss_terms`)."""
  params = policy.tree(program.loss.lora_scale)
  logp, entropy, routed = batch_logprobs(params, batch,
                                         batch.mask_nt.shape[1], program)
  loss, metrics = policy_loss(logp, entropy, batch, norm, kl_beta,
                              program.loss)
  if routed is None:
    return loss, metrics
  aux, moe_metrics = moe.loss_terms(
      program.model_config.moe, routed.stats,
      program.loss.aux_coef(program.model_config), program.num_micro)
  return loss + aux, {**metrics, **moe_metrics}


def policy_loss(logp_nt, entropy_nt, batch: UpdateBatch,
                norm: losses.Normalisers, kl_beta, loss: LossSettings):
  """The configured loss of given log-probs (the batch's per-token fields
  are [N, T] whether it is padded or packed)."""
  return losses.policy_loss(
      logp_nt, batch.old_logp_nt, batch.adv_n, batch.mask_nt,
      batch.ref_logp_nt if loss.use_kl else None, spec=loss.loss,
      kl_beta=kl_beta, norm=norm, entropy_nt=entropy_nt,
      is_weight_nt=batch.is_weight_nt)


def global_normalisers(mask_nt: jax.Array, loss: LossSettings
                       ) -> losses.Normalisers:
  return losses.normalisers(mask_nt, loss.max_len_norm or None)


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


def _in_micro_batches(program: UpdateProgram, rows: int) -> UpdateProgram:
  """`program` as each of its micro-batches of a batch of `rows` rows runs:
  the rows per prompt they keep (`micro_group_size`)."""
  return dataclasses.replace(program, group_size=micro_group_size(
      program.group_size, program.num_micro, rows, program.layout))


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


def accumulate_gradients(policy: Policy, batch: UpdateBatch, kl_beta,
                         program: UpdateProgram):
  """Sum of the gradients (w.r.t. policy.params) of `program.num_micro`
  micro-batches' losses normalised by the whole batch: exactly the gradient
  of the full batch's loss (REFERENCE: token-mean), padded or packed (the
  normalisers of all its slots; empty ones count nothing).
  Returns (grads, loss, metrics)."""
  norm = global_normalisers(batch.mask_nt, program.loss)
  micro = _in_micro_batches(program, batch.mask_nt.shape[0])
  grad_fn = jax.value_and_grad(
      lambda params, mb: loss_fn(Policy(params, policy.base), mb, norm,
                                 kl_beta, micro),
      has_aux=True)
  loss, metrics, grads = micro_batch_sum(
      grad_fn, policy.params, batch, program.num_micro,
      losses.accumulate_metrics)
  return grads, loss, metrics


@functools.partial(jax.jit, static_argnames=("program",),
                   donate_argnames=("state",))
def update_step(state: TrainState, batch: UpdateBatch,
                program: UpdateProgram, base: Params | None = None
                ) -> tuple[TrainState, dict]:
  """One optimizer update on one mini-batch, padded or packed
  (`pack_update_batch`; num_micro is then its number of micro-batches,
  `packing.pack_rows`). The state is donated; with a layout the new state
  keeps the placed state's shardings. base: with LoRA, the frozen base
  (not donated) and state.params the adapters, the only leaves updated."""
  loss = program.loss
  kl_beta = losses.kl_beta_schedule(state.step, beta=loss.kl_beta,
                                    start_step=loss.kl_start_step,
                                    ramp_steps=loss.kl_ramp_steps)
  grads, loss_value, metrics = accumulate_gradients(
      Policy(state.params, base), batch, kl_beta, program)
  state, checked = apply_gradients(state, grads, loss_value,
                                   program.optimizer, program.model_config,
                                   program.layout)
  return state, {**metrics, "loss": loss_value, **checked,
                 "kl_beta": kl_beta}


def pack_update_batch(batch: UpdateBatch, rows: packing.PackedRows
                      ) -> UpdateBatch:
  """A padded UpdateBatch's sequences packed: its per-token fields moved
  into the slots of `rows` (`packing.pack_rows` of the same rows), its row
  fields replaced by `rows`."""
  take = lambda x: None if x is None else packing.gather_slots(
      jnp.asarray(x), jnp.asarray(rows.row_n))
  return UpdateBatch(mask_nt=take(batch.mask_nt),
                     old_logp_nt=take(batch.old_logp_nt),
                     ref_logp_nt=take(batch.ref_logp_nt),
                     adv_n=take(batch.adv_n),
                     is_weight_nt=take(batch.is_weight_nt), rows=rows)


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


# ----------------------------------------------------------------------------
# Scoring: the same log-probs without a gradient, as the update splits rows.
# ----------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("program",))
def score_logprobs(policy: Policy, batch: UpdateBatch,
                   program: UpdateProgram) -> jax.Array:
  """Token log-probs of given completions (π_ref, or π_old recomputed),
  `program.num_micro` strided micro-batches at a time (as the update splits
  rows): [n, t] = program.logp_shape in the padded rows' layout, from
  padded rows or packed ones (0 in rows and columns not packed; with a
  layout, the result's rows split as the padded rows are). Only the
  batch's row fields are read."""
  n, T = program.logp_shape
  layout, num_micro = program.layout, program.num_micro
  params = cast(policy.tree(program.loss.lora_scale),
                program.loss.compute_dtype)   # once
  micro = _in_micro_batches(program, n)
  logp = lambda mb: batch_logprobs(params, mb, T, micro)[0]
  if batch.rows is None and num_micro == 1:
    return logp(batch)
  logp_nt = _join_micro_batches(
      jax.lax.map(logp, micro_batches(batch, num_micro)))
  if batch.rows is None:
    return logp_nt
  logp_nt = packing.scatter_slots(logp_nt, batch.rows.row_n, n)
  return logp_nt if layout is None else layout.constrain(logp_nt,
                                                         ("batch", None))
