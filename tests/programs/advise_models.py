"""The models `tests/test_advise.py` saves and `advise` measures.

Small enough for a few seconds per variant on two CPU cores, large enough
per sample that a step's peak is set by the samples rather than by the
allocator's rounding and workspaces, which at a few samples move the peak
of the same step by more than the samples themselves on the CPU stand-in.
"""

import keras


def cnn(seed=0):
    """Two 3x3 convolutions of 32 filters on 48x48x3, 10 classes, compiled."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((48, 48, 3)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        "adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


VOCABULARY = 1000
LENGTH = 128


def transformer(seed=0, vocabulary=VOCABULARY, length=LENGTH, dim=64):
    """Token embedding, one attention block with residuals, pooling, 4 classes."""
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((length,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(vocabulary, dim)(tokens)
    attended = keras.layers.MultiHeadAttention(num_heads=2, key_dim=dim // 2)(h, h)
    h = keras.layers.LayerNormalization()(h + attended)
    hidden = keras.layers.Dense(2 * dim, activation="relu")(h)
    h = keras.layers.LayerNormalization()(h + keras.layers.Dense(dim)(hidden))
    outputs = keras.layers.Dense(4)(keras.layers.GlobalAveragePooling1D()(h))
    model = keras.Model(tokens, outputs)
    model.compile(
        "adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model
