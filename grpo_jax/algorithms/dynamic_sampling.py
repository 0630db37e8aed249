"""DAPO dynamic sampling and overlong filtering: host-side numpy helpers.

A generation batch is a NamedTuple (`rollout.Groups`) or a dict of numpy
arrays that all have the group axis first: `reward_bg` [b, g] plus whatever
the trainer carries along (completion ids [b, g, t], old log-probs, masks,
...; reshape the sampler's [b*g, ...] to [b, g, ...]). Dynamic sampling keeps the groups whose
rewards differ (DAPO eq. 8: 0 < #correct < G), and draws further generation
batches until `num_groups` groups are kept, at most `max_gen_batches` of them.

When the cap is hit with fewer than `num_groups` kept (`on_cap`):
  "fill"   (default) top up with groups that have no signal, marked in
           info["filler_b"], so the batch keeps its static shape (no
           recompile). Their GRPO advantages are 0; the trainer should also
           zero their loss mask (`mask_bgt & ~filler_b[:, None, None]`) so
           they do not dilute the token-mean normaliser.
  "fewer"  return only the kept groups (a smaller batch: a new jit shape).
  "raise"  raise RuntimeError (verl's behaviour).
Either way a warning is logged and info["dynamic/cap_hit"] is 1.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np

Batch = Any   # a NamedTuple or dict of arrays, each [b, ...]
ON_CAP = ("fill", "fewer", "raise")


def group_has_signal(reward_bg: np.ndarray) -> np.ndarray:
  """bool [B]: the group's rewards are not all equal (std > 0); for 0/1
  rewards, 0 < #correct < G (DAPO eq. 8). Exact: no float std threshold."""
  reward_bg = np.asarray(reward_bg)
  return reward_bg.max(axis=1) > reward_bg.min(axis=1)


def _map(fn: Callable, *batches: Batch) -> Batch:
  """fn over each field of same-typed batches (dicts or NamedTuples); an
  optional field that is None (e.g. `Groups.observation_bgt` without an
  env) stays None."""
  one = lambda *values: None if values[0] is None else fn(*values)
  if isinstance(batches[0], Mapping):
    return {key: one(*(b[key] for b in batches)) for key in batches[0]}
  return type(batches[0])(*(one(*values) for values in zip(*batches)))


def _field(batch: Batch, key: str) -> np.ndarray:
  return batch[key] if isinstance(batch, Mapping) else getattr(batch, key)


def select_groups(batch: Batch, keep_b: np.ndarray) -> Batch:
  """The groups where keep_b is True (a bool mask or indices), every field."""
  return _map(lambda value: value[keep_b], batch)


def filter_groups(batch: Batch, reward_key: str = "reward_bg"
                  ) -> tuple[Batch, Batch]:
  """Splits a generation batch into (groups with signal, groups without)."""
  keep_b = group_has_signal(_field(batch, reward_key))
  return select_groups(batch, keep_b), select_groups(batch, ~keep_b)


def _concat(batches: list[Batch]) -> Batch:
  return _map(lambda *values: np.concatenate(values), *batches)


def _num_groups(batch: Batch) -> int:
  return len(next(iter(batch.values())) if isinstance(batch, Mapping)
             else batch[0])


class GroupAccumulator(NamedTuple):
  """What the generation batches so far have given (immutable)."""
  kept: tuple[Batch, ...] = ()        # groups with signal, in order
  dropped: tuple[Batch, ...] = ()     # groups without signal, for "fill"
  num_gen_batches: int = 0
  num_groups_seen: int = 0


def add_generation_batch(acc: GroupAccumulator, batch: Batch,
                         reward_key: str = "reward_bg") -> GroupAccumulator:
  """A new accumulator with one more generation batch filtered into it."""
  kept, dropped = filter_groups(batch, reward_key)
  return GroupAccumulator(acc.kept + (kept,), acc.dropped + (dropped,),
                          acc.num_gen_batches + 1,
                          acc.num_groups_seen + _num_groups(batch))


def num_kept(acc: GroupAccumulator) -> int:
  return sum(_num_groups(b) for b in acc.kept)


def take_groups(acc: GroupAccumulator, num_groups: int, *,
                on_cap: str = "fill") -> tuple[Batch, dict]:
  """The first `num_groups` kept groups (surplus discarded, as DAPO does);
  when too few were kept, applies `on_cap` (module docstring). Returns
  (batch, info) with info["filler_b"] bool [len(batch)] and the kept fraction."""
  if on_cap not in ON_CAP:
    raise ValueError(f"on_cap={on_cap!r}; allowed: {ON_CAP}")
  if not acc.kept:
    raise ValueError("take_groups on an empty accumulator: add a batch first")
  kept = _concat(list(acc.kept))
  short = num_groups - _num_groups(kept)
  batch = select_groups(kept, slice(0, num_groups))
  if short > 0:
    logging.warning("dynamic sampling: %d of %d groups kept after %d "
                    "generation batches (cap); on_cap=%s",
                    num_groups - short, num_groups, acc.num_gen_batches, on_cap)
    if on_cap == "raise":
      raise RuntimeError(f"dynamic sampling kept {num_groups - short} < "
                         f"{num_groups} groups in {acc.num_gen_batches} "
                         f"generation batches")
  filler = select_groups(_concat(list(acc.dropped)), slice(0, max(short, 0)))
  if on_cap == "fill" and short > 0:
    batch = _concat([batch, filler])
  num_real = min(num_groups, num_kept(acc))
  info = {"filler_b": np.arange(_num_groups(batch)) >= num_real,
          "dynamic/kept_fraction": num_kept(acc) / max(acc.num_groups_seen, 1),
          "dynamic/num_gen_batches": acc.num_gen_batches,
          "dynamic/num_filler": _num_groups(batch) - num_real,
          "dynamic/cap_hit": int(short > 0)}
  return batch, info


def sample_until_full(generate: Callable[[int], Batch], num_groups: int, *,
                      max_gen_batches: int, on_cap: str = "fill",
                      reward_key: str = "reward_bg") -> tuple[Batch, dict]:
  """Calls generate(i) for i = 0, 1, ... (each a scored generation batch)
  until `num_groups` groups with signal are kept or `max_gen_batches` were
  drawn, then `take_groups`. Returns exactly num_groups groups unless
  on_cap="fewer" (or the cap let fewer than num_groups groups be seen).
  info["dynamic/kept_fraction"] = groups with signal / groups generated."""
  if max_gen_batches < 1:
    raise ValueError(f"max_gen_batches={max_gen_batches}; allowed: >= 1")
  acc = GroupAccumulator()
  while wants_more(acc, num_groups, max_gen_batches):
    acc = add_generation_batch(acc, generate(acc.num_gen_batches), reward_key)
  return take_groups(acc, num_groups, on_cap=on_cap)


def wants_more(acc: GroupAccumulator, num_groups: int,
               max_gen_batches: int) -> bool:
  """Whether one more generation batch is drawn: fewer than `num_groups`
  groups kept and fewer than `max_gen_batches` drawn (the one rule of
  `sample_until_full` and of partial rollouts' refills)."""
  return num_kept(acc) < num_groups and acc.num_gen_batches < max_gen_batches


def overlong_filter(mask_nt, truncated_n):
  """DAPO overlong filtering: completions cut at the length limit get mask 0
  (no gradient). mask_nt [N, T] bool or float; truncated_n [N] bool or 0/1.
  Works on numpy and jax arrays alike (and under jit)."""
  return mask_nt * (truncated_n[:, None] == 0)
