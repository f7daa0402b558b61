"""Makes the documentation's pictures again from a real run.

    python3 docs/make_pictures.py [--only report|dashboard] [--out-dir DIR]
                                  [--log-dir DIR]

Run from the repository root. It writes `docs/report.png` and
`docs/dashboard.png` (or the files in `--out-dir`):

1. The run: `tests/programs/report_under_cap.py` in a process of its own
   under a real 600 MiB TensorFlow allocator cap
   (`keras_memguard.testing.run_with_memory_cap`). It is a small CNN on
   random images, with `MemoryMonitor` and `MemoryGuard(threshold=0.9,
   plan=False)` writing to the log directory, for 2 epochs of batches of 64,
   64, 256 and 64 samples. The batch of 256 runs out of memory and the
   guard replays it as micro-batches. This takes 50 to 70 s on 2 CPU cores.
2. `report.png`: `python3 -m keras_memguard report LOG_DIR --output
   report.png`, the command users run. Its summary is printed. This takes
   about 1 s.
3. `dashboard.png`: TensorBoard on the log directory and headless Chromium
   on its Custom Scalars tab (`tests/programs/dashboard.py`, the helpers of
   `tests/test_dashboard.py`), screenshotted at 1900 x 470 pixels with
   smoothing off. Both processes are stopped afterwards. This takes 10 to
   30 s.

Needs: the package with its `cpu` extra (TensorFlow, tensorboard,
matplotlib), the repository's `tests/` folder (for the programs), and for
the dashboard a Chromium binary on `PATH` (`chromium`, `chromium-browser`
or `google-chrome`; e.g. `apt-get install chromium`). Without Chromium,
the dashboard is skipped, and the script says so and exits with status 1.
Nothing needs a GPU.

The log directory is a temporary folder named `logs` (the report's title
and TensorBoard's sidebar show that name), removed at the end unless
`--log-dir` names one to keep. The run fails (status 1) if the guard
recovered from no out-of-memory error, since the pictures would then not
show what the pages say.
"""

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
CAP_MIB = 600
# Wide enough for the dashboard's four charts in one row.
DASHBOARD_SIZE = (1900, 470)


def make_run(log_dir):
    """Runs the guarded fit under the cap; returns the guard's figures."""
    import programs
    from keras_memguard.testing import run_with_memory_cap

    print(f"Running a guarded fit under a {CAP_MIB} MiB cap into {log_dir} ...")
    run = run_with_memory_cap(
        programs.source("report_under_cap", str(log_dir)), CAP_MIB, timeout=600
    )
    result = run.result or {}
    print(
        f"  micro-batches at the end: {result.get('micro_batches')}, "
        f"out-of-memory recoveries: {result.get('oom_recoveries')}"
    )
    if not result.get("oom_recoveries"):
        raise SystemExit(
            "The run recovered from no out-of-memory error: the pictures would "
            "not show a recovery. Nothing was written."
        )
    return result


def make_report(log_dir, output):
    """Draws the report with the `keras-memguard report` command."""
    command = [
        sys.executable, "-m", "keras_memguard", "report", str(log_dir),
        "--output", str(output),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300)
    sys.stdout.write(completed.stdout)
    sys.stderr.write(completed.stderr)
    if completed.returncode != 0:
        raise SystemExit(f"keras-memguard report failed ({completed.returncode}).")


def make_dashboard(log_dir, output):
    """Screenshots TensorBoard's Custom Scalars tab; False without Chromium."""
    from programs import dashboard

    if dashboard.chromium_binary() is None:
        print(
            "dashboard.png not made: no chromium, chromium-browser or "
            "google-chrome on PATH (install Chromium, or pass --only report).",
            file=sys.stderr,
        )
        return False
    print("Screenshotting TensorBoard's Custom Scalars tab ...")
    # TensorBoard is started in this directory: its sidebar shows "logs".
    here = os.getcwd()
    os.chdir(log_dir.parent)
    try:
        dashboard.main([log_dir.name, str(output), *map(str, DASHBOARD_SIZE)])
    finally:
        os.chdir(here)
    return True


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Make docs/report.png and docs/dashboard.png from a real run."
    )
    parser.add_argument(
        "--only", choices=("report", "dashboard"), help="make only this picture"
    )
    parser.add_argument(
        "--out-dir", default=str(ROOT / "docs"),
        help="where the pictures go (default: docs/)",
    )
    parser.add_argument(
        "--log-dir",
        help="keep the run's logs in this folder (its name should be 'logs'); "
        "default: a temporary folder, removed at the end",
    )
    args = parser.parse_args(argv)
    sys.path.insert(0, str(TESTS))  # `import programs`
    out_dir = pathlib.Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory() as scratch:
        if args.log_dir:
            log_dir = pathlib.Path(args.log_dir).resolve()
            if log_dir.exists() and any(log_dir.iterdir()):
                raise SystemExit(f"--log-dir {log_dir} is not empty.")
        else:
            log_dir = pathlib.Path(scratch) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        make_run(log_dir)
        made = True
        if args.only in (None, "report"):
            make_report(log_dir, out_dir / "report.png")
        if args.only in (None, "dashboard"):
            made = make_dashboard(log_dir, out_dir / "dashboard.png")
    return 0 if made else 1


if __name__ == "__main__":
    sys.exit(main())
