"""`dapo keys`: the role keys and Redis users of a deployment, made and rotated from the command line (the shell
of services/keys.py and services/redis_users.py; docs/deploy.md, "Roles, keys and Redis users").

    dapo keys init [--dir DIR]          every role's key where missing: DIR/private/{role}.key, DIR/public/{kid}.pub
    dapo keys rotate ROLE [--dir DIR]   a new current key for ROLE, the previous one still trusted
    dapo keys retire KID [--dir DIR]    stop trusting KID (once nothing signed under it is in flight)
    dapo keys redis-users [--dir DIR] [--run RUN]
                                        DIR/redis/{user}.password and DIR/redis/users.acl (hashed, default user off;
                                        the users reach the keys of RUN only: --run, else $DAPO_RUN, else
                                        $DAPO_REDIS__RUN, else `default`, the run of docker-compose.yml and of the
                                        Kubernetes overlays)
    dapo keys compose [--dir DIR] [--run RUN]
                                        every secret docker-compose.yml mounts, as files in DIR/compose/ (keys and
                                        Redis users made first where missing, the ACL for RUN as redis-users; the
                                        bearer token from $DAPO_TOKEN, else the one there, else a new one)
    dapo keys compose-env [--dir DIR]   the old name of `compose` (it wrote environment variables, which Compose
                                        cannot mount into a read-only container): does the same, says so

DIR defaults to keys.dir (run_dir/keys). Secrets are written mode 0600 in folders 0700, except DIR/compose/: Compose
bind-mounts a file secret with its host mode (its uid, gid and mode options apply only under Swarm), and each
service reads its secrets as its own user (uid 10001, redis), so those files are 0444 in a folder 0700. A wrong
argument exits 2, as any other usage error of `dapo`.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

from services.config import Settings, digest_of_token
from services.errors import ExitCode
from services.keys import ROLES, KeysError, create_keys, keys_dir, private_key_file, retire, rotate, write_secret
from services.redis_users import REDIS_USERS, acl_file

COMPOSE_DIR = "compose"  # DIR/compose/<secret>: the files docker-compose.yml's `secrets:` name


def compose_secrets(root: Path) -> dict[str, str]:
    """The secrets docker-compose.yml mounts, by their name there (`secrets:`), from the key folder."""
    values = {"redis_acl": (root / "redis" / "users.acl").read_text()}
    values |= {f"redis_{user}_password": (root / "redis" / f"{user}.password").read_text().strip()
               for user in REDIS_USERS}
    values |= {f"{role}_key": private_key_file(root, role).read_text().strip() for role in ROLES}
    return values


def make_redis_users(root: Path, run: str) -> str:
    """New passwords for every Redis user, and users.acl with their keys: those of `run` only."""
    passwords = {user: secrets.token_hex(32) for user in REDIS_USERS}
    for user, password in passwords.items():
        write_secret(root / "redis" / f"{user}.password", password)
    write_acl(root, passwords, run)
    return f"{root / 'redis'}: users.acl (run {run}) and {', '.join(f'{u}.password' for u in REDIS_USERS)}"


def write_acl(root: Path, passwords: dict[str, str], run: str) -> None:
    write_secret(root / "redis" / "users.acl", acl_file(passwords, run=run).rstrip("\n"))


def write_compose_secrets(root: Path, run: str = "default") -> Path:
    """DIR/compose/: every file secret of docker-compose.yml, made from the key folder (keys and Redis users first
    where missing; the ACL written again for `run`, the passwords kept). The operator's token ($DAPO_TOKEN, else the
    file's, else a new one: `dapo_token`, mounted into no container) and its sha256 (`dapo_token_sha256`, what the
    services admit it by); the weights token ($DAPO_WEIGHTS_TOKEN, else the file's, else a new one)."""
    create_keys(root)
    passwords = {user: path.read_text().strip() for user in REDIS_USERS
                 if (path := root / "redis" / f"{user}.password").exists()}
    if len(passwords) < len(REDIS_USERS):
        make_redis_users(root, run)
    else:
        write_acl(root, passwords, run)
    folder = root / COMPOSE_DIR
    kept = {}
    for name, variable in (("dapo_token", "DAPO_TOKEN"), ("dapo_weights_token", "DAPO_WEIGHTS_TOKEN")):
        file = folder / name
        kept[name] = (os.environ.get(variable) or (file.read_text().strip() if file.exists() else "")
                      or secrets.token_hex(32))
    # The services get the operator's token as its sha256 only, the learner and generators the weights token.
    values = {**kept, "dapo_token_sha256": digest_of_token(kept["dapo_token"]), **compose_secrets(root)}
    for name, value in values.items():
        write_secret(folder / name, value.rstrip("\n"))
        (folder / name).chmod(0o444)  # read by the service's own user through the bind mount (module docstring)
    return folder


def main(settings: Settings, action: str, name: str | None, folder: str | None, run: str | None = None) -> int:
    root = Path(folder) if folder else keys_dir(settings)
    # The deployments' run (docker-compose.yml's ${DAPO_RUN:-default}, the Kubernetes overlays' redis.run), not the
    # preset's: `dapo run` makes its own Redis users. A run named in the environment as a service reads it counts.
    run = run or os.environ.get("DAPO_RUN") or os.environ.get("DAPO_REDIS__RUN") or "default"
    try:
        return _keys(root, action, name, run)
    except (OSError, KeysError) as err:
        print(f"dapo keys {action}: {err}", file=sys.stderr)
        return ExitCode.UNAVAILABLE


def _keys(root: Path, action: str, name: str | None, run: str) -> int:
    usage = None
    if action == "init":
        for role, kid in create_keys(root).items():
            print(f"{role}: {kid}")
    elif action == "rotate":
        if name not in ROLES:
            usage = f"name a role, one of {', '.join(ROLES)}"
        elif not private_key_file(root, name).exists():
            usage = f"no {name} key in {root} to rotate (`dapo keys init --dir {root}` makes the keys)"
        else:
            print(f"{name}: {rotate(root, name)} (the previous key stays trusted until `dapo keys retire` names it)")
    elif action == "retire" and not name:
        usage = "name the key id to retire"
    elif action == "retire":
        try:
            retire(root, name)
            print(f"retired {name}")
        except KeysError as err:  # no such key, or the role's current one: the argument is wrong
            known = ", ".join(sorted(path.stem for path in (root / "public").glob("*.pub"))) or "none"
            usage = f"{err} (the key ids there: {known})"
    elif action in ("compose", "compose-env"):
        line = (f"{write_compose_secrets(root, run)}: the secrets docker-compose.yml mounts for the run {run} "
                f"(DAPO_SECRETS_DIR={root})")
        if action == "compose-env":  # its output was eval'ed by a shell: nothing on stdout
            print(f"{line} (`dapo keys compose-env` is now `dapo keys compose`: files, not variables)", file=sys.stderr)
        else:
            print(line)
    else:  # redis-users
        print(make_redis_users(root, run))
    if usage:
        print(f"dapo keys {action}: {usage}", file=sys.stderr)
        return ExitCode.USAGE
    return 0
