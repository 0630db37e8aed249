"""Mesh, logical-axis rules and placement: one code path from 1 CPU to a pod.

The model names logical axes only (`transformer.param_axes`); the config maps
them to mesh axes (`config.mesh.rules`, MaxText-style), so a parallelism plan
is a config change, not a code change. With the default rules:

  data    batch rows; parameters replicated (plain data parallelism)
  fsdp    batch rows AND the `embed` dimension of every weight (ZeRO-3: each
          layer's weights are all-gathered where used, gradients
          reduce-scattered, optimizer state stays sharded)
  tensor  query/KV heads, MLP and vocabulary dimensions (Megatron-style)

A mesh axis that does not divide a dimension is dropped for that dimension
(logged once): e.g. 2 KV heads on tensor=4 stay replicated while the 4 query
heads are split.

Placement is by committed input shardings: parameters, optimizer state and
batches are `NamedSharding`ed global arrays, so the jitted sampler and update
run SPMD over the mesh without a mesh context. Policy and reference are two
parameter trees with the same shardings on the same mesh. The sampler
splits its rows (prompts, tokens, KV cache) like a batch and the cache's KV
heads like the parameters' (`Layout.constrain` inside its jit).

Multi-host (SPMD, every host runs the same program): the processes are
joined before any other JAX call (`harness.distributed`). Each host samples its own
rows; `to_host` all-gathers them, so every host scores the same rollout
(rewards work on strings); each then hands over only the rows its devices own
(`host_rows`), and `global_rows` assembles the global batch with
`jax.make_array_from_process_local_data`. Host-side files (metrics, plots,
the run record) are written by process 0 only (`metrics.is_primary`).

Modules: `mesh` (the device mesh), `rules` (logical-axis rules and the
shardings they give), `placement` (putting arrays on them, the multi-host
row helpers, `Layout`); their public names are importable from here.
"""
from __future__ import annotations

from grpo_jax.sharding.mesh import chip_grid, make_mesh, mesh_shape, strided_mesh
from grpo_jax.sharding.placement import (
                                    Layout,
                                    copy_tree,
                                    global_rows,
                                    host_rows,
                                    put,
                                    put_rows,
                                    shard_params,
                                    to_host,
)
from grpo_jax.sharding.rules import (
                                    BATCH,
                                    LENGTH,
                                    Params,
                                    Rules,
                                    batch_sharding,
                                    logical_rules,
                                    opt_state_shardings,
                                    param_shardings,
                                    param_specs,
                                    spec_for,
                                    state_shardings,
)
