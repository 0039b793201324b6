"""Where the configured model lives, for the services that load it: found, never built here.

`model.name_or_path = "tiny"` is the embedded model. With the default settings it is the one shipped with the
package (`services/tiny_model/`, checked against its sha256 before first use), so every machine starts from the
same weights; with other settings (or `tiny.shipped: false`) it is the one `dapo bootstrap` builds
(`cli.bootstrap`) into a cache folder named by a hash of every setting that shapes it. Anything else is a local
folder or a hub id resolved from the local Hugging Face cache (`HF_HUB_OFFLINE` honoured). A model that is not there
is a `ModelNotAvailable` naming it and what to do, raised before a service loads anything heavy.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from services.config import TINY_NAME
from services.data import SyntheticTask
from services.errors import Unavailable

if TYPE_CHECKING:  # pragma: no cover
    from services.config import Settings

# Bump when the build procedure changes, so stale cached folders are not reused.
BUILD_VERSION = 1
BUILD_INFO = "dapo_tiny.json"  # written last: its presence marks a complete folder


# The warmed-up tiny model shipped with the package (the base of the README's learning figures), and the sha256 of
# each of its files: a partial checkout, a Git LFS pointer or an edited file is refused, never trained from.
# Re-ship with `dapo bootstrap --force`, copying the built folder here and updating these digests.
SHIPPED_TINY_DIR = Path(__file__).resolve().with_name("tiny_model")
SHIPPED_TINY_SHA256 = {
    "config.json": "46ae0914ab44ab0d17a5e30e3eaaa085a31ab1217c07b3c826258260de0e8281",
    "dapo_tiny.json": "876d452844ed4172921ec705b260030b7571609c6a4632c0b5ab7b4c35b0968a",
    "generation_config.json": "af6491f6c99225b00ce50606a7a66dfcb17122a3c675768e13d14df515fa54f0",
    "model.safetensors": "b02c695754585c33d83e79132482d4457ff21552cce969593d65f8d098381d5b",
    "tokenizer.json": "18dd27122c3d570fad0550ad1a9cb45d2f4abfeac96da7c4e696c1be6b372779",
    "tokenizer_config.json": "bf803b9fd08e328a2c8f1d345366d4a1588daa0b885e89bc15d85a37fa13ec5a",
}
# The learning curves measured from the shipped model (benchmarks/learning.py), which a run's summary is held to.
SHIPPED_TINY_REFERENCE = SHIPPED_TINY_DIR / "reference.json"


class ModelNotAvailable(Unavailable):
    """The configured model is neither a folder nor in the local Hugging Face cache."""


def model_dir(settings: Settings) -> Path:
    """The folder of the configured model; ModelNotAvailable (saying how to get it) when it is not there."""
    name = settings.model.name_or_path
    if name != TINY_NAME:
        return resolve_pretrained(name)
    if shipped_tiny_applies(settings):
        return verified_shipped_tiny()
    folder = tiny_model_dir(settings)
    if not (folder / BUILD_INFO).is_file():
        raise ModelNotAvailable(f"the tiny model is not built yet (looked in {folder}); run `dapo bootstrap` "
                                "with the same config first")
    return folder


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def hf_cache_dir() -> Path:
    """The hub cache, read from the environment at call time (HF_HUB_CACHE, else HF_HOME/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = Path(os.environ.get("HF_HOME", "~/.cache/huggingface")).expanduser()
    return home / "hub"


def resolve_pretrained(name_or_path: str) -> Path:
    """A local model folder, or the snapshot folder of a hub id (from the cache only when HF_HUB_OFFLINE=1)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotAvailable(f"model folder {path} has no config.json, so it is not a Hugging Face model")
        return path
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
        raise ModelNotAvailable(f"model folder {name_or_path!r} does not exist; point model.name_or_path "
                                "(DAPO_MODEL__NAME_OR_PATH, --set model.name_or_path=...) at a model folder or hub id")
    from huggingface_hub import snapshot_download

    offline = _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")
    cache = hf_cache_dir()
    try:
        folder = snapshot_download(
            name_or_path,
            cache_dir=str(cache),
            local_files_only=offline,
            allow_patterns=None if offline else ["*.json", "*.safetensors", "*.txt", "*.model", "*.py", "*.jinja"],
        )
    except Exception as err:  # the hub raises several types; all mean "not usable here"
        how = (
            "it is not in the local Hugging Face cache and HF_HUB_OFFLINE is set"
            if offline
            else "it is not in the local Hugging Face cache and could not be downloaded"
        )
        raise ModelNotAvailable(
            f"model {name_or_path!r} is not available offline: {how} (cache: {cache}). Download it on a "
            f"connected machine (`huggingface-cli download {name_or_path}`) into that cache, or set "
            f"model.name_or_path to a local folder. ({type(err).__name__}: {err})"
        ) from None
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ModelNotAvailable(f"model {name_or_path!r}: cached snapshot {folder} has no config.json")
    return folder


def tiny_task(settings: Settings) -> SyntheticTask:
    return SyntheticTask.from_settings(settings)


def tiny_cache_key(settings: Settings) -> str:
    """Hash of every setting that shapes the built folder (where it is cached does not)."""
    shape = {
        "build_version": BUILD_VERSION,
        "tiny": settings.tiny.model_dump(mode="json", exclude={"cache_dir", "shipped"}),
        "task": asdict(tiny_task(settings)),
        "raw_template": settings.data.raw_template,
    }
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


def tiny_cache_root(settings: Settings) -> Path:
    return Path(settings.tiny.cache_dir or os.environ.get("DAPO_CACHE_DIR") or "~/.cache/dapo").expanduser()


def tiny_model_dir(settings: Settings) -> Path:
    """Where `dapo bootstrap` builds (and caches) the tiny model these settings describe."""
    return tiny_cache_root(settings) / f"tiny-{tiny_cache_key(settings)}"


def shipped_tiny_key() -> str:
    return json.loads((SHIPPED_TINY_DIR / BUILD_INFO).read_text())["cache_key"]


def shipped_tiny_applies(settings: Settings) -> bool:
    """Whether the shipped model is the one these settings describe (every setting that shapes it as shipped)."""
    return (settings.model.name_or_path == TINY_NAME and settings.tiny.shipped
            and tiny_cache_key(settings) == shipped_tiny_key())


@functools.cache
def verified_shipped_tiny() -> Path:
    """The shipped folder, once each file's sha256 matched (checked once per process: 2 MB)."""
    for name, expected in SHIPPED_TINY_SHA256.items():
        path = SHIPPED_TINY_DIR / name
        actual = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "missing"
        if actual != expected:
            raise ModelNotAvailable(
                f"the shipped tiny model's {path} does not match its sha256 ({actual[:16]} against "
                f"{expected[:16]}): a partial checkout or a Git LFS pointer? Reinstall the package, or set "
                "tiny.shipped=false to build one on this machine with `dapo bootstrap`"
            )
    return SHIPPED_TINY_DIR


def safe_decode(tokenizer, token_ids: list[int]) -> str:
    """Text of sampled ids; ids outside the tokenizer's vocabulary are dropped, never an exception. A sample's
    text is this, and nothing else: the generator writes it so, and the learner checks it (the reward is the
    text's, the update the tokens')."""
    size = len(tokenizer)
    known = [int(t) for t in token_ids if 0 <= int(t) < size]
    try:
        return tokenizer.decode(known, skip_special_tokens=True)
    except Exception:  # a tokenizer that cannot decode some sequence: fall back to piece by piece
        pieces = []
        for token in known:
            try:
                pieces.append(tokenizer.decode([token], skip_special_tokens=True))
            except Exception:
                pieces.append("\ufffd")
        return "".join(pieces)
