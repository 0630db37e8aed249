"""experiments/aot.py compiles a config's programs for a TPU topology on this
CPU (libtpu from requirements-tpu.txt; no TPU): it exits 0 when every
program fits the chips' memory and 1, naming the program and what would
fit, when one does not."""
import json
import os
import re
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import pytest

from grpo_jax import sharding
from grpo_jax.aot import check as aot
from grpo_jax.aot import flops, programs
from grpo_jax.aot.plan import Plan, packed_shape
from grpo_jax.generate import sampling
from grpo_jax.harness import cli
from grpo_jax.models import get_preset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 1500


def _aot(*args):
  try:
    import libtpu  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    pytest.fail("libtpu is missing: pip install -r requirements-tpu.txt "
                "(requirements-test.txt includes it)")
  proc = subprocess.run(
      [sys.executable, "-u", os.path.join(ROOT, "experiments", "aot.py"),
       "--topology=v5e:2x2", *args], capture_output=True, text=True,
      timeout=TIMEOUT_S, cwd=ROOT,
      env={**os.environ, "JAX_PLATFORMS": "cpu"})
  return proc.returncode, proc.stdout + proc.stderr


def _script_json(script: str):
  """Runs `script` in a fresh CPU process (its own device set) and returns
  the JSON of its last printed line, failing on a non-zero exit."""
  proc = subprocess.run([sys.executable, "-c", script],
                        capture_output=True, text=True, timeout=600, cwd=ROOT,
                        env={**os.environ, "JAX_PLATFORMS": "cpu",
                             "PYTHONPATH": ROOT})
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _row(out: str, name: str) -> str:
  return next(line for line in out.splitlines() if line.startswith(name))


def _names(out: str) -> list:
  """The program column of the table's rows."""
  rows = [line for line in out.splitlines()
          if line.endswith(("yes", "NO")) and not line.startswith("  ->")]
  return [line[:14].strip() for line in rows]


def _assert_not_compiled(out: str, *names) -> None:
  """The config runs these programs; --programs left them out."""
  for name in names:
    assert _row(out, name).endswith("not compiled (--programs)"), out


def test_tiny_fits():
  """rl.packing = auto (the default): a run may take either path per
  mini-batch, so both updates are compiled."""
  rc, out = _aot("--config=configs/tiny.py", "--prompt_len=16")
  assert rc == 0, out
  assert "4 chips (TPU v5 lite), 15.75 GiB each" in out
  assert _names(out) == ["sampler", "update", "update packed", "eval greedy"]
  for name in ("sampler", "update", "update packed", "eval greedy"):
    assert _row(out, name).endswith("yes"), out
  assert "fits: every program leaves >= 5%" in out
  lines = out.splitlines()
  below = lines[lines.index(_row(out, "update")) + 1]
  found = re.search(r"each op of the program once \(a loop's body once\), "
                    r"MB: .*all-reduce ([\d.]+)", below)
  assert found and float(found.group(1)) > 0, below   # the gradients' sum


def test_programs_flag_compiles_a_subset_and_says_so():
  """--programs: only the named kinds compile (eval, the cheapest); the
  table names the others as not compiled and the verdict is about the
  compiled ones."""
  rc, out = _aot("--config=configs/tiny.py", "--prompt_len=16",
                 "--programs=eval")
  assert rc == 0, out
  assert _names(out) == ["eval greedy"], out
  _assert_not_compiled(out, "sampler", "update", "update packed")
  assert ("fits: every compiled program (not compiled: sampler, update, "
          "update packed) leaves >= 5%") in out
  rc, out = _aot("--config=configs/tiny.py", "--programs=update,decode")
  assert rc != 0 and "--programs: unknown ['decode']" in out, out


def test_lora_state_is_the_adapters_and_the_base_is_the_reference():
  """model.lora: the state is the adapters (+ Adam), the frozen base an
  argument of the update and of the scoring with β > 0 (no reference copy)."""
  rc, out = _aot("--config=configs/tiny.py", "--prompt_len=16",
                 "--config.model.lora.rank=4", "--config.rl.kl_beta=0.01",
                 "--config.rl.packing=off")
  assert rc == 0, out
  assert "(LoRA rank 4: adapters + optimizer state; frozen base" in out
  assert _names(out) == ["sampler", "update", "score", "eval greedy"], out


def test_packed_update_and_scoring_compile_and_fit():
  """rl.packing = on: only the packed update and packed scoring (π_old
  recomputed), 4 rows of 16 + 8 tokens per micro-batch on 4 row shards.
  The sampler and eval are test_tiny_fits' programs: named, not compiled."""
  rc, out = _aot("--config=configs/tiny.py", "--prompt_len=16",
                 "--config.rl.packing=on", "--config.rl.old_logp=recompute",
                 "--programs=update_packed,score_packed")
  assert rc == 0, out
  assert _names(out) == ["update packed", "score packed"], out
  _assert_not_compiled(out, "sampler", "eval greedy")
  for name in ("update packed", "score packed"):
    row = _row(out, name)
    assert row.split()[2] == "4" and row.endswith("yes"), row


def test_packed_shape_is_the_padded_rows_worst_case():
  """R: the micro-batch rounded up to the row shards; M: the padded
  path's micro-batch count; N: 4 slots per row, a power of two."""
  assert packed_shape(512, 64, 64) == (64, 8, 256)
  assert packed_shape(16, 2, 4) == (4, 4, 16)
  assert packed_shape(8192, 64, 8) == (64, 128, 256)
  assert aot.update_paths("auto") == (True, True)
  assert aot.update_paths("on") == (False, True)
  assert aot.update_paths("off") == (True, False)


def test_sampler_roofline_counts_waves_of_rows_per_call():
  """The step's sampler roofline: b·g rows decoded rows_per_call at a time
  (a static call's prompts x G, or continuous batching's slots), each wave
  t steps reading the weights and its rows' caches."""
  config = cli.load_config(os.path.join(ROOT, "configs", "tiny.py"))
  config.mesh.shape = (1, 1, 1)
  layout = sharding.Layout.from_config(config, jax.devices()[:1])
  model = get_preset(config.model.source)
  plan = Plan(config, model, layout, 16)
  chip = {"flops": 1e30, "bandwidth": 1.0}        # bytes only
  rows = config.rl.prompts_per_step * config.rl.num_generations   # 8
  t = config.sampling.max_new_tokens
  item = jnp.dtype(config.model.compute_dtype).itemsize
  weights = programs.per_chip_bytes(plan.state.params) * item / jnp.dtype(
      config.model.param_dtype).itemsize
  kv = lambda n: flops.decode_bytes_per_chip(
      model, n, model.num_kv_heads, 16, t, weights, item) - t * weights
  for per_call, waves in ((rows, 1), (rows // 4, 4), (3, 3)):
    got = aot.step_roofline(plan, chip, 1, per_call)["sampler"].seconds
    assert got == pytest.approx(waves * (t * weights + kv(per_call)))


def test_continuous_batching_sampler_compiles_and_fits():
  """sampling.continuous_batching: the tool compiles continuous.sample_slots
  on the step's rows; its rows column is the slots (sampling.slots). The
  updates and eval are test_tiny_fits' programs: named, not compiled."""
  rc, out = _aot("--config=configs/tiny.py", "--prompt_len=16",
                 "--config.sampling.continuous_batching=True",
                 "--config.sampling.slots=8", "--programs=sampler")
  assert rc == 0, out
  assert _names(out) == ["sampler slots"], out
  _assert_not_compiled(out, "update", "update packed", "eval greedy")
  row = _row(out, "sampler slots")
  assert row.split()[2] == "8" and row.endswith("yes"), row
  below = out.splitlines()[out.splitlines().index(row) + 1]
  assert "one decode step's collectives per chip, MB: all-" in below, out


def test_parked_engine_programs_of_a_multi_turn_config():
  """env.engine = parked: the engine's programs (its decode call, the
  prompts' prefill, an observation's prefill onto existing pages) replace
  the training sampler call, sized per row shard as the run sizes them; the
  update's rows are the prompt plus the episode's budget, 4 turns of 8
  tokens and 3 observations of 64 (224 tokens). The evaluation runs its
  episodes on the engine too: its programs at the evaluation's rows. The
  update (test_tiny_fits' at another length) is named, not compiled."""
  rc, out = _aot("--config=configs/tiny.py", "--prompt_len=16",
                 "--config.env.name=scripted", "--config.env.engine=parked",
                 "--config.sampling.continuous_batching=True",
                 "--config.sampling.kv_cache=paged", "--config.rl.packing=off",
                 "--config.train.eval_examples=4", "--programs=sampler,eval")
  assert rc == 0, out
  assert _names(out) == ["engine decode", "engine prefill", "engine observe",
                         "eval decode", "eval prefill", "eval observe"], out
  _assert_not_compiled(out, "update")
  assert "completions 224 (an episode's budget, env 'scripted')" in out
  # 8 rows over 4 row shards: 2 rows, 2 slots, each row's 240 columns on
  # 15 pages of 16.
  assert ("parked engine per row shard (4 shards of 1 chips): 2 rows, 2 "
          "slots, 30 pages of 16 columns (compute-dtype pages, 0.00 GiB, "
          "its KV heads split 1 ways)") in out, out
  assert "context 240 = prompt 16 + 4 turns x 8 + 3 observations x 64" in out
  assert _row(out, "engine observe").split()[2] == "2", out
  # 4 greedy evaluation episodes (train.eval_examples) over 4 row shards:
  # 1 row, 1 slot, 15 pages
  assert ("eval: parked engine per row shard (4 shards of 1 chips): 1 rows, "
          "1 slots, 15 pages") in out, out
  assert _row(out, "eval decode").split()[2] == "1", out


def test_decode_collectives_counts_one_decode_step():
  """Only collectives under the decode loop's body count, each once; an
  async collective counts its last result array."""
  scope = 'op_name="jit(f)/decode/while/body/dot"'
  hlo = "\n".join([
      f"  %a = bf16[8,4]{{1,0}} all-gather(%x), dimensions={{0}}, metadata={{{scope}}}",
      f"  %b = (f32[2], f32[6]) all-reduce-start(%y), metadata={{{scope}}}",
      f"  %c = f32[6]{{0}} all-reduce-done(%b), metadata={{{scope}}}",
      '  %d = f32[1000] all-reduce(%z), metadata={op_name="jit(f)/while/body/x"}',
      f"  %e = s32[3] add(%u, %v), metadata={{{scope}}}"])
  assert programs.decode_collectives(hlo) == (("all-gather", 64),
                                              ("all-reduce", 24))
  # every collective of the program, each op once (the update's count)
  assert programs.hlo_collectives(hlo) == (("all-gather", 64),
                                           ("all-reduce", 4024))


# Qwen2.5-0.5B's widths (vocab, heads, MLP) with 4 of its 24 layers: the
# sampler unrolls its layers, so the full depth costs compile time, not
# coverage (config.json is all experiments/aot.py reads).
QWEN_HALF_B_4_LAYERS = dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936,
    hidden_size=896, num_hidden_layers=4, num_attention_heads=14,
    num_key_value_heads=2, intermediate_size=4864,
    max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True, hidden_act="silu")


@pytest.mark.slow
def test_qwen_half_b_fits_with_scoring(tmp_path):
  """Qwen2.5-0.5B's widths, 4 layers, bf16 compute, KL to a reference
  (scoring compiled)."""
  (tmp_path / "config.json").write_text(json.dumps(QWEN_HALF_B_4_LAYERS))
  rc, out = _aot("--config=configs/grpo_gsm8k.py", "--prompt_len=64",
                 f"--config.model.source={tmp_path}",
                 "--config.sampling.max_new_tokens=64",
                 "--config.rl.prompts_per_step=4",
                 "--config.rl.num_generations=4",
                 "--config.rl.mini_batch_size=16",
                 "--config.rl.micro_batch_size=8",
                 "--config.train.eval_examples=4",
                 "--config.rl.packing=off")   # packed: the tiny tests
  assert rc == 0, out
  assert "0.20B params" in out
  for name in ("sampler", "update", "score", "eval greedy"):
    assert _row(out, name).endswith("yes"), out


@pytest.mark.slow
def test_oversized_micro_batch_is_reported():
  """Dense attention at 12k tokens: 16 rows per micro-batch need far more
  than a v5e chip; the tool says so and names a micro-batch that fits."""
  long = ["--config=configs/tiny.py", "--prompt_len=16",
          "--config.sampling.max_new_tokens=12272",
          "--config.rl.prompts_per_step=4", "--config.rl.num_generations=4",
          "--config.rl.micro_batch_size=16", "--config.train.eval_examples=1",
          "--config.sampling.chunk_rows=4", "--config.rl.packing=off"]
  rc, out = _aot(*long, "--config.model.attention=dense")
  assert rc == 1, out
  found = re.search(r"DOES NOT FIT: update does not fit with 16 rows; "
                    r"micro-batch \(rows\) (\d+) fits", out)
  assert found and int(found.group(1)) < 16, out
  rc, out = _aot(*long, "--config.model.attention=blockwise")
  assert rc == 0, out          # blockwise attention: the same batch fits
  assert _row(out, "update").endswith("yes"), out


def test_sampler_chunk_from_memory_budget():
  """The automatic chunk: the largest halving of the prompts whose KV cache
  takes at most KV_FRACTION of the budget."""
  c = get_preset("qwen2.5-0.5b")
  row = sampling.kv_cache_bytes(c, 1, 1000, 2)
  assert row == 2 * 24 * 2 * 64 * 1000 * 2
  budget = row * 64 * 16 / sampling.KV_FRACTION    # 64 prompts x G=16 fit
  size = sampling.CacheSize(c, 2)
  assert sampling.prompts_per_call(size, 512, 16, 1000, 0, budget) == 64
  assert sampling.prompts_per_call(size, 512, 16, 1000, 0, None) == 512
  assert sampling.prompts_per_call(size, 512, 16, 1000, 160, budget,
                                   multiple=4) == 12


def test_flops_by_hand():
  """A 1-layer model with round sizes, counted by hand."""
  c = get_preset("tiny")
  D, H, K, hd, F, V = (c.dim, c.num_heads, c.num_kv_heads, c.head_dim,
                       c.mlp_dim, c.vocab_size)
  body = c.num_layers * (D * (H + 2 * K) * hd + H * hd * D + 3 * D * F)
  assert flops.body_weights(c) == body
  # one prompt of 3 tokens, one row, 2 new tokens: prefill 3 tokens with
  # 6 causal pairs, head on 1; decode 2 tokens with 3*2 + 3 pairs, head on 2
  want = (2 * body * 3 + 2 * D * V * 1 + 4 * c.num_layers * H * hd * 6
          + 2 * body * 2 + 2 * D * V * 2 + 4 * c.num_layers * H * hd * 9)
  assert flops.sampler_flops(c, flops.StepShape(1, 1, 3, 2)) == want
  r = flops.roofline(2e12, 4, 1e12, bytes_per_chip=1e9, bandwidth=1e10)
  assert (r.seconds, r.bound) == (0.5, "compute")
  assert aot.halvings(48) == [48, 24, 12, 6, 3]


def test_window_columns_by_hand():
  """tiny-gemma (window 4: sliding, full, sliding): over t decode steps
  after p columns a full layer reads the integral of x from p to p + t
  columns, a sliding layer skipping its window's past of min(x, 4)."""
  c = get_preset("tiny-gemma")
  assert flops.layer_windows(c) == [4, None, 4]
  assert flops.kv_columns(c, 2, 6) == 3 * 30          # 2*6 + 6*6/2
  assert flops.kv_columns(c, 2, 6, skip_windows=True) == 30 + 2 * 22
  assert flops.kv_columns(c, 5, 3, skip_windows=True) == 19.5 + 2 * 12
  full = get_preset("tiny")
  assert flops.kv_columns(full, 2, 6, True) == flops.kv_columns(full, 2, 6)


def test_update_flops_at_the_rows_lengths():
  """Packed rows compute their own tokens: at every row's length = t the
  padded count; shorter rows, fewer FLOPs, by the hand count."""
  c, shape = get_preset("tiny"), flops.StepShape(2, 2, 3, 5)
  full = flops.update_flops(c, shape, "none", True)
  assert flops.update_flops(c, shape, "none", True, [5] * 4) == full
  got = flops.update_flops(c, shape, "none", False, [1, 2, 3, 4])
  tokens, pairs = 4 * 3 + 10, 4 * 6 + sum(L * 3 + L * (L + 1) / 2
                                          for L in (1, 2, 3, 4))
  want = (3 * 2.0 * flops.body_weights(c) * tokens
          + 4 * 2.0 * flops.head_weights(c) * 10
          + 3 * flops.attention_flops(c, pairs))
  assert got == pytest.approx(want)


def test_split_sync_and_memory():
  """The sampler's own chips hold its weights and a staging copy; the
  sync moves the larger of what a sampler chip receives and a trainer chip
  sends over one chip's ICI."""
  from grpo_jax.aot import split  # pylint: disable=import-outside-toplevel
  config = cli.load_config(os.path.join(ROOT, "configs", "tiny.py"))
  config.mesh.shape = (1, 1, 1)
  layout = sharding.Layout.from_config(config, jax.devices()[:1])
  side = split.SamplerSide(config, get_preset(config.model.source), layout, 16)
  w = side.weight_bytes()
  assert side.sampler_budget(10 * w) == 8 * w
  assert side.sampler_resident() == w
  ici = split.ICI_BANDWIDTH["TPU v5"]
  trainer = Plan(split.trainer_config(config, 8, 4, 1),
                 get_preset(config.model.source), layout, 16)
  assert trainer.micro_rows() == 2 and split.feasible(trainer)
  assert split.sync_cost(side, trainer, ici) == (w, w / ici)
  # Several hosts: the whole model gathered on each trainer chip (here it
  # holds it all: nothing to gather), then each sampler chip's slice.
  whole = sum(x.size * x.dtype.itemsize
              for x in jax.tree.leaves(side.sampler_params()))
  assert whole == w
  assert split.sync_cost(side, trainer, ici, hosts=2) == (0, w / ici)
  quarter = types.SimpleNamespace(weight_bytes=lambda: w // 4)  # 4-way split
  assert split.sync_cost(side, quarter, ici, hosts=2) == (
      w - w // 4, (w - w // 4 + w) / ici)


def test_int8_sampler_reads_half_the_weights_and_kv_bytes():
  """sampling.weights_dtype / kv_dtype = int8 in the pod check: the
  sampler's chips hold int8 weights beside the bf16 staging copy the sync
  sends, a decode step reads int8 weights and (paged) int8 columns with
  their scales, and the automatic pool holds the pages the same bytes do."""
  from grpo_jax.aot import sampler as pod_sampler  # pylint: disable=import-outside-toplevel
  from grpo_jax.aot import split  # pylint: disable=import-outside-toplevel
  config = cli.load_config(os.path.join(ROOT, "configs", "tiny.py"))
  config.mesh.shape = (1, 1, 1)
  config.model.compute_dtype = "bfloat16"
  config.sampling.update(continuous_batching=True, kv_cache="paged")
  layout = sharding.Layout.from_config(config, jax.devices()[:1])
  model = get_preset(config.model.source)
  bf16 = split.SamplerSide(config, model, layout, 16)
  config = config.copy_and_resolve_references()
  config.sampling.update(weights_dtype="int8", kv_dtype="int8")
  int8 = split.SamplerSide(config, model, layout, 16)
  w, q = bf16.weight_bytes(), int8.weight_bytes()
  assert 0.5 * w < q < 0.56 * w
  assert int8.sampler_budget(10 * w) == 10 * w - q - w   # + the staging copy
  assert split.sync_cost(int8, bf16, 1.0) == (w, w)      # bf16 travels
  chips = types.SimpleNamespace(count=1, spec={"bandwidth": 1.0, "flops": 1.0})
  cost = pod_sampler.step_cost(int8, chips)
  cost8 = pod_sampler.step_cost(int8, chips, "int8")
  E = model.head_dim
  assert cost8.column_bytes / cost.column_bytes == pytest.approx((E + 4) / (2 * E))
  assert cost8.weight_bytes == q
  assert pod_sampler.pool_pages(int8, 64) > 1.5 * pod_sampler.pool_pages(bf16, 64)


def test_schedule_only_compares_dense_and_paged_slots():
  """--schedule_only: no compile, the simulated schedules of both samplers
  on the same lognormal rows, and the step's roofline from the paged one."""
  rc, out = _aot("--config=configs/tiny.py", "--prompt_len=16",
                 "--config.sampling.continuous_batching=True",
                 "--config.sampling.kv_cache=paged",
                 "--config.sampling.max_new_tokens=64",
                 "--lengths=lognormal:0.3", "--schedule_only")
  assert rc == 0, out
  assert "clipped mean 0.3 of the cap" in out
  dense, paged = _row(out, "  dense").split(), _row(out, "  paged ").split()
  assert dense[1] == "2" and int(paged[1]) >= 2, out
  assert "paged / dense: time" in out and "program" not in out
  roof = next(x for x in out.splitlines() if "FLOPs  roofline" in x)
  assert roof.startswith("  sampler") and roof.endswith("(memory-bound)")


# Qwen2.5-32B's head width (128, the TPU kernel's lane width) at a toy size.
KERNEL_SIZED = dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=512,
    hidden_size=512, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=512,
    max_position_embeddings=4096, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True, hidden_act="silu")


@pytest.mark.slow
def test_split_compiles_the_paged_sampler_and_the_update(tmp_path):
  """--sampler_devices=2 on v5e:2x2: the paged sampler (the Pallas kernel
  inside shard_map) on 2 chips, the update on the other 2, both fit."""
  (tmp_path / "config.json").write_text(json.dumps(KERNEL_SIZED))
  rc, out = _aot("--config=configs/tiny.py", "--prompt_len=16",
                 f"--config.model.source={tmp_path}",
                 "--config.sampling.continuous_batching=True",
                 "--config.sampling.kv_cache=paged",
                 "--lengths=lognormal:0.3", "--sampler_devices=2")
  assert rc == 0, out
  assert "split 2 sampling (v5e:2x2) + 2 training chips (v5e:2x2)" in out
  assert _row(out, "sampler paged").endswith("yes"), out
  assert _row(out, "update").endswith("yes"), out
  assert "the colocated loop's paged sampler, for its collectives" in out
  assert "with the decode steps' collectives not overlapped" in out


SPLIT_MESHES = """
import json, sys
import ml_collections
from grpo_jax import sharding
from grpo_jax.aot import programs, split
chips = programs.topology_devices("v5p:4x4x4")      # 16 hosts x 4 chips
out = {}
for n in (16, 24, 32, 48):
  grid = ml_collections.ConfigDict(dict(shape=(-1, 4 if n % 16 == 0 else 2, 4),
                                        axes=("data", "fsdp", "tensor")))
  train, sample = split.placement(chips, n)
  for role, devices in (("trainer", train), ("sampler", sample)):
    mesh = sharding.make_mesh(grid, devices).devices
    hop = lambda a, b: sum(abs(x - y) for x, y in zip(a.coords, b.coords))
    out[f"{n} {role}"] = dict(
        n=len(devices), hosts=len({d.process_index for d in devices}),
        shape=list(mesh.shape),
        ids=sorted(d.id for d in mesh.flat),
        tensor_hops=sorted({hop(m[i], m[i + 1]) for m in
                            mesh.reshape(-1, mesh.shape[-1])
                            for i in range(mesh.shape[-1] - 1)}))
print(json.dumps(out))
"""


def test_a_runs_split_of_a_pod_builds_both_meshes():
  """rollout.sampler_devices on a v5p slice gives each host's last chips to
  the sampler: every other row of chips, or a chip in four, not a cuboid,
  which jax's mesh helper refused (AssertionError); 24 (1.5 per host) is
  no grid at all. Both roles' meshes now build, span every host, cover
  their chips once, and keep the tensor axis on chips one link apart."""
  out = _script_json(SPLIT_MESHES)
  for n in (16, 24, 32, 48):
    s, t = out[f"{n} sampler"], out[f"{n} trainer"]
    assert (s["n"], t["n"]) == (n, 64 - n)
    fsdp = 4 if n % 16 == 0 else 2
    assert (s["shape"], t["shape"]) == ([n // fsdp // 4, fsdp, 4],
                                        [(64 - n) // fsdp // 4, fsdp, 4])
    assert s["hosts"] == t["hosts"] == 16
    assert sorted(s["ids"] + t["ids"]) == list(range(64))
    assert len(set(s["ids"])) == n
    assert s["tensor_hops"] == t["tensor_hops"] == [1], (n, s, t)


def test_collectives_not_overlapped_add_to_each_sampler():
  """Per-step collective bytes x the schedule's decode steps at the ICI
  bandwidth, added to each side's sampler; the split's step is its slower
  side plus the sync."""
  from grpo_jax.aot import split, split_check  # pylint: disable=import-outside-toplevel
  program = lambda mb: types.SimpleNamespace(
      collectives=(("all-gather", mb * 0.75e6), ("all-reduce", mb * 0.25e6)))
  sched = lambda steps: types.SimpleNamespace(steps=steps)
  assert split_check.collective_seconds(program(600), sched(1000), 600e9) == 1.0
  s = types.SimpleNamespace(sampler_seconds=90.0, trainer_seconds=95.0,
                            sync_seconds=0.5, step=95.5,
                            one_step=sched(2000))
  line, = split_check.format_collectives(
      s, program(300), split.Colocated(None, sched(1000), 60.0, 40.0),
      program(600), (600e9, 600e9))
  # colocated 60 + 1 + 40 = 101 s; split max(90 + 1, 95) + 0.5 = 95.5 s
  assert "+1.0 s (1000 steps), split sampler +1.0 s (2000 steps)" in line
  assert "step 95.5 s = 0.946x the colocated 101.0 s" in line
  assert "(all overlapped: 0.955x)" in line


MOE_DISPATCH = """
import json
from grpo_jax import sharding
from grpo_jax.aot import programs
from grpo_jax.aot.plan import Plan
from grpo_jax.harness import cli
from grpo_jax.models import get_preset
chips = programs.topology_devices("v5e:2x2")
out = {}
for dispatch in ("auto", "ragged"):
  config = cli.load_config("configs/tiny.py")
  config.model.source = "tiny-moe"
  config.mesh.shape = (1, 1, 4)            # 8 experts, 2 per chip
  config.model.moe.dispatch = dispatch
  layout = sharding.Layout(sharding.make_mesh(config.mesh, chips),
                           sharding.logical_rules(config.mesh))
  plan = Plan(config, get_preset("tiny-moe"), layout, 16)
  out[dispatch] = [plan.layout.mesh.devices.flat[0].platform,
                   dict(plan.score(plan.micro_rows()).program_collectives)]
print(json.dumps(out))
"""


def test_auto_dispatch_compiles_all_to_all_for_a_tpu_topology():
  """model.moe.dispatch = auto on TPU chips whose mesh splits the experts
  (tiny-moe's 8 over tensor 4 of v5e:2x2): the trainer's compiled forward
  (the scoring program: the update's forward, a fraction of its compile) moves
  tokens by all-to-all; `ragged` leaves the grouped matmul to the
  partitioner, which compiles none."""
  out = _script_json(MOE_DISPATCH)
  (platform, auto), (_, ragged) = out["auto"], out["ragged"]
  assert platform == "tpu", out
  assert auto.get("all-to-all", 0) > 0, out
  assert "all-to-all" not in ragged, out


POOL_LAYOUTS = """
import functools, json, re
import jax, jax.numpy as jnp
from jax.sharding import SingleDeviceSharding
from grpo_jax.aot import programs
from grpo_jax.models import page_layout, paged
from grpo_jax.models.int8_pages import Int8Pages
chip = SingleDeviceSharding(programs.topology_devices("v5p:2x2x1")[0])
W, K, Z, E, M, J = 256, 2, 16, 128, 16, 8
lay = page_layout.REFERENCE_LAYOUT
a = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=chip)

def steps(pool, new_mke, page_m, offset_m, table_mj, length_m, q_mhe):
  for _ in range(2):    # write, then read, twice: a decode loop's pattern
    pool = lay.write_step(pool, new_mke, page_m, offset_m)
    out = paged._attend_pages(q_mhe, pool, pool, length_m, table_mj,
                              jnp.zeros_like(length_m),
                              paged.Buckets(layout=lay))
    new_mke = out[:, :K].astype(new_mke.dtype)
  return pool, out

out = {}
for name, pool, dtype, pattern in (
    ("int8", Int8Pages(a((W, K, Z, E), jnp.int8), a((W, K, Z), jnp.float32)),
     jnp.float32, "s8"),
    ("bf16", a((W, K, Z, E), jnp.bfloat16), jnp.bfloat16, "(?:bf16|u16)")):
  hlo = jax.jit(steps, donate_argnums=0).lower(
      pool, a((M, K, E), dtype), a((M,), jnp.int32), a((M,), jnp.int32),
      a((M, J), jnp.int32), a((M,), jnp.int32),
      a((M, 4, E), jnp.bfloat16)).compile().as_text()
  found = re.findall(pattern + r"\\[%d,%d,%d,%d\\]\\{([^}]*)\\}" % (W, K, Z, E), hlo)
  out[name] = sorted({re.sub(r"S\\(\\d+\\)", "", f) for f in found})

def kernel_steps(kernel, kp, vp, new_mke, page_m, offset_m, table_mj, length_m,
                 q_mhe):
  for _ in range(2):
    kp = kernel.write_step(kp, new_mke, page_m, offset_m)
    vp = kernel.write_step(vp, new_mke, page_m, offset_m)
    out = paged.kernel_attention(q_mhe, kp, vp, length_m, table_mj)
    new_mke = out[:, :K].astype(new_mke.dtype)
  return kp, vp, out

pool = a((K, W, Z, E), jnp.bfloat16)
hlo = jax.jit(functools.partial(kernel_steps, page_layout.KERNEL_LAYOUT),
              donate_argnums=(0, 1)).lower(
    pool, pool, a((M, K, E), jnp.bfloat16), a((M,), jnp.int32),
    a((M,), jnp.int32), a((M, J), jnp.int32), a((M,), jnp.int32),
    a((M, 8, E), jnp.bfloat16)).compile().as_text()
out["kernel copies"] = [line.strip()[:120] for line in hlo.splitlines() if re.search(
    r"= (?:bf16|u16)\\[%d,%d,%d,%d\\]\\{[^}]*\\} copy\\(" % (K, W, Z, E), line)]

Z8 = 128           # int8 pages on the int8 kernel, pages first, page size 128
pool = Int8Pages(a((W, K, Z8, E), jnp.int8), a((W, K, Z8), jnp.float32))
hlo = jax.jit(functools.partial(kernel_steps, lay), donate_argnums=(0, 1)).lower(
    pool, pool, a((M, K, E), jnp.bfloat16), a((M,), jnp.int32),
    a((M,), jnp.int32), a((M, J), jnp.int32), a((M,), jnp.int32),
    a((M, 10, E), jnp.bfloat16)).compile().as_text()
out["int8 kernel"] = "tpu_custom_call" in hlo
out["int8 kernel copies"] = [line.strip()[:120] for line in hlo.splitlines() if re.search(
    r"\\[%d,%d,%d(?:,%d)?\\]\\{[^}]*\\} copy\\(" % (W, K, Z8, E), line)]
print(json.dumps(out))
"""


def test_paged_writes_keep_the_pool_in_one_layout_on_a_tpu():
  """A decode step's write (`PoolLayout.write_step`) on a TPU chip (v5p):
  the reference's pool, int8 or bf16, keeps one layout through writes and
  gathers, and the kernels' (heads first, bf16; int8 pages first at page
  size 128, whose heads-first scales were copied) are not copied around
  them. A
  write that scattered one (K, E) column per row made XLA:TPU hold a
  second layout of the pool (the reference's: 2 heads on the second-minor
  axis, the int8 pool padded to twice its bytes) and copy it between the
  two every layer and step."""
  out = _script_json(POOL_LAYOUTS)
  assert len(out["int8"]) == 1 and len(out["bf16"]) == 1, out
  assert not out["kernel copies"], out    # heads first, the TPU kernel's
  assert out["int8 kernel"] and not out["int8 kernel copies"], out


def test_peak_is_the_compilers_where_it_reports_one():
  """A program's bytes: the compiler's peak (memory_analysis's
  peak_memory_in_bytes) where reported, else arguments + outputs -
  aliased + temporaries; the verdict reads the same figure."""
  summed = programs.Program("sampler", 8, 10 * programs.GiB, 2 * programs.GiB, 1 * programs.GiB,
                            100 * programs.GiB, 5 * programs.GiB)
  assert summed.peak == 111 * programs.GiB and summed.total == 116 * programs.GiB
  reported = summed._replace(compiler_peak=40 * programs.GiB)
  assert reported.peak == 40 * programs.GiB and reported.total == 45 * programs.GiB
  assert reported.fits(50 * programs.GiB) and not summed.fits(50 * programs.GiB)
