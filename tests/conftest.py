"""Shared pytest fixtures.

Random-weight tiny checkpoints (qasr.model.testmodel) are written once per test session into a temporary folder;
tests must treat them as read-only. The tests folder is put on sys.path so parity tests can `import official`
(tests/official.py runs the official implementation).
"""

import sys
from pathlib import Path

import pytest

from qasr.model.testmodel import make_test_aligner, make_test_model

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

TINY_SEED = 0


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """Tiny random checkpoint, original layout (thinker.*), one model.safetensors, untied lm_head."""
    return make_test_model(tmp_path_factory.mktemp("tiny-original"), layout="original", size="tiny", seed=TINY_SEED)


@pytest.fixture(scope="session")
def tiny_model_dir_hf(tmp_path_factory) -> Path:
    """The same weights as tiny_model_dir in the transformers-native "-hf" layout."""
    return make_test_model(tmp_path_factory.mktemp("tiny-hf"), layout="hf", size="tiny", seed=TINY_SEED)


@pytest.fixture(scope="session")
def tiny_model_dir_sharded(tmp_path_factory) -> Path:
    """The same weights as tiny_model_dir in 3 safetensors shards with model.safetensors.index.json."""
    return make_test_model(
        tmp_path_factory.mktemp("tiny-sharded"), layout="original", size="tiny", seed=TINY_SEED, num_shards=3
    )


@pytest.fixture(scope="session")
def tiny_aligner_dir(tmp_path_factory) -> Path:
    """Tiny random forced aligner (original layout), with the tiny model's tokenizer plus <timestamp>."""
    return make_test_aligner(tmp_path_factory.mktemp("tiny-aligner"), layout="original", seed=TINY_SEED)


@pytest.fixture(scope="session")
def aligner_server_port(tiny_model_dir, tiny_aligner_dir):
    """The port of a `qasr-server --aligner` on the tiny model and aligner (CPU, the engine in its own process),
    shared by the word-time tests."""
    from live_server import server_process

    with server_process("--model", str(tiny_model_dir), "--aligner", str(tiny_aligner_dir), "--device", "cpu",
                        "--slots", "4", "--max-segment-s", "10") as port:
        yield port
