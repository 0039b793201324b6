"""Every Prometheus metric the services export, in one place (the Grafana dashboard is tested against it).

Each service is its own process, so the default registry holds exactly what that service updates; metrics
of the other services stay at zero there and are harmless.
"""

import time

from prometheus_client import Counter, Gauge, Histogram

# Streams (services/streams.py); label `stream` is prompts | rollouts | scored | dead.
STREAM_DEPTH = Gauge("dapo_stream_depth", "Entries in the stream (undelivered + pending).", ["stream"])
STREAM_PENDING = Gauge("dapo_stream_pending", "Delivered but not yet acknowledged entries.", ["stream"])
STREAM_PRODUCED = Counter("dapo_stream_produced_total", "Messages written to the stream.", ["stream"])
STREAM_ACKED = Counter("dapo_stream_acked_total", "Messages acknowledged.", ["stream"])
STREAM_REDELIVERIES = Counter(
    "dapo_stream_redeliveries_total", "Messages reclaimed from a silent consumer.", ["stream"]
)
STREAM_RELEASED = Counter(
    "dapo_stream_released_total", "Messages taken up after their consumer handed them back (a stop, a wait, a "
    "refused version): no consumer died.", ["stream"]
)
STREAM_DEAD = Counter("dapo_stream_dead_letters_total", "Messages moved to the dead stream.", ["stream", "reason"])
STREAM_BACKPRESSURE = Counter(
    "dapo_stream_backpressure_seconds_total", "Seconds producers waited above high water.", ["stream"]
)
# Redis itself, as the learner reads it (INFO memory, every second while it waits for groups).
REDIS_USED_MEMORY = Gauge("dapo_redis_used_memory_bytes", "Bytes Redis has allocated (used_memory).")
REDIS_MAXMEMORY = Gauge("dapo_redis_maxmemory_bytes", "Redis' maxmemory (0: no limit): beyond it writes are refused.")
REDIS_KEY_MEMORY = Gauge("dapo_redis_key_memory_bytes", "Bytes each of the run's streams and hashes takes in Redis "
                         "(MEMORY USAGE): what fills it.", ["key"])
REDIS_TRIMMED = Counter("dapo_redis_trimmed_entries_total", "Entries the learner trimmed from a stream longer than its "
                        "producers may make it, with Redis nearly full (a producer ignoring its limit).", ["stream"])

# Generator.
GEN_TOKENS = Counter("dapo_generator_tokens_total", "Response tokens generated.")
GEN_TASKS = Counter("dapo_generator_tasks_total", "Prompt tasks turned into rollout groups.", ["split"])
GEN_BATCH_FILL = Gauge("dapo_generator_batch_fill", "Tasks in the engine over tasks_per_batch.")
GEN_VERSION = Gauge("dapo_generator_policy_version", "Policy version the generator serves (NaN until its first: a "
                    "starting generator must not read as far behind).")
GEN_VERSION.set(float("nan"))
# Seconds buckets from a tiny model's reload to a 32B version's pull and load (65 GB), and up to a generation phase
# of hours at the paper's scale for a task's wait in the queue.
LONG_SECONDS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600)
GEN_RELOAD_SECONDS = Histogram("dapo_generator_reload_seconds", "Weight sync: pull, verify and reload.",
                               buckets=LONG_SECONDS)
GEN_LOAD_PAUSE_SECONDS = Histogram(
    "dapo_generator_load_pause_seconds", "The engine's pause for a version: the load into the model alone.",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
)
GEN_RELOAD_FAILURES = Counter("dapo_generator_reload_failures_total", "Refused or failed weight syncs.", ["reason"])
GEN_QUEUE_WAIT = Histogram(
    "dapo_generator_queue_wait_seconds", "Time a task waited in the prompts stream.",
    buckets=(0.01, 0.05, *LONG_SECONDS, 7200, 14400),
)
GEN_TOKENS_PER_SECOND = Gauge("dapo_generator_tokens_per_second", "Response tokens per second over the last 10 s.")
GEN_TASKS_PER_SECOND = Gauge("dapo_generator_tasks_per_second", "Rollout groups written per second over the last 10 s.")
GEN_SECONDS = Counter(
    "dapo_generator_seconds_total", "Generator wall time by activity: busy (engine), reload (weights), idle.",
    ["activity"]
)
GEN_ENGINE_RESTARTS = Counter("dapo_generator_engine_restarts_total", "Engines recreated after dying.", ["cause"])
GEN_RELEASED = Counter("dapo_generator_released_total", "Claimed tasks handed back unfinished.", ["why"])

# Reward.
REWARD_VERIFICATIONS = Counter("dapo_reward_verifications_total", "Responses verified.", ["rule", "correct"])
REWARD_TIMEOUTS = Counter("dapo_reward_timeouts_total", "Verifications stopped at the time limit.")
REWARD_ERRORS = Counter("dapo_reward_errors_total", "Verifications that crashed.")
REWARD_SECONDS = Histogram("dapo_reward_verify_seconds", "Wall time of one group's verification.")
REWARD_ACCURACY = Gauge("dapo_reward_accuracy", "Share of correct responses in the last scored group.")

# Learner.
LEARNER_STEP = Gauge("dapo_learner_step", "Training steps completed.")
LEARNER_VERSION = Gauge("dapo_learner_policy_version", "Latest published policy version.")
LEARNER_REWARD = Gauge("dapo_learner_reward", "Mean reward of the step's groups.", ["view"])  # all | trained
LEARNER_ACCURACY = Gauge("dapo_learner_accuracy", "Share of correct responses.", ["split"])  # train | eval
LEARNER_INFORMATIVE = Gauge("dapo_learner_informative_ratio", "Informative groups over groups scored.")
LEARNER_REFILLS = Counter("dapo_learner_refills_total", "Refill rounds requested by dynamic sampling.")
LEARNER_REFILL_LIMIT = Counter("dapo_learner_refill_limit_hits_total", "Steps that hit the refill limit.")
STREAM_REPAIRED = Counter(
    "dapo_stream_repaired_total", "Streams made writable again after a client set their last id in the future.",
    ["stream"],
)
STREAM_LETTERS_REFUSED = Counter(
    "dapo_stream_dead_letters_refused_total",
    "Workers' dead letters that retired no task: the entry they name was not parked by its holder, or does not "
    "verify.", ["stream"],
)
LEARNER_TASKS_EXPIRED = Counter(
    "dapo_learner_tasks_expired_total", "Issued tasks given up at their deadline (their group never came back)."
)
LEARNER_STALE = Counter("dapo_learner_stale_dropped_total", "Groups dropped as older than max_staleness.")
LEARNER_UNINFORMATIVE = Counter(
    "dapo_learner_uninformative_dropped_total",
    "Groups dropped by dynamic sampling (all correct or all wrong, Eq. 11).",
)
LEARNER_STALENESS = Gauge("dapo_learner_staleness", "Mean policy lag of the groups trained on.")
LEARNER_ENTROPY = Gauge("dapo_learner_entropy", "Mean token entropy of the policy on the batch.")
LEARNER_RESPONSE_LENGTH = Gauge("dapo_learner_response_length", "Mean response length (tokens).")
LEARNER_CLIP_FRACTION = Gauge("dapo_learner_clip_fraction", "Tokens whose ratio was clipped.", ["side"])  # low|high
LEARNER_KL = Gauge("dapo_learner_approx_kl", "Approximate KL from behaviour to current policy.")
LEARNER_LOG_RATIO_MAX = Gauge(
    "dapo_learner_log_ratio_max", "Largest |log pi - log mu| of a token in the last step (what a KL spike is made of).")
LEARNER_LR = Gauge("dapo_learner_lr", "Learning rate.")
LEARNER_STEP_SECONDS = Gauge("dapo_learner_step_seconds", "Wall time of the last step.")
_progressed_at: float | None = None  # time.monotonic() of the learner's last progress (None: none yet)
_update_started: float | None = None  # the update running (`learner_updating`), and how long the last one took
_last_update_s: float | None = None
UPDATE_ALLOWANCE = 3  # an update is progress up to this many times the last one's time (the first: all of it)


def _seconds_since_progress() -> float:
    now = time.monotonic()
    if _update_started is not None:
        running = now - _update_started
        if _last_update_s is None or running <= UPDATE_ALLOWANCE * _last_update_s:
            return 0.0
        return running  # one this much longer than the last is hung (one rank has no collective timeout)
    return float("nan") if _progressed_at is None else now - _progressed_at


LEARNER_SECONDS_SINCE_PROGRESS = Gauge(
    "dapo_learner_seconds_since_progress", "Seconds since the learner's last progress (its start or resume, a scored "
    "group admitted, a step finished; an update running, up to 3 times the last one's time), on its own clock when "
    "scraped (DapoLearnerStalled: not a difference of the learner's and Prometheus's clocks, which may be minutes "
    "apart); NaN before any.")
LEARNER_SECONDS_SINCE_PROGRESS.set_function(_seconds_since_progress)


def learner_updating(active: bool) -> None:
    """An update starts or ends: it is progress while it runs (the 32B recipe's first update takes 73 minutes,
    past DapoLearnerStalled's floor before any train phase is measured), unless it runs past UPDATE_ALLOWANCE times
    the last one's time."""
    global _update_started, _last_update_s
    now = time.monotonic()
    if not active and _update_started is not None:
        _last_update_s = now - _update_started
    _update_started = now if active else None
    learner_progressed()


def learner_progressed() -> None:
    """The learner made progress (its start or resume, a scored group admitted, a step finished)."""
    global _progressed_at
    _progressed_at = time.monotonic()
LEARNER_STEP_PHASE_SECONDS = Gauge(
    "dapo_learner_step_phase_seconds", "Where the last step's time went (learner/records.py PHASES).", ["phase"]
)
LEARNER_TOKENS_PER_SECOND = Gauge("dapo_learner_tokens_per_second", "Trained tokens per second in the last step.")
LEARNER_MODEL_TFLOPS = Gauge(
    "dapo_learner_model_tflops", "Model TFLOP/s per learner device in the last update (6N per trained token).")
LEARNER_MFU = Gauge(
    "dapo_learner_mfu", "Model FLOPs utilisation of the last update: model TFLOP/s over the device's peak.")
LEARNER_GRAD_NORM = Gauge("dapo_learner_grad_norm", "Gradient norm before clipping.")
