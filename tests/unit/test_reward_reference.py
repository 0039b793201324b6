"""`reward.answer_rule: dapo`: the DAPO paper's reference rule (verl `math_dapo.compute_score`), and its wiring.

Every case is checked through the name the config uses (`ANSWER_RULES["dapo"]`, what a verifier child runs) and
asserts the full verdict: correctness, the normalised answer the reference reports, and the rule `dapo_minerva`
(or `none`). The robust default reads most of these differently (its verdict is asserted too where it differs), so
a case fails if the robust rule ran instead or the names were wired to the wrong function.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import get_args

import pytest

from reward.reference import TAIL_CHARS, normalize_final_answer, verify_dapo
from reward.sandbox import ANSWER_RULES, VerifierPool, _verify_in_child
from reward.scoring import Scorer
from reward.verify import RULE_DAPO, RULE_NONE, RULES, verify
from services.config import CONFIG_DIR, RewardConfig, load_settings

D, N = RULE_DAPO, RULE_NONE
FILLER = "Let me double-check this once more. " * 10  # 350 characters, no newline

CASES = [
    # id, response, ground truth, correct, extracted (normalised), rule, robust verdict (None: the same), reason
    ("boxed-only", "So the total is $\\boxed{34}$.", "34", False, None, N, True,
     "the reference reads `Answer:` only; a box alone is no answer"),
    ("beyond-300", "Answer: 34\n" + FILLER, "34", False, None, N, True,
     "only the last 300 characters are read"),
    ("not-line-anchored", "We are done.\nThus the answer: 34", "34", True, "34", D, None,
     "the pattern is not line-anchored: `the answer: 34` inside a sentence counts (the robust rule: after `Thus`)"),
    ("mid-sentence", "We check our answer: 34", "34", True, "34", D, False,
     "the robust rule reads no `answer:` in the middle of a sentence"),
    ("zero-pad", "Answer: 025", "25", False, "025", D, True, "strings are compared: 025 is not 25"),
    ("decimal-vs-frac", "Answer: 0.5", "\\frac{1}{2}", False, "0.5", D, True, "no numeric equality"),
    ("frac-shorthand", "Answer: $\\frac{1}{2}$", "\\frac12", True, "\\frac{1}{2}", D, None,
     "`\\frac12` is expanded to `\\frac{1}{2}`, `$` dropped"),
    ("sqrt-shorthand", "Answer: $2\\sqrt2$", "2\\sqrt{2}", True, "2\\sqrt{2}", D, None, "`\\sqrt2` -> `\\sqrt{2}`"),
    ("thousands", "Answer: 1,000", "1000", True, "1000", D, None, "commas go from a pure number"),
    ("list-commas-kept", "Answer: 1,5", "15", True, "15", D, False,
     "Minerva strips every comma of a digit string: `1,5` is 15 (the robust rule refuses it)"),
    ("units-word", "Answer: 12 dollars", "12", True, "12", D, None, "a listed unit word is removed"),
    ("units-degrees", "Answer: $30^\\circ$", "30", True, "30", D, None, "`^\\circ` is removed"),
    ("units-unlisted", "Answer: 12 apples", "12", False, "12apples", D, True,
     "a word not in Minerva's list stays (spaces are removed first)"),
    ("text-wrapper", "Answer: \\text{(B)}", "(B)", True, "(B)", D, None, "`\\text{}` is unwrapped"),
    ("boxed-in-line", "Answer: $\\boxed{34}$", "34", True, "34", D, None, "a box on the answer line is unwrapped"),
    ("last-line-wins", "Answer: 3\nWait, that is wrong.\nAnswer: 4", "4", True, "4", D, None,
     "the last match is the answer"),
    ("last-line-wins-2", "Answer: 3\nWait, that is wrong.\nAnswer: 4", "3", False, "4", D, None,
     "an earlier answer does not count"),
    ("same-line", "Answer: 3. Final Answer: 4", "4", False, "3.FinalAnswer:4", D, True,
     "matches do not overlap: the first one takes the rest of its line"),
    ("truth-with-equals", "Answer: 5", "x = 5", True, "5", D, None, "the ground truth's last side is compared"),
    ("answer-with-equals", "Answer: $y = 2x+3$", "2x + 3", True, "2x+3", D, None,
     "the answer's last side is compared, spaces removed from both"),
    ("next-line", "Answer:\n\n42", "42", True, "42", D, None, "`\\s*` after the colon crosses newlines"),
    ("minerva-sentence", "Final Answer: The final answer is $7$. I hope it is correct.", "7", True, "7", D, None,
     "only the first `$...$` of the line is kept"),
    ("case-insensitive", "ANSWER: 7", "7", True, "7", D, None, "the pattern is case-insensitive"),
]


@pytest.mark.parametrize("case_id,response,truth,correct,extracted,rule,robust,reason", CASES,
                         ids=[c[0] for c in CASES])
def test_dapo_rule_is_the_reference(case_id, response, truth, correct, extracted, rule, robust, reason):
    verdict = ANSWER_RULES["dapo"](response, truth)
    assert (verdict.correct, verdict.extracted, verdict.rule) == (correct, extracted, rule), reason
    robust_verdict = ANSWER_RULES["robust"](response, truth)
    assert robust_verdict.rule != RULE_DAPO
    assert robust_verdict.correct == (correct if robust is None else robust), f"robust rule on {case_id}"


def test_the_tail_is_exactly_300_characters():
    head = "Answer: 34\n"
    assert verify_dapo(head + "x" * (TAIL_CHARS - len(head)), "34").correct  # starts at the first char read
    assert verify_dapo("x" + head + "x" * (TAIL_CHARS - len(head)), "34").correct
    assert not verify_dapo(head + "x" * (TAIL_CHARS - len(head) + 1), "34").correct  # its `A` is cut off
    assert TAIL_CHARS == 300


@pytest.mark.parametrize(
    "raw,normalised",
    [
        ("x = \\frac12", "\\frac{1}{2}"),
        ("\\dfrac34", "\\dfrac{3}{4}"),
        ("10\\text{ cm}^2", "10"),  # spaces, then `cm`, then `\text{}^2` go
        ("\\$5.00", "5.00"),
        ("5 \\text{ and } 6", "56"),  # `\text{and}` -> `,`, then the commas of a digit string go: a quirk, kept
        ("\\overline{AB}", "AB"),
        ("\\textbf{yes}", "yes"),
        ("1{,}000", "1000"),
        ("12,345,678", "12345678"),
        ("an apple", "apple"),  # Minerva removes "an " and "a " anywhere: a known quirk, kept
        ("a banana split", "banansplit"),
        ("\\boxed{\\{1, 2\\}}", "\\{1,2\\}"),
        ("  7 \\; ", "7"),
    ],
)
def test_minerva_normalisation(raw, normalised):
    assert normalize_final_answer(raw) == normalised


def test_the_child_function_dispatches_on_the_rule_name():
    assert _verify_in_child("\\boxed{34}", "34").rule == "boxed"  # the default stays robust
    assert _verify_in_child("\\boxed{34}", "34", "robust").correct
    dapo = _verify_in_child("\\boxed{34}", "34", "dapo")
    assert not dapo.correct and dapo.rule == RULE_NONE
    assert _verify_in_child("Answer: 025", "25", "dapo").rule == RULE_DAPO
    assert _verify_in_child("Answer: 1", "1", "nonsense").rule == "error"  # never raises in a child
    assert ANSWER_RULES["robust"] is verify and ANSWER_RULES["dapo"] is verify_dapo


def test_rule_names_agree_with_the_config():
    (literal,) = [f.annotation for name, f in RewardConfig.model_fields.items() if name == "answer_rule"]
    assert set(get_args(literal)) == set(ANSWER_RULES) == {"robust", "dapo"}
    assert RewardConfig().answer_rule == "robust"
    assert RULE_DAPO in RULES
    with pytest.raises(ValueError):
        RewardConfig(answer_rule="minerva")
    with pytest.raises(ValueError, match="unknown answer rule"):
        VerifierPool(rule="minerva")


def test_presets():
    assert load_settings("dapo-qwen2.5-32b").reward.answer_rule == "dapo"  # the paper's recipe
    assert load_settings("ablations/6-dynamic-sampling").reward.answer_rule == "dapo"  # Table 1 rows inherit it
    assert load_settings("dapo-qwen2.5-math-1.5b").reward.answer_rule == "robust"
    assert load_settings("tiny-cpu").reward.answer_rule == "robust"
    assert (CONFIG_DIR / "dapo-qwen2.5-32b.yaml").read_text().count("answer_rule: dapo") == 1


def test_a_scorer_refuses_a_pool_with_another_rule():
    cfg = RewardConfig(answer_rule="dapo")
    with pytest.raises(ValueError, match="answer rule"):
        Scorer(SimpleNamespace(rule="robust"), cfg)
    assert Scorer(SimpleNamespace(rule="dapo"), cfg).cfg.answer_rule == "dapo"
