"""Config validation, once at start: every field's name and kind, the
allowed values, registry names, ranges and the fields that must agree.

`validate(config)` fails with an `errors.ConfigError` naming the field and
what is allowed, before any compile or data load. Modules: `fields` (the
fields across the config), `groups` (each group's own checks); the public
names are importable from here.
"""
from __future__ import annotations

from grpo_jax.validation.fields import unknown_field, validate
from grpo_jax.validation.groups import sampler_rows
