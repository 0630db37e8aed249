# Makes `import grpo_jax` work from a plain checkout (pytest puts this folder on sys.path).
