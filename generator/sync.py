"""The generator's half of weight sync: get an announced version and check it fits the model, off the hot path.

Transport http pulls the shards into this generator's own folder; shared-fs checks them in `weights.shared_dir`
and loads them from there, holding the versions it serves or loads so the learner does not prune them.
Transport collective takes versions as broadcast rounds into the engine (services/broadcast.py: this class keeps
the membership and checks what the engine's workers staged) and pulls over HTTP what a round did not bring.

`prepare` runs in a background thread while the engine keeps generating with the old weights; the worker
swaps the engine to the returned folder only between batches (services/weights.py has the protocol).
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from services.broadcast import commit_refusal, leave, register_member
from services.config import Settings
from services.http import client_verify
from services.keys import load_keyring
from services.messages import WeightsAnnouncement, WeightsBroadcast
from services.streams import run_prefix
from services.weights import (
    AnnouncementWatcher,
    WeightsError,
    channel,
    check_schema,
    check_shared,
    latest_announcement,
    model_schema,
    pull_weights,
    tied_aliases,
)
from services.weights_layout import PULLING_PREFIX, remove_unfinished, write_hold

log = logging.getLogger(__name__)


class WeightSync:
    """Gets announced versions (pulled into its own folder, or in the shared one) and validates them against the
    model."""

    def __init__(self, settings: Settings, model_dir: str | Path, redis_client, generator_id: str):
        self.settings = settings
        self.token = (settings.weights_token or settings.token).get_secret_value()  # the weights' own, if given
        self.timeout = settings.generator.pull_timeout_s
        self.dir = Path(settings.generator.weights_dir or Path(settings.run_dir) / "generators" / generator_id)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.id = generator_id
        self.weights = settings.weights
        self.shared = Path(settings.weights.shared_dir) if settings.weights.transport == "shared-fs" else None
        if self.shared is None and (removed := remove_unfinished(self.dir, PULLING_PREFIX)):
            log.warning("removed %d downloads a killed generator left unfinished in %s", removed, self.dir)
        self._held: set[int] = set()
        # What the engine was built for: read from the model folder's own checkpoint before any reload.
        self.expected = model_schema(model_dir)
        self.optional = tied_aliases(model_dir)
        self.redis = redis_client
        self.prefix = run_prefix(settings)
        self.keyring = load_keyring(settings)
        # The only place this generator sends its token to: the configured learner, whatever Redis says.
        self.learner_url = settings.learner.public_base_url()
        self.learner_host = urlsplit(self.learner_url).hostname  # where the broadcast rendezvous store listens
        self.collective = settings.weights.transport == "collective"
        self.watcher = AnnouncementWatcher(redis_client, self.prefix, self.keyring,
                                           poll_s=settings.generator.sync_poll_s)
        self.cancel = threading.Event()  # set when the generator stops: a download or check ends at its next chunk
        self.leave()  # a killed predecessor's membership: no round may name this id before its engine is ready

    def latest(self) -> WeightsAnnouncement | None:
        """Read the latest key now (and tell the watcher)."""
        announcement = latest_announcement(self.redis, self.prefix, self.keyring)
        self.watcher.offer(announcement)
        return announcement

    def register(self, workers: int, busy: bool = False) -> None:
        """collective: be in the learner's next rounds (renewed every heartbeat); `busy`: loading a version from
        the files, left out of rounds meanwhile."""
        register_member(self.redis, self.prefix, self.id, workers, busy=busy)

    def leave(self) -> None:
        if self.collective:
            leave(self.redis, self.prefix, self.id)

    def round_refusal(self, offered: WeightsBroadcast, statuses: list[dict]) -> str | None:
        """Why the engine must not load what its workers staged from a round (None: it may)."""
        for status in statuses:
            if error := status.get("error"):
                return error
            digests = {int(index): hexdigest for index, hexdigest in status["digests"].items()}
            if refusal := commit_refusal(offered, status["commit"], digests, self.keyring, channel(self.prefix)):
                return refusal
        return None

    def prepare(self, announcement: WeightsAnnouncement) -> tuple[Path, float]:
        """Get and verify the files (sha256), then the names/shapes: (folder, seconds); WeightsError if refused."""
        started = time.perf_counter()
        if self.shared is not None:
            self._hold(self._held | {announcement.version})  # before the check: the learner may prune meanwhile
            folder = check_shared(announcement, self.shared, self.weights.pull_concurrency, cancel=self.cancel)
            check_schema(model_schema(folder), self.expected, self.optional)
            return folder, time.perf_counter() - started
        if not pulls_from(announcement.url, self.learner_url):
            raise WeightsError(
                "untrusted_url", f"weights v{announcement.version} announced at {announcement.url}, which is not under "
                f"the configured learner URL {self.learner_url} (learner.public_url): not sending the token there",
            )
        folder = pull_weights(
            announcement, self.token, self.dir, timeout=self.timeout, concurrency=self.weights.pull_concurrency,
            cancel=self.cancel, verify=client_verify(self.settings),
        )
        try:
            check_schema(model_schema(folder), self.expected, self.optional)
        except WeightsError:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return folder, time.perf_counter() - started

    def prune(self, keep: set[Path]) -> None:
        """Drop pulled versions (release held ones, shared-fs) except `keep` (the served one, the one being loaded)."""
        if self.shared is not None:
            self._hold({int(p.name[1:]) for p in keep if p is not None and p.parent == self.shared})
            return
        keep = {p.resolve() for p in keep if p is not None}
        for path in self.dir.iterdir():
            if path.is_dir() and path.resolve() not in keep and not path.name.startswith(PULLING_PREFIX):
                shutil.rmtree(path, ignore_errors=True)

    def _hold(self, versions: set[int]) -> None:
        write_hold(self.shared, self.id, versions)
        self._held = versions


def pulls_from(url: str, learner_url: str) -> bool:
    """Whether `url` is a weights endpoint of the configured learner (same scheme, host and port, path under it)."""
    target, base = urlsplit(url), urlsplit(learner_url.rstrip("/"))
    return (target.scheme, target.netloc) == (base.scheme, base.netloc) and target.path.startswith(
        base.path + "/v1/weights/"
    ) and ".." not in target.path
