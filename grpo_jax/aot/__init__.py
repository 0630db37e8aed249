"""Ahead-of-time compiles for TPU topologies on this CPU: per-chip memory of
every program of a config (`check`), FLOPs and the roofline (`flops`)."""
