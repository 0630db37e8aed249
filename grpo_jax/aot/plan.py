"""`Plan`: every program of a config (sampler, update, scoring, packed or
not, evaluation), lowered on abstract arrays (`programs`) with the
trainer's own functions and shardings.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from grpo_jax import sharding
from grpo_jax.aot.programs import (
  Program,
  abstract_adapters,
  abstract_params,
  abstract_state,
  compile_program,
  per_chip_bytes,
  quantized,
  replicated,
  row_sharded,
)
from grpo_jax.generate import decoding, padded, sampling
from grpo_jax.models import lora, paged
from grpo_jax.models.config import ModelConfig
from grpo_jax.rl import packing, update
from grpo_jax.rl.spec import RunSpec


@dataclasses.dataclass
class Plan:
  """What one training step and its evaluation compile, from a config."""
  config: Any
  model_config: ModelConfig
  layout: sharding.Layout
  prompt_len: int
  run: RunSpec = dataclasses.field(init=False)   # as the trainer derives them
  state: Any = None
  base: Any = None     # LoRA: the frozen base (compute dtype), else None

  def __post_init__(self):
    m = self.config.model
    self.run = RunSpec.from_config(self.config)   # aot loads no tokenizer
    self.rows, self.mini = self.run.batch.rows, self.run.batch.mini
    self.optimizer, self.spec = self.run.optimizer, self.run.update
    self.lora = self.run.lora
    adapters = None
    if self.lora.enabled:   # state = adapters + their optimizer state
      self.base = abstract_params(self.model_config, m.compute_dtype,
                                  self.layout)
      adapters = abstract_adapters(self.model_config, self.lora,
                                   m.param_dtype, self.layout)
    self.state = abstract_state(self.model_config, self.optimizer,
                                m.param_dtype, self.layout, adapters)

  @property
  def base_bytes(self) -> int:
    """LoRA: the frozen base, resident all run (0 without LoRA)."""
    return 0 if self.base is None else per_chip_bytes(self.base)

  @property
  def completion_tokens(self) -> int:
    """T of a row after its prompt: max_new_tokens, or with an env the
    trajectory's budget (`EnvSpec.trajectory_tokens`: every turn and
    observation at its budget), as the rollout shapes the update's rows."""
    env, T = self.run.groups.env, self.run.sampling.max_new_tokens
    return T if env is None else env.trajectory_tokens(T)

  @property
  def seq_len(self) -> int:
    return self.prompt_len + self.completion_tokens

  @property
  def state_bytes(self) -> int:
    return per_chip_bytes(self.state)

  def compute_params(self):
    return abstract_params(self.model_config, self.config.model.compute_dtype,
                           self.layout)

  def compute_copy_bytes(self) -> int:
    """A separate compute-dtype copy exists only when the dtypes differ
    (LoRA: the merged copy, model.lora.sampler = merged)."""
    m = self.config.model
    if self.base is not None:
      return (per_chip_bytes(self.compute_params())
              if self.lora.sampler == "merged" else 0)
    if m.compute_dtype == m.param_dtype:
      return 0
    return per_chip_bytes(self.compute_params())

  @property
  def int8_weights(self) -> bool:
    """The sampler reads int8 weights (`sampling.weights_dtype`; LoRA:
    merged adapters only, unmerged ones attach to the compute-dtype base)."""
    return (self.config.sampling.weights_dtype == "int8"
            and not (self.base is not None and self.lora.sampler == "unmerged"))

  def sampler_params(self):
    """What the sampler decodes with: the compute-dtype params (LoRA: the
    merged copy, or the base with the adapters attached), int8 where
    `sampling.weights_dtype` says."""
    if self.base is not None and self.lora.sampler == "unmerged":
      cast = lambda x: jax.ShapeDtypeStruct(
          x.shape, jnp.dtype(self.config.model.compute_dtype),
          sharding=x.sharding)
      return lora.attach(self.base, jax.tree.map(cast, self.state.params),
                         1.0)
    if self.int8_weights:
      return quantized(self.compute_params())
    return self.compute_params()

  def sampler(self, prompts: int, generations: int,
              sampling_config: sampling.SamplingConfig, name: str) -> Program:
    """One sampler call on `prompts` prompts (padded as `sampling.sample`
    pads them) x `generations` rows each."""
    b = sampling.padded_prompts(prompts, prompts, self.layout.batch_shards,
                                generations)
    prompt = row_sharded(self.layout, (b, self.prompt_len), jnp.int32)
    lens = row_sharded(self.layout, (b,), jnp.int32)
    key = replicated(self.layout, jax.eval_shape(lambda: jax.random.key(0)))
    params, resident = self.sampler_params(), self.sampler_resident()
    call = decoding.CallSpec(self.model_config, sampling_config, generations,
                             self.layout)
    lower = lambda: padded.sample_padded.lower(call, params, prompt, lens, key)
    return compile_program(name, b * generations, lower, resident)

  def sampler_resident(self) -> int:
    """Bytes alive beside a sampler call: the train state (and the reference
    when β > 0); with equal dtypes the sampler reads the state's own params
    (its argument). LoRA: the base too, unless the sampler reads it
    (unmerged)."""
    if self.base is not None:
      return self.state_bytes + (self.base_bytes
                                 if self.compute_copy_bytes() else 0)
    if self.int8_weights:   # the int8 copy is the argument; all else stays
      return self.state_bytes + self.reference_bytes()
    return self.state_bytes + self.reference_bytes() - (
        0 if self.compute_copy_bytes() else per_chip_bytes(self.state.params))

  def sampler_budget(self, hbm: float) -> float:
    """Per-chip bytes the sampler's caches may take a share of (sampling
    .KV_FRACTION): what the train state, the reference and the compute copy
    leave."""
    copy = (self.weight_bytes() if self.int8_weights
            else self.compute_copy_bytes())
    return (hbm - self.state_bytes - self.reference_bytes() - copy
            - self.base_bytes)

  def weight_bytes(self) -> int:
    """The per-chip bytes of the weights the sampler reads each decode step."""
    if self.int8_weights:
      return per_chip_bytes(self.sampler_params())
    if self.base is not None:
      return self.base_bytes
    return per_chip_bytes(self.state.params) * jnp.dtype(
        self.config.model.compute_dtype).itemsize // jnp.dtype(
            self.config.model.param_dtype).itemsize

  def sampling_config(self, greedy=False) -> sampling.SamplingConfig:
    """The run's sampler settings (`RunSpec.sampling`, aot's stand-in stop
    id) as the static program reads them: token choice and length; how rows
    take cache slots is each program's own (`paged_sampling_config`)."""
    run = self.run.sampling
    return sampling.SamplingConfig(
        max_new_tokens=run.max_new_tokens, temperature=run.temperature,
        top_p=run.top_p, top_k=run.top_k, greedy=greedy,
        stop_ids=run.stop_ids, stop_check_every=run.stop_check_every)

  def paged_kernel(self) -> str:
    """The paged decode attention a TPU run uses: `sampling.paged_kernel`
    resolved as on a TPU backend (auto: the Pallas kernel where it can take
    the model, `paged.kernel_refuses`); this process itself runs on the
    CPU backend."""
    return paged.resolve(self.run.sampling.paged_kernel, self.model_config,
                         backend="tpu")

  def paged_sampling_config(self) -> sampling.SamplingConfig:
    """The training sampler's config with the paged KV cache."""
    return dataclasses.replace(
        self.sampling_config(), continuous_batching=True, kv_cache="paged",
        page_size=self.run.sampling.page_size,
        paged_kernel=self.paged_kernel(), kv_dtype=self.run.sampling.kv_dtype)

  def sequence_columns(self, n: int) -> tuple:
    """Abstract (tokens, positions, valid) [n, s] of n padded rows, split
    over the batch shards: the update's and scoring's decoder inputs."""
    return tuple(row_sharded(self.layout, (n, self.seq_len), dtype)
                 for dtype in (jnp.int32, jnp.int32, jnp.bool_))

  def update(self, micro_rows: int) -> Program:
    """update_step on one mini-batch in micro-batches of `micro_rows`."""
    n, T = self.mini, self.completion_tokens
    batch = update.UpdateBatch(
        *self.sequence_columns(n),
        row_sharded(self.layout, (n, T), jnp.bool_),
        row_sharded(self.layout, (n, T), jnp.float32),
        row_sharded(self.layout, (n, T), jnp.float32),
        row_sharded(self.layout, (n,), jnp.float32))
    resident = self.reference_bytes()
    lower = lambda: update.update_step.lower(
        self.state, batch, self.program(num_micro=n // micro_rows,
                                        group_size=self.spec.group_size(n)),
        self.base)
    return compile_program("update", micro_rows, lower, resident,
                           whole_collectives=True)

  def packed_rows(self, rows: int, micro_rows: int
                  ) -> tuple[packing.PackedRows, int, int]:
    """Abstract `packing.pack_rows` output for `rows` sequences at
    `micro_rows` rows per micro-batch (see `PACKED_SEQUENCES_PER_ROW`),
    with R rows per micro-batch and M micro-batches."""
    R, M, N = packed_shape(rows, micro_rows, self.layout.batch_shards)
    S, T = self.seq_len, self.completion_tokens
    row = lambda dtype: row_sharded(self.layout, (R * M, S), dtype)
    return packing.PackedRows(
        row(jnp.int32), row(jnp.int32), row(jnp.bool_), row(jnp.int32),
        row(jnp.int32), row_sharded(self.layout, (N * M, T), jnp.int32),
        row_sharded(self.layout, (N * M,), jnp.int32)), R, M

  def packed_update(self, micro_rows: int) -> Program:
    """update_step on one mini-batch packed (`rl.packing`): rows of
    s = prompt + max_new_tokens tokens, `micro_rows` per micro-batch."""
    n, T = self.mini, self.completion_tokens
    rows, R, num_micro = self.packed_rows(n, micro_rows)
    slots = rows.src_nt.shape[0]
    batch = update.UpdateBatch(
        mask_nt=row_sharded(self.layout, (slots, T), jnp.bool_),
        old_logp_nt=row_sharded(self.layout, (slots, T), jnp.float32),
        ref_logp_nt=row_sharded(self.layout, (slots, T), jnp.float32),
        adv_n=row_sharded(self.layout, (slots,), jnp.float32), rows=rows)
    lower = lambda: update.update_step.lower(
        self.state, batch, self.program(num_micro=num_micro,
                                        group_size=self.spec.group_size(n)),
        self.base)
    return compile_program("update packed", R, lower, self.reference_bytes(),
                           whole_collectives=True)

  def packed_score(self, micro_rows: int) -> Program:
    """score_logprobs on the step's rows packed (as `packed_update`)."""
    rows, R, num_micro = self.packed_rows(self.rows, micro_rows)
    T = self.completion_tokens
    resident = self.state_bytes + self.reference_bytes() - per_chip_bytes(
        self.state.params)
    lower = lambda: update.score_logprobs.lower(
        update.Policy(self.state.params, self.base),
        update.UpdateBatch(rows=rows), self.program(
            num_micro=num_micro, group_size=self.spec.group_size(self.rows),
            logp_shape=(self.rows, T)))
    return compile_program("score packed", R, lower, resident,
                           whole_collectives=True)

  def reference_bytes(self) -> int:
    """The reference model's params, alive all run when β > 0 (LoRA: none,
    the reference is the base, an argument of every program)."""
    if self.base is not None:
      return 0
    return per_chip_bytes(self.state.params) if self.spec.loss.use_kl else 0

  def score(self, micro_rows: int) -> Program:
    """score_logprobs on the step's rows in micro-batches of `micro_rows`."""
    T, rows = self.completion_tokens, self.rows
    cols = update.UpdateBatch(*self.sequence_columns(rows))
    resident = self.state_bytes + self.reference_bytes() - per_chip_bytes(
        self.state.params)
    lower = lambda: update.score_logprobs.lower(
        update.Policy(self.state.params, self.base), cols, self.program(
            num_micro=rows // micro_rows,
            group_size=self.spec.group_size(rows), logp_shape=(rows, T)))
    return compile_program("score", micro_rows, lower, resident,
                           whole_collectives=True)

  def micro_rows(self) -> int:
    return update.micro_batch_rows(self.mini, self.seq_len,
                                   self.spec.micro_batch_size,
                                   self.spec.micro_batch_tokens)

  def program(self, **static) -> update.UpdateProgram:
    """The trainer's static update world, specialised as a step does."""
    return dataclasses.replace(
        self.spec.program(self.model_config, self.optimizer, self.layout),
        **static)

  @property
  def uses_scoring(self) -> bool:
    return self.spec.scores


# Sequences per packed row that aot.py assumes when it sizes the slot arrays
# ([N, T] per micro-batch, N = this x R): completions of a quarter of
# max_new_tokens on average (issue 15's long-tailed workload has a mean of at
# most 0.35). Only the loss's [N, T] float32 arrays depend on it; the
# decoder's activations are the R rows' whatever they hold.
PACKED_SEQUENCES_PER_ROW = 4


def packed_shape(rows: int, micro_rows: int, shards: int
                 ) -> tuple[int, int, int]:
  """(R rows per micro-batch, M micro-batches, N slots per micro-batch) of
  `rows` sequences packed as `step.train_step` packs them
  (`packing.pack_rows(..., micro_rows, shards)`), in its worst case for the
  decoder: every completion at max_new_tokens, so one sequence per row of
  s = prompt + max_new_tokens tokens and as many rows as the padded path
  (`packing.micro_batch_shape`). N: `PACKED_SEQUENCES_PER_ROW` per row, a
  power of two as pack_rows buckets it, a multiple of the shards."""
  R, M = packing.micro_batch_shape(rows, micro_rows, shards)
  return R, M, packing.slot_count(PACKED_SEQUENCES_PER_ROW * R, shards)
