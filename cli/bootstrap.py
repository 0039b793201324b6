"""`dapo bootstrap`: build the embedded tiny model, or find a real Hugging Face model, into the model cache.

`ensure_model(settings)` returns a folder that loads offline with transformers (AutoModelForCausalLM,
AutoTokenizer) and vLLM; services only look it up (`services.models.model_dir`).

* `model.name_or_path = "tiny"`: a char-level tokenizer (built with `tokenizers`, saved as a plain
  PreTrainedTokenizerFast) and a small Qwen2 causal LM, warmed up by supervised training on synthetic
  arithmetic written in the DAPO answer format, until its sampled (temperature 1) accuracy on problems it
  never trained on reaches `tiny.warmup_target_accuracy`: good enough to produce some correct answers, far
  enough from perfect for RL to show. Deterministic from `tiny.seed` on one machine (floats differ between
  CPUs); cached in `services.models.tiny_model_dir`; built under a file lock, so processes starting together
  build it once. With the default settings the model shipped with the package is used instead (the same
  weights on every machine); `--force` rebuilds it here and says whether the rebuild matches it.
* anything else: `services.models.resolve_pretrained`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from services.config import TINY_NAME
from services.data import SyntheticTask, render_prompt
from services.models import (
    BUILD_INFO,
    BUILD_VERSION,
    resolve_pretrained,
    shipped_tiny_applies,
    tiny_cache_key,
    tiny_model_dir,
    tiny_task,
    verified_shipped_tiny,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from services.config import Settings

log = logging.getLogger(__name__)

PAD, UNK, EOS = "<pad>", "<unk>", "<eos>"
SPECIAL_TOKENS = (PAD, UNK, EOS)
# Longest response the tiny model is asked to write while it is validated (answers need ~15-35 chars).
VALIDATION_MAX_NEW_TOKENS = 64


# ---------------------------------------------------------------------------------------------------------------
# Entry points.


def ensure_model(settings: Settings, *, progress: bool = True) -> Path:
    """The folder of the configured model, building the tiny model first if it is not cached yet."""
    name = settings.model.name_or_path
    if name == TINY_NAME:
        return ensure_tiny_model(settings, progress=progress)
    return resolve_pretrained(name)


def main(settings: Settings, *, force: bool = False, measure: bool = False) -> int:
    """`dapo bootstrap`: make sure the model exists, print where and what it is (the folder on stdout, the
    summary on stderr); optionally measure it through vLLM. Returns the exit code."""
    from rich.console import Console

    console = Console(stderr=True)
    if settings.model.name_or_path == TINY_NAME:
        path = ensure_tiny_model(settings, force=force)
        console.print(f"[bold]tiny model[/bold] {path}\n{describe_tiny(path)}")
        if force and shipped_tiny_applies(settings):
            shipped = verified_shipped_tiny()
            same = (shipped / "model.safetensors").read_bytes() == (path / "model.safetensors").read_bytes()
            console.print(
                f"shipped model {shipped}\n{describe_tiny(shipped)}\n"
                + ("  the rebuild is byte-identical to it" if same else
                   "  the rebuild differs from it (float results differ between CPUs); runs keep using the "
                   "shipped one: set tiny.shipped=false to use this build")
            )
    else:
        path = resolve_pretrained(settings.model.name_or_path)
        console.print(f"[bold]model[/bold] {settings.model.name_or_path} -> {path}")
    if measure:
        from cli.measure import measure_with_vllm

        report = measure_with_vllm(path, settings)
        console.print_json(data=report)
    print(path)
    return 0


def describe_tiny(path: Path) -> str:
    info = json.loads((path / BUILD_INFO).read_text())
    warm = info["warmup"]
    return (f"  {info['parameters']:,} parameters, vocabulary {info['vocab_size']}\n"
            f"  warm-up: {warm['steps']} steps in {warm['seconds']:.0f} s, loss {warm['final_loss']:.3f}, "
            f"sampled accuracy {warm['validation_accuracy']:.1%} on {warm['validation_problems']} unseen problems")


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_tiny_model(settings: Settings, *, force: bool = False, progress: bool = True) -> Path:
    """The shipped tiny model when it is the one the settings describe, else the cached folder, built (once,
    under a lock) when missing. `force` rebuilds into the cache whichever applies."""
    if not force and shipped_tiny_applies(settings):
        return verified_shipped_tiny()
    target = tiny_model_dir(settings)
    if not force and (target / BUILD_INFO).is_file():
        return target
    with _file_lock(target.with_name(target.name + ".lock")):
        if not force and (target / BUILD_INFO).is_file():
            return target  # another process built it while we waited
        staging = target.with_name(f".{target.name}.building-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        try:
            build_tiny_model(settings, staging, progress=progress)
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)  # atomic: readers see no folder or a complete one
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


# ---------------------------------------------------------------------------------------------------------------
# The tiny model: tokenizer and architecture.


def tiny_alphabet(settings: Settings) -> str:
    """Every character of the task and of the raw prompt template, each once, in a stable order."""
    template_text = settings.data.raw_template.replace("{problem}", "")
    return "".join(sorted(set(tiny_task(settings).alphabet + template_text)))


def build_tokenizer(alphabet: str):
    """A char-level tokenizer: the special tokens, then one token per character of `alphabet`.

    Built with `tokenizers` as a byte-level BPE without merges, i.e. the pipeline of Qwen2's own tokenizer
    restricted to single characters. That matters: transformers 5 loads any tokenizer of a `qwen2` model as
    Qwen2Tokenizer (whatever tokenizer_config.json says), rebuilding it from vocab and merges with
    byte-level pre-tokenization; a vocabulary of raw characters would then silently lose spaces and
    newlines. With byte-level symbols (space = "Ġ", newline = "Ċ") every loader, Qwen2Tokenizer,
    PreTrainedTokenizerFast or vLLM's, encodes and decodes the same way.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    symbols = []
    for ch in alphabet:
        if len(ch.encode()) != 1:
            raise ValueError(f"tiny tokenizer alphabet must be ASCII, got {ch!r}")
        symbols.append(byte_level.pre_tokenize_str(ch)[0][0])
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *symbols])}
    core = Tokenizer(
        models.BPE(vocab=vocab, merges=[], unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
                   fuse_unk=False, byte_fallback=False)
    )
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = byte_level
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        unk_token=UNK,
        eos_token=EOS,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tokenizer, folder: Path, max_length: int) -> None:
    tokenizer.model_max_length = max_length
    tokenizer.save_pretrained(folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def tiny_model_config(settings: Settings, tokenizer):
    from transformers import Qwen2Config

    t = settings.tiny
    return Qwen2Config(
        # Exactly the tokenizer's size: an engine sampling at temperature 1 can then only draw real tokens.
        vocab_size=len(tokenizer),
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_layers,
        num_attention_heads=t.num_heads,
        num_key_value_heads=t.num_kv_heads,
        max_position_embeddings=t.max_position,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


# ---------------------------------------------------------------------------------------------------------------
# The tiny model: warm-up.


@dataclass
class WarmupResult:
    steps: int = 0
    seconds: float = 0.0
    final_loss: float = float("nan")
    validation_accuracy: float = 0.0
    validation_problems: int = 0
    reached_target: bool = False
    history: list[dict[str, float]] = field(default_factory=list)


def encode_examples(tokenizer, prompts: Sequence[str], responses: Sequence[str]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids + EOS) per example; char-level, so no merge crosses the boundary."""
    prompt_ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(list(responses), add_special_tokens=False)["input_ids"]
    return [(p, r + [tokenizer.eos_token_id]) for p, r in zip(prompt_ids, response_ids)]


def collate(examples: Sequence[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch; the loss covers the response tokens only."""
    import torch

    length = max(len(p) + len(r) for p, r in examples)
    input_ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), length), -100, dtype=torch.long)
    attention = torch.zeros((len(examples), length), dtype=torch.long)
    for row, (p, r) in enumerate(examples):
        ids = p + r
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, len(p) : len(ids)] = torch.tensor(r)
        attention[row, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


def sample_responses(
    model,
    prompts: Sequence[list[int]],
    *,
    eos_id: int,
    pad_id: int,
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator,
) -> list[list[int]]:
    """Plain ancestral sampling with a KV cache (temperature 0 = greedy); responses end at and include EOS."""
    import torch

    batch = len(prompts)
    width = max(len(p) for p in prompts)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, width), dtype=torch.long)
    for row, p in enumerate(prompts):  # left padding: every prompt ends at the same column
        input_ids[row, width - len(p) :] = torch.tensor(p)
        attention[row, width - len(p) :] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    responses: list[list[int]] = [[] for _ in range(batch)]
    done = torch.zeros(batch, dtype=torch.bool)
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True)
        for _ in range(max_new_tokens):
            logits = out.logits[:, -1, :].float()
            if temperature > 0:
                probs = torch.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            else:
                nxt = logits.argmax(-1)
            for row in torch.nonzero(~done).flatten().tolist():
                responses[row].append(int(nxt[row]))
            done |= nxt == eos_id
            if bool(done.all()):
                break
            attention = torch.cat([attention, torch.ones((batch, 1), dtype=torch.long)], dim=1)
            positions = positions[:, -1:] + 1
            out = model(
                input_ids=nxt[:, None],
                attention_mask=attention,
                position_ids=positions,
                past_key_values=out.past_key_values,
                use_cache=True,
            )
    return responses


def sampled_accuracy(model, tokenizer, task: SyntheticTask, problems, settings: Settings, *, seed: int) -> float:
    """Share of problems answered exactly right by one temperature-1 sample each (batches of 128)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    template = settings.data.raw_template
    correct = 0
    model.eval()
    for start in range(0, len(problems), 128):
        chunk = problems[start : start + 128]
        prompts = tokenizer(
            [render_prompt(p, tokenizer, "raw", template) for p in chunk], add_special_tokens=False
        )["input_ids"]
        outs = sample_responses(
            model,
            prompts,
            eos_id=tokenizer.eos_token_id,
            pad_id=tokenizer.pad_token_id,
            max_new_tokens=VALIDATION_MAX_NEW_TOKENS,
            temperature=1.0,
            generator=generator,
        )
        for p, ids in zip(chunk, outs):
            correct += task.is_correct(tokenizer.decode(ids, skip_special_tokens=True), p.answer)
    model.train()
    return correct / max(1, len(problems))


def _learning_rate(step: int, total: int, peak: float) -> float:
    """Linear warm-up over 5 % of the steps, then cosine decay to a tenth of the peak."""
    warm = max(1, total // 20)
    if step < warm:
        return peak * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def warm_up(model, tokenizer, settings: Settings, *, progress: bool = True) -> WarmupResult:
    """Supervised training on worked train-split solutions until the target sampled accuracy is reached.

    Validation uses train-split problems held back from this warm-up (never the eval split, which stays
    untouched for measuring the model), so the number is an honest estimate of held-out accuracy.
    """
    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    t = settings.tiny
    task = tiny_task(settings)
    pool = task.problems("train", None, seed=t.seed)  # every train-split problem, seeded order
    validation, training = pool[: t.warmup_eval_problems], pool[t.warmup_eval_problems :]
    if not training:
        raise ValueError("the synthetic train split is too small for the warm-up; raise synthetic_max_value")
    template = settings.data.raw_template
    prompts = [render_prompt(p, tokenizer, "raw", template) for p in training]
    rng = random.Random(t.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.warmup_lr, weight_decay=0.01, betas=(0.9, 0.98))
    result = WarmupResult(validation_problems=len(validation))
    started = time.perf_counter()
    columns = (
        TextColumn("[bold]warm-up"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("loss {task.fields[loss]:.3f}  acc@T1 {task.fields[acc]:.1%}"),
    )
    model.train()
    with Progress(*columns, disable=not progress, transient=False) as bar:
        job = bar.add_task("warm-up", total=t.warmup_steps, loss=float("nan"), acc=0.0)
        for step in range(t.warmup_steps):
            for group in optimizer.param_groups:
                group["lr"] = _learning_rate(step, t.warmup_steps, t.warmup_lr)
            # Fresh slips every time a problem is drawn: the model learns the slip rate, not particular slips.
            chosen = rng.sample(range(len(training)), min(t.warmup_batch, len(training)))
            examples = encode_examples(
                tokenizer,
                [prompts[i] for i in chosen],
                [task.solution(training[i].problem, t.warmup_slip_rate, rng) for i in chosen],
            )
            batch = collate(examples, tokenizer.pad_token_id)
            loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            result.steps = step + 1
            result.final_loss = loss.item()
            bar.update(job, advance=1, loss=result.final_loss)
            if result.steps % t.warmup_eval_every == 0 or result.steps == t.warmup_steps:
                acc = sampled_accuracy(model, tokenizer, task, validation, settings, seed=t.seed + result.steps)
                result.validation_accuracy = acc
                result.history.append(
                    {"step": result.steps, "loss": result.final_loss, "accuracy": acc,
                     "seconds": round(time.perf_counter() - started, 1)}
                )
                bar.update(job, acc=acc)
                log.info("warm-up step %d: %s", result.steps, result.history[-1])
                if acc >= t.warmup_target_accuracy:
                    result.reached_target = True
                    break
    result.seconds = time.perf_counter() - started
    model.eval()
    return result


@contextlib.contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build_tiny_model(settings: Settings, folder: Path, *, progress: bool = True) -> dict[str, Any]:
    """Build tokenizer + Qwen2 + warm-up into `folder` (deterministic from tiny.seed); returns the build info."""
    import tokenizers
    import torch
    import transformers
    from transformers import GenerationConfig, Qwen2ForCausalLM

    t = settings.tiny
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(tiny_alphabet(settings))
    save_tokenizer(tokenizer, folder, t.max_position)
    config = tiny_model_config(settings, tokenizer)
    with _torch_threads(t.threads):
        torch.manual_seed(t.seed)
        model = Qwen2ForCausalLM(config)
        result = warm_up(model, tokenizer, settings, progress=progress)
    model.save_pretrained(folder, safe_serialization=True)
    GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    ).save_pretrained(folder)
    info = {
        "name": TINY_NAME,
        "cache_key": tiny_cache_key(settings),
        "build_version": BUILD_VERSION,
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
        "task": asdict(tiny_task(settings)),
        "raw_template": settings.data.raw_template,
        "tiny": settings.tiny.model_dump(mode="json", exclude={"cache_dir"}),
        "warmup": asdict(result),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__},
        "built": {"pid": os.getpid(), "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
    }
    (folder / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
    log.info("built tiny model in %s: %s", folder, info["warmup"])
    return info
