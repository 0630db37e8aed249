"""The parked engine at pod scale (`env.engine = "parked"`, docs/agents.md):
its programs compiled for a topology, as a run places them.

A run with an env on the parked engine samples with `parked.Engine`, one per
row shard (`agent_parked.engines`), never with the training sampler call.
Each engine lives on its row shard's devices (`Layout.row_shard`): a copy of
the weights gathered over the batch axes and split over the others as they
are, its page pool's KV heads split as the weights' heads
(`parked_programs.pool_maker`), its slots as host numpy read back once per call. Sized by
the run's own rule (`agent_parked.shard_engine_spec`), per row shard:

  engine decode     `parked_programs.decode_steps`: a call of at most
                    env.engine_steps decode steps over the M slots
  engine prefill    `parked_programs.prefill` of A = M rows (the most one call
                    admits) of the prompt: every slot admitted at once at a
                    step's start, each prefilling its whole prompt
  engine observe    `parked_programs.prefill` of M rows, each the turn's
                    last id and an observation at its budget (env.max_observation_tokens)
                    onto the row's own pages: what a re-admitted row prefills

Every chip belongs to one row shard and every shard's programs are the same,
so shard 0's per-chip bytes are every chip's. Beside them stays what the
training sampler call would leave (`Plan.sampler_resident`) and, with more
than one row shard, the full mesh's compute-dtype weights the shards' copies
were made from.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from grpo_jax.aot.plan import Plan
from grpo_jax.aot.programs import Program, compile_program, per_chip_bytes
from grpo_jax.generate import agent_parked, page_pool, parked, parked_programs, parked_routes, sampling
from grpo_jax.models import int8_pages


def _on(mesh, x) -> jax.ShapeDtypeStruct:
  """x's shape and dtype on `mesh` with x's partition spec (replicated
  where it has none): `Layout.place_like` on an abstract array."""
  spec = getattr(getattr(x, "sharding", None), "spec", P())
  return jax.ShapeDtypeStruct(x.shape, x.dtype,
                              sharding=NamedSharding(mesh, spec))


def step_rows(plan: Plan) -> int:
  """A training step's episodes: prompts x G."""
  return plan.run.batch.prompts * plan.run.batch.generations


def engine_spec(plan: Plan, rows: int = 0, greedy: bool = False
                ) -> parked.EngineSpec:
  """One row shard's engine, sized as `agent_parked.run_episodes` sizes it
  for `rows` episodes (0: a step's, `step_rows`), prompts of
  plan.prompt_len tokens; greedy: an evaluation's greedy call."""
  env, shards = plan.run.groups.env, plan.layout.batch_shards
  per_shard = len(agent_parked.shard_rows(rows or step_rows(plan),
                                          shards)[0])
  cfg = dataclasses.replace(plan.paged_sampling_config(),
                            pages=plan.config.sampling.pages,
                            slots=plan.config.sampling.slots, greedy=greedy)
  return agent_parked.shard_engine_spec(plan.model_config, cfg, shards,
                                        per_shard, plan.prompt_len, env)


def engine_resident(plan: Plan) -> int:
  """Per-chip bytes alive beside the engine's programs (module doc)."""
  copies = (per_chip_bytes(plan.sampler_params())
            if plan.layout.batch_shards > 1 else 0)
  return plan.sampler_resident() + copies


class _Abstract:
  """A row shard's engine arguments as abstract arrays on its devices."""

  def __init__(self, plan: Plan, spec: parked.EngineSpec):
    self.mesh = plan.layout.row_shard(0).mesh
    self.spec = spec
    params = plan.sampler_params()
    self.params = jax.tree.map(lambda x: _on(self.mesh, x), params)
    # The run's pool maker, compiled for its output shardings (a broadcast).
    make = parked_programs.pool_maker(spec, page_pool.pool_dtype(params),
                                      plan.layout.row_shard(0))
    self.pool = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        jax.eval_shape(make), make.lower().compile().output_shardings)
    self.key = _on(self.mesh, jax.eval_shape(lambda: jax.random.key(0)))

  def array(self, shape, dtype) -> jax.ShapeDtypeStruct:
    return _on(self.mesh, jax.ShapeDtypeStruct(shape, dtype))


def decode_program(plan: Plan, spec: parked.EngineSpec,
                   name: str = "engine decode") -> Program:
  """`parked_programs.decode_steps` over the shard's M slots."""
  x = _Abstract(plan, spec)
  M, J, T = spec.slots, spec.table_width, spec.sampling.max_new_tokens
  i32 = lambda *shape: x.array(shape, jnp.int32)
  routes_tlc, routes_dtype = parked_routes.slot_shape(spec.model_config,
                                                     spec.sampling)
  slots = parked_programs.Slots(
      i32(M), i32(M), i32(M), i32(M), i32(M), x.array((M,), jnp.bool_),
      i32(M, J), i32(M, T), x.array((M, T), jnp.float32),
      x.array((M, *routes_tlc), routes_dtype))
  lower = lambda: parked_programs.decode_steps.lower(
      spec, x.params, x.pool, slots, x.key)
  return compile_program(name, M, lower, engine_resident(plan))


def prefill_program(plan: Plan, spec: parked.EngineSpec, rows: int,
                    new_tokens: int, name: str) -> Program:
  """`parked_programs.prefill` of `rows` rows of `new_tokens` new tokens
  each (the call's L: `sampling.bucket`, as `Engine._prefill_pending` pads
  it)."""
  x = _Abstract(plan, spec)
  A, L = rows, sampling.bucket(new_tokens)
  i32 = lambda *shape: x.array(shape, jnp.int32)
  lower = lambda: parked_programs.prefill.lower(
      spec, x.params, x.pool, i32(A, L), i32(A), i32(A),
      i32(A, spec.table_width), i32(A), i32(A), x.key)
  return compile_program(name, A, lower, engine_resident(plan))


def programs(plan: Plan, spec: parked.EngineSpec, prefix: str = "engine"
             ) -> list:
  """(name, build(rows) -> Program, rows) of the engine's programs (module
  doc), named `prefix` decode / prefill / observe; build takes the rows
  (slots, or rows per prefill call) so a search can try fewer."""
  env = plan.run.groups.env
  with_slots = lambda m: dataclasses.replace(spec, slots=m)
  decode, prefill, observe = (f"{prefix} {part}"
                              for part in ("decode", "prefill", "observe"))
  return [
      (decode, lambda m: decode_program(plan, with_slots(m), decode),
       spec.slots),
      (prefill, lambda a: prefill_program(
          plan, spec, a, plan.prompt_len, prefill), spec.slots),
      (observe, lambda a: prefill_program(
          plan, spec, a, env.max_observation_tokens + 1, observe),
       spec.slots),
  ]


def eval_programs(plan: Plan, prompts: int, g: int, greedy: bool
                  ) -> tuple[str, list]:
  """An evaluation call's `prompts` x g episodes on the engine, as
  `evaluation.sample_completions` runs them: (its sizing line, its
  `programs`, named "eval ..." or "eval n=g ...")."""
  prefix = "eval" if greedy else f"eval n={g}"
  spec = engine_spec(plan, prompts * g, greedy)
  return (f"{prefix}: " + describe(plan, spec, prompts * g),
          programs(plan, spec, prefix))


def describe(plan: Plan, spec: parked.EngineSpec, rows: int = 0) -> str:
  """The engine's sizing for `rows` episodes (0: a step's), one line: rows
  per shard, slots, pages, context, pool."""
  c, cfg = spec.model_config, spec.sampling
  env = plan.run.groups.env
  item = page_pool.pool_dtype(plan.sampler_params()).itemsize
  per_column = 2 * c.num_layers * c.num_kv_heads * int8_pages.column_bytes(
      item, cfg.kv_dtype, c.head_dim)
  pool_gib = spec.pages * cfg.page_size * per_column / 1024 ** 3
  heads = plan.layout.row_shard(0).splits("kv_heads", c.num_kv_heads)
  rows = len(agent_parked.shard_rows(rows or step_rows(plan),
                                     plan.layout.batch_shards)[0])
  return (f"parked engine per row shard ({plan.layout.batch_shards} shards of "
          f"{np.prod(plan.layout.row_shard(0).mesh.devices.shape)} chips): "
          f"{rows} rows, {spec.slots} slots, {spec.pages} pages of "
          f"{cfg.page_size} columns ({cfg.kv_dtype or 'compute-dtype'} "
          f"pages, {pool_gib:.2f} GiB, its KV heads split {heads} ways), "
          f"context {spec.context} = prompt {plan.prompt_len} + "
          f"{env.max_turns} turns x {cfg.max_new_tokens} + "
          f"{env.max_turns - 1} observations x {env.max_observation_tokens}; "
          f"{spec.steps_per_call} decode steps per call")

