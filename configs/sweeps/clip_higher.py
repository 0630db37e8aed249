"""DAPO's clip-higher ablation in miniature: the upper clip range ε_high.

ε_high = 0.2 is PPO/GRPO's symmetric clip; 0.28 is DAPO's decoupled
"clip-higher" (Yu et al. 2025, sec. 3.1), which lets low-probability tokens
grow and keeps entropy from collapsing. Run on the local DAPO config:

  python experiments/sweep.py --config=configs/dapo_aime.py:local \
      --sweep=configs/sweeps/clip_higher.py
"""


def get_sweep():
  return [{"rl.eps_high": 0.2}, {"rl.eps_high": 0.28}]
