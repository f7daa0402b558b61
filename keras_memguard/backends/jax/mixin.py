"""`MemGuardMixin` on Keras' JAX backend: Keras' own step, micro-batched.

`keras_memguard.MemGuardMixin` is this class when Keras runs on JAX (as
Keras picks its trainer by backend). The model's train function becomes a
`ReplayingTrainFunction`: Keras' stateless loss and metrics updates run
over `micro_batches` micro-batches inside one compiled step, gradients
accumulated, and a batch that runs out of memory is replayed with twice
the count. What the TensorFlow mixin adds beyond that (`"shrink"`,
`accumulate_gradients` for a `train_step` of your own) is refused with a
message naming the backend.
"""

from keras_memguard.backends import compat
from keras_memguard.callbacks import messages
from keras_memguard.decider import validate_micro_batches
from keras_memguard.errors import UnsupportedTrainingSetupError
from keras_memguard.backends.jax.replay import ReplayingTrainFunction
from keras_memguard.backends.jax.replay import double_micro_batches
from keras_memguard.backends.jax.support import distribution_text
from keras_memguard import step_functions as functions
from keras_memguard.whole_batches import check_micro_batches
from keras_memguard import keras_models


class MemGuardMixin:
    """Mixin that micro-batches a Keras model's train step (JAX backend).

    Put it before `keras.Model` in the bases of your model class. Each
    batch is split into `micro_batches` parts inside one XLA-compiled step;
    their gradients are summed, weighted by each part's share of the
    samples, and applied once: the same update as the whole batch, with
    about the activation memory of a batch `micro_batches` times smaller.
    The step does not donate the model's state to XLA, so a batch that runs
    out of memory is replayed on the untouched state with twice the count
    (which `micro_batches` then keeps). `micro_batches` may be changed
    between batches; one compiled step is kept per count and batch shape.
    The loss comes from `compile()` and `compute_loss`: a `train_step` of
    the class's own is refused at `fit` start (see `MemoryGuard`).

    Attributes:
        micro_batches: The number of micro-batches per batch, an `int` >= 1.
            Defaults to `1` (plain training).
        micro_batch_mode: `"accumulate"`, the only mode on JAX.

    Example:

    ```python
    class MyModel(MemGuardMixin, keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(10)

        def call(self, x):
            return self.dense(x)

    model = MyModel()
    model.compile(optimizer="adam", loss="mse")
    model.micro_batches = 4
    model.fit(x, y, batch_size=256)
    ```
    """

    def __init_subclass__(cls, **kwargs):
        # A class made on a Keras 2 model is refused here, by name, not at
        # its first step.
        super().__init_subclass__(**kwargs)
        keras_models.check_model_class(cls)

    _memguard_micro_batches = 1

    @property
    def micro_batches(self):
        """The number of micro-batches per batch, an `int` >= 1."""
        return self._memguard_micro_batches

    @micro_batches.setter
    def micro_batches(self, value):
        # Plain Python state, kept out of Keras' attribute tracking.
        value = check_micro_batches(self, validate_micro_batches(value))
        _check_distribution(self, value)
        object.__setattr__(self, "_memguard_micro_batches", value)

    @property
    def micro_batch_mode(self):
        """`"accumulate"`: one optimizer update per batch."""
        return "accumulate"

    @micro_batch_mode.setter
    def micro_batch_mode(self, value):
        if value != "accumulate":
            raise ValueError(
                "`micro_batch_mode` must be 'accumulate' on Keras' JAX "
                "backend ('shrink' is TensorFlow only for now). "
                f"Received: micro_batch_mode={value!r}"
            )

    def make_train_function(self, force=False):
        """Makes the micro-batched, replaying train function (once).

        Under `keras.distribution` at one micro-batch, Keras' own train
        function: the micro-batched step is compiled for one device.

        Raises:
            UnsupportedTrainingSetupError: If the class has a `train_step`
                of its own, which cannot be micro-batched on JAX, or if
                `micro_batches` is above one under `keras.distribution`.
        """
        if self.train_function is not None and not force:
            return self.train_function
        if compat.overrides_train_step(self):
            # The micro-batched step is Keras' own: it would run in place of
            # this one.
            raise UnsupportedTrainingSetupError(
                messages.mixin_own_step(type(self).__name__, "JAX")
            )
        if distribution_text() is not None:
            _check_distribution(self, self.micro_batches)
            return super().make_train_function(force)
        return functions.set_train_function(
            self,
            ReplayingTrainFunction(
                self,
                micro_batches=self.micro_batches,
                plan=lambda state, data: self.micro_batches,
                on_out_of_memory=self._memguard_replay_count,
            ),
        )

    def _memguard_replay_count(self, failure):
        count = double_micro_batches(failure)
        self.micro_batches = count
        return count

    def accumulate_gradients(self, data, compute_loss=None, variables=None):
        """TensorFlow only: on JAX the mixin micro-batches Keras' own step.

        Raises:
            UnsupportedTrainingSetupError: Always, naming the backend.
        """
        raise UnsupportedTrainingSetupError(
            "`accumulate_gradients` (micro-batching a `train_step` of your "
            "own) runs on Keras' TensorFlow backend only for now; on JAX, "
            "MemGuardMixin micro-batches Keras' own train step. HINT: move "
            "the loss into `compute_loss` and drop the `train_step` override."
        )


def _check_distribution(model, micro_batches):
    """Refuses more than one micro-batch under `keras.distribution`."""
    distributed = distribution_text()
    if micro_batches > 1 and distributed is not None:
        raise UnsupportedTrainingSetupError(
            messages.mixin_distributed(type(model).__name__, distributed, micro_batches)
        )
