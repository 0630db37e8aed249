"""The record every data source yields (readers raise `errors.DataError`)."""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Example:
  """One problem.

  Attributes:
    question: the problem as shown to the model, without any answer-format
      instructions (prompt templates add those).
    answer: the gold answer as a string ("42", "\\frac{1}{2}", "B", or a
      Countdown expression); rewards verify predictions against it.
    choices: the options of a multiple-choice problem, in the order shown
      (lettered A, B, ...); None for open-ended problems.
    rationale: a worked solution when the source has one (GSM8K, MATH,
      generated word problems); a hint source for STaR, never part of a prompt
      unless a caller puts it there.
    meta: source-specific extras: "level" (int) for generated tasks and MATH,
      "data_source", "index", Countdown "numbers"/"target", ...
  """

  question: str
  answer: str
  choices: tuple[str, ...] | None = None
  rationale: str | None = None
  meta: dict[str, Any] = dataclasses.field(default_factory=dict)
