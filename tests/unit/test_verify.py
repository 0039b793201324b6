"""The verifier, table-driven: every category of the reward issue, each case with the reason it matters.

Columns: response, ground truth, expected verdict, expected deciding rule, reason. Cases marked in
`MATH_VERIFY_ALONE_WRONG` are ones where calling math-verify directly gives the wrong verdict; a test checks
that it still does, so the table keeps showing where the combined verifier is needed.
"""

from __future__ import annotations

import logging

import pytest

from reward import Verdict, verify
from reward.verify import RULES, clean_answer, find_final_answer, parse_number

A, B, M, N = "answer_line", "boxed", "math_verify", "none"

CASES = [
    # id, response, ground truth, correct, rule, reason
    # --- leading zeros ---
    ("zero-pad", "Answer: 025", "25", True, A, "AIME answers written with 3 digits; the reference compares strings"),
    ("zero-pad-2", "Answer: 007", "7", True, A, "several leading zeros are still the same integer"),
    ("zero-pad-truth", "Answer: 25", "025", True, A, "some data sets store the truth zero-padded"),
    ("zero-decimal", "Answer: 0.50", "0.5", True, A, "trailing zeros of a decimal do not change it"),
    ("zero-suffix", "Answer: 250", "25", False, A, "zeros after the digits do change the value"),
    # --- thousands separators ---
    ("comma-1000", "Answer: 1,000", "1000", True, A, "comma thousands separator"),
    ("comma-1-5", "Answer: 1,5", "15", False, A, "`1,5` is not 15: the reference strips every comma"),
    ("comma-decimal", "Answer: 1,5", "1.5", False, A, "a decimal comma is ambiguous with a list; refuse to guess"),
    ("space-1000-boxed", r"\boxed{1 000}", "1000", True, B, "math-verify parses `1 000` as 1x0"),
    ("thin-space", r"Answer: $1\,000$", "1000", True, A, "LaTeX thin space as thousands separator"),
    ("brace-comma", r"Answer: $1{,}000{,}000$", "1000000", True, A, "LaTeX `{,}` thousands separator"),
    ("bad-grouping", "Answer: 12,34", "1234", False, A, "groups of 2 digits are not thousands"),
    ("millions", "Answer: 1,234,567", "1234567", True, A, "several thousands groups"),
    # --- Unicode minus and other look-alikes ---
    ("unicode-minus", "Answer: \u22123", "-3", True, A, "U+2212 minus; math-verify extracts nothing"),
    ("unicode-minus-sign", "Answer: \u22123", "3", False, A, "the minus sign is not dropped"),
    ("unicode-minus-boxed", "$\\boxed{\u2212\\frac{1}{2}}$", "-\\frac{1}{2}", True, B, "Unicode minus in a box"),
    ("fullwidth", "Answer\uff1a\uff14\uff12", "42", True, A, "full-width colon and digits"),
    ("en-dash-minus", "Answer: \u20135", "-5", True, A, "an en dash used as a minus"),
    # --- trailing period ---
    ("period", "Answer: 509.", "509", True, A, "the reference compares `509.` with `509`"),
    ("period-after-box", "The answer is $\\boxed{509}$.", "509", True, B, "sentence period after a box"),
    ("period-decimal", "Answer: 3.5.", "3.5", True, A, "a full stop after a decimal"),
    # --- decorated answer lines ---
    ("bold-colon-inside", "**Answer:** 7", "7", True, A, "Markdown bold around the label; the reference reads `** 7`"),
    ("bold-colon-outside", "**Answer**: 7", "7", True, A, "bold label, colon outside"),
    ("heading-final", "### Final Answer: 7", "7", True, A, "Markdown heading and `Final`"),
    ("italic", "*Answer:* $7$", "7", True, A, "italic label and math delimiters"),
    ("bold-value", "Answer: **7**", "7", True, A, "bold value"),
    ("upper", "ANSWER: 7", "7", True, A, "upper case label"),
    ("minerva", "Final Answer: The final answer is $7$. I hope it is correct.", "7", True, A,
     "Minerva style: the later `answer is` on the same line, without the trailing sentence"),
    ("check-our-answer", "So $17^{-1} \\equiv \\boxed{44} \\pmod{83}$.\n\nWe may check our answer: "
     "$17\\cdot 44 = 748 \\equiv 1$, so it is correct.", "44", True, B,
     "`our answer:` inside a sentence is not a final-answer line (MATH-500 test/number_theory)"),
    ("next-line", "Answer:\n\n42", "42", True, A, "label alone on its line, value on the next"),
    ("is-form", "After simplifying, the answer is 42", "42", True, A, "`the answer is N` without a colon"),
    ("is-form-not-answer", "\\boxed{42}. Let me double-check that the answer is right.", "42", True, B,
     "`the answer is right` is prose, not a later answer"),
    ("numbered-list", "3. Answer: 42", "42", True, A, "answer label after a list number"),
    # --- units and currency ---
    ("unit-cm", "Answer: 12 cm", "12", True, A, "a unit after the number"),
    ("unit-text-squared", "Answer: $12\\text{ cm}^2$", "12", True, A, "a \\text{} unit with an exponent"),
    ("degrees", "Answer: $30^\\circ$", "30", True, A, "degree sign"),
    ("currency", "Answer: \\$18.90", "18.90", True, A, "escaped dollar sign"),
    ("unit-words", "Answer: 45 square units", "45", True, A, "several unit words"),
    ("variable-not-unit", "Answer: 5x", "5", False, M, "a variable is not a unit"),
    ("imaginary-not-unit", "Answer: 3i", "3", False, M, "`i` is the imaginary unit, not a unit"),
    ("percent-same-number", "Answer: 25\\%", "25", True, A, "percentage questions state the truth as 25"),
    ("percent-as-fraction", "Answer: 25%", "0.25", True, M, "25% is 0.25 when the truth is the fraction"),
    ("percent-truth", "Answer: 0.1", "10\\%", True, M, "a percentage truth accepts the fraction too"),
    # --- boxed-only responses ---
    ("boxed-only", "so the result is \\boxed{42}", "42", True, B, "no Answer: line, a box"),
    ("boxed-dfrac", "\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", True, B, "\\dfrac against \\frac"),
    ("boxed-decimal-vs-frac", "$\\boxed{0.75}$", "\\frac34", True, B, "decimal against shorthand fraction"),
    ("boxed-no-brace", "\\boxed 7", "7", True, B, "TeX allows \\boxed without braces for one token"),
    ("fbox", "\\fbox{7}", "7", True, B, "\\fbox is a box too"),
    ("boxed-nested", "\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", True, B, "nested braces inside a box"),
    # --- several boxes: the last final answer wins ---
    ("two-boxes-last", "First \\boxed{3}, but that is wrong; correcting: \\boxed{5}", "5", True, B,
     "math-verify reads two boxes as the set {3, 5}"),
    ("two-boxes-first", "First \\boxed{3}, but that is wrong; correcting: \\boxed{5}", "3", False, B,
     "the earlier, retracted box does not count"),
    ("line-then-box", "Answer: 5\n\nWait, I made an error. Actually \\boxed{6}", "6", True, B,
     "a box after an Answer: line is the later final answer"),
    ("box-then-line", "\\boxed{6}\n\nOn reflection:\nAnswer: 5", "5", True, A, "an Answer: line after a box wins"),
    ("boxes-as-set", "$x = \\boxed{2}$ and $x = \\boxed{3}$", "2, 3", True, B,
     "when the truth lists several values, adjacent boxes joined by `and` are one answer"),
    # --- hedged answers ---
    ("hedge-or-first", "Answer: 12 or 13", "12", False, A, "math-verify takes 12 and accepts"),
    ("hedge-or-second", "Answer: 12 or 13", "13", False, A, "a hedge is wrong whichever value is true"),
    ("hedge-approx", "Answer: approximately 12", "12", False, A, "an approximation of an exact answer"),
    ("hedge-text-or", "Answer: $12 \\text{ or } 13$", "12", False, A, "`or` inside \\text{}"),
    ("hedge-pm", "Answer: $12 \\pm 1$", "12", False, A, "a range, not a value"),
    ("hedge-list", "Answer: 12, 13", "12", False, A, "two values where one is asked"),
    ("hedge-boxed", "\\boxed{12 \\text{ or } 13}", "13", False, B, "a hedge inside a box"),
    ("hedge-question", "Answer: 12?", "12", False, A, "a question mark is not a commitment"),
    ("hedge-x-or", "Answer: $x = 12$ or $x = 13$", "13", False, A, "the last `=` must not hide the hedge"),
    # --- truncated responses: no final answer ---
    ("truncated-arith", "Let me compute 3+4 = 7 and then", "7", False, N,
     "math-verify takes the last number of an unfinished derivation"),
    ("truncated-in-box", "so the answer is \\boxed{12", "12", False, N, "cut off inside the box"),
    ("empty", "", "7", False, N, "an empty response"),
    ("label-only", "Some work.\nAnswer:", "7", False, N, "cut off right after the label"),
    ("no-marker", "We have x = 5. Therefore", "5", False, N, "a value in the text is not a final answer"),
    # --- LaTeX, fractions against decimals, sets, intervals (math-verify) ---
    ("frac-vs-decimal", "Answer: $\\frac{1}{2}$", "0.5", True, A, "a fraction against a decimal truth"),
    ("decimal-vs-frac", "Answer: 0.5", "\\frac{1}{2}", True, A, "a decimal against a fraction truth"),
    ("rounded-third", "Answer: 0.333333", "\\frac{1}{3}", True, M, "a rounded decimal of a repeating fraction"),
    ("too-rounded-third", "Answer: 0.33", "\\frac13", False, M, "two digits are not 1/3"),
    ("set-order", "Answer: $\\{1, 2\\}$", "\\{2, 1\\}", True, M, "sets are unordered"),
    ("interval", "Answer: $(1, 2]$", "(1,2]", True, A, "the same half-open interval"),
    ("interval-wrong-ends", "Answer: $[1, 2)$", "(1,2]", False, M, "open and closed ends differ"),
    ("interval-infinity", "Answer: $(-\\infty, 3)$", "(-\\infty, 3)", True, A, "an interval to infinity"),
    ("radical", "Answer: $2\\sqrt{2}$", "\\sqrt{8}", True, M, "symbolic equality"),
    ("pi", "Answer: $\\frac{\\pi}{2}$", "\\frac{\\pi}{2}", True, A, "the same expression"),
    ("power", "Answer: $2^{10}$", "1024", True, M, "a number written as a power"),
    ("tuple", "Answer: $\\left( 3, \\frac{\\pi}{2} \\right)$", "\\left( 3, \\frac{\\pi}{2} \\right)", True, A,
     "MATH-500 polar coordinates"),
    ("list-order", "Answer: 3, 2", "2, 3", True, M, "a list of solutions in another order"),
    ("polynomial", "Answer: $x^2+2x+1$", "(x+1)^2", True, M, "an expanded polynomial"),
    ("text-choice", "\\boxed{\\text{(C)}}", "\\text{(C)}", True, B, "a multiple-choice letter in \\text{}"),
    # --- exactness ---
    ("big-int", "Answer: 123456789012345678901235", "123456789012345678901234", False, A,
     "23-digit DAPO-17k answers are compared exactly, not in floating point"),
    ("near-integer", "Answer: 2.9999999", "3", False, A, "no rounding tolerance for an integer truth"),
    ("integer-as-decimal", "Answer: 3.0", "3", True, A, "3.0 is 3"),
    ("negative-zero", "Answer: -0", "0", True, A, "-0 is 0"),
    ("factorial", "Answer: 5!", "5", False, M, "`5!` is 120: the `!` is not punctuation"),
    ("frac-numeric", "Answer: $\\frac{50}{2}$", "25", True, A, "an unsimplified fraction equal to the truth"),
    ("power-tower", "Answer: $9^{9^{9}}$", "1", False, M,
     "refused before sympy tries to build a 370-million-digit number (a fuzzing run grew to 15 GB on one)"),
    # --- equations and powers are not the number they end with ---
    ("equation-truth", "Answer: 0", "5x - 7y + 11z + 4 = 0", False, M, "MATH-500 plane equation: not the number 0"),
    ("equation-answer", "Answer: x^2 - 4 = 0", "0", False, A, "an equation stated as the answer to a number"),
    ("two-assignments", "Answer: x = 12, x = 13", "13", False, A, "two solutions where one is asked: a hedge"),
    ("assignment-chain", "Answer: x = 2+3 = 5", "5", True, A, "a variable, the working, then the value"),
    ("named-sum", "Answer: $m + n = 34$", "34", True, A, "DAPO-17k asks for m + n: the value is the last side"),
    ("named-sum-chain", "Answer: a+b+c = 3+4 = 7", "7", True, A, "a named sum, the working, then the value"),
    ("function-value", "Answer: $f(2) = 5$", "5", True, A, "the value of f at 2"),
    ("segment-length", "Answer: AB = 12", "12", True, A, "a length named by its end points"),
    ("coefficient-equation", "Answer: 2x = 34", "34", False, A, "an equation in x, not the value 34"),
    ("bracketed-equation", "Answer: (2x) = 34", "34", False, A, "brackets do not make an equation a name"),
    ("factored-equation", "Answer: $(x-3)(x+5) = 0$", "0", False, A, "roots asked, an equation stated"),
    ("probability", "Answer: $P(A) = 0.5$", "\\frac{1}{2}", True, A, "the probability of A, named"),
    ("power-not-unit", "Answer: 2^3", "8", True, M, "`^3` after a bare number is a power, not cubed units"),
    ("power-not-base", "Answer: 10^3", "10", False, M, "10^3 is 1000, not 10 of some cubed unit"),
    ("unit-squared", "Answer: 12 cm^2", "12", True, A, "`^2` after a unit word squares the unit"),
    ("negative-thin-space", r"\boxed{11111111100}", r"11,\! 111,\! 111,\! 100", True, B,
     r"MATH-500 writes thousands as `,\!` then a blank, which TeX ignores"),
    ("answer-is-colon", "We add them, so the answer is: 42", "42", True, A, "`the answer is:` states the answer"),
    # --- found in review (2026-11-29): each scored wrongly before ---
    ("matrix-rows-wrong", r"Answer: $\begin{pmatrix} 0 \\ 3 \end{pmatrix}$", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}",
     False, M, r"a row break `\\` is not a space: read as one entry `0 3`, math-verify added it up to 3"),
    ("matrix-one-entry", r"Answer: $\begin{pmatrix} 3 \end{pmatrix}$", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", False,
     M, "a one-entry vector is not a two-entry one"),
    ("matrix-rows-right", r"$\boxed{\begin{pmatrix} 1 \\ 2 \end{pmatrix}}$", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}",
     True, B, "the same column vector"),
    ("numbers-apart", "Answer: 3 5", "8", False, A, "two numbers side by side are not their sum"),
    ("numbers-apart-math", "Answer: $3$ $5$", "8", False, A, "nor in separate math spans"),
    ("numbers-apart-signed", "Answer: 3 -5", "-2", False, A, "nor with a sign on the second"),
    ("scale-word", "Answer: 5 million", "500", False, A, "`million` scales the number: it is no unit"),
    ("scale-word-counted", "Answer: 5 million", "5", True, A, "or the answer counts in millions, as asked"),
    ("dozen-count", "Answer: 7 dozen", "7", True, A, "GSM8K asks how many dozens: `dozen` is the unit"),
    ("times-count", "Answer: 22 times", "22", True, A, "GSM8K asks how many times: `times` is the unit"),
    ("scale-word-value", r"Answer: $2.5\text{ million}$", "2500000", True, A, "2.5 million is 2500000"),
    ("operator-word", "Answer: 5 squared", "5", False, M, "`squared` changes the value: no unit"),
    ("hedge-after-stop", "Answer: 12. Or 13.", "12", False, A, "a hedge in the sentence after the answer"),
    ("hedge-after-stop-number", "Answer: $12$.  Alternatively, $13$.", "12", False, A,
     "another number in the sentence after the answer"),
    ("remark-after-stop", "Answer: 12. Thus AB = 12.", "12", True, A,
     "a closing sentence that repeats the value is no hedge"),
    ("remark-with-numbers", "Thus the answer is 25. Indeed 5^2 = 25.", "25", True, A,
     "a check after the answer, with other numbers in it, is no hedge"),
    ("remark-with-and", "Answer: 12. This is the only solution and it is minimal.", "12", True, A,
     "nor a remark with `and` in it: only a sentence that starts as a hedge is one"),
    ("bare-number-after-stop", "Answer: 12. 13.", "12", False, A, "another number alone after the answer"),
    ("bare-number-after-stop-last", "Answer: 12. 13.", "13", False, A, "a hedge whichever of its numbers is true"),
    ("said-in-passing", "So the answer is 34. But wait, n = 20, not 19.\n\nTherefore", "34", False, N,
     "`the answer is` said in the derivation, not on its last line: no final answer (a truncated response)"),
    ("said-on-last-line", "n = 19, m = 15.\nThe answer is 34.", "34", True, A, "said last: the final answer"),
    ("said-after-answer-line", "Answer: 34\n\nSo the answer is 34, as required.", "34", True, A,
     "an `Answer:` line beats a restatement after it"),
    ("lead-in", "Therefore, Answer: 34", "34", True, A, "a lead-in before `Answer:`"),
    ("step-lead-in", "Step 5: Answer: 34", "34", True, A, "a step number before `Answer:`"),
    ("named-set-size", "Answer: |S| = 34", "34", True, A, "`|S|` names what was asked"),
    ("conclusion", "Answer: $m = 15, n = 19$, so $m + n = 34$", "34", True, A, "what comes after `so` is stated"),
    ("trailing-comma", "Answer: 34,", "34", True, A, "a trailing comma"),
    ("half-open-interval", "Answer: $x \\in [3, 5)$", "[3,5)", True, M, "an interval's `)` is the answer's own"),
    ("remark-starting-with-number", "Answer: 12. 12 is the largest such n.", "12", True, M,
     "a number that starts a remark is no hedge"),
    ("bold-expression", "Answer: \\textbf{2\\sqrt{113}}", "2\\sqrt{113}", True, A, "bold around braces"),
    ("end-mark", "Answer: 34 \\blacksquare", "34", True, A, "a proof's end mark"),
    ("percent-of-integer", "Answer: 500%", "5", False, A, "500% is not the integer 5 asked for"),
    ("sides-differ", "Answer: 4 = 5", "5", False, A, "`4 = 5` states two different values"),
    ("display-below-marker", "Answer:\n$$\n5\n$$", "5", True, A, "a display on the lines after `Answer:`"),
    ("latex-bold-marker", r"\textbf{Answer:} 5", "5", True, A, "the marker in LaTeX bold"),
    # --- found in the reward-hacking review (2026-11-29): a policy could learn these ---
    ("copied-expression", "Answer: 3+4*5", "23", False, A, "the problem's own expression is not its result"),
    ("copied-expression-neg", "Answer: 2-1*9", "-7", False, A, "nor with a negative result"),
    ("calculation-times", r"Answer: $12 \times 3$", "36", False, A, "a calculation where its result is asked"),
    ("power-of-ten", r"Answer: 2 \times 10^3", "2000", True, M, "a number written in powers of ten is a number"),
    ("long-line-before", " " * 30000 + "x answer:\nAnswer: 3", "3", True, A,
     "a line of thousands of spaces before a stray marker took seconds to search (the verifier's timeout: -1)"),
]

# Cases where math-verify alone (parse the truth, parse the response, verify) gets the verdict wrong.
MATH_VERIFY_ALONE_WRONG = {
    "space-1000-boxed", "unicode-minus", "two-boxes-last", "hedge-or-first",
    "truncated-arith", "no-marker", "comma-decimal",
}


def test_the_table_is_big_enough_and_covers_every_rule():
    assert len(CASES) >= 60
    assert len({case[0] for case in CASES}) == len(CASES), "case ids must be unique"
    assert {case[4] for case in CASES} == {A, B, M, N}


@pytest.mark.parametrize("case_id,response,truth,correct,rule,reason", CASES, ids=[c[0] for c in CASES])
def test_verdict(case_id, response, truth, correct, rule, reason):
    verdict = verify(response, truth)
    assert isinstance(verdict, Verdict)
    assert verdict.correct is correct, f"{case_id}: {reason}; got {verdict}"
    assert verdict.rule == rule, f"{case_id}: decided by {verdict.rule}, expected {rule}; {verdict}"
    assert verdict.detail, "every verdict says why"
    if rule == N:
        assert verdict.extracted is None


@pytest.mark.parametrize("case_id", sorted(MATH_VERIFY_ALONE_WRONG))
def test_math_verify_alone_is_wrong_here(case_id):
    from math_verify import parse
    from math_verify import verify as mv_verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    _, response, truth, correct, _, _ = next(c for c in CASES if c[0] == case_id)
    direct = mv_verify(parse(f"${truth}$", parsing_timeout=None), parse(response, parsing_timeout=None),
                       timeout_seconds=None)
    assert direct is not correct, f"math-verify now gets {case_id} right; move it out of the list"


def test_extraction_reports_what_was_read():
    verdict = verify("Lots of work...\n\n**Answer:** $\\boxed{\\dfrac{3}{4}}$.", "0.75")
    assert verdict.correct and verdict.extracted == "\\frac{3}{4}" and verdict.rule == B


def test_rules_are_the_score_contract():
    assert set(RULES) == {"answer_line", "boxed", "math_verify", "dapo_minerva", "none", "timeout", "error"}


@pytest.mark.parametrize(
    "text,value",
    [("025", 25), ("1,000", 1000), ("1 000", 1000), ("-3.50", -3.5), ("\\frac{3}{4}", 0.75), ("12 cm", 12),
     ("x = 12", 12), ("x^2 - 4 = 0", None), ("2^3", None), (".5", 0.5), ("3/4", 0.75), ("\\$5", 5), ("1,5", None),
     ("12 or 13", None), ("5x", None), ("2^{10}", None), ("", None), ("\\frac{1}{0}", None)],
)
def test_parse_number(text, value):
    parsed = parse_number(text)
    assert (parsed is None) if value is None else (parsed == value)


def test_clean_answer_strips_decoration_only():
    assert clean_answer("**$\\boxed{7}$.**") == "7"
    assert clean_answer("$\\text{(C)}$", unwrap=False) == "\\text{(C)}"
    assert clean_answer("\u2212 3") == "- 3"


def test_final_answer_is_searched_in_the_tail_only():
    # A 100k-character response with its answer at the end is still read, and quickly.
    response = ("blah " * 20_000) + "\nAnswer: 9"
    candidate = find_final_answer(response)
    assert candidate is not None and candidate.text == "9"
