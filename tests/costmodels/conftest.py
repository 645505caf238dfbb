"""Cost-model tests: CPU only, fast."""

from __future__ import annotations


def pytest_configure(config):
    # GPUs without a shipped calibration file warn on every build; silence that here.
    # Tests that check the warning use pytest.warns, which records it regardless.
    config.addinivalue_line(
        "filterwarnings", "ignore::servesim.costmodels.calibration.CalibrationWarning")
