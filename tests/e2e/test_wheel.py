"""The project as users install it: a wheel (not an editable tree) in a fresh virtual environment.

Offline and quick: the wheel is built without build isolation, installed with `--no-deps`, and the fresh
environment sees this environment's third-party packages through a .pth line (after its own site-packages, so
the project itself can only come from the wheel). Everything runs from a temporary folder without PYTHONPATH.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ["pyproject.toml", "README.md", "services", "generator", "reward", "learner", "cli"]


def run(command: list, cwd: Path, timeout: float = 300) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("DAPO_")}
    done = subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{command}: {done.stdout[-2000:]}{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed; returns its bin folder."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"  # a copy: building writes build/ and *.egg-info next to the sources
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            source.mkdir(exist_ok=True)
            shutil.copy(ROOT / name, source / name)
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp / "dist", source],
        tmp)
    (wheel,) = (tmp / "dist").glob("dapo_services-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "services/configs/tiny-cpu.yaml" in names and "services/configs/ablations/1-grpo.yaml" in names
    venv = tmp / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], tmp)
    run([sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "-q", "--no-deps", "--no-index",
         wheel], tmp)
    purelib = run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp)
    (Path(purelib.strip()) / "dapo_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv / "bin"


def test_the_installed_packages_come_from_the_wheel_and_load_every_preset(installed, tmp_path):
    script = (
        "import cli, services, services.config as c\n"
        "print(services.__file__)\n"
        "names = sorted(str(p.relative_to(c.CONFIG_DIR).with_suffix('')) for p in c.CONFIG_DIR.rglob('*.yaml'))\n"
        "for name in names:\n"
        "    c.load_settings(name)\n"
        "print(len(names))\n"
    )
    location, count = run([installed / "python", "-c", script], tmp_path).split()
    assert Path(location).is_relative_to(installed.parent) and not Path(location).is_relative_to(ROOT)
    assert int(count) == len(list((ROOT / "services" / "configs").rglob("*.yaml"))) >= 9


def test_the_dapo_command_answers(installed, tmp_path):
    from importlib.metadata import version

    assert run([installed / "dapo", "--version"], tmp_path).strip() == f"dapo {version('dapo-services')}"
    assert "--generators" in run([installed / "dapo", "run", "--help"], tmp_path)
