"""Suite-wide: never read the developer's own calibration files (``simulate calibrate``
writes them to ~/.config/servesim/calibration, which ``hardware.calibration: auto`` reads
before the shipped ones)."""

import pytest


@pytest.fixture(autouse=True)
def _no_user_calibration(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SERVESIM_CALIBRATION_DIR",
                       str(tmp_path_factory.getbasetemp() / "no-user-calibration"))
