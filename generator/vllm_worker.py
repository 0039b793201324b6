"""Runs inside vLLM's worker processes (engine arg `worker_extension_cls`): in-place weight reload that is correct.

vLLM's own `reload_weights` loads every checkpoint tensor and re-runs each layer's post-load processing, but a
layer that receives no tensor keeps its old processed state. On CPU, linear layers run on a packed copy of
their weight made at load time (`layer.cpu_linear`); a tied `lm_head` (Qwen2 with `tie_word_embeddings`)
gets no tensor of its own (the checkpoint's `lm_head.weight` is skipped for tied models), so its shared
weight is updated but its packed copy is not: the engine would compute logits with the OLD output
embedding, silently (measured: logprobs off by ~5 nats on the tiny model). After the reload we therefore
repack every layer that still holds its weight (embedding and LM head; projection layers drop theirs after
packing and were reloaded correctly). On GPU there is no packed copy and nothing to refresh.

Imported in vLLM's worker process, this module also makes the engine's processes die with the generator that
started them (`exit_with_owner`): a SIGKILLed generator would otherwise leave its `VLLM::EngineCore` running
under PID 1, holding its memory. (Not `prctl(PR_SET_PDEATHSIG)`: it would have to be set inside the engine core,
which runs none of our code, and it fires when the *thread* that started a process exits.)
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

OWNER_POLL_S = 1.0  # how soon orphaned engine processes notice and exit


def _stat(pid: int) -> tuple[str, int]:
    """(command name, parent pid) of a process; FileNotFoundError once it is gone."""
    text = open(f"/proc/{pid}/stat").read()
    return text[text.index("(") + 1 : text.rindex(")")], int(text[text.rindex(")") + 2 :].split()[1])


def engine_chain(pid: int) -> tuple[list[int], int]:
    """`pid` and its vLLM ancestors (process titles `VLLM::...`: the engine core, when the worker is a process
    of its own), and the pid of the process that started them (the generator)."""
    chain = [pid]
    owner = _stat(pid)[1]
    while (stat := _stat(owner))[0].startswith("VLLM::"):
        chain.append(owner)
        owner = stat[1]
    return chain, owner


def exit_with_owner(poll_s: float = OWNER_POLL_S) -> threading.Thread:
    """A daemon thread that SIGKILLs this process and its vLLM ancestors once the generator that started them is
    gone (the topmost engine process is re-parented)."""
    chain, owner = engine_chain(os.getpid())

    def owned() -> bool:
        try:
            return _stat(chain[-1])[1] == owner
        except FileNotFoundError:
            return False

    def watch() -> None:
        while owned():
            time.sleep(poll_s)
        for pid in reversed(chain):  # the engine core first, this process last
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    thread = threading.Thread(target=watch, name="exit-with-owner", daemon=True)
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
    """Mixed into vLLM's worker class; called through `LLM.collective_rpc(...)`: reload from a folder, or take a
    broadcast round (services/broadcast.py) in a thread of its own while the engine goes on generating, then load
    what it staged when the generator says so."""

    def reload_weights_from(self, weights_path: str) -> dict:
        return self._reload(weights_path=weights_path)

    def _reload(self, **source) -> dict:
        from vllm.platforms import current_platform

        from generator.vllm_logs import quiet_expected_vllm_records

        # In this process: the engine's worker may be one of its own (generator.in_process_engine false).
        quiet_expected_vllm_records(tied_lm_head=self.model_config.hf_config.tie_word_embeddings)
        started = time.perf_counter()
        self.reload_weights(**source)
        refreshed = []
        if current_platform.is_cpu():
            refreshed = refresh_cpu_packed_weights(self.model_runner.get_model())
        return {"seconds": time.perf_counter() - started, "repacked": refreshed}

    def begin_receive(self, announcement_json: str, host: str, member: str) -> None:
        """Take the round as this worker of generator `member`'s engine and stage its buckets, in the background."""
        from services.broadcast import receive
        from services.messages import WeightsBroadcast

        announcement = WeightsBroadcast.model_validate_json(announcement_json)
        device = f"cuda:{self.local_rank}" if announcement.backend == "nccl" else "cpu"
        self._round = (announcement, None, None)

        def run() -> None:
            try:
                self._round = (announcement, receive(announcement, host, member, self.rank, device), None)
            except Exception as err:  # reported to the generator by `receive_status`
                self._round = (announcement, None, f"{type(err).__name__}: {err}")

        self._receiving = threading.Thread(target=run, name="weights-broadcast", daemon=True)
        self._receiving.start()

    def receive_status(self) -> dict | None:
        """None while the round runs; then the error, or the digests this worker computed and the commit."""
        if getattr(self, "_receiving", None) is None or self._receiving.is_alive():
            return None
        _, receipt, error = self._round
        if error is not None:
            return {"error": error}
        return {"digests": {str(i): hexdigest for i, hexdigest in receipt.digests.items()},
                "commit": receipt.commit, "seconds": receipt.seconds}

    def load_staged(self) -> dict:
        """Load the staged round into the model (the only pause of the engine), then free it."""
        from services.broadcast import unpack

        announcement, receipt, _ = self._round
        named = [pair for slots, bucket in zip(announcement.buckets, receipt.buckets) for pair in unpack(bucket, slots)]
        try:
            return self._reload(weights_iterator=iter(named))
        finally:
            self.drop_staged()

    def drop_staged(self) -> None:
        self._round, self._receiving = (None, None, None), None


if multiprocessing.parent_process() is not None:  # imported in vLLM's worker process, not in the generator
    exit_with_owner()
