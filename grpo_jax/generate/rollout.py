"""SAMPLE and SCORE: prompts -> G completions each -> rewards -> groups kept.

The host side of a step, between the two jitted programs: render prompts,
call the sampler, detokenise, run the reward functions (strings: the one
deliberate host boundary) and apply DAPO's dynamic sampling.

The rollout has three typed forms, one per consumer:

    sampling.Samples   n = b*g rows, as the sampler returns them   [n, t]
    Groups             group axis first, for rewards and dynamic
                       sampling (whole groups are kept or dropped) [b, g, t]
    rl.batch.RolloutBatch  rows again, prompt + completion side by
                       side, for the update (built in rl/)         [n, s]
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, NamedTuple, Sequence

import numpy as np

from grpo_jax import rewards, sharding
from grpo_jax.algorithms import dynamic_sampling
from grpo_jax.data import templates
from grpo_jax.envs import base as envs
from grpo_jax.generate import agent, agent_parked, sampling


class Groups(NamedTuple):
  """b groups of g completions of one prompt each (host numpy, the group
  axis first): one generation batch after SAMPLE + SCORE."""
  prompt_ids_b: np.ndarray    # object [b]: each prompt's token ids (tuple)
  tokens_bgt: np.ndarray      # int32 completion ids, pad after the stop
  logp_bgt: np.ndarray        # float32 sampler log-probs (0 on padding)
  mask_bgt: np.ndarray        # bool: generated tokens, stop included
  length_bg: np.ndarray       # int32 generated tokens
  truncated_bg: np.ndarray    # bool: no stop within max_new_tokens
  reward_bg: np.ndarray       # float32 weighted reward
  correct_bg: np.ndarray      # bool: the accuracy reward > 0
  # bool: env observation tokens (attended to, never trained; mask_bgt is
  # False there); None: no env, every generated token is the model's
  observation_bgt: np.ndarray | None = None
  # routing replay (model.moe.routing_replay = rollout): the experts the
  # sampler chose per sparse layer, each prompt's tokens' (object [b], each
  # [p, l, c]) and the completions' [b, g, t, l, c]; None: not recorded
  prompt_routes_b: np.ndarray | None = None
  routes_bgtlc: np.ndarray | None = None
  # partial rollouts (rollout.partial): int32, the policy version that
  # sampled each token (algorithms/staleness.py); None: every token the
  # batch's version
  version_bgt: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class RewardSpec:
  """Rewards as `compute_rewards` specs; `accuracy` names the one whose value
  > 0 means correct (accuracy metrics, dynamic sampling's 0 < correct < G)."""
  specs: tuple
  accuracy: str

  @classmethod
  def from_config(cls, config) -> "RewardSpec":
    specs = tuple((name, float(w), dict(config.reward_kwargs.get(name, {})))
                  for name, w in config.rewards.items())
    return cls(specs, config.accuracy_reward)


def score(spec: RewardSpec, prompts: Sequence[str], completions: Sequence[str],
          answers: Sequence[str], lengths: np.ndarray
          ) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
  """Weighted reward float32[N], correct bool[N], per-reward metrics."""
  parts: dict[str, np.ndarray] = {}
  total, metrics = rewards.compute_rewards(spec.specs, prompts, completions,
                                           answers, lengths, components=parts)
  return total, parts[spec.accuracy] > 0, metrics


def completion_texts(tokenizer, tokens_nt: np.ndarray, length_n: np.ndarray,
                     truncated_n: np.ndarray) -> list[str]:
  """The text of each sampled row [n] (`sampling.Samples` fields, host
  arrays), as the rewards read it: the stop token is not part of it."""
  ends_n = length_n - (~truncated_n)
  return [tokenizer.decode(row[:end], skip_special_tokens=True)
          for row, end in zip(tokens_nt, ends_n)]


@dataclasses.dataclass(frozen=True)
class GroupSettings:
  """How examples become scored groups: G completions per prompt, the
  rewards, the prompt template (and system prompt), and the prompt count
  each sampler call is padded to a multiple of (a fixed chunk shape)."""
  num_generations: int
  rewards: RewardSpec
  template: str
  system_prompt: str = ""
  batch_multiple: int = 1
  env: envs.EnvSpec | None = None      # multi-turn episodes (agent.py)


def generate_groups(sampler: sampling.Sampler, params, tokenizer, examples,
                    key, settings: GroupSettings
                    ) -> tuple[Groups, dict[str, float]]:
  """Samples G completions for each example and scores them, group-major.
  With the sampler's layout its rows are split over the mesh; every host
  gets all of them back (the rewards read every row). The sampler's page
  pool holder (`sampling.PagePools`, kv_cache "paged") is kept across
  calls."""
  G = settings.num_generations
  if settings.env is not None:
    return generate_episodes(sampler, params, tokenizer, examples, key,
                             settings)
  t0 = time.perf_counter()
  texts = templates.render_prompts(tokenizer, settings.template,
                                   [e.question for e in examples],
                                   settings.system_prompt)
  prompt_ids = tokenizer.encode_batch(texts)
  out = sharding.to_host(sampler.sample(params, prompt_ids, key, G,
                                        settings.batch_multiple))
  t1 = time.perf_counter()
  groups, metrics = score_samples(settings.rewards, texts, prompt_ids,
                                  [e.answer for e in examples], out,
                                  tokenizer, G)
  t2 = time.perf_counter()
  metrics.update({"time/sample": t1 - t0, "time/score": t2 - t1,
                  "sample/decode_steps": int(out.steps),
                  "sample/tokens": int(out.length_n.sum())})
  return groups, metrics


def generate_episodes(sampler: sampling.Sampler, params, tokenizer, examples,
                      key, settings: GroupSettings
                      ) -> tuple[Groups, dict[str, float]]:
  """`generate_groups` with an env: G multi-turn episodes per example
  (agent.run_episodes; env.engine "parked": agent_parked.run_episodes),
  the rewards on each last turn's text plus the env's reward terms; the
  loss mask covers the model's turns only."""
  G, B = settings.num_generations, len(examples)
  t0 = time.perf_counter()
  engine: dict = {}
  if settings.env.engine == "parked":
    ep = agent_parked.run_episodes(sampler, params, tokenizer, examples, key,
                                   G, settings.env, settings.system_prompt,
                                   stats=engine)
  else:
    ep = agent.run_episodes(sampler, params, tokenizer, examples, key, G,
                            settings.env, settings.system_prompt,
                            settings.batch_multiple)
  t1 = time.perf_counter()
  actions_n = ep.action_nt.sum(axis=1).astype(np.int32)
  reward_n, correct_n, metrics = score(
      settings.rewards, np.repeat(ep.prompt_texts, G).tolist(),
      ep.final_texts, [e.answer for e in examples for _ in range(G)],
      actions_n)
  prompts_b = np.empty((B,), object)
  prompts_b[:] = ep.prompt_ids
  shape = lambda x: x.reshape(B, G, *x.shape[1:])
  groups = Groups(prompts_b, shape(ep.tokens_nt), shape(ep.logp_nt),
                  shape(ep.action_nt), shape(ep.length_n),
                  shape(ep.truncated_n),
                  shape((reward_n + ep.env_reward_n).astype(np.float32)),
                  shape(correct_n), shape(ep.observation_nt))
  if ep.routes_ntlc is not None:      # a group's prompt: its first row's
    prompt_routes_b = np.empty((B,), object)
    for b in range(B):
      prompt_routes_b[b] = ep.prompt_routes_n[b * G]
    groups = groups._replace(prompt_routes_b=prompt_routes_b,
                             routes_bgtlc=shape(ep.routes_ntlc))
  metrics.update(agent.metrics(ep))
  metrics.update(agent_parked.metrics(engine))
  metrics.update({"time/sample": t1 - t0,
                  "time/score": time.perf_counter() - t1,
                  "sample/tokens": int(actions_n.sum())})
  return groups, metrics


def answer_texts(tokenizer, groups: Groups) -> list[str]:
  """What the rewards read of each row [n]: the completion, or with an env
  the last model turn (after the last observation token)."""
  B, G, T = groups.tokens_bgt.shape
  tokens_nt = groups.tokens_bgt.reshape(B * G, T)
  length_n = groups.length_bg.reshape(-1)
  truncated_n = groups.truncated_bg.reshape(-1)
  if groups.observation_bgt is None:
    return completion_texts(tokenizer, tokens_nt, length_n, truncated_n)
  obs_nt = groups.observation_bgt.reshape(B * G, T)
  starts = np.where(obs_nt.any(axis=1), T - np.argmax(obs_nt[:, ::-1], axis=1), 0)
  ends = length_n - (~truncated_n)
  return [tokenizer.decode(row[s:e], skip_special_tokens=True)
          for row, s, e in zip(tokens_nt, starts, ends)]


def score_samples(spec: RewardSpec, texts: Sequence[str],
                  prompt_ids: Sequence[Sequence[int]], answers: Sequence[str],
                  out: sampling.Samples, tokenizer, num_generations: int
                  ) -> tuple[Groups, dict[str, float]]:
  """The host-side Samples of B prompts' G rows (prompt-major), scored and
  shaped into Groups; the reward metrics."""
  G = num_generations
  reward_n, correct_n, metrics = score(
      spec, np.repeat(texts, G).tolist(), completion_texts(
          tokenizer, out.tokens_nt, out.length_n, out.truncated_n),
      [a for a in answers for _ in range(G)], out.length_n)
  return shape_groups(out, prompt_ids, reward_n, correct_n, G), metrics


def shape_groups(out: sampling.Samples, prompt_ids: Sequence[Sequence[int]],
                 reward_n: np.ndarray, correct_n: np.ndarray,
                 num_generations: int) -> Groups:
  """The host-side Samples of B prompts' G rows (prompt-major) and their
  scores as Groups, recorded routes split per prompt (`split_routes`)."""
  B, G = len(prompt_ids), num_generations
  T = out.tokens_nt.shape[1]
  prompts_b = np.empty((B,), object)
  prompts_b[:] = [tuple(p) for p in prompt_ids]
  groups = Groups(prompts_b, out.tokens_nt.reshape(B, G, T),
                  out.logp_nt.reshape(B, G, T), out.mask_nt.reshape(B, G, T),
                  out.length_n.reshape(B, G), out.truncated_n.reshape(B, G),
                  reward_n.reshape(B, G), correct_n.reshape(B, G))
  if out.routes_nslc is not None:
    groups = groups._replace(**split_routes(out.routes_nslc, prompt_ids, G,
                                            T))
  return groups


def split_routes(routes_nslc: np.ndarray, prompt_ids, num_generations: int,
                 completion_len: int) -> dict:
  """The sampler's recorded routes [n, p + t, l, c] (prompts left-padded to
  the call's p) as Groups fields: each prompt's own tokens' routes (from
  its first row) and the completions' t columns."""
  G, T = num_generations, completion_len
  P = routes_nslc.shape[1] - T
  prompts_b = np.empty((len(prompt_ids),), object)
  for b, p in enumerate(prompt_ids):     # one by one: arrays, not a block
    prompts_b[b] = routes_nslc[b * G, P - len(p):P]
  tail = routes_nslc[:, P:]
  return {"prompt_routes_b": prompts_b,
          "routes_bgtlc": tail.reshape(-1, G, *tail.shape[1:])}


@dataclasses.dataclass(frozen=True)
class DynamicSampling:
  """DAPO's dynamic sampling (rl.dynamic_sampling): generation batches until
  the step has its groups that are neither all right nor all wrong, at most
  `max_batches` of them, then `on_cap` (algorithms/dynamic_sampling.py)."""
  enabled: bool = False
  max_batches: int = 1
  on_cap: str = "raise"

  def wants_more(self, seen: Sequence[Groups], num_groups: int) -> bool:
    """Whether a step that has scored the generation batches `seen` draws
    another (a refill), by `collect`'s rule."""
    if not self.enabled:
      return not seen
    acc = dynamic_sampling.GroupAccumulator()
    for groups in seen:
      acc = dynamic_sampling.add_generation_batch(acc, groups)
    return dynamic_sampling.wants_more(acc, num_groups, self.max_batches)

  @property
  def batches(self) -> int:
    """The most generation batches a step draws."""
    return self.max_batches if self.enabled else 1


def collect(generate: Callable[[int], tuple[Groups, dict]],
            num_groups: int, dynamic: DynamicSampling = DynamicSampling()
            ) -> tuple[Groups, dict[str, float]]:
  """One step's groups: with dynamic sampling, keeps generating batches until
  `num_groups` groups with 0 < correct < G (reward variance > 0) are kept."""
  seen: list[tuple[Groups, dict]] = []

  def gen(i):
    batch, metrics = generate(i)
    seen.append((batch, metrics))
    return batch

  if dynamic.enabled:
    batch, info = dynamic_sampling.sample_until_full(
        gen, num_groups, max_gen_batches=dynamic.max_batches,
        on_cap=dynamic.on_cap)
    # Filler groups (cap hit, on_cap="fill") keep the shape but get no
    # gradient and do not count in the token-mean normaliser.
    batch = batch._replace(
        mask_bgt=batch.mask_bgt & ~info["filler_b"][:, None, None])
  else:
    batch, info = gen(0), {}
  metrics = _merge_generation_metrics(seen)
  metrics.update({k: float(v) for k, v in info.items() if np.ndim(v) == 0})
  # Rollout statistics over everything generated (what the policy does now).
  everything = [b for b, _ in seen]
  rewards = np.concatenate([b.reward_bg.ravel() for b in everything])
  correct = np.concatenate([b.correct_bg.ravel() for b in everything])
  lengths = np.concatenate([b.length_bg.ravel() for b in everything])
  truncated = np.concatenate([b.truncated_bg.ravel() for b in everything])
  mixed = np.concatenate([_mixed(b.correct_bg) for b in everything])
  metrics.update({
      "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
      "accuracy": float(correct.mean()),
      "response_length/mean": float(lengths.mean()),
      "response_length/max": float(lengths.max()),
      "truncation_rate": float(truncated.mean()),
      "groups/mixed_fraction": float(mixed.mean()),
  })
  return batch, metrics


def _mixed(correct_bg: np.ndarray) -> np.ndarray:
  n = correct_bg.sum(axis=1)
  return (n > 0) & (n < correct_bg.shape[1])


def _merge_generation_metrics(seen) -> dict[str, float]:
  out: dict[str, float] = {}
  for _, m in seen:
    for k, v in m.items():
      if k.startswith(("time/", "sample/")) or k.endswith("/seconds"):
        out[k] = out.get(k, 0.0) + v       # summed over generation batches
  for k in {k for _, m in seen for k in m
            if k.startswith(("reward/", "env/")) and not k.endswith("/seconds")}:
    out[k] = float(np.mean([m[k] for _, m in seen if k in m]))
  return out
