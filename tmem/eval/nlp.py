"""The two pieces of NLTK that the F1 protocols rely on, written here because NLTK is not installed.

* :func:`porter_stem` — the Porter (1980) suffix-stripping algorithm, "An algorithm for suffix
  stripping", Program 14(3), with the small changes of NLTK's default ``NLTK_EXTENSIONS`` mode
  (used by the official LoCoMo F1): a handful of irregular forms, words of one or two letters
  kept as they are, ``-ies``/``-ied`` on four-letter words giving ``-ie``, step 1c turning ``y``
  into ``i`` only after a consonant that is not the first letter, ``bli→ble`` in place of
  ``abli→able``, an extra ``alli`` pass, and the ``fulli``/``logi`` rules of step 2.
* :func:`word_tokenize` — Penn-Treebank-style word splitting as NLTK's ``word_tokenize`` does it
  (used by the MemOS F1): sentences first (a period ends a sentence unless it closes a known
  abbreviation or a single letter; NLTK's trained Punkt model knows more abbreviations), then
  punctuation split off, clitics (``'s``, ``n't``, ``'ll`` …) separated, double quotes turned
  into `````/``''``.

Both were written from the published algorithm and conventions and checked on hand-worked
examples (tests/test_eval_f1.py); exact parity with NLTK was not testable offline. On the short
answers LoCoMo is scored on, the remaining differences (Punkt's abbreviation list) rarely matter.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from functools import lru_cache

# --------------------------------------------------------------------------- Porter stemmer

_VOWELS = frozenset("aeiou")
# Irregular forms NLTK's extension mode maps directly (they defeat the suffix rules).
_IRREGULAR = {
    "skies": "sky", "sky": "sky", "dying": "die", "lying": "lie", "tying": "tie", "news": "news",
    "innings": "inning", "inning": "inning", "outings": "outing", "outing": "outing",
    "cannings": "canning", "canning": "canning", "howe": "howe", "proceed": "proceed",
    "exceed": "exceed", "succeed": "succeed",
}

Condition = Callable[[str], bool]
Rule = tuple[str, str, Condition | None]


def _consonant(word: str, i: int) -> bool:
    """Porter's consonant: not a vowel, and ``y`` only when it follows a vowel (or starts the word)."""
    ch = word[i]
    if ch in _VOWELS:
        return False
    if ch == "y":
        return i == 0 or not _consonant(word, i - 1)
    return True


def measure(stem: str) -> int:
    """``m`` in Porter's form ``[C](VC)^m[V]``: the number of vowel→consonant transitions."""
    m, after_vowel = 0, False
    for i in range(len(stem)):
        cons = _consonant(stem, i)
        if cons and after_vowel:
            m += 1
        after_vowel = not cons
    return m


def _has_vowel(stem: str) -> bool:
    return any(not _consonant(stem, i) for i in range(len(stem)))


def _double_consonant(word: str) -> bool:
    return len(word) >= 2 and word[-1] == word[-2] and _consonant(word, len(word) - 1)


def _cvc(word: str) -> bool:
    """``*o``: consonant-vowel-consonant ending, the last not w, x or y (NLTK also: a 2-letter VC word)."""
    n = len(word)
    if n >= 3:
        return _consonant(word, n - 3) and not _consonant(word, n - 2) and _consonant(word, n - 1) and word[-1] not in "wxy"
    return n == 2 and not _consonant(word, 0) and _consonant(word, 1)


def _m_gt0(stem: str) -> bool:
    return measure(stem) > 0


def _m_gt1(stem: str) -> bool:
    return measure(stem) > 1


def _first_rule(word: str, rules: Sequence[Rule]) -> str:
    """Apply the rule of the first matching suffix; if its condition fails the word stays as it is."""
    for suffix, replacement, condition in rules:
        if word.endswith(suffix):
            stem = word[: len(word) - len(suffix)]
            return stem + replacement if condition is None or condition(stem) else word
    return word


def _step1a(word: str) -> str:
    if word.endswith("ies") and len(word) == 4:
        return word[:-3] + "ie"
    return _first_rule(word, [("sses", "ss", None), ("ies", "i", None), ("ss", "ss", None), ("s", "", None)])


def _step1b(word: str) -> str:
    if word.endswith("ied"):
        return word[:-3] + ("ie" if len(word) == 4 else "i")
    if word.endswith("eed"):
        stem = word[:-3]
        return stem + "ee" if measure(stem) > 0 else word
    for suffix in ("ed", "ing"):
        if word.endswith(suffix) and _has_vowel(word[: -len(suffix)]):
            stem = word[: -len(suffix)]
            break
    else:
        return word
    if stem.endswith(("at", "bl", "iz")):
        return stem + "e"
    if _double_consonant(stem):
        return stem if stem[-1] in "lsz" else stem[:-1]
    if measure(stem) == 1 and _cvc(stem):
        return stem + "e"
    return stem


def _step1c(word: str) -> str:
    return _first_rule(word, [("y", "i", lambda stem: len(stem) > 1 and _consonant(stem, len(stem) - 1))])


_STEP2: tuple[Rule, ...] = (
    ("ational", "ate", _m_gt0), ("tional", "tion", _m_gt0), ("enci", "ence", _m_gt0), ("anci", "ance", _m_gt0),
    ("izer", "ize", _m_gt0), ("bli", "ble", _m_gt0), ("alli", "al", _m_gt0), ("entli", "ent", _m_gt0),
    ("eli", "e", _m_gt0), ("ousli", "ous", _m_gt0), ("ization", "ize", _m_gt0), ("ation", "ate", _m_gt0),
    ("ator", "ate", _m_gt0), ("alism", "al", _m_gt0), ("iveness", "ive", _m_gt0), ("fulness", "ful", _m_gt0),
    ("ousness", "ous", _m_gt0), ("aliti", "al", _m_gt0), ("iviti", "ive", _m_gt0), ("biliti", "ble", _m_gt0),
    ("fulli", "ful", _m_gt0),
)


def _step2(word: str) -> str:
    if word.endswith("alli") and measure(word[:-4]) > 0:
        return _step2(word[:-4] + "al")
    if word.endswith("logi"):  # the measure is taken with the "l" kept on the stem ("geologi" → "geolog")
        return word[:-1] if measure(word[:-3]) > 0 else word
    return _first_rule(word, _STEP2)


_STEP3: tuple[Rule, ...] = (
    ("icate", "ic", _m_gt0), ("ative", "", _m_gt0), ("alize", "al", _m_gt0), ("iciti", "ic", _m_gt0),
    ("ical", "ic", _m_gt0), ("ful", "", _m_gt0), ("ness", "", _m_gt0),
)

_STEP4: tuple[Rule, ...] = (
    ("al", "", _m_gt1), ("ance", "", _m_gt1), ("ence", "", _m_gt1), ("er", "", _m_gt1), ("ic", "", _m_gt1),
    ("able", "", _m_gt1), ("ible", "", _m_gt1), ("ant", "", _m_gt1), ("ement", "", _m_gt1), ("ment", "", _m_gt1),
    ("ent", "", _m_gt1), ("ion", "", lambda stem: measure(stem) > 1 and stem[-1:] in ("s", "t")),
    ("ou", "", _m_gt1), ("ism", "", _m_gt1), ("ate", "", _m_gt1), ("iti", "", _m_gt1), ("ous", "", _m_gt1),
    ("ive", "", _m_gt1), ("ize", "", _m_gt1),
)


def _step5(word: str) -> str:
    if word.endswith("e"):
        stem = word[:-1]
        m = measure(stem)
        if m > 1 or (m == 1 and not _cvc(stem)):
            word = stem
    if word.endswith("ll") and measure(word[:-1]) > 1:
        word = word[:-1]
    return word


@lru_cache(maxsize=65536)
def porter_stem(word: str) -> str:
    """The Porter stem of ``word`` (lowercased), as NLTK's default ``PorterStemmer().stem`` gives it."""
    word = word.lower()
    if word in _IRREGULAR:
        return _IRREGULAR[word]
    if len(word) <= 2:
        return word
    for step in (_step1a, _step1b, _step1c, _step2):
        word = step(word)
    word = _first_rule(word, _STEP3)
    word = _first_rule(word, _STEP4)
    return _step5(word)


# --------------------------------------------------------------------------- Treebank-style tokenizer

# Words a period does not end a sentence after (a small stand-in for Punkt's learned list).
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st vs etc e.g i.e u.s a.m p.m jan feb mar apr jun jul aug sep sept oct nov dec no".split()
)
_SENTENCE_END = re.compile(r"""(?<=[.!?])(["'\)\]}»”’]*)\s+""")


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text``: break after ``.``/``!``/``?`` (and closing quotes) followed by space,
    except after an abbreviation or a single letter followed by a period."""
    sentences: list[str] = []
    start = 0
    for match in _SENTENCE_END.finditer(text):
        head = text[start : match.start()]
        last_word = head.split()[-1].lower() if head.split() else ""
        if last_word.endswith(".") and not match.group(1):
            bare = last_word.rstrip(".").lstrip("\"'([{")
            if bare in _ABBREVIATIONS or (len(bare) == 1 and bare.isalpha()):
                continue
        sentences.append(text[start : match.end(1)] if match.group(1) else head)
        start = match.end()
    tail = text[start:]
    if tail.strip():
        sentences.append(tail)
    return sentences


_Sub = tuple[re.Pattern[str], str]


def _subs(*pairs: tuple[str, str]) -> tuple[_Sub, ...]:
    return tuple((re.compile(pattern), replacement) for pattern, replacement in pairs)


# Each rule: what the Penn Treebank convention splits off (regex, replacement).
_OPENING_QUOTES = _subs(
    (r"([«“‘„]|`+)", r" \1 "),  # typographic opening quotes and backticks stand alone
    (r'^"', "``"),  # a straight double quote opening the text
    (r"(``)", r" \1 "),
    (r'([ (\[{<])("|\'{2})', r"\1 `` "),  # a double quote after a space or bracket opens a quote
    (r"(?i)(')(?!re|ve|ll|m|t|s|d|n)(\w)\b", r"\1 \2"),  # an opening single quote before a word
)
_PUNCTUATION = _subs(
    (r"""([^.])(\.)([\]\)}>"'»”’ ]*)\s*$""", r"\1 \2 \3 "),  # the sentence-final period
    (r"([:,])([^\d])", r" \1 \2"),  # commas and colons, unless inside a number (1,000 / 10:30)
    (r"([:,])$", r" \1 "),
    (r"\.{2,}", r" \g<0> "),  # ellipses
    (r"[;@#$%&]", r" \g<0> "),
    (r"[?!]", r" \g<0> "),
    (r"([^'])' ", r"\1 ' "),  # a closing single quote
    (r"[*]", r" \g<0> "),
    (r"[\]\[(){}<>]", r" \g<0> "),  # brackets
    (r"--", r" -- "),
)
_CLOSING_QUOTES = _subs(
    (r"([»”’])", r" \1 "),
    (r"''", " '' "),
    (r'"', " '' "),
    (r"([^' ])('[sS]|'[mM]|'[dD]|') ", r"\1 \2 "),  # clitics 's 'm 'd and the bare possessive '
    (r"([^' ])('ll|'LL|'re|'RE|'ve|'VE|n't|N'T) ", r"\1 \2 "),  # clitics 'll 're 've n't
)
_SPLIT_WORDS = _subs(  # fused words the Treebank writes as two tokens
    (r"(?i)\b(can)(not)\b", r" \1 \2 "),
    (r"(?i)\b(d)('ye)\b", r" \1 \2 "),
    (r"(?i)\b(gim)(me)\b", r" \1 \2 "),
    (r"(?i)\b(gon)(na)\b", r" \1 \2 "),
    (r"(?i)\b(got)(ta)\b", r" \1 \2 "),
    (r"(?i)\b(lem)(me)\b", r" \1 \2 "),
    (r"(?i)\b(more)('n)\b", r" \1 \2 "),
    (r"(?i)\b(wan)(na)(?=\s)", r" \1 \2 "),
    (r"(?i) ('t)(is)\b", r" \1 \2 "),
    (r"(?i) ('t)(was)\b", r" \1 \2 "),
)


def _tokenize_sentence(text: str) -> list[str]:
    for pattern, replacement in (*_OPENING_QUOTES, *_PUNCTUATION):
        text = pattern.sub(replacement, text)
    text = f" {text} "
    for pattern, replacement in (*_CLOSING_QUOTES, *_SPLIT_WORDS):
        text = pattern.sub(replacement, text)
    return text.split()


def word_tokenize(text: str) -> list[str]:
    """Treebank-style tokens of ``text``, sentence by sentence (see the module docstring)."""
    return [token for sentence in split_sentences(text) for token in _tokenize_sentence(sentence)]
