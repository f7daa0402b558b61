"""Runs the whole test process under TensorFlow's BFC CPU allocator.

Set before TensorFlow is imported, so every allocation is counted (the
default CPU allocator misses small ones) and a generous cap is in force.
Tests that need a small cap, and so real out-of-memory errors, start their own
process through `keras_memguard.testing.run_with_memory_cap`.
"""

import os

SUITE_MEMORY_LIMIT_MIB = 8192

# The JAX and PyTorch backends' tests run in a process of their own
# (KERAS_BACKEND=jax or torch): each run collects its own folder only.
_BACKEND_FOLDERS = {"jax": "jax_backend", "torch": "torch_backend"}
collect_ignore = [
    folder
    for backend, folder in _BACKEND_FOLDERS.items()
    if os.environ.get("KERAS_BACKEND") != backend
]

os.environ.update(
    {
        "TF_CPU_ALLOCATOR_USE_BFC": "true",
        "TF_CPU_BFC_MEM_LIMIT_IN_MB": str(SUITE_MEMORY_LIMIT_MIB),
        "TF_ENABLE_ONEDNN_OPTS": "0",
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "KERAS_BACKEND": "tensorflow",
    }
)


import pytest  # noqa: E402

# With MEMGUARD_TEST_SUBSET=floor (the floor ends in `.ci/run`, TensorFlow's
# and PyTorch's), the slow tests run only from these files: the training
# core, the guard, the mixin, the replay, inference, the profiler and
# MirroredStrategy, where Keras' and the frameworks' internals differ by
# version; and the tests marked `slow(floor=True)` in other files: tests
# slow only for their seconds (no process, no cap), which the floor runs as
# it would fast ones, and the one two-worker test whose replays are
# MirroredStrategy's.
# The finder, the advice, the examples, the benchmarks' smoke runs, the
# growth checks, the planning figures and the user models run at the
# newest end; the fast tests run at both.
FLOOR_SLOW_FILES = frozenset(
    (
        "test_bad_input.py",
        "test_compat.py",
        "test_guard.py",
        "test_inference.py",
        "test_masked_losses.py",
        "test_micro_batch.py",
        "test_mirrored.py",
        "test_monitor.py",
        "test_own_train_step.py",
        "test_profile_spikes.py",
        "test_remat.py",
        "test_torch_guard.py",
        "test_torch_probe.py",
        "test_torch_replay.py",
        "test_torch_step.py",
    )
)


def _is_slow(item):
    return item.get_closest_marker("slow") is not None


def _floor_runs(item):
    """Whether the floor ends run `item`, a slow test."""
    return item.path.name in FLOOR_SLOW_FILES or item.get_closest_marker(
        "slow"
    ).kwargs.get("floor", False)


def pytest_collection_modifyitems(config, items):
    # The files with slow tests first, each file's tests kept together (a
    # module fixture that slow and fast tests share is not built twice):
    # the workers then end on files of fast tests, not one worker on a
    # minutes-long test while the other waits.
    slow_files = {item.path for item in items if _is_slow(item)}
    items.sort(key=lambda item: item.path not in slow_files)
    if os.environ.get("MEMGUARD_TEST_SUBSET") != "floor":
        return
    kept, left_out = [], []
    for item in items:
        if _is_slow(item) and not _floor_runs(item):
            left_out.append(item)
        else:
            kept.append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept


@pytest.fixture(autouse=True)
def _plan_cache_per_test(tmp_path, monkeypatch):
    """Each test gets its own `$KERAS_HOME`: no plan is shared by two tests
    (their models are often alike), none lands in the user's home."""
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras_home"))


def pytest_terminal_summary(terminalreporter):
    """Prints how many documentation code blocks ran, and the excerpts."""
    ran = {}
    for outcome in ("passed", "failed"):
        ran[outcome] = sum(
            dict(report.user_properties).get("docs_blocks", 0)
            for report in terminalreporter.stats.get(outcome, ())
            if getattr(report, "when", None) == "call"
        )
    if not any(ran.values()):
        return
    import docs_blocks

    _, excerpts = docs_blocks.counts(docs_blocks.all_blocks())
    terminalreporter.write_line(
        f"documentation code blocks: {ran['passed']} ran, {ran['failed']} failed, "
        f"{excerpts} marked as excerpts (not run)"
    )
