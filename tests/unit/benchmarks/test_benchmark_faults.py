"""The fault benchmark's counting (benchmarks/faults.py): ledger checks, work redone, dead letters matched to
what was injected, on synthetic inputs (no run, no Redis)."""

from __future__ import annotations

import sys
from pathlib import Path

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from benchmarks.faults import (  # noqa: E402
    AclAttempt,
    Injection,
    Kill,
    analyze,
    digest,
    ground_truth_in,
    ledger_check,
    match_dead,
    recovery,
    redone,
    report,
)


def row(step: int, trained: list[str], **dropped) -> dict:
    return {"step": step, "version": step, "trained": trained, "stale_at_take": [],
            **{f"dropped_{k}": v for k, v in dropped.items()}}


def test_ledger_check_finds_repeated_steps_and_groups_trained_twice():
    good = [row(1, ["a", "b"]), row(2, ["c"], uninformative=["d"])]
    assert ledger_check(good) == {"steps": 2, "steps_once_in_order": True, "steps_repeated": [],
                                  "groups_trained": 3, "groups_unique": 3, "groups_trained_twice": [],
                                  "trained_and_dropped": []}
    bad = ledger_check([row(1, ["a"]), row(2, ["b"]), row(2, ["a"], duplicate=["b"])])
    assert not bad["steps_once_in_order"] and bad["steps_repeated"] == [2]
    assert bad["groups_trained_twice"] == ["a"] and bad["trained_and_dropped"] == ["b"]
    assert not ledger_check([row(2, ["a"])])["steps_once_in_order"]  # must start at step 1


def test_redone_counts_rows_of_a_discarded_lineage_once():
    final = [row(1, ["a"]), row(2, ["c", "d"])]
    seen = [row(1, ["a"]), row(2, ["b", "x"]), row(2, ["b", "x"]), row(2, ["c", "d"])]
    assert redone(seen, final) == {"steps_redone": 1, "steps": [2], "groups_retrained": 2}


def test_recovery_measures_from_the_kill_to_the_first_step_beyond_it():
    timeline = [(9.0, 3), (10.5, 3), (12.0, 2), (20.0, 3), (31.0, 4), (40.0, 5)]
    assert recovery(10.0, 3, timeline) == {"next_step_s": 21.0, "rolled_back_to": 2}
    assert recovery(10.0, 3, timeline[:4]) == {"next_step_s": None, "rolled_back_to": 2}


def scored_payload(task_id: str) -> bytes:
    return msgpack.packb({"rollout": {"task": {"task_id": task_id}}})


def test_dead_letters_are_matched_by_bytes_or_task_id_and_the_rest_are_legitimate():
    garbage, forged = b"\xff garbage", scored_payload("train-forged-1")
    prompt = msgpack.packb({"task_id": "train-forged-2"})
    injections = [
        Injection("malformed", "garbage", "scored", "unparseable", digest(garbage)),
        Injection("forged", "wrong key", "scored", "forged: bad signature", digest(forged), "train-forged-1"),
        # a forged prompt comes back as a scored group: matched by its task id
        Injection("forged", "made-up prompt", "prompts", "provenance: unknown", digest(prompt), "train-forged-2"),
        # a tampered group of a real task: only its own bytes match it, never the real task's other letters
        Injection("forged", "tampered", "scored", "forged: bad signature", digest(b"tampered"), "train-real",
                  real_task=True),
        # refused by its size: the letter keeps only the payload's sha256; an entry without a payload: neither
        Injection("poison", "8 MB", "prompts", "oversize:", digest(b"big" * 1000), "train-poison-1"),
        Injection("malformed", "no payload", "scored", "forged: no signature", digest(b"")),
    ]
    dead = [
        {"stream": "prompts", "reason": "oversize: 3,000 bytes", "payload_sha256": digest(b"big" * 1000)},
        {"stream": "scored", "reason": "forged: no signature"},
        {"stream": "scored", "reason": "forged: bad signature under reward-0123456789abcdef", "data": forged},
        {"stream": "scored", "reason": "unparseable ScoredGroup: ...", "data": garbage},
        {"stream": "scored", "reason": "provenance: unknown task id 'train-forged-2'",
         "data": scored_payload("train-forged-2")},
        {"stream": "prompts", "reason": "delivered 4 times (max 3)", "data": msgpack.packb({"task_id": "train-real"})},
    ]
    pairs, unmatched = match_dead(dead, injections)
    assert [(d["reason"].split(":")[0], i.label) for d, i in pairs] == [
        ("oversize", "8 MB"), ("forged", "no payload"), ("forged", "wrong key"), ("unparseable ScoredGroup", "garbage"),
        ("provenance", "made-up prompt")]
    assert unmatched == [dead[5]]


def test_analyze_and_report_state_each_goal():
    final = [row(1, ["a", "b"]), row(2, ["c", "train-forged-9"])]
    injections = [
        Injection("forged", "signed, unknown id", "scored", "provenance: unknown", digest(b"x"), "train-forged-9"),
        Injection("poison", "token id", "prompts", "invalid task: token id", digest(b"p"), "train-poison-1"),
    ]
    dead = [{"stream": "prompts", "reason": "invalid task: token id 1000000000 at position 2", "data": b"p"}]
    kills = [Kill(1, "learner", "learner", 10, 100.0, 2, 3.0, back_up_s=12.0, next_step_s=30.0, rolled_back_to=1),
             Kill(1, "redis", "redis-server", 11, 200.0, 2, 3.0, back_up_s=1.5, next_step_s=8.0, rolled_back_to=2)]
    metrics = [{"step": 1, "step_seconds": 10.0, "duplicates": 1, "lost": 0},
               {"step": 2, "step_seconds": 20.0, "duplicates": 0, "lost": 2}]
    acl = [AclAttempt("generator", "FLUSHALL", refused=True), AclAttempt("generator", "XADD scored", refused=False),
           AclAttempt("generator", "POST /v1/score with DAPO_WEIGHTS_TOKEN", refused=True, kind="http")]
    a = analyze(final, final + [row(2, ["z"])], metrics, dead, injections, kills, acl)
    assert a["forged_trained"] == 1 and a["forged_injected"] == 1
    assert a["injections"]["token id"]["dead_as_expected"] == 1 and a["injections"]["signed, unknown id"][
        "dead_as_expected"] == 0
    assert a["legit_dead"] == [] and a["redone"]["steps_redone"] == 1
    assert a["per_kind"]["learner"] == {"kills": 1, "back_up_s": [12.0], "next_step_s": [30.0], "steps_redone": [1]}
    assert a["metrics"]["duplicates_dropped"] == 1 and a["metrics"]["lost_with_redis"] == 2
    assert a["metrics"]["median_step_s"] == 15.0
    text = report({"analysis": a, "command_short": "python -m benchmarks.faults", "steps": 2, "kills": kills,
                   "returncode": 0, "minutes": 3.0, "conditions": "", "orphans": []})
    assert "| 0 forged messages trained | 1 of 1 | **no** |" in text
    assert "| the run finishes by itself | exit 0 after 3.0 min | yes |" in text
    assert "| learner | 1 | 12.0 | 30.0 | 1 |" in text
    assert "| 0 Redis commands outside a role's ACL accepted | 1 of 2 (generator: XADD scored) | **no** |" in text
    assert "| 0 HTTP calls outside a generator's audience accepted | 0 of 1 | yes |" in text


def test_a_spilled_payload_is_read_back_and_matched(tmp_path):
    from benchmarks.faults import with_spilled_payload

    big = msgpack.packb({"task_id": "train-poison-1", "prompt": "x" * 1000})
    spilled = tmp_path / f"{digest(big)}.msgpack"
    spilled.write_bytes(big)
    letter = {"stream": "prompts", "reason": "invalid task: prompt text of 1000 bytes cannot fit", "data": b"",
              "payload_sha256": digest(big), "payload_file": str(spilled)}
    injected = Injection("poison", "big prompt", "prompts", "invalid task", digest(big), "train-poison-1")
    pairs, unmatched = match_dead([with_spilled_payload(letter)], [injected])
    assert [i.label for _, i in pairs] == ["big prompt"] and unmatched == []
    spilled.write_bytes(b"changed")  # a file that is not the payload it names is not read back
    assert with_spilled_payload(letter)["data"] == b""


def test_a_dead_letter_carrying_a_ground_truth_is_found():
    def scored(truth: str) -> bytes:
        return msgpack.packb({"rollout": {"task": {"task_id": "t", "ground_truth": truth}}})

    assert ground_truth_in("scored", scored("42")) and ground_truth_in("held", scored("x"))
    assert not ground_truth_in("scored", scored("")) and not ground_truth_in("prompts", scored("42"))
    assert not ground_truth_in("scored", b"\xff garbage")


def test_a_flood_is_counted_apart_and_its_letters_are_not_legitimate():
    flood = b"F" * 100
    injections = [Injection("flood", "2 MB entries", "rollouts", "oversize", digest(flood)) for _ in range(3)]
    dead = [{"stream": "rollouts", "reason": "oversize: 2,000,000 bytes", "payload_sha256": digest(flood)}]
    a = analyze([row(1, ["a"])], [row(1, ["a"])], [{"step": 1, "step_seconds": 5.0}], dead, injections, [], [])
    assert a["legit_dead"] == [] and a["injections"] == {} and a["flood"] == {"entries": 3, "dead_as_expected": 1}
    floods = [{"wave": 1, "entries": 3, "filled": True, "writable_after_s": 4.0}]
    text = report({"analysis": a, "command_short": "c", "steps": 1, "kills": [], "returncode": 0, "minutes": 1.0,
                   "conditions": "", "orphans": [], "floods": floods})
    assert ("| Redis filled to maxmemory by a generator: it is freed, the run goes on | 1 floods of 3 entries of 2 MB "
            "(writes refused: 1 of 1); below 95 % again after 4.0 s; 1 of 3 dead-lettered (`oversize`), the rest "
            "trimmed unread | yes |") in text
    floods[0]["writable_after_s"] = None  # Redis never freed: the goal is missed
    text = report({"analysis": a, "command_short": "c", "steps": 1, "kills": [], "returncode": 0, "minutes": 1.0,
                   "conditions": "", "orphans": [], "floods": floods})
    (line,) = [line for line in text.splitlines() if line.startswith("| Redis filled")]
    assert line.endswith("| **no** |")
