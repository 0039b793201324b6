"""Where the configured model lives, for the services that load it: found, never built here.

`model.name_or_path = "tiny"` is the embedded model that `dapo bootstrap` builds (`cli.bootstrap`) into a cache
folder named by a hash of every setting that shapes it; anything else is a local folder or a hub id resolved
from the local Hugging Face cache (`HF_HUB_OFFLINE` honoured). A model that is not there is a
`ModelNotAvailable` naming it and what to do, raised before a service loads anything heavy.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from services.data import SyntheticTask
from services.startup import Unavailable

if TYPE_CHECKING:  # pragma: no cover
    from services.config import Settings

TINY_NAME = "tiny"
# Bump when the build procedure changes, so stale cached folders are not reused.
BUILD_VERSION = 1
BUILD_INFO = "dapo_tiny.json"  # written last: its presence marks a complete folder


class ModelNotAvailable(Unavailable):
    """The configured model is neither a folder nor in the local Hugging Face cache."""


def model_dir(settings: Settings) -> Path:
    """The folder of the configured model; ModelNotAvailable (saying how to get it) when it is not there."""
    name = settings.model.name_or_path
    if name != TINY_NAME:
        return resolve_pretrained(name)
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
        "tiny": settings.tiny.model_dump(mode="json", exclude={"cache_dir"}),
        "task": asdict(tiny_task(settings)),
        "raw_template": settings.data.raw_template,
    }
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


def tiny_cache_root(settings: Settings) -> Path:
    return Path(settings.tiny.cache_dir or os.environ.get("DAPO_CACHE_DIR") or "~/.cache/dapo").expanduser()


def tiny_model_dir(settings: Settings) -> Path:
    return tiny_cache_root(settings) / f"tiny-{tiny_cache_key(settings)}"
