"""vLLM log records that every healthy generator produces, and that mean nothing is wrong here: dropped, each for
the reason written below, so that what is left in a generator's log is worth reading. Everything else vLLM logs
passes through untouched, warnings of the same kind about other layers included.
"""

from __future__ import annotations

import logging

# The engine runs with skip_tokenizer_init (the service tokenizes prompts itself: generator/engine.py), and vLLM
# 0.32 still warms up a chat template at start, which needs the tokenizer it was told not to load; it logs the
# ValueError with a traceback and goes on.
WARMUP_LOGGER, WARMUP_MESSAGE = "vllm.renderers.base", "Chat template warmup failed"
# A reload of published weights: a layer that has no tensor in the checkpoint keeps the tensors it had. That is
# right for the rotary embedding (its cos/sin cache is computed, never saved) and for a tied LM head (it is the
# embedding, which was loaded; the publisher leaves `lm_head.weight` out of tied models, services/weights.py).
RELOAD_LOGGER, RELOAD_MESSAGE = "vllm.model_executor.model_loader.reload.layerwise", ": Failed to load weights"


class ExpectedVllmRecords(logging.Filter):
    """Drops the records above; `tied_lm_head`: whether the model ties its LM head to the embedding."""

    def __init__(self, tied_lm_head: bool) -> None:
        super().__init__()
        self.tied_lm_head = tied_lm_head

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message == WARMUP_MESSAGE:
            error = record.exc_info[1] if record.exc_info else None
            return not (isinstance(error, ValueError) and "skip_tokenizer_init" in str(error))
        if message.endswith(RELOAD_MESSAGE):
            layer = message[: -len(RELOAD_MESSAGE)]
            return not (layer.endswith("RotaryEmbedding") or (self.tied_lm_head and layer.endswith("LMHead")))
        return True


def quiet_expected_vllm_records(tied_lm_head: bool) -> None:
    """Install the filter on the two vLLM loggers concerned (once per process: a restart adds nothing)."""
    for name in (WARMUP_LOGGER, RELOAD_LOGGER):
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, ExpectedVllmRecords)]:
            logger.removeFilter(old)
        logger.addFilter(ExpectedVllmRecords(tied_lm_head))
