"""The per-stream path and the wire protocols import no torch and no tokenizers (issue #10): a client or a front-end
process needs neither."""

from __future__ import annotations

import subprocess
import sys

TORCH_FREE = ["qasr.audio", "qasr.audio.g711", "qasr.streaming.settings", "qasr.streaming.events",
              "qasr.streaming.resample", "qasr.streaming.vad", "qasr.streaming.session", "qasr.server.protocol",
              "qasr.server.commands", "qasr.server.limits"]


def test_streaming_audio_and_the_native_protocol_import_without_torch_or_tokenizers():
    code = "\n".join([
        "import sys",
        "sys.modules['torch'] = None  # any import of torch now raises ImportError",
        "sys.modules['tokenizers'] = None",
        *[f"import {module}" for module in TORCH_FREE],
        "assert 'qasr.model.tokenizer' not in sys.modules and 'qasr.engine.engine' not in sys.modules",
        "print('ok')",
    ])
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_the_check_itself_fails_when_torch_is_imported():
    code = "import sys\nsys.modules['torch'] = None\nimport qasr.model.audio"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "torch" in result.stderr
