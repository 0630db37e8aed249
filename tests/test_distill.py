"""On-policy distillation: the per-token signal by hand, the teacher scored
in the step's scoring pass, the tokenizer refusal and the config checks."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny
from grpo_jax import errors, validation
from grpo_jax.algorithms import distillation
from grpo_jax.models import get_preset, init_params, transformer
from grpo_jax.models.byte_tokenizer import byte_tokenizer
from grpo_jax.rl import distill, step, train, update
from grpo_jax.rl.batch import RolloutBatch
from grpo_jax.star import collect, loop


def test_reverse_kl_advantages_by_hand():
  student = jnp.array([[-1.0, -0.5, -2.0], [-0.2, -3.0, 0.0]])
  teacher = jnp.array([[-0.4, -1.5, -2.0], [-0.7, -0.1, -9.0]])
  mask = jnp.array([[1, 1, 1], [1, 1, 0]], jnp.float32)
  # A_t = log π_T - log π_S on valid tokens: [0.6, -1.0, 0.0], [-0.5, 2.9, 0].
  got = distillation.reverse_kl_advantages(student, teacher, mask)
  np.testing.assert_allclose(got, [[0.6, -1.0, 0.0], [-0.5, 2.9, 0.0]], atol=1e-6)
  m = distillation.reverse_kl_metrics(student, teacher, mask)
  # log π_S - log π_T summed over 5 valid tokens: -0.6 + 1.0 + 0 + 0.5 - 2.9 = -2.0.
  np.testing.assert_allclose(m["distill/reverse_kl_token"], -2.0 / 5, rtol=1e-6)
  np.testing.assert_allclose(m["distill/reverse_kl_seq"], (0.4 - 2.4) / 2, rtol=1e-6)


def _rollout(model_config, n=4, p=5, t=4, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, model_config.vocab_size, (n, p + t)).astype(np.int32)
  tokens[1::2, :p] = tokens[0::2, :p]   # groups of 2 rows share a prompt
  positions = np.tile(np.arange(p + t, dtype=np.int32), (n, 1))
  mask = np.ones((n, t), np.float32)
  mask[1, 2:] = 0   # a short completion
  valid = np.concatenate([np.ones((n, p), bool), mask > 0], axis=1)
  old = rng.uniform(-4, -0.1, (n, t)).astype(np.float32)   # "the sampler's"
  return RolloutBatch(tokens, positions, valid, mask, old,
                      np.zeros((n // 2, 2), np.float32))


def _reference_logprobs(model_config, params, tokens, p, temperature):
  """log π(y_t | ·) from the plain forward: an independent computation."""
  logits = transformer.forward(model_config, params, jnp.asarray(tokens))
  logp = jax.nn.log_softmax(logits[:, p - 1:-1].astype(jnp.float32) / temperature)
  return np.take_along_axis(np.asarray(logp), tokens[:, p:, None], axis=2)[..., 0]


@pytest.mark.parametrize("packing", ["off", "on"])
def test_score_step_gives_the_teachers_per_token_signal(packing):
  """The update's advantages are log π_T - log π_S per sampled token, with
  π_T a different (and differently shaped) model scored on the same rows,
  π_S the sampler's log-probs; padded or packed alike."""
  student_cfg = get_preset("tiny")
  teacher_cfg = student_cfg.replace(num_layers=student_cfg.num_layers + 1)
  student = init_params(student_cfg, jax.random.key(0))
  teacher = init_params(teacher_cfg, jax.random.key(7))
  rollout = _rollout(student_cfg)
  loss = update.LossSettings(temperature=0.7)
  spec = step.UpdateSpec(loss=loss, distill=True, packing=packing, num_generations=2)
  program = spec.program(student_cfg, None)
  plan = step.UpdatePlan.of(spec, rollout)
  state = update.TrainState(jnp.zeros((), jnp.int32), student, None, None)
  frozen = step.Frozen(teacher=distill.Teacher(teacher_cfg, teacher, "test"))
  full, metrics = step.score_step(plan, program, state, rollout,
                                  np.full((4,), 9.0, np.float32), frozen)
  want_teacher = _reference_logprobs(teacher_cfg, teacher, rollout.tokens_ns, 5, 0.7)
  want = (want_teacher - rollout.old_logp_nt) * rollout.mask_nt
  np.testing.assert_allclose(np.asarray(full.adv_n), want, atol=2e-5)
  diff = (rollout.old_logp_nt - want_teacher) * rollout.mask_nt
  assert metrics["distill/reverse_kl_token"] == pytest.approx(
      diff.sum() / rollout.mask_nt.sum(), abs=1e-5)


def test_a_teacher_with_another_tokenizer_is_refused():
  student, teacher = byte_tokenizer(), byte_tokenizer()
  teacher.backend.add_tokens(["<extra_token>"])
  distill.check_tokenizers(student, byte_tokenizer(), "same")   # agrees: no error
  with pytest.raises(errors.ConfigError, match="rl.distill.teacher.*tokenizer differs"):
    distill.check_tokenizers(student, teacher, "other")


def test_config_checks():
  config = tiny.get_config()
  config.rl.distill.mode = "on_policy"
  with pytest.raises(errors.ConfigError, match="rl.distill.teacher"):
    validation.validate(config)
  config.rl.distill.teacher = "tiny"
  config.rl.dynamic_sampling = True
  with pytest.raises(errors.ConfigError, match="rl.dynamic_sampling"):
    validation.validate(config)
  config.rl.distill.mode = "offline"
  with pytest.raises(errors.ConfigError, match="rl.distill.mode"):
    validation.validate(config)


@pytest.mark.slow
def test_distillation_run_from_a_run_teacher(tmp_path):
  """A tiny RL run is the teacher (a grpo_jax workdir); the student's run
  logs the reverse KL, which falls as the student trains on it."""
  teacher_dir = str(tmp_path / "teacher")
  config = tiny.get_config()
  config.train.steps = 1
  config.train.eval_at_start = config.train.eval_at_end = False
  train.run(config, teacher_dir)
  config = tiny.get_config()
  config.seed = 3   # another initial student
  config.rl.distill.mode, config.rl.distill.teacher = "on_policy", teacher_dir
  config.train.steps = 6
  config.optim.learning_rate = 3e-3
  config.train.eval_at_start = config.train.eval_at_end = False
  train.run(config, str(tmp_path / "student"))
  rows = [json.loads(l) for l in open(tmp_path / "student" / "metrics.jsonl")]
  kl = [r["distill/reverse_kl_token"] for r in rows if "loss" in r]
  assert len(kl) == 6 and all(np.isfinite(kl))
  assert np.mean(kl[-2:]) < np.mean(kl[:2])


def test_off_policy_distillation_samples_with_the_teacher(tmp_path, monkeypatch):
  """star.teacher: each outer iteration's answers come from the teacher's
  params (and its model config); the student is what is fine-tuned."""
  teacher_cfg = get_preset("tiny").replace(num_layers=get_preset("tiny").num_layers + 1)
  teacher = distill.Teacher(teacher_cfg, init_params(teacher_cfg, jax.random.key(5)), "t")
  seen = []
  monkeypatch.setattr(distill, "load_model_as_teacher",
                      lambda config, source, tok, layout, field: teacher)

  def record(config, sampler, params, *args):
    seen.append((sampler.model_config, params))
    return collect.Kept([], [], []), {}

  monkeypatch.setattr(loop, "collect_examples", record)
  config = tiny.get_config()
  config.method, config.star.teacher, config.star.iterations = "star", "a_teacher", 1
  config.train.eval_examples = 1
  loop.run(config, str(tmp_path))
  (model_config, params), = seen
  assert model_config == teacher_cfg
  jax.tree.map(np.testing.assert_array_equal, params, teacher.params)


def test_a_mismatched_teacher_is_refused_before_its_weights_load(monkeypatch):
  config = tiny.get_config()
  student = byte_tokenizer()
  student.backend.add_tokens(["<only_the_student_has_it>"])
  monkeypatch.setattr(distill.experiment, "load_model", lambda c: pytest.fail("loaded"))
  with pytest.raises(errors.ConfigError, match="'star.teacher' = 'tiny'.*tokenizer differs"):
    distill.load_model_as_teacher(config, "tiny", student, None, "star.teacher")
