"""`MemGuardMixin` on Keras' PyTorch backend: Keras' own step, micro-batched.

The model's train function becomes a `ReplayingTrainFunction`: Keras' loss
and metrics over `micro_batches` micro-batches, their gradients summed in
the variables' `.grad` and applied once, and a batch that runs out of
memory replayed with twice the count. `accumulate_gradients` (for a
`train_step` of your own, on TensorFlow) is refused with a message naming
the backend.
"""

from keras_memguard import step_functions as functions
from keras_memguard.backends import compat
from keras_memguard.callbacks import messages
from keras_memguard.backends.torch.replay import ReplayingTrainFunction
from keras_memguard.backends.torch.replay import double_micro_batches
from keras_memguard.backends.torch.step import validate_mode
from keras_memguard.decider import validate_micro_batches
from keras_memguard.errors import UnsupportedTrainingSetupError
from keras_memguard.whole_batches import check_micro_batches
from keras_memguard import keras_models


class MemGuardMixin:
    """Mixin that micro-batches a Keras model's train step (PyTorch backend).

    Put it before `keras.Model` in the bases of your model class. Each
    batch is split into `micro_batches` parts; each part runs forward and
    backward on its own, its loss weighted by its share of the batch, the
    gradients add up in torch's `.grad`, and the optimizer applies them
    once: the same update as the whole batch, with the activation memory of
    a batch `micro_batches` times smaller. A batch that runs out of memory
    is replayed with twice the count (which `micro_batches` then keeps),
    with nothing applied twice. `micro_batches` may be changed between
    batches. The loss comes from `compile()` and `compute_loss`: a
    `train_step` of the class's own is refused when `fit` makes the train
    function.

    Attributes:
        micro_batches: The number of micro-batches per batch, an `int` >= 1.
            Defaults to `1` (plain training).
        micro_batch_mode: `"accumulate"` (one optimizer update per batch,
            the default) or `"shrink"` (one per micro-batch).

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
    _memguard_micro_batch_mode = "accumulate"

    @property
    def micro_batches(self):
        """The number of micro-batches per batch, an `int` >= 1."""
        return self._memguard_micro_batches

    @micro_batches.setter
    def micro_batches(self, value):
        # Plain Python state, kept out of Keras' and torch's attribute tracking.
        object.__setattr__(
            self, "_memguard_micro_batches",
            check_micro_batches(self, validate_micro_batches(value)),
        )

    @property
    def micro_batch_mode(self):
        """`"accumulate"` (one update per batch) or `"shrink"` (one a part)."""
        return self._memguard_micro_batch_mode

    @micro_batch_mode.setter
    def micro_batch_mode(self, value):
        validate_mode(value)
        object.__setattr__(self, "_memguard_micro_batch_mode", value)
        function = getattr(self, "train_function", None)
        if isinstance(function, ReplayingTrainFunction):
            function.mode = value

    def make_train_function(self, force=False):
        """Makes the micro-batched, replaying train function (once).

        Raises:
            UnsupportedTrainingSetupError: If the class has a `train_step`
                of its own, which cannot be micro-batched on torch.
        """
        if self.train_function is not None and not force:
            return self.train_function
        if compat.overrides_train_step(self):
            raise UnsupportedTrainingSetupError(
                messages.mixin_own_step(type(self).__name__, "PyTorch")
            )
        return functions.set_train_function(
            self,
            ReplayingTrainFunction(
                self,
                micro_batches=self.micro_batches,
                plan=lambda batch: self.micro_batches,
                on_out_of_memory=self._memguard_replay_count,
                mode=self.micro_batch_mode,
            ),
        )

    def _memguard_replay_count(self, failure):
        count = double_micro_batches(failure)
        self.micro_batches = count
        return count

    def accumulate_gradients(self, data, compute_loss=None, variables=None):
        """TensorFlow only: on torch the mixin micro-batches Keras' own step.

        Raises:
            UnsupportedTrainingSetupError: Always, naming the backend.
        """
        raise UnsupportedTrainingSetupError(
            "`accumulate_gradients` (micro-batching a `train_step` of your "
            "own) runs on Keras' TensorFlow backend only for now; on "
            "PyTorch, MemGuardMixin micro-batches Keras' own train step. "
            "HINT: move the loss into `compute_loss` and drop the "
            "`train_step` override."
        )
