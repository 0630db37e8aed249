"""The RL loop (GRPO, DAPO and the losses that followed): `train.run`, the
jitted update over packed or padded micro-batches, sequence packing, and
the sampler apart from the trainer (async_rollouts, weight_sync)."""
