"""Runs inside vLLM's worker processes (engine arg `worker_extension_cls`): in-place weight reload that is correct.

vLLM's own `reload_weights` loads every checkpoint tensor and re-runs each layer's post-load processing, but a
layer that receives no tensor keeps its old processed state. On CPU, linear layers run on a packed copy of
their weight made at load time (`layer.cpu_linear`); a tied `lm_head` (Qwen2 with `tie_word_embeddings`)
gets no tensor of its own (the checkpoint's `lm_head.weight` is skipped for tied models), so its shared
weight is updated but its packed copy is not: the engine would compute logits with the OLD output
embedding, silently (measured: logprobs off by ~5 nats on the tiny model). After the reload we therefore
repack every layer that still holds its weight (embedding and LM head; projection layers drop theirs after
packing and were reloaded correctly). On GPU there is no packed copy and nothing to refresh.

Imported in vLLM's engine process, this module also makes that process die with the generator that started
it (`exit_with_parent`): a SIGKILLed generator would otherwise leave its engine core running under PID 1,
holding its memory. (Not `prctl(PR_SET_PDEATHSIG)`: it fires when the *thread* that started the process
exits, and a generator may restart its engine from a worker thread.)
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

PARENT_POLL_S = 1.0  # how soon an orphaned engine process notices and exits


def exit_with_parent(poll_s: float = PARENT_POLL_S) -> threading.Thread:
    """A daemon thread that SIGKILLs this process once its parent is gone (it is re-parented)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="exit-with-parent", daemon=True)
    thread.start()
    return thread


def refresh_cpu_packed_weights(model) -> list[str]:
    """Re-derive the packed CPU GEMM weights from the current (shared) weights; the names refreshed."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    refreshed = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and weight is not None and weight.ndim == 2 and weight.numel() > 0:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            refreshed.append(name)
    return refreshed


class WeightReloadExtension:
    """Mixed into vLLM's worker class; called through `LLM.collective_rpc("reload_weights_from", ...)`."""

    def reload_weights_from(self, weights_path: str) -> dict:
        from vllm.platforms import current_platform

        started = time.perf_counter()
        self.reload_weights(weights_path=weights_path)
        refreshed = []
        if current_platform.is_cpu():
            refreshed = refresh_cpu_packed_weights(self.model_runner.get_model())
        return {"seconds": time.perf_counter() - started, "repacked": refreshed}


if multiprocessing.parent_process() is not None:  # imported in vLLM's engine process, not in the generator
    exit_with_parent()
