"""The calculator env: the model writes <calc>EXPR</calc>, the env answers
with the value. EXPR is parsed with `ast` and evaluated node by node over
numbers and + - * / // % ** (bounded): model text is never `eval`-ed.
"""
from __future__ import annotations

import ast
import dataclasses
import operator
import re
import types
from typing import Sequence

from grpo_jax import registry
from grpo_jax.data import generated
from grpo_jax.envs import base

_CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub,
           ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 100          # 2**100 is fine, 9**9**9 is not computed
MAX_DIGITS = 200
INSTRUCTIONS = ("You may use a calculator: write <calc>expression</calc> and "
                "wait for its result. End with the final answer.")


def evaluate(expression: str) -> int | float:
  """The value of an arithmetic expression; ValueError for anything else
  (names, calls, attributes, huge powers)."""
  try:
    tree = ast.parse(expression.strip(), mode="eval")
  except SyntaxError as e:
    raise ValueError("syntax error") from e
  return _value(tree.body)


def _value(node: ast.AST) -> int | float:
  if isinstance(node, ast.Constant) and type(node.value) in (int, float):
    return node.value
  if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
    return _UNARY[type(node.op)](_value(node.operand))
  if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
    left, right = _value(node.left), _value(node.right)
    if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
      raise ValueError("exponent too large")
    value = _BINARY[type(node.op)](left, right)
    if isinstance(value, int) and len(str(abs(value))) > MAX_DIGITS:
      raise ValueError("result too large")
    return value
  raise ValueError(f"not arithmetic: {type(node).__name__}")


def format_value(value: int | float) -> str:
  if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
    return str(int(value))
  return repr(value)


@registry.register("env", "calculator")
class Calculator:
  """Each turn with a <calc> call gets its value (the last call of the
  turn); a turn without one ends the episode."""

  def __init__(self, timeout_s: float = 5.0,
               instructions: str = INSTRUCTIONS):
    del timeout_s           # arithmetic is bounded by MAX_EXPONENT/DIGITS
    self.instructions = instructions

  def initial_messages(self, example) -> base.Messages:
    return base.user_messages(example, self.instructions)

  def step(self, turn_text: str, turn_ids: Sequence[int]) -> base.StepResult:
    del turn_ids
    calls = _CALL.findall(turn_text)
    if not calls:
      return base.Done()
    try:
      return base.Observation(format_value(evaluate(calls[-1])))
    except (ValueError, ZeroDivisionError, OverflowError) as e:
      return base.tool_error(str(e) or type(e).__name__)


@registry.register("template", "calculator")
def calculator_prompt(question: str, hint: str | None = None) -> base.Messages:
  """The calculator env's first message (its instructions, then the
  question), so a warm-up's SFT prompts are the episodes' first prompts."""
  if hint is not None:
    question = f"{question}\n\nHint: {hint}"
  return base.user_messages(types.SimpleNamespace(question=question),
                            INSTRUCTIONS)


@registry.register("dataset", "calculator_calls")
def calculator_calls(num_examples: int, levels=1, seed: int = 0) -> list:
  """Generated tool-call transcripts for an SFT warm-up before RL with the
  calculator (configs/tool_use.py `:warm`), two turns of each arithmetic
  problem (data source "arithmetic"'s): the first turn,
  `<calc>EXPRESSION</calc>` after the env's first message, and the answer
  turn, "The answer is VALUE." after that call and the tool's VALUE (the
  chat in meta["messages"], `star.sft_run.sft_examples`)."""
  out = []
  for e in generated.arithmetic_dataset(num_examples, levels, seed):
    call = f"<calc>{e.meta['expression']}</calc>"
    chat = [*calculator_prompt(e.question), {"role": "assistant", "content": call},
            {"role": "tool", "content": e.answer}]
    out += [dataclasses.replace(e, rationale=call),
            dataclasses.replace(e, rationale=f"The answer is {e.answer}.",
                                meta={**e.meta, "messages": chat})]
  return out
