"""prompting.validate's checks when a request is added: cheap ones only, the samples' finiteness left to the
admission (tests/engine/test_host_copy.py)."""

import numpy as np
import pytest

from qasr.engine.options import EngineOptions
from qasr.engine.prompting import validate
from qasr.engine.request import DecodeRequest


def test_validate_leaves_the_samples_to_the_admission():
    """validate runs when a request is added, where a pass over every sample held the device idle at the start of an
    offline batch: a NaN passes here and is refused when the admission stages the clip (tests/engine/test_engine.py)."""
    audio = np.zeros(16_000, np.float32)
    audio[8_000] = np.nan
    validate(DecodeRequest(audio=audio), EngineOptions())
    with pytest.raises(ValueError, match="too short"):
        validate(DecodeRequest(audio=audio[:10]), EngineOptions())
