"""The vLLM records a healthy generator drops, and the ones it keeps (generator/vllm_logs.py)."""

from __future__ import annotations

import logging
import sys

import pytest

from generator.vllm_logs import RELOAD_LOGGER, WARMUP_LOGGER, quiet_expected_vllm_records


def emit(logger: str, message: str, *args, error: Exception | None = None) -> list[logging.LogRecord]:
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record)

    handler = Keep()
    log = logging.getLogger(logger)
    log.addHandler(handler)
    try:
        if error is None:
            log.warning(message, *args)
        else:
            try:
                raise error
            except type(error):
                log.warning(message, exc_info=sys.exc_info())
    finally:
        log.removeHandler(handler)
    return seen


@pytest.fixture(autouse=True)
def no_filters():
    yield
    for name in (WARMUP_LOGGER, RELOAD_LOGGER):
        logging.getLogger(name).filters.clear()


def test_the_tokenizer_less_warmup_traceback_is_dropped_and_other_failures_kept():
    quiet_expected_vllm_records(tied_lm_head=True)
    skipped = ValueError("Tokenizer not available when `skip_tokenizer_init=True`")
    assert emit(WARMUP_LOGGER, "Chat template warmup failed", error=skipped) == []
    assert len(emit(WARMUP_LOGGER, "Chat template warmup failed", error=RuntimeError("jinja broke"))) == 1


def test_reload_warnings_dropped_only_for_layers_without_weights_of_their_own():
    quiet_expected_vllm_records(tied_lm_head=True)
    quiet_expected_vllm_records(tied_lm_head=True)  # installed twice (an engine restart): still one filter
    assert len(logging.getLogger(RELOAD_LOGGER).filters) == 1
    for layer in ("RotaryEmbedding", "YaRNScalingRotaryEmbedding", "ParallelLMHead"):
        assert emit(RELOAD_LOGGER, "%s: Failed to load weights", layer) == [], layer
    assert len(emit(RELOAD_LOGGER, "%s: Failed to load weights", "QKVParallelLinear")) == 1
    quiet_expected_vllm_records(tied_lm_head=False)  # an untied head must be in the checkpoint: say so if not
    assert len(emit(RELOAD_LOGGER, "%s: Failed to load weights", "ParallelLMHead")) == 1
