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

from grpo_jax import checkpoint, errors
from grpo_jax.harness import experiment
from grpo_jax.models import lora, save_pretrained

FORMATS = ("hf", "peft")


def export(source, step, out_dir, fmt: str = "hf", base_source: str = "",
           tokenizer=None):
  """Writes checkpoint `step` of `source` (a workdir, checkpoints dir or step
  dir) to `out_dir` as `fmt`: merged HF weights or a PEFT adapter directory
  (LoRA checkpoints); a full fine-tuning checkpoint exports as hf only."""
  if fmt not in FORMATS:
    raise errors.ConfigError(f"--format={fmt!r}; allowed: {FORMATS}")
  directory, step = checkpoint.find_step(source, step)
  config = experiment.lora_run_config(directory, step)
  adapters = (checkpoint.load_params(directory, step=step)
              if config is not None else None)
  if adapters is None or not lora.is_adapters(adapters):
    if fmt == "peft":   # full weights (rank 0, or STaR's merged M_n)
      raise errors.ConfigError(
          f"{directory} step {step} holds full weights, not adapters: "
          "export --format=hf")
    return checkpoint.export_checkpoint(directory, step, out_dir,
                                        tokenizer=tokenizer)
  spec = lora.LoraSpec.from_config(config)
  if fmt == "peft":
    return lora.save_peft_adapter(adapters, spec, out_dir,
                                  base_source or config.model.source)
  model_config = checkpoint.load_model_config(directory, step)
  base = experiment.load_lora_base(config, directory, step, base_source)
  merged = lora.merge(base, adapters, spec.scale, dtype="float32")
  return save_pretrained(model_config, merged, out_dir, tokenizer=tokenizer)
