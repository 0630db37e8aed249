"""Environments of multi-turn episodes: the interface (`base`) and the
built-in envs, registered as kind "env": python (code sandbox), calculator
(safe arithmetic), scripted (tests). docs/agents.md."""
from grpo_jax.envs import base, calculator, python_tool, scripted  # noqa: F401
from grpo_jax.envs.base import Done, Env, EnvSpec, Observation  # noqa: F401
