"""Property tests: adversarial model text never raises out of the verifier, and every call returns in time.

Example counts are kept modest (suite time matters); the strategies aim at the known weak spots instead:
huge inputs, deeply nested LaTeX, binary garbage with lone surrogates and control characters, token soup of
the very syntax the extractor looks for.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reward import verify
from reward.sandbox import VerifierPool
from reward.verify import RULES, clean_answer, find_final_answer, parse_number

TIMEOUT_S = 1.0
SLACK_S = 1.0  # process replacement and scheduling on a shared 2-core machine

TOKENS = [
    "\\boxed{", "\\boxed", "{", "}", "\\frac", "\\dfrac{", "\\sqrt{", "\\text{", "\\left(", "\\right)", "Answer:",
    "**Answer:**", "answer is", "\n", " ", "$", "$$", "\\(", "\\)", "\\[", "\\]", "1", "0", "9", "-", "\u2212", ",",
    ".", "/", "^", "_", "or", "and", "%", "\\%", "^\\circ", "\\pm", "x", "=", "(", ")", "[", "]", "\\{", "\\}",
    "\\infty", "\\pi", "!", "?", "\u00a0", "\u200b", "\x00", "\ud800", "cm", "{,}", "\\,",
]

token_soup = st.lists(st.sampled_from(TOKENS), max_size=80).map("".join)
binary_garbage = st.binary(max_size=3000).map(lambda b: b.decode("utf-8", "surrogateescape"))
nested_latex = st.tuples(
    st.sampled_from(["\\frac{1}{", "\\sqrt{", "{", "(", "\\left(", "\\boxed{", "2^{", "\\text{"]),
    st.integers(1, 4000),
    st.booleans(),
).map(lambda t: "Answer: $" + t[0] * t[1] + "1" + ("}" * t[1] if t[2] else "") + "$")
huge = st.tuples(st.sampled_from(["9", "a", "\\boxed{1}", "Answer: 1\n", "{", " "]), st.integers(10_000, 400_000)).map(
    lambda t: t[0] * (t[1] // len(t[0]))
)
adversarial = st.one_of(token_soup, binary_garbage, nested_latex, huge, st.text(max_size=500))
truths = st.one_of(st.sampled_from(["7", "-3", "1000", "\\frac{1}{2}", "(1,2]", "\\{1, 2\\}", "2, 3", "x^2+1"]),
                   token_soup, st.text(max_size=50))


@settings(max_examples=80, deadline=None)
@given(response=adversarial)
def test_extraction_never_raises_and_stays_fast(response):
    started = time.perf_counter()
    candidate = find_final_answer(response)
    if candidate is not None:
        cleaned = clean_answer(candidate.text)
        parse_number(cleaned)
        assert isinstance(cleaned, str)
    assert time.perf_counter() - started < 1.0


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(workers=2, timeout_s=TIMEOUT_S, memory_mb=1024) as p:
        yield p


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(response=adversarial, truth=truths)
def test_sandboxed_verification_always_returns_a_verdict_within_the_limit(pool, response, truth):
    started = time.monotonic()
    verdict = pool.verify(response, truth)
    elapsed = time.monotonic() - started
    assert verdict.rule in RULES
    assert isinstance(verdict.correct, bool)
    assert elapsed < TIMEOUT_S + SLACK_S, f"took {elapsed:.2f}s: {verdict}"
    if verdict.rule in ("timeout", "error", "none"):
        assert not verdict.correct
    verdict.detail.encode("utf-8")  # JSON-safe: no lone surrogates leak into a Score
    if verdict.extracted is not None:
        verdict.extracted.encode("utf-8")


# A metamorphic property of the numeric path: decorating a correct integer answer keeps it correct, and the
# same decoration around a different integer keeps it wrong.
DECORATIONS = [
    "Answer: {}", "**Answer:** {}", "Answer: {}.", "Answer: ${}$", "\\boxed{{{}}}", "Final answer: **{}**",
    "Answer: {} cm", "The answer is $\\boxed{{{}}}$.", "ANSWER：{}", "Answer:\n\n{}",
    "\\boxed{{1}} no wait \\boxed{{{}}}",
]


def _render(value: int, style: int) -> str:
    text = str(abs(value))
    if style == 1:
        text = "00" + text  # leading zeros
    elif style == 2 and abs(value) >= 1000:
        text = f"{abs(value):,}"  # thousands separators
    elif style == 3 and abs(value) >= 1000:
        text = f"{abs(value):,}".replace(",", "\\,")
    sign = "" if value >= 0 else ("\u2212" if style == 4 else "-")
    return sign + text


@settings(max_examples=150, deadline=None)
@given(
    value=st.integers(-10**25, 10**25),
    offset=st.integers(1, 10**6),
    decoration=st.sampled_from(DECORATIONS),
    style=st.integers(0, 4),
)
def test_decorated_integers_keep_their_verdict(value, offset, decoration, style):
    truth = str(value)
    right = verify(decoration.format(_render(value, style)), truth)
    assert right.correct, right
    wrong = verify(decoration.format(_render(value + offset, style)), truth)
    assert not wrong.correct, wrong
