"""Render a plan report in headless Chromium and save a screenshot: checks the HTML report in a real browser.

    python -m experiments.tools.screenshot_report                 # built-in GPT-2 (small), budget halfway
    python -m experiments.tools.screenshot_report --model cnn --out /tmp/report_cnn.png

Needs Debian's chromium (apt-get install chromium) and matplotlib. The page is self-contained, so the browser runs with
networking features off.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

import autockpt
from autockpt.present import zoo

CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--hide-scrollbars",
)


def screenshot(html_path: Path, png_path: Path, *, width: int = 1200, height: int = 2700) -> None:
    """Screenshot a local HTML file with headless Chromium (raises if chromium is missing or fails)."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise FileNotFoundError("chromium is not installed (Debian: apt-get install chromium)")
    with tempfile.TemporaryDirectory() as profile_dir:
        subprocess.run(
            [browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile_dir}", f"--window-size={width},{height}",
             f"--screenshot={png_path.resolve()}", html_path.resolve().as_uri()],
            check=True, capture_output=True, timeout=120,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2", choices=sorted(zoo.BUILDERS))
    parser.add_argument("--size", default="small", choices=zoo.SIZES)
    parser.add_argument("--fraction", type=float, default=0.5, help="budget: fraction from static memory to the peak")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/report_gpt2.png"))
    args = parser.parse_args()
    case = zoo.build(args.model, args.size)
    planner = autockpt.Planner.from_model(case.model, example_inputs=case.args, example_kwargs=case.kwargs, loss_fn=case.loss_fn)
    static, peak = planner.trace.static_bytes, planner.trace.baseline_peak_bytes
    plan = planner.plan(budget_bytes=int(static + args.fraction * (peak - static)), pareto_points=6)
    with tempfile.TemporaryDirectory() as folder:
        html = Path(folder) / "report.html"
        plan.report(html)
        screenshot(html, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
