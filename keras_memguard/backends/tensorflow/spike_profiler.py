"""A trace of the batch after a memory spike, with TensorFlow's profiler.

`MemoryMonitor(profile_spikes=True)` hands its per-batch peaks here: when a
batch's peak rises past `spike_fraction` over the one before, the next
batch runs under `tf.profiler` (host tracer level 2, so the Memory Profile
tool gets the allocators' events), at most `max_profiles` times per `fit`.
"""

import logging
import os
import time

from keras_memguard import step_functions as functions

logger = logging.getLogger("keras_memguard")


class SpikeProfiler:
    """Traces the train function call after a memory spike, for `MemoryMonitor`.

    `after_sample` compares each sample's peak with the previous one and arms
    a trace; `before_batch` (at the next `on_train_batch_begin`) puts a
    one-shot wrapper in `model.train_function` that runs the profiler around
    exactly that call, stopping it in a `finally`, so an error in the batch
    (an out-of-memory error) still writes the trace and never leaves the
    profiler running. Starting there, not at the spike's batch end, keeps
    validation and epoch-end work out of a trace armed at an epoch's last
    batch.

    Args:
        log_dir: The monitor's `log_dir`.
        fraction: `spike_fraction`.
        max_profiles: The most traces per `fit`.
    """

    def __init__(self, log_dir, fraction, max_profiles):
        self.log_dir = os.fspath(log_dir)
        self.plugin_dir = os.path.join(self.log_dir, "plugins", "profile")
        self.factor = 1.0 + fraction
        self.max_profiles = max_profiles
        # Every file written, over all fits.
        self.paths = []
        # Per fit: the previous sample's peak (MiB), the spike to trace
        # after as `(step, previous_mib, peak_mib)`, the traces left.
        self._previous = None
        self._spike = None
        self._left = 0
        self._busy_logged = False
        # `(model, wrapper, original)` while a wrapper waits for its call.
        self._installed = None
        # The spike whose trace is running, and the files there before it.
        self._running = None
        self._before = ()
        # time.time() after the latest trace was written: TensorFlow names
        # a trace's run directory after the second it is written in, so a
        # trace written in the same second would replace it (`_start`
        # waits for the next second).
        self._last_written = None

    def begin_fit(self):
        self._uninstall()
        self._previous = None
        self._spike = None
        self._left = self.max_profiles
        self._busy_logged = False

    def end_fit(self):
        self._uninstall()
        self._spike = None
        if self._running is not None:  # Not reached: `_trace` always stops.
            self._stop(self._running, save=True)

    def after_sample(self, peak_mib, step):
        previous = self._previous
        self._previous = peak_mib
        if (
            peak_mib is not None
            and previous  # None or 0: no relative jump to measure
            and peak_mib > previous * self.factor
            and self._left > 0
            and self._spike is None
        ):
            self._spike = (step, previous, peak_mib)

    def before_batch(self, model):
        spike = self._spike
        if spike is None or self._installed is not None:
            return
        self._spike = None
        original = model.train_function

        def traced(iterator):
            installed = self._installed
            if installed is None or installed[1] is not traced:
                # Left behind by a `fit` that raised before this call.
                return original(iterator)
            self._uninstall()
            return self._trace(original, iterator, spike)

        functions.set_train_function(model, traced)
        self._installed = (model, traced, original)

    def _uninstall(self):
        installed = self._installed
        if installed is None:
            return
        self._installed = None
        model, traced, original = installed
        if getattr(model, "train_function", None) is traced:
            functions.set_train_function(model, original)

    def _trace(self, function, iterator, spike):
        import tensorflow as tf

        if not self._start(spike):
            return function(iterator)
        try:
            logs = function(iterator)
        except (StopIteration, tf.errors.OutOfRangeError):
            # The end of the data, not a batch: trace the next one instead.
            self._stop(spike, save=False)
            self._left += 1
            self._spike = spike
            raise
        except BaseException:
            self._stop(spike, save=True)
            raise
        self._stop(spike, save=True)
        return logs

    def _start(self, spike):
        import tensorflow as tf

        last = self._last_written
        if last is not None and int(time.time()) == int(last):
            # Rare (two traces within a second; at most `max_profiles` per
            # fit): wait for the next second rather than overwrite.
            time.sleep(max(0.0, int(last) + 1 - time.time()))
        options = tf.profiler.experimental.ProfilerOptions(
            # Level 2 records the allocators' MemoryAllocation and
            # MemoryDeallocation events, which the Memory Profile tool reads.
            host_tracer_level=2,
            python_tracer_level=0,
            device_tracer_level=1,
        )
        try:
            tf.profiler.experimental.start(self.log_dir, options=options)
        except tf.errors.AlreadyExistsError:
            if not self._busy_logged:
                self._busy_logged = True
                logger.info(
                    "memory spike at step %d not traced: another TensorFlow "
                    "profiler session is running (keras.callbacks.TensorBoard"
                    "(profile_batch=...) or tf.profiler); later spikes in "
                    "this fit are traced when it is free, without this "
                    "message",
                    spike[0],
                )
            return False
        self._running = spike
        self._left -= 1
        step, previous, peak = spike
        self._before = set(self._written_files())
        logger.info(
            "memory peak rose from %.1f MiB to %.1f MiB (+%.0f%%) at step %d: "
            "tracing the next batch with the TensorFlow profiler into %s",
            previous,
            peak,
            100.0 * (peak / previous - 1.0),
            step,
            self.plugin_dir,
        )
        return True

    def _stop(self, spike, save):
        import tensorflow as tf

        self._running = None
        try:
            tf.profiler.experimental.stop(save=save)
        except tf.errors.OpError as error:
            # A trace that cannot be written must not end the training.
            logger.warning("the memory spike trace was not written: %s", error)
            return
        if not save:
            return
        self._last_written = time.time()
        new = sorted(set(self._written_files()) - self._before)
        where = new[-1] if new else self.plugin_dir
        self.paths.extend(new)
        logger.info(
            "trace of the batch after the memory spike at step %d written to "
            "%s (TensorBoard: Profile tab, tools memory_profile and "
            "trace_viewer)",
            spike[0],
            where,
        )

    def _written_files(self):
        import tensorflow as tf

        try:
            return tf.io.gfile.glob(
                os.path.join(self.plugin_dir, "*", "*.xplane.pb")
            )
        except tf.errors.OpError:
            return []
