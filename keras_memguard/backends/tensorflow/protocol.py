"""The TensorFlow backend as `keras_memguard.backends.current()` gives it."""

NAME = "tensorflow"
VALIDATION_IN_FIT = True
PROFILES_SPIKES = True


def make_probe(devices=None, memory_limit=None):
    """TensorFlow's allocator statistics (`AllocatorProbe`)."""
    from keras_memguard.backends.tensorflow.probe import AllocatorProbe

    return AllocatorProbe(devices=devices, memory_limit=memory_limit)


def training_run(guard, log_key):
    """The run of one `fit` under `guard` (`TfTrainingRun`)."""
    from keras_memguard.backends.tensorflow.run import TfTrainingRun

    return TfTrainingRun(guard, log_key)


def inference_run(guard, kind):
    """The run of one `evaluate` or `predict`, or `None` where unguarded."""
    from keras_memguard.backends.tensorflow import run

    return run.inference_run(guard, kind)


def spike_profiler(log_dir, spike_fraction, max_profiles):
    """`MemoryMonitor(profile_spikes=True)`'s tracer (`SpikeProfiler`)."""
    from keras_memguard.backends.tensorflow.spike_profiler import SpikeProfiler

    return SpikeProfiler(log_dir, spike_fraction, max_profiles)


def mixin_class():
    """`MemGuardMixin` on TensorFlow."""
    from keras_memguard.backends.tensorflow.mixin import MemGuardMixin

    return MemGuardMixin
