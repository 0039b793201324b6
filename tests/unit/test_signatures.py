"""Signatures that mean one thing, by the role that may sign (services/keys.py): what is signed is a list of
length-prefixed fields under a context (a stream key, a run's weights channel), each role signs with its own Ed25519
key, and verifiers hold public keys only; so no re-split of the fields, splice, replay into another place or run,
nor a signature by another role's key verifies."""

from __future__ import annotations

import os
import stat

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.config import load_settings
from services.keys import (
    ROLES,
    Keyring,
    KeysError,
    create_keys,
    framed,
    load_keyring,
    load_signer,
    private_key_file,
    retire,
    rotate,
)
from services.messages import WeightsAnnouncement, WeightsFile, announcement_refusal, sign_announcement

fields = st.lists(st.binary(max_size=12), max_size=6)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys")
    create_keys(path)
    return path


@pytest.fixture(scope="module")
def keyring(folder):
    return Keyring(folder / "public")


@pytest.fixture(scope="module")
def signers(folder):
    return {role: signer(folder, role) for role in ROLES}


def signer(folder, role):
    return load_signer(load_settings("tiny-cpu", keys={"dir": str(folder)}), role)


@given(fields, fields)
def test_framing_is_injective(a, b):
    assert (framed(*a) == framed(*b)) == (a == b)


@given(fields, st.data())
def test_no_re_split_of_the_same_bytes_verifies(signers, keyring, parts, data):
    """Any other cut of the fields' concatenation (the dead-letter attack moved text from one field to the next)."""
    joined = b"\n".join(parts)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(joined)), max_size=len(parts) + 1)))
    resplit = [joined[i:j] for i, j in zip([0, *cuts], [*cuts, len(joined)])]
    signature = signers["learner"].sign("dapo:run-a:dead", *parts)
    assert keyring.refusal(signature, "learner", "dead letters", "dapo:run-a:dead", *parts) is None
    if resplit != parts:
        assert keyring.refusal(signature, "learner", "dead letters", "dapo:run-a:dead", *resplit)


def test_str_int_and_bytes_fields_sign_alike_as_redis_returns_them(folder, keyring):
    """A dead letter is signed from str and int values and verified from the bytes Redis hands back."""
    written = signer(folder, "learner").sign("dapo:run-a:dead", b"deliveries", 4, b"reason", "délivré")
    assert keyring.refusal(written, "learner", "x", "dapo:run-a:dead", b"deliveries", b"4", b"reason",
                           "délivré".encode()) is None


def test_a_signature_binds_its_context_its_run_and_its_role(folder, keyring):
    reward = signer(folder, "reward")
    signature = reward.sign("dapo:run-a:scored", b"payload")
    assert keyring.refusal(signature, "reward", "scored", "dapo:run-a:scored", b"payload") is None
    assert keyring.refusal(signature, "reward", "scored", "dapo:run-a:prompts", b"payload")  # another stream
    assert keyring.refusal(signature, "reward", "scored", "dapo:run-b:scored", b"payload")  # another run
    assert keyring.refusal(signature, "reward", "scored", "dapo:run-a:scored", b"payload", b"")  # a field added
    assert "is not in the keyring" in keyring.refusal("é" + signature[1:], "reward", "scored", "dapo:run-a:scored",
                                                      b"payload")  # junk on the wire: a reason, no exception
    # The same bytes signed by a generator key: a generator cannot make a scored group.
    forged = signer(folder, "generator").sign("dapo:run-a:scored", b"payload")
    assert keyring.refusal(forged, "reward", "scored", "dapo:run-a:scored", b"payload") == (
        f"forged: signed by the generator role's key {signer(folder, 'generator').kid}, and only the reward role "
        "signs scored")
    # A signature moved under another kid's label does not verify either.
    relabelled = signer(folder, "reward").kid + ":" + forged.partition(":")[2]
    assert keyring.refusal(relabelled, "reward", "scored", "dapo:run-a:scored", b"payload").startswith(
        "forged: bad signature")


def test_an_announcement_is_the_learners_and_verifies_in_its_run_only(folder, keyring):
    files = [WeightsFile(name="model.safetensors", sha256="0" * 64, size=1)]
    plain = WeightsAnnouncement(version=3, sha256="1" * 64, size=1, url="http://learner:8000/v1/weights/3", files=files)
    announcement = sign_announcement(plain, signer(folder, "learner"), "dapo:run-a:weights")
    assert announcement_refusal(announcement, keyring, "dapo:run-a:weights") is None
    assert announcement_refusal(announcement, keyring, "dapo:run-b:weights")
    assert announcement_refusal(announcement.model_copy(update={"version": 4}), keyring, "dapo:run-a:weights")
    by_generator = sign_announcement(plain, signer(folder, "generator"), "dapo:run-a:weights")
    assert "only the learner role signs" in announcement_refusal(by_generator, keyring, "dapo:run-a:weights")


def test_run_keys_are_private_files_and_a_key_of_another_role_is_refused(tmp_path):
    kids = create_keys(tmp_path)
    assert sorted(kids) == sorted(ROLES) and create_keys(tmp_path) == kids  # made once, then read
    for role in ROLES:
        assert stat.S_IMODE(os.stat(private_key_file(tmp_path, role)).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "private").st_mode) == 0o700
    generator_key = private_key_file(tmp_path, "generator").read_text().strip()
    mixed_up = load_settings("tiny-cpu", keys={"dir": str(tmp_path), "private_key": generator_key})
    with pytest.raises(KeysError, match="a key of another role"):
        load_signer(mixed_up, "learner")  # a learner pod given the generator's Secret
    assert load_signer(mixed_up, "generator").kid == kids["generator"]
    with pytest.raises(KeysError, match="no reward key"):
        load_signer(load_settings("tiny-cpu", keys={"dir": str(tmp_path / "none")}), "reward")


def test_rotation_keeps_the_previous_kid_until_it_is_retired(tmp_path):
    old = create_keys(tmp_path)["generator"]
    keyring = load_keyring(load_settings("tiny-cpu", keys={"dir": str(tmp_path)}))
    signed_before = signer(tmp_path, "generator").sign("ctx", b"x")
    new = rotate(tmp_path, "generator")
    assert new != old and signer(tmp_path, "generator").kid == new
    signed_after = signer(tmp_path, "generator").sign("ctx", b"x")
    for signature in (signed_before, signed_after):  # the new kid is found at once (an unknown kid re-reads)
        assert keyring.refusal(signature, "generator", "rollouts", "ctx", b"x") is None
    with pytest.raises(KeysError, match="current key"):
        retire(tmp_path, new)
    retire(tmp_path, old)
    private_key_file(tmp_path, "generator").unlink()  # moved into a Secret (docs/deploy.md): the last key is current
    with pytest.raises(KeysError, match="last public key"):
        retire(tmp_path, new)
    keyring.refresh()
    assert keyring.refusal(signed_before, "generator", "rollouts", "ctx", b"x").startswith(f"forged: key id '{old}'")
    assert keyring.refusal(signed_after, "generator", "rollouts", "ctx", b"x") is None


def test_dapo_keys_makes_the_deployment_secrets(tmp_path):
    from cli.keys import compose_secrets
    from cli.keys import main as keys

    settings = load_settings("tiny-cpu", run_dir=str(tmp_path))
    assert keys(settings, "init", None, None) == 0 and len(list((tmp_path / "keys" / "public").glob("*.pub"))) == 3
    assert keys(settings, "redis-users", None, str(tmp_path / "deploy")) == 0
    acl = (tmp_path / "deploy" / "redis" / "users.acl").read_text()
    # the deployments' run (compose, the Kubernetes overlays: `default`), not the tiny-cpu preset's own
    assert "~dapo:default:*" in acl and "tiny-cpu" not in acl
    passwords = {p.stem: p.read_text() for p in (tmp_path / "deploy" / "redis").glob("*.password")}
    assert sorted(passwords) == ["autoscaler", "generator", "learner", "reward"]
    default = acl.splitlines()[0]  # off (no one logs in as it), with what the AOF replay's EXEC re-check needs
    assert default.startswith("user default reset") and " off " in default and "nopass" not in default
    assert not any(p in acl for p in passwords.values())
    assert all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in (tmp_path / "deploy" / "redis").iterdir())
    assert keys(settings, "init", None, str(tmp_path / "deploy")) == 0
    compose = compose_secrets(tmp_path / "deploy")  # what docker-compose.yml mounts, by its secret names
    assert compose["redis_acl"] == acl and compose["redis_generator_password"] == passwords["generator"].strip()
    assert sorted(name for name in compose if name.endswith("_key")) == ["generator_key", "learner_key", "reward_key"]


def test_dapo_keys_compose_writes_every_file_once_and_keeps_the_token(tmp_path, monkeypatch, capsys):
    from cli.keys import main as keys

    settings = load_settings("tiny-cpu", run_dir=str(tmp_path))
    monkeypatch.delenv("DAPO_TOKEN", raising=False)
    assert keys(settings, "compose", None, str(tmp_path / "s")) == 0  # keys and Redis users made where missing
    token = (tmp_path / "s" / "compose" / "dapo_token").read_text()
    acl = (tmp_path / "s" / "compose" / "redis_acl").read_text()
    assert "compose" in capsys.readouterr().out
    assert keys(settings, "compose-env", None, str(tmp_path / "s")) == 0  # the old name: the same, no stdout
    assert capsys.readouterr().out == ""  # its output was eval'ed by a shell
    assert (tmp_path / "s" / "compose" / "dapo_token").read_text() == token  # kept, as are the users
    assert (tmp_path / "s" / "compose" / "redis_acl").read_text() == acl
    monkeypatch.setenv("DAPO_TOKEN", "t" * 40)
    keys(settings, "compose", None, str(tmp_path / "s"))
    assert (tmp_path / "s" / "compose" / "dapo_token").read_text().strip() == "t" * 40


def test_dapo_keys_usage_errors_exit_2(tmp_path, capsys):
    from cli.keys import main as keys

    settings = load_settings("tiny-cpu", run_dir=str(tmp_path))
    keys(settings, "init", None, None)
    assert keys(settings, "rotate", "nobody", None) == 2
    assert keys(settings, "retire", None, None) == 2
    assert keys(settings, "retire", "learner-0000", None) == 2
    assert "learner-" in capsys.readouterr().err  # names the key ids there are
    current = next(path.stem for path in (tmp_path / "keys" / "public").glob("reward-*.pub"))
    assert keys(settings, "retire", current, None) == 2  # the role's current key: rotate it first
    assert "rotate it first" in capsys.readouterr().err
    assert keys(settings, "rotate", "generator", str(tmp_path / "none")) == 2  # no keys there to rotate
    assert not (tmp_path / "none").exists()
    (tmp_path / "file").write_text("")
    assert keys(settings, "init", None, str(tmp_path / "file" / "keys")) == 69  # one line, no traceback
    assert "dapo keys init: " in capsys.readouterr().err
    assert keys(settings, "redis-users", None, str(tmp_path / "k8s"), "other") == 0
    assert "~dapo:other:*" in (tmp_path / "k8s" / "redis" / "users.acl").read_text()


def test_a_key_retired_while_the_keyring_reads_the_folder_is_no_crash(tmp_path, monkeypatch):
    create_keys(tmp_path)
    keyring = Keyring(tmp_path / "public")
    before = keyring.kids("reward")
    rotate(tmp_path, "reward")
    real_read_text = type(tmp_path).read_text

    def vanished(path, *args, **kwargs):  # the retire's unlink lands between the listing and the read
        if path.name.startswith("reward-"):
            raise FileNotFoundError(path)
        return real_read_text(path, *args, **kwargs)

    monkeypatch.setattr(type(tmp_path), "read_text", vanished)
    keyring.refresh()
    assert keyring.kids("reward") == before  # the keys so far
    monkeypatch.undo()
    keyring.refresh()
    assert len(keyring.kids("reward")) == 2


def test_a_malformed_key_file_stops_a_start_but_never_the_message_path(tmp_path):
    # A forged entry under an unknown kid forces a re-read of the folder: a bad file (a half-written one, a stray)
    # then met there must give a `forged:` reason, not an error out of every consumer.
    create_keys(tmp_path)
    keyring = Keyring(tmp_path / "public")
    good = signer(tmp_path, "generator").sign("ctx", b"x")
    (tmp_path / "public" / "generator-0123456789abcdef.pub").write_text("")
    (tmp_path / "public" / "nobody-0123456789abcdef.pub").write_text("x")
    reason = keyring.refusal("generator-ffffffffffffffff:AAAA", "generator", "rollouts", "ctx", b"x")
    assert reason.startswith("forged: key id 'generator-ffffffffffffffff' is not in the keyring")
    assert keyring.refusal(good, "generator", "rollouts", "ctx", b"x") is None  # the good keys stay
    with pytest.raises(KeysError, match="holds 0 bytes"):
        Keyring(tmp_path / "public")  # at start: the configuration is wrong, and the service says so
