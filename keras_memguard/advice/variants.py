"""What `advise` does to a loaded model: its batch, and each variant.

Runs in the measuring child process (it imports Keras, so the backend's
framework). Backend-neutral: what a variant needs of one backend (the
`"remat"` rung, XLA, `torch.compile`) is that backend's `advice` module
(`keras_memguard.backends.current().advice()`).

- `make_inputs` and `make_targets` build inputs from the model's input
  specs and targets that fit its loss and output shapes.
- `apply_variant` turns the loaded model into one variant: a dtype policy
  (the model rebuilt, see `rebuild_with_policy`, the same on every
  backend), or what the backend's `advice.apply_variant` makes of the
  others. A variant the model cannot take, or that the backend does not
  have, raises `Unsupported` with the reason.
"""

import keras
import numpy as np

from keras_memguard import backends
from keras_memguard.backends import compat

BASELINE = "float32"
POLICIES = ("mixed_float16", "mixed_bfloat16")
# The memory-saving rung `MemoryGuard(escalate=("remat",))` switches on.
REMAT = "remat"
JIT = "jit_compile"
VARIANTS = (BASELINE, *POLICIES, REMAT, JIT)
# Integer inputs with no Embedding layer to bound them get 0 or 1: valid
# for any lookup, mask or one-hot that takes integers.
_DEFAULT_INTEGER_RANGE = (0, 2)


class Unsupported(Exception):
    """The model cannot take a variant; the message says why."""


# Inputs and targets.


def input_specs(model, input_shape=None):
    """`[(name, shape_without_batch, dtype)]` for each input of `model`.

    Args:
        model: A built Keras model.
        input_shape: `None`, one shape (a tuple of ints, for a model with
            one input) or a list of shapes, one per input, in order; each
            replaces the model's own shape for its input.

    Returns:
        A list of `(name, shape, dtype)` with fully known shapes.

    Raises:
        ValueError: If a shape is unknown and not given, or `input_shape`
            does not match the model's inputs.
    """
    try:
        inputs = list(model.inputs)
    except (AttributeError, ValueError):
        inputs = []
    if not inputs:
        raise ValueError(
            f"{type(model).__name__} has no input specs (a subclassed model "
            "built without an Input). HINT: pass --input-shape."
        )
    shapes = [tuple(t.shape[1:]) for t in inputs]
    if input_shape is not None:
        given = [tuple(input_shape)] if _is_shape(input_shape) else [tuple(s) for s in input_shape]
        if len(given) != len(inputs):
            raise ValueError(
                f"The model has {len(inputs)} inputs but {len(given)} input "
                f"shape(s) were given: {given}."
            )
        shapes = given
    specs = []
    for tensor, shape in zip(inputs, shapes):
        name = getattr(tensor, "name", "input")
        if any(d is None for d in shape):
            raise ValueError(
                f"Input {name!r} has an unknown dimension: shape "
                f"{(None, *shape)}. HINT: pass --input-shape (input_shape=)."
            )
        specs.append((name, shape, str(tensor.dtype)))
    return specs


def _is_shape(value):
    return all(isinstance(d, (int, np.integer)) for d in value)


def integer_range(model, input_range=None):
    """`(low, high)`: integer inputs are drawn from `[low, high)`.

    `input_range` when given; else below the smallest `input_dim` of the
    model's Embedding layers (token ids must index a row); else 0 or 1.
    """
    if input_range is not None:
        return tuple(int(v) for v in input_range)
    dims = [
        layer.input_dim
        for layer in compat.all_layers(model)
        if isinstance(layer, keras.layers.Embedding)
    ]
    return (0, int(min(dims))) if dims else _DEFAULT_INTEGER_RANGE


def make_inputs(model, batch_size, input_shape=None, input_range=None, seed=0):
    """Random inputs for `batch_size` samples, as `fit` takes them.

    Floating inputs are uniform in [0, 1); integer ones (token ids, class
    ids) are drawn from `integer_range(model, input_range)`.

    Returns:
        One array for a model with one input, else a list of arrays.
    """
    rng = np.random.default_rng(seed)
    low, high = integer_range(model, input_range)
    arrays = []
    for _, shape, dtype in input_specs(model, input_shape):
        full = (batch_size, *shape)
        if np.issubdtype(np.dtype(dtype), np.integer):
            arrays.append(rng.integers(low, high, full).astype(dtype))
        elif dtype == "bool":
            arrays.append(rng.integers(0, 2, full).astype(bool))
        else:
            arrays.append(rng.random(full, dtype=np.float32).astype(dtype, copy=False))
    return arrays[0] if len(arrays) == 1 else arrays


def loss_kind(loss):
    """What targets a loss takes: "sparse", "onehot", "binary" or "real"."""
    if isinstance(loss, str):
        name = loss
    else:
        fn = getattr(loss, "fn", None)
        name = " ".join(
            str(n)
            for n in (
                getattr(loss, "name", None),
                type(loss).__name__,
                getattr(fn, "__name__", None),
                getattr(loss, "__name__", None),
            )
            if n
        )
    name = name.lower().replace("_", "")
    if "sparse" in name:
        return "sparse"
    if "categorical" in name or "kldivergence" in name:
        return "onehot"
    if "binary" in name or "hinge" in name:
        return "binary"
    return "real"


def make_targets(model, x, seed=1):
    """Targets for `x` that fit the model's loss and output shapes.

    Sparse categorical losses get class ids below the output's last
    dimension; categorical ones one-hot rows; binary and hinge losses 0 or
    1; any other loss (mean squared error, ...) standard normal values. The
    output shapes come from calling the model on one sample.

    Returns:
        One array for a model with one output, else a list of arrays.
    """
    rng = np.random.default_rng(seed)
    one = keras.tree.map_structure(lambda a: a[:1], x)
    outputs = keras.tree.flatten(model(one, training=False))
    losses = model.loss
    if isinstance(losses, dict):
        losses = [losses.get(name) for name in model.output_names]
    elif not isinstance(losses, (list, tuple)):
        losses = [losses] * len(outputs)
    batch_size = len(keras.tree.flatten(x)[0])
    targets = []
    for output, loss in zip(outputs, losses):
        shape = tuple(output.shape[1:])
        kind = loss_kind(loss) if loss is not None else "real"
        if kind == "sparse":
            targets.append(rng.integers(0, shape[-1], (batch_size, *shape[:-1])).astype("int32"))
        elif kind == "onehot":
            ids = rng.integers(0, shape[-1], (batch_size, *shape[:-1]))
            targets.append(np.eye(shape[-1], dtype="float32")[ids])
        elif kind == "binary":
            targets.append(rng.integers(0, 2, (batch_size, *shape)).astype("float32"))
        else:
            targets.append(rng.standard_normal((batch_size, *shape)).astype("float32"))
    return targets[0] if len(targets) == 1 else targets


# Variants.


def apply_variant(model, name):
    """Turns the loaded `model` into variant `name`.

    A dtype policy is made here, alike on every backend; the other
    variants by the backend's `advice.apply_variant`, or refused where the
    backend does not have them (its `advice.UNAVAILABLE`).

    Args:
        model: The loaded, compiled model (float32).
        name: One of `VARIANTS`.

    Returns:
        `(model, how)`: the model to measure (the same object or a
        rebuilt one) and a sentence saying what was done, or `None`.

    Raises:
        Unsupported: If the model or the backend cannot take the variant.
        ValueError: If `name` is not one of `VARIANTS`.
    """
    if name not in VARIANTS:
        raise ValueError(f"Unknown variant {name!r}. Valid: {VARIANTS}")
    if name == BASELINE:
        return model, None
    if name in POLICIES:
        return rebuild_with_policy(model, name)
    advice = backends.current().advice()
    reason = advice.UNAVAILABLE.get(name)
    if reason is not None:
        raise Unsupported(reason)
    return advice.apply_variant(model, name)


def unavailable(name, backend, why):
    """The reason for a variant `backend` does not have, as `advise` reports it.

    Args:
        name: The variant, one of `VARIANTS`.
        backend: The Keras backend's name.
        why: What stands in its place there, a sentence.

    Returns:
        `"<name> is not available on the <backend> backend: <why>"`.
    """
    return f"{name} is not available on the {backend} backend: {why}"


def supports_jit(model):
    """Whether Keras would compile `model`'s step with XLA."""
    return all(
        getattr(layer, "supports_jit", True) for layer in compat.all_layers(model)
    )


def recompile(target, source, **overrides):
    """Compiles `target` as `source` was compiled (a fresh optimizer).

    From `source.get_compile_config()` (optimizer, loss, metrics, loss
    weights, execution settings), with `overrides` applied.
    """
    config = source.get_compile_config()
    if not config:
        raise Unsupported(f"{type(source).__name__} was saved without a compile config")
    config = dict(config)
    config.update(overrides)
    target.compile_from_config(config)


def rebuild_with_policy(model, policy):
    """A copy of `model` whose layers compute under dtype `policy`.

    A loaded model's layers carry their own dtype policy in their configs,
    so `keras.mixed_precision.set_global_policy` alone leaves them float32.
    The model is cloned (`keras.models.clone_model`, nested models too)
    with each float32 layer's config `dtype` replaced by `policy` (input
    layers and layers of other dtypes keep theirs), the weights are
    copied (variables stay float32 under a mixed policy), and the copy is
    compiled from the original's compile config (for `"mixed_float16"`
    Keras then wraps the optimizer in a `LossScaleOptimizer`).

    Args:
        model: A built, compiled Keras model.
        policy: `"mixed_float16"` or `"mixed_bfloat16"`.

    Returns:
        `(rebuilt_model, how)`.

    Raises:
        Unsupported: If the model cannot be cloned or its weights do not
            carry over.
    """
    previous = keras.mixed_precision.global_policy()
    # Layers a clone creates inside (a subclassed model's sublayers) and
    # the model's own policy follow the global one.
    keras.mixed_precision.set_global_policy(policy)
    try:

        def clone_layer(layer):
            if not isinstance(layer, keras.layers.Layer):
                # An operation on tensors (`a + b`): no weights, no policy.
                return layer
            config = layer.get_config()
            if not isinstance(layer, keras.layers.InputLayer) and _is_float32(layer):
                config["dtype"] = policy
            return layer.__class__.from_config(config)

        try:
            rebuilt = keras.models.clone_model(
                model, clone_function=clone_layer, recursive=True
            )
        except Exception as error:  # noqa: BLE001 - any reason is the answer
            raise Unsupported(
                f"{type(model).__name__} could not be cloned with dtype "
                f"{policy!r}: {first_line(error)}"
            ) from error
        if not rebuilt.built:
            try:
                rebuilt.build(model.input_shape)
            except Exception as error:  # noqa: BLE001
                raise Unsupported(
                    f"the clone could not be built: {first_line(error)}"
                ) from error
        try:
            rebuilt.set_weights(model.get_weights())
        except ValueError as error:
            raise Unsupported(
                f"the weights do not carry over to the clone: {first_line(error)}"
            ) from error
        recompile(rebuilt, model)
    finally:
        keras.mixed_precision.set_global_policy(previous)
    changed = sum(
        1
        for layer in compat.all_layers(rebuilt)
        if layer is not rebuilt
        and getattr(layer.dtype_policy, "name", None) == policy
    )
    how = (
        f"rebuilt: keras.models.clone_model with each float32 layer's config "
        f"dtype set to {policy!r} ({changed} layers), weights copied, compiled "
        "from the original's compile config"
    )
    if isinstance(rebuilt.optimizer, keras.optimizers.LossScaleOptimizer):
        how += " (optimizer wrapped in a LossScaleOptimizer)"
    return rebuilt, how


def _is_float32(layer):
    return getattr(layer.dtype_policy, "name", "float32") == "float32"


def variable_bytes(model):
    """`(weights, optimizer_variables)` bytes: what every step keeps."""
    seen = set()

    def total(variables):
        count = 0
        for variable in variables:
            if id(variable) in seen:
                continue
            seen.add(id(variable))
            count += int(np.prod(variable.shape)) * _itemsize(variable.dtype)
        return count

    weights = total(model.weights)
    optimizer = total(model.optimizer.variables) if model.optimizer is not None else 0
    return weights, optimizer


def _itemsize(dtype):
    try:
        return np.dtype(dtype).itemsize
    except TypeError:  # bfloat16
        return 2


def first_line(error):
    """`"TypeName: first line of the message"` of an exception."""
    text = str(error).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(error).__name__}: {line}" if line else type(error).__name__


class RepeatedBatch(keras.utils.PyDataset):
    """One batch, served `steps` times: the measured steps' input.

    Where the backend has no `tf.data` (JAX, PyTorch without TensorFlow),
    a `PyDataset` is what every Keras backend's `fit` takes. It serves
    the same arrays each time, so no copy of the batch waits beside the
    step.

    Args:
        x: The inputs, an array or a list of arrays.
        y: The targets, an array or a list of arrays.
        steps: Batches per epoch, an integer >= 1.
    """

    def __init__(self, x, y, steps):
        super().__init__()
        self._arrays = (x, y)
        self._steps = int(steps)

    def __len__(self):
        return self._steps

    def __getitem__(self, index):
        return self._arrays
