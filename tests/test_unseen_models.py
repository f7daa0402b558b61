"""Models the guard was not tuned for, under a real cap: never worse than plain Keras.

Each runs in its own process (`tests/programs/unseen_under_cap.py`): on
today's TensorFlow a crash ends the process, and the test asserts a clean
exit and every batch trained.
"""

import math

import keras
import pytest

from keras_memguard.testing import run_with_memory_cap

pytestmark = pytest.mark.slow


def _run(memory_limit_mib, *args, as_gpu=False):
    import programs

    # The XLA CNN took 265-333 s on two busy cores (its compiles): the
    # timeout only guards against a hang.
    run = run_with_memory_cap(
        programs.source("unseen_under_cap", *args),
        memory_limit_mib=memory_limit_mib,
        timeout=900,
        check=False,
        as_gpu=as_gpu,
    )
    # A crash (a signal, an abort) is a negative status and no result.
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.result is not None, run.stdout[-3000:]
    return run.result


def _trained_every_batch(result):
    assert result["error"] is None, result
    assert result["batches"] == result["expected_batches"], result
    assert all(math.isfinite(v) for v in result["loss"]), result


def test_a_decoder_language_model_trains_where_its_replay_crashed():
    # 103 MiB is 0.55x the decoder's plain peak (184 MiB); plain Keras runs
    # out of memory at batch 32 here. No metric reads the logits, so none
    # are kept across micro-batches: the planned split runs with no error.
    result = _run(103, "decoder")
    _trained_every_batch(result)
    assert result["oom_recoveries"] == 0, result


def test_a_fine_tunings_second_fit_is_planned_for_the_base_it_now_trains():
    # 126 MiB is 0.55x plain training's peak with the base trainable. The
    # first `fit`'s step (the base frozen) needs half of it; planned from
    # its readings, the second ran whole batches and ran out of memory
    # twice. Planned anew, neither `fit` runs out of memory.
    result = _run(126, "fine_tune")
    assert result["batches"] == 8, result
    assert [fit["oom_recoveries"] for fit in result["fits"]] == [0, 0], result
    assert all(math.isfinite(v) for fit in result["fits"] for v in fit["loss"]), result
    # The second `fit` splits its batches where the first did not need to.
    assert max(result["ks"][4:]) > 1, result


def test_validation_and_predict_batches_on_xla_are_sliced_before_they_run():
    # 58 MiB is 0.55x plain XLA training's peak at batch 64 (106 MiB).
    # Validation and `predict` at 512 do not fit whole; their steps are
    # compiled with XLA too, where an error ended `fit` (plain Keras: the
    # process). Planned from their compiled programs, nothing runs out of
    # memory.
    result = _run(58, "validation", as_gpu=True)
    assert result["jit_compile"] is True, result
    assert result["error"] is None, result
    assert result["eval_oom_recoveries"] == 0, result
    assert result["predict_oom_recoveries"] == 0, result
    assert math.isfinite(result["val_loss"][0]), result
    assert result["predicted"] == [512, 4], result
    planned = [m for m in result["messages"] if "slices for a batch of 512 of fit's validation" in m]
    assert planned and "(XLA): compiled step needs" in planned[0], result["messages"]


def test_validation_batches_larger_than_training_batches_are_planned_in_slices():
    # Without XLA: 63 MiB is 0.55x plain training's peak at batch 64.
    # Validation at 512 was sliced only after running out of memory (three
    # times, 10 s each here); planned from the layer outputs and then its
    # own readings, as `evaluate` is, it runs out of memory no more.
    result = _run(63, "validation", "off", as_gpu=True)
    assert result["jit_compile"] is False, result
    assert result["error"] is None, result
    assert result["eval_oom_recoveries"] == 0, result
    assert math.isfinite(result["val_loss"][0]), result
    assert result["predicted"] == [512, 4], result


@pytest.mark.parametrize("xla", [True, False], ids=["xla", "no_xla"])
def test_a_stateful_rnn_trains_whole_batches_under_a_cap(xla):
    # 60 MiB: the XLA step of a whole batch needs 51.9 MiB beside 3 MiB in
    # use (over the guard's threshold, under the limit, where plain `fit`
    # trains). The guard used to split the first batch, which the stateful
    # layers refused (ValueError); `evaluate` and `predict` were sliced too.
    result = _run(60, "stateful", *([] if xla else ["off"]), as_gpu=True)
    assert result["jit_compile"] is xla, result
    _trained_every_batch(result)
    assert result["ks"] == [1] * 8 and result["oom_recoveries"] == 0, result
    assert math.isfinite(result["evaluated"]) and result["predicted"] == [128, 1], result
    assert any("trains the batches of Functional whole" in m for m in result["messages"])


def test_a_stateful_rnns_xla_step_that_cannot_fit_is_refused_before_it_runs():
    # Plain `fit` runs out of memory inside the XLA program here and the
    # process aborts. No count can help a stateful model: the guard reads
    # the compiled step and stops before it runs.
    result = _run(20, "stateful", as_gpu=True)
    assert result["jit_compile"] is True, result
    assert result["batches"] == 0, result
    assert result["error"].startswith("MicroBatchTooLargeError: The XLA-compiled step"), result
    assert "stateful layers 'lstm', 'lstm_1'" in result["error"], result
    assert "Nothing ran" in result["error"], result


@pytest.mark.parametrize("xla", [True, False], ids=["xla", "no_xla"])
def test_a_gan_with_its_own_train_step_trains_whole_batches_under_a_cap(xla):
    # keras.io's DCGAN: its own `compile` (two optimizers) and `train_step`.
    # The guard used to refuse it at the start of `fit` where plain `fit`
    # trains; its batches now run whole, as in plain `fit` (which trains
    # under 170 MiB with XLA, not under 160).
    result = _run(200, "gan", *([] if xla else ["off"]), as_gpu=True)
    assert result["jit_compile"] is xla, result
    assert result["error"] is None, result
    assert result["batches"] == result["expected_batches"] == 8, result
    assert result["ks"] == [1] * 8 and result["oom_recoveries"] == 0, result
    assert all(math.isfinite(v) for v in result["d_loss"]), result
    assert any("trains the batches of GAN whole" in m for m in result["messages"])


def test_a_gans_xla_step_whose_buffers_find_no_place_is_refused_before_it_runs():
    # 150 MiB: the step's 75 MiB beside 10 MiB in use fits the limit in
    # total, but its 75 MiB buffer is over half the free block, which the
    # allocator then hands it whole: plain `fit` runs out of memory inside
    # the XLA program and the process aborts. The guard tries the buffers
    # first and stops before the step runs.
    result = _run(150, "gan", as_gpu=True)
    assert result["jit_compile"] is True, result
    assert result["batches"] == 0, result
    error = result["error"]
    assert error.startswith("MicroBatchTooLargeError: The XLA-compiled step"), result
    assert "found no place in the free memory" in error, error
    assert "the own `train_step` of GAN runs the whole batch. Nothing ran." in error, error


def test_a_ragged_input_on_xla_trains_whole_and_a_batch_that_cannot_fit_is_named():
    # XLA compiles a step for fixed shapes; a ragged batch's micro-batches
    # have none. The guard searched counts whose programs all failed to
    # compile and blamed the device's memory ("could not be compiled within
    # the device's memory at 10 micro-batches"). Plain `fit` aborts the
    # process under 100 MiB (the whole step needs 91 MiB beside 24 MiB in
    # use); under 200 MiB it trains, and so does the guard, whole.
    result = _run(200, "ragged", as_gpu=True)
    assert result["jit_compile"] is True, result
    _trained_every_batch(result)
    assert result["ks"] == [1, 1, 1, 1] and result["oom_recoveries"] == 0, result
    assert any("its input is ragged" in m for m in result["messages"]), result
    refused = _run(100, "ragged", as_gpu=True)
    assert refused["batches"] == 0, refused
    error = refused["error"]
    assert error.startswith("MicroBatchTooLargeError: The XLA-compiled step"), error
    assert "Nothing ran" in error and "`jit_compile=False`" in error, error


def test_a_ragged_input_without_xla_is_split_under_a_cap():
    # 60 MiB: 0.75x the whole step's peak without XLA.
    result = _run(60, "ragged", "off", as_gpu=True)
    assert result["jit_compile"] is False, result
    _trained_every_batch(result)
    assert min(result["ks"]) > 1 and result["oom_recoveries"] == 0, result


def test_a_gans_batch_that_cannot_fit_is_named_after_one_error_without_xla():
    result = _run(50, "gan", "off", as_gpu=True)
    assert result["jit_compile"] is False, result
    assert result["batches"] == 0, result
    assert result["error"].startswith(
        "MicroBatchTooLargeError: Out of memory on a batch of 64 samples, which "
        "MemoryGuard cannot split: the own `train_step` of GAN"
    ), result
    assert "find_batch_size" in result["error"], result


def test_an_optimizer_update_that_cannot_fit_is_named_after_one_error():
    # 70 MiB: Adam's update of a 60000x64 embedding does not fit beside the
    # weights and slots (47 MiB) at any batch size, in plain `fit` too. The
    # guard used to split on to 512 micro-batches (2 errors, 53 s) and then
    # blame a single sample.
    result = _run(70, "large_embedding", as_gpu=True)
    assert result["batches"] == 0, result
    assert result["error"].startswith(
        "MicroBatchTooLargeError: The optimizer's update ran out of memory: `adam/"
    ), result
    assert "no micro-batch count shrinks it" in result["error"], result
    assert result["oom_recoveries"] <= 1, result


def test_kept_outputs_of_a_decoder_do_not_crash_a_new_count():
    # A metric of its own keeps the whole batch's logits (31 MiB here). The
    # buffer they went into was a constant TensorFlow folded when the step
    # for a new count was first run: under the cap that crashed the process.
    result = _run(125, "decoder", "metric")
    _trained_every_batch(result)
    assert result["samples"] == [128.0], result


def test_an_xla_step_is_planned_from_its_compiled_program_with_no_error():
    # 145 MiB is 0.55x plain Keras' XLA peak here (264 MiB); after an
    # out-of-memory error in an XLA program TensorFlow aborts the process.
    # 32x32 images: the step's convolutions run as naive loops inside the
    # micro-batch loop on XLA:CPU, and at 64x64 the test took 5 minutes.
    result = _run(145, "xla_cnn")
    assert result["jit_compile"] is True
    _trained_every_batch(result)
    assert result["oom_recoveries"] == 0, result
    # Split at every batch (plain training does not fit). The count may
    # rise where more is in use before a batch (Keras 3.8's numpy input
    # holds more from the second batch on).
    assert all(k > 1 for k in result["ks"]), result


@pytest.mark.skipif(
    tuple(int(part) for part in keras.version().split(".")[:2]) < (3, 9),
    reason="at the newest end only (CI time); the floor runs the XLA CNN above",
)
def test_a_decoder_compiled_as_on_a_gpu_is_split_no_more_than_its_free_blocks_need():
    # As on a GPU (the cap one region, `jit_compile="auto"` resolving to
    # XLA). At 6 micro-batches the program fits in total but needs a 74.5
    # MiB block the allocator does not have; the search went to 12 (3
    # samples a micro-batch) and the failed probe, counted as the first
    # batch's peak, taught a margin that pushed later batches higher. Counts
    # between 6 and 12 pass the probe.
    result = _run(103, "decoder", as_gpu=True)
    _trained_every_batch(result)
    assert result["jit_compile"] is True, result
    assert result["oom_recoveries"] == 0, result
    assert max(result["ks"]) <= 9, result
    assert len(set(result["ks"])) == 1, result
    # The probes' blocks (a failed one reaches the cap) are taken and freed
    # before the first step: `MemoryMonitor` logs the step's peak, not the
    # probes' (it logged 100% for the first batch, 45% for the others).
    first, *later = result["usages"]
    assert first <= max(later) + 0.05, result["usages"]


def test_an_xla_step_given_a_whole_free_block_keeps_its_count():
    # As on a GPU. The step's program (152.6 MiB with what is in use, 80%
    # of the cap) is one buffer over half the free memory: the allocator
    # hands it the whole block, and the batch peaks near the cap, as plain
    # `fit`'s do here (188.5 MiB, every batch trained). Counted as memory
    # taken beside the step, that remainder made the guard stop `fit`
    # after one batch with MicroBatchTooLargeError.
    result = _run(190, "xla_mlp", as_gpu=True)
    _trained_every_batch(result)
    assert result["jit_compile"] is True, result
    assert result["oom_recoveries"] == 0, result
    assert result["ks"] == [1, 1, 1, 1], result


def test_an_xla_evaluate_that_runs_out_of_memory_stops_with_a_clear_error():
    result = _run(150, "xla_evaluate")
    assert result["error"].startswith("CompiledStepOutOfMemoryError: An XLA-compiled step of `evaluate`"), result
    assert result["eval_oom_recoveries"] == 0, result


def _accumulators_run(mode, shape, *more, memory_limit_mib=150, env=None):
    import programs

    return run_with_memory_cap(
        programs.source("accumulators_under_cap", mode, shape, *more),
        memory_limit_mib=memory_limit_mib,
        timeout=400,
        env=env,
    )


# One inter-op thread: TensorFlow runs the step's ops one at a time, as it
# runs a GPU's kernels, so what is alive together is the same from run to run
# (on the CPU's thread pool an update can free a gradient early or late).
_IN_ORDER = {"TF_NUM_INTEROP_THREADS": "1"}


def test_a_refusal_names_the_accumulators_when_they_are_what_does_not_fit():
    # The eight-layer MLP: the weights, Adam's slots and the inputs take
    # 97-99 MiB of 130, the accumulators 32 MiB more, so no micro-batch fits
    # beside them. (The two-layer MLP of the tests below accumulates
    # within a few MiB of its plain peak: under 150 MiB it ran out of
    # memory in 2 runs of 2 here and trained every batch on a busier CPU,
    # see bench/RESULTS.md.)
    result = _accumulators_run("accumulate", "deep", memory_limit_mib=130, env=_IN_ORDER).result
    assert result["error"] is not None, result
    error = result["error"]
    assert error.startswith("MicroBatchTooLargeError: Accumulating gradients does not fit"), error
    assert "does not fit in device memory: the batch" not in error
    assert "the accumulators take 32.1 MiB" in error, error
    assert 'mode=\\"shrink\\"' in error or 'mode="shrink"' in error, error


def test_a_refusal_at_one_sample_says_what_the_accumulators_took():
    # The sixteen-layer MLP over 2304 timesteps: 152 MiB in use before the
    # batch and 64 MiB of accumulators leave 124 MiB of 340, more than a
    # micro-batch's gradients (the up-front check passes by 60 MiB), and one
    # sample's activations need more than that (accumulating one sample
    # failed under 400 MiB and trained under 420). The text names the
    # accumulators and offers the step without them.
    result = _accumulators_run("accumulate", "long", memory_limit_mib=340, env=_IN_ORDER).result
    error = result["error"]
    assert error is not None and error.startswith(
        "MicroBatchTooLargeError: A micro-batch of a single sample does not fit"
    ), result
    assert "the accumulators took 64.1 MiB" in error, error
    assert 'mode=\\"shrink\\"' in error or 'mode="shrink"' in error, error
    assert result["batches"] == 0, result


def test_a_refusal_says_nothing_is_left_where_the_accumulators_pass_the_limit():
    from keras_memguard.callbacks.messages import too_large

    mib = 2**20
    message = too_large(16, 16, None, 130 * mib, accumulation=(105 * mib, 32 * mib))
    assert "which leaves nothing of the 130.0 MiB limit" in message, message
    message = too_large(16, 16, None, 140 * mib, accumulation=(105 * mib, 32 * mib))
    assert "which leaves 3.0 MiB of the 140.0 MiB limit" in message, message
    # Room for the micro-batch's gradients left, and still no sample fit:
    # the text says what the accumulators took; a step without them, none.
    message = too_large(16, 16, None, 180 * mib, accumulation=(105 * mib, 32 * mib))
    assert message.startswith("A micro-batch of a single sample does not fit"), message
    assert "the accumulators took 32.0 MiB" in message and 'mode="shrink"' in message, message
    assert "accumulators" not in too_large(16, 16, None, 180 * mib), message
    assert "accumulators" not in too_large(16, 16, None, 180 * mib, accumulation=(105 * mib, 0))


def test_a_refusal_without_accumulators_says_what_was_held_beside_the_step():
    # A two-headed MLP under 49 MiB with mode="auto" (bench/RESULTS.md):
    # without accumulators, one sample a micro-batch ran out of memory
    # beside 37.4 MiB of weights, Adam's slots and batches of 1024, where
    # plain `fit` at batch 12 trains; the text said only that one sample
    # does not fit, and offered no smaller batch.
    from keras_memguard.callbacks.messages import too_large

    mib = 2**20
    message = too_large(1024, 1024, 45 * mib, 49 * mib, accumulation=(int(37.4 * mib), 0))
    assert (
        "37.4 MiB was in use before the batch (weights, optimizer state and the "
        "input's batches of 1024 samples), which left 11.6 MiB for the step." in message
    ), message
    assert "HINT: pass a smaller `batch_size` to `fit`" in message, message
    assert "accumulators" not in message, message
    # More in use than the limit: nothing left, still no accumulators named.
    message = too_large(8, 8, None, 40 * mib, accumulation=(41 * mib, 0))
    assert "which left nothing for the step" in message and "Accumulating" not in message


@pytest.mark.parametrize("jit", ["off", "xla"])
def test_auto_mode_stops_accumulating_where_the_accumulators_do_not_fit(jit):
    # The two-layer MLP under 150 MiB: "auto" goes on without the
    # accumulators and trains every batch. The memory in use
    # before the first batch shows they cannot fit, so no step runs out of
    # memory.
    # TensorFlow's warnings on: each allocation that fails says so.
    run = _accumulators_run("auto", "wide", jit, env={"TF_CPP_MIN_LOG_LEVEL": "1"})
    result = run.result
    assert result["error"] is None, result
    assert result["batches"] == 4, result
    assert result["oom_recoveries"] == 0, result
    switched = [m for m in result["messages"] if "gradient accumulation off" in m]
    # On XLA at the floor (Keras 3.8) the compiled step of the whole batch
    # (no accumulators at one micro-batch) fits: nothing to switch.
    assert len(switched) == 1 if jit == "off" else len(switched) <= 1, result["messages"]
    for line in switched:
        assert "the accumulators take 32.1 MiB" in line, switched
    # On XLA a count's buffers are tried on the allocator before its step
    # runs. A try that fails waits 10 s in TensorFlow's allocator, so a
    # block that found no room is not tried again at another count (the
    # same 32 MiB block failed 8 times, 80 s of waiting, before).
    failed_tries = run.stderr.count("requested by op Empty")
    assert failed_tries <= (1 if jit == "xla" else 0), run.stderr[-3000:]
