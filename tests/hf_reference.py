"""transformers models as parity references: random weights far from their
init, and their per-token log-softmax (tests of models/hf loading)."""
import numpy as np
import torch


def randomize(model, seed: int = 0, norm_offset: float = 0.0):
  """Weights ~N(0, 0.1), vectors (norms, biases) ~N(norm_offset, 0.3), so a
  layout error or a missing norm offset shows; the model in eval mode."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for p in model.parameters():
      p.copy_(torch.randn(p.shape, generator=gen)
              * (0.3 if p.ndim == 1 else 0.1) + (norm_offset if p.ndim == 1 else 0))
  return model.eval()


def logprobs(model, tokens) -> np.ndarray:
  """float32 log-softmax of the model's logits on `tokens` (N, S)."""
  with torch.no_grad():
    logits = model(torch.tensor(np.asarray(tokens))).logits
  return torch.log_softmax(logits.float(), -1).numpy()
