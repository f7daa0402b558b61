"""The guard's words: its log lines and the text of its errors, in one place."""

import logging
import re
from typing import NamedTuple

from keras_memguard.decider import accumulation_fits
from keras_memguard.decider import micro_batches_text

logger = logging.getLogger("keras_memguard")

_MIB = 1024 * 1024


def _samples(count):
    return f"{count} sample" if count == 1 else f"{count} samples"


def log_plan(decided, batch_size):
    """INFO: a planned count that changed, and why."""
    k = decided.micro_batches
    logger.info(
        "planned k=%d for batch %d: %s (micro-batch %d)",
        k,
        batch_size,
        decided.reason,
        -(-batch_size // k),
    )


def log_cached_plan(readings, path):
    """INFO: planning starts from an earlier run's measurements."""
    logger.info(
        "planning from %d measurement%s of an earlier run (%s)",
        readings,
        "" if readings == 1 else "s",
        path,
    )


def log_decision(decided, micro_batch_text):
    """INFO: a count changed by a batch's peak (reacting mode)."""
    micro = f" (micro-batch {micro_batch_text})" if micro_batch_text else ""
    logger.info(
        "%s: micro-batches %d -> %d%s",
        decided.reason,
        decided.previous_micro_batches,
        decided.micro_batches,
        micro,
    )


def log_replay(batch_size, micro_batches, new_k, micro_batch_text):
    """INFO: a batch that ran out of memory is replayed."""
    logger.info(
        "out of memory at %s of a batch of %d: replaying it with %s "
        "(micro-batch %s)",
        micro_batches_text(micro_batches),
        batch_size,
        micro_batches_text(new_k),
        micro_batch_text,
    )


def log_eval_slices(batch_size, micro_batches, done, new_k, training_k):
    """INFO: a validation batch goes on in smaller slices."""
    logger.info(
        "out of memory evaluating a validation batch of %d at %s: going on "
        "from sample %d with %s (micro-batch %d); training keeps %s",
        batch_size,
        micro_batches_text(micro_batches),
        done,
        micro_batches_text(new_k),
        -(-batch_size // new_k),
        micro_batches_text(training_k),
    )


def log_inference_plan(kind, batch_size, micro_batches, reason):
    """INFO: the slices a batch shape of `evaluate` or `predict` is planned in."""
    logger.info(
        "planned %s of batch %d in %s: %s",
        kind,
        batch_size,
        micro_batches_text(micro_batches),
        reason,
    )


def log_inference_slices(kind, batch_size, micro_batches, done, new_k):
    """INFO: an `evaluate` or `predict` batch goes on in smaller slices."""
    going_on = f"going on from sample {done}" if done is not None else "going on"
    logger.info(
        "out of memory in %s on a batch of %d at %s: %s with %s (micro-batch %d)",
        kind,
        batch_size,
        micro_batches_text(micro_batches),
        going_on,
        micro_batches_text(new_k),
        -(-batch_size // new_k),
    )


def log_inference_unsupported(kind, replicas):
    """INFO: `evaluate` or `predict` over several replicas runs as Keras runs it."""
    logger.info(
        "%s over %d replicas runs with Keras' own function: the guard cuts "
        "slices on one replica only",
        kind,
        replicas,
    )


def log_rung(rung, why, segments, segment_layers):
    """INFO: a rung of `escalate` is switched on."""
    logger.info(
        "rung %r on: %s; the forward pass now runs in %d recomputed "
        "segments of up to %d layers",
        rung,
        why,
        segments,
        segment_layers,
    )


def log_accumulation_off(why, accumulator_bytes):
    """WARNING: `mode="auto"` stops accumulating gradients for the rest of `fit`."""
    logger.warning(
        "mode='auto': gradient accumulation off for the rest of fit: %s (the "
        "accumulators take %s, one per trainable weight); each micro-batch is "
        "now its own update, a smaller effective batch, as with mode='shrink'",
        why,
        mib_text(accumulator_bytes),
    )


def memory_limit_unknown(devices, backend="tensorflow"):
    """`MemoryLimitUnknownError`'s text."""
    start = (
        "MemoryGuard cannot tell how close training is to running out of "
        f"memory: no memory limit is known for {', '.join(devices)}. "
    )
    if backend == "jax":
        return start + (
            "JAX reports none on this device (a CPU keeps no memory "
            "statistics). HINT: pass `memory_limit=<bytes>` to MemoryGuard."
        )
    if backend == "torch":
        return start + (
            "PyTorch reports none for host memory where this process has "
            "neither a cgroup memory limit nor an address-space limit "
            "(RLIMIT_AS). HINT: pass `memory_limit=<bytes>` to MemoryGuard; "
            "on a GPU, torch.cuda.set_per_process_memory_fraction sets one "
            "the guard reads."
        )
    return start + (
        "HINT: pass `memory_limit=<bytes>` to MemoryGuard, configure a "
        "logical device with a `memory_limit` "
        "(tf.config.set_logical_device_configuration), or on the CPU set "
        "TF_CPU_ALLOCATOR_USE_BFC=true and TF_CPU_BFC_MEM_LIMIT_IN_MB "
        "before TensorFlow is imported."
    )


class WholeStep(NamedTuple):
    """What trains a model's batches whole, in the words of the messages.

    Attributes:
        class_name: The model's class name.
        reason: Why a batch cannot be split, as a clause ("its own
            `train_step` does not use keras_memguard's machinery").
        runner: What runs each whole batch ("the own `train_step` of VAE").
        split_hint: How to have batches split.
        smaller_hint: What trains where a whole batch does not fit.
    """

    class_name: str
    reason: str
    runner: str
    split_hint: str
    smaller_hint: str


def own_step_whole(class_name, backend):
    """The `WholeStep` of a model with a `train_step` of its own, on `backend`."""
    if backend == "tensorflow":
        split_hint = (
            "mix `keras_memguard.MemGuardMixin` into the class "
            f"(`class {class_name}(MemGuardMixin, ...)`) and build the "
            "override on `self.accumulate_gradients(...)`"
        )
    else:
        split_hint = (
            "move the loss into `compute_loss` and drop the `train_step` "
            "override (Keras' own step is split)"
        )
    return WholeStep(
        class_name,
        "its own `train_step` does not use keras_memguard's machinery",
        f"the own `train_step` of {class_name}",
        split_hint,
        "pass a smaller `batch_size` to `fit` (`keras_memguard.find_batch_size` "
        f"finds one), or {split_hint}",
    )


def distributed_whole(class_name, distribution):
    """The `WholeStep` of a JAX model trained under `keras.distribution`.

    `distribution`: the distribution in words ("DataParallel over 2 devices").
    """
    where = f"`keras.distribution` ({distribution})"
    return WholeStep(
        class_name,
        "on Keras' JAX backend keras_memguard splits a step on one device, "
        f"and {where} spreads each batch over several",
        f"Keras' train step under {where}",
        "train on one device",
        "pass a smaller `batch_size` to `fit`, or spread the batch over more devices",
    )


def eager_whole(class_name, why):
    """The `WholeStep` of a JAX model whose step Keras runs without XLA.

    `why`: the cause, as `support.eager_reason` gives it ("`jit_compile=False`",
    "its layer 'random_rotation' (RandomRotation) does not support XLA").
    """
    if why.startswith("its layer"):
        split_hint = (
            "move that layer into the input pipeline (`dataset.map(...)`, as "
            "keras.io does for augmentation) so that the step compiles with XLA"
        )
    else:
        split_hint = "compile with Keras' defaults on JAX (`jit_compile=\"auto\"`)"
    return WholeStep(
        class_name,
        "on Keras' JAX backend keras_memguard splits a step compiled with "
        f"XLA, and Keras runs this model's without it ({why})",
        "Keras' train step without XLA",
        split_hint,
        f"pass a smaller `batch_size` to `fit`, or {split_hint}",
    )


def ragged_on_xla(class_name):
    """The `WholeStep` of a model fed ragged tensors, its step compiled with XLA."""
    split_hint = (
        "compile the model with `jit_compile=False` (the guard then splits "
        "ragged batches), or pad the input (`RaggedTensor.to_tensor()`, "
        "`tf.data.Dataset.padded_batch`)"
    )
    return WholeStep(
        class_name,
        "its input is ragged (`tf.RaggedTensor`), and XLA compiles a step for "
        "fixed shapes, which a ragged batch's micro-batches do not have",
        f"the XLA-compiled train step of {class_name}",
        split_hint,
        f"pass a smaller `batch_size` to `fit`, or {split_hint}",
    )


def split_fails_whole(class_name, error):
    """The `WholeStep` of a model whose code fails on a micro-batch.

    `error`: what a micro-batch's step raised, not an out-of-memory error
    (code that assumes the batch size: a reshape or a noise tensor of a
    fixed batch, a loss's labels made for it).
    """
    split_hint = (
        "make the model's code take the batch size from its input "
        "(`keras.ops.shape(x)[0]`) instead of a fixed number"
    )
    return WholeStep(
        class_name,
        f"its step fails on a micro-batch ({error_summary(error)}), as code "
        "that assumes the batch size does",
        f"the step of {class_name} (its code assumes the batch size)",
        split_hint,
        f"pass a smaller `batch_size` to `fit` and to the model's code, or {split_hint}",
    )


def error_summary(error, limit=240):
    """`error` in one line: its type and the first line that says what failed.

    Keras wraps a layer's error as "Exception encountered when calling
    Lambda.call()." with the cause on a later line, and TensorFlow adds the
    graph node; both are cut to what a reader needs.
    """
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    head = lines[0] if lines else ""
    wrapped = re.match(r"Exception encountered when calling (\S+?)(?:\.call)?\(\)\.?$", head)
    if wrapped and len(lines) > 1:
        head = f"in {wrapped.group(1)}: {lines[1]}"
    head = head.split(" for '{{node ")[0]
    if len(head) > limit:
        head = head[: limit - 3].rstrip() + "..."
    return f"{type(error).__name__}: {head}" if head else type(error).__name__


def mixin_own_step(class_name, backend_name):
    """`UnsupportedTrainingSetupError`'s text for a JAX or PyTorch mixin class with its own `train_step`."""
    return (
        f"{class_name} has a `train_step` of its own; on Keras' {backend_name} "
        "backend MemGuardMixin micro-batches Keras' own train step only. "
        "HINT: move the loss into `compute_loss` and drop the `train_step` "
        "override, or drop the mixin (`MemoryGuard` then trains the batches "
        "whole)."
    )


def mixin_distributed(class_name, distribution, micro_batches):
    """`UnsupportedTrainingSetupError`'s text for the JAX mixin asked to split under `keras.distribution`."""
    return (
        f"MemGuardMixin cannot micro-batch {class_name} under "
        f"`keras.distribution` ({distribution}): on Keras' JAX backend it "
        "splits a step on one device. Received: "
        f"micro_batches={micro_batches}. HINT: leave `micro_batches` at 1 "
        "(Keras' own step then trains the whole batch, as plain `fit` does), "
        "or train on one device."
    )


def whole_step_refused(whole, micro_batches):
    """`UnsupportedTrainingSetupError`'s text for micro-batches asked of a `WholeStep`."""
    return (
        f"MemoryGuard cannot micro-batch {whole.class_name}: {whole.reason}. "
        f"Received: micro_batches={micro_batches}. HINT: leave `micro_batches` "
        "at 1 (the guard then trains whole batches and watches memory), or "
        f"{whole.split_hint}."
    )


def whole_step_batches(whole, backend):
    """The warning when a model's batches are trained whole (a `WholeStep`)."""
    # TensorFlow's XLA step is read and tried before it runs.
    xla = " (on XLA it stops before a step that cannot fit runs)" if backend == "tensorflow" else ""
    return (
        f"MemoryGuard trains the batches of {whole.class_name} whole: "
        f"{whole.reason}, so a batch cannot be split into micro-batches. The "
        f"guard watches memory and explains an out-of-memory error{xla}. "
        f"HINT: to have batches split when memory runs short, {whole.split_hint}."
    )


def whole_step_out_of_memory(batch_size, whole):
    """`MicroBatchTooLargeError`'s text when a batch of a `WholeStep` does not fit."""
    return (
        f"Out of memory on a batch of {_samples(batch_size)}, which MemoryGuard "
        f"cannot split: {whole.runner} runs the whole batch. HINT: "
        f"{whole.smaller_hint}."
    )


def whole_step_too_large(batch_size, whole, needed, in_use, limit, no_block=None):
    """`MicroBatchTooLargeError`'s text when the XLA step of a `WholeStep` cannot fit.

    `no_block`: as in `stateful_step_too_large`.
    """
    return (
        _whole_step_needs(batch_size, needed, in_use, limit, no_block)
        + f", and MemoryGuard cannot split it: {whole.runner} runs the whole "
        f"batch. Nothing ran. HINT: {whole.smaller_hint}."
    )


def learning_rate_schedule():
    """The error's text for `scale_learning_rate` with a schedule."""
    return (
        "`scale_learning_rate=True` needs a float learning rate; this "
        "optimizer uses a schedule. HINT: scale the schedule yourself "
        "or pass scale_learning_rate=False."
    )


def _names(layers):
    return ", ".join(repr(name) for name in layers)


def stateful_whole_batches(class_name, layers):
    """The warning when a model's batches are trained whole (stateful layers)."""
    return (
        f"MemoryGuard trains the batches of {class_name} whole: its stateful "
        f"layers ({_names(layers)}) keep one state row per sample of the batch, "
        "so a batch cannot be split into micro-batches or slices. The guard "
        "watches memory and explains an out-of-memory error."
    )


def unreadable_whole_batches(devices, micro_batches=1):
    """The warning when the devices planned against keep no memory statistics."""
    batches = (
        "Batches train whole, as in plain `fit`"
        if micro_batches == 1
        else f"Batches train at micro_batches={micro_batches}, as asked"
    )
    return (
        f"MemoryGuard cannot plan micro-batches: {', '.join(devices)} "
        "keeps no memory statistics, so no batch's memory can be measured. "
        f"{batches}, and an out-of-memory error "
        "is handled as with `plan=False` (replayed in micro-batches; on XLA, "
        "a clear error). HINT: on TensorFlow's CPU, "
        "set TF_CPU_ALLOCATOR_USE_BFC=true in the environment before "
        "TensorFlow is imported."
    )


def stateful_split_refused(class_name, layers, micro_batches):
    """`UnsupportedTrainingSetupError`'s text for micro-batches asked of stateful layers."""
    return (
        f"MemoryGuard cannot split the batches of {class_name} into "
        f"micro-batches: its stateful layers ({_names(layers)}) keep one "
        "state row per sample of the batch, whose size the model fixes. "
        f"Received: micro_batches={micro_batches}. HINT: leave `micro_batches` "
        "at 1 (the guard then trains whole batches and watches memory), or "
        "lower the batch size of the layers' `batch_shape`."
    )


def code_batch_search_refused(class_name, size, error, first=False):
    """`find_batch_size`'s `UnsupportedTrainingSetupError` text when the
    model's train step fails at a batch it tries (not out of memory).

    `first`: the step before any trial, where an input `fit` cannot train
    either (targets missing, a dataset of single samples) fails as well.
    """
    also, check = "", ""
    if first:
        also = (
            "; so does an input `fit` cannot train either (targets the loss "
            "needs and `y` does not give; a dataset of single samples, not "
            "batches)"
        )
        check = "check that `model.fit` trains on this input; if it does, "
    return (
        f"find_batch_size cannot try a batch of {_samples(size)} on "
        f"{class_name}: its train step raised {error_summary(error)}. Code "
        "that assumes the batch size (a reshape or a noise tensor made for a "
        f"fixed batch) fails so at any other batch{also}. The weights are as "
        f"they were. HINT: {check}take the batch size from the input "
        "(`keras.ops.shape(x)[0]`) to search."
    )


def stateful_search_refused(class_name, layers):
    """`find_batch_size`'s `UnsupportedTrainingSetupError` text for stateful layers."""
    return (
        f"find_batch_size cannot try other batch sizes on {class_name}: its "
        f"stateful layers ({_names(layers)}) keep one state row per sample of "
        "the batch size the model was built with (their `batch_shape`). HINT: "
        "build the model without `stateful=True` to search, or rebuild it at "
        "each batch size to try."
    )


def stateful_out_of_memory(batch_size, layers, evaluating=False):
    """`MicroBatchTooLargeError`'s text when a stateful model's batch does not fit."""
    batch = "validation batch" if evaluating else "batch"
    return (
        f"Out of memory on a {batch} of {_samples(batch_size)}, which MemoryGuard "
        f"cannot split: the stateful layers {_names(layers)} keep one state row "
        "per sample of the batch. HINT: lower the batch size of the layers' "
        "`batch_shape` (and `fit`'s), or use mixed precision or a smaller model."
    )


def _whole_step_needs(batch_size, needed, in_use, limit, no_block):
    """What a whole XLA step needs that the memory cannot give."""
    start = (
        f"The XLA-compiled step of a batch of {_samples(batch_size)} needs "
        f"{_mib(needed)} beside {_mib(in_use)} in use, "
    )
    if no_block is None:
        return start + f"over the memory limit of {_mib(limit)}"
    return start + (
        f"under the memory limit of {_mib(limit)}, but its largest buffer "
        f"({_mib(no_block)}, allocated in one piece) found no place in the "
        "free memory that leaves room for the rest (the allocator hands a "
        "buffer over half a free block the whole block)"
    )


def stateful_step_too_large(batch_size, layers, needed, in_use, limit, no_block=None):
    """`MicroBatchTooLargeError`'s text when a stateful model's XLA step cannot fit.

    `no_block`: the largest buffer's bytes where the step fits in total but
    its buffers found no place (`xla_memory.allocates`), else `None`.
    """
    return (
        _whole_step_needs(batch_size, needed, in_use, limit, no_block)
        + ", and MemoryGuard cannot split it: the stateful "
        f"layers {_names(layers)} keep one state row per sample of the batch. "
        "Nothing ran. HINT: lower the batch size of the layers' `batch_shape` "
        "(and `fit`'s), or use mixed precision or a smaller model."
    )


def cap_reached(micro_batches, batch_size, evaluating=False, stateful=(), whole_step=None):
    """`MicroBatchTooLargeError`'s text when `max_micro_batches` is reached.

    `stateful`: the names of the layers that cap the count at one, if any;
    `whole_step`: the `WholeStep` that does (in training), or `None`.
    """
    if stateful:
        return stateful_out_of_memory(batch_size, stateful, evaluating)
    if whole_step and not evaluating:
        return whole_step_out_of_memory(batch_size, whole_step)
    if evaluating:
        return (
            f"Out of memory evaluating at {micro_batches} micro-batches, "
            "the cap set by `max_micro_batches`; the validation batch of "
            f"{batch_size} samples cannot be split further. HINT: raise "
            "`max_micro_batches` or lower `validation_batch_size`."
        )
    return (
        f"Out of memory at {micro_batches} micro-batches, the cap set "
        f"by `max_micro_batches`; the batch of {batch_size} samples "
        "cannot be split further. HINT: raise `max_micro_batches` or "
        "lower the batch size."
    )


def allocation_does_not_shrink(reason, batch_size, peak, limit):
    """`MicroBatchTooLargeError`'s text when no count can help."""
    return (
        f"No micro-batch count helps the batch of {_samples(batch_size)}: {reason}. "
        f"Measured peak before the failure: {_mib(peak)}; memory limit: "
        f"{_mib(limit)}. HINT: the allocation belongs to a layer whose "
        "memory does not depend on the batch (its weights' gradients, or "
        "a kernel's workspace): use mixed precision, a smaller layer or "
        "input size, or a device with more memory."
    )


def optimizer_update_too_large(op, allocation, shape, before, limit, accumulators):
    """`MicroBatchTooLargeError`'s text when the optimizer's update ran out of memory."""
    asked = _mib(allocation) + (f" {list(shape)}" if shape else "") if allocation else "memory"
    held = (
        f", and the accumulators {_mib(accumulators)} more (one per trainable weight)"
        if accumulators
        else ""
    )
    return (
        f"The optimizer's update ran out of memory: `{op}` asked for {asked}, "
        f"with {_mib(before)} in use before the batch (weights, optimizer "
        f"state, inputs){held}, of the {_mib(limit)} limit. The update works on "
        "whole weights after the micro-batches have run, so no micro-batch "
        "count shrinks it; plain `fit` needs it at every batch size too. "
        "HINT: an optimizer with less state (`SGD`, `Adafactor`), mixed "
        "precision, fewer or smaller weights (a smaller `Embedding`, "
        "`enable_lora` on large layers), or a device with more memory."
    )


def mib_text(value):
    """`value` bytes as "12.3 MiB", or "unknown" for `None`."""
    return f"{value / _MIB:.1f} MiB" if value else "unknown"


_mib = mib_text


def _room_text(value):
    # `mib_text` reads 0 as not measured; here it is measured room.
    return _mib(value) if value > 0 else "nothing"


# `too_large`'s `remat_refusal` where no rung exists (evaluation,
# prediction, the JAX backend).
NO_RUNGS = object()


def too_large(
    batch_size,
    micro_batches,
    peak,
    limit,
    escalate=(),
    rungs_tried=(),
    remat_refusal=NO_RUNGS,
    accumulation=None,
):
    """`MicroBatchTooLargeError`'s text when one sample does not fit.

    With no rung allowed, the remat rung is offered only where it can be
    used (`remat_refusal` is `None`); where it cannot (a str), the text
    says why, so the hint is never one the guard would then refuse; with
    `NO_RUNGS` it mentions no rung. `accumulation` is `(in_use_bytes,
    accumulator_bytes)` of an accumulating step: where the accumulators
    leave less room than they take, the text says that accumulation is what
    does not fit, and what trains instead; where they left more, a step's
    gradients and its optimizer's update may still need more than the rest
    (all of them at once where ops run one at a time, as on a GPU), so the
    text says what they took and what may fit without them: a step
    without accumulators holds every gradient until its update, so where
    activations, not the accumulators, take the room, it need not fit.
    """
    accumulated = held = smaller_batch = ""
    if accumulation is not None and limit:
        in_use, accumulators = accumulation
        if accumulators and not accumulation_fits(in_use, accumulators, limit):
            return (
                f"Accumulating gradients does not fit in device memory: "
                f"{_mib(in_use)} was in use before the batch (weights, optimizer "
                f"state, inputs) and the accumulators take {_mib(accumulators)} "
                f"more (one per trainable weight), which leaves "
                f"{_room_text(limit - in_use - accumulators)} of the "
                f"{_mib(limit)} limit for a micro-batch's activations and "
                f"gradients; the batch of {_samples(batch_size)} ran out of "
                f"memory even at {micro_batches_text(micro_batches)}. A single "
                "sample may well fit without the accumulators. HINT: "
                "`MemoryGuard(mode=\"shrink\")` trains at the micro-batch size "
                "without accumulators (one update per micro-batch), or pass a "
                "smaller `batch_size` to `fit`; mixed precision halves the "
                "accumulators."
            )
        if accumulators:
            accumulated = (
                f" The step accumulated gradients: the accumulators took "
                f"{_mib(accumulators)} of the limit (one per trainable weight); "
                "without them, `MemoryGuard(mode=\"shrink\")` may fit (one update "
                "per micro-batch)."
            )
        elif in_use:
            # Updating per micro-batch: beside the step are the weights, the
            # optimizer's state and the input's whole batches, which only a
            # smaller `batch_size` shrinks.
            held = (
                f" {_mib(in_use)} was in use before the batch (weights, optimizer "
                f"state and the input's batches of {_samples(batch_size)}), which left "
                f"{_room_text(limit - in_use)} for the step."
            )
            smaller_batch = (
                "pass a smaller `batch_size` to `fit` (the input holds whole batches "
                "beside the step), "
            )
    counted = micro_batches_text(micro_batches)
    tried = f" Tried: {counted} of one sample"
    if rungs_tried:
        tried += f", then the rungs: {', '.join(rungs_tried)}."
    elif escalate:
        tried += "."
    elif remat_refusal is None:
        tried += (
            "; no rung was allowed. HINT: `MemoryGuard(escalate=(\"remat\",))` "
            "recomputes activations in the backward pass instead of keeping them."
        )
    elif remat_refusal is not NO_RUNGS:
        tried += f"; the remat rung cannot be used on this model: {remat_refusal}."
    else:
        tried += "."
    return (
        f"A micro-batch of a single sample does not fit in device memory: the "
        f"batch of {_samples(batch_size)} ran out of "
        f"memory even at {counted}. Measured peak before the failure: "
        f"{_mib(peak)}; memory limit: {_mib(limit)}.{held}{tried}{accumulated} HINT: "
        f"{smaller_batch}use mixed precision "
        "(keras.mixed_precision.set_global_policy('mixed_float16')), a smaller "
        "model or input size, or a device with more memory (a larger memory "
        "limit)."
    )


def not_a_keras_model(user, type_name, module, keras_2, class_name=None):
    """The error where `user` got a model, or a model class, that is not Keras 3's.

    `type_name` and `module`: the class received (for a model class made
    with the mixin, `class_name` is that class and `type_name` its Keras 2
    base); `keras_2`: whether that class is Keras 2's (`tf_keras`).
    """
    if keras_2:
        what = (
            f"a Keras 2 model (`{module}.{type_name}`, from the `tf_keras` "
            "package, which `tf.keras` is where TF_USE_LEGACY_KERAS=1 is set)"
        )
        if class_name is not None:
            what = f"the class `{class_name}`, made on {what}"
        hint = (
            "build the model with Keras 3: `import keras` and `keras.Model`, "
            "`keras.layers` (not `tf_keras` or `tf.keras` with "
            "TF_USE_LEGACY_KERAS=1)"
        )
    else:
        what = f"`{module}.{type_name}`, which is not a `keras.Model`"
        hint = "pass a Keras 3 model (`keras.Model`, `keras.Sequential`)"
    return f"{user} works with Keras 3 models. Received: {what}. HINT: {hint}."
