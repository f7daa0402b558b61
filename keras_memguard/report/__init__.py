"""`keras-memguard report`: read a run's event files, summarise and draw it.

Reading (`events`), the figures and their text (`summary`) and drawing
(`plot`, which needs matplotlib: `pip install "keras-memguard[report]"`)
are separate modules; `make_report` and the command line tie them together.
"""

from keras_memguard.report.cli import main
from keras_memguard.report.cli import make_report
from keras_memguard.report.events import find_runs
from keras_memguard.report.events import load_run
from keras_memguard.report.events import load_runs
from keras_memguard.report.summary import format_summary
from keras_memguard.report.summary import summarize

__all__ = [
    "find_runs",
    "format_summary",
    "load_run",
    "load_runs",
    "main",
    "make_report",
    "summarize",
]
