"""Supervised fine-tuning: next-token loss on completion tokens only.

    batches = sft_batches(examples, rows_per_step=8, row_len=256, pack=True,
                          pad_id=0, rng=np.random.default_rng(0))
    program = update.UpdateProgram(model_config, SFTSettings(), optimizer,
                                   num_micro=2)
    state, metrics = sft_step(state, next(batches), program)

An `SFTExample` is (prompt ids, completion ids). A row of S tokens holds one
example, right-padded, or (`pack=True`) several examples back to back. Packed
examples each get positions 0..n-1 and their own segment id, and the decoder
attends only within a segment (`hidden_states(segment_ns=...)`), so a packed
row computes exactly what its examples would alone.

The loss is the token-mean of -log p over the completion tokens of the WHOLE
batch: the token count is taken before the batch is split into micro-batches,
so the gradient does not depend on the split (as the RL token-mean,
`losses.py`). Prompt tokens are context, never targets. The micro-batch
scan and the optimizer step are the RL update's (`update.micro_batch_sum`,
`update.apply_gradients`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.algorithms import logprobs as logprobs_lib
from grpo_jax.generate import sampling
from grpo_jax.models import cast, lora, transformer
from grpo_jax.models.config import ModelConfig
from grpo_jax.rl import packing, update
from grpo_jax.rl.update import TrainState

Params = transformer.Params


class SFTExample(NamedTuple):
  """One training sequence: the loss covers `completion_ids` only."""
  prompt_ids: tuple[int, ...]
  completion_ids: tuple[int, ...]


class SFTBatch(NamedTuple):
  """N rows of S tokens (host numpy or device arrays)."""
  tokens_ns: np.ndarray       # int32
  positions_ns: np.ndarray    # int32, restarting at 0 for each example
  segments_ns: np.ndarray     # int32, 0 = padding, 1, 2, ... = examples
  loss_mask_ns: np.ndarray    # float32, 1 on completion tokens (targets)


@dataclasses.dataclass(frozen=True)
class SFTSettings:
  """The static (hashable) part of the SFT step."""
  chunk: int = 256              # positions per chunk of the vocabulary head
  remat: str = "none"
  compute_dtype: str = "float32"
  lora_scale: float = 0.0       # α/r of the adapters (model.lora; 0: off)

  @classmethod
  def from_config(cls, config) -> "SFTSettings":
    m = config.model
    return cls(chunk=m.logprob_chunk, remat=m.remat,
               compute_dtype=m.compute_dtype,
               lora_scale=lora.LoraSpec.from_config(config).scale)


# ----------------------------------------------------------------------------
# Host side: examples -> fixed-shape rows.
# ----------------------------------------------------------------------------

def example_length(example: SFTExample) -> int:
  return len(example.prompt_ids) + len(example.completion_ids)


def row_length(examples: Sequence[SFTExample]) -> int:
  """Tokens per row for these examples: the longest, rounded up to an eighth
  of its power-of-two bucket (72 -> 80, 300 -> 320; a multiple of 8, at least 16). Less
  than 1/8 of a row is padding, where the bucket itself (72 -> 128) padded
  up to half of it at the same cost per token, and a run still compiles
  for at most 8 row lengths per power of two."""
  longest = max(map(example_length, examples))
  step = max(8, sampling.bucket(longest) // 8)
  return max(16, -(-longest // step) * step)


def group_rows(examples: Sequence[SFTExample], row_len: int,
               pack: bool) -> list[list[SFTExample]]:
  """Examples grouped into rows of at most `row_len` tokens: one per row,
  or (pack) each in the first row with room for it (`packing.assign_rows`,
  as the RL update packs)."""
  rows = packing.assign_rows(
      range(len(examples)), [len(e.prompt_ids) for e in examples],
      [len(e.completion_ids) for e in examples], row_len, pack)
  return [[examples[i] for i in row] for row in rows]


def rows_to_batch(rows: Sequence[Sequence[SFTExample]], row_len: int,
                  pad_id: int) -> SFTBatch:
  """Fixed-shape (N, row_len) arrays for the rows; the tail is padding."""
  N = len(rows)
  tokens = np.full((N, row_len), pad_id, np.int32)
  positions = np.zeros((N, row_len), np.int32)
  segments = np.zeros((N, row_len), np.int32)
  loss_mask = np.zeros((N, row_len), np.float32)
  for i, row in enumerate(rows):
    col = 0
    for seg, e in enumerate(row, start=1):
      P, C = len(e.prompt_ids), len(e.completion_ids)
      end = col + P + C
      tokens[i, col:end] = (*e.prompt_ids, *e.completion_ids)
      positions[i, col:end] = np.arange(P + C)
      segments[i, col:end] = seg
      loss_mask[i, col + P:end] = 1.0
      col = end
  return SFTBatch(tokens, positions, segments, loss_mask)


def sft_batches(examples: Sequence[SFTExample], rows_per_step: int,
                row_len: int, pack: bool, pad_id: int,
                rng: np.random.Generator) -> Iterator[SFTBatch]:
  """Endless batches of `rows_per_step` rows: each epoch shuffles the
  examples and groups them into rows; rows run on across epoch ends, so
  every batch is full."""
  if not examples:
    raise ValueError("sft_batches needs at least one example")
  pending: list[list[SFTExample]] = []
  while True:
    order = rng.permutation(len(examples))
    pending += group_rows([examples[i] for i in order], row_len, pack)
    while len(pending) >= rows_per_step:
      batch, pending = pending[:rows_per_step], pending[rows_per_step:]
      yield rows_to_batch(batch, row_len, pad_id)


# ----------------------------------------------------------------------------
# The loss and the jitted step.
# ----------------------------------------------------------------------------

def completion_nll_sum(params: Params, model_config: ModelConfig,
                       batch: SFTBatch, sft: SFTSettings) -> jax.Array:
  """Σ -log p(token) over the completion tokens of the batch (a scalar).

  Column t's hidden state predicts token t+1; targets are tokens[:, 1:]
  weighted by loss_mask[:, 1:]. A completion token never starts a segment
  (its prompt precedes it), so no prediction crosses two packed examples.
  """
  params = cast(params, sft.compute_dtype)
  h_nsd = transformer.hidden_states(
      model_config, params, batch.tokens_ns, batch.positions_ns,
      batch.segments_ns > 0, batch.segments_ns,
      transformer.ForwardSettings(remat=sft.remat))
  logp_ns, _ = logprobs_lib.token_logprobs(
      model_config, params, h_nsd[:, :-1], batch.tokens_ns[:, 1:],
      chunk_size=sft.chunk)                                 # (N, S-1)
  return -jnp.sum(logp_ns * batch.loss_mask_ns[:, 1:])


def num_target_tokens(batch: SFTBatch) -> jax.Array:
  """The token-mean normaliser: completion tokens in the whole batch (>= 1)."""
  return jnp.maximum(jnp.sum(batch.loss_mask_ns[:, 1:]), 1.0)


def sft_loss(policy: update.Policy, model_config: ModelConfig,
             batch: SFTBatch, num_tokens: jax.Array, sft: SFTSettings
             ) -> jax.Array:
  """This (micro-)batch's share of the token-mean loss: its NLL sum over
  the whole batch's completion-token count. With LoRA the policy is the
  frozen base with its adapters (`update.Policy`)."""
  params = policy.tree(sft.lora_scale)
  return completion_nll_sum(params, model_config, batch, sft) / num_tokens


def accumulate_gradients(policy: update.Policy, batch: SFTBatch,
                         program: update.UpdateProgram):
  """(loss, grads w.r.t. policy.params, token count) of the whole batch's
  token-mean loss, summed over `program.num_micro` micro-batches that share
  one normaliser: exact whatever the split."""
  num_micro = program.num_micro
  if batch.tokens_ns.shape[0] % num_micro:
    raise ValueError(f"num_micro={num_micro} must divide the "
                     f"{batch.tokens_ns.shape[0]} rows")
  num_tokens = num_target_tokens(batch)
  grad_fn = jax.value_and_grad(
      lambda params, mb: (sft_loss(update.Policy(params, policy.base),
                                   program.model_config, mb, num_tokens,
                                   program.loss), None),
      has_aux=True)
  loss, _, grads = update.micro_batch_sum(grad_fn, policy.params, batch,
                                          num_micro)
  return loss, grads, num_tokens


@functools.partial(jax.jit, static_argnames=("program",),
                   donate_argnames=("state",))
def sft_step(state: TrainState, batch: SFTBatch,
             program: update.UpdateProgram, base=None
             ) -> tuple[TrainState, dict]:
  """One optimizer update on the completion-token NLL. `program`: the
  model, these `SFTSettings` as its loss, the optimizer (an
  `optimizer.OptimizerSpec`: equal specs, one compile; or an optax
  transformation), the micro-batches and the layout (the new state keeps
  the placed state's shardings; batches then come row-sharded,
  `layout.rows`). The state is donated: pass a copy of parameters that
  must survive (e.g. the original model). base: with LoRA, the frozen base
  (not donated); state.params are its adapters."""
  loss, grads, num_tokens = accumulate_gradients(
      update.Policy(state.params, base), batch, program)
  state, checked = update.apply_gradients(state, grads, loss,
                                          program.optimizer,
                                          program.model_config,
                                          program.layout)
  return state, {"loss": loss, **checked, "tokens": num_tokens}
