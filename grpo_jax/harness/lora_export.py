"""Exporting a LoRA run's checkpoint (adapters only) for Hugging Face.

A LoRA checkpoint holds the adapters, their optimizer state and, in its
host state, what identifies the frozen base ("lora_base": model.source,
dtype, checksum; `experiment.base_identity`). `export` loads that base,
checks it is the one the adapters were trained on, and writes

  hf    the merged model W + α/r·A·B (float32) as a transformers directory
        (`save_pretrained`), or
  peft  adapter_config.json + adapter_model.safetensors, which
        `peft.PeftModel.from_pretrained(base_model, directory)` loads onto
        the transformers model of the base (`lora.save_peft_adapter`).
"""
from __future__ import annotations

import ml_collections

from grpo_jax import checkpoint, errors
from grpo_jax.harness import experiment
from grpo_jax.models import lora, save_pretrained

FORMATS = ("hf", "peft")


def lora_config(source, step) -> ml_collections.ConfigDict | None:
  """The run config of a checkpoint if it trained LoRA adapters, else None."""
  saved = checkpoint.load_config(source, step)
  if not saved or not saved.get("model", {}).get("lora", {}).get("rank"):
    return None
  return ml_collections.ConfigDict(saved)


def load_base(config, source, step, base_source: str = ""):
  """The frozen base the checkpoint's adapters belong to (from model.source,
  or `base_source` where the base has moved), checked against its
  "lora_base" identity."""
  saved = checkpoint.load_host_state(source, step).get("lora_base")
  if saved is None:
    raise errors.CheckpointError(
        f"checkpoint {source} step {step} trained LoRA adapters but does not "
        "record its base (host state 'lora_base')")
  config.model.source = base_source or config.model.source
  config.model.compute_dtype = saved["dtype"]
  _, base = experiment.load_model(config)   # LoRA: in the compute dtype
  identity = experiment.base_identity(config, base)
  if identity["checksum"] != saved["checksum"]:
    raise errors.CheckpointError(
        f"the base {config.model.source!r} is not the one the adapters of "
        f"{source} step {step} were trained on: checksum "
        f"{identity['checksum']} != {saved['checksum']} (saved {saved})")
  return base


def export(source, step, out_dir, fmt: str = "hf", base_source: str = "",
           tokenizer=None):
  """Writes checkpoint `step` of `source` (a workdir, checkpoints dir or step
  dir) to `out_dir` as `fmt`: merged HF weights or a PEFT adapter directory
  (LoRA checkpoints); a full fine-tuning checkpoint exports as hf only."""
  if fmt not in FORMATS:
    raise errors.ConfigError(f"--format={fmt!r}; allowed: {FORMATS}")
  directory, step = checkpoint.find_step(source, step)
  config = lora_config(directory, step)
  if config is None:
    if fmt == "peft":
      raise errors.ConfigError(
          f"{directory} step {step} is a full fine-tuning checkpoint "
          "(model.lora.rank = 0): it has no adapters; export --format=hf")
    return checkpoint.export_checkpoint(directory, step, out_dir,
                                        tokenizer=tokenizer)
  spec = lora.LoraSpec.from_config(config)
  adapters = checkpoint.load_params(directory, step=step)
  if fmt == "peft":
    return lora.save_peft_adapter(adapters, spec, out_dir,
                                  base_source or config.model.source)
  model_config = checkpoint.load_model_config(directory, step)
  base = load_base(config, directory, step, base_source)
  merged = lora.merge(base, adapters, spec.scale, dtype="float32")
  return save_pretrained(model_config, merged, out_dir, tokenizer=tokenizer)
