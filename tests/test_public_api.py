"""The public API is small, sorted, documented and shown in the docs."""

import inspect
import pathlib
import re

import keras_memguard

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


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


def _python_blocks(paths):
    return "\n".join(
        block
        for path in paths
        for block in re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)
    )


def test_the_guides_show_every_public_name_in_use():
    guides = sorted((DOCS / "guides").glob("*.md")) + [DOCS / "getting-started.md"]
    code = _python_blocks(guides)
    troubleshooting = (DOCS / "troubleshooting.md").read_text()
    for name in keras_memguard.__all__:
        if name.endswith("Error"):
            # Each error has its entry in the troubleshooting page.
            assert f"`{name}`" in troubleshooting, name
        else:
            assert re.search(rf"\b{name}\b", code), name


def test_every_public_name_has_a_reference_entry():
    entries = re.findall(r"^::: ([\w.]+)$", (DOCS / "reference.md").read_text(), flags=re.M)
    assert sorted(entry.rsplit(".", 1)[1] for entry in entries) == PUBLIC_API


def test_the_readme_shows_the_callbacks_in_use():
    code = _python_blocks([README])
    for name in ("MemoryMonitor", "MemoryGuard", "MemGuardMixin", "find_batch_size", "advise"):
        assert re.search(rf"\b{name}\b", code), name


def test_memory_guard_docstring_is_no_longer_than_keras_longest_callback_docstring():
    import keras

    longest = max(
        len(inspect.getdoc(obj).splitlines())
        for obj in vars(keras.callbacks).values()
        if inspect.isclass(obj) and inspect.getdoc(obj)
    )
    assert len(inspect.getdoc(keras_memguard.MemoryGuard).splitlines()) <= longest


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
