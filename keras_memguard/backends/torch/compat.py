"""Every private Keras name the PyTorch training core uses, in one place.

The micro-batched step trains through the pieces Keras' own torch
`train_step` uses (the compiled loss and its per-loss terms, the loss
tracker, the compiled metrics, the masks Keras' losses average over).
Those pieces are private and move between releases, so no other module of
`keras_memguard.backends.torch` names them: they go through the functions
here, which raise `UnsupportedTrainingSetupError` naming the supported
versions when something is missing. Checked against Keras 3.8 and 3.15 on
torch (`PRIVATE_NAMES` lists each name; the tests resolve every one).

Differences between the two ends that matter here: Keras 3.8's
`apply_mask` divides by `valid + epsilon` where 3.15 uses `divide_no_nan`
(the masked mean differs by a relative `epsilon / valid`), and 3.8's loss
tracker counts the first input's rows where 3.15 counts the first input
that is not `None`. Neither changes what the functions here return.
"""

import contextlib
import importlib

import keras

from keras_memguard.errors import UnsupportedTrainingSetupError

SUPPORTED = "Keras 3.8-3.15 on PyTorch"

# Every private name used, as `(owner, name)`: a module path and one of its
# attributes, or a class (dotted path) and one of its attributes. Attributes
# set on instances (`_loss_tracker`, `_compile_loss`, ...) are looked up on
# a compiled model by the tests.
PRIVATE_NAMES = (
    ("keras.src.backend.torch.trainer", "TorchTrainer"),
    ("keras.src.losses.loss", "apply_mask"),
    ("keras.Model", "_compute_loss"),
    ("keras.Model", "_loss_tracker"),
    ("keras.Model", "_compile_loss"),
    ("keras.Model", "_compile_metrics"),
    ("keras.Model", "_call_has_training_arg"),
    ("CompileLoss", "_flat_losses"),
    ("keras.src.backend.torch.trainer", "TorchEpochIterator"),
    ("keras.Model", "_symbolic_build"),
)


def _attribute(owner, name):
    try:
        return getattr(owner, name)
    except AttributeError:
        raise UnsupportedTrainingSetupError(
            f"This Keras ({keras.version()}) has no `{name}` on "
            f"{getattr(owner, '__name__', type(owner).__name__)}, which "
            "keras_memguard's PyTorch training core needs. "
            f"Supported: {SUPPORTED}."
        ) from None


def torch_trainer_class():
    """Keras' `TorchTrainer`, whose `train_step` the mixin replaces."""
    module = importlib.import_module("keras.src.backend.torch.trainer")
    return _attribute(module, "TorchTrainer")


def epoch_iterator_class():
    """Keras' `TorchEpochIterator`: batches as torch `fit` yields them."""
    module = importlib.import_module("keras.src.backend.torch.trainer")
    return _attribute(module, "TorchEpochIterator")


def symbolic_build(model, data):
    """Builds the model's metrics and optimizer variables as `fit` does first."""
    _attribute(type(model), "_symbolic_build")(model, data_batch=data)


def batches_of(data):
    """The batches Keras' torch `fit` passes to `train_function` at once.

    `fit` and `train_on_batch` call `train_function(data)` with a list of
    `steps_per_execution` batches (one, as Keras 3.8-3.15 refuse more on
    torch).
    """
    return list(data)


def compute_loss(model, x, y, y_pred, sample_weight):
    """The loss Keras' torch `train_step` computes (compiled loss + `losses`)."""
    return _attribute(model, "_compute_loss")(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
    )


def loss_tracker(model):
    """The model's `loss` Mean tracker, or `None` when it has none."""
    return getattr(model, "_loss_tracker", None)


def compiled_metrics(model):
    """The model's `CompileMetrics`, or `None` without compiled metrics."""
    return getattr(model, "_compile_metrics", None)


def loss_term_count(model):
    """How many compiled losses the model's loss sums (one per output).

    `0` before the compiled loss is built or without one.
    """
    loss = getattr(model, "_compile_loss", None)
    if loss is None:
        return 0
    return len(getattr(loss, "_flat_losses", None) or [])


def call_has_training_arg(model):
    """Whether `model.call` takes a `training` argument."""
    return bool(getattr(model, "_call_has_training_arg", True))


@contextlib.contextmanager
def recording_loss_masks():
    """Records the masks Keras' losses average over, inside the block.

    A loss whose values carry a mask (a Keras mask, `ignore_class`) with a
    mean reduction divides by its count of unmasked elements, not of
    samples. Inside the block every such reduction appends `(valid, total)`
    to the yielded list: the unmasked and all elements, as Python floats
    (read without a gradient; the micro-batched step weights by them).

    Yields:
        A list of `(valid, total)` pairs.
    """
    module = importlib.import_module("keras.src.losses.loss")
    original = _attribute(module, "apply_mask")
    recorded = []

    def apply_mask(sample_weight, mask, dtype, reduction):
        if mask is not None and reduction in ("mean", "sum_over_batch_size"):
            flat = keras.ops.reshape(mask, (-1,))
            valid = keras.ops.sum(keras.ops.cast(flat, "float32"))
            recorded.append(
                (float(keras.ops.convert_to_numpy(valid)), float(flat.shape[0]))
            )
        return original(sample_weight, mask, dtype, reduction)

    module.apply_mask = apply_mask
    try:
        yield recorded
    finally:
        module.apply_mask = original
