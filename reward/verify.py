"""The math verifier: DAPO's `Answer:` rule made robust, with math-verify for LaTeX. Pure functions, no I/O.

DAPO's reward (arXiv 2503.14476, Eq. 1 of section 2.4) is a rule: +1 when the final answer equals the
ground truth, -1 otherwise. Deciding "the final answer" and "equals" is the whole difficulty:

1. Find the final answer. Candidates are `Answer:` lines (also `**Answer:**`, `Final answer:`, `Therefore,
   Answer:`) and `\\boxed{...}`; the one that starts last wins, so a corrected answer beats an earlier one and two
   boxes are never read as a set. `The answer is 7` counts only with neither, on the last line: said earlier it
   is a step ("so the answer is 7. But wait, ..."), and a restatement after an `Answer:` line does not replace
   it. With no candidate the response has no final answer (a truncated response): we never fall back to "the
   last number in the text", which is how unanchored extraction rewards an unfinished derivation.
2. Clean it: Unicode minus and spaces, Markdown decoration, math delimiters, `\\text{}` and bold wrappers
   (whatever braces they hold), a trailing period or comma, an end mark.
3. Compare. A numeric ground truth (what DAPO-Math-17k and AIME use) is compared exactly as a rational
   number: leading zeros, thousands separators (`1,000`, `1\\,000`, `1 000`, but never `1,5`), currency and
   units and scale words (`5 million`) are handled; hedged answers (`12 or 13`, `12. Or 13.`), numbers side by
   side (`3 5`) and sides of `=` that differ (`4 = 5`) are wrong. Anything else, and numbers written as LaTeX
   expressions (`2^{10}`), go to math-verify, which knows fractions against decimals, sets, intervals,
   equations and symbolic equality.

`verify()` has no time limit of its own: math-verify's limit uses SIGALRM, which only works in a main thread,
so we call math-verify with it disabled. It refuses the answers that would make sympy allocate without bound
(power towers, huge exponents), but symbolic work can still be slow (`(x+y+z)^{999}` against 1 takes minutes).
Untrusted text at scale goes through `reward.sandbox.VerifierPool`, which enforces time and memory from outside.

This is the `robust` answer rule, the default. `reward.answer_rule: dapo` selects the paper's own, stricter rule
instead (`reward.reference`), for reproducing its numbers.
"""

from __future__ import annotations

import logging
import re
import unicodedata
from dataclasses import asdict, dataclass
from fractions import Fraction

from services.rewards import (  # noqa: F401 (the rule names, defined with the rules each answer rule uses)
    RULE_ANSWER_LINE,
    RULE_BOXED,
    RULE_DAPO,
    RULE_ERROR,
    RULE_MATH_VERIFY,
    RULE_NONE,
    RULE_TIMEOUT,
    RULES,
)

# Only the tail of a response can hold its final answer; bounding the scan bounds the cost of huge inputs.
MAX_SCAN_CHARS = 32_000
# The longest MATH-500 answer has 159 characters; a much longer "answer" is a paragraph, not an answer.
MAX_ANSWER_CHARS = 400

# math-verify warns once per process that its timeouts are off; the pool enforces time, so that is expected.
for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).setLevel(logging.ERROR)


@dataclass(frozen=True)
class Verdict:
    """Whether a response's final answer equals the ground truth, what was read, and which rule decided."""

    correct: bool
    extracted: str | None
    rule: str
    detail: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------------------------------------
# Text normalization
# --------------------------------------------------------------------------------------------------------

_CHAR_MAP = {
    # Minus and dash look-alikes a model (or a tokenizer round trip) produces.
    "\u2212": "-", "\u2012": "-", "\u2013": "-", "\u2014": "-", "\ufe63": "-", "\uff0d": "-", "\u2010": "-",
    "\u2011": "-",
    # Spaces: no-break, thin, narrow no-break, figure, ideographic.
    "\u00a0": " ", "\u2009": " ", "\u202f": " ", "\u2007": " ", "\u2008": " ", "\u200a": " ", "\u3000": " ",
    # Invisible characters.
    "\u200b": "", "\u200c": "", "\u200d": "", "\u2060": "", "\ufeff": "",
    # Full-width punctuation from CJK-trained models.
    "\uff1a": ":", "\uff0c": ",", "\uff0e": ".", "\u3002": ".", "\uff05": "%", "\uff04": "$",
}
_CHAR_MAP.update({chr(0xFF10 + d): str(d) for d in range(10)})  # full-width digits
_CHAR_TABLE = str.maketrans(_CHAR_MAP)


def normalize_text(text: str) -> str:
    """Unicode look-alikes to ASCII where they change the meaning of a number; drop control characters."""
    text = text.translate(_CHAR_TABLE)
    if not text.isascii():
        # Lone surrogates (valid in JSON escapes, not in UTF-8) would break every encoder downstream.
        text = text.encode("utf-8", "ignore").decode("utf-8")
    if not text.isprintable():
        # Control characters other than newline and tab (binary garbage) would only confuse the regexes.
        text = "".join(ch for ch in text if ch in "\n\t" or unicodedata.category(ch) != "Cc")
    return text


# --------------------------------------------------------------------------------------------------------
# Finding the final answer
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    text: str
    rule: str  # RULE_ANSWER_LINE or RULE_BOXED
    start: int


# `Answer: 7`, `**Answer:** 7`, `**Answer**: 7`, `Final answer: 7`, `The answer is 7`, `ANSWER：7`. The match
# stops at the marker, so a later marker on the same line ("Final Answer: The final answer is 5") is found too.
_ANSWER_RE = re.compile(r"(?i)\banswer\b(?P<colon>[ \t*_]*:|[ \t]+is\b[ \t]*:?)[ \t*_]*(?:\}[ \t*_]*)?")
# After "answer is" (no colon) only an answer-looking start counts: "the answer is 7", not "the answer is right".
_IS_FORM_START = re.compile(r"[-+$\\(\[{\d.*_`\"']")
# `Answer:` counts at the start of a line (after Markdown or LaTeX bold, a list number, "The final", a lead-in such as
# "Therefore," or "Step 5:") or after "final".
_COLON_FORM_PREFIX = re.compile(
    r"(?im)(?:^[\s#>*_\-\d.)]*(?:\\(?:textbf|textit|text|mathbf|emph)\s*\{[\s*_]*)?"
    r"(?:(?:therefore|thus|hence|so|finally|in\s+conclusion)\s*[,:]?\s*|step\s*\d+\s*[:.)]\s*"
    r"|\$?\\therefore\$?\s*)?(?:(?:the|my|our)\s+)?(?:final\s+)?[\s*_]*|final[\s*_]*)$"
)
MAX_LEAD_IN_CHARS = 200
_DISPLAY_CLOSE = {"$$": "$$", "\\[": "\\]"}
_NEXT_LINE = re.compile(r"[ \t]*\n[ \t]*\n?[ \t]*([^\n]+)")
_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])(?P<space>\s*)")


def _matching_braces(text: str) -> dict[int, int]:
    """Position of each `{` -> position just past its closing `}` (one linear pass; unclosed ones absent)."""
    pairs: dict[int, int] = {}
    stack: list[int] = []
    for i, ch in enumerate(text):
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            pairs[stack.pop()] = i + 1
    return pairs


def _boxes(text: str) -> list[tuple[int, int, str]]:
    """Every complete `\\boxed{...}` (or `\\boxed 7`) as (start, end, content), in order.

    An unclosed box (a response cut off inside it) is not an answer; a complete box inside it still is.
    """
    if "\\boxed" not in text and "\\fbox" not in text:
        return []
    pairs = _matching_braces(text)
    found = []
    for m in _BOX_RE.finditer(text):
        after = m.end()
        if after < len(text) and text[after] == "{":
            end = pairs.get(after)
            if end is not None:
                found.append((m.start(), end, text[after + 1 : end - 1]))
        elif m.group("space"):
            token = _BARE_BOX_TOKEN.match(text, after)
            if token:
                found.append((m.start(), token.end(), token.group()))
    return found


_BARE_BOX_TOKEN = re.compile(r"[^\s$]+")
# What may separate boxes that together state one multi-valued answer: "$x = \boxed{2}$ and $x = \boxed{3}$".
_BOX_JOINER = re.compile(
    r"(?:\s|\$|,|;|\band\b|\\text\{\s*(?:and|,)?\s*\}|\\quad|\\,|\\;|\b[A-Za-z](?:_\{?\w+\}?)?\s*=)*"
)


def _last_box(text: str, multi_valued: bool) -> Candidate | None:
    boxes = _boxes(text)
    if not boxes:
        return None
    start, end, content = boxes[-1]
    if multi_valued:
        # "x = \boxed{2} and \boxed{3}" answers a question whose truth is the set {2, 3}: join boxes that are
        # separated only by connectors. For a single-valued truth the last box alone is the answer.
        parts = [content]
        i = len(boxes) - 2
        while i >= 0 and _BOX_JOINER.fullmatch(text, boxes[i][1], start):
            start, _, content = boxes[i]
            parts.insert(0, content)
            i -= 1
        content = ", ".join(parts)
    return Candidate(content, RULE_BOXED, start)


def _last_answer_line(text: str, said: bool = False) -> Candidate | None:
    """The last `Answer:` line (also `the answer is: 42`); with `said`, the last `the answer is 42` instead, and only
    on the response's last line: said in passing ("so the answer is 34. But wait, ...", "the answer is 34 since
    ...") it is a step of the derivation, not its final answer."""
    markers = list(_ANSWER_RE.finditer(text))
    for m in reversed(markers):
        marker = m.group("colon").lower()
        if said != ("is" in marker and ":" not in marker):
            continue
        if "is" not in marker:
            line_start = text.rfind("\n", 0, m.start()) + 1
            # (no lead-in is that long: and a line of thousands of spaces would take the search seconds)
            if m.start() - line_start > MAX_LEAD_IN_CHARS or not _COLON_FORM_PREFIX.search(text, line_start, m.start()):
                continue  # "We may check our answer: 17*44 = 748" is not a final answer
        elif not _IS_FORM_START.match(text, m.end()):
            continue  # "the answer is right" (with a colon or not: "the answer is: 42" counts)
        line_end = text.find("\n", m.end())
        if said:
            if line_end >= 0 and text[line_end:].strip():
                return None  # the last one said is not on the last line: no later one is
            rest = text[m.end() :]
            return None if rest.count("{") > rest.count("}") else Candidate(rest, RULE_ANSWER_LINE, m.start())
        rest = text[m.end() : line_end if line_end >= 0 else len(text)]
        if not rest.strip(" \t*_"):
            # "Answer:" alone on its line: the answer is on the next non-empty line.
            following = _NEXT_LINE.match(text, m.end())
            if following is None:
                continue
            rest = following.group(1)
            if rest.strip() in _DISPLAY_CLOSE:  # the answer is a display on the lines below: `$$`, 5, `$$`
                close = text.find(_DISPLAY_CLOSE[rest.strip()], following.end())
                if close < 0:
                    continue  # cut off inside the display
                rest = text[following.end() : close]
        said = next((inner for inner in _ANSWER_RE.finditer(rest) if _IS_FORM_START.match(rest, inner.end())), None)
        if said is not None:  # "Final Answer: The final answer is 5": what follows the last marker of its line
            rest = rest[said.end():]
        if rest.count("{") > rest.count("}"):
            continue  # cut off inside a group ("the answer is \boxed{12"): not a complete answer
        return Candidate(rest, RULE_ANSWER_LINE, m.start())
    return None


def find_final_answer(response: str, multi_valued: bool = False) -> Candidate | None:
    """The last stated final answer: an `Answer:` line or a box, whichever starts later; with neither, a last line
    that says `the answer is 42`."""
    text = normalize_text(response[-MAX_SCAN_CHARS:])
    line = _last_answer_line(text)
    box = _last_box(text, multi_valued)
    if line is None and box is None:
        return _last_answer_line(text, said=True)
    if line is None or box is None:
        return line or box
    # A box inside the answer line ("Answer: $\boxed{7}$") starts later, so the box's clean content wins.
    return box if box.start >= line.start else line


# --------------------------------------------------------------------------------------------------------
# Cleaning an extracted answer
# --------------------------------------------------------------------------------------------------------

# Decoration around an answer, unwrapped whatever it holds: `\\textbf{2\\sqrt{113}}` is 2\\sqrt{113}.
_FORMATTING = ("textbf", "textit", "mathbf", "mathit", "boldsymbol", "bm", "underline", "emph", "textsf", "mathsf",
               "textup", "textnormal", "boxed", "fbox", "displaystyle")
# Words and units: unwrapped for the text and number rules; math-verify gets them kept (it reads units from them).
_TEXT = ("text", "textrm", "texttt", "mathrm", "mbox", "operatorname")
_WRAPPER = re.compile(r"\\(" + "|".join(sorted(_FORMATTING + _TEXT, key=len, reverse=True)) + r")(?![A-Za-z])\s*\{")
_END_MARKS = re.compile(r"(?:\s*(?:\\(?:blacksquare|square|qed|Box)(?![A-Za-z])|∎|□))+\s*$")
# A matrix row break `\\` is matched whole and kept: its second backslash and a blank are not the `\ ` space
# (reading `\begin{pmatrix} 1 \\ 2 \end{pmatrix}` as one entry `1 2`, math-verify added it up to 3).
_SPACING = re.compile(r"\\\\|\\[,;: ]|~|\\quad|\\qquad|\\enspace|\\thinspace")
# A Minerva-style tail: "$5$. I hope it is correct."
_SENTENCE_END = re.compile(r"(?<=[\d$}\])a-zA-Z])\.\s+(?=[A-Z])")


def _blank_unless_row_break(match: re.Match) -> str:
    return match.group() if match.group() == "\\\\" else " "


def clean_answer(text: str, unwrap: bool = True) -> str:
    """Strip what decorates an answer without changing it: Markdown, math delimiters, a full stop, and
    (with `unwrap`) `\\text{}`-like wrappers. math-verify gets the wrappers kept: it reads units from them."""
    text = normalize_text(text).strip()
    text = _SENTENCE_END.split(text, maxsplit=1)[0]
    # Math delimiters: $...$, $$...$$, \(...\), \[...\]; a lone `$` ("Answer: $42", copied from the prompt).
    text = re.sub(r"(?<!\\)\$", " ", text)
    text = re.sub(r"\\\\|\\[()\[\]]", _blank_unless_row_break, text)
    text = re.sub(r"\\!\s*", "", text.replace("{,}", ","))  # `11,\! 111`: a negative space, and TeX ignores the blank
    text = text.replace("\\left", "").replace("\\right", "")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = _SPACING.sub(_blank_unless_row_break, text)
    text = _unwrap(text, _FORMATTING + _TEXT if unwrap else _FORMATTING)
    text = _END_MARKS.sub("", text)  # a proof's end mark after the answer
    text = re.sub(r"\s+", " ", text).strip(" \t*_`#>\"'")
    text = re.sub(r"(?:\s*\\\\)+$", "", text)  # a line break after the answer
    text = text.rstrip(" .;,")  # "509." is 509 (but "5!" stays a factorial)
    if text.endswith(")") and text.count(")") + text.count("]") > text.count("(") + text.count("["):
        text = text[:-1]  # "(The answer is 34)": the sentence's parenthesis, not the answer's (nor `[3, 5)`'s)
    return text.strip(" \t*_`")


def _unwrap(text: str, commands: tuple[str, ...]) -> str:
    """`text` with each `\\command{...}` of `commands` replaced by what its braces hold (balanced: the content may
    hold braces of its own); an unclosed one is left as it is."""
    for _ in range(MAX_NESTING):  # one pass per level of wrappers inside wrappers
        pairs, out, pos, changed = _matching_braces(text), [], 0, False
        for m in _WRAPPER.finditer(text):
            end = pairs.get(m.end() - 1)
            if m.group(1) not in commands or end is None or m.start() < pos:
                continue
            out += [text[pos : m.start()], text[m.end() : end - 1]]
            pos, changed = end, True
        if not changed:
            return text
        text = "".join(out) + text[pos:]
    return text


# --------------------------------------------------------------------------------------------------------
# Numbers
# --------------------------------------------------------------------------------------------------------

_NUMBER_RE = re.compile(
    r"""
    (?P<currency>\\\$|\$|€|£|¥|USD\s*)?\s*
    (?P<sign>[-+])?\s*
    (?P<currency2>\\\$|\$|€|£|¥)?\s*
    (?:
        \\frac\s*\{\s*(?P<fnum>[-+]?\d+)\s*\}\s*\{\s*(?P<fden>\d+)\s*\}   # \frac{3}{4}
      | \\frac(?P<snum>\d)(?P<sden>\d)                                 # \frac34 (TeX shorthand)
      | (?P<int>\d{1,3}(?:,\d{3})+(?!\d)|\d{1,3}(?:\ \d{3})+(?!\d)|\d+)?    # 1,234 | 1 234 | 0025
        (?P<dec>\.\d+|\.(?!\d))?                                       # .5 | 5.
        (?:\s*/\s*(?P<den>\d+))?                                       # 3/4
    )
    """,
    re.VERBOSE,
)
_UNIT_TOKEN = re.compile(
    r"\s*(?:\\%|%|°|\^\s*\{?\s*\\circ\s*\}?|\\circ|\\degree|\^\s*\{?\s*[23]\s*\}?|/\s*[A-Za-z]+(?![A-Za-z])"
    r"|[A-Za-z]+(?![A-Za-z])\.?)"
)
# A number's scale in words: `5 million` is 5000000, or 5 counted in millions (`_verify_number` takes either); not
# 5 of a unit called "million". (`7 dozen` stays a count of dozens: GSM8K asks "how many dozens".)
_SCALE_WORDS = {"hundred": 100, "thousand": 10**3, "million": 10**6, "billion": 10**9, "trillion": 10**12}
_SCALE = re.compile(r"(?i)\s*(" + "|".join(_SCALE_WORDS) + r")(?![A-Za-z])")
# Words right after a number that change its value: never units (`3 times 4` fails anyway: `4` is no unit).
_OPERATOR_WORDS = {"squared", "cubed", "factorial"}
_SQUARED = re.compile(r"\^\s*\{?\s*[23]\s*\}?")  # `cm^2`: a unit squared; after a bare number (`2^3`) a power
# What may stand left of `=` in a one-number answer: a variable (`x`, `a_1`, `\theta`) or arithmetic (`2+3 = 5`).
_NAME_OR_ARITHMETIC = re.compile(
    r"\s*(?:[A-Za-z](?:_\{?\w+\}?)?|\\[A-Za-z]+|(?:[\d.,\s+\-*/()^{}×÷]|\\cdot|\\times|\\div)+)?\s*"
)
# ... or what the problem asked for, named: `m + n`, `a+b+c`, `AB`, `f(2)`, `P(A)`, `\angle ABC`. Digits only in
# a subscript or the argument of a name: `2x = 34`, `(2x) = 34`, `(x-3)(x+5) = 0` and `x^2 - 4 = 0` are equations,
# not the value of their right side. Each token can match one way only (a letter run ends where the letters do, a
# subscript is `{...}` or one character), so a long response that does not match fails in linear time.
_NAMED_QUANTITY = re.compile(
    r"(?:\\?[A-Za-z]+(?![A-Za-z])(?:_(?:\{\w+\}|\w))?(?:\s*\([^()=,]*\))?|\|[^|=]{1,40}\||\\\#"
    r"|\\(?:overline|bar|widehat|hat)\s*\{[^{}=]{1,40}\}|[+\-*/·\s])+"
)
# What states the conclusion of a derivation in an answer: `m = 15, n = 19, so m + n = 34` states 34.
_CONCLUSION = re.compile(r"(?i)\b(?:so|thus|hence|therefore)\b|\\therefore|\\implies|\\Rightarrow")
# Short letter runs that are units (or ordinals), not variables: "5x" and "3i" must not read as 5 and 3.
_SHORT_UNITS = {
    "m", "g", "s", "h", "l", "L", "K", "J", "N", "W", "V", "A", "cm", "mm", "km", "kg", "mg", "ml", "mL", "hr",
    "ft", "in", "yd", "mi", "lb", "oz", "Hz", "th", "st", "nd", "rd", "sq", "pm", "am", "AM", "PM",
}
HEDGE_WORDS = {
    "or", "and", "nor", "either", "neither", "maybe", "perhaps", "possibly", "probably", "approximately",
    "approx", "about", "around", "roughly", "between", "not", "nearly", "almost", "likely", "unsure", "guess",
    "alternatively", "otherwise", "might",
}
_HEDGE_RE = re.compile(
    r"(?i)\b(?:" + "|".join(sorted(HEDGE_WORDS)) + r")\b|\\lor\b|\\vee\b|\\pm\b|±|\\approx\b|≈|\\sim\b|\?"
)


def _units_only(rest: str) -> bool:
    """True if `rest` (what follows a number) is only units: `cm`, `\\%`, `^\\circ`, `square units`."""
    pos, after_unit = 0, False
    while pos < len(rest):
        m = _UNIT_TOKEN.match(rest, pos)
        if m is None or m.end() == pos:
            return rest[pos:].strip() == ""
        word = m.group().strip().rstrip(".")
        lowered = word.lower()
        if word.isalpha() and (lowered in HEDGE_WORDS or lowered in _OPERATOR_WORDS or lowered in _SCALE_WORDS
                               or (len(word) <= 2 and word not in _SHORT_UNITS)):
            return False
        if _SQUARED.fullmatch(word) and not after_unit:
            return False  # `2^3` is 8, not 2 cubic somethings
        pos, after_unit = m.end(), word.isalpha()
    return True


def _value_side(text: str) -> str | None:
    """The value an answer with `=` states: its last side, when each side before it is a variable (`x = 12`), a
    named quantity (`m + n = 34`) or arithmetic (`x = 2+3 = 5`); None for an equation (`5x - 7y + 4 = 0`) or
    several values (`x = 12, x = 13`). What comes after a conclusion (`m = 15, n = 19, so m + n = 34`) is what it
    states."""
    text = _CONCLUSION.split(text)[-1]
    *sides, value = text.split("=")
    named = (_NAME_OR_ARITHMETIC.fullmatch(side) or _NAMED_QUANTITY.fullmatch(side) for side in sides)
    return value if all(named) else None


def parse_number(text: str, scaled: bool = True) -> Fraction | None:
    """The exact value of a cleaned answer that is one plain number (units allowed), else None.

    `025` -> 25, `1,000` -> 1000, `1 000` -> 1000, `-3.50` -> -7/2, `\\frac{3}{4}` -> 3/4, `12 cm` -> 12,
    `2.5 million` -> 2500000, `1,5` -> None (not a thousands separator: a list, or a decimal comma we refuse to
    guess),
    `12 or 13` -> None.
    """
    if "=" in text:
        text = _value_side(text)
        if text is None:
            return None
    text = text.strip()
    if not text or len(text) > 200:
        return None
    m = _NUMBER_RE.match(text)
    if m is None:
        return None
    g = m.groupdict()
    if g["currency"] and g["currency2"]:
        return None
    sign = -1 if g["sign"] == "-" else 1
    if g["fnum"] is not None:
        if int(g["fden"]) == 0:
            return None
        value = Fraction(int(g["fnum"]), int(g["fden"]))
    elif g["snum"] is not None:
        if g["sden"] == "0":
            return None
        value = Fraction(int(g["snum"]), int(g["sden"]))
    else:
        digits = (g["int"] or "").replace(",", "").replace(" ", "")
        decimal = g["dec"] or ""
        if not digits and len(decimal) <= 1:
            return None  # no digit at all
        value = Fraction((digits or "0") + (decimal if len(decimal) > 1 else ""))
        if g["den"] is not None:
            if decimal or int(g["den"]) == 0:
                return None
            value /= int(g["den"])
    rest = text[m.end() :]
    scale = _SCALE.match(rest)
    if scale:
        value *= _SCALE_WORDS[scale.group(1).lower()] if scaled else 1
        rest = rest[scale.end() :]
    if not _units_only(rest):
        return None
    return sign * value


def _is_integer(value: Fraction) -> bool:
    return value.denominator == 1


# --------------------------------------------------------------------------------------------------------
# math-verify (LaTeX, sets, intervals, symbolic equality)
# --------------------------------------------------------------------------------------------------------

_THOUSANDS_SPACE = re.compile(r"(?<![\d.])(\d{1,3}(?: \d{3})+)(?![\d.])")


def _for_math_verify(answer: str) -> str:
    # `\boxed{1 000}` is 1x0 to latex2sympy: join digit groups split by spaces (from `\,`, `~`, thin space).
    return _THOUSANDS_SPACE.sub(lambda m: m.group(1).replace(" ", ""), answer)


# Answers sympy would try to evaluate into astronomically large numbers (`9^{9^{9}}` is 370 million digits before
# its last step; a fuzzing run of plain verify() grew to 15 GB on one), and nesting that makes the LaTeX parser
# crawl. No real final answer looks like this; refusing them keeps verify() usable outside the sandbox.
_POWER_TOWER = re.compile(r"\^\s*\{[^{}]*\^|(?:\^|\*\*)\s*\(?\s*[\w.]+\s*\)?\s*(?:\^|\*\*)")
_HUGE_EXPONENT = re.compile(r"(?:\^|\*\*)\s*\{?\s*\(?\s*-?\d{6,}|\d{5,}\s*!")
MAX_NESTING = 10


def _too_expensive(answer: str) -> str | None:
    if _POWER_TOWER.search(answer):
        return "a power tower"
    if _HUGE_EXPONENT.search(answer):
        return "a huge exponent or factorial"
    depth = deepest = 0
    for ch in answer:
        if ch in "{([":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "})]":
            depth = max(0, depth - 1)
    if deepest > MAX_NESTING:
        return f"nesting deeper than {MAX_NESTING}"
    return None


def _math_verify(ground_truth: str, answer: str) -> tuple[bool, str]:
    """math-verify on an already extracted answer; its own (signal based) timeouts are off."""
    from math_verify import parse as mv_parse
    from math_verify import verify as mv_verify

    refused = _too_expensive(answer)
    if refused:
        return False, f"not evaluated: {refused} (no real final answer needs one)"

    gold = mv_parse("\\boxed{" + _for_math_verify(ground_truth) + "}", parsing_timeout=None)
    pred = mv_parse("\\boxed{" + _for_math_verify(answer) + "}", parsing_timeout=None)
    if not gold:
        return False, "math-verify could not parse the ground truth"
    if not pred:
        return False, "math-verify could not parse the answer"
    ok = mv_verify(gold, pred, timeout_seconds=None)
    # parse() returns [value, source string]; printing the sympy value of a hostile input can be slow.
    read = next((p for p in reversed(pred) if isinstance(p, str)), "an expression")
    return bool(ok), f"math-verify: {read[:80]!r} {'equals' if ok else 'differs from'} the ground truth"


# --------------------------------------------------------------------------------------------------------
# The verdict
# --------------------------------------------------------------------------------------------------------

_TOP_LEVEL_COMMA = re.compile(r",(?![^{]*\})")


def _is_multi_valued(clean_truth: str) -> bool:
    """A ground truth listing several values (`2, 3`), as opposed to a tuple or interval `(1, 2]`."""
    if not _TOP_LEVEL_COMMA.search(clean_truth) or clean_truth[:1] in "([{":
        return False
    return parse_number(clean_truth) is None


def verify(response: str, ground_truth: str) -> Verdict:
    """Decide whether `response` ends with a final answer equal to `ground_truth`.

    >>> verify("... so the total is 25.\\n\\n**Answer:** 025", "25").correct
    True
    >>> verify("Answer: 12 or 13", "12").correct
    False
    """
    truth = clean_answer(ground_truth)
    candidate = find_final_answer(response, multi_valued=_is_multi_valued(truth))
    if candidate is None:
        return Verdict(False, None, RULE_NONE, "no final answer (no `Answer:` line and no \\boxed{})")
    answer = clean_answer(candidate.text)
    if not answer:
        return Verdict(False, "", candidate.rule, "the final answer is empty")
    if len(answer) > MAX_ANSWER_CHARS:
        return Verdict(False, answer[:MAX_ANSWER_CHARS] + "...", candidate.rule, "the final answer is too long")
    # math-verify gets the text with its \text{} wrappers: it reads units and words from them.
    truth_latex, answer_latex = clean_answer(ground_truth, unwrap=False), clean_answer(candidate.text, unwrap=False)

    truth_value = parse_number(truth)
    if truth_value is not None:
        tail = _SENTENCE_END.split(normalize_text(candidate.text).strip(), maxsplit=1)[1:]
        return _verify_number(truth_value, truth_latex, answer, answer_latex, candidate.rule, "".join(tail))

    # Non-numeric truth (LaTeX, a set, an interval, a word): the same text first, then math-verify.
    if _canonical_text(answer) == _canonical_text(truth):
        return Verdict(True, answer, candidate.rule, "same text as the ground truth")
    ok, detail = _math_verify(truth_latex, answer_latex)
    return Verdict(ok, answer, RULE_MATH_VERIFY, detail)


# The sentence after a numeric answer is a hedge when it starts like one (`12. Or 13.`, `12. Maybe 14.`) or is
# another number alone (`12. 13.`); a remark (`12. Indeed 3 x 4 = 12.`, `12. Done in 3 steps.`) is not.
_HEDGE_START = re.compile(
    r"(?i)\s*(?:or|alternatively|otherwise|maybe|perhaps|possibly|probably|might|either|unless|else)\b"
)
_BARE_NUMBER = re.compile(r"\s*\$?\s*([-+]?\d[\d,]*(?:\.\d+)?)\s*\$?\s*[.?!]?\s*")
# Numbers side by side: `3 5`, `3 -5` (math-verify would add them up); `2 \frac12` and `3 - 5` do not match.
# and `12. 13` (a number alone after the stop: `12. 12 is the largest n.` is a remark)
_NUMBERS_APART = re.compile(r"\d\s*[,;]\s*\d|\d\s+[-+]?\d|\d\s*\.\s+[-+]?\d[\d,]*(?:\.\d+)?\s*[.?!]?\s*$")


# Two numbers joined by an arithmetic operator (`3+4*5`, `12 \times 3`); `2 \times 10^3` is a number written so.
_CALCULATION = re.compile(r"\d\s*(?:[-+*/×÷·]|\\(?:times|cdot|div)(?![A-Za-z]))\s*\(?\s*[-+]?\d(?!\d*\s*\^)")


def _hedge_after(tail: str, value: Fraction | None) -> str | None:
    """What makes the sentence after a numeric answer a hedge (`_HEDGE_START`, `_BARE_NUMBER`), else None."""
    sentence = re.split(r"(?<=[.?!])\s", tail.strip(), maxsplit=1)[0]
    if start := _HEDGE_START.match(sentence):
        return start.group().strip()
    bare = _BARE_NUMBER.fullmatch(sentence)
    if bare and parse_number(bare.group(1)) != value:
        return bare.group(1)
    return None


def _verify_number(truth_value: Fraction, truth_latex: str, answer: str, answer_latex: str, rule: str,
                   tail: str = "") -> Verdict:
    hedge = _HEDGE_RE.search(answer)
    if hedge:
        return Verdict(False, answer, rule, f"hedged answer ({hedge.group()!r})")
    if "=" in answer and _value_side(answer) is None:  # math-verify would compare `x^2 - 4 = 0` by its right side
        return Verdict(False, answer, rule, "an equation or several values where one number is expected")
    value = parse_number(answer)
    if "=" in answer and value is not None:
        stated = [parse_number(side) for side in _CONCLUSION.split(answer)[-1].split("=")[:-1]]
        if any(side is not None and side != value for side in stated):  # `4 = 5` states two values
            return Verdict(False, answer, rule, "sides of `=` that are different numbers")
    if tail:
        hedge_after = _hedge_after(tail, value)
        if hedge_after is not None:
            return Verdict(False, answer, rule, f"hedged answer (after it: {hedge_after!r})")
    if value is None:
        if _NUMBERS_APART.search(answer):
            return Verdict(False, answer, rule, "several numbers (or a decimal comma) where one number is expected")
        if _is_integer(truth_value) and _CALCULATION.search(answer):
            # `3+4*5`: the problem's own expression copied, which math-verify would evaluate to the truth
            return Verdict(False, answer, rule, "a calculation where its result is expected")
        # A number written as an expression (`2^{10}`, `\\sqrt{16}`): math-verify evaluates it.
        ok, detail = _math_verify(truth_latex, answer_latex)
        return Verdict(ok, answer, RULE_MATH_VERIFY, detail)
    if value == truth_value or (_SCALE.search(answer) and parse_number(answer, scaled=False) == truth_value):
        return Verdict(True, answer, rule, f"equals {_format(truth_value)}")
    if _is_integer(truth_value) and "%" not in truth_latex:
        # An integer truth is exact: no rounding tolerance, so 2.9999999 is not 3 and 23-digit answers stay exact;
        # `500%` is not 5 (a percentage reads as its number: `5%` for 5 is equal above).
        return Verdict(False, answer, rule, f"{_format(value)} != {_format(truth_value)}")
    # A non-integer truth or a percentage truth: a rounded decimal of 1/3, or `12%` for 0.12, is math-verify's call.
    ok, detail = _math_verify(truth_latex, answer_latex)
    return Verdict(ok, answer, RULE_MATH_VERIFY, detail)


def _format(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def _canonical_text(text: str) -> str:
    return re.sub(r"\s+", "", text).lower()
