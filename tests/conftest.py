"""Suite-wide: never read the developer's own calibration files (``simulate calibrate``
writes them to ~/.config/servesim/calibration, which ``hardware.calibration: auto`` reads
before the shipped ones)."""

import pytest


@pytest.fixture(autouse=True)
def _no_user_calibration(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SERVESIM_CALIBRATION_DIR",
                       str(tmp_path_factory.getbasetemp() / "no-user-calibration"))


@pytest.fixture
def cli_error(capsys, tmp_path):
    """``cli_error(config, *sets)``: the one error line of ``simulate run config -q --set
    ...`` in process, asserting exit 2, no traceback and no output folder."""
    from servesim.simulator.cli import run_cli

    def run(config: str, *sets: str) -> str:
        args = ["run", config, "-q", "-o", str(tmp_path / "out")]
        for s in sets:
            args += ["--set", s]
        rc = run_cli(args)
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.startswith(("error:", "internal error:"))]
        assert rc == 2, err
        assert len(lines) == 1 and "Traceback" not in err, err
        assert not (tmp_path / "out").exists()
        return lines[0]

    return run
