"""Countdown: reach the target with the given numbers and + - * / ( ).

The equation is parsed by `ast.parse` on a string restricted to digits,
operators, parentheses and spaces, and evaluated by walking the tree with
exact fractions. Nothing is ever passed to `eval`.
"""
from __future__ import annotations

import ast
import collections
import re
from fractions import Fraction
from typing import Any, Mapping

import numpy as np

from grpo_jax.registry import register
from grpo_jax.rewards import extract
from grpo_jax.rewards._common import per_completion

MAX_EQUATION_CHARS = 256
_ALLOWED = re.compile(r"[\d\s+\-*/().]+")
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
        ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}


class _Invalid(Exception):
  """The equation is not plain arithmetic on integers."""


def _walk(node: ast.AST, used: list[int]) -> Fraction:
  """Exact value of an arithmetic tree; records the integer literals used."""
  if isinstance(node, ast.Expression):
    return _walk(node.body, used)
  if isinstance(node, ast.Constant) and type(node.value) is int:  # pylint: disable=unidiomatic-typecheck
    used.append(node.value)
    return Fraction(node.value)
  if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
    left, right = _walk(node.left, used), _walk(node.right, used)
    if isinstance(node.op, ast.Div) and right == 0:
      raise _Invalid("division by zero")
    return _OPS[type(node.op)](left, right)
  if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
    value = _walk(node.operand, used)
    return -value if isinstance(node.op, ast.USub) else value
  raise _Invalid(type(node).__name__)


def evaluate(expression: str) -> tuple[Fraction, list[int]] | None:
  """(value, numbers used) of an arithmetic expression; None if invalid."""
  expression = expression.replace("\u00d7", "*").replace("\u00f7", "/").strip()
  if len(expression) > MAX_EQUATION_CHARS or not _ALLOWED.fullmatch(expression):
    return None
  try:
    used: list[int] = []
    return _walk(ast.parse(expression, mode="eval"), used), used
  except (_Invalid, SyntaxError, ValueError, RecursionError, MemoryError):
    return None


def extract_equation(completion: str) -> str | None:
  """The last <answer>…</answer>, else \\boxed{}/`Answer:`; its side with
  the most operators if it is written as an equation ("(1+2)*4 = 12")."""
  text = extract.last_tagged(completion, "answer")
  if text is None:
    text = extract.last_boxed(completion) or extract.anchored_span(completion)
  if not text:
    return None
  sides = text.replace("\\times", "*").replace("\\div", "/").split("=")
  return max(sides, key=lambda s: sum(s.count(op) for op in "+-*/"))


def _task(answer: Any) -> tuple[int, list[int]]:
  """(target, numbers) from {"target": t, "numbers": [...]} or (t, [...])."""
  if isinstance(answer, Mapping):
    return int(answer["target"]), [int(n) for n in answer["numbers"]]
  target, numbers = answer
  return int(target), [int(n) for n in numbers]


def score(completion: str, target: int, numbers: list[int],
          use_all: bool = False) -> bool:
  """True if the equation uses each given number at most once (exactly once
  if `use_all`) and evaluates to `target`."""
  equation = extract_equation(completion)
  result = evaluate(equation) if equation else None
  if result is None:
    return False
  value, used = result
  available, spent = collections.Counter(numbers), collections.Counter(used)
  if spent - available:  # A number not given, or used too often.
    return False
  if use_all and spent != available:
    return False
  return value == target


@register("reward", "countdown")
def countdown_reward(prompts, completions, answers, completion_lengths, *,
                     use_all: bool = False) -> np.ndarray:
  """1 if the completion's equation reaches the target, else 0."""
  del prompts, completion_lengths
  tasks = [_task(a) for a in per_completion(answers, len(completions))]
  return np.array([float(score(c, t, n, use_all))
                   for c, (t, n) in zip(completions, tasks)], np.float32)
