"""Multi-turn episodes with an env (docs/agents.md): token-in, token-out.

A trajectory is one token sequence after its prompt:

    y_1  o_1  y_2  o_2 ... y_K        y_k: turn k's ids exactly as sampled
                                      (stop included); o_k: the env's
                                      observation, wrapped in the chat
                                      template's tool-turn markers

Model text is never detokenised and re-tokenised into it: a turn's ids go
in as sampled, an observation's as tokenised once here (`ToolTurns`).
`action` marks the y tokens (the loss, KL, entropy and every token count
read only those), `observation` the o tokens (attended to, never trained).

This is the per-turn path: each turn is one sampler call over the live
rows, their whole history as the prompt, and the turn waits for the
slowest tool of the batch (any sampler serves it). The tools of a turn run
at once in threads, each bounded by env.tool_timeout_s: a tool that fails
or overruns is an observation (`base.tool_error`), never a crash.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import NamedTuple, Sequence

import jax
import numpy as np

from grpo_jax import sharding
from grpo_jax.data import templates
from grpo_jax.envs import base
from grpo_jax.errors import ConfigError
from grpo_jax.generate import sampling

GRACE_S = 1.0     # beyond tool_timeout_s: a tool's own time-out answers first
_A, _O = "\x01A\x01", "\x01O\x01"      # placeholders located in the template


@dataclasses.dataclass(frozen=True)
class ToolTurns:
  """The chat template's tool turn as ids: what follows a model turn's stop
  token up to the observation (`prefix`), and what follows the observation
  up to the next assistant turn (`suffix`), each tokenised once."""
  prefix: tuple[int, ...]
  suffix: tuple[int, ...]

  @classmethod
  def of(cls, tokenizer, stop_ids: Sequence[int]) -> "ToolTurns":
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "u"}, {"role": "assistant", "content": _A},
         {"role": "tool", "content": _O}], add_generation_prompt=True)
    if _A not in text or _O not in text:
      raise ConfigError("config field 'env.name': the tokenizer's chat "
                        "template does not render a 'tool' message")
    between, suffix = text.split(_A, 1)[1].split(_O, 1)
    for stop in stop_ids:   # the sampled turn already ends with its stop
      stop_text = tokenizer.decode([stop])
      if stop_text and between.startswith(stop_text):
        between = between[len(stop_text):]
        break
    return cls(tuple(tokenizer.encode(between)), tuple(tokenizer.encode(suffix)))

  def wrap(self, tokenizer, text: str, max_tokens: int) -> list[int]:
    """An observation's ids: the markers around its text, the text cut to
    fit `max_tokens` in all."""
    room = max_tokens - len(self.prefix) - len(self.suffix)
    if room < 1:
      raise ConfigError(
          f"config field 'env.max_observation_tokens' = {max_tokens} leaves "
          f"no room inside the tool-turn markers "
          f"({len(self.prefix) + len(self.suffix)} tokens)")
    return [*self.prefix, *tokenizer.encode(text)[:room], *self.suffix]


class Episodes(NamedTuple):
  """n = b*g finished episodes as fixed-shape host arrays [n, t] (t =
  `EnvSpec.trajectory_tokens`), plus what scoring and the metrics read."""
  prompt_ids: list                # [b] the prompts' ids (tuples)
  prompt_texts: list              # [b] the rendered prompts
  tokens_nt: np.ndarray           # int32, pad after the trajectory
  logp_nt: np.ndarray             # float32 sampler log-probs (0 off y)
  action_nt: np.ndarray           # bool: model-turn tokens (stops included)
  observation_nt: np.ndarray      # bool: observation tokens and markers
  length_n: np.ndarray            # int32 trajectory tokens
  truncated_n: np.ndarray         # bool: the last turn has no stop
  final_texts: list               # [n] the last turn's text (the answer)
  env_reward_n: np.ndarray        # float32 sum of the steps' reward terms
  turns_n: np.ndarray             # int32 model turns
  tool_calls_n: np.ndarray        # int32 observations
  tool_errors_n: np.ndarray       # int32 observations that are errors
  # record_routes: each row's prompt's experts [n] of [p, l, c] and its
  # trajectory's [n, t, l, c] (`Row.routes`); else None
  prompt_routes_n: list | None = None
  routes_ntlc: np.ndarray | None = None


@dataclasses.dataclass
class Row:
  """One episode's host bookkeeping."""
  env: base.Env
  history: list        # prompt + trajectory ids: the next turn's prompt
  tokens: list = dataclasses.field(default_factory=list)
  logp: list = dataclasses.field(default_factory=list)
  action: list = dataclasses.field(default_factory=list)
  final_text: str = ""
  truncated: bool = False
  env_reward: float = 0.0
  turns: int = 0
  tool_calls: int = 0
  tool_errors: int = 0
  # record_routes: the experts of history's every column from the row's
  # latest sampler call (its prompt's from the prefill, the turn's from
  # the decode), [len(history), l, c] after its turn
  routes: np.ndarray | None = None

  def add_turn(self, ids, logp, text: str, truncated: bool) -> None:
    self.tokens += ids
    self.logp += logp
    self.action += [True] * len(ids)
    self.history += ids
    self.final_text, self.truncated = text, truncated
    self.turns += 1

  def add_observation(self, ids) -> None:
    self.tokens += ids
    self.logp += [0.0] * len(ids)
    self.action += [False] * len(ids)
    self.history += ids
    self.tool_calls += 1


def run_tools(calls, timeout_s: float) -> list[base.StepResult]:
  """env.step(text, ids) of each call at once, in threads; a step that
  raises or is not back within timeout_s is a tool error."""
  pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(calls)))
  try:
    futures = [pool.submit(env.step, text, ids) for env, text, ids in calls]
    deadline = time.monotonic() + timeout_s + GRACE_S
    return [tool_result(f, deadline, timeout_s) for f in futures]
  finally:
    pool.shutdown(wait=False, cancel_futures=True)


def tool_result(future, deadline: float, timeout_s: float) -> base.StepResult:
  """A step's future by its deadline: its result, or a tool error."""
  try:
    return future.result(timeout=max(0.0, deadline - time.monotonic()))
  except concurrent.futures.TimeoutError:
    return base.tool_error(f"timed out after {timeout_s:g} s")
  except Exception as e:  # pylint: disable=broad-except
    return base.tool_error(type(e).__name__)


def take_turn(row: Row, tokenizer, ids: list, logp: list, truncated: bool
              ) -> str | None:
  """A finished turn into the row; its text (without the stop) for the
  env's step, or None where it has no stop (the episode ends truncated)."""
  text = tokenizer.decode(ids[:len(ids) - (not truncated)],
                          skip_special_tokens=True)
  row.add_turn(ids, logp, text, truncated)
  return None if truncated else text


def take_result(row: Row, result: base.StepResult, turns: ToolTurns,
                tokenizer, spec: base.EnvSpec) -> bool:
  """The env's answer into the row: its reward term, and the observation's
  ids unless the episode ends (Done, or no turn left). True: it goes on."""
  row.env_reward += float(result.reward)
  if isinstance(result, base.Done) or row.turns >= spec.max_turns:
    return False
  row.tool_errors += bool(result.error)
  row.add_observation(turns.wrap(tokenizer, result.text,
                                 spec.max_observation_tokens))
  return True


def render_prompts(tokenizer, envs: Sequence[base.Env], examples,
                   system_prompt: str) -> list[str]:
  """Each example's first messages (its env's), after the system prompt,
  through the chat template."""
  system = [{"role": "system", "content": system_prompt}] if system_prompt else []
  return [templates.render_prompt([*system, *env.initial_messages(e)], tokenizer)
          for env, e in zip(envs, examples)]


def start_rows(tokenizer, examples, G: int, spec: base.EnvSpec,
               system_prompt: str) -> tuple:
  """G fresh episodes per example, each with its env and its prompt as its
  history: (rows [n], rendered prompts [b], prompt ids [b] as tuples)."""
  rows = [Row(spec.make(), []) for _ in range(len(examples) * G)]
  texts = render_prompts(tokenizer, [r.env for r in rows[::G]], examples,
                         system_prompt)
  prompt_ids = [tuple(p) for p in tokenizer.encode_batch(texts)]
  for i, row in enumerate(rows):
    row.history = list(prompt_ids[i // G])
  return rows, texts, prompt_ids


def run_episodes(sampler: sampling.Sampler, params, tokenizer, examples, key,
                 num_generations: int, spec: base.EnvSpec,
                 system_prompt: str = "", batch_multiple: int = 1
                 ) -> Episodes:
  """G episodes per example, turn by turn (module docstring). Turn k's
  samples come from fold_in(key, k); turn 0 is one group call (G rows a
  prompt), later turns one call over the live rows' histories."""
  G, cfg = num_generations, sampler.sampling
  turns = ToolTurns.of(tokenizer, cfg.stop_ids)
  rows, texts, prompt_ids = start_rows(tokenizer, examples, G, spec,
                                       system_prompt)
  T = spec.trajectory_tokens(cfg.max_new_tokens)
  live = list(range(len(rows)))
  for turn in range(spec.max_turns):
    turn_key = jax.random.fold_in(key, turn)
    if turn == 0:
      out = sampler.sample(params, prompt_ids, turn_key, G, batch_multiple)
    else:
      out = sampler.sample(params, [rows[i].history for i in live], turn_key,
                           1, sampling.bucket(len(live), 1))
    out = sharding.to_host(out)
    calls = []
    for j, i in enumerate(live):
      k = int(out.length_n[j])
      if out.routes_nslc is not None:   # the history (left-padded), the turn
        P = out.routes_nslc.shape[1] - out.tokens_nt.shape[1]
        rows[i].routes = out.routes_nslc[j, P - len(rows[i].history):P + k]
      ids = [int(x) for x in out.tokens_nt[j, :k]]
      text = take_turn(rows[i], tokenizer, ids,
                       [float(x) for x in out.logp_nt[j, :k]],
                       bool(out.truncated_n[j]))
      if text is not None:
        calls.append((i, text, ids))
    results = run_tools([(rows[i].env, text, ids) for i, text, ids in calls],
                        spec.tool_timeout_s)
    live = [i for (i, _, _), result in zip(calls, results)
            if take_result(rows[i], result, turns, tokenizer, spec)]
    if not live:
      break
  return collect(rows, prompt_ids, texts, T, cfg.pad_id)


def collect(rows: list[Row], prompt_ids, texts, T: int, pad_id: int
            ) -> Episodes:
  """The finished rows as fixed-shape `Episodes` of width T."""
  n = len(rows)
  tokens = np.full((n, T), pad_id, np.int32)
  logp = np.zeros((n, T), np.float32)
  action = np.zeros((n, T), bool)
  observation = np.zeros((n, T), bool)
  for i, row in enumerate(rows):
    k = len(row.tokens)
    tokens[i, :k], logp[i, :k] = row.tokens, row.logp
    action[i, :k] = row.action
    observation[i, :k] = ~np.asarray(row.action, bool)
  as_int = lambda f: np.asarray([f(r) for r in rows], np.int32)
  routes = {}
  if rows and rows[0].routes is not None:     # an episode ends on its turn
    p_n = [len(r.history) - len(r.tokens) for r in rows]
    routes_ntlc = np.zeros((n, T) + rows[0].routes.shape[1:],
                           rows[0].routes.dtype)
    for i, (row, p) in enumerate(zip(rows, p_n)):
      routes_ntlc[i, :len(row.tokens)] = row.routes[p:]
    routes = dict(prompt_routes_n=[r.routes[:p] for r, p in zip(rows, p_n)],
                  routes_ntlc=routes_ntlc)
  return Episodes(
      prompt_ids, texts, tokens, logp, action, observation,
      as_int(lambda r: len(r.tokens)),
      np.asarray([r.truncated for r in rows], bool),
      [r.final_text for r in rows],
      np.asarray([r.env_reward for r in rows], np.float32),
      as_int(lambda r: r.turns), as_int(lambda r: r.tool_calls),
      as_int(lambda r: r.tool_errors), **routes)


def metrics(ep: Episodes) -> dict[str, float]:
  """Tool use of a batch of episodes ("env/..." metrics)."""
  return {"env/turns_mean": float(ep.turns_n.mean()),
          "env/tool_calls_mean": float(ep.tool_calls_n.mean()),
          "env/tool_call_rate": float((ep.tool_calls_n > 0).mean()),
          "env/tool_errors": float(ep.tool_errors_n.sum()),
          "env/observation_tokens_mean": float(ep.observation_nt.sum(1).mean()),
          "env/reward_terms_mean": float(ep.env_reward_n.mean())}
