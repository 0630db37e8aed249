"""grpo_jax: STaR, GRPO and DAPO post-training of language-model reasoners in JAX.

Importing the package registers every name a config can use (see
`grpo_jax.registry`): data sets, layouts, tasks and templates (`data`),
rewards (`rewards`), advantages, loss aggregations and KL estimators
(`algorithms`), model presets and bundled weights (`models`), maj@k answer
readers (`evaluation`) and the methods, i.e. the loops: "rl" (`train`) and
"star" (`star_loop`).

Shape letters, one meaning in every name (`reward_bg`, `logp_nt`,
`tokens_ns`):

    b  prompts (groups)            g  generations per prompt
    n  rows, n = b*g (or any rows  t  completion tokens
       of a batch)                 p  prompt tokens
    s  p + t (a row: prompt then   v  vocabulary
       completion)                 l  layers;  d  model width

The model code (`models/`, `algorithms/logprobs.py`) does not know about
groups: there `b` is any batch of sequences and `t` their length.
"""
__version__ = "0.1.0"

# pylint: disable=wrong-import-position,unused-import
from grpo_jax import algorithms, data, models, rewards
from grpo_jax import evaluation, star_loop, train
