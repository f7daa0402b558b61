"""`MemoryGuard` on Keras' PyTorch backend: the glue for one `fit`.

The guard trains through the torch training core
(`keras_memguard.backends.torch.replay`): a `ReplayingTrainFunction` put
inside the model's logs carrier. Before each batch the decider plans its
count from the memory in use and the demands measured so far, as on
TensorFlow without XLA (PyTorch runs eagerly: there is no compiled program
to read); after it, the batch's peak is what the decider learns from; a
batch that raised an out-of-memory error is run again on the untouched
weights with the count `decider.fail` gives. The plan cache keeps what was
learned per set-up, as on the other backends.

On a CUDA device the probe reads the caching allocator (allocated bytes, the
peak per batch); on the CPU it reads the process's resident memory, so
`memory_limit` must be given there.

`evaluate` and `predict` (and `fit`'s validation) run in slices
(`keras_memguard.backends.torch.inference`): one per batch until a batch
runs out of memory, then as many as the decider says, going on from the
first sample not yet done.
"""

import math

import keras
import numpy as np
import torch
from keras import tree

from keras_memguard import decider
from keras_memguard import oom_explanation
from keras_memguard import forward_writes
from keras_memguard import split_loss
from keras_memguard.backends import compat
from keras_memguard.backends import shared
from keras_memguard.backends.torch import activations
from keras_memguard.backends.torch.inference import SlicedPredictFunction
from keras_memguard.backends.torch.inference import SlicedTestFunction
from keras_memguard.backends.torch.inference import more_slices
from keras_memguard.backends.torch.mixin import MemGuardMixin
from keras_memguard.backends.torch.replay import ReplayingTrainFunction
from keras_memguard.callbacks import logs_carrier
from keras_memguard.callbacks import messages
from keras_memguard.callbacks import oom_report
from keras_memguard.errors import UnsupportedTrainingSetupError

# The micro-batching modes the torch step has.
_MODES = {"accumulate": "accumulate", "auto": "accumulate", "shrink": "shrink"}


def unsupported_options(options):
    """The `GuardOptions` the PyTorch backend cannot honour, in words, or `None`."""
    refused = []
    if options.escalate:
        refused.append(f"escalate={options.escalate!r}")
    if options.scale_learning_rate:
        refused.append("scale_learning_rate=True")
    if not refused:
        return None
    return (
        "On Keras' PyTorch backend `MemoryGuard` micro-batches and replays; "
        f"not supported there yet: {', '.join(refused)}. HINT: leave these "
        "options at their defaults, or train on the TensorFlow backend."
    )


def sample_size_of(data):
    """Elements of one sample's inputs: what a micro-batch's demand scales with.

    Args:
        data: A batch as Keras' data adapters yield it.

    Returns:
        A float > 0 (`1.0` where the inputs have no shape).
    """
    x = data[0] if isinstance(data, (tuple, list)) and data else data
    total = 0
    for leaf in tree.flatten(x):
        shape = getattr(leaf, "shape", None)
        if shape is not None and len(shape) >= 1:
            total += math.prod(int(d) for d in tuple(shape)[1:])
    return float(total) or 1.0


def batch_size_of(data):
    """Samples in a batch: the first dimension of its first input, or `None`."""
    x = data[0] if isinstance(data, (tuple, list)) and data else data
    for leaf in tree.flatten(x):
        shape = getattr(leaf, "shape", None)
        if shape is not None and len(shape) >= 1:
            return int(shape[0])
    return None


def gradient_bytes(model):
    """Bytes of the model's trainable weights: the gradients a step holds."""
    total = 0
    for variable in model.trainable_weights:
        size = math.prod(variable.shape)
        try:
            total += size * np.dtype(variable.dtype).itemsize
        except TypeError:  # a dtype numpy does not know (bfloat16)
            total += size * 2
    return float(total)


def describe_setup(model, data, devices, limits, mode):
    """What identifies a training set-up to the plan cache (see the TensorFlow one)."""
    x = data[0] if isinstance(data, (tuple, list)) and data else data
    signature = []
    for leaf in tree.flatten(x):
        shape = tuple(getattr(leaf, "shape", ()) or ())
        signature.append(
            [str(getattr(leaf, "dtype", None)), len(shape), shape[-1] if len(shape) > 1 else None]
        )
    return {
        "model": type(model).__name__,
        "layers": [type(layer).__name__ for layer in model.layers],
        # What the layers compute in (float32 weights under mixed precision).
        "policies": compat.dtype_policies(model),
        "weights": [[list(v.shape), str(v.dtype)] for v in model.weights],
        "trainable": [bool(v.trainable) for v in model.weights],
        "optimizer": type(getattr(model, "optimizer", None)).__name__,
        "inputs": signature,
        "jit_compile": bool(getattr(model, "jit_compile", False)),
        "devices": list(devices),
        "limits": [None if l is None else int(l) for l in limits],
        "mode": mode,
        "backend": "torch",
        "torch": torch.__version__,
        "keras": keras.__version__,
    }


def _peak(samples):
    peaks = [s.peak_bytes for s in samples if s.peak_bytes is not None]
    return float(max(peaks)) if peaks else None


class TorchTrainingRun:
    """One `fit` of a model under `MemoryGuard`, on the PyTorch backend.

    Args:
        session: The guard's `GuardSession` (its controller, reader,
            limits and options).
        fit: What identifies this `fit` (the callbacks' shared `params`).
        log_key: The logs key the micro-batch count is reported under.
    """

    def __init__(self, session, fit, log_key):
        self.session = session
        self.fit = fit
        self.log_key = log_key
        self.model = session.model
        self.function = None
        self._carrier = None
        self._previous_inner = None
        # Memory in use right before the batch that runs now, and its
        # batch and sample sizes.
        self._before = None
        self._batch_size = None
        self._sample_size = 1.0

    def begin(self):
        """Checks the options; installs the replaying function in the carrier."""
        session = self.session
        reason = unsupported_options(session.options)
        if reason is not None:
            raise UnsupportedTrainingSetupError(reason)
        model = self.model
        whole_step = None
        if compat.overrides_train_step(model):
            # A step of the model's own: nothing in it can be split, so it
            # runs whole, as in plain `fit`.
            session.train_whole_batches(
                messages.own_step_whole(type(model).__name__, "torch"), "torch"
            )
            whole_step = model.train_step
        session.start_unless_planning(lambda: self._start(None))
        self.function = ReplayingTrainFunction(
            model,
            micro_batches=session.micro_batches,
            plan=self._plan,
            on_out_of_memory=self._on_out_of_memory,
            mode=_MODES[session.options.mode],
            whole_step=whole_step,
            on_split_error=self._on_split_error,
        )
        self._carrier, self._previous_inner = logs_carrier.train_inside(
            self.model, session, self._contribute, self.fit, self.function
        )

    def end(self):
        """Puts the train function in place before back."""
        logs_carrier.leave(
            self.model, self.session, self._carrier, self.function, self._previous_inner
        )
        self._carrier = None
        self.function = None

    def begin_epoch(self):
        """Nothing at an epoch's start: steps are counted per call."""

    def after_train_batch(self, batch, logs):
        """Nothing in Keras' batch hook: the carrier's contribution did it."""

    def micro_batch_size(self, micro_batches):
        """Samples in one micro-batch, or `None`."""
        size = self._batch_size
        return -(-size // micro_batches) if size else None

    def _start(self, data):
        """Starts the decider for this `fit`: limit, fixed bytes, plan cache."""
        session = self.session
        options = session.options
        state = None
        from_cache = data is not None and options.plan and options.plan_cache
        if from_cache and not session.has_restored_state:
            fields = describe_setup(
                self.model, data, session.probe.devices, session.limits, options.mode
            )
            state = session.controller.load_plan(fields)
        sample_bytes = oom_explanation.layer_output_bytes(self.model)
        if not sample_bytes and state is None and data is not None and not session.stateful_layers:
            # The first batch is planned from its layer outputs: where the
            # static shapes do not tell them, a forward pass of two samples does.
            sample_bytes = activations.counted_sample_bytes(self.model, data)
        session.start(
            session.smallest_limit,
            gradient_bytes(self.model),
            sample_bytes,
            state,
        )

    def _plan(self, data):
        """The count for the batch about to run (the function's `plan`)."""
        session = self.session
        if not session.started:
            self._start(data)
        # Reading resets the peak: the batch's own peak is read after it.
        self._before = shared.in_use_bytes(session.read())
        batch_size = self._batch_size = batch_size_of(data) or 1
        self._sample_size = sample_size_of(data)
        if not session.options.plan:
            k = session.micro_batches
        else:
            k = session.controller.plan(batch_size, self._sample_size, self._before)
        # No autograd graph: the check's forward passes keep no activations.
        with torch.no_grad():
            split_loss.check_once(self.model, data, batch_size, k)
            if forward_writes.due(self.model, batch_size, k):
                # A training pass: an unseeded Dropout draws from torch's global
                # generator, whose state is put back so the run draws as plain `fit`.
                devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
                with torch.random.fork_rng(devices=devices):
                    forward_writes.check_once(self.model, data, batch_size, k)
        return k

    def _on_out_of_memory(self, failure):
        """The count to replay a batch with, from the decider, or raises."""
        session = self.session
        controller = session.controller
        in_use = shared.in_use_bytes(session.read())
        self._before = decider.in_use_beside_replay(self._before, in_use)
        decided = controller.fail(
            decider.Failure(
                failure.batch_size,
                failure.micro_batches,
                self._sample_size,
                self._before,
                controller.limit_bytes,
                in_use_bytes=in_use,
                allocation_bytes=failure.allocation_bytes,
            )
        )
        if decided.cannot_split is not None:
            raise oom_report.cannot_split_error(
                session, decided, failure.batch_size, failure.micro_batches
            ) from failure.error
        k = min(decided.micro_batches, failure.batch_size)
        messages.log_replay(
            failure.batch_size, failure.micro_batches, k, str(-(-failure.batch_size // k))
        )
        return k

    def _on_split_error(self, batch_size, micro_batches, error):
        return self.session.whole_after_split_error(error, "torch")

    def _contribute(self, logs):
        """After each train function call: the decider learns, logs and scalars."""
        session = self.session
        samples = session.read(self._carrier.batch_key)
        function = self.function
        controller = session.controller
        if function is not None and controller.limit_bytes and self._batch_size:
            decided = controller.observe(
                decider.Reading(
                    self._batch_size,
                    min(function.micro_batches, self._batch_size),
                    self._sample_size,
                    self._before,
                    _peak(samples),
                    controller.limit_bytes,
                    shared.in_use_bytes(samples),
                )
            )
            if not session.options.plan and decided.changed:
                messages.log_decision(decided, str(self.micro_batch_size(decided.micro_batches)))
                function.micro_batches = decided.micro_batches
                session.save_state()
        session.advance(1)
        if function is not None and isinstance(self.model, MemGuardMixin):
            # A mixin model keeps the guard's count for its own `fit`s.
            self.model.micro_batches = min(function.micro_batches, self._batch_size or 1)
        if logs is not None:
            logs[self.log_key] = session.micro_batches
        if session.writer is not None:
            session.write_scalars(self.micro_batch_size(session.micro_batches))


# `evaluate` and `predict` (and `fit`'s validation).

_FUNCTIONS = {"evaluate": SlicedTestFunction, "predict": SlicedPredictFunction}


def inference_run(session, kind):
    """Starts the run of an `evaluate` or `predict` call.

    Args:
        session: The guard's `GuardSession`.
        kind: `"evaluate"` or `"predict"`.

    Returns:
        The started `TorchInferenceRun`.
    """
    run = TorchInferenceRun(session, kind)
    run.begin()
    return run


class TorchInferenceRun:
    """One `evaluate` or `predict` (or `fit`'s validation) under `MemoryGuard`.

    Each batch runs in slices of the count this kind has come to (one slice
    until a batch runs out of memory); a slice that runs out of memory is
    run again in smaller ones, from the first sample not yet done, with the
    count the decider gives (`decider.fail_evaluation`), which stays for
    the next batches and calls.

    Args:
        session: The guard's `GuardSession`.
        kind: `"evaluate"` or `"predict"`.
    """

    def __init__(self, session, kind):
        self.session = session
        self.kind = kind
        self.model = session.model
        self.controller = session.inference_controller(kind)
        state = self.controller.state
        start = state.micro_batches if state.oom_count else 1
        self.function = _FUNCTIONS[kind](
            self.model, micro_batches=start, on_out_of_memory=self._on_out_of_memory
        )
        self._previous = None

    def begin(self):
        """Installs the sliced function in place of Keras' own."""
        self._previous = shared.install_inference_function(
            self.model, self.kind, self.function
        )

    def end(self):
        """Puts Keras' own function back."""
        shared.restore_inference_function(self.model, self.kind, self._previous)

    def after_batch(self):
        """Nothing after a batch: the count changes only after an error."""

    def _on_out_of_memory(self, failure):
        k = more_slices(failure)
        messages.log_inference_slices(
            self.kind, failure.batch_size, failure.micro_batches, None, k
        )
        self.controller.set_micro_batches(k)
        self.controller.count_replay()
        return k
