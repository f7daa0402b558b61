"""The PyTorch backend as `keras_memguard.backends.current()` gives it."""

NAME = "torch"
VALIDATION_IN_FIT = False
PROFILES_SPIKES = False


def make_probe(devices=None, memory_limit=None):
    """CUDA's allocator statistics, or the process's resident memory on the CPU."""
    from keras_memguard.backends.torch.probe import TorchMemoryProbe

    return TorchMemoryProbe(devices=devices, memory_limit=memory_limit)


def training_run(session, fit, log_key):
    """The run of one `fit` with the guard's `GuardSession` (`TorchTrainingRun`)."""
    from keras_memguard.backends.torch.run import TorchTrainingRun

    return TorchTrainingRun(session, fit, log_key)


def inference_run(session, kind):
    """The run of one `evaluate` or `predict` (`TorchInferenceRun`)."""
    from keras_memguard.backends.torch import run

    return run.inference_run(session, kind)


def mixin_class():
    """`MemGuardMixin` on PyTorch."""
    from keras_memguard.backends.torch.mixin import MemGuardMixin

    return MemGuardMixin


def multi_worker_preparer():
    """`prepare_multi_worker`: nothing to prepare off TensorFlow."""
    from keras_memguard.backends.shared import prepare_multi_worker

    return prepare_multi_worker


def batch_size_finder():
    """What `find_batch_size` asks of PyTorch (its `finder` module)."""
    from keras_memguard.backends.torch import finder

    return finder


def advice():
    """What `advise`'s measuring child asks of PyTorch (its `advice` module)."""
    from keras_memguard.backends.torch import advice as module

    return module


def sees_gpu():
    """Whether torch sees a CUDA device.

    CUDA device i is the i-th GPU of `CUDA_VISIBLE_DEVICES`, as a
    TensorFlow GPU ordinal is: NVML's probe maps both alike.
    """
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.device_count())


def record_writer(path):
    """`None`: TensorBoard's own record writer is used (no TensorFlow here)."""
    return None


def growth_evidence():
    """What the growth evidence asks of torch (its `growth` module)."""
    from keras_memguard.backends.torch import growth

    return growth
