"""Tokenizers from tokenizer.json or GGUF metadata, chat templates, stop ids.

    tok = load_tokenizer("smollm2-135m-instruct")   # or a HF dir, or a .gguf
    prompt = tok.apply_chat_template([{"role": "user", "content": "2+2?"}])
    ids = tok.encode(prompt)                         # no BOS/EOS added

The backend is a `tokenizers.Tokenizer`. From a GGUF it is rebuilt from the
vocabulary, merges and token types in the metadata, with the pre-tokenizer
that `tokenizer.ggml.pre` names (llama.cpp's table). Chat templates render
with jinja2 in a sandbox, with transformers' helpers (`raise_exception`,
`tojson`, `strftime_now`), so the strings match `apply_chat_template`.
"""
from __future__ import annotations

import datetime
import functools
import json
import logging
import os
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from grpo_jax.models import weights

Source = Union[str, os.PathLike]

# Special tokens that end a turn or a document in common chat formats; any
# of these that the vocabulary has as a special token is a stop id.
_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>",
               "<|eom_id|>", "</s>", "<end_of_turn>")


class Tokenizer:
  """Text <-> ids, the chat template, and the ids that end a generation."""

  def __init__(self, backend: tokenizers.Tokenizer,
               chat_template: Optional[str] = None,
               special_tokens: Optional[dict[str, Optional[str]]] = None,
               extra_stop_ids: Sequence[int] = ()):
    """special_tokens: bos_token / eos_token / pad_token / unk_token strings."""
    self.backend = backend
    self.chat_template = chat_template
    self.special_tokens = {k: v for k, v in (special_tokens or {}).items()
                           if v is not None}
    self._extra_stop_ids = tuple(extra_stop_ids)

  # --- ids ---------------------------------------------------------------

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    """Token ids; special tokens written in `text` map to their ids."""
    return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

  def encode_batch(self, texts: Sequence[str],
                   add_special_tokens: bool = False) -> list[list[int]]:
    encodings = self.backend.encode_batch(list(texts),
                                          add_special_tokens=add_special_tokens)
    return [e.ids for e in encodings]

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False
             ) -> str:
    return self.backend.decode(list(ids),
                               skip_special_tokens=skip_special_tokens)

  def token_id(self, token: Optional[str]) -> Optional[int]:
    return None if token is None else self.backend.token_to_id(token)

  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  @property
  def bos_id(self) -> Optional[int]:
    return self.token_id(self.special_tokens.get("bos_token"))

  @property
  def eos_id(self) -> Optional[int]:
    return self.token_id(self.special_tokens.get("eos_token"))

  @property
  def pad_id(self) -> Optional[int]:
    """The pad token, else eos (batches are padded and masked anyway)."""
    pad = self.token_id(self.special_tokens.get("pad_token"))
    return self.eos_id if pad is None else pad

  @property
  def stop_ids(self) -> list[int]:
    """eos, the ids a generation_config lists, and end-of-turn specials."""
    special = {t.content for t in self.backend.get_added_tokens_decoder()
               .values() if t.special}
    ends = [self.token_id(t) for t in _END_TOKENS if t in special]
    ids = [self.eos_id, *self._extra_stop_ids, *ends]
    return sorted({i for i in ids if i is not None})

  def special_token_ids(self) -> dict[str, int]:
    """{"bos_token_id": ..., ...} for a transformers config."""
    out = {f"{k}_id": self.token_id(v) for k, v in self.special_tokens.items()}
    return {k: v for k, v in out.items() if v is not None}

  # --- chat --------------------------------------------------------------

  def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                          add_generation_prompt: bool = True,
                          **kwargs) -> str:
    """The conversation as the model's chat format (a string, not ids)."""
    if self.chat_template is None:
      raise ValueError("this tokenizer has no chat template")
    template = _compile_template(self.chat_template)
    # transformers passes tools/documents as None when absent; templates test
    # `tools is not none`, which an undefined variable would pass.
    context = {"tools": None, "documents": None, **self.special_tokens,
               **kwargs}
    return template.render(**context, messages=list(messages),
                           add_generation_prompt=add_generation_prompt)

  # --- files -------------------------------------------------------------

  def save_pretrained(self, directory: Source):
    """tokenizer.json, tokenizer_config.json and chat_template.jinja."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    self.backend.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast",
              "clean_up_tokenization_spaces": False, **self.special_tokens}
    if self.chat_template is not None:
      config["chat_template"] = self.chat_template
      (directory / "chat_template.jinja").write_text(self.chat_template)
    (directory / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False))


# ----------------------------------------------------------------------------
# Chat templates: transformers' sandbox and helpers.
# ----------------------------------------------------------------------------

def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None,
            sort_keys=False):
  # Jinja's own tojson escapes HTML (<, >, &), which chat formats must not.
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                    separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
  return datetime.datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}` (marks assistant text for
  transformers' masks); here it renders its body unchanged."""
  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_render"), [], [],
                                  body).set_lineno(lineno)

  def _render(self, caller):
    return caller()


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
  env = ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True,
      extensions=[_GenerationTag, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals.update(raise_exception=_raise_exception,
                     strftime_now=_strftime_now)
  return env.from_string(source)


# ----------------------------------------------------------------------------
# Sources.
# ----------------------------------------------------------------------------

def load_tokenizer(source: Source) -> Tokenizer:
  """From a HF directory, a .gguf file, or a preset with bundled weights."""
  path = Path(source)
  if path.is_dir():
    return from_directory(path)
  if path.suffix == ".gguf":
    return from_gguf(path)
  directory = weights.cached_preset_directory(str(source))
  if (directory / "tokenizer.json").is_file():
    return from_directory(directory)
  return from_gguf(weights.bundled_gguf(str(source)))


def from_directory(directory: Path) -> Tokenizer:
  """tokenizer.json + tokenizer_config.json (+ chat_template.jinja,
  special_tokens_map.json, generation_config.json) as transformers saves."""
  directory = Path(directory)
  path = directory / "tokenizer.json"
  if not path.is_file():
    raise FileNotFoundError(f"{path} not found (only fast tokenizers, saved "
                            "as tokenizer.json, are supported)")
  backend = tokenizers.Tokenizer.from_file(str(path))
  config = _read_json(directory / "tokenizer_config.json")
  special = {**_read_json(directory / "special_tokens_map.json"), **config}
  special = {k: _token_content(special.get(k)) for k in
             ("bos_token", "eos_token", "pad_token", "unk_token")}
  generation = _read_json(directory / "generation_config.json")
  return Tokenizer(backend, _chat_template(directory, config), special,
                   _as_list(generation.get("eos_token_id")))


def _read_json(path: Path) -> dict[str, Any]:
  return json.loads(path.read_text()) if path.is_file() else {}


def _token_content(token) -> Optional[str]:
  """transformers writes special tokens as strings or AddedToken dicts."""
  return token.get("content") if isinstance(token, dict) else token


def _as_list(x) -> list[int]:
  return [] if x is None else list(x) if isinstance(x, list) else [x]


def _chat_template(directory: Path, config: dict[str, Any]) -> Optional[str]:
  """chat_template.jinja (transformers 5) over tokenizer_config's entry,
  which may be a string or a list of named templates ("default" is used)."""
  jinja = directory / "chat_template.jinja"
  if jinja.is_file():
    return jinja.read_text()
  template = (config.get("chat_template")
              or _read_json(directory / "chat_template.json")
              .get("chat_template"))
  if isinstance(template, list):
    named = {t["name"]: t["template"] for t in template}
    template = named.get("default")
  return template


# ----------------------------------------------------------------------------
# GGUF metadata -> tokenizers.Tokenizer (byte-level BPE).
# ----------------------------------------------------------------------------

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
  return pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _gpt2_bytes() -> pre_tokenizers.PreTokenizer:
  return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
  return pre_tokenizers.Sequence([
      pre_tokenizers.Digits(individual_digits=True), _gpt2_bytes()])


# `tokenizer.ggml.pre` -> pre-tokenizer, after llama.cpp's regex table.
# "smollm" (also StarCoder's) splits every digit, then GPT-2's regex.
_PRE_TOKENIZERS = {
    "default": _gpt2_bytes, "gpt-2": _gpt2_bytes,
    "smollm": _digits_then_gpt2, "starcoder": _digits_then_gpt2,
    "refact": _digits_then_gpt2,
    "llama3": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "smaug-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": lambda: _split_then_bytes(_QWEN2_SPLIT),
    "deepseek-r1-qwen": lambda: _split_then_bytes(_QWEN2_SPLIT),
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def from_gguf(path: Path, reader=None) -> Tokenizer:
  """The tokenizer a GGUF file's `tokenizer.*` metadata describes; `reader`
  (a `gguf.GGUFReader` of `path`) saves parsing the file a second time."""
  reader = reader or weights.open_reader(Path(path))
  kind = weights.field(reader, "tokenizer.ggml.model")
  if kind != "gpt2":
    raise ValueError(f"{path}: tokenizer.ggml.model={kind!r}; only byte-level"
                     " BPE ('gpt2') GGUF tokenizers are supported")
  tokens = weights.field(reader, "tokenizer.ggml.tokens")
  merges = weights.field(reader, "tokenizer.ggml.merges")
  if not tokens or not merges:
    raise ValueError(f"{path}: a BPE tokenizer needs tokenizer.ggml.tokens "
                     "and tokenizer.ggml.merges; the file lacks one")
  types = weights.field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
  backend = _byte_level_bpe(tokens, merges, types,
                            weights.field(reader, "tokenizer.ggml.pre", "default"),
                            path)

  def token(key):
    i = weights.field(reader, f"tokenizer.ggml.{key}")
    return None if i is None else tokens[i]

  special = {"bos_token": token("bos_token_id"),
             "eos_token": token("eos_token_id"),
             "pad_token": token("padding_token_id"),
             "unk_token": token("unknown_token_id")}
  _add_bos_eos(backend, weights.field(reader, "tokenizer.ggml.add_bos_token", False),
               weights.field(reader, "tokenizer.ggml.add_eos_token", False), special,
               tokens)
  return Tokenizer(backend, weights.field(reader, "tokenizer.chat_template"), special)


def _byte_level_bpe(tokens: list[str], merges: list[str], types: list[int],
                    pre: str, path: Path) -> tokenizers.Tokenizer:
  spelled = [_byte_spelling(t) for t in tokens]
  backend = tokenizers.Tokenizer(models.BPE(
      vocab={t: i for i, t in enumerate(spelled)},
      merges=[tuple(m.split(" ", 1)) for m in merges],
      fuse_unk=False, byte_fallback=False))
  if pre not in _PRE_TOKENIZERS:
    logging.warning("%s: unknown pre-tokenizer %r; using GPT-2's (ids may "
                    "differ from llama.cpp)", path, pre)
  backend.pre_tokenizer = _PRE_TOKENIZERS.get(pre, _gpt2_bytes)()
  backend.decoder = decoders.ByteLevel()
  # Control tokens (<|im_end|>) must stay whole and are special; user-defined
  # ones (<think>) stay whole but decode as text. An entry that is not in the
  # byte alphabet cannot be either (llama.cpp mislabels some): adding it
  # would grow the vocabulary past the model's.
  whole = [(t, k) for t, s, k in zip(tokens, spelled, types) if t == s]
  backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                              for t, k in whole if k == _CONTROL])
  backend.add_tokens([AddedToken(t, special=False, normalized=False)
                      for t, k in whole if k == _USER_DEFINED])
  return backend


def _byte_spelling(token: str) -> str:
  """A vocabulary entry in the byte-to-unicode alphabet BPE works in; llama.cpp
  stores some added tokens as raw text instead."""
  table = _bytes_to_unicode()
  if set(token) <= _byte_alphabet():
    return token
  return "".join(table[b] for b in token.encode("utf-8"))


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> frozenset[str]:
  return frozenset(_bytes_to_unicode().values())


@functools.lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's reversible byte -> printable character map."""
  keep = (list(range(ord("!"), ord("~") + 1))
          + list(range(ord("\u00a1"), ord("\u00ac") + 1))
          + list(range(ord("\u00ae"), ord("\u00ff") + 1)))
  chars, extra = {}, 0
  for b in range(256):
    if b in keep:
      chars[b] = chr(b)
    else:
      chars[b] = chr(256 + extra)
      extra += 1
  return chars


def _add_bos_eos(backend: tokenizers.Tokenizer, add_bos: bool, add_eos: bool,
                 special: dict[str, Optional[str]], tokens: list[str]):
  """What encode(..., add_special_tokens=True) adds, as llama.cpp does."""
  bos = special["bos_token"] if add_bos else None
  eos = special["eos_token"] if add_eos else None
  if bos is None and eos is None:
    return
  single = " ".join(filter(None, [bos, "$A", eos]))
  ids = [(t, tokens.index(t)) for t in (bos, eos) if t is not None]
  backend.post_processor = processors.TemplateProcessing(
      single=single, special_tokens=ids)
