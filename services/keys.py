"""Role keys: who may sign what on the wire, where the keys live, and how they rotate. The one place that owns keys.

Roles. Three roles sign: the `learner` (what it issues: prompt tasks, its durable `held` groups, weight
announcements), `generator` (rollout groups) and `reward` (scored groups). Each role has its own Ed25519 key;
every verifier holds only public keys, so a generator's key cannot make a `scored` group the learner accepts, and
no worker key can make a task or an announcement. `SIGNER_OF` says which role signs each stream, and
`DEAD_LETTER_SIGNER_OF` which role may dead-letter an entry of it (the stream's consumer): the learner acts on
dead letters (it stops waiting for the task one names), so a generator cannot retire a `scored` group by a letter.

Key ids. A key's id (kid) is `{role}-{first 16 hex of the sha256 of its public key}`; a signature travels as
`{kid}:{base64 signature}`. A verifier looks the kid up in its keyring (the public keys in `keys.public_dir`,
one `{kid}.pub` file each): the role is the keyring's, never the message's word.

What is signed. A list of fields, each length-prefixed (`framed`), the first naming what it is (a stream key, the
dead stream's key, the run's weights channel): no re-split of the fields, splice or shift of bytes between them,
nor a replay into another stream or run, gives the same signed bytes. The signature travels next to the payload
(the stream field `sig`, a dead letter's `sig` over all its fields, the announcement's `signature`), so payload
schemas and their `schema_version` are unchanged. This is the one explanation of the scheme; the README,
services/messages.py and services/weights.py point here.

Storage. A key is one line of base64 (32 raw bytes). An embedded run (`dapo run`, `create_keys`) keeps them
under run_dir/keys: `private/{role}.key` (mode 0600, folder 0700) and `public/{kid}.pub`. Kubernetes and compose:
one Secret per role holding its private key, given to that role's pods only as DAPO_KEYS__PRIVATE_KEY, and the
public keys (not secret) mounted at keys.public_dir in every pod (docs/deploy.md).

Rotation (`rotate`, `retire`; `dapo keys rotate ROLE`, `dapo keys retire KID`), without dropping in-flight work:
1. `rotate` writes the role's new public key beside the old one, then its new private key: verifiers find the
   new kid at once (a kid not in the keyring reloads the folder), and the old kid still verifies, so entries
   already in the streams or in `held` under it are not lost.
2. Restart the role's processes (a rollout): they sign under the new kid from then on.
3. Once nothing signed under the old kid is in flight (streams drained, `held` released by a checkpoint),
   `retire` removes its public key. Verifiers see the folder change within KEYRING_REFRESH_S; an entry still
   signed under it is dead-lettered, `forged: key id ... is not in the keyring`.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import time
from pathlib import Path
from typing import Literal, get_args

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from services.config import Settings
from services.errors import Unavailable
from services.files import write_atomic

log = logging.getLogger(__name__)

Role = Literal["learner", "generator", "reward"]
ROLES: tuple[Role, ...] = get_args(Role)
# Which role signs the entries of each stream, and weight announcements.
SIGNER_OF: dict[str, Role] = {"prompts": "learner", "held": "learner", "rollouts": "generator", "scored": "reward",
                              "weights": "learner"}
# Which role may dead-letter an entry of each stream: its consumer.
DEAD_LETTER_SIGNER_OF: dict[str, Role] = {"prompts": "generator", "rollouts": "reward", "scored": "learner",
                                          "held": "learner"}
KEYRING_REFRESH_S = 1.0  # a verifier looks for added or retired public keys at most this often


class KeysError(Unavailable):
    """A key that is missing, malformed or not what the configuration says it is (a service exits saying so, 69)."""


def key_id(role: Role, public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(Encoding.Raw, PublicFormat.Raw)
    return f"{role}-{hashlib.sha256(raw).hexdigest()[:16]}"


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str, what: str, size: int = 32) -> bytes:
    """`size` bytes from their base64 (32: an Ed25519 key, 64: a signature); KeysError otherwise."""
    text = text.strip()
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except ValueError as err:
        raise KeysError(f"{what} is not base64: {err}") from None
    if len(raw) != size:
        raise KeysError(f"{what} holds {len(raw)} bytes, not {size}")
    return raw


def framed(*fields: str | bytes | int) -> bytes:
    """Fields as one unambiguous byte string: each as its length (8 bytes, big-endian) then its bytes (a str as
    UTF-8, an int in decimal, as Redis stores it). No other list of fields gives the same bytes."""
    out = bytearray()
    for field in fields:
        data = field if isinstance(field, bytes) else str(field).encode()
        out += len(data).to_bytes(8, "big") + data
    return bytes(out)


class Signer:
    """One role's private key: signs as `{kid}:{base64 signature}` over the framed fields under a context."""

    def __init__(self, role: Role, private: Ed25519PrivateKey):
        self.role = role
        self._private = private
        self.kid = key_id(role, private.public_key())

    @classmethod
    def from_text(cls, role: Role, text: str, what: str) -> "Signer":
        return cls(role, Ed25519PrivateKey.from_private_bytes(_unb64(text, what)))

    def sign(self, context: str, *fields: str | bytes | int) -> str:
        return f"{self.kid}:{_b64(self._private.sign(framed(context, *fields)))}"


class Keyring:
    """The public keys a verifier trusts, by kid, read from `keys.public_dir` and re-read when the folder changes."""

    def __init__(self, public_dir: Path):
        self.dir = public_dir
        self._keys: dict[str, tuple[Role, Ed25519PublicKey]] = {}
        self._listing: tuple = ()
        self._checked_at = float("-inf")
        self.refresh(strict=True)

    def refresh(self, strict: bool = False) -> None:
        """Re-read the folder if its files changed (a key added by a rotation, one retired). `strict` (at start): a
        malformed key file raises KeysError. Later a refresh runs on the message path (an unknown key id forces
        one), so a malformed file is skipped and logged there (a key already read under its name is kept): one
        bad file must not stop the consumers."""
        self._checked_at = time.monotonic()
        try:
            listing = tuple(sorted((p.name, p.stat().st_mtime_ns) for p in self.dir.glob("*.pub")))
            if listing != self._listing:
                self._keys, self._listing = self._read(listing, strict), listing
        except FileNotFoundError:
            return  # a key retired while the folder was read: the keys so far until the next look
        except OSError as err:
            raise KeysError(f"cannot read the public keys in {self.dir}: {err}") from None

    def _read(self, listing: tuple, strict: bool) -> dict[str, tuple[Role, Ed25519PublicKey]]:
        keys = {}
        for name, _ in listing:
            kid = name[: -len(".pub")]
            try:
                keys[kid] = self._read_key(name, kid)
            except KeysError as err:
                if strict:
                    raise
                log.error("public key skipped: %s", err)
                if kid in self._keys:
                    keys[kid] = self._keys[kid]
        return keys

    def _read_key(self, name: str, kid: str) -> tuple[Role, Ed25519PublicKey]:
        role = kid.rpartition("-")[0]
        if role not in ROLES:
            raise KeysError(f"{self.dir / name}: a public key is named {{role}}-{{id}}.pub, role one of {ROLES}")
        public = Ed25519PublicKey.from_public_bytes(_unb64((self.dir / name).read_text(), str(self.dir / name)))
        if key_id(role, public) != kid:
            raise KeysError(f"{self.dir / name}: the file name is not the key's id ({key_id(role, public)})")
        return role, public

    def kids(self, role: Role) -> list[str]:
        self._maybe_refresh(force=False)
        return sorted(kid for kid, (owner, _) in self._keys.items() if owner == role)

    def _maybe_refresh(self, force: bool) -> None:
        if force or time.monotonic() - self._checked_at >= KEYRING_REFRESH_S:
            self.refresh()

    def refusal(self, signature: str | bytes | None, role: Role, what: str, context: str,
                *fields: str | bytes | int) -> str | None:
        """Why `signature` does not show that `role` signed the fields under `context` (None: it does). `what` names
        the thing signed in the reason (e.g. `prompts`). Reasons start with `forged:`."""
        if isinstance(signature, bytes):
            signature = signature.decode(errors="replace")
        if not signature:
            return "forged: no signature"
        kid, _, encoded = signature.partition(":")
        self._maybe_refresh(force=kid not in self._keys)
        if kid not in self._keys:
            return f"forged: key id {kid[:80]!r} is not in the keyring (retired by a rotation, or never issued)"
        owner, public = self._keys[kid]
        if owner != role:
            return f"forged: signed by the {owner} role's key {kid}, and only the {role} role signs {what}"
        try:
            public.verify(_unb64(encoded, "the signature", 64), framed(context, *fields))
        except (InvalidSignature, KeysError):
            return f"forged: bad signature under {kid} (tampered, or not signed with that key)"
        return None


# -- where the keys live --------------------------------------------------------------------------------------
def keys_dir(settings: Settings) -> Path:
    return Path(settings.keys.dir or Path(settings.run_dir) / "keys")


def public_dir(settings: Settings) -> Path:
    return Path(settings.keys.public_dir) if settings.keys.public_dir else keys_dir(settings) / "public"


def private_key_file(folder: Path, role: Role) -> Path:
    return folder / "private" / f"{role}.key"


def load_keyring(settings: Settings) -> Keyring:
    return Keyring(public_dir(settings))


def load_signer(settings: Settings, role: Role, keyring: Keyring | None = None) -> Signer:
    """This process's key for `role`: keys.private_key (its role's Secret), else keys.dir/private/{role}.key. Its
    public key must be in the keyring as a `role` key, or the configuration mixed up two roles' keys."""
    if settings.keys.private_key is not None:
        signer = Signer.from_text(role, settings.keys.private_key.get_secret_value(), "keys.private_key")
    else:
        path = private_key_file(keys_dir(settings), role)
        try:
            text = path.read_text()
        except OSError as err:
            raise KeysError(f"no {role} key: {path} ({err.strerror}); set DAPO_KEYS__PRIVATE_KEY to the {role} role's "
                            "key, or create the run's keys (`dapo keys init`; `dapo run` does)") from None
        signer = Signer.from_text(role, text, str(path))
    keyring = keyring or load_keyring(settings)
    if signer.kid not in keyring.kids(role):
        raise KeysError(f"the {role} key {signer.kid} is not among the {role} public keys in {keyring.dir} "
                        f"({', '.join(keyring.kids(role)) or 'none'}): a key of another role, or of another run")
    return signer


def write_secret(path: Path, text: str) -> None:
    """`text` in `path`, mode 0600 from its creation (in a folder made 0700), replaced atomically."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_atomic(path, text + "\n", mode=0o600)


def new_key(folder: Path, role: Role) -> str:
    """A new key for `role` in `folder`: its public key first (verifiers know it before anything is signed with
    it), then the private key in place of the role's current one. Returns the new kid."""
    private = Ed25519PrivateKey.generate()
    kid = key_id(role, private.public_key())
    public = folder / "public"
    public.mkdir(mode=0o755, parents=True, exist_ok=True)
    raw = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    write_atomic(public / f"{kid}.pub", _b64(raw) + "\n", mode=0o644)  # whole: verifiers re-read the folder any time
    write_secret(private_key_file(folder, role),
                   _b64(private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())))
    return kid


def create_keys(folder: Path) -> dict[Role, str]:
    """Every role's key in `folder`, made where missing (an embedded run's keys): role -> current kid."""
    made = {}
    for role in ROLES:
        path = private_key_file(folder, role)
        if path.exists():
            private = Ed25519PrivateKey.from_private_bytes(_unb64(path.read_text(), str(path)))
            made[role] = key_id(role, private.public_key())
        else:
            made[role] = new_key(folder, role)
    return made


def rotate(folder: Path, role: Role) -> str:
    """Step 1 of a rotation: a new current key for `role`, the previous one still trusted. Returns the new kid."""
    return new_key(folder, role)


def retire(folder: Path, kid: str) -> None:
    """Step 3 of a rotation: stop trusting `kid` (refused: the role's current key, or its last one, which is the
    current key wherever the private keys were moved out of `folder` into Secrets, as docs/deploy.md advises)."""
    role = kid.rpartition("-")[0]
    if role not in ROLES or not (folder / "public" / f"{kid}.pub").exists():
        raise KeysError(f"no public key {kid} in {folder / 'public'}")
    current = private_key_file(folder, role)
    if current.exists() and Signer.from_text(role, current.read_text(), str(current)).kid == kid:
        raise KeysError(f"{kid} is the {role} role's current key: rotate it first")
    if [path.stem for path in (folder / "public").glob(f"{role}-*.pub")] == [kid]:
        raise KeysError(f"{kid} is the {role} role's last public key: every {role} would be refused (rotate first)")
    (folder / "public" / f"{kid}.pub").unlink()
