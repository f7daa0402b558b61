"""Every private Keras/TensorFlow name lives in `training.compat` and resolves here."""

import importlib
import pathlib
import re

import keras
import pytest
import tensorflow as tf

from keras_memguard.backends import compat

PACKAGE = pathlib.Path(compat.__file__).resolve().parents[1]


def _owner(path):
    if path == "CollectiveAllReduceExtended":
        module = importlib.import_module(
            "tensorflow.python.distribute.collective_all_reduce_strategy"
        )
        return module.CollectiveAllReduceExtended
    try:
        return importlib.import_module(path)
    except ImportError:
        module, _, name = path.rpartition(".")
        return getattr(importlib.import_module(module), name)


def _compiled_model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    return model


@pytest.mark.parametrize("owner,name", compat.PRIVATE_NAMES)
def test_every_private_name_resolves_on_this_version(owner, name):
    version = tuple(int(part) for part in keras.__version__.split(".")[:2])
    if (owner, name) in compat.OPTIONAL_NAMES and version < (3, 9):
        pytest.skip(f"{name} is Keras 3.9+; compat falls back")
    if owner == "tf.function":
        target = tf.function(lambda: 0)  # set by `__init__`
    else:
        target = _owner(owner)
    if owner == "keras.Model" and not hasattr(target, name):
        target = _compiled_model()  # Set by `__init__`/`compile`.
    if owner == "keras.optimizers.Optimizer":
        target = keras.optimizers.SGD(0.1)
    if owner == "keras.metrics.MeanMetricWrapper":  # set by `__init__`
        target = keras.metrics.MeanMetricWrapper(keras.metrics.mean_absolute_error)
    if owner == "tensorflow.python.eager.context.Context":
        target = _owner("tensorflow.python.eager.context").context()  # an instance's
    assert hasattr(target, name), f"{owner}.{name} (Keras {keras.__version__})"


def test_only_metrics_that_accumulate_per_sample_are_updated_per_micro_batch():
    def own(y_true, y_pred):
        return keras.ops.mean(y_pred)

    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2, activation="softmax")(inputs))
    keras_own = [
        "mae", "mse", "accuracy", "categorical_accuracy", keras.metrics.AUC(),
        keras.metrics.R2Score(),
        keras.metrics.TopKCategoricalAccuracy(1), keras.metrics.CosineSimilarity(),
    ]
    model.compile("sgd", "categorical_crossentropy", metrics=keras_own + [own, keras.losses.Huber()])
    compat.symbolic_build(model, (tf.zeros((4, 3)), tf.zeros((4, 2))))
    told = {
        m.name: compat.metric_accumulates_per_sample(m)
        for m in compat.compiled_metrics(model).metrics
    }
    assert told.pop("own") is False and told.pop("huber_loss") is False, told
    assert all(told.values()) and len(told) == len(keras_own), told


def test_compat_helpers_work_on_a_compiled_model():
    model = _compiled_model()
    x = tf.zeros((4, 3))
    compat.symbolic_build(model, (x, tf.zeros((4, 2))))
    assert compat.loss_tracker(model) is not None
    assert compat.compiled_loss(model) is not None
    assert compat.compiled_metrics(model) is not None
    assert compat.call_has_training_arg(model) in (True, False)
    assert model in compat.all_layers(model)
    assert compat.learning_rate_variable(model.optimizer) is not None
    loss = compat.compute_loss(model, x, tf.ones((4, 2)), model(x), None)
    assert float(loss) > 0
    assert float(compat.unscale_loss_for_distribution(loss)) == float(loss)
    wrapped = compat.autoconvert_optionals(model, lambda data: data)
    assert wrapped((tf.experimental.Optional.empty(None), 1)) == (None, 1)
    spec = compat.with_unknown_batch_size(tf.TensorSpec((4, 3)))
    assert spec.shape.as_list() == [None, 3]


def test_a_missing_name_names_the_supported_versions():
    with pytest.raises(Exception) as info:
        compat._attribute(object(), "_no_such_name")
    message = str(info.value)
    assert "_no_such_name" in message and "Keras 3.8" in message
    assert keras.__version__ in message


def test_no_other_module_names_a_private_keras_or_tensorflow_name():
    private = re.compile(
        r"keras\.src|tensorflow\.python|\._(compute_loss|loss_tracker|"
        r"symbolic_build|maybe_symbolic_build|make_function|autoconvert_optionals|"
        r"compile_loss|compile_metrics|call_has_training_arg|flatten_layers|"
        r"get_metrics_result_or_logs|learning_rate|in_multi_worker_mode|"
        r"update_metrics_variables|get_jax_state|unbatch|batch)\b"
    )
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "backends" / "compat.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if private.search(line):
                offenders.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_cluster_value_is_none_outside_a_cluster():
    # No coordination service in a single process: nothing stored, no hang.
    assert compat.cluster_value("keras_memguard/out_of_memory_worker", 50) is None


def test_a_peer_abort_is_told_by_error_type_and_the_stored_worker_not_text():
    from keras_memguard.backends.tensorflow import multi_worker

    # The text a worker reports, but no worker index stored in the cluster:
    # not taken for a peer's out-of-memory abort.
    lookalike = tf.errors.AbortedError(
        None, None, "keras_memguard: worker 1 ran out of memory: OOM"
    )
    assert multi_worker._raise_if_peer_aborted(lookalike) is None
    # Another error type is never a peer's abort, whatever it says.
    other = tf.errors.ResourceExhaustedError(
        None, None, "Collective ops is aborted by: keras_memguard"
    )
    assert multi_worker._raise_if_peer_aborted(other) is None


def test_auto_jit_compile_resolves_as_on_a_gpu_within_and_as_before_after():
    def resolved(**kwargs):
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse", **kwargs)
        return model.jit_compile

    assert resolved() is False  # No GPU here: Keras turns XLA off.
    with compat.resolving_auto_jit_compile_as_on_gpu():
        assert resolved() is True
        assert resolved(jit_compile=False) is False
        with tf.distribute.MirroredStrategy(["CPU:0"]).scope():
            assert resolved() is False  # Off under a strategy, as on a GPU.
    assert resolved() is False
