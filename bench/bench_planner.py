"""The planner: out-of-memory errors per run, settled micro-batch, plan cost.

Part 1 (child processes under a real 600 MiB cap, the 64x64x3 CNN of
bench_guard.py): for each batch size, two runs of the same set-up in a row
sharing one plan cache (a fresh `$KERAS_HOME`): the first starts from
nothing, the second from the cache; then a third run started by hand at
the best count (`MemoryGuard(plan=False, micro_batches=best_k)`, the
baseline for time). Reported per run: out-of-memory errors, the micro-batch
it settled on, against the best micro-batch (the largest `ceil(batch / k)`
that plain training at that size fits), and the seconds to the end of the
first epoch, against the run started at the best count.

Part 2 (in process): the per-batch cost of `planner.plan` (median of
timed loops).

    python bench/bench_planner.py [--batches 272,408,1024] [--best 136]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CAP_MIB = 600
MARKER = "PLANNER_RESULT "


def child(batch, batches, by_hand_k=0):
    sys.argv = [sys.argv[0], "--child", "x"]
    sys.path.insert(0, HERE)
    import bench_guard as bg

    import keras_memguard

    model = bg.build_model("design_cnn")
    dataset = bg.generated_dataset("design_cnn", batch, batches)
    if by_hand_k:
        guard = keras_memguard.MemoryGuard(plan=False, micro_batches=by_hand_k)
    else:
        guard = keras_memguard.MemoryGuard()
    start = time.perf_counter()
    model.fit(dataset, epochs=1, verbose=0, callbacks=[guard])
    print(MARKER + json.dumps({
        "batch": batch,
        "ooms": guard.oom_recoveries,
        "k": guard.micro_batches,
        "micro": -(-batch // guard.micro_batches),
        "seconds": round(time.perf_counter() - start, 1),
    }), flush=True)


def run_child(batch, batches, keras_home, by_hand_k=0):
    from keras_memguard.testing import memory_cap_env

    env = memory_cap_env(CAP_MIB)
    env["KERAS_HOME"] = keras_home
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(batch), str(batches), str(by_hand_k)],
        env=env, capture_output=True, text=True, timeout=900,
    )
    for line in out.stdout.splitlines():
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER):])
    return {"batch": batch, "error": out.stderr[-2000:]}


def plan_cost(rounds=7, calls=20000):
    from keras_memguard import planner

    config = planner.make_planner_config()
    state = planner.init_planner_state(base_bytes=1e6)
    for work, peak in ((5e5, 2.5e8), (1e6, 4.2e8)):
        state = planner.observe(config, state, work, 6.3e8, peak)
    medians = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            planner.plan(config, state, 408, 12288.0, 6.3e8)
        medians.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(medians)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="272,408,1024")
    parser.add_argument("--best", type=int, default=136,
                        help="largest batch plain training fits under the cap")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    print(f"plan() per batch: {plan_cost():.1f} us (median of 7 x 20000 calls)")
    for batch in (int(b) for b in args.batches.split(",")):
        best = max(-(-batch // k) for k in range(1, batch + 1)
                   if -(-batch // k) <= args.best)
        best_k = -(-batch // best)
        results = {}
        with tempfile.TemporaryDirectory() as home:
            for run, k in (("first", 0), ("second", 0), ("by hand", best_k)):
                results[run] = run_child(batch, args.steps, home, by_hand_k=k)
        base = results["by hand"].get("seconds")
        for run, r in results.items():
            if "error" in r:
                print(f"batch {batch} {run}: failed\n{r['error']}")
                continue
            ratio = f" ({r['seconds'] / base:.2f}x by hand)" if base else ""
            print(
                f"batch {batch} {run} run: {r['ooms']} OOM, settled k={r['k']} "
                f"(micro-batch {r['micro']}, {r['micro'] / best:.2f} of best "
                f"{best}), first epoch {r['seconds']} s{ratio}"
            )


if __name__ == "__main__":
    main()
