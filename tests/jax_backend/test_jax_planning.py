"""Planning the micro-batch count from the compiled step's memory analysis."""

import keras
import pytest

from jax_models import make_wide_mlp
from jax_models import wide_data
from keras_memguard.backends.jax import ReplayingTrainFunction
from keras_memguard.backends.jax import StepCache
from keras_memguard.backends.jax import excess_bytes
from keras_memguard.backends.jax import plan_micro_batches
from keras_memguard.backends.compat import jax_state
from keras_memguard.backends.compat import symbolic_build
from keras_memguard.compiled_plan import StepMemory
from keras_memguard.backends.jax.compiled import spec_of

BATCH = 2048
MIB = 2**20
THRESHOLD = 0.9


@pytest.fixture(scope="module")
def planned():
    """The wide MLP built from a batch's shapes; its k=1 step analysed."""
    keras.utils.set_random_seed(0)
    model = make_wide_mlp()
    x, y = wide_data()
    batch = spec_of((x[:BATCH], y[:BATCH]))
    symbolic_build(model, batch)
    state = spec_of(jax_state(model))
    cache = StepCache(model)
    return model, cache, state, batch


def test_need_shrinks_with_more_micro_batches(planned):
    _, cache, state, batch = planned
    one, four = cache.memory(1, state, batch), cache.memory(4, state, batch)
    assert one.argument_bytes == four.argument_bytes  # the same state and batch
    assert four.temp_bytes < one.temp_bytes / 2
    assert one.alias_bytes == 0  # nothing donated: a failed step loses nothing
    assert one.need_bytes == (
        one.argument_bytes + one.output_bytes + one.temp_bytes - one.alias_bytes
    )


def test_a_step_over_the_limit_at_one_is_planned_at_the_smallest_count_that_fits(planned):
    _, cache, state, batch = planned
    analyse = lambda k: cache.memory(k, state, batch)  # noqa: E731
    one = analyse(1)
    # A limit the whole batch exceeds, that a few micro-batches fit.
    fixed = one.argument_bytes + one.output_bytes
    limit = int((fixed + one.temp_bytes / 3) / THRESHOLD)
    decided = plan_micro_batches(analyse, BATCH, limit, threshold=THRESHOLD)

    assert one.need_bytes >= THRESHOLD * limit
    assert decided.fits and decided.micro_batches > 1
    assert decided.memory.need_bytes < THRESHOLD * limit
    # The count below does not fit: it is the smallest.
    below = analyse(decided.micro_batches - 1)
    assert below.need_bytes >= THRESHOLD * limit
    assert len(decided.analysed) <= 6, [m.micro_batches for m in decided.analysed]
    assert "under target 90%" in decided.reason


def test_memory_in_use_and_a_margin_count_against_the_limit(planned):
    _, cache, state, batch = planned
    analyse = lambda k: cache.memory(k, state, batch)  # noqa: E731
    limit = int(1.5 * analyse(1).need_bytes)
    assert plan_micro_batches(analyse, BATCH, limit).micro_batches == 1
    # Memory in use stands in for the step's arguments (it holds them).
    in_use = analyse(1).argument_bytes + limit // 2
    busy = plan_micro_batches(analyse, BATCH, limit, in_use_bytes=in_use)
    assert busy.micro_batches > 1
    spare = plan_micro_batches(analyse, BATCH, limit, margin_bytes=limit // 2)
    assert spare.micro_batches == busy.micro_batches


def test_nothing_fits_says_so(planned):
    _, cache, state, batch = planned
    analyse = lambda k: cache.memory(k, state, batch)  # noqa: E731
    decided = plan_micro_batches(analyse, BATCH, analyse(1).argument_bytes, max_micro_batches=16)
    assert not decided.fits
    assert decided.micro_batches == 16
    assert "no count tried fits" in decided.reason


def test_a_count_that_cannot_be_compiled_within_memory_does_not_fit(planned):
    _, cache, state, batch = planned
    tried = []

    def analyse(k):  # None: the GPU's autotuner ran out of memory compiling
        tried.append(k)
        return None if k < 8 else cache.memory(k, state, batch)

    decided = plan_micro_batches(analyse, BATCH, 1 << 40)
    # Doubled until a count compiled, then the counts between were tried:
    # 8 is the smallest that compiles.
    assert decided.fits and decided.micro_batches == 8
    assert tried[:4] == [1, 2, 4, 8] and sorted(tried[4:]) == [5, 6, 7], tried

    nothing = plan_micro_batches(lambda k: None, 16, 1 << 40, max_compiles=3)
    assert not nothing.fits and nothing.memory is None and nothing.predicted_usage is None
    assert nothing.micro_batches == 4
    assert "could not be compiled within the device's memory at 4 micro-batches" in nothing.reason


def test_analyses_that_do_not_fall_with_the_micro_batch_do_not_end_at_one_sample():
    # What an H100 under a 256 MiB limit analysed for a 32x32 CNN at batch
    # 4096 in one of five runs (MiB: arguments, outputs, temporaries): 1 to
    # 8 micro-batches did not compile (the autotuner out of memory), and
    # the autotuner's kernels made 17 need more than 16. Planning settled
    # at 4096 micro-batches of one sample, where 22 fit.
    measured = {16: 140.1, 17: 154.8, 21: 135.4, 4096: 0.4}
    tried = []

    def analyse(k):
        tried.append(k)
        if k < 16:
            return None
        temp = measured.get(k, 28.0 + 0.5 * -(-4096 // k))
        return StepMemory(k, int(48.1 * MIB), int(0.1 * MIB), int(temp * MIB), 0)

    decided = plan_micro_batches(analyse, 4096, 256 * MIB, in_use_bytes=96.2 * MIB)
    assert decided.fits and 21 < decided.micro_batches <= 64, (decided, tried)
    assert sum(k >= 16 for k in tried) <= 8, tried


def test_planning_arguments_are_checked():
    with pytest.raises(ValueError, match="threshold=1.5"):
        plan_micro_batches(lambda k: None, 8, 100, threshold=1.5)
    with pytest.raises(ValueError, match="limit_bytes=0"):
        plan_micro_batches(lambda k: None, 8, 0)


def test_excess_bytes_of_a_measured_peak():
    from keras_memguard.backends.jax import StepMemory

    memory = StepMemory(2, 100, 40, 60, 0)
    assert excess_bytes(memory, 100, 230) == 30
    assert excess_bytes(memory, 100, 150) == 0
    assert excess_bytes(memory, None, 150) is None


def test_fit_runs_the_first_batch_at_the_planned_count_before_any_step(planned):
    _, _, _, batch_spec = planned
    keras.utils.set_random_seed(0)
    model = make_wide_mlp()
    x, y = wide_data()
    cache = StepCache(model)
    ran = []

    def plan(state, data):
        analyse = lambda k: cache.memory(k, state, data)  # noqa: E731
        one = analyse(1)
        limit = int((one.argument_bytes + one.output_bytes + one.temp_bytes / 3) / THRESHOLD)
        decided = plan_micro_batches(analyse, len(data[0]), limit, threshold=THRESHOLD)
        ran.append(decided.micro_batches)
        return decided.micro_batches

    function = ReplayingTrainFunction(model, cache=cache, plan=plan)
    model.train_function = function
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)

    assert ran and ran[0] > 1
    assert function.micro_batches == ran[-1]
    # Every count planned was compiled once per batch shape and run from the
    # cache: the keys hold the planned counts.
    assert {k for k, _ in cache.keys()} >= set(ran)
