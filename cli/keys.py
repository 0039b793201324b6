"""`dapo keys`: the role keys and Redis users of a deployment, made and rotated from the command line (the shell
of services/keys.py and services/redis_users.py; docs/deploy.md, "Roles, keys and Redis users").

    dapo keys init [--dir DIR]          every role's key where missing: DIR/private/{role}.key, DIR/public/{kid}.pub
    dapo keys rotate ROLE [--dir DIR]   a new current key for ROLE, the previous one still trusted
    dapo keys retire KID [--dir DIR]    stop trusting KID (once nothing signed under it is in flight)
    dapo keys redis-users [--dir DIR]   DIR/redis/{user}.password and DIR/redis/users.acl (hashed, default user off)
    dapo keys compose-env [--dir DIR]   `export` lines of those for docker-compose.yml (eval "$(dapo keys ...)")

DIR defaults to keys.dir (run_dir/keys). Secrets are written mode 0600 in folders 0700.
"""

from __future__ import annotations

import secrets
import shlex
from pathlib import Path

from services.config import Settings
from services.keys import ROLES, create_keys, keys_dir, private_key_file, retire, rotate, write_secret
from services.redis_users import REDIS_USERS, acl_file


def compose_secrets(root: Path) -> dict[str, str]:
    """The secrets docker-compose.yml reads from the environment, by variable name."""
    values = {"REDIS_ACL": (root / "redis" / "users.acl").read_text()}
    values |= {f"REDIS_{user.upper()}_PASSWORD": (root / "redis" / f"{user}.password").read_text().strip()
               for user in REDIS_USERS}
    values |= {f"DAPO_{role.upper()}_KEY": private_key_file(root, role).read_text().strip() for role in ROLES}
    return values


def main(settings: Settings, action: str, name: str | None, folder: str | None) -> int:
    root = Path(folder) if folder else keys_dir(settings)
    if action == "init":
        for role, kid in create_keys(root).items():
            print(f"{role}: {kid}")
    elif action == "rotate":
        if name not in ROLES:
            raise SystemExit(f"dapo keys rotate: name a role, one of {', '.join(ROLES)}")
        print(f"{name}: {rotate(root, name)} (the previous key stays trusted until `dapo keys retire` names it)")
    elif action == "retire":
        if not name:
            raise SystemExit("dapo keys retire: name the key id to retire (a file name in public/, without .pub)")
        retire(root, name)
        print(f"retired {name}")
    elif action == "compose-env":
        print("\n".join(f"export {name}={shlex.quote(value)}" for name, value in compose_secrets(root).items()))
    else:  # redis-users
        passwords = {user: secrets.token_hex(32) for user in REDIS_USERS}
        redis_dir = root / "redis"
        for user, password in passwords.items():
            write_secret(redis_dir / f"{user}.password", password)
        write_secret(redis_dir / "users.acl", acl_file(passwords).rstrip("\n"))
        print(f"{redis_dir}: users.acl and {', '.join(f'{u}.password' for u in REDIS_USERS)}")
    return 0
