"""The figures of a run, and their text: pure Python over `RunData`.

No TensorBoard, TensorFlow or matplotlib here: the figures come from the
series `events.load_run` read, so they can be tested with scripted series.
"""

import math
import statistics
from typing import NamedTuple, Optional, Tuple

_MIB = 1024 * 1024


class DeviceSummary(NamedTuple):
    """One device's figures.

    Attributes:
        device: The device name (`"gpu0"`).
        peak_mib: The highest per-batch peak, or `None` if never logged.
        peak_step: The step of that peak (the first, if it repeats).
        limit_mib: The device limit logged at that step (else the last one
            logged), or `None`.
        last_current_mib: The bytes in use at the last step, in MiB.
    """

    device: str
    peak_mib: Optional[float]
    peak_step: Optional[int]
    limit_mib: Optional[float]
    last_current_mib: Optional[float]

    @property
    def peak_usage(self):
        """The highest peak over the limit, or `None`."""
        if self.peak_mib is None or not self.limit_mib:
            return None
        return self.peak_mib / self.limit_mib


class HostSummary(NamedTuple):
    """The process's resident host memory (RSS) over the run, in MiB.

    Attributes:
        first_mib: The first point's RSS.
        first_step: Its step.
        last_mib: The last point's RSS.
        last_step: Its step.
        peak_mib: The highest RSS.
        peak_step: Its step (the first, if it repeats).
    """

    first_mib: float
    first_step: int
    last_mib: float
    last_step: int
    peak_mib: float
    peak_step: int

    @property
    def growth_mib(self):
        """The last point's RSS minus the first's."""
        return self.last_mib - self.first_mib


class FloorSummary(NamedTuple):
    """The floor (memory in use between steps) of one series over the run.

    Written per epoch by `MemoryMonitor(growth=True)`; the growth per
    epoch only at the epochs its trend test found the floor rising.

    Attributes:
        series: The device's name, or `"host"` for the resident memory.
        first_mib: The first epoch's floor.
        last_mib: The last epoch's floor.
        epochs: How many epochs have a floor.
        growth_mib_per_epoch: The last growth rate written, or `None` when
            the floor was never found rising.
        limit_mib: The device's limit, or `None` (the host's is not logged).
    """

    series: str
    first_mib: float
    last_mib: float
    epochs: int
    growth_mib_per_epoch: Optional[float]
    limit_mib: Optional[float]

    @property
    def epochs_to_limit(self):
        """At the growth rate, epochs until the floor reaches the limit.

        `None` without a rate or a limit; `0` when the floor is there.
        """
        rate, limit = self.growth_mib_per_epoch, self.limit_mib
        if not rate or rate <= 0 or not limit:
            return None
        return max(0, math.ceil((limit - self.last_mib) / rate))


class KChange(NamedTuple):
    """A change of the micro-batch count, decided after batch `step`."""

    step: int
    old: int
    new: int


class Recovery(NamedTuple):
    """Out-of-memory recoveries during batch `step`.

    Attributes:
        step: The batch.
        count: How many recoveries it took (the count's increase).
        seconds: The batch's time beyond a typical batch's, from the wall
            times, or `None` when it cannot be derived (the first point).
    """

    step: int
    count: int
    seconds: Optional[float]


class RunSummary(NamedTuple):
    """The figures of one run; see `summarize`."""

    name: str
    path: str
    first_step: Optional[int]
    last_step: Optional[int]
    epoch_ends: Tuple[int, ...]
    epoch_source: Optional[str]
    devices: Tuple[DeviceSummary, ...]
    highest: Optional[DeviceSummary]
    k_changes: Tuple[KChange, ...]
    final_k: Optional[int]
    final_micro_batch_size: Optional[int]
    recoveries: Tuple[Recovery, ...]
    recovery_count: int
    recovery_seconds: Optional[float]
    typical_step_seconds: Optional[float]
    oom_reports: Tuple[dict, ...]
    host: Optional[HostSummary] = None
    floors: Tuple[FloorSummary, ...] = ()


def _int(value):
    return None if value is None else int(round(value))


def _device_summary(name, series):
    peak = series["peak"]
    peak_mib = peak_step = None
    for step, value in zip(peak.steps, peak.values):
        if peak_mib is None or value > peak_mib:
            peak_mib, peak_step = value, step
    limits = dict(zip(series["limit"].steps, series["limit"].values))
    limit_mib = limits.get(peak_step)
    if limit_mib is None and series["limit"]:
        limit_mib = series["limit"].values[-1]
    current = series["current"]
    return DeviceSummary(
        name,
        peak_mib,
        peak_step,
        limit_mib,
        current.values[-1] if current else None,
    )


def floor_summary(name, floor, growth, limit=None):
    """The floor's first and last epochs and its growth, or `None`.

    Args:
        name: The series' name (a device's, or `"host"`).
        floor: Its `floor_mib` `Series`.
        growth: Its `growth_mib_per_epoch` `Series`.
        limit: Its `limit_mib` `Series`, or `None` (the host's).

    Returns:
        A `FloorSummary`, or `None` when no floor was logged.
    """
    if not floor:
        return None
    limit_mib = limit.values[-1] if limit else None
    rate = growth.values[-1] if growth else None
    return FloorSummary(name, floor.values[0], floor.values[-1], len(floor.values), rate, limit_mib)


def host_summary(host_rss):
    """The first, last and highest points of the host's RSS.

    Args:
        host_rss: The `memory/host/rss_mib` `Series`.

    Returns:
        A `HostSummary`, or `None` when the series is empty.
    """
    if not host_rss:
        return None
    steps, values = host_rss.steps, host_rss.values
    top = max(range(len(values)), key=lambda i: (values[i], -i))
    return HostSummary(values[0], steps[0], values[-1], steps[-1], values[top], steps[top])


def k_changes(micro_batches):
    """The changes of the micro-batch count between consecutive points.

    Args:
        micro_batches: The `memguard/micro_batches` `Series`.

    Returns:
        A tuple of `KChange`.
    """
    changes = []
    values = [_int(v) for v in micro_batches.values]
    for i in range(1, len(values)):
        if values[i] != values[i - 1]:
            changes.append(KChange(micro_batches.steps[i], values[i - 1], values[i]))
    return tuple(changes)


def recoveries(oom_recoveries):
    """Where the guard's recovery count rose, and the time each took.

    The count is the guard's running total, counted from 0 before the
    first point. A recovered batch's time is its interval (wall time since
    the previous point, per step) beyond the median interval of the batches
    without a recovery: the allocator's retries, the replay and any new
    trace.

    Args:
        oom_recoveries: The `memguard/oom_recoveries` `Series`.

    Returns:
        `(recoveries, typical_step_seconds)`: a tuple of `Recovery`, and the
        median seconds per batch (or `None` with fewer than two points).
    """
    steps, values, walls = oom_recoveries
    increases = []
    for i, value in enumerate(values):
        previous = values[i - 1] if i else 0.0
        increases.append(max(0, _int(value - previous)))
    typical = [
        (walls[i] - walls[i - 1]) / (steps[i] - steps[i - 1])
        for i in range(1, len(steps))
        if not increases[i] and steps[i] > steps[i - 1]
    ]
    per_step = statistics.median(typical) if typical else None
    found = []
    for i, count in enumerate(increases):
        if not count:
            continue
        seconds = None
        if i and per_step is not None:
            spent = walls[i] - walls[i - 1]
            seconds = max(0.0, spent - per_step * (steps[i] - steps[i - 1]))
        found.append(Recovery(steps[i], count, seconds))
    return tuple(found), per_step


def summarize(run):
    """Computes a run's figures.

    Args:
        run: A `RunData` from `events.load_run`.

    Returns:
        A `RunSummary`: per-device highest peak and its step, the device
        with the highest peak, the changes of `k` and the `k` the run ended
        with, the out-of-memory recoveries and the time spent in them (the
        sum of the recovered batches' extra time; `None` when none could be
        derived), the epoch ends, the out-of-memory explanations, the
        host's resident memory and, where the growth test ran, each floor.
    """
    devices = tuple(_device_summary(name, series) for name, series in run.devices.items())
    with_peak = [d for d in devices if d.peak_mib is not None]
    highest = max(with_peak, key=lambda d: d.peak_mib) if with_peak else None
    found, per_step = recoveries(run.oom_recoveries)
    timed = [r.seconds for r in found if r.seconds is not None]
    steps = run.steps
    micro_batches = run.micro_batches
    size = run.micro_batch_size
    return RunSummary(
        name=run.name,
        path=run.path,
        first_step=steps[0] if steps else None,
        last_step=steps[-1] if steps else None,
        epoch_ends=tuple(run.epoch_ends),
        epoch_source=run.epoch_source,
        devices=devices,
        highest=highest,
        k_changes=k_changes(micro_batches),
        final_k=_int(micro_batches.values[-1]) if micro_batches else None,
        final_micro_batch_size=_int(size.values[-1]) if size else None,
        recoveries=found,
        recovery_count=sum(r.count for r in found),
        recovery_seconds=sum(timed) if timed else None,
        typical_step_seconds=per_step,
        oom_reports=tuple(run.oom_reports),
        host=host_summary(run.host_rss),
        floors=tuple(
            found
            for found in [
                floor_summary(name, series["floor"], series["growth"], series["limit"])
                for name, series in run.devices.items()
            ]
            + [floor_summary("host", run.host_floor, run.host_growth)]
            if found is not None
        ),
    )


def _mib(value):
    return f"{value:.1f} MiB"


def _bytes(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return _mib(value / _MIB)


def _steps(steps, most=10):
    shown = ", ".join(str(s) for s in steps[:most])
    return shown + (f", ... ({len(steps)} in all)" if len(steps) > most else "")


def format_oom_report(report):
    """One out-of-memory explanation as text lines; missing keys are left out.

    Args:
        report: A dict from `events.load_oom_reports`.

    Returns:
        A list of lines (without indentation).
    """
    name = report.get("file", "?")
    if "error" in report and len(report) == 2:
        return [f"{name}: could not be read ({report['error']})"]
    step = report.get("step")
    head = f"step {step}" if step is not None else "step unknown"
    parts = []
    for key, label in (
        ("failed_allocation_bytes", "failed to allocate"),
        ("in_use_bytes", "in use"),
        ("largest_free_chunk_bytes", "largest free chunk"),
        ("limit_bytes", "limit"),
    ):
        text = _bytes(report.get(key))
        if text is not None:
            if key == "failed_allocation_bytes" and report.get("failed_layer"):
                text += f" in layer '{report['failed_layer']}'"
                if report.get("backward"):
                    text += " (backward pass)"
            parts.append(f"{label} {text}")
    fragmentation = report.get("fragmentation")
    if isinstance(fragmentation, (int, float)) and not isinstance(fragmentation, bool):
        parts.append(f"fragmentation {fragmentation:.0%}")
    lines = [f"{head} ({name}): " + ("; ".join(parts) if parts else "no figures")]
    tensors = report.get("largest_tensors")
    if isinstance(tensors, list) and tensors:
        shown = []
        for tensor in tensors[:5]:
            if not isinstance(tensor, dict):
                continue
            text = _bytes(tensor.get("bytes")) or "? MiB"
            layer = tensor.get("layer")
            shape = tensor.get("shape")
            if layer:
                kind = tensor.get("kind")
                text += f" {kind} of {layer}" if kind and kind != layer else f" {layer}"
            if shape is not None:
                text += f" {tuple(shape) if isinstance(shape, list) else shape}"
            shown.append(text)
        if shown:
            lines.append("largest tensors: " + "; ".join(shown))
    return lines


def format_floor(floor):
    """One line on a floor: its epochs, and its trend with the projection.

    Args:
        floor: A `FloorSummary`.

    Returns:
        The line, without indentation.
    """
    if floor.series == "host":
        line = "floor of host memory (RSS, between steps): "
    else:
        line = f"floor of {floor.series} (memory in use between steps): "
    if floor.epochs == 1:
        line += f"{_mib(floor.last_mib)} in 1 epoch"
    else:
        line += (
            f"{_mib(floor.first_mib)} in the first epoch, {_mib(floor.last_mib)} "
            f"in the last of {floor.epochs}"
        )
    rate = floor.growth_mib_per_epoch
    if rate is None:
        return line + "; no rise found"
    line += f"; rising {rate:.1f} MiB per epoch"
    remaining = floor.epochs_to_limit
    if remaining is not None:
        line += (
            f": at that rate it reaches the {_mib(floor.limit_mib)} limit in about "
            f"{remaining} more epoch{'s' if remaining != 1 else ''}"
        )
    return line


def format_summary(summary):
    """A run's figures as a few lines of text.

    Args:
        summary: A `RunSummary`.

    Returns:
        The text, lines joined with newlines (no trailing newline).
    """
    if summary.name == ".":
        lines = [f"Run {summary.path}"]
    else:
        lines = [f"Run {summary.name} ({summary.path})"]
    if summary.first_step is None:
        lines.append("  no per-batch points")
    else:
        line = f"  steps {summary.first_step}-{summary.last_step}"
        if summary.epoch_ends:
            count = len(summary.epoch_ends)
            line += (
                f", {count} epoch{'s' if count != 1 else ''} "
                f"(ending at steps {_steps(summary.epoch_ends)})"
            )
            if summary.epoch_source == "keras":
                line += ", placed by the wall times of Keras' TensorBoard epochs"
        else:
            line += ", epoch ends not logged"
        lines.append(line)

    if summary.highest is not None:
        h = summary.highest
        line = f"  highest peak: {_mib(h.peak_mib)} on {h.device} at step {h.peak_step}"
        if h.peak_usage is not None:
            line += f" ({h.peak_usage:.0%} of its {_mib(h.limit_mib)} limit)"
        lines.append(line)
        if len(summary.devices) > 1:
            for d in summary.devices:
                if d.peak_mib is None:
                    continue
                line = f"    {d.device}: peak {_mib(d.peak_mib)} at step {d.peak_step}"
                if d.peak_usage is not None:
                    line += f" ({d.peak_usage:.0%} of {_mib(d.limit_mib)})"
                lines.append(line)
    elif summary.host is not None:
        # The monitor ran (host memory is logged) on a device that keeps
        # no memory statistics (a CPU under JAX, TensorFlow's CPU without BFC).
        lines.append("  memory: no device readings (the device keeps no memory statistics)")
    else:
        lines.append("  memory: not logged (MemoryMonitor with log_dir writes it)")

    host = summary.host
    if host is None:
        if summary.highest is not None:
            lines.append("  host memory (RSS): not logged")
    elif host.first_step == host.last_step:
        lines.append(f"  host memory (RSS): {_mib(host.last_mib)} at step {host.last_step}")
    else:
        lines.append(
            f"  host memory (RSS): {_mib(host.first_mib)} at step {host.first_step}, "
            f"{_mib(host.last_mib)} at step {host.last_step} "
            f"({host.growth_mib:+.1f} MiB); highest {_mib(host.peak_mib)} "
            f"at step {host.peak_step}"
        )

    for floor in summary.floors:
        lines.append("  " + format_floor(floor))

    if summary.final_k is None:
        lines.append("  micro-batches: not logged (MemoryGuard with log_dir writes them)")
    else:
        line = f"  micro-batches: settled on k={summary.final_k}"
        if summary.final_micro_batch_size is not None:
            line += f" (micro-batch {summary.final_micro_batch_size})"
        changes = summary.k_changes
        if changes:
            shown = ", ".join(f"after step {c.step}: {c.old} -> {c.new}" for c in changes[:10])
            more = f", ... ({len(changes)} in all)" if len(changes) > 10 else ""
            line += f"; {len(changes)} change{'s' if len(changes) != 1 else ''}: {shown}{more}"
        else:
            line += "; no change"
        lines.append(line)

        if not summary.recoveries:
            lines.append("  out-of-memory recoveries: none")
        else:
            steps = ", ".join(
                f"step {r.step}" + (f" x{r.count}" if r.count > 1 else "")
                for r in summary.recoveries[:10]
            )
            line = f"  out-of-memory recoveries: {summary.recovery_count} ({steps})"
            if summary.recovery_seconds is not None:
                line += (
                    f"; about {summary.recovery_seconds:.1f} s spent in them "
                    f"(time beyond a typical batch of "
                    f"{summary.typical_step_seconds:.3f} s)"
                )
            else:
                line += "; time spent not derivable from the wall times"
            lines.append(line)

    if summary.oom_reports:
        lines.append("  out-of-memory explanations:")
        for report in summary.oom_reports:
            first, *rest = format_oom_report(report)
            lines.append("    " + first)
            lines.extend("      " + line for line in rest)
    return "\n".join(lines)
