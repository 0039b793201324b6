"""Problems with exact ground truth: the synthetic arithmetic task, the shared math sets, prompt templates.

`load_problems(spec, settings)` is the one entry point. A spec is
  synthetic-train / synthetic-eval   the built-in arithmetic task (disjoint splits, see `SyntheticTask`)
  aime2024 / aime2025 / math500 / gsm8k / dapo17k   the files in the shared data folder
  a path                             JSONL rows {problem, answer[, id]} or a verl parquet (DAPO-Math-17k layout)
The shared data folder is `$DAPO_DATA_DIR`, else `../shared/data` next to the repository.
"""

from __future__ import annotations

import ast
import hashlib
import itertools
import json
import logging
import operator
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Literal, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from services.config import Settings

log = logging.getLogger(__name__)

# The DAPO user prompt, verbatim from the DAPO-Math-17k training set (see shared/data/README.md).
DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
DAPO_TEMPLATE = DAPO_PREFIX + "{problem}" + DAPO_SUFFIX
# The short form of the same instruction, for models without a chat template (the tiny model's format).
RAW_TEMPLATE = "Solve. Last line: Answer: N\n{problem}\n"

NAMED_SETS = {
    "aime2024": "aime2024.jsonl",
    "aime2025": "aime2025.jsonl",
    "math500": "math500.jsonl",
    "gsm8k": "gsm8k_test.jsonl",
    "dapo17k": "dapo_math_17k.jsonl",
}
SYNTHETIC_SPECS = ("synthetic-train", "synthetic-eval")


class DataError(ValueError):
    """A data spec or file that cannot be loaded; the message names the spec or file and line."""


@dataclass(frozen=True)
class Problem:
    id: str
    problem: str
    answer: str


# ---------------------------------------------------------------------------------------------------------------
# Synthetic task: multi-step integer arithmetic with a worked solution in the DAPO answer format.


_BINARY_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def evaluate_expression(expression: str) -> int:
    """Exact value of an integer +,-,* expression with the usual precedence (an independent check of `solve`)."""

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.BinOp):
            ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
            if type(node.op) in ops:
                return ops[type(node.op)](walk(node.left), walk(node.right))
        raise DataError(f"not an integer +,-,* expression: {expression!r}")

    return walk(ast.parse(expression, mode="eval"))


@dataclass(frozen=True)
class SyntheticTask:
    """Integer arithmetic like `3+4*5=?`, solved one operation per step: `4*5=20,3+20=23` then `Answer: 23`.

    Difficulty grows with `operands` (steps = operands - 1) and `max_value` (operands are 0..max_value).
    Splits: a problem is held out iff the hash of its text falls under `eval_fraction`, independent of seed
    and sizes, so the train and eval splits can never share a problem.
    """

    operands: int = 3
    max_value: int = 9
    ops: str = "+-*"
    eval_fraction: float = 0.1

    def __post_init__(self) -> None:
        if self.operands < 2:
            raise DataError("synthetic task needs at least 2 operands")
        if self.max_value < 1:
            raise DataError("synthetic task needs max_value >= 1")
        if not self.ops or any(op not in _BINARY_OPS for op in self.ops) or len(set(self.ops)) != len(self.ops):
            raise DataError(f"synthetic ops must be distinct characters from '+-*', got {self.ops!r}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise DataError("synthetic eval_fraction must lie strictly between 0 and 1")

    @classmethod
    def from_settings(cls, settings: Settings | None) -> SyntheticTask:
        data = _settings(settings).data
        return cls(data.synthetic_operands, data.synthetic_max_value, data.synthetic_ops, data.synthetic_eval_fraction)

    @property
    def alphabet(self) -> str:
        """Every character a problem or a worked solution can contain."""
        return "0123456789" + self.ops + "-=?,\n" + "Answer: "

    @property
    def space_size(self) -> int:
        return (self.max_value + 1) ** self.operands * len(self.ops) ** (self.operands - 1)

    @staticmethod
    def problem_text(expression: str) -> str:
        return f"{expression}=?"

    @staticmethod
    def expression_of(problem_text: str) -> str:
        return problem_text.removesuffix("=?")

    def split_of(self, problem_text: str) -> Literal["train", "eval"]:
        digest = hashlib.sha256(problem_text.encode()).digest()
        return "eval" if int.from_bytes(digest[:8], "big") / 2**64 < self.eval_fraction else "train"

    @staticmethod
    def solve(expression: str, slip: Callable[[int], int] | None = None) -> tuple[list[str], int]:
        """Steps in evaluation order (all `*` left to right, then `+`/`-` left to right) and the value.

        `slip` (warm-up data only) may alter each intermediate result; later steps follow from the altered value.
        """
        tokens: list[Any] = []
        number = ""
        for ch in expression:
            if ch.isdigit():
                number += ch
            else:
                tokens += [int(number), ch]
                number = ""
        tokens.append(int(number))
        steps = []
        for level in ("*", "+-"):
            i = 1
            while i < len(tokens):
                if tokens[i] in level:
                    a, op, b = tokens[i - 1 : i + 2]
                    value = _BINARY_OPS[op](a, b)
                    if slip is not None:
                        value = slip(value)
                    steps.append(f"{a}{op}{b}={value}")
                    tokens[i - 1 : i + 2] = [value]
                else:
                    i += 2
        return steps, tokens[0]

    def solution(self, problem_text: str, slip_rate: float = 0.0, rng: random.Random | None = None) -> str:
        """The worked response the warm-up teaches: steps on one line, then the DAPO answer line.

        With `slip_rate`, each intermediate result is off by 1 or 2 with that probability and the rest of the
        solution follows from it, like the arithmetic slips of human-written data: a model trained on it knows
        the right step (its most likely one) yet slips when sampled, which reinforcement learning can fix.
        """
        def slip(value: int) -> int:
            return value + rng.choice((-2, -1, 1, 2)) if rng.random() < slip_rate else value

        steps, value = self.solve(self.expression_of(problem_text), slip if slip_rate > 0 else None)
        return ",".join(steps) + f"\nAnswer: {value}"

    def answer(self, problem_text: str) -> str:
        return str(self.solve(self.expression_of(problem_text))[1])

    @staticmethod
    def is_correct(response: str, answer: str) -> bool:
        """Exact check for this task: the last non-empty line is `Answer: N` with N the true integer."""
        lines = [line.strip() for line in response.strip().splitlines()]
        if not lines or not lines[-1].startswith("Answer:"):
            return False
        return lines[-1].removeprefix("Answer:").strip() == answer

    def _expression(self, values: Sequence[int], ops: Sequence[str]) -> str:
        return "".join(f"{v}{o}" for v, o in zip(values, ops)) + str(values[-1])

    def _candidates(self, rng: random.Random) -> Iterable[str]:
        """Problem texts in a seeded random order, each at most once."""
        values = range(self.max_value + 1)
        if self.space_size <= 200_000:
            every = [
                self.problem_text(self._expression(v, o))
                for v in itertools.product(values, repeat=self.operands)
                for o in itertools.product(self.ops, repeat=self.operands - 1)
            ]
            rng.shuffle(every)
            yield from every
            return
        seen: set[str] = set()
        misses = 0
        while misses < 10_000:  # a huge space: draw until draws stop producing new problems
            text = self.problem_text(
                self._expression(
                    [rng.randint(0, self.max_value) for _ in range(self.operands)],
                    [rng.choice(self.ops) for _ in range(self.operands - 1)],
                )
            )
            if text in seen:
                misses += 1
                continue
            seen.add(text)
            yield text

    def problems(self, split: Literal["train", "eval"], size: int | None, seed: int = 0) -> list[Problem]:
        """`size` distinct problems of one split in a seeded order (None = all; fewer, with a warning, if the
        split holds fewer)."""
        rng = random.Random(f"{seed}:{split}")
        chosen = []
        for text in self._candidates(rng):
            if self.split_of(text) != split:
                continue
            digest = hashlib.sha256(text.encode()).hexdigest()[:12]
            chosen.append(Problem(id=f"arith-{digest}", problem=text, answer=self.answer(text)))
            if size is not None and len(chosen) >= size:
                break
        if size is not None and len(chosen) < size:
            log.warning("synthetic %s split holds only %d problems (%d asked)", split, len(chosen), size)
        return chosen


# ---------------------------------------------------------------------------------------------------------------
# Files.


def data_dir() -> Path:
    """The shared data folder: `$DAPO_DATA_DIR`, else `../shared/data` beside the repository."""
    env = os.environ.get("DAPO_DATA_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data"


def strip_dapo_template(text: str) -> str:
    """The bare problem from a DAPO user prompt (text without the template comes back unchanged)."""
    if text.startswith(DAPO_PREFIX) and text.endswith(DAPO_SUFFIX):
        return text[len(DAPO_PREFIX) : len(text) - len(DAPO_SUFFIX)]
    return text


def checked_problem(where: str, ident: Any, fallback_id: str, text: Any, answer: Any) -> Problem:
    """One row as a Problem, refused with its place in the file unless the problem is non-empty text and the answer a
    non-empty value (a number is kept as its text), each valid Unicode; a missing, null or empty id becomes
    `fallback_id`. A problem still in the DAPO template (a row copied from the verl layout) is stripped of it: the
    prompt puts it back once (`render_prompt`)."""
    if not isinstance(text, str) or not text.strip():
        raise DataError(f"{where}: the problem must be non-empty text, not {type(text).__name__} {str(text)[:40]!r}")
    if answer is None or isinstance(answer, (dict, list)) or not str(answer).strip():
        raise DataError(f"{where}: the answer must be a non-empty value, not {str(answer)[:40]!r}")
    for name, value in (("problem", text), ("answer", str(answer)), ("id", str(ident))):
        try:
            value.encode("utf-8")  # JSON's "\ud835" loads as half a character: no tokenizer or message takes it
        except UnicodeEncodeError as err:
            raise DataError(f"{where}: the {name} is not valid Unicode (an unpaired surrogate at character "
                            f"{err.start}: a UTF-16 pair cut in half)") from None
    return Problem(id=fallback_id if ident in (None, "") else str(ident), problem=strip_dapo_template(text),
                   answer=str(answer))


def read_jsonl(path: str | os.PathLike) -> list[Problem]:
    """Rows {problem, answer[, id]}: one JSON object a line (JSON Lines, whatever the suffix: `Dataset.to_json`
    writes them as `.json`), or a JSON array of them; a missing, null or empty id becomes `<file stem>-<row index>`."""
    path = Path(path)
    with path.open(encoding="utf-8") as f:
        first = f.read(4096).lstrip()[:1]
    if first == "[":
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{err.lineno}: not JSON ({err.msg})") from None
        numbered = [(f"{path} row {index}", index, row) for index, row in enumerate(rows)]
    else:
        numbered = []
        with path.open(encoding="utf-8") as f:
            for index, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    numbered.append((f"{path}:{index + 1}", index, json.loads(line)))
                except json.JSONDecodeError as err:
                    raise DataError(f"{path}:{index + 1}: not JSON ({err.msg})") from None
    problems = []
    for where, index, row in numbered:
        if not isinstance(row, dict):
            raise DataError(f"{where}: a row is an object with problem and answer, not {type(row).__name__}")
        missing = [k for k in ("problem", "answer") if k not in row]
        if missing:
            raise DataError(f"{where}: missing field(s) {', '.join(missing)}")
        problems.append(checked_problem(where, row.get("id"), f"{path.stem}-{index}", row["problem"], row["answer"]))
    return problems


def shared_problems(train: Iterable[Problem], held_out: Iterable[Problem]) -> int:
    """How many held-out problems are also in the training set (whitespace aside)."""
    seen = {normalise_problem(p.problem) for p in train}
    return sum(normalise_problem(p.problem) in seen for p in held_out)


def check_alphabet(problems: Iterable[Problem], alphabet: set[str]) -> None:
    """DataError naming the first problem with characters outside `alphabet`: a character-level tokenizer without
    an unknown token (the tiny model's) would silently drop them from the prompt."""
    for problem in problems:
        if missing := set(problem.problem) - alphabet:
            raise DataError(f"problem {problem.id}: characters {''.join(sorted(missing))!r} are not in the tiny "
                            "model's alphabet (it is built for the synthetic task; real data needs a real model)")


def read_parquet(path: str | os.PathLike) -> list[Problem]:
    """The verl layout of DAPO-Math-17k: `prompt` (chat messages), `reward_model.ground_truth`, `extra_info.index`.

    The user message's DAPO template is stripped, so the problem is bare like every other source. Flat
    {problem, answer} parquet files load too.
    """
    path = Path(path)
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"reading {path} needs pyarrow, which is not installed: pip install pyarrow "
            "(or pip install 'dapo-services[parquet]')"
        ) from None
    rows = pq.read_table(path).to_pylist()
    problems = []
    for index, row in enumerate(rows):
        where = f"{path} row {index}"
        if "problem" in row and "answer" in row:
            text, answer = row["problem"], row["answer"]
        elif "prompt" in row and "reward_model" in row:
            prompt = row["prompt"]
            if isinstance(prompt, str):  # a plain-text prompt rather than chat messages
                text = strip_dapo_template(prompt)
            else:
                users = [m for m in prompt or [] if isinstance(m, dict) and m.get("role") == "user"]
                if not users:
                    raise DataError(f"{where}: `prompt` holds no user message")
                text = strip_dapo_template(users[-1].get("content") or "")
            answer = (row["reward_model"] or {}).get("ground_truth")
            if answer is None:
                raise DataError(f"{where}: no reward_model.ground_truth")
        else:
            raise DataError(f"{where}: neither verl columns (prompt, reward_model) nor (problem, answer)")
        extra = row.get("extra_info") or {}
        row_index = index if extra.get("index") in (None, "") else extra["index"]
        problems.append(checked_problem(where, row.get("id"), f"{path.stem}-{row_index}", text, answer))
    return problems


# ---------------------------------------------------------------------------------------------------------------
# De-duplication.


def normalise_problem(text: str) -> str:
    return " ".join(text.split())


@dataclass
class DedupeReport:
    total: int
    unique: int
    duplicates: dict[str, str] = field(default_factory=dict)  # duplicate id -> id of the first occurrence
    conflicts: dict[str, list[str]] = field(default_factory=dict)  # first id -> every distinct answer seen

    def summary(self) -> str:
        return (
            f"{self.total} rows, {self.unique} problems kept, {len(self.duplicates)} duplicates, "
            f"{len(self.conflicts)} with conflicting answers (left out: which is the truth?)"
        )


def dedupe(problems: Iterable[Problem]) -> tuple[list[Problem], DedupeReport]:
    """Keep the first row of each whitespace-normalised problem text; report duplicates and answer conflicts. A
    problem whose rows disagree on the answer is left out (DAPO-Math-17k has 12, 4 of them with the placeholder
    answer -1 first): the first row is no more likely to be right, and a wrong truth trains the opposite way."""
    first: dict[str, Problem] = {}
    answers: dict[str, list[str]] = {}
    report = DedupeReport(total=0, unique=0)
    for p in problems:
        report.total += 1
        key = normalise_problem(p.problem)
        if key not in first:
            first[key] = p
            answers[key] = [p.answer]
            continue
        kept = first[key]
        report.duplicates[p.id] = kept.id
        if p.answer.strip() not in (a.strip() for a in answers[key]):
            answers[key].append(p.answer)
            report.conflicts[kept.id] = answers[key]
    conflicting = {key for key, seen in answers.items() if len(seen) > 1}
    unique = [problem for key, problem in first.items() if key not in conflicting]
    report.unique = len(unique)
    return unique, report


# ---------------------------------------------------------------------------------------------------------------
# Entry points.


def _settings(settings: Settings | None) -> Settings:
    if settings is not None:
        return settings
    from services.config import Settings

    return Settings()


def load_problems(spec: str, settings: Settings | None = None) -> list[Problem]:
    """Problems for a spec (see the module docstring); de-duplicated when `data.dedupe` is on."""
    s = _settings(settings)
    if spec in SYNTHETIC_SPECS:
        task = SyntheticTask.from_settings(s)
        split: Literal["train", "eval"] = "train" if spec == "synthetic-train" else "eval"
        size = s.data.synthetic_train_size if split == "train" else s.data.synthetic_eval_size
        return task.problems(split, size, seed=s.data.seed)
    if spec == "synthetic":
        raise DataError("say which synthetic split: `synthetic-train` or `synthetic-eval`")
    if spec in NAMED_SETS:
        path = data_dir() / NAMED_SETS[spec]
        if not path.is_file():
            raise DataError(f"data set {spec!r} not found at {path} (set DAPO_DATA_DIR to the shared data folder)")
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            known = ", ".join([*SYNTHETIC_SPECS, *NAMED_SETS])
            raise DataError(f"data spec {spec!r} is neither a known set ({known}) nor an existing file")
    if path.suffix == ".parquet":
        problems = read_parquet(path)
    elif path.suffix in (".jsonl", ".json"):
        problems = read_jsonl(path)
    else:
        raise DataError(f"{path}: unknown format (expected .jsonl or .parquet)")
    if not problems:
        raise DataError(f"{path}: no problems in it")
    if not s.data.dedupe:
        return problems
    unique, report = dedupe(problems)
    if report.duplicates:
        (log.warning if report.conflicts else log.info)("%s: %s", spec, report.summary())
    return unique


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(
    problem: Problem | str,
    tokenizer: Any,
    template: Literal["auto", "dapo", "raw"] = "auto",
    raw_template: str = RAW_TEMPLATE,
) -> str:
    """The prompt text the policy sees.

    dapo: the DAPO instruction around the problem, inside the tokenizer's chat template when it has one.
    raw:  `raw_template` (the short DAPO-like form, no chat template: the tiny model's format).
    auto: dapo if the tokenizer has a chat template, raw otherwise.
    """
    text = problem.problem if isinstance(problem, Problem) else problem
    if template == "auto":
        template = "dapo" if has_chat_template(tokenizer) else "raw"
    if template == "raw":
        return raw_template.format(problem=text)
    if template != "dapo":
        raise DataError(f"unknown prompt template {template!r} (auto, dapo, raw)")
    message = DAPO_TEMPLATE.format(problem=text)
    if not has_chat_template(tokenizer):
        return message
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
    )
