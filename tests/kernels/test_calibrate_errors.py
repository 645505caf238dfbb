"""``simulate calibrate`` refuses a bad ``-o`` or ``--gpu`` before measuring (minutes on a
GPU), with one-line errors (exit 2). No GPU needed: the measurement is replaced by a stub
that fails the test if it is reached."""

from __future__ import annotations

import pytest
from kernels_synthetic import synthetic_doc
from servesim.kernels import calibrate as C
from servesim.kernels.calibration_file import check_output_file, write_calibration
from servesim.simulator.cli import main
from servesim.simulator.errors import ServesimError


def _run_main(args, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


@pytest.fixture
def gpu_present(monkeypatch):
    """As on a GPU machine, except that measuring fails the test."""
    def measure(*a, **k):
        raise AssertionError("the -o check must come before measuring")

    monkeypatch.setattr(C, "require_gpu", lambda: None)
    monkeypatch.setattr(C, "run_calibration", measure)


def test_output_folder_is_refused_before_measuring(capsys, tmp_path, gpu_present):
    code, _, err = _run_main(["calibrate", "--gpu", "h100-sxm", "-o", str(tmp_path)], capsys)
    assert code == 2
    assert err.splitlines() == [(f"error: {tmp_path}: is a folder; give the calibration file's "
                                f"name, e.g. {tmp_path / 'h100-sxm.yaml'}")]


def test_output_under_a_file_is_refused_before_measuring(capsys, tmp_path, gpu_present):
    (tmp_path / "f").write_text("x")
    out = tmp_path / "f" / "sub" / "h100.yaml"
    code, _, err = _run_main(["calibrate", "--gpu", "h100-sxm", "-o", str(out)], capsys)
    assert code == 2
    assert err.splitlines() == [f"error: {out}: {tmp_path / 'f'} is a file, not a folder"]


def test_unknown_gpu_is_named_before_the_gpu_check(capsys, monkeypatch):
    def no_gpu():
        raise ServesimError(C.NO_GPU_MESSAGE)

    monkeypatch.setattr(C, "require_gpu", no_gpu)  # (this machine, with or without torch)
    code, _, err = _run_main(["calibrate", "--gpu", "nosuch"], capsys)
    assert code == 2
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --gpu nosuch: no "), err
    assert "h100-sxm" in lines[0]


def test_write_calibration_refuses_a_folder_and_leaves_no_temp_file(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(ServesimError, match=r"is a folder"):
        write_calibration(synthetic_doc(), tmp_path / "d")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_check_output_file_accepts_a_new_file_in_a_new_folder(tmp_path):
    check_output_file(tmp_path / "new" / "deeper" / "h100-sxm.yaml")
    assert not (tmp_path / "new").exists()  # (checked, not created)
    p = write_calibration(synthetic_doc(), tmp_path / "new" / "h100-sxm.yaml")
    assert C.read_calibration(p) == synthetic_doc()
