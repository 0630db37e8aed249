"""Process supervision end to end: the "equations" process reward, step ends
mapped to tokens, per-token process advantages into the loss and a run."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import grpo_process, tiny
from grpo_jax import errors, registry, validation
from grpo_jax.algorithms import advantages as adv_lib
from grpo_jax.algorithms import losses
from grpo_jax.models import get_preset, init_params
from grpo_jax.models.byte_tokenizer import byte_tokenizer
from grpo_jax.rewards import equations, process
from grpo_jax.rl import train, update


def test_equation_steps_reward_true_equations_and_the_answer():
  text = "3 + 4 = 7. Then 7 x 2 = 15, so 15 / 3 = 5.0. The answer is 5."
  steps = process.equation_steps(text, correct=True)
  ends = [text.index("= 7") + 3, text.index("= 15") + 4,
          text.index("= 5.0") + 5, len(text)]
  assert steps == [(ends[0], 1.0), (ends[1], 0.0), (ends[2], 1.0),
                   (ends[3], 1.0)]
  assert process.equation_steps("no equation", correct=False) == [(11, 0.0)]
  # a chain is no step (its last link "3 * 4 = 14" is false, the chain true)
  chain = "2 + 3 * 4 = 14, then 14 - 20 = -6"
  assert process.equation_steps(chain, correct=False) == [(len(chain), 1.0),
                                                          (len(chain), 0.0)]
  holds = equations.equation_holds
  assert holds("10", "/", "4", "2.5") and holds("10", "/", "3", "3.33")
  assert not holds("10", "/", "0", "0") and not holds("10", "/", "3", "3.4")
  assert not holds("12", "-", "5", "-7") and holds("5", "-", "12", "-7")
  assert holds("6", "\u00d7", "7", "42") and not holds("6", "x", "7", "43")


def test_star_and_the_process_reward_read_the_same_equations():
  """One definition (rewards/equations.py): STaR's check is "every step of
  the process reward holds"."""
  texts = ["4 packs of 4 is 4 * 4 = 16 more, so 15 + 16 = 31.",
           "Noah starts with 23, so 23 + 4 = 19.", "2 + 3 * 4 = 14",
           "27 bags = 3 x 10 = 33 apples", "No equation: 31."]
  for text in texts:
    rewards = [r for _, r in process.equation_steps(text, correct=True)[:-1]]
    assert equations.arithmetic_holds(text) == all(r == 1.0 for r in rewards)
  assert [len(process.equation_steps(t, True)) - 1 for t in texts] == [
      2, 1, 0, 1, 0]


def test_char_ends_map_to_the_token_that_ends_the_step():
  tok = byte_tokenizer()   # one token per byte: char i is token i
  text = "2 + 2 = 4 ok"
  ids = tok.encode(text)
  assert process.char_ends_to_tokens(
      lambda x: tok.decode(x), ids, [9, len(text)]) == [8, len(text) - 1]
  # with multi-character tokens: decode of a prefix of k tokens
  pieces = ["ab", "c", "de", "f"]
  decode = lambda ids_: "".join(pieces[i] for i in ids_)
  assert process.char_ends_to_tokens(decode, [0, 1, 2, 3],
                                     [1, 2, 3, 4, 6]) == [0, 0, 1, 2, 3]


def test_step_rewards_arrays_and_the_process_advantage():
  tok = byte_tokenizer()
  texts = [["1 + 1 = 2. 2", "1 + 1 = 3. 3"], ["7", "x"]]
  T = 16
  tokens = np.zeros((2, 2, T), np.int32)
  lengths = np.zeros((2, 2), np.int32)
  for b in range(2):
    for g in range(2):
      ids = tok.encode(texts[b][g])
      tokens[b, g, :len(ids)] = ids
      lengths[b, g] = len(ids)
  correct = np.array([[True, False], [True, False]])
  reward, end, metrics = process.step_rewards("equations", tok, tokens,
                                              lengths, correct, T)
  # completion (0,0): equation ends at char 9 (token 8, r 1), answer at 11 (1)
  np.testing.assert_array_equal(np.flatnonzero(end[0, 0]), [8, 11])
  np.testing.assert_array_equal(reward[0, 0, [8, 11]], [1.0, 1.0])
  np.testing.assert_array_equal(reward[0, 1, [8, 11]], [0.0, 0.0])
  np.testing.assert_array_equal(np.flatnonzero(end[1, 0]), [0])
  assert metrics["process/equations_per_completion"] == 0.5
  assert metrics["process/equation_holds_frac"] == 0.5
  adv = np.asarray(adv_lib.grpo_process_advantages(jnp.asarray(reward),
                                                   jnp.asarray(end)))
  # group 0: steps [1, 1, 0, 0]: mean .5, std (ddof 1) = sqrt(1/3)
  z = 0.5 / (np.sqrt(1 / 3) + 1e-6)
  np.testing.assert_allclose(adv[0, 0, :9], 2 * z, rtol=1e-5)
  np.testing.assert_allclose(adv[0, 0, 9:12], z, rtol=1e-5)
  np.testing.assert_allclose(adv[0, 0, 12:], 0.0)
  np.testing.assert_allclose(adv[0, 1, :9], -2 * z, rtol=1e-5)
  # group 1: steps [1, 0]: z = ±0.5 / sqrt(0.5)
  np.testing.assert_allclose(adv[1, :, 0], [0.5 / (np.sqrt(.5) + 1e-6),
                                            -0.5 / (np.sqrt(.5) + 1e-6)],
                             rtol=1e-5)


def test_registered_and_validated():
  assert "equations" in registry.names("process_reward")
  c = grpo_process.get_config("local")
  validation.validate(c)
  c.rl.process_reward = "equation"
  with pytest.raises(errors.ConfigError, match="equations"):
    validation.validate(c)
  validation.validate(grpo_process.get_config("local_outcome"))


@pytest.mark.parametrize("advantage", [
    "grpo_process", pytest.param("grpo", marks=pytest.mark.slow)])
def test_grpo_process_trains_end_to_end(tmp_path, advantage):
  """Process supervision trains; an outcome run with the process reward set
  logs the same process/* metrics (the README compares them)."""
  c = tiny.get_config()
  c.rl.advantage = advantage
  c.rl.process_reward = "equations"
  c.rl.loss_agg = "seq-mean-token-mean"
  c.train.steps = 2
  c.train.eval_at_start = c.train.eval_at_end = False
  train.run(c, str(tmp_path))
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in rows] == [1, 2]
  for r in rows:
    assert np.isfinite(r["loss"]) and r["process/steps_per_completion"] >= 1


def test_per_token_advantages_are_exact_under_micro_batching():
  """The update with process advantages [N, T] (each row's own) gives the
  same loss and gradient for 1 and 4 micro-batches."""
  cfg = get_preset("tiny")
  params = init_params(cfg, jax.random.key(0))
  rng = np.random.RandomState(3)
  n, prompt, comp = 8, 4, 5
  lengths = rng.randint(1, comp + 1, n)
  mask = (np.arange(comp)[None] < lengths[:, None]).astype(np.float32)
  tokens = rng.randint(1, 256, (n, prompt + comp)).astype(np.int32)
  pos = np.broadcast_to(np.arange(prompt + comp), (n, prompt + comp))
  adv_nt = np.cumsum(rng.randn(n, comp), axis=1)[:, ::-1].astype(np.float32)
  batch = update.UpdateBatch(
      jnp.asarray(tokens), jnp.asarray(pos, jnp.int32),
      jnp.ones((n, prompt + comp), bool), jnp.asarray(mask),
      jnp.asarray(rng.randn(n, comp).astype(np.float32) * 0.1 - 2.0),
      jnp.zeros((n, comp)), jnp.asarray(adv_nt))
  s = update.LossSettings(
      loss=losses.PolicyLossSpec(agg="seq-mean-token-mean"), chunk=4)
  step = jax.jit(update.accumulate_gradients, static_argnums=3)
  results = [step(update.Policy(params), batch, 0.0,
                  update.UpdateProgram(cfg, s, num_micro=k)) for k in (1, 4)]
  assert abs(float(results[0][1])) > 1e-3
  for grads, loss, _ in results[1:]:
    np.testing.assert_allclose(loss, results[0][1], rtol=1e-5, atol=1e-7)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(results[0][0])):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
