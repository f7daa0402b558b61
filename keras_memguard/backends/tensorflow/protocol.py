"""The TensorFlow backend as `keras_memguard.backends.current()` gives it."""

NAME = "tensorflow"
VALIDATION_IN_FIT = True
PROFILES_SPIKES = True


def make_probe(devices=None, memory_limit=None):
    """TensorFlow's allocator statistics (`AllocatorProbe`)."""
    from keras_memguard.backends.tensorflow.probe import AllocatorProbe

    return AllocatorProbe(devices=devices, memory_limit=memory_limit)


def training_run(session, fit, log_key):
    """The run of one `fit` with the guard's `GuardSession` (`TfTrainingRun`)."""
    from keras_memguard.backends.tensorflow.run import TfTrainingRun

    return TfTrainingRun(session, fit, log_key)


def inference_run(session, kind):
    """The run of one `evaluate` or `predict`, or `None` where unguarded."""
    from keras_memguard.backends.tensorflow import run

    return run.inference_run(session, kind)


def spike_profiler(log_dir, spike_fraction, max_profiles):
    """`MemoryMonitor(profile_spikes=True)`'s tracer (`SpikeProfiler`)."""
    from keras_memguard.backends.tensorflow.spike_profiler import SpikeProfiler

    return SpikeProfiler(log_dir, spike_fraction, max_profiles)


def mixin_class():
    """`MemGuardMixin` on TensorFlow."""
    from keras_memguard.backends.tensorflow.mixin import MemGuardMixin

    return MemGuardMixin


def multi_worker_preparer():
    """`prepare_multi_worker` for `MultiWorkerMirroredStrategy`."""
    from keras_memguard.backends.tensorflow.multi_worker import prepare_multi_worker

    return prepare_multi_worker


def batch_size_finder():
    """What `find_batch_size` asks of TensorFlow (its `finder` module)."""
    from keras_memguard.backends.tensorflow import finder

    return finder


def advice():
    """What `advise`'s measuring child asks of TensorFlow (its `advice` module)."""
    from keras_memguard.backends.tensorflow import advice as module

    return module


def sees_gpu():
    """Whether TensorFlow lists a physical GPU."""
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU"))


def record_writer(path):
    """TensorFlow's C++ record writer (it also opens `gs://` and other remote paths)."""
    import tensorflow as tf

    return tf.io.TFRecordWriter(path)


def growth_evidence():
    """What the growth evidence asks of tensorflow (its `growth` module)."""
    from keras_memguard.backends.tensorflow import growth

    return growth
