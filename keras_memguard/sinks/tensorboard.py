"""TensorBoard event writing, the memory dashboard, and every tag name.

Scalars go to the run directory `<log_dir>/memguard`, beside the `train` and
`validation` runs of `keras.callbacks.TensorBoard`, so the two never share an
event file. TensorBoard follows only the newest event file of a run
directory, so exactly one writer per directory is kept for the whole process
(`writer_for`): a monitor and a guard on the same `log_dir`, and repeated
`fit` calls, all append to one file.

The training thread only appends `(step, wall time, tags, values)` to a
queue (`ScalarWriter.write`, `ScalarWriter.write_values`): no protobuf is
built and nothing is written there. The event bytes are encoded from those
rows (the protobuf wire format of TensorBoard's `Event` and `Summary`, with
each tag's bytes made once; rows of one step become one event) and framed by
TensorFlow's C++ record writer (`tf.io.TFRecordWriter`, which computes the
checksums; TensorBoard's own where TensorFlow is not loaded, on the JAX
backend), by a background thread every `FLUSH_SECS` seconds, and by
`flush()`. Each callback holds the writer from `on_train_begin` to
`on_train_end` (`acquire` / `release`); the monitor flushes at each epoch
end and the last holder's release flushes, so the file is complete on disk
when `fit` returns. Keras calls no callback when an exception escapes `fit`:
the background thread's flushes, and one more at interpreter exit
(`atexit`), put the rows of every completed batch on disk anyway.

The event file stays open until the process exits, so a later `fit` appends
to it (a new file per `fit` would be named within the same second and could
sort before the old one, which TensorBoard then skips); if the file was
deleted in between, a new one is started.

With the scalars, each writer writes a layout for TensorBoard's Custom
Scalars dashboard (`dashboard_layout`): a chart per device overlaying
current, peak and limit, the process's resident host memory, usage against
the guard's threshold, and the micro-batch count with the out-of-memory
recoveries. It is written once,
when the first scalars of a kind appear, and again only if a new device or
kind of scalar shows up.
"""

import atexit
import collections
import logging
import math
import os
import re
import socket
import struct
import threading
import time

from tensorboard.compat.proto import event_pb2
from tensorboard.compat.proto import summary_pb2
from tensorboard.compat.proto import tensor_pb2
from tensorboard.compat.proto import tensor_shape_pb2
from tensorboard.compat.proto import types_pb2
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.custom_scalar import metadata as custom_scalars_metadata

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
# The process's resident memory (RSS) on the host, not a device's.
HOST_RSS_MIB = "memory/host/rss_mib"
# The floor (the memory in use between steps) per epoch, and its growth per
# epoch while it keeps rising (`MemoryMonitor(growth=True)`); `{dev}` is a
# device's name or `host` for the resident memory.
FLOOR_MIB = "memory/{dev}/floor_mib"
GROWTH_MIB_PER_EPOCH = "memory/{dev}/growth_mib_per_epoch"
HOST = "host"
MICRO_BATCHES = "memguard/micro_batches"
MICRO_BATCH_SIZE = "memguard/micro_batch_size"
OOM_RECOVERIES = "memguard/oom_recoveries"
# The guard's `threshold` (a fraction, like `usage`).
THRESHOLD = "memguard/threshold"

# Seconds between the background thread's writes to disk.
FLUSH_SECS = 2.0

# Titles of the dashboard's category and charts (`{dev}` as above).
DASHBOARD_CATEGORY = "keras_memguard"
DEVICE_CHART = "{dev} memory: current, peak, limit and floor (MiB)"
HOST_CHART = "Host memory: resident set size of the process and its floor (MiB)"
USAGE_CHART = "Memory usage (peak / limit) and threshold"
MICRO_BATCH_CHART = "Micro-batches and out-of-memory recoveries"

_MIB = float(1024 * 1024)
_DEVICE_TAG = re.compile(r"^memory/([^/]+)/(current_mib|peak_mib|limit_mib|usage)$")
_USAGE_TAG = re.compile(r"^memory/[^/]+/usage$")


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


def dashboard_layout(devices=(), usage=True, guard=True, host=False):
    """Returns the Custom Scalars layout of the memory dashboard.

    Each chart is a multiline chart whose tag regular expressions match the
    tags this package writes, in every run (`<log_dir>/memguard`).

    Args:
        devices: Device names (`"gpu0"`, `"cpu0"`): one chart each, with
            `current_mib`, `peak_mib`, `limit_mib` and, where the growth
            test runs, `floor_mib`. Defaults to `()`.
        usage: Whether to add the chart of every device's `usage` with the
            guard's `threshold`. Defaults to `True`.
        guard: Whether to add the chart of `micro_batches` and
            `oom_recoveries`. Defaults to `True`.
        host: Whether to add the chart of the process's resident memory
            (`memory/host/rss_mib`) and its floor, after the device charts.
            Defaults to
            `False`.

    Returns:
        A `tensorboard.plugins.custom_scalar.layout_pb2.Layout`.
    """
    charts = [
        layout_pb2.Chart(
            title=DEVICE_CHART.format(dev=device),
            multiline=layout_pb2.MultilineChartContent(
                tag=[r"^memory/%s/(current|peak|limit|floor)_mib$" % re.escape(device)]
            ),
        )
        for device in devices
    ]
    if host:
        charts.append(
            layout_pb2.Chart(
                title=HOST_CHART,
                multiline=layout_pb2.MultilineChartContent(
                    tag=[
                        "^%s$" % re.escape(HOST_RSS_MIB),
                        "^%s$" % re.escape(FLOOR_MIB.format(dev=HOST)),
                    ]
                ),
            )
        )
    if usage:
        charts.append(
            layout_pb2.Chart(
                title=USAGE_CHART,
                multiline=layout_pb2.MultilineChartContent(
                    tag=[_USAGE_TAG.pattern, "^%s$" % re.escape(THRESHOLD)]
                ),
            )
        )
    if guard:
        charts.append(
            layout_pb2.Chart(
                title=MICRO_BATCH_CHART,
                multiline=layout_pb2.MultilineChartContent(
                    tag=[
                        "^(%s|%s)$"
                        % (re.escape(MICRO_BATCHES), re.escape(OOM_RECOVERIES))
                    ]
                ),
            )
        )
    return layout_pb2.Layout(
        category=[layout_pb2.Category(title=DASHBOARD_CATEGORY, chart=charts)]
    )


def layout_summary(layout):
    """Returns a `Summary` holding `layout` as the Custom Scalars plugin reads it.

    The same summary as `tensorboard.plugins.custom_scalar.summary.pb`, built
    without TensorFlow's protobufs.
    """
    tensor = tensor_pb2.TensorProto(
        dtype=types_pb2.DT_STRING,
        tensor_shape=tensor_shape_pb2.TensorShapeProto(),
        string_val=[layout.SerializeToString()],
    )
    return summary_pb2.Summary(
        value=[
            summary_pb2.Summary.Value(
                tag=custom_scalars_metadata.CONFIG_SUMMARY_TAG,
                metadata=custom_scalars_metadata.create_summary_metadata(),
                tensor=tensor,
            )
        ]
    )


# --------------------------------------------------------------------------
# Event encoding: the protobuf wire format of `Event` (wall_time = 1,
# double; step = 2, varint; summary = 5, message) holding a `Summary`
# (value = 1, repeated message) of `Summary.Value`s (tag = 1, string;
# simple_value = 2, float). Equal to `Event(...).SerializeToString()` up to
# field order; tests parse it back with TensorBoard's protobufs.

_pack_f32 = struct.Struct("<f").pack
_pack_f64 = struct.Struct("<d").pack


def _varint(value):
    value &= 0xFFFFFFFFFFFFFFFF  # int64 as protobuf writes a negative one
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _value_prefix(tag):
    """The bytes of a `Summary.Value` entry up to its float's 4 bytes."""
    name = tag.encode("utf-8")
    value = b"\x0a" + _varint(len(name)) + name + b"\x15"
    return b"\x0a" + _varint(len(value) + 4) + value


def _float32_bytes(value):
    try:
        return _pack_f32(value)
    except OverflowError:  # Beyond float32: TensorBoard shows +-inf.
        return _pack_f32(math.copysign(math.inf, value))


def encode_event(step, wall_time, summary_bytes):
    """Returns the bytes of an `Event` holding one serialized `Summary`."""
    return (
        b"\x09"
        + _pack_f64(wall_time)
        + b"\x10"
        + _varint(step)
        + b"\x2a"
        + _varint(len(summary_bytes))
        + summary_bytes
    )


def _record_writer(path):
    """A writer of TFRecord-framed records to `path`.

    The backend's (TensorFlow's C++ writer on the TensorFlow backend, which
    also opens remote paths such as `gs://...`); otherwise TensorBoard's own
    (the same framing, checksums computed in Python), so the JAX and
    PyTorch backends need no TensorFlow.
    """
    from keras_memguard import backends

    writer = backends.current().record_writer(path)
    if writer is not None:
        return writer
    from tensorboard.summary.writer.record_writer import RecordWriter

    return RecordWriter(open(path, "wb"))


class _EventFile:
    """One event file, framed as TensorFlow's record writer frames it.

    Args:
        path: The event file to create, starting with TensorBoard's version
            record.
    """

    def __init__(self, path):
        self.path = path
        self._records = _record_writer(path)
        self.write(
            event_pb2.Event(
                wall_time=time.time(), file_version="brain.Event:2"
            ).SerializeToString()
        )

    def write(self, data):
        self._records.write(data)

    def flush(self):
        self._records.flush()

    def close(self):
        self._records.close()


class ScalarWriter:
    """Appends scalar events to one event file of a run directory.

    Use `writer_for(log_dir)` rather than this constructor, so that one
    directory never gets two writers. `write` and `write_values` are what
    the training thread calls; the rest happens at `flush()` and on the
    writer's thread (see the module's docstring).

    Args:
        run_dir: The directory the event file is created in.
    """

    def __init__(self, run_dir):
        self.run_dir = run_dir
        self.path = None
        # (step, wall_time, tags or None, values or (tag, value) pairs).
        self._pending = collections.deque()
        self._file = None
        self._failed = False
        self._holders = set()
        self._lock = threading.Lock()  # holders and the thread
        self._io_lock = threading.Lock()  # encoding, the file
        self._thread = None
        self._stop = None
        # tag -> the bytes before its float; new tags update the dashboard.
        self._prefixes = {}
        self._devices = []
        self._has_usage = False
        self._has_guard = False
        self._has_host = False
        self._layout_bytes = None
        self._layout_event = None
        # The largest step written so far (`acquire`), read off the
        # training thread where rows are encoded (`_drain`).
        self._reached = 0

    # The training thread.

    def write(self, step, scalars):
        """Queues scalars at one step; they are written as a single event.

        Args:
            step: The integer step shown on TensorBoard's horizontal axis.
            scalars: `(tag, value)` pairs, a tuple or a list not changed
                afterwards (it is read later, on another thread); `None`
                values are skipped.
        """
        self._pending.append((step, time.time(), None, scalars))
        if self._thread is None:
            self._start()

    def write_values(self, step, tags, values):
        """Queues `values[i]` under `tags[i]` at one step (`None` skipped).

        The same as `write(step, zip(tags, values))`, with no pair built:
        for a caller that writes the same tags every batch.

        Args:
            step: The integer step.
            tags: A tuple of tag names.
            values: A tuple or list of numbers or `None`, as long as `tags`,
                not changed afterwards.
        """
        self._pending.append((step, time.time(), tags, values))
        if self._thread is None:
            self._start()

    def acquire(self, holder, step=0):
        """Marks `holder` (a callback) as writing until `release(holder)`.

        Acquiring twice without a release counts once, so a `fit` that
        raised before `on_train_end` does not keep the thread running for
        good.

        Args:
            holder: The callback.
            step: The last step `holder` wrote at, `0` if none.

        Returns:
            The step `holder` goes on from: `step`, or the largest step
            written to this run in this process where that is larger, so
            the fits of several callbacks on one `log_dir` (a search's
            copies, one per trial; a new callback per fold) follow one
            another on the step axis instead of overlapping.
        """
        with self._lock:
            self._holders.add(id(holder))
        with self._io_lock:
            self._drain()
            if self._file is not None and not os.path.exists(self._file.path):
                # Deleted since the last fit: start a new file.
                self._file.close()
                self._file = None
                self.path = None
            reached = self._reached
        self._start()
        return max(step, reached)

    def release(self, holder):
        """Lets go of the writer; the last holder flushes every event.

        The thread stops; the file stays open, and the next `fit` appends.
        """
        with self._lock:
            self._holders.discard(id(holder))
            if self._holders:
                return
            thread, stop = self._thread, self._stop
            self._thread = self._stop = None
        if thread is not None:
            stop.set()
            thread.join()
        self.flush()

    def flush(self):
        """Encodes every queued row and writes it to disk."""
        with self._io_lock:
            self._drain()
            if self._file is not None and not self._failed:
                try:
                    self._file.flush()
                except Exception as e:  # Logging never stops training.
                    self._fail(e)

    def close(self):
        """Flushes and closes the file and stops the thread (at exit)."""
        with self._lock:
            thread, stop = self._thread, self._stop
            self._thread = self._stop = None
        if thread is not None:
            stop.set()
            thread.join()
        self.flush()
        with self._io_lock:
            if self._file is not None:
                try:
                    self._file.close()
                except Exception:
                    pass
                self._file = None

    # The writer's thread and flushes.

    def _start(self):
        with self._lock:
            if self._thread is not None:
                return
            self._stop = threading.Event()
            self._thread = threading.Thread(
                target=self._run,
                args=(self._stop,),
                name="keras_memguard-events",
                daemon=True,
            )
            self._thread.start()

    def _run(self, stop):
        while not stop.wait(FLUSH_SECS):
            try:
                self.flush()
            except Exception:  # Logging never stops training.
                logger.exception("Writing TensorBoard events failed")

    def _fail(self, error):
        self._failed = True
        self._pending.clear()
        logger.warning(
            "Writing TensorBoard events to %s failed: %s. Later events of "
            "this directory are dropped.",
            self.path or self.run_dir,
            error,
        )

    def _open(self):
        try:
            os.makedirs(self.run_dir, exist_ok=True)
            self.path = os.path.join(
                self.run_dir,
                "events.out.tfevents.%010d.%s.%d.memguard"
                % (time.time(), socket.gethostname(), os.getpid()),
            )
            self._file = _EventFile(self.path)
            if self._layout_event is not None:  # the dashboard, in a new file
                self._file.write(self._layout_event)
        except Exception as e:
            self._fail(e)
            return False
        _register_exit_flush()
        return True

    def _drain(self):
        """Encodes and writes the queued rows; call with `_io_lock` held."""
        pending = self._pending
        if self._failed:
            pending.clear()
            return
        if not pending:
            return
        if self._file is None and not self._open():
            return
        prefixes = self._prefixes
        events = []
        layout_step = None  # the step where a tag was first seen
        step = wall = None
        parts = []
        while pending:
            row_step, row_wall, tags, values = pending.popleft()
            if row_step != step:
                if row_step > self._reached:
                    self._reached = row_step
                if parts:
                    events.append(encode_event(step, wall, b"".join(parts)))
                    parts = []
                step, wall = row_step, row_wall
            pairs = values if tags is None else zip(tags, values)
            for tag, value in pairs:
                if value is None:
                    continue
                prefix = prefixes.get(tag)
                if prefix is None:
                    prefix = prefixes[tag] = _value_prefix(tag)
                    if self._new_tag(tag) and layout_step is None:
                        layout_step, layout_wall = row_step, row_wall
                parts.append(prefix)
                parts.append(_float32_bytes(value))
        if parts:
            events.append(encode_event(step, wall, b"".join(parts)))
        if layout_step is not None:
            layout = self._layout_event_at(layout_step, layout_wall)
            if layout is not None:
                events.insert(0, layout)
        try:
            for event in events:
                self._file.write(event)
        except Exception as e:  # Logging never stops training.
            self._fail(e)

    def _new_tag(self, tag):
        """Notes what a new tag adds to the dashboard; whether it adds any."""
        match = _DEVICE_TAG.match(tag)
        changed = False
        if match and match.group(1) not in self._devices:
            self._devices.append(match.group(1))
            changed = True
        if (match and match.group(2) == "usage" or tag == THRESHOLD) and not self._has_usage:
            self._has_usage = changed = True
        if tag in (MICRO_BATCHES, OOM_RECOVERIES) and not self._has_guard:
            self._has_guard = changed = True
        if tag == HOST_RSS_MIB and not self._has_host:
            self._has_host = changed = True
        return changed

    def _layout_event_at(self, step, wall):
        """The dashboard layout's event, or `None` if it did not change."""
        layout = dashboard_layout(
            self._devices, self._has_usage, self._has_guard, self._has_host
        )
        layout_bytes = layout.SerializeToString()
        if not layout.category[0].chart or layout_bytes == self._layout_bytes:
            return None
        self._layout_bytes = layout_bytes
        self._layout_event = event_pb2.Event(
            wall_time=wall, step=step, summary=layout_summary(layout)
        ).SerializeToString()
        return self._layout_event


_writers = {}
_writers_lock = threading.Lock()
_exit_flush_registered = False


def _flush_all_at_exit():
    with _writers_lock:
        writers = list(_writers.values())
    for writer in writers:
        try:
            writer.close()
        except Exception:
            pass


def _register_exit_flush():
    global _exit_flush_registered
    with _writers_lock:
        if not _exit_flush_registered:
            # Registered after TensorFlow's import: runs before its own.
            atexit.register(_flush_all_at_exit)
            _exit_flush_registered = True


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
