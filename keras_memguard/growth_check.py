"""Proving that a loop does not leak: `check_growth`, and the growth evidence.

`check_growth` runs a function several times (a `fit` of one epoch, a
`predict`, a model build) and tests the memory left in use after each
call with `keras_memguard.growth` (the test `MemoryMonitor` uses across
epochs and calls). The evidence (`snapshot`, `evidence`) is what can be
counted cheaply in one pass over the objects the garbage collector tracks:
live Keras models and variables, the callbacks' lists and what they hold,
and what the backend adds (`keras_memguard.backends.current().
growth_evidence()`: traced functions, cached `tf.data` pipelines, live
tensors). A pass is taken at the start and when growth is found, never
per batch.
"""

import gc
import logging
import os
import warnings

import keras

from keras_memguard import backends
from keras_memguard import growth
from keras_memguard.probes import host as host_memory

logger = logging.getLogger("keras_memguard")

_MIB = 1024 * 1024
# Items of one callback list looked at for the bytes they hold.
_MAX_ITEMS = 4096
# A callback container is named in the evidence from this many bytes on.
_HOLDER_BYTES = _MIB


def _item_bytes(value, nbytes, depth=0):
    size = nbytes(value)
    if size is not None:
        return size
    size = getattr(value, "nbytes", None)  # numpy arrays
    if isinstance(size, int):
        return size
    if depth < 2:
        if isinstance(value, dict):
            value = list(value.values())[:_MAX_ITEMS]
        if isinstance(value, (list, tuple)):
            return sum(_item_bytes(v, nbytes, depth + 1) for v in value[:_MAX_ITEMS])
    return 0


def snapshot():
    """Counts, in one pass over the tracked objects, what growth evidence needs.

    Returns:
        A dict: `keras_models`, `keras_variables` (counts), `holders` (a
        dict from `"CallbackClass.attribute"` to `(items, bytes)` for the
        callbacks' list and dict attributes), and the backend's figures
        (`traced_functions`, `cached_datasets`, `live_tensors_mib`, where the
        backend has them). Never raises: a figure that could not be taken
        is missing.

    Example:

    ```python
    before = snapshot()
    # ... the loop ...
    print(evidence(before, snapshot()))
    ```
    """
    figures = {}
    try:
        module = backends.current().growth_evidence()
        objects = gc.get_objects()
        kinds = {}
        models = variables = 0
        callbacks = []
        for obj in objects:
            kind_of = type(obj)
            kind = kinds.get(kind_of)
            if kind is None:
                if issubclass(kind_of, keras.Model):
                    kind = "model"
                elif issubclass(kind_of, keras.Variable):
                    kind = "variable"
                elif issubclass(kind_of, keras.callbacks.Callback):
                    kind = "callback"
                else:
                    kind = ""
                kinds[kind_of] = kind
            if not kind:
                continue
            if kind == "model":
                models += 1
            elif kind == "variable":
                variables += 1
            else:
                callbacks.append(obj)
        figures["keras_models"] = models
        figures["keras_variables"] = variables
        holders = {}
        for callback in callbacks:
            for name, value in list(vars(callback).items()):
                if name in ("model", "params") or not isinstance(value, (list, dict)):
                    continue
                if not value:
                    continue
                key = f"{type(callback).__name__}.{name}"
                items = len(value)
                size = _item_bytes(value, module.nbytes)
                old = holders.get(key, (0, 0))
                holders[key] = (old[0] + items, old[1] + size)
        figures["holders"] = holders
        figures.update(module.count(objects, kinds))
        del objects
    except Exception as error:  # Evidence never stops training.
        logger.debug("growth evidence incomplete: %s", error)
    return figures


def _count_text(count, one, many):
    return f"{count} {one if count == 1 else many}"


def evidence(before, now, unit="epoch"):
    """The facts of `now` against `before` (two `snapshot`s).

    Args:
        before: The `snapshot` at the start, or `None`.
        now: The `snapshot` now.
        unit: The series' unit, for the wording. Defaults to `"epoch"`.

    Returns:
        A tuple of `keras_memguard.growth.Evidence`, one fact each.
    """
    before = before or {}
    facts = []
    for key, one, many in (
        ("keras_models", "live Keras model", "live Keras models"),
        ("keras_variables", "live Keras variable", "live Keras variables"),
        ("traced_functions", "traced graph of tf.function", "traced graphs of tf.functions"),
        (
            "cached_datasets",
            "live tf.data pipeline with a .cache()",
            "live tf.data pipelines with a .cache()",
        ),
    ):
        if key not in now:
            continue
        figure, old = now[key], before.get(key)
        if key == "cached_datasets" and not figure:
            continue
        text = _count_text(figure, one, many)
        if old is not None:
            text += f" ({old} at the start)"
        facts.append(growth.Evidence(key, figure, old, text))
    if "live_tensors_mib" in now:
        figure, old = now["live_tensors_mib"], before.get("live_tensors_mib")
    if "live_tensors_mib" in now and max(figure, old or 0.0) >= 0.1:
        text = f"live tensors hold {figure:.1f} MiB"
        if old is not None:
            text += f" ({old:.1f} MiB at the start)"
        facts.append(growth.Evidence("live_tensors_mib", figure, old, text))
    holders = now.get("holders") or {}
    old_holders = before.get("holders") or {}
    grown = sorted(
        (
            (size, key, items)
            for key, (items, size) in holders.items()
            if size >= _HOLDER_BYTES
            and size > old_holders.get(key, (0, 0))[1]
        ),
        reverse=True,
    )
    for size, key, items in grown[:3]:
        facts.append(
            growth.Evidence(
                "callback_outputs",
                size / _MIB,
                old_holders.get(key, (0, 0))[1] / _MIB if before else None,
                f"callback attribute `{key}` holds {items} items, "
                f"{size / _MIB:.1f} MiB of arrays",
            )
        )
    return tuple(facts)


def host_limit_bytes():
    """The host's physical memory in bytes (the RSS projection's limit), or `None`."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def check_growth(
    fn, repeats=6, raise_on_growth=True, args=(), kwargs=None, config=None
):
    """Runs `fn` several times and tests whether memory grows per call.

    After each call the garbage collector runs (garbage is not a leak) and
    the memory in use is read: every device's allocator (the backend's
    probe, as `MemoryMonitor` reads it) and the process's resident memory
    (RSS). The floors after the calls are tested for a rising trend with
    the test `MemoryMonitor` uses (`keras_memguard.growth`: Mann-Kendall,
    Theil-Sen slope, a rate and a rise worth telling, a rise in both
    halves). The first call is its own warm-up: what it sets up once
    (traces, weights) is in its floor, the first point; growth shows from
    the second call on, so `repeats=4` finds growth after three calls of it.

    This is the way to prove a loop does not leak in a test: run one
    iteration as `fn` and keep the default `raise_on_growth=True`.

    Args:
        fn: The function to run, e.g. `lambda: model.fit(x, y, epochs=1)`.
        repeats: How many times to call it, at least 4. Defaults to `6`.
        raise_on_growth: If `True`, growth raises `AssertionError` with the
            warning's text (rate, projection, evidence), so a test fails
            with it; if `False`, the results are returned either way.
            Defaults to `True`.
        args: Positional arguments for `fn`. Defaults to `()`.
        kwargs: Keyword arguments for `fn`, or `None`. Defaults to `None`.
        config: A `keras_memguard.growth.GrowthConfig` (from
            `keras_memguard.growth.make_config`) for every series, or
            `None` for the defaults (devices: `make_config()`; the host's
            resident memory, which creeps: `host_config(strict=False)`).
            Defaults to `None`.

    Returns:
        A tuple of `GrowthResult`, one per device with a reading, then one
        named `"host"` for the RSS; `unit` is `"call"`, `reaches_limit_at`
        is the call index at which the floor reaches the device's limit
        (for the host: its physical memory). Evidence is gathered for
        growing series.

    Raises:
        ValueError: If `repeats` is less than 4 or `fn` is not callable.
        AssertionError: If memory grows and `raise_on_growth` is `True`.

    Example:

    ```python
    def test_predict_loop_does_not_leak():
        keras_memguard.check_growth(lambda: model.predict(x, verbose=0))

    # Or look at the figures:
    for result in keras_memguard.check_growth(step, raise_on_growth=False):
        print(result.name, result.growing, result.slope_mib)
    ```
    """
    if not callable(fn):
        raise ValueError(f"`fn` must be callable. Received: fn={fn!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 4:
        raise ValueError(
            "`repeats` must be an integer of at least 4 (the trend test "
            f"needs four floors). Received: repeats={repeats!r}"
        )
    host_config = config or growth.host_config(strict=False)
    config = config or growth.make_config()
    kwargs = kwargs or {}
    probe = backends.current().make_probe()
    host = host_memory.shared_probe()
    before = None
    names = None
    floors = []
    for call in range(repeats):
        fn(*args, **kwargs)
        gc.collect()
        with warnings.catch_warnings():
            # An unknown limit is said in the result (no projection).
            warnings.simplefilter("ignore", UserWarning)
            samples = probe.sample()
        if names is None:
            names = [sample.device for sample in samples]
            before = snapshot()
        floors.append([s.current_bytes for s in samples] + [host.rss_bytes()])
    limits = []
    for device in probe.devices:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                limits.append(probe.limit_bytes(device))
        except Exception:  # An unknown limit only means no projection.
            limits.append(None)
    limits.append(host_limit_bytes())
    xs = tuple(float(i) for i in range(repeats))
    results = []
    for i, name in enumerate(names + ["host"]):
        ys = [row[i] for row in floors]
        if all(y is None for y in ys):
            continue
        results.append(
            growth.assess(
                host_config if name == "host" else config, name, "call", xs, ys, limits[i]
            )
        )
    if any(r.growing for r in results):
        facts = evidence(before, snapshot(), "call")
        results = [r._replace(evidence=facts) if r.growing else r for r in results]
        if raise_on_growth:
            raise AssertionError(
                "\n".join(
                    growth.warning_text(r, f"{repeats} calls of {getattr(fn, '__name__', 'fn')}")
                    for r in results
                    if r.growing
                )
            )
    return tuple(results)
