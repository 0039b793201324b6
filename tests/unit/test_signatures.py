"""Signatures that mean one thing (services/messages.py): what is signed is a list of length-prefixed fields under a
context, with a key bound to the run, so no re-split of the fields, splice or replay into another place or run
verifies."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.messages import (
    WeightsAnnouncement, WeightsFile, announcement_signed, framed, sign, sign_announcement, signing_key, verify,
)

KEY = signing_key("a-token-for-the-tests-0123456789", "run-a")
fields = st.lists(st.binary(max_size=12), max_size=6)


@given(fields, fields)
def test_framing_is_injective(a, b):
    assert (framed(*a) == framed(*b)) == (a == b)


@given(fields, st.data())
def test_no_re_split_of_the_same_bytes_verifies(parts, data):
    """Any other cut of the fields' concatenation (the dead-letter attack moved text from one field to the next)."""
    joined = b"\n".join(parts)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(joined)), max_size=len(parts) + 1)))
    resplit = [joined[i:j] for i, j in zip([0, *cuts], [*cuts, len(joined)])]
    signature = sign(KEY, "dapo:run-a:dead", *parts)
    assert verify(KEY, signature, "dapo:run-a:dead", *parts)
    if resplit != parts:
        assert not verify(KEY, signature, "dapo:run-a:dead", *resplit)


def test_str_int_and_bytes_fields_sign_alike_as_redis_returns_them():
    """A dead letter is signed from str and int values and verified from the bytes Redis hands back."""
    written = sign(KEY, "dapo:run-a:dead", b"deliveries", 4, b"reason", "délivré")
    assert verify(KEY, written, "dapo:run-a:dead", b"deliveries", b"4", b"reason", "délivré".encode())


def test_a_signature_binds_its_context_and_its_run():
    signature = sign(KEY, "dapo:run-a:scored", b"payload")
    assert not verify(KEY, signature, "dapo:run-a:prompts", b"payload")  # another stream
    assert not verify(KEY, signature, "dapo:run-a:scored", b"payload", b"")  # a field added
    same_token_other_run = signing_key("a-token-for-the-tests-0123456789", "run-b")
    assert same_token_other_run != KEY
    assert not verify(same_token_other_run, signature, "dapo:run-a:scored", b"payload")
    assert not verify(KEY, "é" + signature[1:], "dapo:run-a:scored", b"payload")  # junk on the wire: False


def test_an_announcement_verifies_in_its_run_only():
    files = [WeightsFile(name="model.safetensors", sha256="0" * 64, size=1)]
    announcement = sign_announcement(
        WeightsAnnouncement(version=3, sha256="1" * 64, size=1, url="http://learner:8000/v1/weights/3", files=files), KEY
    )
    assert announcement_signed(announcement, KEY)
    assert not announcement_signed(announcement, signing_key("a-token-for-the-tests-0123456789", "run-b"))
    assert not announcement_signed(announcement.model_copy(update={"version": 4}), KEY)
