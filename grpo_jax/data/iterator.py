"""A deterministic, resumable batch iterator with per-host slices.

Epoch e visits the N examples in the order `permutation(N)` drawn from
`np.random.default_rng([seed, e])` (0..N-1 when not shuffled). Global batch k
of an epoch is positions [k*B, (k+1)*B) of that order; the last N mod B
examples of each epoch are skipped (a new order next epoch covers them).
Host i of n receives the i-th of n equal slices of every global batch, so the
union of the hosts' batches is exactly the one-host batch, and only the
examples a host serves are ever indexed (a lazy source such as
`read_tfds` then reads only that host's records).

The state (seed, epoch, position) is the same on every host and does not
depend on the host count: a run can resume on a different number of hosts.

    it = BatchIterator(examples, global_batch_size=64, seed=0,
                       host_index=jax.process_index(), host_count=jax.process_count())
    batch = next(it)                      # 64 // host_count Examples
    saved = it.state_dict()               # a small dict of ints, for the checkpoint
    it = BatchIterator.from_state(examples, saved, host_index=..., host_count=...)
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from grpo_jax.data.example import Example


class BatchIterator:
  """Infinite iterator of per-host batches (lists of Examples); see the module doc."""

  def __init__(self, examples: Sequence[Example], global_batch_size: int, seed: int = 0,
               shuffle: bool = True, host_index: int = 0, host_count: int = 1):
    """An iterator at the start of epoch 0 (`from_state` resumes one)."""
    if global_batch_size < 1 or global_batch_size % host_count:
      raise ValueError(f"global_batch_size {global_batch_size} must be a positive multiple "
                       f"of host_count {host_count}")
    if not 0 <= host_index < host_count:
      raise ValueError(f"host_index {host_index} not in [0, {host_count})")
    if len(examples) < global_batch_size:
      raise ValueError(f"{len(examples)} examples cannot fill one batch of {global_batch_size}")
    self._examples, self._batch = examples, global_batch_size
    self._seed, self._shuffle = seed, shuffle
    self._host_index, self._host_count = host_index, host_count
    self._epoch, self._position = 0, 0
    self._order, self._order_epoch = None, None

  @property
  def batches_per_epoch(self) -> int:
    return len(self._examples) // self._batch

  def _epoch_order(self) -> np.ndarray:
    """The visiting order of the current epoch (computed once per epoch)."""
    if self._order_epoch != self._epoch:
      size = len(self._examples)
      self._order = (np.random.default_rng([self._seed, self._epoch]).permutation(size)
                     if self._shuffle else np.arange(size))
      self._order_epoch = self._epoch
    return self._order

  def __iter__(self) -> "BatchIterator":
    return self

  def __next__(self) -> list[Example]:
    if self._position >= self.batches_per_epoch:
      self._epoch, self._position = self._epoch + 1, 0
    local = self._batch // self._host_count
    start = self._position * self._batch + self._host_index * local
    indices = self._epoch_order()[start:start + local]
    self._position += 1
    return [self._examples[int(i)] for i in indices]

  def state_dict(self) -> dict[str, Any]:
    """Where the iterator is: enough, with the same examples, to resume exactly."""
    return {"seed": self._seed, "shuffle": self._shuffle, "epoch": self._epoch,
            "position": self._position, "global_batch_size": self._batch,
            "num_examples": len(self._examples)}

  @classmethod
  def from_state(cls, examples: Sequence[Example], state: dict[str, Any],
                 host_index: int = 0, host_count: int = 1) -> "BatchIterator":
    """An iterator that continues from `state` (from `state_dict`) over `examples`."""
    if state["num_examples"] != len(examples):
      raise ValueError(f"the checkpoint's data iterator ran over {state['num_examples']} "
                       f"examples, the training data now has {len(examples)}: not the "
                       "same data set. data.source / data.kwargs (or the data file) changed since "
                       "the checkpoint. Resume with the original data, or start a "
                       "fresh --workdir.")
    it = cls(examples, state["global_batch_size"], seed=state["seed"],
             shuffle=state["shuffle"], host_index=host_index, host_count=host_count)
    it._epoch, it._position = state["epoch"], state["position"]
    return it
