"""Generated arithmetic tasks: multi-digit arithmetic and Countdown.

A task is a function `(rng: random.Random, level: int) -> Example` registered
under kind "task"; `generated.py` turns tasks into seeded data sets.
"""
from __future__ import annotations

import ast
import dataclasses
import fractions
import random

from grpo_jax.data.example import Example
from grpo_jax.registry import register


@dataclasses.dataclass(frozen=True)
class ArithmeticSpec:
  """What a level of the arithmetic task asks: operand count, digits, operators."""
  num_operands: int
  digits: int
  operators: str


# Level 1 is single-digit addition, the level a 135M model gets partly right.
_ARITHMETIC_LEVELS = {
    1: ArithmeticSpec(2, 1, "+"),
    2: ArithmeticSpec(2, 1, "+-*"),
    3: ArithmeticSpec(2, 2, "+-"),
    4: ArithmeticSpec(3, 2, "+-*"),
    5: ArithmeticSpec(3, 3, "+-*"),
}


def arithmetic_spec(level: int) -> ArithmeticSpec:
  """The spec of `level` (>= 1); past level 5 each level adds one 3-digit operand."""
  if level < 1:
    raise ValueError(f"arithmetic level must be >= 1, got {level}")
  return _ARITHMETIC_LEVELS.get(level) or ArithmeticSpec(level - 2, 3, "+-*")


def evaluate_integer_expression(numbers: list[int], operators: list[str]) -> int:
  """n0 op0 n1 op1 ... with `*` before `+`/`-`, left to right otherwise."""
  terms, signs = [numbers[0]], []
  for op, number in zip(operators, numbers[1:]):
    if op == "*":
      terms[-1] *= number
    else:
      terms.append(number)
      signs.append(op)
  total = terms[0]
  for sign, term in zip(signs, terms[1:]):
    total = total + term if sign == "+" else total - term
  return total


@register("task", "arithmetic")
def arithmetic_problem(rng: random.Random, level: int) -> Example:
  """"What is 47 + 8 * 3?" with an integer answer (may be negative)."""
  spec = arithmetic_spec(level)
  low = 1 if spec.digits == 1 else 10 ** (spec.digits - 1)
  numbers = [rng.randint(low, 10 ** spec.digits - 1) for _ in range(spec.num_operands)]
  operators = [rng.choice(spec.operators) for _ in range(spec.num_operands - 1)]
  expression = " ".join([str(numbers[0])] + [f"{o} {n}" for o, n in zip(operators, numbers[1:])])
  value = evaluate_integer_expression(numbers, operators)
  return Example(question=f"What is {expression}?", answer=str(value),
                 rationale=f"{expression} = {value}.",
                 meta={"level": level, "expression": expression})


# ---------------------------------------------------------------- Countdown


def countdown_spec(level: int) -> tuple[int, int]:
  """(how many numbers, largest number) of a Countdown level: 3 numbers up to 10 at
  level 1, one more number and 10 higher per level."""
  if level < 1:
    raise ValueError(f"countdown level must be >= 1, got {level}")
  return level + 2, 10 * level


def _combine(rng: random.Random, left: tuple[int, str], right: tuple[int, str]) -> tuple[int, str]:
  """A random exact, non-negative combination of two (value, expression) pairs,
  the larger value on the left."""
  (a, expr_a), (b, expr_b) = sorted([left, right], key=lambda item: -item[0])
  options = [(a + b, "+"), (a - b, "-")]
  if a * b <= 1000:
    options.append((a * b, "*"))
  if b and a % b == 0:
    options.append((a // b, "/"))
  value, op = rng.choice(options)
  return value, f"({expr_a}) {op} ({expr_b})"


def _minimal_parentheses(expression: str) -> str:
  """The same expression with only the parentheses precedence needs."""
  return ast.unparse(ast.parse(expression, mode="eval"))


@register("task", "countdown")
def countdown_problem(rng: random.Random, level: int) -> Example:
  """Reach a target with every given number used once and + - * /.

  Solvable by construction: the target is the value of an expression built
  from the numbers (random pairs combined until one value is left, exact
  division only, no negative intermediate results); that expression is the gold `answer`.
  Any other expression passing `countdown_check` is as good.
  """
  count, largest = countdown_spec(level)
  while True:  # Redraws (deterministically) until the target is in 1..1000.
    numbers = [rng.randint(1, largest) for _ in range(count)]
    items = [(n, str(n)) for n in numbers]
    while len(items) > 1:
      i, j = sorted(rng.sample(range(len(items)), 2), reverse=True)
      items.append(_combine(rng, items.pop(i), items.pop(j)))
    target, expression = items[0]
    if 1 <= target <= 1000:
      break
  question = (f"Using the numbers {numbers}, each exactly once, and the operations "
              f"+, -, *, /, write an expression that equals {target}.")
  return Example(question=question, answer=_minimal_parentheses(expression),
                 meta={"level": level, "numbers": numbers, "target": target})


_ALLOWED_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
                ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}


def _evaluate(node: ast.AST, used: list[int]) -> fractions.Fraction:
  """Exact value of an expression of integers and + - * /; collects the integers."""
  if isinstance(node, ast.Constant) and type(node.value) is int:
    used.append(node.value)
    return fractions.Fraction(node.value)
  if isinstance(node, ast.BinOp) and type(node.op) in _ALLOWED_OPS:
    left, right = _evaluate(node.left, used), _evaluate(node.right, used)
    return _ALLOWED_OPS[type(node.op)](left, right)
  raise ValueError(f"not allowed in Countdown: {ast.dump(node)[:40]}")


def countdown_check(expression: str, numbers: list[int], target: int) -> bool:
  """True iff `expression` uses exactly `numbers` (each once) and equals `target`.

  Allowed: integers, + - * / and parentheses (also × and ÷); an "= 24" tail
  is ignored. Division is exact (fractions). Never raises.
  """
  text = expression.split("=")[0].replace("×", "*").replace("÷", "/").strip()
  if not text or len(text) > 200:
    return False
  used: list[int] = []
  try:
    value = _evaluate(ast.parse(text, mode="eval").body, used)
  except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
    return False
  return sorted(used) == sorted(numbers) and value == target
