"""`dapo bootstrap --measure`: a built model's tokens/s and held-out accuracy through vLLM at temperature 1."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.data import load_problems, render_prompt
from services.models import tiny_task

if TYPE_CHECKING:  # pragma: no cover
    from services.config import Settings


def measure_with_vllm(
    path: Path, settings: Settings, *, problems: int = 300, samples: int = 4, max_tokens: int = 64, repeats: int = 2
) -> dict[str, Any]:
    """Sample `samples` responses for each of `problems` held-out synthetic problems at temperature 1, `repeats`
    times: accuracy over every sample, tokens/s of each pass (the CPU is shared, so passes differ)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(settings.generator.kv_cache_gib))))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    task = tiny_task(settings)
    held_out = load_problems("synthetic-eval", settings)[:problems]
    tokenizer = AutoTokenizer.from_pretrained(path)
    template, raw = settings.data.prompt_template, settings.data.raw_template
    prompts = [
        {"prompt_token_ids": tokenizer(render_prompt(p, tokenizer, template, raw),
                                       add_special_tokens=False)["input_ids"]}
        for p in held_out
    ]
    started = time.perf_counter()
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, enforce_eager=True, seed=settings.tiny.seed)
    load_seconds = time.perf_counter() - started
    # No per-request seed: vLLM 0.32 on CPU crashes ("CPU Generator does not use offset") when a seeded
    # request's prefill is chunked; the engine seed already makes the run reproducible.
    params = SamplingParams(n=samples, temperature=1.0, top_p=1.0, max_tokens=max_tokens, logprobs=0)
    llm.generate(prompts[:8], params, use_tqdm=False)  # the first call pays one-off setup costs
    correct = total = tokens = 0
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        completions = [(c, p) for out, p in zip(outputs, held_out) for c in out.outputs]
        generated = sum(len(c.token_ids) for c, _ in completions)
        rates.append(round(generated / seconds))
        tokens += generated
        total += len(completions)
        correct += sum(task.is_correct(c.text, p.answer) for c, p in completions)
    return {
        "model": str(path),
        "problems": len(held_out),
        "samples": total,
        "accuracy_t1": round(correct / total, 4),
        "mean_response_tokens": round(tokens / total, 2),
        "tokens_per_s": rates,
        "engine_load_seconds": round(load_seconds, 1),
        "load_average_1min": os.getloadavg()[0],
    }
