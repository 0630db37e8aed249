"""grpo_jax: STaR, GRPO and DAPO post-training of language-model reasoners in JAX.

Importing the package registers every name a config can use (see
`grpo_jax.registry`): data sets, layouts, tasks and templates (`data`),
rewards (`rewards`), advantages, loss aggregations and KL estimators
(`algorithms`), model presets and bundled weights (`models`), maj@k answer
readers (`evaluation`) and the methods, i.e. the loops: "rl" (`rl.train`)
and "star" (`star.loop`).

Shape letters, one meaning in every name and file (`reward_bg`, `logp_nt`,
`tokens_ns`, `q_nqhe`):

    b  prompts (groups)             g  generations per prompt
    n  rows, n = b*g (or any rows   t  completion tokens
       of a batch)                  p  prompt tokens
    s  a row's columns, p + t (or   v  vocabulary
       any sequence of tokens)      l  layers;  d  model width
    q  query columns: the last q    h  query heads;  k  KV heads
       of the s (s, t, or 1)        e  head width
    m  cache slots (continuous      r  packed rows: rows of s
       batching, continuous.py)        columns holding several
                                       sequences (packing.py)
    w  pages of a KV page pool      z  columns of a page
       (models/paged.py)            j  a row's page-table entries
    x  experts of an MoE layer      c  experts chosen per token
       (models/moe.py)

A name's shape suffix is its last `_` part: these letters in axis order
(`logits_nsv` is [n, s, v]); a trailing 1 is a kept axis of size one
(`adv_n1`); upper case is a size (`N`, `T`). Rows of a group are `bg` or `n`,
never `b` followed by `t`, `s` or `q` (tests/test_architecture.py checks).
"""

__version__ = "0.1.0"

# pylint: disable=wrong-import-position,unused-import
import grpo_jax.harness.pipeline  # the method "pipeline"
import grpo_jax.rl.train  # the method "rl"
import grpo_jax.star.loop  # the method "star"
import grpo_jax.star.sft_run  # the method "sft"
from grpo_jax import algorithms, data, envs, evaluation, models, rewards
