"""Protocol prompt texts loaded from a file the user names, with their placeholders filled.

For strict comparability with published numbers, ``tmem eval`` can send another project's answer
or judge prompt verbatim (e.g. ``../shared/datasets/protocol/memos__ANSWER_PROMPT_MEMOS.txt``).
The texts are never copied into tmem: the user passes a path, and this module reads it, finds its
placeholders and fills them from tmem's inputs. Placeholder styles:

* ``format`` — Python ``str.format``/f-string fields: ``{question}``, positional ``{}``;
  ``{{``/``}}`` are literal braces (the LoCoMo, MemOS and LoCoMo-Plus texts);
* ``jinja`` — ``{{ name }}`` variables only (the Mem0 texts); control blocks are refused;
* ``dollar`` — ``$name``/``${name}`` (:class:`string.Template`).

``auto`` picks ``dollar`` when the text has a ``${name}``, else ``format`` when it has
``str.format`` fields, else ``jinja`` when it has ``{{ name }}`` variables, else ``dollar`` when it
has a ``$name``. A placeholder the caller cannot fill is an error that
names the file, the placeholder and the names that can be filled — never a silent blank.
"""

from __future__ import annotations

import hashlib
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from tmem.errors import TmemError

PlaceholderStyle = Literal["format", "jinja", "dollar", "plain"]
STYLE_CHOICES = ("auto", "format", "jinja", "dollar")
POSITIONAL = ""  # the name of a positional ``{}`` field

_JINJA_VAR = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
_JINJA_BLOCK = re.compile(r"\{%|\{\{[^}]*[|(.\[][^}]*\}\}")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DOLLAR_BRACED = re.compile(r"(?<!\$)\$\{[A-Za-z_][A-Za-z0-9_]*\}")

# Placeholders of known protocol texts that tmem cannot fill honestly, with the reason.
UNSUPPORTED = {
    "speaker_1_memories": "tmem's context is not split per speaker; use a template with one context placeholder",
    "speaker_2_memories": "tmem's context is not split per speaker; use a template with one context placeholder",
    "speaker_1_graph_memories": "tmem has no knowledge-graph relations to fill it with",
    "speaker_2_graph_memories": "tmem has no knowledge-graph relations to fill it with",
}


class PromptFileError(TmemError):
    """A prompt file cannot be read or filled. Names the file and what is wrong."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"prompt file {path}: {reason}")

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return (type(self), (self.path, self.reason))


@dataclass(frozen=True)
class PromptTemplate:
    """A protocol prompt text and its placeholders (in order of first appearance)."""

    path: str
    text: str
    style: PlaceholderStyle
    fields: tuple[str, ...]  # POSITIONAL ("") for each positional field, in order
    sha256: str

    @property
    def version(self) -> str:
        """Content version for cache keys: the file's hash prefix."""
        return f"file-{self.sha256[:12]}"

    @property
    def names(self) -> frozenset[str]:
        return frozenset(f for f in self.fields if f != POSITIONAL)

    @property
    def positional_count(self) -> int:
        return sum(1 for f in self.fields if f == POSITIONAL)

    def fill(self, values: Mapping[str, str], positional: Sequence[str] = ()) -> str:
        """The text with every placeholder replaced. Positional ``{}`` fields take, in order, the
        values named by ``positional``. Raises :class:`PromptFileError` for a placeholder that
        ``values`` cannot fill."""
        self._check(values, positional)
        if self.style == "format":
            return _fill_format(self.text, values, list(positional))
        if self.style == "jinja":
            return _JINJA_VAR.sub(lambda m: values[m.group(1)], self.text)
        if self.style == "dollar":
            return string.Template(self.text).substitute(values)
        return self.text

    def _check(self, values: Mapping[str, str], positional: Sequence[str]) -> None:
        missing = sorted(self.names - set(values))
        if missing:
            name = missing[0]
            why = UNSUPPORTED.get(name, "tmem has no input of that name")
            raise PromptFileError(
                self.path, f"placeholder {name!r} cannot be filled ({why}); fillable: {', '.join(sorted(values))}"
            )
        if self.positional_count != len(positional):
            raise PromptFileError(
                self.path,
                f"{self.positional_count} positional {{}} field(s) but {len(positional)} positional name(s) given "
                f"({', '.join(positional) or 'none'}); pass the names to fill them with, in order",
            )
        unknown = [name for name in positional if name not in values]
        if unknown:
            raise PromptFileError(self.path, f"positional name {unknown[0]!r} is not fillable; fillable: {', '.join(sorted(values))}")


def _format_fields(text: str) -> list[str] | None:
    """``str.format`` field names of ``text`` ("" for positional), or None if it is not a valid format string."""
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError:
        return None
    return [name for _, name, _, _ in parsed if name is not None]


def _fill_format(text: str, values: Mapping[str, str], positional: list[str]) -> str:
    out: list[str] = []
    for literal, name, spec, conversion in string.Formatter().parse(text):
        out.append(literal)  # already unescaped: "{{" is "{" here
        if name is None:
            continue
        value = values[positional.pop(0)] if name == POSITIONAL else values[name]
        converted = {"r": repr, "a": ascii}.get(conversion or "", str)(value)
        out.append(format(converted, spec or ""))
    return "".join(out)


def detect_style(text: str) -> PlaceholderStyle | None:
    """The placeholder style of ``text`` (see the module docstring), or None when it has none."""
    if _DOLLAR_BRACED.search(text):  # "${name}" would also read as a str.format field
        return "dollar"
    fields = _format_fields(text)
    if fields:
        return "format"
    if _JINJA_VAR.search(text):
        return "jinja"
    if string.Template(text).get_identifiers():
        return "dollar"
    return None


def parse_template(text: str, path: str, style: str = "auto", *, plain_ok: bool = False) -> PromptTemplate:
    """Find the placeholders of ``text`` in ``style`` (``auto`` detects it). A text without any is
    an error unless ``plain_ok`` (e.g. a judge's fixed system message)."""
    if style not in STYLE_CHOICES:
        raise PromptFileError(path, f"unknown placeholder style {style!r}; choose one of {', '.join(STYLE_CHOICES)}")
    chosen = detect_style(text) if style == "auto" else style
    if chosen is None and not plain_ok:
        raise PromptFileError(path, "no placeholder found ({name}, {}, {{ name }} or $name): nothing to fill the inputs into")
    fields: list[str]
    if chosen is None:
        chosen, fields = "plain", []
    elif chosen == "format":
        found = _format_fields(text)
        if found is None:
            raise PromptFileError(path, "not a valid str.format template (unbalanced braces; use --prompt-style)")
        bad = [name for name in found if name != POSITIONAL and not _IDENTIFIER.fullmatch(name)]
        if bad:
            raise PromptFileError(path, f"field {{{bad[0]}}} is an expression, not a name; only plain names are filled")
        fields = found
    elif chosen == "jinja":
        if _JINJA_BLOCK.search(text):
            raise PromptFileError(path, "Jinja2 blocks, filters and expressions are not supported; only {{ name }}")
        fields = [m.group(1) for m in _JINJA_VAR.finditer(text)]
    else:
        template = string.Template(text)
        if not template.is_valid():
            raise PromptFileError(path, "invalid $-placeholder (write $$ for a literal dollar sign)")
        fields = template.get_identifiers()
    ordered = tuple(dict.fromkeys(f for f in fields if f != POSITIONAL)) + tuple(f for f in fields if f == POSITIONAL)
    return PromptTemplate(
        path=path, text=text, style=chosen, fields=ordered,  # type: ignore[arg-type]
        sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
    )


def load_prompt_file(path: Path | str, style: str = "auto", *, plain_ok: bool = False) -> PromptTemplate:
    """Read a protocol prompt file (UTF-8, kept byte for byte, whitespace included)."""
    where = Path(path)
    try:
        text = where.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptFileError(str(where), f"cannot read it ({exc})") from exc
    return parse_template(text, str(where), style, plain_ok=plain_ok)


# --------------------------------------------------------------------------- response models
# A protocol text asks for its answer in its own words; the adapter still asks for JSON, so the
# response models below carry no instructions of their own beyond naming the field.


class FileAnswer(BaseModel):
    answer: str = Field(min_length=1, description="The answer the prompt asks for.")


JudgeLabel = Literal["correct", "partial", "wrong"]
LABEL_SCORES: Mapping[str, float] = {"correct": 1.0, "partial": 0.5, "wrong": 0.0}


class FileJudgement(BaseModel):
    label: str = Field(description="The label the prompt asks for.")
    reason: str | None = Field(default=None, description="The explanation, if the prompt asks for one.")

    @field_validator("label")
    @classmethod
    def _known_label(cls, value: str) -> str:
        label = value.strip().strip("'\"’").lower()
        if label not in LABEL_SCORES:
            raise ValueError(f"label must be CORRECT, WRONG or PARTIAL (any case), got {value!r}")
        return label
