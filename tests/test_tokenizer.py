"""Tokenizers: the same ids and chat strings as transformers.

The bundled SmolLM2 GGUF is read by both libraries; transformers' tokenizer
saved as a directory checks the tokenizer.json path; our saved directory is
read back by transformers.
"""
import json

import jinja2
import pytest
import transformers

from grpo_jax.models import loading
from grpo_jax.models.tokenizer import Tokenizer, from_gguf, load_tokenizer

TEXTS = {
    "english": (
        "The quick brown fox jumps over the lazy dog. It's 3:45 pm, and "
        "we've got 1,234,567 reasons (roughly) to keep going -- don't stop!\n"
        "Second line,   with  irregular   spaces\tand a tab."),
    "latex": (
        r"Let $f(x) = \frac{x^2 + 1}{\sqrt{x - 3}}$. Then "
        r"\[ \int_0^{\infty} e^{-x^2}\,dx = \frac{\sqrt{\pi}}{2}, \quad "
        r"\sum_{k=1}^{n} k = \binom{n+1}{2}. \] The answer is "
        r"\boxed{\tfrac{7}{12}}."),
    "python": (
        "def fib(n: int) -> int:\n"
        "    \"\"\"Returns the n-th Fibonacci number.\"\"\"\n"
        "    a, b = 0, 1\n"
        "    for _ in range(n):\n"
        "        a, b = b, a + b  # 0x1F, 1e-9, 10_000\n"
        "    return a\n\n\n"
        "print({k: fib(k) for k in range(10)})\n"),
    "non_ascii": (
        "Café naïve façade — “quotes” and ‘apostrophes’. Ελληνικά, Русский "
        "текст, العربية, हिन्दी, 中文分词测试, 日本語のテキスト, 한국어. "
        "Emoji: 🤖🚀👩‍💻 and ≤ ∞ ≠ π² x³."),
    "specials": "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
}

CHATS = [
    [{"role": "user", "content": "What is 7 * 8?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Solve $x^2 = 4$."},
     {"role": "assistant", "content": "$x = \\pm 2$"},
     {"role": "user", "content": "Und auf Deutsch? 中文?"}],
]


@pytest.fixture(scope="module")
def gguf_path():
  return loading.bundled_gguf("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def reference(gguf_path):
  return transformers.AutoTokenizer.from_pretrained(
      gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def ours(gguf_path):
  return from_gguf(gguf_path)


@pytest.fixture(scope="module")
def reference_dir(reference, tmp_path_factory):
  """transformers' tokenizer as a tokenizer.json directory."""
  directory = tmp_path_factory.mktemp("hf_tokenizer")
  reference.save_pretrained(directory)
  return directory


@pytest.mark.parametrize("kind", sorted(TEXTS))
def test_gguf_ids_match_transformers(ours, reference, kind):
  text = TEXTS[kind]
  ids = ours.encode(text)
  assert ids == reference(text, add_special_tokens=False).input_ids
  assert ours.decode(ids) == text


def test_numbers_split_per_code_point_as_llama_cpp_does(ours):
  """llama.cpp's "smollm" pre-tokenizer first isolates every \\p{N} code
  point (digits, but also ½, ², ٣), then applies GPT-2's regex.
  transformers' GGUF converter ignores `tokenizer.ggml.pre`, so after a space
  it differs: it gives " ½" as "ĠÂ" + "½". SmolLM2 was trained with the
  split (its tokenizer.json: Digits(individual_digits) then ByteLevel)."""
  ids = ours.encode("x = 1234567890")
  assert [ours.decode([i]) for i in ids[-10:]] == list("1234567890")
  assert ours.backend.encode(" ½").tokens == ["Ġ", "Â½"]


def test_encode_batch_is_encode_per_text(ours):
  texts = list(TEXTS.values())
  assert ours.encode_batch(texts) == [ours.encode(t) for t in texts]


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, reference, chat,
                                            add_generation_prompt):
  text = ours.apply_chat_template(chat, add_generation_prompt)
  assert text == reference.apply_chat_template(
      chat, tokenize=False, add_generation_prompt=add_generation_prompt)
  assert ours.encode(text) == reference(text, add_special_tokens=False
                                        ).input_ids


def test_special_ids_of_smollm2(ours):
  assert ours.vocab_size == 49152
  assert (ours.bos_id, ours.eos_id, ours.pad_id) == (1, 2, 2)
  assert ours.stop_ids == [0, 2]  # <|endoftext|>, <|im_end|>
  assert ours.encode("<|im_end|>") == [2]
  assert ours.decode([1, 2], skip_special_tokens=True) == ""


@pytest.mark.parametrize("kind", sorted(TEXTS))
def test_tokenizer_json_directory_matches_transformers(reference_dir, kind):
  ours = load_tokenizer(reference_dir)
  reference = transformers.AutoTokenizer.from_pretrained(reference_dir)
  text = TEXTS[kind]
  assert ours.encode(text) == reference(text, add_special_tokens=False
                                        ).input_ids
  assert ours.apply_chat_template(CHATS[1]) == reference.apply_chat_template(
      CHATS[1], tokenize=False, add_generation_prompt=True)
  assert (ours.eos_id, ours.pad_id) == (reference.eos_token_id,
                                        reference.pad_token_id)


def test_saved_directory_loads_in_transformers(ours, reference, tmp_path):
  ours.save_pretrained(tmp_path)
  back = transformers.AutoTokenizer.from_pretrained(tmp_path)
  for text in TEXTS.values():
    assert back(text, add_special_tokens=False).input_ids == ours.encode(text)
  assert back.apply_chat_template(CHATS[1], tokenize=False,
                                  add_generation_prompt=True) == (
                                      ours.apply_chat_template(CHATS[1]))
  assert back.eos_token == "<|im_end|>"
  again = load_tokenizer(tmp_path)
  assert again.encode(TEXTS["non_ascii"]) == ours.encode(TEXTS["non_ascii"])


def test_template_in_tokenizer_config_list_form(ours, tmp_path):
  ours.save_pretrained(tmp_path)
  (tmp_path / "chat_template.jinja").unlink()
  config_path = tmp_path / "tokenizer_config.json"
  data = json.loads(config_path.read_text())
  data["chat_template"] = [{"name": "default", "template": "D{{ eos_token }}"},
                           {"name": "tool_use", "template": "T"}]
  config_path.write_text(json.dumps(data))
  assert load_tokenizer(tmp_path).apply_chat_template([]) == "D<|im_end|>"


def test_preset_name_gives_the_bundled_tokenizer(ours, tmp_path, monkeypatch):
  monkeypatch.setenv("GRPO_JAX_CACHE", str(tmp_path))  # empty: reads the GGUF
  tok = load_tokenizer("smollm2-135m-instruct")
  assert tok.encode(TEXTS["latex"]) == ours.encode(TEXTS["latex"])
  assert tok.chat_template == ours.chat_template


_FEATURES = (
    "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
    "{{ raise_exception('bad role ' + m.role) }}{% endif %}"
    "{% if loop.index > 3 %}{% break %}{% endif %}"
    "{% generation %}{{ m | tojson }}{% endgeneration %}\n{% endfor %}"
    "{{ bos_token }}{% if add_generation_prompt %}>{% endif %}"
    "{% if tools is not none %}TOOLS{% endif %}")


def test_template_helpers_render_as_in_transformers(ours, reference):
  chat = [{"role": "user", "content": "<b>&\"é\"</b>"}] * 5
  tok = Tokenizer(ours.backend, _FEATURES, ours.special_tokens)
  assert tok.apply_chat_template(chat) == reference.apply_chat_template(
      chat, chat_template=_FEATURES, tokenize=False,
      add_generation_prompt=True)
  with pytest.raises(jinja2.TemplateError, match="bad role tool"):
    tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_template_cannot_reach_python_internals(ours):
  tok = Tokenizer(ours.backend, "{{ messages.__class__.__mro__ }}", {})
  with pytest.raises(jinja2.exceptions.SecurityError):
    tok.apply_chat_template([])
