"""Trailing units and multiplier words of an answer: pure string code.

An answer's unit is dropped only when every word of it is a real unit (a
list: SI and imperial measures, time, money, `m/s^2`, `km/h`, `N\\cdot m`,
`\\text{ cm}^2`, `square units`) or a counted noun ("36 apples", "12
students": a plural word that is no quantity word). Anything else stays and
the parser must read it: `e`, `i`, `pi` are numbers; "or more", "squared",
"times", "dozen" change the value; so `3\\mathrm{e}`, `3 pi` and `3\\text{ or
more}` are never the number 3. Multiplier words are read as multipliers
(`5\\text{ million}` -> `5\\times 10^{6}`).

Single-letter units (`m`, `g`, `s`, `h`, `N`, ...) count only inside
`\\text{}`/`\\mathrm{}` or in a compound with `/` (`5 m/s`): a bare `5 m` may
be a product with the variable m.
"""
from __future__ import annotations

import re

_UNITS = frozenset("""
mm cm dm m km nm um μm mi mile miles in inch inches ft foot feet yd yard yards
mg g kg gram grams kilogram kilograms lb lbs pound pounds oz ounce ounces ton tons tonne tonnes
s sec secs second seconds ms min mins minute minutes h hr hrs hour hours day days week weeks
month months year years yr yrs
ml mL l L liter liters litre litres cl gal gallon gallons cup cups quart quarts pint pints tbsp tsp
dollar dollars cent cents euro euros pence penny pennies yuan yen rupee rupees rs usd USD
mph kph kmh km/h
N kN J kJ W kW kWh Wh V mV A mA K C F Pa kPa Hz kHz MHz GHz ohm ohms cal kcal calorie calories
rad radian radians sq square cubic unit units meter meters metre metres kilometer kilometers
centimeter centimeters millimeter millimeters liter mile
""".split())
# Plural words that are quantities, not counted things: never dropped.
_QUANTITY_WORDS = frozenset("""
or and not more less than least most times plus minus over under squared cubed factorial
millions billions thousands trillions hundreds dozens tens ones halves thirds quarters
fourths fifths sixths sevenths eighths ninths tenths hundredths thousandths pairs twos
threes percents degrees roots powers apart others
""".split())
_IRREGULAR_PLURALS = frozenset("people children men women sheep fish feet teeth mice geese".split())
_MULTIPLIERS = {"hundred": "10^{2}", "thousand": "10^{3}", "million": "10^{6}",
                "billion": "10^{9}", "trillion": "10^{12}", "dozen": "12"}

_SEPARATOR = r"(?:\s|~|\\[,;: ]|\\cdot|\*|/)*"
_POWER = r"(?:\s*\^\s*\{?\s*-?\d\s*\}?|[\u00b2\u00b3])?"
# The last token of an answer: a wrapped unit (`\text{ cm}`, `\mathrm{m/s^2}`)
# or a bare word, with an optional power.
_LAST_TOKEN = re.compile(
    rf"(?P<sep>{_SEPARATOR})(?:\\(?:text|mbox|textnormal|textrm|mathrm|rm)\s*\{{(?P<wrapped>[^{{}}]*)\}}"
    rf"|(?P<bare>[A-Za-z]+)){_POWER}\s*$")
_BODY_SPLIT = re.compile(r"\s*(?:/|\\cdot|\*|\\[,;: ]|~|\s|\bper\b)\s*")
_BODY_POWER = re.compile(r"\^\s*\{?\s*-?\d\s*\}?|[\u00b2\u00b3]")
_MULTIPLIER = re.compile(
    r"(?<=[\d}$])(?:\s|~|\\[,;: ])*(?:\\(?:text|mathrm|textrm)\s*\{\s*(?P<w1>[a-z]+)\s*\}"
    r"|(?P<w2>[a-z]+))\s*$")
_MAX_TOKENS = 6


_CONSTANTS = frozenset("""e i pi squared cubed factorial percent degrees power root exponent
divided half third quarter fourth fifth tenth hundredth thousandth negative point""".split())


def changes_value(word: str) -> bool:
  """True if `word` after a number is part of its value ("million", "or",
  "times", "pi"), not a unit or a counted thing."""
  word = word.lower()
  return word in _QUANTITY_WORDS or word in _MULTIPLIERS or word in _CONSTANTS


def _is_counted_noun(word: str) -> bool:
  """A plural that counts things; not a fraction word ("fifths", "twelfths")."""
  return (word.islower() and word not in _QUANTITY_WORDS and not word.endswith("ths")
          and (word in _IRREGULAR_PLURALS or (len(word) >= 4 and word.endswith("s"))))


def _describes(words: list[str]) -> bool:
  """Lowercase words that change no value: "red" in "12 red marbles"."""
  return len(words) <= 2 and all(w.isalpha() and w.islower() and not changes_value(w)
                                 for w in words)


def _unit_words(body: str, wrapped: bool, compound: bool, after_noun: bool) -> bool:
  """True if every word of `body` is a unit, or `body` is a counted noun
  with its describing words ("red marbles"), or describes one already
  dropped."""
  words = [w for w in _BODY_SPLIT.split(_BODY_POWER.sub(" ", body).strip()) if w]
  if not words:
    return False
  if _is_counted_noun(words[-1]) and _describes(words[:-1]) or after_noun and _describes(words):
    return True
  short_ok = wrapped or compound or len(words) > 1 and "/" in body
  return all(w in _UNITS and (len(w) > 1 or short_ok) for w in words)


def strip_units(answer: str) -> str:
  """`answer` without its trailing unit and with a final multiplier word read
  (`5 million dollars` -> `5\\times 10^{6}`); unchanged if it has neither."""
  rest, compound, after_noun = answer.rstrip(), False, False
  for _ in range(_MAX_TOKENS):
    match = _LAST_TOKEN.search(rest)
    if match is None:
      break
    wrapped = match.group("wrapped") is not None
    body = match.group("wrapped") if wrapped else match.group("bare")
    left = rest[:match.start()].rstrip()
    divides = "/" in match.group("sep") or "\\cdot" in match.group("sep")
    if not left or not _unit_words(body, wrapped, compound or divides, after_noun):
      break
    after_noun = after_noun or _is_counted_noun(body.split()[-1] if body.split() else "")
    rest, compound = left, divides
  rest = read_multiplier(rest)
  if rest != answer.rstrip() and (rest[-1].isdigit() or rest[-1] in "})$"):
    return rest
  return answer


def read_multiplier(answer: str) -> str:
  """`5\\text{ million}` -> `5\\times 10^{6}`: a final multiplier word."""
  match = _MULTIPLIER.search(answer)
  word = match and (match.group("w1") or match.group("w2"))
  if not word or word not in _MULTIPLIERS:
    return answer
  return f"{answer[:match.start()]}\\times {_MULTIPLIERS[word]}"
