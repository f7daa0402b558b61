"""TensorBoard event writing, and every tag name the package writes.

Scalars go to the run directory `<log_dir>/memguard`, beside the `train` and
`validation` runs of `keras.callbacks.TensorBoard`, so the two never share an
event file. TensorBoard follows only the newest event file of a run
directory, so exactly one writer per directory is kept for the whole process
(`writer_for`): a monitor and a guard on the same `log_dir`, and repeated
`fit` calls, all append to one file.

Events are built with TensorBoard's own protobufs and written by its
`EventFileWriter` (a background thread does the disk I/O); no TensorFlow op
runs, which keeps per-batch logging cheap.
"""

import os
import threading
import time

from tensorboard.compat.proto import event_pb2
from tensorboard.compat.proto import summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter

RUN_NAME = "memguard"

# Tag templates; `{dev}` is a device name such as "gpu0" or "cpu0".
CURRENT_MIB = "memory/{dev}/current_mib"
PEAK_MIB = "memory/{dev}/peak_mib"
LIMIT_MIB = "memory/{dev}/limit_mib"
USAGE = "memory/{dev}/usage"
EPOCH_PEAK_MIB = "memory/{dev}/epoch_peak_mib"
NVML_USED_MIB = "memory/{dev}/nvml_used_mib"
NVML_PROCESS_MIB = "memory/{dev}/nvml_process_mib"
GPU_PERCENT = "utilization/{dev}/gpu_percent"
MICRO_BATCHES = "memguard/micro_batches"
MICRO_BATCH_SIZE = "memguard/micro_batch_size"
OOM_RECOVERIES = "memguard/oom_recoveries"

_MIB = float(1024 * 1024)


def device_tags(device):
    """Returns the per-batch tag names of one device.

    Args:
        device: A device name such as `"gpu0"`.

    Returns:
        A dict with keys `current`, `peak`, `limit`, `usage`, `epoch_peak`,
        `nvml_used`, `nvml_process`, `gpu_percent`.
    """
    return {
        "current": CURRENT_MIB.format(dev=device),
        "peak": PEAK_MIB.format(dev=device),
        "limit": LIMIT_MIB.format(dev=device),
        "usage": USAGE.format(dev=device),
        "epoch_peak": EPOCH_PEAK_MIB.format(dev=device),
        "nvml_used": NVML_USED_MIB.format(dev=device),
        "nvml_process": NVML_PROCESS_MIB.format(dev=device),
        "gpu_percent": GPU_PERCENT.format(dev=device),
    }


def to_mib(num_bytes):
    """Converts bytes to MiB as a float; `None` stays `None`."""
    return None if num_bytes is None else num_bytes / _MIB


class ScalarWriter:
    """Appends scalar events to one event file of a run directory.

    Use `writer_for(log_dir)` rather than this constructor, so that one
    directory never gets two writers.

    Args:
        run_dir: The directory the event file is created in.
    """

    def __init__(self, run_dir):
        self.run_dir = run_dir
        self._writer = None

    def write(self, step, scalars):
        """Writes scalars at one step as a single event.

        Args:
            step: The integer step shown on TensorBoard's horizontal axis.
            scalars: Iterable of `(tag, value)` pairs; `None` values are
                skipped.
        """
        values = [
            summary_pb2.Summary.Value(tag=tag, simple_value=value)
            for tag, value in scalars
            if value is not None
        ]
        if not values:
            return
        if self._writer is None:
            # Created on first use: a callback that never logs leaves no file.
            self._writer = EventFileWriter(self.run_dir, max_queue_size=1000)
        self._writer.add_event(
            event_pb2.Event(
                wall_time=time.time(),
                step=step,
                summary=summary_pb2.Summary(value=values),
            )
        )

    def flush(self):
        """Writes pending events to disk."""
        if self._writer is not None:
            self._writer.flush()


_writers = {}
_writers_lock = threading.Lock()


def writer_for(log_dir):
    """Returns the process-wide writer of `<log_dir>/memguard`.

    Args:
        log_dir: The TensorBoard log directory the user passed.

    Returns:
        A `ScalarWriter`, the same object for the same directory.
    """
    run_dir = os.path.join(os.path.abspath(os.fspath(log_dir)), RUN_NAME)
    with _writers_lock:
        writer = _writers.get(run_dir)
        if writer is None:
            writer = _writers[run_dir] = ScalarWriter(run_dir)
        return writer
