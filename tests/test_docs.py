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


# --- every code block of the README and docs/ runs as written -------------------------------------------
import re
import shlex

import pytest

_BLOCK = re.compile(r"(<!-- docs-test: skip \(([^)]*)\) -->\n)?```(\w*)\n(.*?)```", re.S)
_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks():
    for path in _DOCS:
        for i, m in enumerate(_BLOCK.finditer(path.read_text())):
            skip, lang, code = m.group(2), m.group(3), m.group(4)
            if lang in ("python", "bash"):
                marks = [pytest.mark.skip(reason=skip)] if skip else []
                yield pytest.param(lang, code, id=f"{path.relative_to(ROOT)}:{i}", marks=[pytest.mark.slow, *marks])


def _commands(code: str) -> list[list[str]]:
    """The remat commands of a shell block (a setup line's last command; pip and pytest are the
    environment's, which CI itself runs)."""
    out = []
    for line in code.splitlines():
        line = line.split("&&")[-1].strip()
        words = shlex.split(line, comments=True)
        if words and words[0].endswith("remat"):
            out.append(words[1:])
    return out


@pytest.mark.parametrize("lang, code", list(_blocks()))
def test_every_code_block_runs_as_written(lang, code, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    if lang == "python":
        exec(compile(code, "<docs block>", "exec"), {"__name__": "__docs__"})
        return
    from remat.cli import main

    commands = _commands(code)
    if not commands:
        pytest.skip("no remat command in this block (environment setup, run by CI itself)")
    for argv in commands:
        assert main([*argv, "-q"]) == 0, (argv, capsys.readouterr().err)


def test_the_readme_is_read_in_three_minutes():
    """Everything beyond the first hour lives in docs/ (tests/test_front_door.py checks the links)."""
    assert len((ROOT / "README.md").read_text()) < 8000
