"""Gemma 2 and Gemma 3 in the one decoder: parity with transformers on tiny
random checkpoints written here (float32 log-softmax within 1e-4), export
back, and the per-layer sliding window (shorter than the rows) in the
blockwise attention and the cached decode steps."""
import re

import hf_reference
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from grpo_jax.models import (
  blockwise,
  decode,
  forward,
  get_preset,
  hf,
  init_params,
  load_pretrained,
  save_pretrained,
)
from grpo_jax.models.attention import attention, attention_mask

WINDOW = 5          # < the rows' 24 columns
_COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               sliding_window=WINDOW, query_pre_attn_scalar=24,
               max_position_embeddings=128)


def _gemma2():
  # Soft-caps small enough to bind on these scores and logits.
  return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
      num_hidden_layers=3, attn_logit_softcapping=3.0,
      final_logit_softcapping=4.0, **_COMMON))


def _gemma3():
  # 5 layers, period 2: the scan's groups and the unrolled last layer; the
  # global layers' RoPE linearly scaled, the local ones' not.
  rope = {"full_attention": {"rope_type": "linear", "factor": 8.0,
                             "rope_theta": 1e6},
          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
  return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
      num_hidden_layers=5, sliding_window_pattern=2, rope_parameters=rope,
      **_COMMON))


def _randomize(model, seed=0):
  """Weights far from init (norm weights ~N(0, 0.3): transformers scales by
  1 + w, so a missing offset shows)."""
  return hf_reference.randomize(model, seed)


_logprobs = hf_reference.logprobs


TOKENS = np.random.RandomState(0).randint(0, 300, (2, 24))


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def checkpoint(request, tmp_path_factory):
  model = _randomize({"gemma2": _gemma2, "gemma3": _gemma3}[request.param]())
  directory = tmp_path_factory.mktemp(request.param)
  model.save_pretrained(directory)
  return request.param, model, directory


def test_logits_match_transformers_and_export_round_trips(checkpoint,
                                                          tmp_path):
  arch, model, directory = checkpoint
  config, params = load_pretrained(directory)
  assert config.architecture == arch
  assert config.layer_types == tuple(model.config.layer_types)
  assert "sliding_attention" in config.layer_types
  assert "full_attention" in config.layer_types
  ref = _logprobs(model, TOKENS)
  ours = np.asarray(jax.nn.log_softmax(
      forward(config, params, jnp.asarray(TOKENS))))
  err = np.abs(ours - ref).max()
  assert err < 1e-4, f"{arch}: max |d log-softmax| = {err}"
  # The window matters here: attending to everything gives other values.
  wide = config.replace(sliding_window=64)
  assert np.abs(np.asarray(jax.nn.log_softmax(
      forward(wide, params, jnp.asarray(TOKENS)))) - ref).max() > 1e-3

  save_pretrained(config, params, tmp_path / "out")
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
  assert type(back).__name__ == type(model).__name__
  np.testing.assert_allclose(_logprobs(back.eval(), TOKENS), ref, atol=1e-5)
  config2, params2 = load_pretrained(tmp_path / "out")
  assert config2 == config
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
               params, params2)


def test_norms_store_one_plus_weight(checkpoint):
  _, model, directory = checkpoint
  _, params = load_pretrained(directory)
  w = model.model.layers[1].post_feedforward_layernorm.weight.detach()
  np.testing.assert_allclose(params["layers"]["post_mlp_norm"][1],
                             1 + w.numpy(), rtol=1e-6)


def test_transformers4_spelling_reads_the_same():
  gemma3 = hf.config_to_hf(get_preset("gemma-3-27b"), "bfloat16")
  assert gemma3["rope_parameters"]["sliding_attention"]["rope_theta"] == 1e4
  v4 = {k: v for k, v in gemma3.items() if k not in ("rope_parameters",
                                                     "layer_types")}
  v4["sliding_window_pattern"] = 6
  assert hf.config_from_hf(v4) == get_preset("gemma-3-27b")
  assert hf.config_from_hf(gemma3) == get_preset("gemma-3-27b")
  gemma2 = hf.config_to_hf(get_preset("gemma-2-9b"), "bfloat16")
  del gemma2["layer_types"]
  assert hf.config_from_hf(gemma2) == get_preset("gemma-2-9b")


def test_layer_configs_and_period():
  c = get_preset("gemma-3-1b")
  assert c.layer_period() == 6
  full, local = c.layer_config(5), c.layer_config(0)
  assert (full.sliding_window, full.rope_theta) == (None, 1e6)
  assert (local.sliding_window, local.rope_theta) == (512, 1e4)
  assert get_preset("gemma-2-2b").layer_period() == 2
  assert get_preset("qwen3-8b").layer_period() == 1
  with pytest.raises(ValueError, match="layer_types"):
    c.replace(layer_types=("sliding_attention",) * 3)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_blockwise_window_and_softcap_match_dense(softcap):
  """Several key blocks, some wholly outside the window: values and grads."""
  N, Q, H, K, E = 2, 40, 4, 2, 8
  ks = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(ks[0], (N, Q, H, E))
  k = jax.random.normal(ks[1], (N, K, Q, E))
  v = jax.random.normal(ks[2], (N, K, Q, E))
  pos = jnp.broadcast_to(jnp.arange(Q), (N, Q))
  valid = jnp.ones((N, Q), bool)
  config = get_preset("tiny-gemma").replace(layer_types=None,
                                            sliding_window=WINDOW)
  mask = attention_mask(config, pos, pos, valid)
  dense = lambda q, k, v: attention(q, k, v, mask, softcap)
  blocks = lambda q, k, v: blockwise.attention(
      q, k, v, blockwise.MaskInfo(pos, pos, valid), sliding_window=WINDOW,
      softcap=softcap, block_q=8, block_k=8)
  # Jitted: one compile each, where op-by-op dispatch compiles every op.
  np.testing.assert_allclose(jax.jit(blocks)(q, k, v),
                             jax.jit(dense)(q, k, v), atol=1e-5)
  w = jax.random.normal(ks[3], (N, Q, H, E))
  grads = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * w),
                                     (0, 1, 2)))(q, k, v)
  for a, b in zip(grads(blocks), grads(dense)):
    np.testing.assert_allclose(a, b, atol=1e-4)


@pytest.mark.parametrize("softcaps", [(None, None), (3.0, 4.0)])
def test_cached_decode_matches_forward(softcaps):
  """The lockstep decode step, one token at a time past the window, gives
  the full forward's logits: per-layer windows and RoPE bases in the
  unrolled layers."""
  config = get_preset("tiny-gemma").replace(attn_softcap=softcaps[0],
                                            final_softcap=softcaps[1])
  params = init_params(config, jax.random.key(1))
  params = jax.tree.map(lambda x: x * 5, params)   # scores the caps bind
  tokens = jnp.asarray(TOKENS[:, :12] % config.vocab_size)
  full = jax.jit(forward, static_argnums=0)(config, params, tokens)
  cache = decode.init_cache(config, 2, 12)
  step = jax.jit(lambda c, t, i: decode.decode_step(
      config, params, c, t, jnp.full((2,), i), i))
  for i in range(12):
    logits, cache = step(cache, tokens[:, i], i)
    np.testing.assert_allclose(logits, full[:, i], atol=2e-4, rtol=1e-4)


# ----------------------------------------------------------------------------
# Tokenizer files as Gemma checkpoints ship them: a byte-fallback BPE
# (SentencePiece style, "▁" for spaces), <bos> added by the template,
# <end_of_turn> ending a turn, generation_config listing both stop ids.
# ----------------------------------------------------------------------------

GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate') }}{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' "
    "else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first "
    "else '') }}{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}"
    "{%- endif -%}")
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>",
            "<end_of_turn>"]


@pytest.fixture(scope="module")
def gemma_tokenizer_dir(tmp_path_factory):
  import json

  from tokenizers import Tokenizer, decoders, models, normalizers, trainers
  backend = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
  backend.normalizer = normalizers.Replace(" ", "\u2581")
  backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "),
                                       decoders.ByteFallback(),
                                       decoders.Fuse()])
  corpus = ["What is 2 + 3? The answer is 5.", "Natalia sold clips to 48 "
            "of her friends in April.", "model user system turn"] * 20
  backend.train_from_iterator(corpus, trainers.BpeTrainer(
      vocab_size=200, special_tokens=SPECIALS,
      initial_alphabet=[f"<0x{b:02X}>" for b in range(256)]))
  directory = tmp_path_factory.mktemp("gemma_tok")
  backend.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>",
      "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
      "chat_template": GEMMA_TEMPLATE}))
  end_of_turn = backend.token_to_id("<end_of_turn>")
  (directory / "generation_config.json").write_text(json.dumps({
      "eos_token_id": [1, end_of_turn], "bos_token_id": 2}))
  return directory


CHATS = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": "Natalia sold clips"},
     {"role": "assistant", "content": "48 "},
     {"role": "user", "content": "In April?"}],
]


@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_gemma_chat_template_and_ids_match_transformers(gemma_tokenizer_dir,
                                                        chat):
  from grpo_jax.models.tokenizer import load_tokenizer
  ours = load_tokenizer(gemma_tokenizer_dir)
  ref = transformers.AutoTokenizer.from_pretrained(gemma_tokenizer_dir)
  text = ours.apply_chat_template(CHATS[chat])
  assert text == ref.apply_chat_template(CHATS[chat], tokenize=False,
                                         add_generation_prompt=True)
  assert text.startswith("<bos><start_of_turn>user\n")
  assert text.endswith("<end_of_turn>\n<start_of_turn>model\n")
  ids = ours.encode(text)
  assert ids == ref(text, add_special_tokens=False)["input_ids"]
  assert ids.count(ours.bos_id) == 1 and ids[0] == ours.bos_id
  assert ours.decode(ids) == ref.decode(ids)


def test_gemma_stop_ids_come_from_the_checkpoint(gemma_tokenizer_dir):
  from grpo_jax.models.tokenizer import load_tokenizer
  tok = load_tokenizer(gemma_tokenizer_dir)
  end_of_turn = tok.token_id("<end_of_turn>")
  assert set(tok.stop_ids) == {1, end_of_turn}
  assert tok.eos_id == 1 and tok.pad_id == 0


@pytest.mark.slow
def test_text_decoder_of_a_multimodal_gemma3(tmp_path):
  """Gemma3ForConditionalGeneration's directory: its text_config and text
  tensors load (the vision tower is not read) and give its text logits."""
  text = dict(_COMMON, num_hidden_layers=3, sliding_window_pattern=2)
  vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, image_size=28, patch_size=14)
  model = _randomize(transformers.Gemma3ForConditionalGeneration(
      transformers.Gemma3Config(text_config=text, vision_config=vision,
                                mm_tokens_per_image=4)))
  model.save_pretrained(tmp_path)
  config, params = load_pretrained(tmp_path)
  assert config.architecture == "gemma3" and config.num_layers == 3
  ours = np.asarray(jax.nn.log_softmax(
      forward(config, params, jnp.asarray(TOKENS))))
  assert np.abs(ours - _logprobs(model, TOKENS)).max() < 1e-4
  # transformers 4.50's names (the published files): language_model.model.*
  import shutil

  from safetensors.numpy import load_file, save_file
  old = tmp_path / "v450"
  old.mkdir()
  shutil.copy(tmp_path / "config.json", old / "config.json")
  renamed = {re.sub(r"^model\.language_model\.", "language_model.model.",
                    re.sub(r"^model\.(vision_tower|multi_modal_projector)",
                           r"\1", k)): v
             for k, v in load_file(tmp_path / "model.safetensors").items()}
  assert any(k.startswith("vision_tower.") for k in renamed)
  save_file(renamed, old / "model.safetensors")
  _, params_v450 = load_pretrained(old)
  jax.tree.map(np.testing.assert_array_equal, params, params_v450)
