from pathlib import Path

from remat.profiler.docs import render
from remat.profiler.registry import REGISTRY

ROOT = Path(__file__).resolve().parents[1]


def test_flops_table_is_generated_from_the_registry():
    text = (ROOT / "docs" / "flops.md").read_text()
    assert text == render(), "docs/flops.md is stale: python -m remat.profiler.docs > docs/flops.md"
    for packet in REGISTRY:
        assert f"`{packet.__name__}" in text


def test_memory_rule_table_is_generated_from_the_registry():
    from remat.profiler.docs import render_memory

    text = (ROOT / "docs" / "memory.md").read_text()
    assert text == render_memory(), "docs/memory.md is stale: python -m remat.profiler.docs --memory > docs/memory.md"
