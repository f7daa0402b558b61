"""The `"remat"` rung: recompute activations in the backward pass.

When one sample per micro-batch does not fit, the guard can run the
forward pass in segments of `SEGMENT_LAYERS` layers, each under
`tf.recompute_grad`: a segment keeps only its input for the backward pass
and recomputes the rest there: less memory for more step time (each
segment's forward pass runs twice per step), with the same gradients.

Only a chain of layers can be cut into segments: a `keras.Sequential`
model, or a functional model with one input and one output whose layers
each take the previous layer's output. Layers that draw random numbers
(dropout and noise layers draw again when recomputed) or update state in
`call` (BatchNormalization's moving statistics would update twice) are
refused, and so are models with a `train_step` or `call` of their own.
"""

import keras
import tensorflow as tf

from keras_memguard.backends import compat

RUNG = "remat"
SEGMENT_LAYERS = 3
# The model attribute that holds the segments while the rung is on.
_SEGMENTS_ATTR = "_memguard_remat_segments"


def chain_layers(model):
    """The layers of `model` as a chain, or a reason why they are not one.

    Args:
        model: A Keras model.

    Returns:
        `(layers, None)` with the layers in call order, or `(None, reason)`.
    """
    name = type(model).__name__
    if isinstance(model, keras.Sequential):
        layers = list(model.layers)
    elif not type(model).call.__module__.startswith("keras."):
        return None, f"{name} has a `call` of its own"
    else:
        try:
            inputs, outputs = model.inputs, model.outputs
        except AttributeError:
            return None, f"{name} is not a functional model"
        if len(inputs) != 1 or len(outputs) != 1:
            return None, f"{name} has more than one input or output"
        layers = [
            layer for layer in model.layers
            if not isinstance(layer, keras.layers.InputLayer)
        ]
        previous = inputs[0]
        try:
            for layer in layers:
                if layer.input is not previous:
                    return None, f"layer {layer.name!r} does not take the previous layer's output"
                previous = layer.output
        except (AttributeError, ValueError):
            return None, f"a layer of {name} is used more than once"
        if previous is not outputs[0]:
            return None, f"{name}'s output is not its last layer's"
    if len(layers) <= SEGMENT_LAYERS:
        return None, f"{name} has {len(layers)} layers, too few to save anything"
    for layer in compat.all_layers(model):
        if layer is model:
            continue
        if isinstance(layer, keras.layers.BatchNormalization):
            return None, f"layer {layer.name!r} updates moving statistics in `call`"
        if "Dropout" in type(layer).__name__ or "Noise" in type(layer).__name__:
            return None, f"layer {layer.name!r} draws random numbers"
    return layers, None


def can_remat(model):
    """`None` when the rung can be used on `model`, else why not (a str)."""
    if type(model).train_step is not keras.Model.train_step:
        return f"{type(model).__name__} has a `train_step` of its own"
    return chain_layers(model)[1]


def switch_on(model):
    """Runs `model`'s forward pass in recomputed segments from now on.

    Returns:
        The number of segments.

    Raises:
        ValueError: If `can_remat(model)` gives a reason.
    """
    reason = can_remat(model)
    if reason is not None:
        raise ValueError(f"The {RUNG!r} rung cannot be used: {reason}.")
    layers, _ = chain_layers(model)
    segments = tuple(
        tuple(layers[i : i + SEGMENT_LAYERS])
        for i in range(0, len(layers), SEGMENT_LAYERS)
    )
    # Plain Python state, kept out of Keras' attribute tracking.
    object.__setattr__(model, _SEGMENTS_ATTR, segments)
    return len(segments)


def switch_off(model):
    """Runs `model`'s forward pass whole again."""
    model.__dict__.pop(_SEGMENTS_ATTR, None)


def is_on(model):
    """Whether `model`'s forward pass runs in recomputed segments."""
    return segments_of(model) is not None


def segments_of(model):
    """The segments while the rung is on, else `None`."""
    return model.__dict__.get(_SEGMENTS_ATTR)


def _segment_function(segment):
    # Positional arguments only: `tf.recompute_grad` rejects keywords in a
    # compiled step; `training` is closed over.
    def run(x):
        for layer in segment:
            if compat.call_has_training_arg(layer):
                x = layer(x, training=True)
            else:
                x = layer(x)
        return x

    return tf.recompute_grad(run)


def recomputed_forward(segments, x):
    """The training forward pass through `segments`, each recomputed.

    Args:
        segments: Tuples of layers, from `segments_of`.
        x: The model's input.

    Returns:
        The model's output.
    """
    for segment in segments:
        x = _segment_function(segment)(x)
    return x
