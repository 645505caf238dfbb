"""``simulate fit`` robustness: ``-o FILE`` is checked before fitting (and a late write failure
still prints the fitted values), runs the config cannot replay and malformed per-request
lists are one-line errors naming the file (exit 2)."""

from __future__ import annotations

import json

import pytest
from servesim.simulator.cli import run_cli
from servesim.simulator.errors import ServesimError
from servesim.simulator.fit import load_measured

N = 6


def measured(tmp_path, name="run.json", **kw):
    d = {"input_lens": [100 + 20 * i for i in range(N)], "output_lens": [4] * N,
         "ttfts": [0.03] * N, "itls": [[0.01] * 3 for _ in range(N)],
         "start_times": [float(i) for i in range(N)], "errors": [""] * N,
         "request_rate": 1.0, "max_concurrency": None}
    d.update(kw)
    p = tmp_path / name
    p.write_text(json.dumps(d))
    return p


@pytest.fixture
def config(tmp_path):
    p = tmp_path / "dep.yaml"
    p.write_text("model: {name: llama-3.1-8b, max_model_len: 4096}\n"
                 "hardware: {name: a100-sxm4-80gb}\n")
    return p


@pytest.fixture
def no_fit(monkeypatch):
    """The checks must come before the fit: fitting fails the test."""
    from servesim.simulator import fit

    def boom(*a, **k):
        raise AssertionError("fitted before checking")

    monkeypatch.setattr(fit, "fit", boom)


@pytest.mark.parametrize("content, msg", [
    ("garbage: [\n", "{o}:2:1: invalid YAML: expected the node content, but found '<stream end>'"),
    ("[1, 2]\n", ("{o}: expected a calibration mapping (gpu:, frontend:, host: ...) to merge the "
                 "fit into, got a list")),
    ("frontend: 5\n", "{o}: frontend: expected a mapping, got int 5"),
])
def test_output_file_is_checked_before_fitting(content, msg, tmp_path, config, no_fit, capsys):
    out = tmp_path / "cal.yaml"
    out.write_text(content)
    rc = run_cli(["fit", str(config), str(measured(tmp_path)), "-o", str(out)])
    assert rc == 2
    assert capsys.readouterr().err == f"error: {msg.format(o=out)}\n"


def test_output_in_an_unwritable_place(tmp_path, config, no_fit, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    rc = run_cli(["fit", str(config), str(measured(tmp_path)), "-o", str(afile / "cal.yaml")])
    assert rc == 2
    assert capsys.readouterr().err == (f"error: {afile / 'cal.yaml'}: {afile} is a file, not a "
                                       "folder\n")
    rc = run_cli(["fit", str(config), str(measured(tmp_path)), "-o", "/proc/cal.yaml"])
    assert rc == 2
    assert capsys.readouterr().err == ("error: /proc/cal.yaml: cannot write the calibration file "
                                       "here: No such file or directory\n")


def test_late_write_failure_still_prints_the_fitted_values(tmp_path, config, monkeypatch,
                                                            capsys):
    from servesim.reports import writers

    def full(path, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writers, "atomic_write_text", full)
    out = tmp_path / "cal.yaml"
    rc = run_cli(["fit", str(config), str(measured(tmp_path)), "--max-evals", "10",
                  "-o", str(out)])
    cap = capsys.readouterr()
    assert rc == 2
    assert "fitted parameters" in cap.out and "request_s" in cap.out
    assert cap.err == (f"error: {out}: cannot write the calibration file: No space left on "
                       "device; the fitted values are printed above\n")


def test_requests_longer_than_max_model_len_are_an_error(tmp_path, config, capsys):
    long = measured(tmp_path, "longin.json", input_lens=[100000] * N)
    rc = run_cli(["fit", str(config), str(long), str(measured(tmp_path))])
    assert rc == 2
    assert capsys.readouterr().err == (
        f"error: {long}: {N} of {N} requests are longer (prompt + output tokens) than "
        f"max_model_len 4096 of {config}, so they cannot be replayed: is it the measured "
        "server's config? (--set model.max_model_len=N)\n")


def test_malformed_per_request_lists(tmp_path):
    empty = measured(tmp_path, "empty.json", input_lens=[], output_lens=[], ttfts=[], itls=[],
                     start_times=[], errors=[])
    with pytest.raises(ServesimError) as e:
        load_measured(empty)
    assert str(e.value) == f"{empty}: no requests (input_lens is empty)"
    bad = measured(tmp_path, "bad.json", itls=[[0.01, "x", 0.01]] + [[0.01] * 3] * (N - 1))
    with pytest.raises(ServesimError) as e:
        load_measured(bad)
    assert str(e.value) == f"{bad}: itls[0][1]: expected a number (seconds), got 'x'"


def test_folder_without_result_json_and_holdout_file_also_fitted(tmp_path, config, capsys):
    folder = tmp_path / "run"
    folder.mkdir()
    with pytest.raises(ServesimError) as e:
        load_measured(folder)
    assert str(e.value) == f"{folder / 'result.json'}: cannot read (No such file or directory)"
    m = measured(tmp_path)
    rc = run_cli(["fit", str(config), str(m), "--holdout-file", str(m)])
    assert rc == 2
    assert capsys.readouterr().err == (f"error: --holdout-file {m}: also a measured file to fit; "
                                       "a held-out file must not be fitted\n")
