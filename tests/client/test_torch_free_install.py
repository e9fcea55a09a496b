"""The client installs and runs without torch: the package with no extras goes into a fresh virtual environment (no
system site-packages), `import torch` fails there, importing the client loads nothing of the server, engine or
model, and that environment's `qasr-mic --file` streams to a server running from the test's own environment on the
tiny model.

Needs the package index, as .ci/run does (the venv installs numpy, websockets, msgpack, soundfile and soxr); the
pip cache makes reruns quick. Deselect with `-m "not client_install"`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import numpy as np
import pytest
import soundfile

from qasr.bench.synthetic import speech_like

# tests/ is on sys.path (tests/conftest.py)
from live_server import REPO, ThreadedServer, real_engine

pytestmark = [pytest.mark.client_install, pytest.mark.timeout(180)]

SERVER_SIDE = ("torch", "tokenizers", "safetensors", "webrtcvad", "qasr.server", "qasr.engine", "qasr.model")
LOADED_BY_THE_CLIENT = f"""
import json, sys
import qasr.client, qasr.client.mic, qasr.bench.stream
print(json.dumps(sorted(m for m in sys.modules if m.startswith({SERVER_SIDE!r}))))
"""


def copy_sources(destination: Path) -> Path:
    """What a `pip install .` of a clean checkout reads: pyproject.toml, README.md and the package folders."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    folders = set(config["tool"]["setuptools"]["package-dir"].values())
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, destination / name)
    for folder in folders:
        shutil.copytree(REPO / folder, destination / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    return destination


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory) -> Path:
    """A fresh venv holding the package with no extras: its bin/ folder. The wheel is built here (no build
    isolation: this environment has setuptools); the venv gets no pip of its own, this environment's pip installs
    into it (`pip --python`), which saves ensurepip's ~15 s."""
    root = tmp_path_factory.mktemp("client-install")
    (root / "src").mkdir()
    source = copy_sources(root / "src")
    pip = [sys.executable, "-m", "pip"]
    built = subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(root / "wheel"),
                            str(source)], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stdout + built.stderr
    env_dir = root / "venv"
    venv.create(env_dir, with_pip=False, system_site_packages=False, clear=True)
    wheel, = (root / "wheel").glob("qasr-*.whl")
    installed = subprocess.run([*pip, "--python", str(env_dir / "bin" / "python"), "install", "-q", str(wheel)],
                               env=clean_env(), capture_output=True, text=True, timeout=150)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return env_dir / "bin"


def clean_env() -> dict[str, str]:
    """This process's environment without what would let the venv see our packages."""
    return {key: value for key, value in os.environ.items()
            if key not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def test_the_base_install_has_no_torch_and_the_client_loads_nothing_of_the_server(client_venv):
    python = str(client_venv / "python")
    torch = subprocess.run([python, "-c", "import torch"], env=clean_env(), capture_output=True, text=True)
    assert torch.returncode != 0 and "No module named 'torch'" in torch.stderr
    loaded = subprocess.run([python, "-c", LOADED_BY_THE_CLIENT], env=clean_env(), capture_output=True, text=True)
    assert loaded.returncode == 0, loaded.stderr
    assert json.loads(loaded.stdout) == []
    help_text = subprocess.run([str(client_venv / "qasr-mic"), "--help"], env=clean_env(), capture_output=True,
                               text=True)
    assert help_text.returncode == 0 and "--file" in help_text.stdout


def test_the_torch_free_qasr_mic_streams_a_file_to_a_server(client_venv, tiny_model_dir, tmp_path):
    rate = 16000
    silence = np.zeros(int(0.6 * rate), dtype=np.float32)
    audio = np.concatenate([silence, speech_like(1.5, seed=3), silence, speech_like(1.2, seed=4), silence, silence])
    soundfile.write(str(tmp_path / "speech.wav"), audio, rate, subtype="PCM_16")
    with ThreadedServer(lambda: real_engine(tiny_model_dir)) as server:
        mic = subprocess.run([str(client_venv / "qasr-mic"), "--url", server.url, "--file",
                              str(tmp_path / "speech.wav"), "--speed", "4", "--jsonl"],
                             env=clean_env(), capture_output=True, text=True, timeout=60)
    assert mic.returncode == 0, mic.stderr
    finals = [json.loads(line) for line in mic.stdout.splitlines()]  # --jsonl: one final per line
    assert [final["segment_id"] for final in finals] == [0, 1], mic.stdout
    assert 0 <= finals[0]["start"] < finals[0]["end"] < finals[1]["start"] < finals[1]["end"] <= len(audio) / rate
    assert all(isinstance(final["text"], str) for final in finals)  # random weights: random text
    assert "Traceback" not in mic.stderr
