"""TensorBoard event writing, and every tag name the package writes.

Scalars go to the run directory `<log_dir>/memguard`, beside the `train` and
`validation` runs of `keras.callbacks.TensorBoard`, so the two never share an
event file. TensorBoard follows only the newest event file of a run
directory, so exactly one writer per directory is kept for the whole process
(`writer_for`): a monitor and a guard on the same `log_dir`, and repeated
`fit` calls, all append to one file. Each callback holds the writer from
`on_train_begin` to `on_train_end` (`acquire` / `release`); when the last
holder lets go, the file is flushed and closed (and its thread stopped), so
it is complete on disk when `fit` returns; the next `fit` opens the same
file again and appends (a new file per `fit` would be named within the same
second and could sort before the old one, which TensorBoard then skips).

Events are built with TensorBoard's own protobufs and framed by its
`RecordWriter`; a background thread does the framing (a checksum computed in
Python) and the disk I/O, and no TensorFlow op runs, which keeps per-batch
logging cheap.
"""

import logging
import os
import queue
import socket
import threading
import time

from tensorboard.compat.proto import event_pb2
from tensorboard.compat.proto import summary_pb2
from tensorboard.summary.writer.record_writer import RecordWriter

logger = logging.getLogger("keras_memguard")

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


class _EventFile:
    """Appends events to one event file from a background thread.

    Args:
        path: The event file; created with TensorBoard's version record
            when it does not exist, appended to when it does.
    """

    def __init__(self, path):
        new = not os.path.exists(path)
        self.path = path
        self._file = open(path, "ab")
        self._records = RecordWriter(self._file)
        self._queue = queue.Queue(maxsize=1000)
        self._failed = False
        self._thread = threading.Thread(
            target=self._run, name="keras_memguard-events", daemon=True
        )
        self._thread.start()
        if new:
            self.add(
                event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2")
            )

    def add(self, event):
        self._queue.put(event.SerializeToString())

    def _run(self):
        while True:
            data = self._queue.get()
            try:
                if data is None:
                    return
                if not self._failed:
                    self._records.write(data)
            except OSError as e:  # Logging never stops training.
                self._failed = True
                logger.warning(
                    "Writing TensorBoard events to %s failed: %s. Later "
                    "events of this file are dropped.",
                    self.path,
                    e,
                )
            finally:
                self._queue.task_done()

    def flush(self):
        self._queue.join()
        if not self._failed:
            self._file.flush()

    def close(self):
        self._queue.put(None)
        self._thread.join()
        self._file.close()


class ScalarWriter:
    """Appends scalar events to one event file of a run directory.

    Use `writer_for(log_dir)` rather than this constructor, so that one
    directory never gets two writers.

    Args:
        run_dir: The directory the event file is created in.
    """

    def __init__(self, run_dir):
        self.run_dir = run_dir
        self.path = None
        self._writer = None
        self._holders = set()
        self._lock = threading.Lock()

    def _open(self):
        # On first use (a callback that never logs leaves no file), and
        # again after `release` closed the file: the same file goes on.
        with self._lock:
            if self._writer is None:
                os.makedirs(self.run_dir, exist_ok=True)
                if self.path is None:
                    self.path = os.path.join(
                        self.run_dir,
                        "events.out.tfevents.%010d.%s.%d.memguard"
                        % (time.time(), socket.gethostname(), os.getpid()),
                    )
                self._writer = _EventFile(self.path)
            return self._writer

    def acquire(self, holder):
        """Marks `holder` (a callback) as writing until `release(holder)`.

        Acquiring twice without a release counts once, so a `fit` that
        raised before `on_train_end` does not keep the file open for good.
        """
        with self._lock:
            self._holders.add(id(holder))

    def release(self, holder):
        """Lets go of the writer; the last holder closes the event file.

        Events written later go to a new event file in the same directory.
        """
        with self._lock:
            self._holders.discard(id(holder))
            if self._holders:
                writer = None
            else:
                writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()

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
        writer = self._writer
        if writer is None:
            writer = self._open()
        writer.add(
            event_pb2.Event(
                wall_time=time.time(),
                step=step,
                summary=summary_pb2.Summary(value=values),
            )
        )

    def flush(self):
        """Writes pending events to disk."""
        writer = self._writer
        if writer is not None:
            writer.flush()


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
