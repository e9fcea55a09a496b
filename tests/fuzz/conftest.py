"""Hypothesis profiles for the fuzz tests: `ci` (the default, a few seconds per adapter) and `nightly` (>= 100,000
generated message sequences per adapter). Pick one with HYPOTHESIS_PROFILE=nightly (docs/reliability.md).
QASR_FUZZ_EXAMPLES sets the nightly count of one run: bench/fuzz_nightly.sh splits an adapter's 100,000 over
shards, one seed each, so that a many-core machine runs them side by side."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
               database=None, print_blob=True)
settings.register_profile("ci", max_examples=100, **_COMMON)
settings.register_profile("nightly", max_examples=int(os.environ.get("QASR_FUZZ_EXAMPLES", 100_000)), **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
