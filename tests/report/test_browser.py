"""report.html renders with its plots in headless Chromium (skipped without chromium)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from servesim.reports.render import write_report

CANDIDATES = ("/usr/bin/chromium", "chromium", "chromium-browser", "google-chrome")


def _chromium() -> str | None:
    for c in CANDIDATES:
        p = shutil.which(c)
        if p:
            return p
    return None


def test_report_html_renders_plots_in_headless_chromium(run_dir, tmp_path):
    exe = _chromium()
    if exe is None:
        pytest.skip("chromium not installed (apt-get install -y chromium) - browser render "
                    "check skipped")
    _, html = write_report(run_dir)
    shot = tmp_path / "shot.png"
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}",
           f"--screenshot={shot}", "--window-size=1200,2000", html.resolve().as_uri()]
    try:
        subprocess.run(cmd, capture_output=True, timeout=60, check=False)
    except subprocess.TimeoutExpired:
        pytest.skip("chromium did not finish within 60 s")
    assert shot.is_file(), "chromium wrote no screenshot"
    import matplotlib.image as mpimg
    import numpy as np

    img = mpimg.imread(shot)[..., :3]
    assert img.shape[0] >= 1000 and img.shape[1] >= 1000
    assert float(img.std()) > 0.05, "screenshot is blank"
    # plots are there: many distinct colours (text alone is black on white)
    colours = np.unique((img.reshape(-1, 3) * 255).astype(np.uint8), axis=0)
    assert len(colours) > 200
    # some blue from the CDF lines below the answer paragraph
    blue = (img[..., 2] > 0.6) & (img[..., 0] < 0.3)
    assert blue.sum() > 500
