"""The RL loop (GRPO, DAPO and the losses that followed): `train.run`, the
jitted update over packed or padded micro-batches, and sequence packing."""
