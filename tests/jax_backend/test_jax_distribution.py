"""`keras.distribution` on JAX: the guard and the mixin train as plain `fit`.

The micro-batched step is compiled for one device, so under a distribution
the guard runs Keras' own train, test and predict functions on whole
batches; it used to refuse such a `fit`, and the mixin failed inside JAX
with a sharding mismatch. Two CPU devices (tests/jax_backend/conftest.py).
"""


import jax
import numpy as np
import pytest

import keras

import keras_memguard
from jax_models import assert_guarded_whole_as_plain
from jax_models import assert_weights_kept_a_split_refused_and_it_trains_on
from jax_models import make_mlp
from jax_models import max_weight_difference
from jax_models import mlp_data
from jax_models import mlp_layers
from jax_models import twins
from keras_memguard.errors import MicroBatchTooLargeError
from keras_memguard.errors import UnsupportedTrainingSetupError

WHERE = "`keras.distribution` (DataParallel over 2 devices)"


@pytest.fixture
def data_parallel():
    devices = keras.distribution.list_devices()
    assert len(devices) == 2
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    yield
    keras.distribution.set_distribution(None)


class FailingSequential(keras.Sequential):
    """Raises XLA's out-of-memory error while the step is traced, when told.

    The seam JAX's CPU backend cannot reach at these sizes (raised in
    `compute_loss`, inside Keras' own step); what `fit` does with the error
    is the real code.
    """

    fails = False

    def compute_loss(self, *args, **kwargs):
        if self.fails:
            raise jax.errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: Out of memory allocating 4096 bytes.", 8
            )
        return super().compute_loss(*args, **kwargs)


def make_failing_mlp():
    model = FailingSequential(mlp_layers())
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model


def test_a_guarded_fit_trains_whole_batches_as_plain_fit(data_parallel, caplog):
    x, y = mlp_data()
    plain, model = twins(make_mlp)
    warned = assert_guarded_whole_as_plain(
        plain, model, x, y, caplog, dict(batch_size=20, epochs=2, shuffle=False, verbose=0), 50,
        validation_data=(x, y),
    )
    told = [message for message in warned if "trains the batches of" in message]
    assert len(told) == 1 and WHERE in told[0] and "train on one device" in told[0], told


def test_out_of_memory_is_named_the_weights_kept_and_a_split_refused(data_parallel):
    x, y = mlp_data()
    model = make_failing_mlp()
    guard = keras_memguard.MemoryGuard(memory_limit=1 << 30, plan_cache=False)
    model.fit(x, y, batch_size=20, epochs=1, verbose=0, callbacks=[guard])  # builds it
    before = [np.array(w) for w in model.get_weights()]
    model.fails = True
    model.make_train_function(force=True)  # traced again at the next batch
    with pytest.raises(MicroBatchTooLargeError) as info:
        model.fit(x, y, batch_size=20, epochs=1, verbose=0, callbacks=[guard])
    assert (
        "Out of memory on a batch of 20 samples, which MemoryGuard cannot split: "
        f"Keras' train step under {WHERE} runs the whole batch"
    ) in str(info.value), info.value
    assert_weights_kept_a_split_refused_and_it_trains_on(model, before, x, y, guard, "loss")


def test_the_mixin_trains_kerass_step_and_refuses_a_split(data_parallel):
    class Net(keras_memguard.MemGuardMixin, keras.Sequential):
        pass

    def build():
        net = Net(mlp_layers())
        net.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        return net

    x, y = mlp_data()
    plain, net = twins(build)
    expected = plain.fit(x, y, batch_size=20, shuffle=False, verbose=0).history
    history = net.fit(x, y, batch_size=20, shuffle=False, verbose=0).history
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-6)
    assert max_weight_difference(net, plain) < 1e-6
    # It used to fail inside JAX: "Computation was compiled for input
    # shardings that disagree with the shardings of arguments passed to it".
    with pytest.raises(UnsupportedTrainingSetupError) as info:
        net.micro_batches = 2
    assert f"MemGuardMixin cannot micro-batch Net under {WHERE}" in str(info.value)
    assert "Received: micro_batches=2" in str(info.value) and net.micro_batches == 1


def small_cnn():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((32, 32, 3)), keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10),
    ])
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_find_batch_size_answers_the_batch_the_devices_train_together():
    # It used to compile the step for one device: about half the answer.
    x = np.zeros((64, 32, 32, 3), "float32")
    y = np.zeros((64,), "int64")
    limit = 200 * 2**20
    one = keras_memguard.find_batch_size(small_cnn(), x, y, memory_limit=limit, verbose=0)
    devices = keras.distribution.list_devices()
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    try:
        found = keras_memguard.find_batch_size(
            small_cnn(), x, y, memory_limit=limit, batch_size=512, verbose=0
        )
        answer = found.largest_batch_size
        # Weights and Adam's slots are on each device: less than twice.
        assert 1.5 * one.largest_batch_size < answer < 2 * one.largest_batch_size, (
            answer, one.largest_batch_size)
        assert answer % 2 == 0 and found.micro_batches == 1, found
        # Keras shards a batch only in whole parts: the answer trains.
        model = small_cnn()
        model.fit(np.zeros((answer, 32, 32, 3), "float32"), np.zeros((answer,), "int64"),
                  batch_size=answer, verbose=0)
    finally:
        keras.distribution.set_distribution(None)
