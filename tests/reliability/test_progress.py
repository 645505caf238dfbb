"""Progress for every phase longer than ~2 s (defect 12/13): the phases the work reports, and
the bar a terminal gets."""

from __future__ import annotations

import io
import time

from servesim.simulator import progress
from servesim.simulator.config import load_config, resolve_config
from servesim.simulator.runner import run_experiment
from servesim.workloads.stats import trace_stats

from .conftest import CONFIG


class Recording:
    def __init__(self):
        self.phases: list[tuple[str, int | None, int]] = []

    def start(self, name, total):
        entry = [name, total, 0]
        self.phases.append(entry)

        def tick(done=0):
            entry[2] = done

        return tick, lambda: None


def test_long_phases_report_progress(monkeypatch, tmp_path):
    rec = Recording()
    old = progress.set_reporter(rec)
    try:
        cfg = resolve_config(load_config(CONFIG, ["workload.num_prompts=30"]))
        run_experiment(cfg, resolved=True)
        trace = tmp_path / "t.csv"
        trace.write_text("arrival_s,prompt_len,output_len\n" +
                         "".join(f"{i},10,5\n" for i in range(50)))
        trace_stats(trace)
    finally:
        progress.set_reporter(old)
    got = {name: (total, done) for name, total, done in rec.phases}
    assert got["arrival times (normalising pass)"] == (30, 30)
    assert got["simulating"] == (30, 30)
    assert got[f"reading {trace}"] == (None, 50)


def test_bar_appears_only_after_the_delay(monkeypatch):
    from rich.console import Console

    buf = io.StringIO()
    monkeypatch.setattr("rich.console.Console", lambda **k: Console(file=buf, force_terminal=True,
                                                                     width=80))
    rep = progress.BarReporter(show_after_s=0.3)
    tick, stop = rep.start("quick", 10)
    tick(10)
    stop()
    assert buf.getvalue() == ""  # finished before the delay: nothing drawn
    tick, stop = rep.start("slow phase", 10)
    time.sleep(0.6)
    tick(5)
    time.sleep(0.3)
    tick(6)
    stop()
    assert "slow phase" in buf.getvalue()
