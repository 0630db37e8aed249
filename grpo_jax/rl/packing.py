"""Sequence packing: several sequences per row of a token budget, isolated by
segment ids, for the RL update and scoring (`rl.packing`) and SFT.

Padded rows [prompt | completion] cost s = p + t tokens each whatever the
completion's length; on long-tailed reasoning lengths most of that is
padding. Packing lays the sequences back to back in rows of s tokens
(`assign_rows`: first fit, a group's longest completions first; SFT packs
by the same rule), so the decoder runs over about the tokens that exist.

Prompts once per group (`group_size` G > 1, `rl.shared_prompt`): a row
holds, for each group in it, the prompt ONCE and then those of its
completions that fit, [prompt_b | c_b1 | c_b2 | ... | prompt_b' | ...]; a
group that does not fit in one row continues in the next with another copy
of the prompt. Segment ids say who sees whom (`transformer.segment_mask`):
segment id = group * SEGMENT_MEMBERS + member, member 0 the prompt, which
every completion of the group sees; a completion sees itself causally, never
a sibling. Positions are the padded row's: prompt 0..p-1, every completion
p..p+c-1. So each completion token's hidden state is exactly its padded
row's, with B·p + Σ c decoder tokens instead of n·s (padded) or B·p + n·t
(`hidden_states_shared_prompt`).

The first token of completion c_b2 is predicted by the prompt's last
column, not by the column before it (c_b1's last token): `pred_rs` names,
for every packed column, the column whose hidden state predicts its token;
the LM head runs on those gathered states (`packed_logprobs`).

The loss stays exact by construction: the log-probs are gathered back into
the padded layout, N sequence slots of t tokens per micro-batch ([N, T],
`src_nt`), and the policy losses, aggregations, KL and rollout correction
run on those as on padded rows (empty slots have mask 0). Only rows with a
loss token are packed, each through its last one: what a masked token's
log-prob would be is never read.

Micro-batches: at most the padded path's rows per micro-batch
(`update.micro_batch_rows`), the packed rows spread evenly over the fewest
micro-batches (`micro_batch_shape`: R rows of s tokens each, rounded to a
few steps so shapes, and compilations, stay few). Host arrays are laid out
strided as the padded path's (`update.micro_batches`: micro-batch m holds
rows m, m+M, ...), so the same scan and the same row sharding apply.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.algorithms import logprobs as logprobs_lib
from grpo_jax.models import transformer
from grpo_jax.models.config import ModelConfig

SEGMENT_MEMBERS = transformer.SEGMENT_MEMBERS


def assign_rows(group_n: Sequence[int], prompt_n: Sequence[int],
                completion_n: Sequence[int], row_len: int,
                pack: bool = True) -> list[list[int]]:
  """Sequences (indices) grouped into rows of at most `row_len` tokens: one
  per row, or (pack) first fit. A sequence costs its prompt and completion,
  or only its completion in a row that already holds its group's prompt;
  it goes to the first row holding that prompt with room for the
  completion, else the first row with room for both, else a new row. The
  sequences of a group are placed longest first (a group is contiguous
  in the input, as rollouts are laid out); singleton groups (SFT) keep
  their order. Within a row, a group's sequences are adjacent, after the
  group's first appearance (so its prompt is written once)."""
  group_n, prompt_n = np.asarray(group_n), np.asarray(prompt_n, np.int64)
  completion_n = np.asarray(completion_n, np.int64)
  n = len(group_n)
  too_long = np.flatnonzero(prompt_n + completion_n > row_len)
  if too_long.size:
    i = too_long[0]
    raise ValueError(f"a sequence of {prompt_n[i] + completion_n[i]} tokens "
                     f"does not fit a row of {row_len}; drop it or raise the "
                     "row length")
  if not pack:
    return [[i] for i in range(n)]
  # Group order (first appearance), longest first inside a group.
  first_seen = {}
  for i in range(n):
    first_seen.setdefault(group_n[i], i)
  order = sorted(range(n), key=lambda i: (first_seen[group_n[i]],
                                          -completion_n[i], i))
  used = np.zeros(n, np.int64)                 # tokens used per row (<= n)
  rows: list[list[int]] = []
  rows_of_group: dict[int, list[int]] = {}
  for i in order:
    g, p, c = group_n[i], prompt_n[i], completion_n[i]
    row = next((r for r in rows_of_group.get(g, ())
                if used[r] + c <= row_len), None)
    if row is None:
      fits = np.flatnonzero(used[:len(rows)] + p + c <= row_len)
      row = int(fits[0]) if fits.size else len(rows)
      if row == len(rows):
        rows.append([])
      rows_of_group.setdefault(g, []).append(row)
      c = p + c
    rows[row].append(int(i))
    used[row] += c
  # A group's sequences adjacent within each row, in order of appearance.
  return [sorted(row, key=lambda i: (first_seen[group_n[i]], i))
          for row in rows]


class PackedRows(NamedTuple):
  """Sequences packed into M micro-batches of R rows of S tokens and N
  sequence slots of T tokens. Row arrays are [R*M, S], slot arrays
  [N*M, T] / [N*M], strided: micro-batch m holds rows (slots) m, m+M, ...
  (`update.micro_batches` splits them). `pred_rs` is a column of the same
  row (rows stay where the batch sharding put them); `src_nt` is flat within
  a micro-batch: its local row r, column j -> r*S + j (a gather of R*S
  scalar log-probs, not of hidden states)."""
  tokens_rs: np.ndarray      # int32
  positions_rs: np.ndarray   # int32: the padded row's positions
  valid_rs: np.ndarray       # bool: real tokens
  segments_rs: np.ndarray    # int32: group * SEGMENT_MEMBERS + member; 0 pad
  pred_rs: np.ndarray        # int32: the column (same row) predicting it
  src_nt: np.ndarray         # int32: slot's completion token t (0: none)
  row_n: np.ndarray          # int32: the padded row slot holds (n: empty)
  # the recorded experts of every token (routing replay), moved as the
  # tokens are; None: not replayed
  routes_rslc: np.ndarray | None = None


def _bucket(n: int) -> int:
  """The next power of two >= n: few distinct shapes, few compiles."""
  return 1 << (max(n, 1) - 1).bit_length()


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


ROW_STEPS = 8   # row counts a micro-batch may take: few shapes, few compiles


def micro_batch_shape(rows: int, rows_per_micro: int, row_multiple: int = 1
                      ) -> tuple[int, int]:
  """(R rows per micro-batch, M micro-batches) for `rows` packed rows: the
  fewest micro-batches of at most `rows_per_micro` rows (rounded up to
  `row_multiple`), the rows spread evenly over them, R rounded up to a step
  of rows_per_micro / ROW_STEPS (a multiple of row_multiple). So fewer
  than one step of empty rows per micro-batch is paid for, and a run
  compiles for at most ROW_STEPS row counts per micro-batch count."""
  most = _round_up(max(rows_per_micro, 1), row_multiple)
  step = _round_up(max(1, most // ROW_STEPS), row_multiple)
  M = max(1, -(-rows // most))
  return _round_up(max(1, -(-rows // M)), step), M


def slot_count(sequences: int, row_multiple: int = 1) -> int:
  """N, the sequence slots of a micro-batch holding at most `sequences`:
  the next power of two (few shapes), a multiple of row_multiple."""
  return _round_up(_bucket(sequences), row_multiple)


def sequence_lengths(valid_ns: np.ndarray, need_nt: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
  """(prompt tokens [n], completion tokens to pack [n]) of padded rows
  [left-padded prompt | completion]: the completion through its last
  `need_nt` token (0: nothing to pack)."""
  T = need_nt.shape[1]
  prompt_n = valid_ns[:, :-T].sum(axis=1)
  need = np.asarray(need_nt) > 0
  last_n = T - np.argmax(need[:, ::-1], axis=1)
  return prompt_n.astype(np.int64), np.where(need.any(axis=1), last_n, 0)


def pack_rows(tokens_ns: np.ndarray, valid_ns: np.ndarray,
              need_nt: np.ndarray, group_size: int, rows_per_micro: int,
              row_multiple: int = 1, routes_nslc: np.ndarray | None = None
              ) -> tuple[PackedRows, int]:
  """Packs padded rows [left-padded prompt (P) | completion (T)] into rows
  of S = P + T tokens, R = `rows_per_micro` (at most) per micro-batch.

  need_nt [n, T]: the completion tokens whose log-probs are needed (the
  loss mask); each row is packed through its last one, rows without any are
  left out. group_size G > 1: rows come in groups of G sharing a prompt,
  which a packed row then holds once (module docstring). row_multiple: R and
  N are multiples of it (the devices the rows are split over). routes_nslc:
  the rows' recorded experts (routing replay), packed with their tokens.
  Returns the rows and M, the number of micro-batches.
  """
  tokens_ns, valid_ns = np.asarray(tokens_ns), np.asarray(valid_ns, bool)
  n, S = tokens_ns.shape
  T = need_nt.shape[1]
  P = S - T
  prompt_n, comp_n = sequence_lengths(valid_ns, need_nt)
  keep = np.flatnonzero(comp_n > 0)
  group_n = np.arange(n) // group_size if group_size > 1 else np.arange(n)
  rows = [[int(keep[j]) for j in row] for row in assign_rows(
      group_n[keep], prompt_n[keep], comp_n[keep], S)]
  R, M = micro_batch_shape(len(rows), rows_per_micro, row_multiple)
  per_micro = [rows[m * R:(m + 1) * R] for m in range(M)]
  N = slot_count(max([sum(map(len, rs)) for rs in per_micro] + [1]),
                 row_multiple)
  out = _empty(M, R, S, N, T, n)
  if routes_nslc is not None:
    routes_nslc = np.asarray(routes_nslc)
    out = out._replace(routes_rslc=np.zeros(
        (R * M, S) + routes_nslc.shape[2:], routes_nslc.dtype))
  for m, micro_rows in enumerate(per_micro):
    slot = 0
    for r, row in enumerate(micro_rows):
      col, last_group, prompt_last, member, gid = 0, None, 0, 0, 0
      for i in row:
        p, c = int(prompt_n[i]), int(comp_n[i])
        if group_n[i] != last_group:        # the group's prompt, once
          last_group, member = group_n[i], 0
          gid += 1
          _put(out, r * M + m, col, tokens_ns[i, P - p:P], np.arange(p),
               gid * SEGMENT_MEMBERS,
               None if routes_nslc is None else routes_nslc[i, P - p:P])
          prompt_last, col = col + p - 1, col + p
        member += 1
        _put(out, r * M + m, col, tokens_ns[i, P:P + c], p + np.arange(c),
             gid * SEGMENT_MEMBERS + member,
             None if routes_nslc is None else routes_nslc[i, P:P + c])
        cols = col + np.arange(c)
        out.pred_rs[r * M + m, col:col + c] = np.concatenate(
            [[prompt_last], cols[:-1]])
        out.src_nt[slot * M + m, :c] = r * S + cols
        out.row_n[slot * M + m] = i
        slot, col = slot + 1, col + c
  return out, M


def _empty(M, R, S, N, T, n) -> PackedRows:
  return PackedRows(np.zeros((R * M, S), np.int32),
                    np.zeros((R * M, S), np.int32),
                    np.zeros((R * M, S), bool), np.zeros((R * M, S), np.int32),
                    np.zeros((R * M, S), np.int32),
                    np.zeros((N * M, T), np.int32), np.full((N * M,), n,
                                                            np.int32))


def _put(out: PackedRows, row, col, tokens, positions, segment, routes=None):
  """One sequence's tokens (and their routes) written into packed row
  `row` from column `col`."""
  end = col + len(tokens)
  if routes is not None:
    out.routes_rslc[row, col:end] = routes
  out.tokens_rs[row, col:end] = tokens
  out.positions_rs[row, col:end] = positions
  out.valid_rs[row, col:end] = True
  out.segments_rs[row, col:end] = segment


def padded_cost(n: int, prompt_len: int, completion_len: int,
                group_size: int) -> int:
  """Decoder tokens the padded path pays for n rows: each group's prompt
  once (group_size > 1, `hidden_states_shared_prompt`) or every row whole."""
  if group_size > 1:
    return n // group_size * prompt_len + n * completion_len
  return n * (prompt_len + completion_len)


def wins(rows: PackedRows, n: int, prompt_len: int, completion_len: int,
         group_size: int) -> bool:
  """rl.packing = auto: pack when the packed rows pay for fewer decoder
  tokens than the padded path (long-tailed lengths); with every completion
  near the cap, one per row, the shared-prompt padded path pays less."""
  return rows.tokens_rs.size < padded_cost(n, prompt_len, completion_len,
                                           group_size)


def packed_tokens(rows: PackedRows) -> int:
  """Real tokens in the packed rows (what the decoder works on, padding
  excluded); the row count times S is what it pays for."""
  return int(rows.valid_rs.sum())


# ----------------------------------------------------------------------------
# Device side: one micro-batch of packed rows -> log-probs in N slots.
# ----------------------------------------------------------------------------

def packed_logprobs(model_config: ModelConfig, params, rows: PackedRows,
                    forward: logprobs_lib.Forward = logprobs_lib.Forward()):
  """log π and entropy of each slot's completion tokens, float32 [N, T],
  from ONE micro-batch of packed rows ([R, S] arrays, `src_nt` [N, T]).
  Entries past a slot's packed length (and empty slots) are garbage that
  the loss mask removes, as the padded path's are.
  forward.constrain pins the activations' shardings as the padded path
  does (`transformer.hidden_states`; `sharding.Layout.constrain`): packed
  rows over the batch axes, and so the predicting states (same row) and the
  slots' log-probs. Only the [R, S] scalar log-probs cross chips (a slot's
  row may live on another), never hidden states. forward.group_size is
  not read: the rows say who shares a prompt (segment ids). Returns the
  log-probs, the entropies and the MoE `transformer.Routed` (None for a
  dense model), replaying `rows.routes_rslc` where given."""
  constrain = forward.constrain
  routes = rows.routes_rslc
  h_rsd, routed = transformer.hidden_states_routed(
      model_config, params, rows.tokens_rs, rows.positions_rs, rows.valid_rs,
      rows.segments_rs, forward.settings,
      None if routes is None else jnp.moveaxis(routes, 2, 0))
  if constrain is not None:     # the gather and the head read whole rows
    h_rsd = constrain(h_rsd, ("batch", None, None))
  h_pred = jnp.take_along_axis(h_rsd, rows.pred_rs[..., None], axis=1)
  if constrain is not None:
    h_pred = constrain(h_pred, ("batch", None, None))
  logp_rs, entropy_rs = logprobs_lib.token_logprobs(
      model_config, params, h_pred, rows.tokens_rs,
      chunk_size=forward.chunk_size, temperature=forward.temperature)
  take = lambda x: jnp.take(x.reshape(-1), rows.src_nt, axis=0)
  logp_nt, entropy_nt = take(logp_rs), take(entropy_rs)
  if constrain is not None:
    logp_nt = constrain(logp_nt, ("batch", None))
    entropy_nt = constrain(entropy_nt, ("batch", None))
  return logp_nt, entropy_nt, routed


def gather_slots(x_n: jax.Array, row_n: jax.Array) -> jax.Array:
  """Padded-row values [n, ...] -> slot values [N, ...] (0 in empty slots,
  whose row index is n)."""
  return jnp.take(x_n, row_n, axis=0, mode="fill", fill_value=0)


def scatter_slots(x_slots: jax.Array, row_n: jax.Array, n: int) -> jax.Array:
  """Slot values [N, ...] -> padded rows [n, ...] (0 in rows not packed)."""
  out = jnp.zeros((n, *x_slots.shape[1:]), x_slots.dtype)
  return out.at[row_n].set(x_slots, mode="drop")


def describe(rows: PackedRows, n: int) -> dict[str, float]:
  """How much packing saved: decoder tokens paid for, packed / padded, and
  the packed rows' fill."""
  paid = rows.tokens_rs.size
  return {"pack/token_ratio": paid / max(n * rows.tokens_rs.shape[1], 1),
          "pack/fill": packed_tokens(rows) / max(paid, 1)}
