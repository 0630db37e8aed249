"""SAMPLE and SCORE: the static and continuous-batching samplers over one
decoding contract, and the rollout (sample, score, group) that RL, STaR and
evaluation share."""
