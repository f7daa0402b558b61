"""The public API is small, sorted, documented and shown in the README."""

import inspect
import pathlib
import re

import keras_memguard

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


# The public API, written out: adding, removing or renaming a public name
# is a decision, so it must change this list too.
PUBLIC_API = [
    "AllocatorProbe",
    "AllocatorSample",
    "BatchSizeResult",
    "CompiledStepOutOfMemoryError",
    "DevicesAlreadyInitializedError",
    "DistributedOutOfMemoryError",
    "GrowthResult",
    "MemGuardError",
    "MemGuardMixin",
    "MemoryGuard",
    "MemoryLimitUnknownError",
    "MemoryMonitor",
    "MicroBatchTooLargeError",
    "MissingExtraError",
    "NvmlProbe",
    "NvmlSample",
    "UnsupportedTrainingSetupError",
    "advise",
    "check_growth",
    "configure_devices",
    "configured_memory_limits",
    "find_batch_size",
    "prepare_multi_worker",
]


def test_all_is_the_pinned_public_api():
    assert PUBLIC_API == sorted(PUBLIC_API)
    assert keras_memguard.__all__ == PUBLIC_API


def test_every_public_name_resolves_and_is_listed_by_dir():
    listed = dir(keras_memguard)
    for name in keras_memguard.__all__:
        assert name in listed, name
        assert hasattr(keras_memguard, name), name


def test_every_public_name_is_documented():
    for name in keras_memguard.__all__:
        obj = getattr(keras_memguard, name)
        doc = inspect.getdoc(obj)
        assert doc and len(doc.splitlines()[0]) > 10, name


def test_readme_shows_every_public_name_in_use():
    text = README.read_text()
    code = "\n".join(re.findall(r"```python\n(.*?)```", text, flags=re.S))
    for name in keras_memguard.__all__:
        if name.endswith("Error"):
            # Errors are listed in the README's table of errors.
            assert f"`{name}`" in text, name
        else:
            assert re.search(rf"\b{name}\b", code), name


# The training core's names for a `train_step` of your own, written out.
TRAINING_API = [
    "AccumulatedGradients",
    "MicroBatch",
    "accumulate_gradients",
    "has_batch_statistics_layers",
    "make_step_function",
    "micro_batch_train_step",
    "split_micro_batches",
]


def test_training_all_is_pinned_and_documented():
    import keras_memguard.backends.tensorflow as training

    assert training.__all__ == TRAINING_API
    for name in training.__all__:
        doc = inspect.getdoc(getattr(training, name))
        assert doc and len(doc.splitlines()[0]) > 10, name
