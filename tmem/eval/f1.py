"""Token-level F1 on LoCoMo in the three incompatible definitions in use
(../shared/datasets/protocol/F1_DEFINITIONS.md; always say which one a number uses).

* ``official`` — snap-research/LoCoMo ``evaluation.py``: normalised (commas, case, punctuation,
  a/an/the/and), Porter-stemmed, **multiset** overlap; multi-hop gold and prediction are split on
  commas (mean over gold parts of the best prediction part); open-domain gold is cut at the
  first ``;``; adversarial scores 1 when the prediction says "no information available" or
  "not mentioned".
* ``mem0`` — mem0 ``metrics/utils.py``: lowercase, ``. , ! ?`` become spaces, whitespace split,
  **set** overlap, no stemming; empty strings score 0; adversarial questions are not scored.
* ``memos`` — MemOS ``locomo_eval.py``: NLTK ``word_tokenize`` of the lowercased text
  (punctuation kept as tokens), **set** overlap; adversarial questions are not scored.
  Mem0, MemOS, HyperMem and T-Mem tables use this one ("F1 51.96" in the T-Mem paper).

Questions without a reference answer (LoCoMo-Plus cognitive items) have no F1 (``None``).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Literal, get_args

from tmem.eval.nlp import porter_stem, word_tokenize

F1Variant = Literal["official", "mem0", "memos"]
F1_VARIANTS: tuple[F1Variant, ...] = get_args(F1Variant)

_ARTICLES = re.compile(r"\b(a|an|the|and)\b")
_PUNCTUATION = frozenset(string.punctuation)
_MEM0_BREAKS = str.maketrans({".": " ", ",": " ", "!": " ", "?": " "})
ADVERSARIAL_MARKERS = ("no information available", "not mentioned")
UNSCORED_CATEGORIES = frozenset({"cognitive"})  # no reference answer


def _f1(overlap: int, n_pred: int, n_gold: int) -> float:
    if overlap == 0 or n_pred == 0 or n_gold == 0:
        return 0.0
    precision, recall = overlap / n_pred, overlap / n_gold
    return 2 * precision * recall / (precision + recall)


def set_f1(pred_tokens: Iterable[str], gold_tokens: Iterable[str]) -> float:
    """F1 of two token *sets* (repeats count once)."""
    pred, gold = set(pred_tokens), set(gold_tokens)
    return _f1(len(pred & gold), len(pred), len(gold))


def multiset_f1(pred_tokens: Iterable[str], gold_tokens: Iterable[str]) -> float:
    """F1 of two token *multisets* (a repeated token counts as often as it occurs in both)."""
    pred, gold = Counter(pred_tokens), Counter(gold_tokens)
    return _f1(sum((pred & gold).values()), sum(pred.values()), sum(gold.values()))


# --------------------------------------------------------------------------- official LoCoMo


def normalize_official(text: str) -> str:
    """LoCoMo's ``normalize_answer``: drop commas, lowercase, drop punctuation, blank a/an/the/and, squash spaces."""
    text = text.replace(",", "").lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def official_tokens(text: str) -> list[str]:
    return [porter_stem(word) for word in normalize_official(text).split()]


def official_f1_plain(prediction: str, gold: str) -> float:
    return multiset_f1(official_tokens(prediction), official_tokens(gold))


def official_f1_multi(prediction: str, gold: str) -> float:
    """Multi-hop: mean over comma-separated gold parts of the best-matching prediction part."""
    preds = [p.strip() for p in prediction.split(",")]
    golds = [g.strip() for g in gold.split(",")]
    return sum(max(official_f1_plain(p, g) for p in preds) for g in golds) / len(golds)


def f1_official(prediction: str, gold: str, category: str) -> float | None:
    if category in UNSCORED_CATEGORIES:
        return None
    if category == "adversarial":
        lowered = prediction.lower()
        return 1.0 if any(marker in lowered for marker in ADVERSARIAL_MARKERS) else 0.0
    if category == "multi-hop":
        return official_f1_multi(prediction, gold)
    if category == "open-domain":
        gold = gold.split(";")[0].strip()
    return official_f1_plain(prediction, gold)


# --------------------------------------------------------------------------- Mem0


def mem0_tokens(text: str) -> list[str]:
    return str(text).lower().translate(_MEM0_BREAKS).split()


def f1_mem0(prediction: str, gold: str, category: str) -> float | None:
    if category in UNSCORED_CATEGORIES or category == "adversarial":
        return None
    prediction, gold = str(prediction).strip(), str(gold).strip()
    if not prediction or not gold:
        return 0.0
    return set_f1(mem0_tokens(prediction), mem0_tokens(gold))


# --------------------------------------------------------------------------- MemOS


def memos_tokens(text: str) -> list[str]:
    return word_tokenize(str(text).lower())


def f1_memos(prediction: str, gold: str, category: str) -> float | None:
    if category in UNSCORED_CATEGORIES or category == "adversarial":
        return None
    return set_f1(memos_tokens(prediction), memos_tokens(gold))


# --------------------------------------------------------------------------- all three

_BY_VARIANT = {"official": f1_official, "mem0": f1_mem0, "memos": f1_memos}


def f1_score(prediction: str, gold: str, category: str, variant: F1Variant) -> float | None:
    """One variant's F1 in [0, 1] for a question of ``category`` (a LoCoMo category name)."""
    if variant not in _BY_VARIANT:
        raise ValueError(f"unknown F1 variant {variant!r}; known: {', '.join(F1_VARIANTS)}")
    return _BY_VARIANT[variant](prediction, gold, category)


def f1_all(prediction: str, gold: str, category: str) -> Mapping[F1Variant, float | None]:
    """Every variant's F1 for one answer, keyed by variant name."""
    return {variant: _BY_VARIANT[variant](prediction, gold, category) for variant in F1_VARIANTS}
