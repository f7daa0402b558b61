"""Every private Keras and TensorFlow name keras_memguard uses, in one place.

keras_memguard trains through the same pieces Keras' own train steps use
(the compiled loss, the loss tracker, the per-replica reduction on
TensorFlow; the stateless loss and metrics updates on JAX; the torch
trainer's step and epoch iterator on PyTorch). Those pieces
are private and move between releases, so no other module names them: they
go through the functions here, which detect what the installed version has
and raise `UnsupportedTrainingSetupError` naming the versions when something
is missing. Checked against TensorFlow 2.18 with Keras 3.8 through
TensorFlow 2.21 with Keras 3.15 (`PRIVATE_NAMES` lists each name; the test
suite resolves every one on both ends), Keras 3.15's JAX trainer
(`JAX_PRIVATE_NAMES`, resolved by the JAX tests) and its torch trainer
(`TORCH_PRIVATE_NAMES`, resolved by the torch tests; checked on Keras 3.8
too: 3.8's `apply_mask` divides by `valid + epsilon` where 3.15 uses
`divide_no_nan`, and 3.8's loss tracker counts the first input's rows
where 3.15 counts the first input that is not `None`; neither changes what
the functions here return).

TensorFlow is imported on first use, so that the JAX and PyTorch backends'
training cores can use this module where TensorFlow is not installed.
"""

import contextlib
import functools
import importlib
import importlib.metadata
import types

import keras
import numpy as np
from keras import tree

from keras_memguard.errors import UnsupportedTrainingSetupError

SUPPORTED = "TensorFlow 2.18-2.21 with Keras 3.8-3.15"

# Every private name used, as `(owner, name)`: a module path and one of its
# attributes, or a class (dotted path) and one of its attributes. Attributes
# set on instances (a compiled model's `_loss_tracker`, an optimizer's
# `_learning_rate`) are looked up on a compiled model by the test suite.
PRIVATE_NAMES = (
    ("keras.src.backend.tensorflow.trainer", "reduce_per_replica"),
    ("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer"),
    ("keras.src.backend.tensorflow.trainer", "potentially_ragged_concat"),
    ("keras.src.backend.tensorflow.trainer", "convert_to_np_if_not_ragged"),
    ("keras.src.losses.loss", "unscale_loss_for_distribution"),
    ("tensorflow.python.eager.context", "context"),
    ("tensorflow.python.eager.context.Context", "_context_handle"),
    (
        "tensorflow.python.distribute.collective_all_reduce_strategy",
        "CollectiveAllReduceExtended",
    ),
    ("keras.Model", "_compute_loss"),
    ("keras.Model", "_symbolic_build"),
    ("keras.Model", "_maybe_symbolic_build"),
    ("keras.Model", "_make_function"),
    ("keras.Model", "_get_metrics_result_or_logs"),
    ("keras.Model", "_flatten_layers"),
    ("keras.Model", "_loss_tracker"),
    ("keras.Model", "_compile_loss"),
    ("keras.Model", "_compile_metrics"),
    ("keras.Model", "_call_has_training_arg"),
    ("keras.metrics.MeanMetricWrapper", "_fn"),
    ("keras.optimizers.Optimizer", "_learning_rate"),
    ("CollectiveAllReduceExtended", "_in_multi_worker_mode"),
    # Optional: Keras 3.9+ only; `autoconvert_optionals` falls back.
    ("tensorflow.TensorSpec", "_unbatch"),
    ("tensorflow.TensorSpec", "_batch"),
    ("keras.Model", "_autoconvert_optionals"),
    ("tensorflow.core.protobuf.bfc_memory_map_pb2", "MemoryDump"),
    ("tensorflow.compiler.xla.service.hlo_pb2", "HloProto"),
    ("tensorflow.compiler.tf2xla.python.xla", "optimization_barrier"),
    ("keras.src.losses.loss", "apply_mask"),
    ("keras.src.losses.loss", "reduce_values"),
    ("keras.src.backend", "get_keras_mask"),
    ("keras.src.backend", "set_keras_mask"),
    ("tf.function", "_omit_frequent_tracing_warning"),
    ("keras.src.trainers.data_adapters", "get_data_adapter"),
    ("keras.src.trainers.trainer", "model_supports_jit"),
    ("keras.src.trainers.trainer.Trainer", "_resolve_auto_jit_compile"),
    ("keras.Model", "_distribute_strategy"),
)
OPTIONAL_NAMES = (("keras.Model", "_autoconvert_optionals"),)
# The JAX trainer's private names, resolved where JAX is installed.
JAX_PRIVATE_NAMES = (
    ("keras.src.backend.jax.trainer", "JAXTrainer"),
    ("keras.src.backend.jax.trainer.JAXTrainer", "compute_loss_and_updates"),
    ("keras.src.backend.jax.trainer.JAXTrainer", "_update_metrics_variables"),
    ("keras.src.backend.jax.trainer.JAXTrainer", "_get_jax_state"),
    ("keras.src.backend.jax.trainer.JAXTrainer", "jax_state_sync"),
    ("keras.Model", "_symbolic_build"),
    ("keras.src.losses.loss", "reduce_values"),
    ("keras.src.backend", "get_keras_mask"),
    ("keras.src.backend", "set_keras_mask"),
)
# The torch trainer's private names, resolved where torch is installed.
TORCH_PRIVATE_NAMES = (
    ("keras.src.backend.torch.trainer", "TorchTrainer"),
    ("keras.src.backend.torch.trainer", "TorchEpochIterator"),
    ("keras.src.backend", "get_keras_mask"),
    ("keras.src.backend", "set_keras_mask"),
    ("keras.src.losses.loss", "apply_mask"),
    ("keras.src.losses.loss", "reduce_values"),
    ("keras.Model", "_compute_loss"),
    ("keras.Model", "_loss_tracker"),
    ("keras.Model", "_compile_loss"),
    ("keras.Model", "_compile_metrics"),
    ("keras.Model", "_call_has_training_arg"),
    ("keras.Model", "_symbolic_build"),
    ("CompileLoss", "_flat_losses"),
)


class _TensorFlow:
    """`tensorflow`, imported on first attribute access."""

    def __getattr__(self, name):
        import tensorflow

        return getattr(tensorflow, name)


tf = _TensorFlow()


def _tensorflow_version():
    try:
        return importlib.metadata.version("tensorflow")
    except importlib.metadata.PackageNotFoundError:
        try:
            return importlib.metadata.version("tensorflow-cpu")
        except importlib.metadata.PackageNotFoundError:
            return "not installed"


def _missing(name, error=None):
    return UnsupportedTrainingSetupError(
        f"keras_memguard needs the private {name} of Keras/TensorFlow, which "
        f"the installed versions lack (Keras {keras.__version__}, "
        f"TensorFlow {_tensorflow_version()}). Supported: {SUPPORTED}. HINT: "
        "install a supported pair, e.g. `pip install "
        "'tensorflow-cpu>=2.18,<2.22' 'keras>=3.8,<3.16'`."
        + (f" ({error})" if error else "")
    )


def _import_attribute(module, name):
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise _missing(f"`{module}.{name}`", error) from None


@functools.cache
def _trainer_module():
    return importlib.import_module("keras.src.backend.tensorflow.trainer")


def reduce_per_replica(values, strategy, reduction="auto"):
    """Keras' own per-replica reduction of a step's logs (`reduction="auto"`)."""
    function = getattr(_trainer_module(), "reduce_per_replica", None)
    if function is None:
        raise _missing("`reduce_per_replica`")
    return function(values, strategy, reduction=reduction)


_HOST_OUTPUTS_MARK = "_keras_memguard_host_outputs"


def concatenate_predictions_on_host():
    """Makes Keras' `predict` take numpy batch outputs as they are.

    Keras' `predict` ends with `potentially_ragged_concat`, a TensorFlow op
    that would copy outputs a predict function left on the host back onto
    the device, all at once, then `convert_to_np_if_not_ragged`, which
    expects tensors. Installed once per process: outputs that are all numpy
    arrays of one inner shape are joined with numpy (the values Keras
    gives) and a numpy array passes through; anything else goes to Keras'
    own functions.
    """
    module = _trainer_module()
    concat = getattr(module, "potentially_ragged_concat", None)
    to_numpy = getattr(module, "convert_to_np_if_not_ragged", None)
    if concat is None or to_numpy is None:
        raise _missing("`potentially_ragged_concat` and `convert_to_np_if_not_ragged`")
    if getattr(concat, _HOST_OUTPUTS_MARK, False):
        return

    @functools.wraps(concat)
    def host_concat(tensors):
        if all(isinstance(t, np.ndarray) for t in tensors) and (
            len({t.shape[1:] for t in tensors}) == 1
        ):
            if len(tensors) == 1:
                return tensors[0]
            if tensors[0].ndim == 0:
                return np.stack(tensors)
            return np.concatenate(tensors, axis=0)
        return concat(tensors)

    @functools.wraps(to_numpy)
    def host_to_numpy(x):
        return x if isinstance(x, np.ndarray) else to_numpy(x)

    setattr(host_concat, _HOST_OUTPUTS_MARK, True)
    module.potentially_ragged_concat = host_concat
    module.convert_to_np_if_not_ragged = host_to_numpy


def data_adapter(x, y=None, sample_weight=None, batch_size=None):
    """The data adapter `fit` builds for this input (shuffled, as `fit` does)."""
    get = _import_attribute("keras.src.trainers.data_adapters", "get_data_adapter")
    return get(x, y, sample_weight, batch_size=batch_size, shuffle=True)


@contextlib.contextmanager
def resolving_auto_jit_compile_as_on_gpu():
    """Within: `jit_compile="auto"` resolves as Keras resolves it with a GPU.

    Keras turns XLA off for `"auto"` on a machine with no accelerator and
    under a `tf.distribute` strategy, and on otherwise wherever the model
    supports it (`Trainer._resolve_auto_jit_compile`).
    """
    trainer = _import_attribute("keras.src.trainers.trainer", "Trainer")
    supports_jit = _import_attribute("keras.src.trainers.trainer", "model_supports_jit")
    original = trainer.__dict__.get("_resolve_auto_jit_compile")
    if original is None:
        raise _missing("`Trainer._resolve_auto_jit_compile`")

    def resolve(self):
        if keras.backend.backend() == "torch":
            return False
        if keras.backend.backend() == "tensorflow" and getattr(
            self, "_distribute_strategy", None
        ):
            return False
        return supports_jit(self)

    trainer._resolve_auto_jit_compile = resolve
    try:
        yield
    finally:
        trainer._resolve_auto_jit_compile = original


def tensorflow_trainer_class():
    """Returns Keras' `TensorFlowTrainer` class (the base of `keras.Model`)."""
    cls = getattr(_trainer_module(), "TensorFlowTrainer", None)
    if cls is None:
        raise _missing("`TensorFlowTrainer`")
    return cls


@functools.cache
def _unscale_function():
    return _import_attribute(
        "keras.src.losses.loss", "unscale_loss_for_distribution"
    )


def unscale_loss_for_distribution(loss):
    """Undoes the loss scaling by replica count, as Keras' train step does."""
    return _unscale_function()(loss)


def omit_frequent_tracing_warning(function):
    """Keeps TensorFlow's "frequent retracing" warning off `function`.

    TensorFlow counts the traces of every `tf.function` made from the same
    code together. The guard makes one compiled step per micro-batch count
    from one closure, each tracing at most twice (its first shapes, then the
    shapes relaxed), so a run that uses a few counts would be warned about
    retracing it does not do.

    Args:
        function: A `tf.function`; anything else is returned as it is.

    Returns:
        `function`.
    """
    if hasattr(function, "_omit_frequent_tracing_warning"):
        function._omit_frequent_tracing_warning = True
    return function


def autoconvert_optionals(model, function):
    """Wraps a step so that `tf.experimental.Optional` inputs become `None`.

    Keras 3.9+ does this with `Model._autoconvert_optionals`; Keras 3.8 has
    no such wrapper (its iterators never yield optionals to the step).
    """
    method = getattr(model, "_autoconvert_optionals", None)
    if method is not None:
        return method(function)

    @functools.wraps(function)
    def wrapper(data):
        return function(optionals_to_none(data))

    return wrapper


def optionals_to_none(data):
    """`data` with each `tf.experimental.Optional` replaced by `None`.

    What a step wrapped by `autoconvert_optionals` receives.
    """
    return tree.map_structure(
        lambda item: None if isinstance(item, tf.experimental.Optional) else item,
        data,
    )


def _attribute(obj, name):
    try:
        return getattr(obj, name)
    except AttributeError:
        raise _missing(f"`{type(obj).__name__}.{name}`") from None


def compute_loss(model, x, y, y_pred, sample_weight):
    """The loss the built-in train step computes (compiled loss + `losses`)."""
    return _attribute(model, "_compute_loss")(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
    )


def loss_tracker(model):
    """The model's `loss` Mean tracker, or `None` when it has none."""
    return getattr(model, "_loss_tracker", None)


def compiled_loss(model):
    """The model's `CompileLoss`, or `None` without a compiled loss."""
    return getattr(model, "_compile_loss", None)


def compiled_metrics(model):
    """The model's `CompileMetrics`, or `None` without compiled metrics."""
    return getattr(model, "_compile_metrics", None)


def metric_accumulates_per_sample(metric):
    """Whether updating `metric` micro-batch by micro-batch gives the whole batch's value.

    Keras' own metrics accumulate over samples (a sum and a count, a
    confusion matrix), so they do. A function compiled as a metric is
    wrapped in `MeanMetricWrapper`: it does only where the function is one
    of Keras' own, which give one value per sample. A function of the
    user's, or a loss object, may reduce over the batch (`ops.mean`, a
    correlation over the batch axis): the wrapper then counts one value
    per update, so per micro-batch it averages other values, with other
    weights, than once per batch.
    """
    if not type(metric).__module__.startswith("keras."):
        return False
    if isinstance(metric, keras.metrics.MeanMetricWrapper):
        function = getattr(metric, "_fn", None)
        return (
            function is not None
            and not isinstance(function, keras.losses.Loss)
            and getattr(function, "__module__", "").startswith("keras.")
        )
    return True


def call_has_training_arg(model):
    """Whether `model.call` takes a `training` argument."""
    return bool(getattr(model, "_call_has_training_arg", True))


def all_layers(model):
    """Every layer of `model`, itself included, recursively."""
    return list(
        _attribute(model, "_flatten_layers")(include_self=True, recursive=True)
    )


def dtype_policies(model):
    """The name of each layer's dtype policy, in `all_layers` order.

    A policy sets the dtype a layer computes in: under `"mixed_bfloat16"`
    the activations take half the memory of `"float32"`'s over the same
    float32 weights, which the weights' dtypes do not show.
    """
    return [
        getattr(getattr(layer, "dtype_policy", None), "name", None)
        for layer in all_layers(model)
    ]


def symbolic_build(model, data):
    """Creates model, metric and optimizer variables from a batch's specs."""
    _attribute(model, "_symbolic_build")(data_batch=data)


def metrics_result_or_logs(model, logs):
    """Keras' choice between the metrics' results and a step's logs."""
    return _attribute(model, "_get_metrics_result_or_logs")(logs)


def choose_metrics_results_beside(model, extra_keys):
    """Keras' choice between metrics' results and logs, ignoring `extra_keys`.

    Keras builds `fit`'s epoch logs from its metrics' results (read across
    replicas) only when the last step's logs hold exactly the metrics'
    keys; with keys added beside them it keeps the last step's logs, which
    under a distribution strategy are one replica's view. While installed
    on `model`, the keys `extra_keys()` names are set aside for that choice
    and put back after it. `restore_metrics_results_choice` removes it.
    """
    original = _attribute(model, "_get_metrics_result_or_logs")

    def results_or_logs(logs):
        if isinstance(logs, dict):
            extras = {key: logs[key] for key in extra_keys() if key in logs}
            if extras:
                rest = {key: value for key, value in logs.items() if key not in extras}
                chosen = original(rest)
                if chosen is not rest:
                    return {**chosen, **extras}
        return original(logs)

    # An instance attribute, not tracked by Keras, shadowing the method.
    object.__setattr__(model, "_get_metrics_result_or_logs", results_or_logs)


def is_end_of_data(error):
    """Whether `error` is how a train function says its input ran out.

    `StopIteration`, and on TensorFlow `tf.errors.OutOfRangeError`, which
    Keras' epoch iterator catches to end an epoch (told by name: this
    module imports TensorFlow only on first use).
    """
    if isinstance(error, StopIteration):
        return True
    return any(
        cls.__name__ == "OutOfRangeError" and cls.__module__.startswith("tensorflow")
        for cls in type(error).__mro__
    )


def error_behind_build(error):
    """The model's own error behind Keras' build failure, else `error`.

    Keras 3.8 builds a model from a batch's shapes and, where the model's
    code raises there, raises `RuntimeError("Unable to automatically build
    the model ...")` while handling it, with the model's error as its
    context; later versions let the model's error through.
    """
    inner = error.__cause__ or error.__context__
    if (
        isinstance(error, RuntimeError)
        and inner is not None
        and str(error).startswith("Unable to automatically build the model")
    ):
        return inner
    return error


def fit_history(model):
    """What tells one `fit` of `model` from the next: its `History`.

    Keras' `CallbackList.set_model` sets a new `History` as `model.history`
    for every `fit` (Keras 3.8 through 3.15), before any callback's
    `on_train_begin`; `evaluate` and `predict` leave it. `None` before the
    first `fit`.
    """
    return getattr(model, "history", None)


def restore_metrics_results_choice(model):
    """Removes what `choose_metrics_results_beside` installed on `model`."""
    model.__dict__.pop("_get_metrics_result_or_logs", None)


def learning_rate_variable(optimizer):
    """The optimizer's learning-rate variable, or `None` for a schedule."""
    value = _attribute(optimizer, "_learning_rate")
    return value if hasattr(value, "assign") else None


def in_multi_worker_mode(strategy):
    """Whether a `MultiWorkerMirroredStrategy` spans several workers."""
    return bool(_attribute(strategy.extended, "_in_multi_worker_mode")())


def report_error_to_cluster(code, message):
    """Aborts the collectives of every worker with `code` and `message`."""
    context = _import_attribute("tensorflow.python.eager.context", "context")
    context().report_error_to_cluster(code, message)


def tensorflow_initialized():
    """Whether TensorFlow's eager context (and so its devices) is initialized.

    `None` when the installed TensorFlow does not say.
    """
    try:
        context = _import_attribute("tensorflow.python.eager.context", "context")
        return context()._context_handle is not None
    except (AttributeError, UnsupportedTrainingSetupError):
        return None


def parse_bfc_memory_dump(data):
    """The BFC allocator's `MemoryDump` protobuf parsed from `data` (bytes).

    Raises:
        ValueError: If `data` is not a `MemoryDump`.
    """
    return _parse_proto("tensorflow.core.protobuf.bfc_memory_map_pb2", "MemoryDump", data)


def _parse_proto(module, name, data):
    """Parses `data` as the protobuf message `module.name`."""
    message = _import_attribute(module, name)()
    try:
        message.ParseFromString(data)
    except Exception as error:  # protobuf's DecodeError
        raise ValueError(f"not a {name}: {error}") from None
    return message


def parse_hlo_proto(data):
    """XLA's `HloProto` parsed from `data` (bytes), with its buffer assignment.

    What `tf.function(...).experimental_get_compiler_ir(...)(stage=
    "optimized_hlo_proto_serialized")` returns.

    Raises:
        ValueError: If `data` is not an `HloProto`.
    """
    return _parse_proto("tensorflow.compiler.xla.service.hlo_pb2", "HloProto", data)


def hidden_from_xla(value):
    """`value`, an `int32` scalar, passed through XLA's optimization barrier.

    XLA compiles what comes out of the barrier as a value it does not know,
    so no pass folds it. Only inside an XLA-compiled function: outside one
    the op has no kernel.
    """
    import tensorflow as tf

    barrier = _import_attribute("tensorflow.compiler.tf2xla.python.xla", "optimization_barrier")
    return barrier(tf.convert_to_tensor(value, tf.int32))[0]


def set_cluster_value(key, value):
    """Stores `value` under `key` in the cluster's coordination service."""
    context = _import_attribute("tensorflow.python.eager.context", "context")
    context().set_config_key_value(key, value)


def cluster_value(key, timeout_ms):
    """The value under `key` in the coordination service, or `None`.

    `None` when nothing is stored there within `timeout_ms`, or when the
    service cannot be reached.
    """
    context = _import_attribute("tensorflow.python.eager.context", "context")
    try:
        return context().get_config_key_value(key, max(1, int(timeout_ms)))
    except (tf.errors.OpError, RuntimeError):
        return None


def per_output_loss_metrics(model):
    """The `<output>_loss` Mean metrics of a multi-output compiled loss.

    Keras' `CompileLoss` updates each of them inside the loss computation,
    once per call, with the batch size known at trace time as weight.
    Empty when the compiled loss is not built or has one output.
    """
    loss = compiled_loss(model)
    if loss is None or not getattr(loss, "built", False):
        return []
    return list(getattr(loss, "metrics", None) or [])


@contextlib.contextmanager
def recording_per_output_losses(model):
    """Records the per-output loss updates of `CompileLoss` instead of applying them.

    Inside the block (at trace time), each `<output>_loss` metric's
    `update_state(value, sample_weight)` appends `value` to a list instead
    of changing the metric, so a micro-batched step can combine the
    micro-batches' values and update each metric once, as Keras does for
    the whole batch.

    Yields:
        A list with one list per metric, in `per_output_loss_metrics` order,
        that receives the recorded values.
    """
    metrics = per_output_loss_metrics(model)
    recorded = [[] for _ in metrics]
    for metric, values in zip(metrics, recorded):

        def record(value, sample_weight=None, _values=values):
            _values.append(value)

        object.__setattr__(metric, "update_state", record)
    try:
        yield recorded
    finally:
        for metric in metrics:
            object.__delattr__(metric, "update_state")


@contextlib.contextmanager
def recording_loss_masks():
    """Records what Keras' losses divide by, where it is not the samples.

    A loss whose values carry a mask (Keras masks, `ignore_class`) with a
    mean reduction is divided by the number of unmasked elements, and one
    reduced by `"mean_with_sample_weight"` by the sum of its sample weights
    (the mask merged into them), not by the number of elements. Inside the
    block (at trace time) each such reduction appends `(valid, total)` to
    the yielded list: what it divided by, and all its elements, scalar
    tensors. A micro-batch's loss weighted by its share of the samples
    times `valid / total`, summed and divided by `sum(valid) / sum(total)`,
    is then the whole batch's loss.

    Yields:
        A list of `(valid, total)` pairs.
    """
    module = importlib.import_module("keras.src.losses.loss")
    original_mask = _attribute(module, "apply_mask")
    original_reduce = _attribute(module, "reduce_values")
    recorded = []

    def apply_mask(sample_weight, mask, dtype, reduction):
        if mask is not None and reduction in ("mean", "sum_over_batch_size"):
            flat = keras.ops.cast(keras.ops.reshape(mask, (-1,)), dtype)
            recorded.append(
                (keras.ops.sum(flat), keras.ops.cast(keras.ops.shape(flat)[0], dtype))
            )
        return original_mask(sample_weight, mask, dtype, reduction)

    def reduce_values(values, sample_weight=None, reduction="sum_over_batch_size"):
        loss = original_reduce(values, sample_weight, reduction)
        if (
            reduction == "mean_with_sample_weight"
            and sample_weight is not None
            and tuple(values.shape) not in ((), (0,))
        ):
            elements = keras.ops.prod(keras.ops.convert_to_tensor(keras.ops.shape(values)))
            recorded.append(
                (
                    keras.ops.sum(keras.ops.cast(sample_weight, loss.dtype)),
                    keras.ops.cast(elements, loss.dtype),
                )
            )
        return loss

    module.apply_mask = apply_mask
    module.reduce_values = reduce_values
    try:
        yield recorded
    finally:
        module.apply_mask = original_mask
        module.reduce_values = original_reduce


@contextlib.contextmanager
def scaling_summed_losses(scale):
    """Inside the block, a loss that sums over samples comes out times `scale`.

    Micro-batch losses are combined weighted by their share of the samples
    (the whole batch's mean is the shares' sum of the micro-batches' means),
    but a summed loss's whole-batch value is the plain sum of the
    micro-batches' sums. With `scale` the inverse of the micro-batch's
    share, its share-weighted value is its own sum, whatever else the loss
    adds (mean-reduced terms, `model.losses`). Applied at trace time to a
    loss reduced by `"sum"`, and to the entries of a model's `losses` that
    `mark_summed_added_losses` marked (an `add_loss(ops.sum(...))`, Keras
    3.8's activity regularizers).

    Args:
        scale: A scalar (a float or a tensor).
    """
    module = importlib.import_module("keras.src.losses.loss")
    original = _attribute(module, "reduce_values")
    layer_class = keras.layers.Layer
    original_losses = layer_class.__dict__["losses"]

    def reduce_values(values, sample_weight=None, reduction="sum_over_batch_size"):
        loss = original(values, sample_weight, reduction)
        if reduction == "sum" and tuple(values.shape) not in ((), (0,)):
            loss = loss * keras.ops.cast(scale, loss.dtype)
        return loss

    # The values already scaled, by id (and kept alive, so that no id is
    # reused): Keras' JAX trainer reads `losses` once to collect them and
    # once more from that collection, which must not scale them twice.
    scaled = {}

    def losses(self):
        values = original_losses.fget(self)
        summed = getattr(self, _SUMMED_ADDED_LOSSES_ATTR, None)
        if not summed or len(summed) != len(values):
            return values
        result = []
        for value, is_summed in zip(values, summed):
            if is_summed and id(value) not in scaled:
                value = value * keras.ops.cast(scale, value.dtype)
                scaled[id(value)] = value
            result.append(value)
        return result

    module.reduce_values = reduce_values
    layer_class.losses = property(losses, doc=original_losses.__doc__)
    try:
        yield
    finally:
        module.reduce_values = original
        layer_class.losses = original_losses


_SUMMED_ADDED_LOSSES_ATTR = "_memguard_summed_added_losses"


def mark_summed_added_losses(model, summed):
    """Records which entries of `model.losses` sum over the batch's samples.

    `summed` has one flag per entry, in `model.losses`' order;
    `scaling_summed_losses` scales the marked entries while the model's
    `losses` has as many entries as flags (a layer that adds a loss only
    now and then leaves them all unscaled); no flags, `()`, says they are
    yet to be measured. Not saved with the model.
    """
    # object.__setattr__: a plain tuple, not tracked state.
    object.__setattr__(model, _SUMMED_ADDED_LOSSES_ATTR, tuple(bool(s) for s in summed))


def summed_added_losses(model):
    """The flags `mark_summed_added_losses` recorded, or `None`."""
    return getattr(model, _SUMMED_ADDED_LOSSES_ATTR, None)


def override_build_and_make_function(model, to_build_batch, wrap_step):
    """Replaces two of Keras' trainer methods on one model instance.

    For `MultiWorkerMirroredStrategy`: `_maybe_symbolic_build` builds from
    `to_build_batch(first batch)` (Keras reduces a distributed batch across
    workers there, which fails), and `_make_function` compiles
    `wrap_step(train_step)` instead of `train_step`. Nothing is saved with
    the model.
    """
    trainer_class = tensorflow_trainer_class()
    for name in ("_maybe_symbolic_build", "_make_function"):
        if not hasattr(trainer_class, name):
            raise _missing(f"`TensorFlowTrainer.{name}`")

    def maybe_symbolic_build(self, iterator=None, data_batch=None):
        if iterator is not None:
            # Keras 3.8 yields `(step, batches)`, 3.9+ `(begin, end, batches)`.
            for item in iterator:
                data_batch = to_build_batch(next(item[-1]))
                break
        with self.distribute_strategy.scope():
            symbolic_build(self, data_batch)

    def make_function(self, step_function):
        return trainer_class._make_function(self, wrap_step(step_function))

    # object.__setattr__: plain instance attributes, not tracked state.
    object.__setattr__(
        model, "_maybe_symbolic_build", types.MethodType(maybe_symbolic_build, model)
    )
    object.__setattr__(
        model, "_make_function", types.MethodType(make_function, model)
    )


def with_unknown_batch_size(spec):
    """A batched `tf.TypeSpec` with its batch dimension unknown."""
    try:
        return spec._unbatch()._batch(None)
    except AttributeError:
        raise _missing("`TypeSpec._unbatch`/`_batch`") from None


# --- Keras' JAX trainer (`keras/src/backend/jax/trainer.py`). ---


def unpack_data(data):
    """`(x, y, sample_weight)` of a batch as Keras' data adapters yield it."""
    return keras.utils.unpack_x_y_sample_weight(data)


def loss_and_updates_function(model):
    """The model's stateless `compute_loss_and_updates` (differentiable)."""
    return _attribute(model, "compute_loss_and_updates")


def update_metrics_variables(model, metrics_variables, unscaled_loss, x, y, y_pred,
                             sample_weight):
    """Updates the loss tracker and compiled metrics, statelessly.

    Returns:
        `(logs, metrics_variables)`, as `JAXTrainer.train_step` gets them.
    """
    return _attribute(model, "_update_metrics_variables")(
        metrics_variables, unscaled_loss, x, y, y_pred, sample_weight
    )


def jax_state(model):
    """The model's state tuple as JAX `fit` passes it to its train function.

    `(trainable, non_trainable, optimizer, metrics variables)`, each a list
    of arrays, read from the model's variables without purging them.
    """
    return _attribute(model, "_get_jax_state")(
        trainable_variables=True,
        non_trainable_variables=True,
        optimizer_variables=True,
        metrics_variables=True,
        purge_model_variables=False,
    )


_JAX_STATE_NAMES = {
    "train": ("trainable_variables", "non_trainable_variables",
              "optimizer_variables", "metrics_variables"),
    "test": ("trainable_variables", "non_trainable_variables", "metrics_variables"),
    "predict": ("trainable_variables", "non_trainable_variables"),
}


def keep_jax_state(model, state, kind="train"):
    """Puts `state` back into the model's variables when a step raised.

    JAX `fit`, `evaluate` and `predict` take the variables' values out of
    the model (purge them) and put the latest state back only once a step
    has completed: `fit` in its `finally`, `evaluate` and `predict` only
    when they end normally. A step that raises would leave the model
    without weights. This hands JAX the state the step started from:
    synced by `fit`'s `finally`, and at once for `evaluate` and `predict`.

    Args:
        model: The Keras model.
        state: The state tuple the step was given.
        kind: `"train"`, `"test"` or `"predict"`: which tuple it is.
    """
    model._jax_state = dict(zip(_JAX_STATE_NAMES[kind], state))
    model._jax_state_synced = False
    if kind != "train":
        model.jax_state_sync()


def overrides_train_step(model):
    """Whether the model's class replaces the `train_step` of Keras' trainer (JAX or PyTorch)."""
    if keras.backend.backend() == "torch":
        trainer = torch_trainer_class()
    else:
        trainer = _import_attribute("keras.src.backend.jax.trainer", "JAXTrainer")
    return type(model).train_step is not trainer.train_step


def distribution():
    """The global `keras.distribution` in force, or `None`."""
    return keras.distribution.distribution()


# Keras' torch trainer.


def torch_trainer_class():
    """Keras' `TorchTrainer`, whose `train_step` the torch mixin replaces."""
    return _import_attribute("keras.src.backend.torch.trainer", "TorchTrainer")


def torch_epoch_iterator_class():
    """Keras' `TorchEpochIterator`: batches as torch `fit` yields them."""
    return _import_attribute("keras.src.backend.torch.trainer", "TorchEpochIterator")


def keras_mask(tensor):
    """The Keras mask a tensor carries (`mask_zero`, `Masking`), or `None`.

    On PyTorch a layer's output mask rides on the tensor as an attribute,
    which a new tensor (`detach()`, `torch.cat`) does not have: the losses
    and metrics that read it would see none unless it is carried over.
    """
    return _import_attribute("keras.src.backend", "get_keras_mask")(tensor)


def set_keras_mask(tensor, mask):
    """Makes `tensor` carry `mask` as its Keras mask (see `keras_mask`)."""
    _import_attribute("keras.src.backend", "set_keras_mask")(tensor, mask)
    return tensor


def batches_of(data):
    """The batches Keras' torch `fit` passes to `train_function` at once.

    `fit` and `train_on_batch` call `train_function(data)` with a list of
    `steps_per_execution` batches (one, as Keras 3.8-3.15 refuse more on
    torch).
    """
    return list(data)


def loss_term_count(model):
    """How many compiled losses the model's loss sums (one per output).

    `0` before the compiled loss is built or without one.
    """
    loss = compiled_loss(model)
    if loss is None:
        return 0
    return len(getattr(loss, "_flat_losses", None) or [])
