"""Data: the synthetic task's splits and ground truth, the shared files, parquet, de-duplication, prompts."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from services.config import Settings
from services.data import (
    DAPO_TEMPLATE,
    NAMED_SETS,
    RAW_TEMPLATE,
    DataError,
    Problem,
    SyntheticTask,
    data_dir,
    dedupe,
    evaluate_expression,
    load_problems,
    render_prompt,
    strip_dapo_template,
)

DATA = data_dir()
needs_shared_data = pytest.mark.skipif(not (DATA / "aime2024.jsonl").is_file(), reason=f"no shared data in {DATA}")


def make_settings(**data) -> Settings:
    s = Settings()
    for key, value in data.items():
        setattr(s.data, key, value)
    return s


# --------------------------------------------------------------------------- synthetic task


@pytest.mark.parametrize(
    "task",
    [SyntheticTask(), SyntheticTask(operands=2, max_value=5, ops="+*"), SyntheticTask(operands=5, max_value=30)],
    ids=["default", "small-space", "sampled-space"],
)
def test_synthetic_splits_never_share_a_problem(task):
    train = task.problems("train", 3000, seed=1)
    held_out = task.problems("eval", 300, seed=2)
    assert train and held_out
    assert not {p.problem for p in train} & {p.problem for p in held_out}
    # Each split is decided by the text alone, so no seed or size can move a problem across.
    assert all(task.split_of(p.problem) == "train" for p in train)
    assert all(task.split_of(p.problem) == "eval" for p in held_out)
    assert not {p.problem for p in task.problems("train", 3000, seed=99)} & {p.problem for p in held_out}
    assert len({p.problem for p in train}) == len(train)
    assert len({p.id for p in train + held_out}) == len(train) + len(held_out)


def test_whole_small_space_splits_by_fraction():
    task = SyntheticTask()  # 10^3 operand choices x 3^2 operator choices
    train, held_out = task.problems("train", None), task.problems("eval", None)
    assert len(train) + len(held_out) == task.space_size == 9000
    assert 0.08 < len(held_out) / task.space_size < 0.12


def test_load_problems_synthetic_specs_use_config():
    s = make_settings(synthetic_train_size=700, synthetic_eval_size=90, synthetic_operands=4)
    train, held_out = load_problems("synthetic-train", s), load_problems("synthetic-eval", s)
    assert (len(train), len(held_out)) == (700, 90)
    assert all(p.problem.count("=") == 1 and len(re.findall(r"\d+", p.problem)) == 4 for p in train)
    assert load_problems("synthetic-train", s) == train  # deterministic
    assert load_problems("synthetic-train",
                         make_settings(synthetic_train_size=700, synthetic_operands=4, seed=5)) != train
    with pytest.raises(DataError, match="synthetic-train"):
        load_problems("synthetic", s)


STEP = re.compile(r"^(-?\d+)([+\-*])(\d+)=(-?\d+)$")


def check_worked_solution(task: SyntheticTask, problem: Problem) -> None:
    expression = task.expression_of(problem.problem)
    assert problem.answer == str(evaluate_expression(expression))
    *steps_line, last = task.solution(problem.problem).split("\n")
    assert last == f"Answer: {problem.answer}"
    steps = steps_line[0].split(",")
    assert len(steps) == expression.count("+") + expression.count("-") + expression.count("*")
    for step in steps:
        a, op, b, value = STEP.match(step).groups()
        assert evaluate_expression(f"{a}{op}{b}") == int(value)
    assert int(STEP.match(steps[-1]).group(4)) == int(problem.answer)
    assert task.is_correct(task.solution(problem.problem), problem.answer)


def test_every_synthetic_ground_truth_is_right():
    task = SyntheticTask()
    for problem in task.problems("train", None) + task.problems("eval", None):
        check_worked_solution(task, problem)


@given(
    values=st.lists(st.integers(0, 99), min_size=2, max_size=7),
    ops=st.lists(st.sampled_from("+-*"), min_size=6, max_size=6),
)
@hsettings(max_examples=300, deadline=None)
def test_solution_steps_match_python_arithmetic(values, ops):
    task = SyntheticTask(operands=len(values), max_value=99)
    expression = "".join(f"{v}{o}" for v, o in zip(values, ops)) + str(values[-1])
    text = task.problem_text(expression)
    check_worked_solution(task, Problem("x", text, task.answer(text)))


def test_is_correct_reads_only_the_last_answer_line():
    ok = SyntheticTask.is_correct
    assert ok("4*5=20,3+20=23\nAnswer: 23", "23")
    assert ok("Answer: -17\n", "-17")
    assert not ok("Answer: 23\n4*5=20", "23")
    assert not ok("4*5=20,3+20=23\nAnswer: 230", "23")
    assert not ok("", "0")


def test_synthetic_task_rejects_bad_settings():
    with pytest.raises(DataError):
        SyntheticTask(operands=1)
    with pytest.raises(DataError):
        SyntheticTask(ops="/")
    with pytest.raises(DataError):
        SyntheticTask(eval_fraction=0.0)


# --------------------------------------------------------------------------- shared files


@needs_shared_data
@pytest.mark.parametrize("spec,rows", [("aime2024", 30), ("aime2025", 30), ("math500", 500), ("gsm8k", 1319)])
def test_named_sets_load(spec, rows):
    problems = load_problems(spec, make_settings(dedupe=False))
    assert len(problems) == rows
    assert len({p.id for p in problems}) == rows
    assert all(p.problem.strip() and p.answer.strip() for p in problems)


@needs_shared_data
def test_aime_answers_match_the_official_keys():
    aime24 = {p.id: p.answer for p in load_problems("aime2024")}
    assert [aime24[f"aime2024-I-{i}"] for i in (1, 2, 15)] == ["204", "25", "721"]
    assert [aime24[f"aime2024-II-{i}"] for i in (1, 4, 15)] == ["73", "33", "315"]
    aime25 = {p.id: p.answer for p in load_problems("aime2025")}
    assert [aime25["aime2025-I-1"], aime25["aime2025-II-15"]] == ["70", "240"]


@needs_shared_data
def test_math500_keeps_latex_answers():
    answers = {p.id: p.answer for p in load_problems("math500")}
    assert answers["test/precalculus/807.json"] == r"\left( 3, \frac{\pi}{2} \right)"
    assert sum(a.lstrip("-").isdigit() for a in answers.values()) == 311


@needs_shared_data
def test_dapo17k_rows_distinct_problems_and_conflicts():
    rows = load_problems("dapo17k", make_settings(dedupe=False))
    assert len(rows) == 17917
    unique, report = dedupe(rows)
    assert (report.total, report.unique, len(unique)) == (17917, 17176, 17176)  # 17,188 distinct, 12 disagree
    assert len(report.duplicates) == 729
    assert len(report.conflicts) == 12
    assert all(len(set(answers)) >= 2 for answers in report.conflicts.values())
    # The file marks each repeat with the id of its first occurrence: the report must agree row for row.
    marked = {}
    with (DATA / NAMED_SETS["dapo17k"]).open() as f:
        for line in f:
            row = json.loads(line)
            if "duplicate_of" in row:
                marked[row["id"]] = row["duplicate_of"]
    assert report.duplicates == marked
    assert len(load_problems("dapo17k")) == 17176  # data.dedupe is on by default
    assert "17917 rows, 17176 problems kept, 729 duplicates, 12 with conflicting answers" in report.summary()


@needs_shared_data
def test_dapo_template_is_the_training_sets_exact_prompt():
    tokenizer_without_chat_template = object()
    with (DATA / NAMED_SETS["dapo17k"]).open() as f:
        rows = [json.loads(next(f)) for _ in range(50)]
    for row in rows:
        assert render_prompt(row["problem"], tokenizer_without_chat_template, "dapo") == row["prompt"]
        assert strip_dapo_template(row["prompt"]) == row["problem"]


def test_data_dir_follows_the_environment(tmp_path, monkeypatch):
    (tmp_path / "aime2024.jsonl").write_text(json.dumps({"id": "a", "problem": "1+1?", "answer": 2}) + "\n")
    monkeypatch.setenv("DAPO_DATA_DIR", str(tmp_path))
    assert load_problems("aime2024") == [Problem("a", "1+1?", "2")]


def test_jsonl_path_with_missing_ids_and_bad_rows(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"problem": "What is 2+2?", "answer": "4"}\n\n{"problem": "3*3?", "answer": 9}\n')
    assert load_problems(str(path)) == [Problem("mine-0", "What is 2+2?", "4"), Problem("mine-2", "3*3?", "9")]
    path.write_text('{"problem": "x"}\n')
    with pytest.raises(DataError, match=r"mine\.jsonl:1: missing field\(s\) answer"):
        load_problems(str(path))
    path.write_text("{not json\n")
    with pytest.raises(DataError, match=r"mine\.jsonl:1: not JSON"):
        load_problems(str(path))
    with pytest.raises(DataError, match="neither a known set"):
        load_problems(str(tmp_path / "absent.jsonl"))


@pytest.mark.parametrize("line,reason", [
    ("5", "a row is an object with problem and answer, not int"),
    ('"problem answer"', "a row is an object with problem and answer, not str"),
    ('{"problem": null, "answer": "1"}', "the problem must be non-empty text, not NoneType"),
    ('{"problem": ["1+1?"], "answer": "2"}', "the problem must be non-empty text, not list"),
    ('{"problem": "  ", "answer": "2"}', "the problem must be non-empty text"),
    ('{"problem": "1+1?", "answer": null}', "the answer must be a non-empty value, not 'None'"),
    ('{"problem": "1+1?", "answer": ""}', "the answer must be a non-empty value"),
    # half a UTF-16 pair: loaded, then no message could carry the task (the learner crashed on every restart)
    ('{"problem": "1+1?", "answer": "2\\ud835"}', "the answer is not valid Unicode (an unpaired surrogate at "
     "character 1"),
    ('{"problem": "x\\udc00 + 1?", "answer": "2"}', "the problem is not valid Unicode"),
    ('{"id": "\\ud835", "problem": "1+1?", "answer": "2"}', "the id is not valid Unicode"),
])
def test_a_bad_row_is_refused_with_its_file_and_line(tmp_path, line, reason):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"problem": "2+2?", "answer": "4"}\n' + line + "\n")
    with pytest.raises(DataError, match=re.escape(f"mine.jsonl:2: {reason}")):
        load_problems(str(path))


def test_a_json_array_file_and_null_or_zero_ids(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps([{"id": 0, "problem": "1+1?", "answer": 2},
                                {"id": None, "problem": "2+2?", "answer": 4}],
                               indent=2))
    assert load_problems(str(path)) == [Problem("0", "1+1?", "2"), Problem("mine-1", "2+2?", "4")]
    path.write_text('{"id": "", "problem": "1+1?", "answer": 2}\n{"problem": "3+3?", "answer": 6}\n')  # to_json's
    assert load_problems(str(path)) == [Problem("mine-0", "1+1?", "2"), Problem("mine-1", "3+3?", "6")]


def test_dedupe_normalises_whitespace_keeps_the_first_and_leaves_out_problems_whose_rows_disagree():
    """DAPO-Math-17k repeats problems, 12 of them with different answers (4 with the placeholder -1 first): which
    row is right is unknown, and a wrong truth trains the wrong way, so they are left out."""
    rows = [
        Problem("a", "What is  1+1?", "2"),
        Problem("b", "What is 1+1? ", "2"),
        Problem("c", "What\nis 1+1?", "3"),
        Problem("d", "Other", "5"),
        Problem("e", "Other ", " 5"),
    ]
    unique, report = dedupe(rows)
    assert [p.id for p in unique] == ["d"]
    assert report.duplicates == {"b": "a", "c": "a", "e": "d"}
    assert report.conflicts == {"a": ["2", "3"]}
    assert report.unique == 1 and "left out" in report.summary()
    # by text, not id: two files each numbering from 0 lose only the problem whose rows disagree
    unique, _ = dedupe([Problem("0", "1+1=?", "2"), Problem("0", "2+2=?", "4"), Problem("1", "2+2=?", "5")])
    assert [p.problem for p in unique] == ["1+1=?"]


def test_a_jsonl_row_still_in_the_dapo_template_is_stripped_of_it_and_an_empty_file_is_refused(tmp_path):
    """A jsonl made from the verl layout keeps the instruction in the problem: the prompt wrapped it twice."""
    path = tmp_path / "copied.jsonl"
    path.write_text(json.dumps({"problem": DAPO_TEMPLATE.format(problem="What is 2+2?"), "answer": "4"}) + "\n")
    (problem,) = load_problems(str(path), make_settings())
    assert problem.problem == "What is 2+2?"
    assert render_prompt(problem, None, "dapo").count("Solve the following") == 1
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="empty.jsonl: no problems"):
        load_problems(str(empty), make_settings())


# --------------------------------------------------------------------------- parquet (verl layout)


def write_verl_parquet(path, rows):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(
        [
            {
                "data_source": "math_dapo",
                "prompt": [{"role": "user", "content": DAPO_TEMPLATE.format(problem=problem)}],
                "ability": "MATH",
                "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
                "extra_info": {"index": str(index)},
            }
            for index, (problem, answer) in enumerate(rows)
        ]
    )
    pq.write_table(table, path)


def test_verl_parquet_loads_like_dapo_math_17k(tmp_path):
    path = tmp_path / "dapo-math-17k.parquet"
    # The Hugging Face original repeats every prompt; de-duplication folds the repeats.
    write_verl_parquet(path, [("Find $x$ if $x+1=3$.", "2"), ("Compute $7\\cdot 6$.", "42")] * 3)
    rows = load_problems(str(path), make_settings(dedupe=False))
    assert len(rows) == 6
    assert rows[0] == Problem("dapo-math-17k-0", "Find $x$ if $x+1=3$.", "2")
    assert rows[1].problem == "Compute $7\\cdot 6$." and rows[1].answer == "42"
    unique = load_problems(str(path))
    assert [p.answer for p in unique] == ["2", "42"]


def test_flat_parquet_and_bad_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"problem": "1+2?", "answer": "3"}]), tmp_path / "flat.parquet")
    assert load_problems(str(tmp_path / "flat.parquet")) == [Problem("flat-0", "1+2?", "3")]
    pq.write_table(pa.Table.from_pylist([{"question": "1+2?"}]), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match="bad.parquet row 0"):
        load_problems(str(tmp_path / "bad.parquet"))
    text_prompt = [{"prompt": "What is 1+2?", "reward_model": {"ground_truth": "3"}}]
    pq.write_table(pa.Table.from_pylist(text_prompt), tmp_path / "text.parquet")
    assert load_problems(str(tmp_path / "text.parquet")) == [Problem("text-0", "What is 1+2?", "3")]


def test_parquet_without_pyarrow_says_how_to_install(tmp_path, monkeypatch):
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(__import__("sys").modules, "pyarrow", None)  # as if pyarrow were not installed
    monkeypatch.setitem(__import__("sys").modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match="pip install pyarrow"):
        load_problems(str(tmp_path / "x.parquet"))


# --------------------------------------------------------------------------- prompts


def chat_tokenizer():
    """A real fast tokenizer with a chat template (Qwen-style markers), built locally."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]")
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return tok


def test_render_prompt_uses_the_chat_template_when_there_is_one():
    tok = chat_tokenizer()
    problem = Problem("p", "What is $1+1$?", "2")
    text = render_prompt(problem, tok, "auto")
    assert text == "<|im_start|>user\n" + DAPO_TEMPLATE.format(problem=problem.problem) + \
        "<|im_end|>\n<|im_start|>assistant\n"
    assert render_prompt(problem, tok, "dapo") == text
    assert render_prompt(problem, tok, "raw") == RAW_TEMPLATE.format(problem=problem.problem)


def test_render_prompt_raw_without_chat_template():
    from cli.bootstrap import build_tokenizer

    tok = build_tokenizer("0123456789+-*=?,\n :ASLNaeilnorstvw.")
    assert render_prompt("3+4*5=?", tok, "auto") == "Solve. Last line: Answer: N\n3+4*5=?\n"
    assert render_prompt("3+4*5=?", tok, "auto", "Q {problem} A") == "Q 3+4*5=? A"
    assert render_prompt("x", tok, "dapo") == DAPO_TEMPLATE.format(problem="x")
    with pytest.raises(DataError):
        render_prompt("x", tok, "nonsense")


def test_config_default_raw_template_is_the_module_default():
    assert Settings().data.raw_template == RAW_TEMPLATE


def test_warm_up_slips_are_consistent_and_at_the_requested_rate():
    """Slipped solutions stay self-consistent (later steps use the slipped value) and land at the rate asked."""
    import random

    task = SyntheticTask()
    rng = random.Random(0)
    problems = task.problems("train", 2000)
    assert all(task.solution(p.problem, 0.0, rng) == task.solution(p.problem) for p in problems[:50])
    wrong_steps = total_steps = wrong_answers = 0
    for p in problems:
        text = task.solution(p.problem, 0.4, rng)
        chain, answer_line = text.split("\n")
        values = {}
        for step in chain.split(","):
            left, result = step.split("=")
            op_at = max(i for i, ch in enumerate(left) if ch in "+-*" and i > 0 and left[i - 1].isdigit())
            a, op, b = int(left[:op_at]), left[op_at], int(left[op_at + 1:])
            true = {"+": a + b, "-": a - b, "*": a * b}[op]
            total_steps += 1
            wrong_steps += int(result) != true
            assert abs(int(result) - true) <= 2
            values[step] = int(result)
        assert answer_line == f"Answer: {list(values.values())[-1]}"  # the answer follows the chain
        wrong_answers += answer_line != f"Answer: {p.answer}"
    assert 0.35 < wrong_steps / total_steps < 0.45
    assert wrong_answers > 0


def test_prompts_are_cached_by_problem_text_not_by_the_files_ids():
    """A train and an eval file may both number their rows from 0: eval problem 0 must get its own prompt."""
    from learner.service import PromptBuilder

    class CharTokenizer:  # the one call PromptBuilder makes, on a tokenizer without a chat template
        chat_template = None

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) for c in text]}

    build = PromptBuilder(CharTokenizer(), make_settings())
    train, held_out = Problem("0", "1+1?", "2"), Problem("0", "2+2?", "4")
    assert "1+1?" in build(train)[0] and "2+2?" in build(held_out)[0]
    assert build(held_out)[1] == [ord(c) for c in build(held_out)[0]]
    # the most recent prompts only (the held-out set is issued again at every evaluation), not the whole data set
    build.CACHED_PROMPTS = 3
    for i in range(10):
        build(Problem(str(i), f"{i}+0?", str(i)))
        build(held_out)  # used again and again: kept
    assert len(build._cache) == 3 and "2+2?" in build._cache and "9+0?" in build._cache


def test_characters_outside_a_tokenizer_alphabet_name_the_problem():
    from services.data import check_alphabet

    alphabet = set("0123456789+-*=? \nWhatis")
    check_alphabet([Problem("a", "What is 1+2?", "3")], alphabet)
    with pytest.raises(DataError, match=re.escape("problem b: characters '\\\\bdeox{}' are not in the tiny model's")):
        check_alphabet([Problem("a", "What is 1+2?", "3"), Problem("b", "What is \\boxed{x}?", "4")], alphabet)


def test_held_out_problems_that_are_also_training_problems_are_counted():
    from services.data import shared_problems

    train = [Problem("a", "What is 1+2?", "3"), Problem("b", "What is 2+2?", "4")]
    held_out = [Problem("0", "What is  1+2?", "3"), Problem("1", "What is 5+5?", "10")]
    assert shared_problems(train, held_out) == 1 and shared_problems(train, held_out[1:]) == 0


def test_a_resume_on_another_built_in_task_or_raw_template_is_another_recipe():
    """The built-in task's difficulty, and the raw template (the prompt of the tiny model), say what the
    checkpoint's policy was trained on: changed, a resume would mix two tasks in one run's curve."""
    from learner.service import recipe, recipe_changes

    saved = recipe(make_settings())
    harder = make_settings(synthetic_operands=4, raw_template="Q: {problem}\nA:")
    assert [change.split(" ")[0] for change in recipe_changes(saved, harder)] == ["data.raw_template",
                                                                                   "data.synthetic_operands"]
