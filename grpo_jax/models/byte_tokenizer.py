"""A byte-level tokenizer for the `tiny` preset (tests, CI, smoke runs).

Ids 0..255 are the bytes; id 0 (NUL, never in text) is both EOS and padding,
so the 256-token `tiny` model can read and write any text.
"""
from __future__ import annotations

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from grpo_jax.models.tokenizer import Tokenizer

_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                  "{% endfor %}{% if add_generation_prompt %}assistant: "
                  "{% endif %}")


def byte_tokenizer() -> Tokenizer:
  byte_chars = pre_tokenizers.ByteLevel.alphabet()
  table = {c: i for i, c in enumerate(sorted(byte_chars, key=_byte_of))}
  backend = tokenizers.Tokenizer(models.BPE(vocab=table, merges=[]))
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                   use_regex=False)
  backend.decoder = decoders.ByteLevel()
  eos = next(c for c, i in table.items() if i == 0)
  return Tokenizer(backend, _CHAT_TEMPLATE, {"eos_token": eos})


def _byte_of(char: str) -> int:
  """GPT-2's printable stand-in character -> the byte it stands for."""
  bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1)))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(map(chr, cs), bs))[char]
