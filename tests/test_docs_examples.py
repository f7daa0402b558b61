"""Every Python block of the README and of `docs/` runs.

The blocks are collected by `tests/docs_blocks.py` (its docstring lists the
markers a page uses). A quick block runs in this process, in an empty
folder, as a script would; a slow one runs in a process of its own, under
a real allocator cap where the page speaks of running out of memory. The
count of blocks run and of excerpts is printed at the end of the session.
JAX and PyTorch blocks run in those backends' own test processes
(`tests/jax_backend/test_jax_docs.py`, `tests/torch_backend/test_torch_docs.py`).
"""

import pytest

import docs_blocks
from keras_memguard.testing import run_with_memory_cap

BLOCKS = docs_blocks.blocks_for("tensorflow")
# What the suite's own process runs under (tests/conftest.py).
SUITE_CAP_MIB = 8192


def run_block(block, tmp_path, monkeypatch):
    """Runs one block: in this process, or in a child for a slow one."""
    if block.slow:
        monkeypatch.chdir(tmp_path)
        run = run_with_memory_cap(
            block.code,
            memory_limit_mib=block.cap_mib or SUITE_CAP_MIB,
            timeout=block.timeout,
            env={"KERAS_HOME": str(tmp_path / "keras_home")},
            check=False,
            as_gpu=block.as_gpu,
        )
        assert run.returncode == 0, (
            f"{block.name} exited with {run.returncode}\n"
            f"{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
        )
        return
    docs_blocks.run_in_process(block, tmp_path, monkeypatch)


def _param(block):
    # A quick block is slow only for its seconds (the blocks together take
    # a quarter of the fast loop): the floor ends run it, the fast loop not.
    mark = pytest.mark.slow if block.slow else pytest.mark.slow(floor=True)
    return pytest.param(block, id=block.name, marks=[mark])


@pytest.mark.parametrize("block", [_param(block) for block in BLOCKS])
def test_docs_block_runs(block, tmp_path, monkeypatch, request):
    # The Markdown blocks this test runs, for the count printed at the end.
    request.node.user_properties.append(("docs_blocks", block.covers))
    run_block(block, tmp_path, monkeypatch)


def test_every_block_is_run_or_marked_as_an_excerpt():
    blocks = docs_blocks.all_blocks()
    run, excerpts = docs_blocks.counts(blocks)
    assert run > 0
    # Excerpts are few: a page shows code that runs.
    assert excerpts <= max(3, run // 5), [b.name for b in blocks if b.excerpt]
