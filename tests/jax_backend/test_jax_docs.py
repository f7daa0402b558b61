"""The documentation's JAX blocks (`<!-- docs-test: backend=jax -->`) run.

Collected by `tests/docs_blocks.py`; each runs in this process (Keras on
jax), in an empty folder, as a script would.
"""

import pytest

import docs_blocks

BLOCKS = docs_blocks.blocks_for("jax")


@pytest.mark.skipif(not BLOCKS, reason="no jax block in the documentation")
@pytest.mark.parametrize("block", BLOCKS or [None], ids=lambda block: getattr(block, "name", "none"))
def test_docs_block_runs(block, tmp_path, monkeypatch, request):
    request.node.user_properties.append(("docs_blocks", block.covers))
    docs_blocks.run_in_process(block, tmp_path, monkeypatch)
