"""STaR's pure pieces (Zelikman et al. 2022): the checks a rationale must pass
to be kept (its arithmetic is checked by `grpo_jax/rewards/equations.py`,
which the process reward shares), the fine-tuning schedule and the few-shot
split. The loop that uses them is `grpo_jax/star/loop.py`.
"""
from __future__ import annotations

import re
from typing import Sequence

from grpo_jax.data.example import Example


def mentions_hint(text: str, hint: str) -> bool:
  """A rationalisation that talks about its hint ("as the hint says") or
  repeats it ("The correct answer is B.") is no rationale for the prompt it
  is stored with, which has no hint; and the hint must never reach a stored
  example."""
  return "hint" in text.lower() or hint in text


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_LIST_MARKER = re.compile(r"^\s*(?:\d+[.)]|[-*\u2022])\s+")


def reasoning(text: str) -> str:
  """What a completion offers as the derivation of its answer: the text
  without its final answer statement (the last line, or the last sentence
  of a one-line reply) and without any sentence that states an answer
  (contains "answer"): "1. The answer is 31.\n2. The answer is 31." derives
  nothing, "14 + 17 = 31." does. Sentences end at . ! ? before whitespace;
  list markers ("3. ", "- ") are not part of a line's text."""
  lines = [_LIST_MARKER.sub("", l) for l in text.strip().split("\n")
           if l.strip()]
  if len(lines) == 1:
    lines = _SENTENCE_END.split(lines[0])
  sentences = [s for line in lines[:-1] for s in _SENTENCE_END.split(line)]
  return " ".join(s for s in sentences if "answer" not in s.lower())


def finetune_steps(star, iteration: int) -> int:
  """Steps of outer iteration n >= 1: sft_steps * sft_growth^(n-1) (paper:
  40 steps, 20% more each iteration)."""
  return max(1, int(round(star.sft_steps * star.sft_growth ** (iteration - 1))))


def split_shots(problems: Sequence[Example], k: int
                ) -> tuple[list[Example], list[Example]]:
  """The first k problems with a gold rationale become few-shot exemplars
  (the paper's small prompt set P); the rest stay problems."""
  with_rationale = [i for i, p in enumerate(problems) if p.rationale]
  if len(with_rationale) < k:
    raise ValueError(f"star.few_shot={k} exemplars need gold rationales; "
                     f"the data has {len(with_rationale)}")
  chosen = set(with_rationale[:k])
  return ([problems[i] for i in sorted(chosen)],
          [p for i, p in enumerate(problems) if i not in chosen])
