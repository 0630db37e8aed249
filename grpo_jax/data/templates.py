"""Prompt templates: a question (and, only when asked, a hint) -> chat messages.

A template is `(question: str, hint: str | None = None) -> list[{"role", "content"}]`
registered under kind "template", chosen by name in the config. Each asks for
the answer in the form a reward extracts it from:

| name | asks for |
| --- | --- |
| r1_think | reasoning inside `<think> </think>`, then `\\boxed{answer}` |
| boxed | step-by-step reasoning, final answer in `\\boxed{}` |
| dapo_answer | last line `Answer: $Answer` (DAPO's format) |
| last_number | reasoning ending with the answer as a plain number |
| as_is | nothing added: the question is the whole prompt |

All instructions sit in one user message (no system message), so templates
work with chat formats that have no system role. The hint is how STaR
rationalises: it is added only when `hint` is given, and a stored training
example must use the prompt built WITHOUT it.
"""
from __future__ import annotations

import inspect
from typing import Any, Sequence

from grpo_jax.registry import lookup, register

Messages = list[dict[str, str]]


def answer_hint(answer: str) -> str:
  """The STaR rationalisation hint for a gold answer."""
  return f"The correct answer is {answer}."


def _with_hint(question: str, hint: str | None) -> str:
  return question if hint is None else f"{question}\n\nHint: {hint}"


def _user(content: str) -> Messages:
  return [{"role": "user", "content": content}]


@register("template", "r1_think")
def r1_think_prompt(question: str, hint: str | None = None) -> Messages:
  """DeepSeek-R1 style: think inside <think> tags, then a boxed answer."""
  return _user(f"{_with_hint(question, hint)}\n\n"
               "First think about the problem step by step inside <think> </think> tags. "
               "After </think>, write the final answer as \\boxed{answer}.")


@register("template", "boxed")
def boxed_prompt(question: str, hint: str | None = None) -> Messages:
  """Reason step by step and put the final answer in \\boxed{}."""
  return _user(f"{_with_hint(question, hint)}\n\n"
               "Reason step by step, and put your final answer in \\boxed{}.")


@register("template", "dapo_answer")
def dapo_answer_prompt(question: str, hint: str | None = None) -> Messages:
  """DAPO's format: the last line of the response is `Answer: $Answer`."""
  return _user("Solve the problem below step by step. The last line of your response "
               "should be of the form Answer: $Answer where $Answer is the final answer.\n\n"
               f"{_with_hint(question, hint)}\n\n"
               'Write the final answer on its own last line, after "Answer:".')


@register("template", "last_number")
def last_number_prompt(question: str, hint: str | None = None) -> Messages:
  """Plain: reason, and end with the answer as a number (rewards read the last number)."""
  return _user(f"{_with_hint(question, hint)}\n\n"
               "Work it out step by step and end your reply with the final answer "
               "as a plain number.")


@register("template", "as_is")
def as_is_prompt(question: str, hint: str | None = None) -> Messages:
  """The question alone, e.g. a DAPO-Math-17k prompt read with strip_instructions=False."""
  return _user(_with_hint(question, hint))


def render_prompt(messages: Messages, tokenizer: Any) -> str:
  """The prompt string the model sees: the tokenizer's chat template plus the
  assistant's generation prompt.

  `tokenizer` has `apply_chat_template(messages, add_generation_prompt=True) -> str`
  (grpo_jax.models.tokenizer); a Hugging Face tokenizer works too (asked for text, not ids).
  """
  kwargs: dict[str, Any] = {"add_generation_prompt": True}
  if "tokenize" in inspect.signature(tokenizer.apply_chat_template).parameters:
    kwargs["tokenize"] = False  # Hugging Face returns token ids unless told otherwise.
  text = tokenizer.apply_chat_template(messages, **kwargs)
  if not isinstance(text, str):
    raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected str")
  return text


def render_prompts(tokenizer: Any, template: str, questions: Sequence[str],
                   system_prompt: str = "") -> list[str]:
  """Each question through the named prompt template (after a system
  message, if given) and the chat template: the prompts of training,
  STaR and evaluation."""
  fmt = lookup("template", template)
  system = [{"role": "system", "content": system_prompt}] if system_prompt else []
  return [render_prompt([*system, *fmt(q)], tokenizer) for q in questions]
