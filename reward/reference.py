"""The DAPO paper's own answer rule (`reward.answer_rule: dapo`), for reproducing its numbers. Pure, no I/O.

The paper's reward is verl's `verl/utils/reward_score/math_dapo.py` (`compute_score`, default arguments): a
Minerva-style exact match (Lewkowycz et al. 2022, appendix D.1). This module behaves the same, quirks included:

1. Only the last `TAIL_CHARS` (300) characters of the response are read.
2. The final answer is the capture of the last match of `Answer\\s*:\\s*([^\\n]+)` (case-insensitive). The
   pattern is not line-anchored ("Thus the answer: 34" counts) and `\\s*` may cross newlines ("Answer:\\n34").
   No match: no answer, reward -1. `\\boxed{}` alone is never read.
3. The answer and the ground truth are both normalised by `normalize_final_answer` and compared as strings:
   `025` is not `25`, `0.5` is not `\\frac{1}{2}`, but `$\\frac12$` is `\\frac{1}{2}` and `1,000` is `1000`.

Differences from the robust default (`reward.verify`) are deliberate there; this module is only the reference.
One quirk is not reproduced: verl compares the placeholder "[INVALID]" when there is no match, so a ground truth
that normalises to "[INVALID]" would count a response without an answer as correct; here it is always wrong.
"""

from __future__ import annotations

import re

from reward.verify import RULE_DAPO, RULE_NONE, Verdict

# verl: `solution_str[-300:]`, "the longest answer in MATH-500 has 159 characters".
TAIL_CHARS = 300
ANSWER_PATTERN = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)

# Minerva's normalisation tables, applied in this order with plain (non-regex) replacement. Their quirks are the
# reference's: "an " and "a " go anywhere ("a banana split" -> "banansplit"), a removed word goes from inside others
# too, and `\text{and}` becomes a comma that the digit rule then drops ("5 and 6" in \text{} -> "56").
SUBSTITUTIONS: tuple[tuple[str, str], ...] = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
REMOVED_EXPRESSIONS: tuple[str, ...] = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples",
    "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}",
    "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)

# (pattern, replacement) in order. Without DOTALL, as in the reference: `.` stops at a newline.
_REWRITES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r".*?\$(.*?)\$.*"), r"$\1$"),  # keep the first $...$ of a line, drop the prose around it
    (re.compile(r"\\text\{(.*?)\}"), r"\1"),  # unwrap, up to the first closing brace
    (re.compile(r"\\textbf\{(.*?)\}"), r"\1"),
    (re.compile(r"\\overline\{(.*?)\}"), r"\1"),
    (re.compile(r"\\boxed\{(.*)\}"), r"\1"),  # greedy: up to the last closing brace
    (re.compile(r"frac([^{])(.)"), r"frac{\1}{\2}"),  # \frac12 -> \frac{1}{2}
    (re.compile(r"sqrt([^{])"), r"sqrt{\1}"),  # \sqrt2 -> \sqrt{2}
)


def normalize_final_answer(answer: str) -> str:
    """Minerva's normalisation of a final answer (or a ground truth), as the DAPO reference applies it."""
    answer = answer.rsplit("=", 1)[-1]  # the last side of an equation: `x = 5` -> ` 5`
    for before, after in SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expression in REMOVED_EXPRESSIONS:
        answer = answer.replace(expression, "")
    for pattern, replacement in _REWRITES:
        answer = pattern.sub(replacement, answer)
    answer = answer.replace("$", "")
    without_commas = answer.replace(",", "")
    if without_commas.isdigit():  # `1,000` -> `1000` (str.isdigit: Unicode digits such as `²` count too)
        answer = without_commas
    return answer.strip()


def verify_dapo(response: str, ground_truth: str) -> Verdict:
    """The reference verdict: the last `Answer:` of the response's last 300 characters, normalised, equals the
    normalised ground truth as a string. `extracted` is the normalised answer (verl's `pred`)."""
    found = ANSWER_PATTERN.findall(response[-TAIL_CHARS:])
    if not found:
        return Verdict(False, None, RULE_NONE, f"no `Answer:` in the last {TAIL_CHARS} characters (dapo rule)")
    answer = normalize_final_answer(found[-1])
    truth = normalize_final_answer(ground_truth)
    correct = answer == truth
    relation = "==" if correct else "!="
    return Verdict(correct, answer, RULE_DAPO, f"{answer[:80]!r} {relation} {truth[:80]!r} (normalised strings)")
