"""Multi-turn episodes on the parked engine (`env.engine = "parked"`,
docs/agents.md "Rows that wait").

The per-turn path (`agent.run_episodes`) samples a turn for the whole batch,
re-prefills each row's history and waits for the batch's slowest tool. Here
each row goes its own way through `parked.Engine`:

    admit -> decode its turn -> park (slot freed, pages kept) -> its tool
    runs in a thread while the other rows decode -> the observation is
    appended and the row admitted again (only the turn's last id and the
    observation are prefilled) ... -> the episode ends: pages released

The host loop: admit whatever rows are ready (FIFO) while slots and pages
last; one engine step (a device call of at most env.engine_steps decode
steps, left as soon as a turn ends); the ended turns to the env's step in
the worker pool; the observations that are back (or past
env.tool_timeout_s: a time-out observation) make their rows ready. With
nothing decoding, it blocks on the first tool to answer. If the head of the
ready queue cannot get its pages while nothing decodes, the youngest other
rows' pages are released (they are recomputed from their first token at
admission), so some row always proceeds. Budgets per row are the per-turn
path's: env.max_turns turns of at most sampling.max_new_tokens, observations
of at most env.max_observation_tokens, env.tool_timeout_s per call, so a row
stays within its prompt + `EnvSpec.trajectory_tokens` columns.

Row i's turn k draws its noise as number i * max_turns + k (`parked`): an
episode depends on the key and the weights, never on the tools' timing.

Recording routes (`sampling.record_routes`, MoE routing replay): a row
whose episode ended is admitted once more for a turn of one token, which
feeds its last token (its sample is dropped); its routes, every column's
(`parked.Engine.routes`), go to `Row.routes`, then its pages are released.
"""
from __future__ import annotations

import collections
import concurrent.futures
import time

import jax

from grpo_jax.envs import base
from grpo_jax.errors import ConfigError
from grpo_jax.generate import agent, parked, sampling


def check_hosts(field: str = "'env.engine' = 'parked'",
                fix: str = "use env.engine='turns' (any mesh)") -> None:
  """The host loops (episodes', partial rollouts' stream) read and write
  each row shard's slots: every device of the sampler mesh must be this
  process's (one host)."""
  if jax.process_count() > 1:
    raise ConfigError(
        f"config field {field} runs on one host; this run has "
        f"{jax.process_count()} processes: {fix}")


def shard_rows(n: int, shards: int) -> list[range]:
  """Rows 0..n-1 over the row shards in blocks, as the sampler splits rows
  (a group's rows together)."""
  per = -(-n // shards)
  return [range(r * per, min(n, (r + 1) * per)) for r in range(shards)]


def engine_spec(sampler: sampling.Sampler, rows: int, prompt_len: int,
                spec: base.EnvSpec) -> parked.EngineSpec:
  """The engine of one row shard's `rows` rows (`shard_engine_spec`)."""
  return shard_engine_spec(sampler.model_config, sampler.sampling,
                           sampler.shards, rows, prompt_len, spec)


def shard_engine_spec(model_config, cfg: sampling.SamplingConfig,
                      shards: int, rows: int, prompt_len: int,
                      spec: base.EnvSpec) -> parked.EngineSpec:
  """The engine of one of `shards` row shards holding `rows` episodes: a
  row's context its prompt plus its trajectory budget, parked rows keeping
  their pages (`pool_spec`). The run's and aot's (`aot/engine.py`) one
  sizing."""
  context = prompt_len + spec.trajectory_tokens(cfg.max_new_tokens)
  return pool_spec(model_config, cfg, shards, rows, context,
                   spec.engine_steps)


def pool_spec(model_config, cfg: sampling.SamplingConfig, shards: int,
              rows: int, context: int, steps_per_call: int = 16,
              parked_hold_pages: bool = True) -> parked.EngineSpec:
  """The engine of one of `shards` row shards holding `rows` rows of at
  most `context` columns: sampling.slots slots over the row shards (0: one
  per row), sampling.pages pages per shard (0: a whole context for each
  row that can hold pages, so no row waits for them: every row where
  parked rows keep theirs (episodes), each slot where rows give theirs
  back when they leave one (partial rollouts' stream))."""
  slots = min(-(-cfg.slots // shards) or rows, rows)
  holders = rows if parked_hold_pages else slots
  pages = cfg.pages or holders * -(-context // cfg.page_size)
  return parked.EngineSpec(model_config, cfg, slots, pages, context,
                           steps_per_call)


def engines(sampler: sampling.Sampler, params, key, espec: parked.EngineSpec
            ) -> list[parked.Engine]:
  """An engine per row shard, its pool and a copy of the weights on the
  shard's devices (`Layout.row_shard`; weights split over the batch axes,
  fsdp, are gathered whole on each shard; the pool's KV heads split as the
  weights' heads are), and the key too (a run's step key lives on the
  whole mesh)."""
  if sampler.shards == 1:
    return [parked.Engine(espec, params, key, sampler.layout)]
  out = []
  for r in range(sampler.shards):
    shard = sampler.layout.row_shard(r)
    out.append(parked.Engine(espec, shard.place_like(params),
                             shard.place_like(key), shard))
  return out


class _Tools:
  """The env steps in flight: a worker pool, each call's row and deadline."""

  def __init__(self, workers: int, timeout_s: float):
    self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers)
    self.timeout_s = timeout_s
    self.calls: dict = {}          # future -> (parked row, deadline)

  def submit(self, env: base.Env, text: str, ids: list, row: parked.Parked):
    deadline = time.monotonic() + self.timeout_s + agent.GRACE_S
    self.calls[self.pool.submit(_step, env, text, ids)] = (row, deadline)

  def answered(self, block: bool) -> list:
    """(row, result) of the calls done or past their deadline (a result
    that came back after it, while the host was busy, is a time-out too);
    block: wait for the first of them."""
    if block and self.calls:
      first = min(d for _, d in self.calls.values())
      concurrent.futures.wait(
          self.calls, timeout=max(0.0, first - time.monotonic()),
          return_when=concurrent.futures.FIRST_COMPLETED)
    now, out = time.monotonic(), []
    late = base.tool_error(f"timed out after {self.timeout_s:g} s")
    for future, (row, deadline) in list(self.calls.items()):
      if future.done():
        result, at = future.result()
        out.append((row, result if at <= deadline else late))
      elif now >= deadline:
        out.append((row, late))
      else:
        continue
      del self.calls[future]
    return out


def _step(env: base.Env, text: str, ids: list) -> tuple:
  """env.step (an exception: a tool error) and when it returned."""
  try:
    result = env.step(text, ids)
  except Exception as e:  # pylint: disable=broad-except
    result = base.tool_error(type(e).__name__)
  return result, time.monotonic()


def _share(engine: parked.Engine, held: parked.Parked,
           ready: collections.deque) -> None:
  """`held` was just admitted to prefill all its tokens: each waiting row
  with the same tokens and nothing cached (a fresh row of its group, whose
  prompt is held's) takes held's full pages before its last token
  (`Engine.share`) and comes in with them cached: only its tail is
  prefilled."""
  count = (len(held.tokens) - 1) // engine.spec.sampling.page_size
  if not count:
    return
  for i, r in enumerate(ready):
    if not r.cached and not r.pages and r.tokens == held.tokens:
      ready[i] = r._replace(cached=count * engine.spec.sampling.page_size,
                            pages=engine.share(held, count))


def _make_room(engine: parked.Engine, ready: collections.deque,
               tools: _Tools) -> int:
  """Nothing decodes and the head of `ready` cannot get its pages: release
  the pages of the other waiting rows, youngest (highest id) first, until
  it can. Returns how many rows were released."""
  head = ready[0]
  holders = sorted([r for r in list(ready)[1:] if r.pages]
                   + [r for r, _ in tools.calls.values() if r.pages],
                   key=lambda r: -r.row)
  released = 0
  for r in holders:
    if engine.free_pages >= engine.spec.table_width - len(head.pages):
      break
    released += 1
    _replace_row(ready, tools, r, engine.release(r))
  return released


def _replace_row(ready, tools, old: parked.Parked, new: parked.Parked):
  for i, r in enumerate(ready):
    if r is old:
      ready[i] = new
      return
  for future, (r, deadline) in tools.calls.items():
    if r is old:
      tools.calls[future] = (new, deadline)
      return


def run_episodes(sampler: sampling.Sampler, params, tokenizer, examples, key,
                 num_generations: int, spec: base.EnvSpec,
                 system_prompt: str = "", batch_multiple: int = 1,
                 stats: dict | None = None, share_prompts: bool = True
                 ) -> agent.Episodes:
  """`agent.run_episodes` on the parked engine (module docstring): the same
  Episodes. Rows split over the sampler's row shards (`shard_rows`), each
  shard's rows on its own engine, the shards' host loops in threads (a
  device call releases the GIL). stats (a dict): the engines' `parked.Stats`
  and the rows released for room, summed over the shards, filled in.
  share_prompts: a row admitted with its whole history to prefill lends
  its full pages to the waiting rows of the same tokens (a group's G rows:
  `_share`); False: each prefills its own (what sharing saves)."""
  del batch_multiple      # the engine's shapes do not depend on the batch
  cfg = sampler.sampling
  check_hosts()
  turns = agent.ToolTurns.of(tokenizer, cfg.stop_ids)
  rows, texts, prompt_ids = agent.start_rows(tokenizer, examples,
                                             num_generations, spec,
                                             system_prompt)
  parts = [p for p in shard_rows(len(rows), sampler.shards) if len(p)]
  espec = engine_spec(sampler, len(parts[0]), max(map(len, prompt_ids)), spec)
  run = lambda engine, part: _run_shard(engine, rows, part, turns, tokenizer,
                                        spec, share_prompts)
  shard_engines = engines(sampler, params, key, espec)[:len(parts)]
  with concurrent.futures.ThreadPoolExecutor(len(parts)) as pool:
    released = sum(pool.map(run, shard_engines, parts))
  if stats is not None:
    total = lambda f: sum(f(e) for e in shard_engines)
    stats.update({k: total(lambda e, k=k: getattr(e.stats, k))
                  for k in parked.Stats._fields},
                 released=released, free_pages=total(lambda e: e.free_pages),
                 pages=total(lambda e: e.spec.pages))
  T = spec.trajectory_tokens(cfg.max_new_tokens)
  return agent.collect(rows, prompt_ids, texts, T, cfg.pad_id)


def _run_shard(engine: parked.Engine, rows: list, part: range,
               turns: agent.ToolTurns, tokenizer, spec: base.EnvSpec,
               share: bool) -> int:
  """The host loop of one shard's rows (module docstring); returns how
  many rows were released for room."""
  cfg = engine.spec.sampling
  ready = collections.deque(parked.Parked(i, tuple(rows[i].history))
                            for i in part)
  tools = _Tools(len(part), spec.tool_timeout_s)
  finished, released = 0, 0
  feeding = set()            # ended rows admitted to feed their last token

  def end(p: parked.Parked) -> int:
    if cfg.record_routes and p.row not in feeding:
      feeding.add(p.row)
      ready.append(p)
      return 0
    engine.release(p)
    return 1

  try:
    while finished < len(part):
      while ready:
        held = engine.admit(
            ready[0], ready[0].row * spec.max_turns + rows[ready[0].row].turns,
            1 if ready[0].row in feeding else cfg.max_new_tokens)
        if held is None:
          break
        if not ready.popleft().cached and share:
          _share(engine, held, ready)
      if ready and not engine.busy:
        freed = _make_room(engine, ready, tools)
        if not freed:
          raise RuntimeError(f"row {ready[0].row} cannot get its pages in an "
                             "idle engine")
        released += freed
        continue
      for turn in engine.step():
        row = rows[turn.row]
        if turn.row in feeding:          # its last token fed: its routes
          row.routes = engine.routes(turn.parked)
          finished += end(turn.parked)
          continue
        text = agent.take_turn(row, tokenizer, turn.ids, turn.logp,
                               not turn.stopped)
        if text is None:
          finished += end(turn.parked)
        else:
          tools.submit(row.env, text, turn.ids, turn.parked)
      for p, result in tools.answered(block=not engine.busy and not ready):
        if agent.take_result(rows[p.row], result, turns, tokenizer, spec):
          ready.append(p._replace(tokens=tuple(rows[p.row].history)))
        else:
          finished += end(p)
  finally:
    tools.pool.shutdown(wait=False, cancel_futures=True)
  return released


def metrics(stats: dict) -> dict[str, float]:
  """The engine's counters as "env/engine_..." metrics."""
  return {f"env/engine_{k}": float(v) for k, v in stats.items()}
