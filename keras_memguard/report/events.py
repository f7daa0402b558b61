"""Reads a run's TensorBoard event files into plain Python data.

The event files are read with TensorBoard's own loader (`EventAccumulator`),
the tag names come from `keras_memguard.sinks.tensorboard` (where they live),
and the out-of-memory explanations from `<run>/oom-*.json`. Nothing here
draws or decides; `summary` and `plot` work on the `RunData` this returns.
"""

import glob
import json
import os
import re
from typing import NamedTuple, Optional, Tuple

from keras_memguard.sinks import tensorboard as tb

# The device series read for each device, by the keys `tb.device_tags` uses.
DEVICE_SERIES = ("current", "peak", "limit", "usage", "epoch_peak", "floor", "growth")

# Keras' `TensorBoard` callback writes its epoch scalars to this run, beside
# ours, at steps that count epochs; their wall times place epoch ends when no
# MemoryMonitor wrote its epoch scalars.
KERAS_TRAIN_RUN = "train"


class Series(NamedTuple):
    """One scalar tag's points, in step order.

    Attributes:
        steps: The global batch steps.
        values: The values (floats).
        wall_times: Seconds since the epoch when each point was written.
    """

    steps: Tuple[int, ...] = ()
    values: Tuple[float, ...] = ()
    wall_times: Tuple[float, ...] = ()

    def __bool__(self):
        return bool(self.steps)


class RunData(NamedTuple):
    """What one run directory holds.

    Attributes:
        name: The run's name: the directory holding `memguard/`, relative to
            the log directory given (`"."` for the log directory itself).
        path: The run directory read (`<log_dir>/memguard`).
        devices: Dict from device name (`"gpu0"`, `"cpu0"`) to a dict from
            series key (`DEVICE_SERIES`) to `Series` (empty when not logged).
        micro_batches: `memguard/micro_batches` (the count for the next
            batch), empty without a `MemoryGuard`.
        micro_batch_size: `memguard/micro_batch_size`.
        oom_recoveries: `memguard/oom_recoveries` (the guard's running count).
        epoch_ends: The last step of each epoch, in order.
        epoch_source: Where `epoch_ends` came from: `"monitor"` (the
            monitor's epoch scalars), `"keras"` (the wall times of Keras'
            `TensorBoard` epoch scalars in the sibling `train` run), or
            `None` (no epoch information).
        oom_reports: The out-of-memory explanations, one dict per
            `oom-*.json` file, each with a `"file"` key; a file that cannot
            be read gives `{"file": ..., "error": ...}`.
        host_rss: `memory/host/rss_mib` (the process's resident memory),
            empty where it was not logged.
        host_floor: `memory/host/floor_mib`, the resident memory's floor per
            epoch (`MemoryMonitor(growth=True)`), or empty.
        host_growth: `memory/host/growth_mib_per_epoch`, written at the
            epochs the floor was found rising, or empty.
    """

    name: str
    path: str
    devices: dict
    micro_batches: Series
    micro_batch_size: Series
    oom_recoveries: Series
    epoch_ends: Tuple[int, ...]
    epoch_source: Optional[str]
    oom_reports: Tuple[dict, ...]
    host_rss: Series = Series()
    host_floor: Series = Series()
    host_growth: Series = Series()

    @property
    def steps(self):
        """Every step with a point, sorted."""
        found = set(self.micro_batches.steps)
        found.update(self.host_rss.steps)
        for series in self.devices.values():
            for key in ("current", "peak"):
                found.update(series[key].steps)
        return tuple(sorted(found))


def _is_event_file(name):
    return "tfevents" in name


def find_runs(log_dir):
    """Returns the directories under `log_dir` the package wrote events to.

    A run directory is a `memguard` directory (`tb.RUN_NAME`) holding an
    event file; `log_dir` may also be such a directory itself.

    Args:
        log_dir: The `log_dir` given to `MemoryMonitor` or `MemoryGuard`, or
            a directory above several of them.

    Returns:
        A sorted list of run directory paths; empty when there are none.
    """
    log_dir = os.path.abspath(os.fspath(log_dir))
    runs = []
    for directory, subdirectories, files in os.walk(log_dir):
        subdirectories.sort()
        if os.path.basename(directory) == tb.RUN_NAME and any(
            _is_event_file(name) for name in files
        ):
            runs.append(directory)
    return sorted(runs)


def _accumulator(path, guidance):
    from tensorboard.backend.event_processing import event_accumulator

    size_guidance = {kind: 0 for kind in guidance}  # 0: keep every point
    accumulator = event_accumulator.EventAccumulator(
        path, size_guidance=size_guidance, purge_orphaned_data=False
    )
    accumulator.Reload()
    return accumulator


def _series(events):
    """A `Series` from TensorBoard's `ScalarEvent`s; the last point per step."""
    by_step = {}
    for event in events:
        by_step[int(event.step)] = (float(event.value), float(event.wall_time))
    steps = tuple(sorted(by_step))
    return Series(
        steps,
        tuple(by_step[s][0] for s in steps),
        tuple(by_step[s][1] for s in steps),
    )


def _tag_pattern(template):
    """A regex matching a tag template's `{dev}` as the group `dev`."""
    prefix, _, suffix = template.partition("{dev}")
    return re.compile(re.escape(prefix) + r"(?P<dev>[^/]+)" + re.escape(suffix) + "$")


def load_run(run_dir, log_dir=None):
    """Reads one run directory.

    Args:
        run_dir: A directory `find_runs` returned.
        log_dir: The directory the run was found under, to name the run.
            Defaults to `None`: the run is named by its parent directory.

    Returns:
        A `RunData`.
    """
    from tensorboard.backend.event_processing import event_accumulator

    run_dir = os.path.abspath(run_dir)
    accumulator = _accumulator(run_dir, [event_accumulator.SCALARS])
    tags = accumulator.Tags().get(event_accumulator.SCALARS, [])
    empty = {key: Series() for key in DEVICE_SERIES}
    devices = {}
    patterns = {key: _tag_pattern(template) for key, template in _TEMPLATES.items()}
    for tag in tags:
        for key, pattern in patterns.items():
            match = pattern.match(tag)
            if match and match.group("dev") != tb.HOST:
                device = devices.setdefault(match.group("dev"), dict(empty))
                device[key] = _series(accumulator.Scalars(tag))

    def scalar(tag):
        return _series(accumulator.Scalars(tag)) if tag in tags else Series()

    micro_batches = scalar(tb.MICRO_BATCHES)
    epoch_ends = sorted(
        {s for d in devices.values() for s in d["epoch_peak"].steps}
    )
    epoch_source = "monitor" if epoch_ends else None
    if not epoch_ends:
        step_series = micro_batches or _first_peak(devices)
        epoch_ends = _epoch_ends_from_keras(os.path.dirname(run_dir), step_series)
        epoch_source = "keras" if epoch_ends else None

    parent = os.path.dirname(run_dir)
    name = parent
    if log_dir is not None:
        relative = os.path.relpath(parent, log_dir)
        if not relative.startswith(".."):
            name = relative
    return RunData(
        name=name,
        path=run_dir,
        devices=dict(sorted(devices.items(), key=lambda item: _device_order(item[0]))),
        micro_batches=micro_batches,
        micro_batch_size=scalar(tb.MICRO_BATCH_SIZE),
        oom_recoveries=scalar(tb.OOM_RECOVERIES),
        epoch_ends=tuple(epoch_ends),
        epoch_source=epoch_source,
        oom_reports=load_oom_reports(run_dir),
        host_rss=scalar(tb.HOST_RSS_MIB),
        host_floor=scalar(tb.FLOOR_MIB.format(dev=tb.HOST)),
        host_growth=scalar(tb.GROWTH_MIB_PER_EPOCH.format(dev=tb.HOST)),
    )


_TEMPLATES = {
    "current": tb.CURRENT_MIB,
    "peak": tb.PEAK_MIB,
    "limit": tb.LIMIT_MIB,
    "usage": tb.USAGE,
    "epoch_peak": tb.EPOCH_PEAK_MIB,
    "floor": tb.FLOOR_MIB,
    "growth": tb.GROWTH_MIB_PER_EPOCH,
}


def _device_order(name):
    match = re.match(r"([a-z]+)(\d+)$", name)
    if match is None:
        return (name, 0)
    # GPUs first, then CPUs, each by number.
    return ({"gpu": "0", "cpu": "1"}.get(match.group(1), match.group(1)), int(match.group(2)))


def _first_peak(devices):
    for series in devices.values():
        if series["peak"]:
            return series["peak"]
    return Series()


def epoch_ends_from_wall_times(step_series, epoch_wall_times):
    """Places epoch ends on the step axis by wall time.

    Each epoch ends at the last step written before that epoch's end was
    written (Keras writes its epoch scalars after the epoch's last batch).

    Args:
        step_series: A `Series` of per-batch points (steps and wall times).
        epoch_wall_times: The wall times at which each epoch ended.

    Returns:
        A sorted list of steps, one per epoch that had a batch before it.
    """
    ends = set()
    points = sorted(zip(step_series.wall_times, step_series.steps))
    for end in epoch_wall_times:
        before = [step for wall_time, step in points if wall_time <= end]
        if before:
            ends.add(max(before))
    return sorted(ends)


def _epoch_ends_from_keras(parent, step_series):
    """Epoch ends from Keras' `TensorBoard` epoch scalars, or `[]`."""
    train_dir = os.path.join(parent, KERAS_TRAIN_RUN)
    if not step_series or not os.path.isdir(train_dir):
        return []
    from tensorboard.backend.event_processing import event_accumulator

    try:
        accumulator = _accumulator(
            train_dir, [event_accumulator.SCALARS, event_accumulator.TENSORS]
        )
    except Exception:  # A report never fails on a neighbour's files.
        return []
    tags = accumulator.Tags()
    wall_times = {}  # epoch -> the latest wall time written for it
    for kind, read in (
        (event_accumulator.TENSORS, accumulator.Tensors),
        (event_accumulator.SCALARS, accumulator.Scalars),
    ):
        for tag in tags.get(kind, []):
            if not tag.startswith("epoch_"):
                continue
            for event in read(tag):
                wall_times[event.step] = max(
                    wall_times.get(event.step, 0.0), event.wall_time
                )
    return epoch_ends_from_wall_times(step_series, sorted(wall_times.values()))


def load_oom_reports(run_dir):
    """Reads the out-of-memory explanations `<run_dir>/oom-*.json`.

    Args:
        run_dir: A run directory (`<log_dir>/memguard`).

    Returns:
        A tuple of dicts in step order (then failure order), each the file's
        JSON object with `"file"` added; a file that is not a JSON object
        gives `{"file": ..., "error": "<why>"}`.
    """
    reports = []
    for path in glob.glob(os.path.join(run_dir, "oom-*.json")):
        try:
            with open(path, encoding="utf-8") as f:
                report = json.load(f)
            if not isinstance(report, dict):
                raise ValueError(f"a JSON {type(report).__name__}, not an object")
        except (OSError, ValueError) as error:
            report = {"error": str(error)}
        report["file"] = os.path.basename(path)
        reports.append(report)

    def order(report):
        step = report.get("step")
        # `oom-<step>-<n>.json`: the n-th failure of the same batch.
        attempt = re.fullmatch(r"oom-\d+-(\d+)\.json", report["file"])
        return (
            0 if isinstance(step, (int, float)) and not isinstance(step, bool) else 1,
            step if isinstance(step, (int, float)) else 0,
            int(attempt.group(1)) if attempt else 1,
            report["file"],
        )

    return tuple(sorted(reports, key=order))


def load_runs(log_dir):
    """Reads every run under `log_dir`.

    Args:
        log_dir: The `log_dir` given to `MemoryMonitor` or `MemoryGuard`.

    Returns:
        A list of `RunData`, one per run directory `find_runs` finds.
    """
    log_dir = os.path.abspath(os.fspath(log_dir))
    return [load_run(run_dir, log_dir) for run_dir in find_runs(log_dir)]
