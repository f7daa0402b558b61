"""`MemGuardMixin`: a micro-batched `train_step` for Keras model classes."""

from keras_memguard.backends.tensorflow import accumulation
from keras_memguard import step_functions as functions
from keras_memguard.backends.tensorflow.replay import run_execution
from keras_memguard.backends.tensorflow.splitting import validate_micro_batches
from keras_memguard.backends.tensorflow.splitting import validate_mode
from keras_memguard.backends.tensorflow.step import MIXIN_STEP_MARK
from keras_memguard.backends.tensorflow.step import build_training_state
from keras_memguard.backends.tensorflow.step import micro_batch_train_step
from keras_memguard.backends.tensorflow.step import step_function
from keras_memguard.whole_batches import check_micro_batches
from keras_memguard import keras_models


def _set_private(model, name, value):
    # Plain Python state: kept out of Keras and TensorFlow attribute tracking
    # (and so out of checkpoints, SavedModel and `.keras` files).
    object.__setattr__(model, name, value)


def _iterator_function(model, step):
    """Wraps a one-batch step into a `train_function(iterator)`.

    The batch is pulled eagerly, then the compiled step runs on it; with
    `steps_per_execution > 1`, up to that many batches run and the last
    logs are returned, as Keras' own train function does. Before the first
    batch, the model's, metrics' and optimizer's variables are created
    from its specs: a subclassed model is unbuilt until then, and the
    micro-batched step cannot create variables inside its compiled loop.
    """
    built = []

    def run(data):
        if not built:
            build_training_state(model, data)
            built.append(True)
        return step(data)

    def train_function(iterator):
        return run_execution(model, iterator, run)

    return train_function


class MemGuardMixin:
    """Mixin that micro-batches a Keras model's `train_step`.

    Put it before `keras.Model` in the bases of your model class. Each
    batch is split into `micro_batches` parts that run one after the other,
    so a step needs about the activation memory of a batch `micro_batches`
    times smaller. In `"accumulate"` mode their gradients are summed,
    weighted by each part's share of the samples, and applied once: the
    same update as the whole batch. A step that runs out of memory part-way
    changes no weights, optimizer variables or metrics (BatchNormalization
    moving statistics excepted), so the batch can be replayed with a larger
    `micro_batches`. In `"shrink"` mode each part is its own optimizer
    update. Both attributes may be changed between batches (`MemoryGuard`
    does). BatchNormalization layers normalize each micro-batch on its own
    (a warning says so once). The mixin adds nothing to `get_config()`:
    saving and loading work as without it, and a loaded model starts again
    with `micro_batches=1`.

    A `train_step` of your own micro-batches through
    `self.accumulate_gradients(data, compute_loss)`, where
    `compute_loss(x, y, sample_weight)` runs ONE micro-batch and returns its
    mean loss, or `(loss, extras)` with a dict of scalar means. Run the
    state updates under `tf.control_dependencies(result.control_inputs())`,
    so that a step that runs out of memory changes nothing. An override
    that keeps its own `tf.GradientTape` over the whole batch cannot be
    split: at `micro_batches > 1` it is refused with
    `UnsupportedTrainingSetupError`.

    Attributes:
        micro_batches: The number of micro-batches per batch, an `int` >= 1.
            Defaults to `1` (plain training).
        micro_batch_mode: `"accumulate"` or `"shrink"` (not supported under
            a `tf.distribute` strategy). Defaults to `"accumulate"`.

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

    A `train_step` of your own (the keras-io VAE pattern):

    ```python
    class VAE(MemGuardMixin, keras.Model):
        def train_step(self, data):
            def compute_loss(x, y, sample_weight):
                z_mean, z_log_var, z = self.encoder(x)
                reconstruction = self.decoder(z)
                rec = ops.mean(ops.sum(
                    keras.losses.binary_crossentropy(x, reconstruction),
                    axis=(1, 2)))
                kl = ops.mean(ops.sum(-0.5 * (
                    1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var)),
                    axis=1))
                return rec + kl, {"reconstruction_loss": rec, "kl_loss": kl}

            result = self.accumulate_gradients(data, compute_loss)
            with tf.control_dependencies(result.control_inputs()):
                self.optimizer.apply(result.gradients, self.trainable_weights)
                self.total_loss_tracker.update_state(result.loss)
                self.kl_loss_tracker.update_state(result.extras["kl_loss"])
                ...
                return {m.name: m.result() for m in self.metrics}
    ```
    """

    def __init_subclass__(cls, **kwargs):
        # A class made on a Keras 2 model is refused here, by name, not at
        # its first step.
        super().__init_subclass__(**kwargs)
        keras_models.check_model_class(cls)

    # Class-level defaults: the mixin needs no `__init__`, which keeps
    # `from_config` and Keras' functional-class injection untouched.
    _memguard_micro_batches = 1
    _memguard_micro_batch_mode = "accumulate"
    # `(k, mode)` while the compiled step for `k` runs `train_step`
    # (tracing), so that a retrace reads the `k` of its own function.
    _memguard_pinned = None

    @property
    def micro_batches(self):
        """The number of micro-batches per batch, an `int` >= 1."""
        if self._memguard_pinned is not None:
            return self._memguard_pinned[0]
        return self._memguard_micro_batches

    @micro_batches.setter
    def micro_batches(self, value):
        value = check_micro_batches(self, validate_micro_batches(value))
        _set_private(self, "_memguard_micro_batches", value)
        self._memguard_use_current_step()

    @property
    def micro_batch_mode(self):
        """`"accumulate"` (one update per batch) or `"shrink"` (one a part)."""
        if self._memguard_pinned is not None:
            return self._memguard_pinned[1]
        return self._memguard_micro_batch_mode

    @micro_batch_mode.setter
    def micro_batch_mode(self, value):
        value = validate_mode(value)
        _set_private(self, "_memguard_micro_batch_mode", value)
        self._memguard_use_current_step()

    def train_step(self, data):
        """Runs one micro-batched training step (see `micro_batch_train_step`).

        Args:
            data: The batch.

        Returns:
            The logs `dict` of the built-in `train_step`.
        """
        return micro_batch_train_step(
            self, data, self.micro_batches, self.micro_batch_mode
        )

    setattr(train_step, MIXIN_STEP_MARK, True)

    def accumulate_gradients(self, data, compute_loss=None, variables=None):
        """Computes a batch's gradients over `self.micro_batches` micro-batches.

        For a `train_step` of your own: see
        `keras_memguard.backends.tensorflow.accumulate_gradients`, which this calls
        with `self.micro_batches`.

        Args:
            data: The batch, as `train_step` receives it.
            compute_loss: `compute_loss(x, y, sample_weight)`, run on one
                micro-batch, returning its mean loss or `(loss, extras)`
                (extras: a dict of scalar means). `None` uses the model's
                own forward pass and compiled loss (and keeps the whole
                batch's outputs in `result.y_pred`). Defaults to `None`.
            variables: The variables to differentiate. Defaults to
                `self.trainable_weights`.

        Returns:
            An `AccumulatedGradients` tuple: `gradients`, `loss` (the whole
            batch's mean), `extras`, `y_pred`, `batch_size` and
            `control_inputs()`.

        Raises:
            ValueError: If `compute_loss` returns something other than a
                scalar loss or `(loss, extras)`.

        Example:

        ```python
        result = self.accumulate_gradients(data, compute_loss)
        with tf.control_dependencies(result.control_inputs()):
            self.optimizer.apply(result.gradients, self.trainable_weights)
        ```
        """
        return accumulation.accumulate_gradients(
            self,
            data,
            self.micro_batches,
            compute_loss=compute_loss,
            variables=variables,
        )

    def make_train_function(self, force=False):
        """Sets `train_function` to the compiled step of the current `k`.

        `compile()` resets `train_function` to `None`; the steps compiled
        before then hold the old optimizer and metrics and are dropped.

        Args:
            force: Whether to rebuild even if a train function exists.
                Defaults to `False`.

        Returns:
            The train function.
        """
        if self.train_function is not None and not force:
            return self.train_function
        _set_private(self, "_memguard_train_functions", {})
        return functions.set_train_function(
            self, self._memguard_train_function(self.micro_batches, self.micro_batch_mode)
        )

    def _memguard_train_step_for(self, micro_batches, mode):
        """Returns `train_step` with `micro_batches` and mode pinned.

        Used by `make_step_function`, so a `train_step` override that reads
        `self.micro_batches` gets the `k` of the function being traced.
        """

        def train_step(data):
            previous = self._memguard_pinned
            _set_private(self, "_memguard_pinned", (micro_batches, mode))
            try:
                return self.train_step(data)
            finally:
                _set_private(self, "_memguard_pinned", previous)

        return train_step

    def _memguard_train_function(self, micro_batches, mode):
        cache = self.__dict__.get("_memguard_train_functions")
        if cache is None:
            cache = {}
            _set_private(self, "_memguard_train_functions", cache)
        key = (micro_batches, mode)
        if key not in cache:
            # Cheap: tracing happens on the first call.
            cache[key] = _iterator_function(
                self, step_function(self, micro_batches, mode)
            )
        return cache[key]

    def _memguard_use_current_step(self):
        # Swap only our own train functions: one installed by someone else
        # (the out-of-memory replay) reads `micro_batches` itself.
        current = getattr(self, "train_function", None)
        cache = self.__dict__.get("_memguard_train_functions") or {}
        if current is None or not any(current is f for f in cache.values()):
            return
        functions.set_train_function(
            self, self._memguard_train_function(self.micro_batches, self.micro_batch_mode)
        )
