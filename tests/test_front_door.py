"""What a new user meets first: `remat --help`, argument errors, model specs, and the docs' links.

Each CLI test runs the real command in a subprocess and reads its real output."""
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import remat_env

ROOT = Path(__file__).resolve().parents[1]


def _help_imports_torch(*argv: str) -> tuple[str, bool]:
    """Run `remat ARGV --help` as the console script does, and say whether torch got imported."""
    code = textwrap.dedent(f"""
        import runpy, sys
        sys.argv = ["remat", *{list(argv)!r}, "--help"]
        try:
            runpy.run_module("remat.cli", run_name="__main__")
        except SystemExit:
            pass
        print("TORCH" if "torch" in sys.modules else "NO-TORCH")
    """)
    done = subprocess.run([sys.executable, "-c", code], env=remat_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout, done.stdout.strip().endswith("NO-TORCH")


@pytest.mark.parametrize("command", [(), ("flops",), ("profile",), ("plan",), ("sweep",)])
def test_help_answers_without_importing_torch(command):
    start = time.perf_counter()
    text, torch_free = _help_imports_torch(*command)
    assert torch_free, f"remat {' '.join(command)} --help imported torch"
    assert time.perf_counter() - start < 5
    assert "usage: remat" in text


def test_every_flag_has_help():
    from remat.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict)).choices
    for name, sub in subparsers.items():
        for action in sub._actions:
            assert action.help and len(action.help) > 10, f"remat {name} {action.option_strings or action.dest}"


def test_import_remat_is_lazy_and_names_still_resolve():
    code = ("import sys, remat; assert 'torch' not in sys.modules; "
            "assert callable(remat.trace) and callable(remat.checkpoint) and callable(remat.checkpoint_); "
            "import remat.trace.check; assert callable(remat.trace), 'remat.trace became the subpackage'; "
            "assert remat.InfeasibleBudget.__name__ == 'InfeasibleBudget'; "
            "assert set(remat.__all__) <= set(dir(remat)); print('ok')")
    done = subprocess.run([sys.executable, "-c", code], env=remat_env(), capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr


@pytest.mark.parametrize("argv, says", [
    (["plan", "--batch", "0"], "--batch: must be a positive integer, got 0"),
    (["plan", "--batch", "-3"], "--batch: must be a positive integer, got -3"),
    (["plan", "--budget", "0"], "--budget: budget '0' must be positive"),
    (["plan", "--budget", "150%"], "--budget: budget fraction '150%' must be in (0, 1]"),
    (["profile", "--top", "0"], "--top: must be a positive integer"),
    (["flops", "torchvison:resnet18"], "did you mean torchvision?"),
])
def test_bad_arguments_fail_at_once_with_one_line(run_remat, argv, says):
    start = time.perf_counter()
    done = run_remat(*argv)
    assert time.perf_counter() - start < 2.0
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert says in done.stderr


@pytest.mark.slow  # imports torchvision in a subprocess; spec suggestions run by default above
def test_a_misspelled_torchvision_model_gets_close_names(run_remat):
    done = run_remat("flops", "torchvision:resnet81")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "did you mean" in done.stderr and "resnet18" in done.stderr and "resnet101" in done.stderr


FACTORIES = '''
import torch

def make(batch):
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)), (torch.randn(batch, 8),)

def no_batch():
    return make(2)

def only_model(batch):
    return torch.nn.Linear(8, 8)
'''


@pytest.fixture
def factory_dir(tmp_path):
    """A factory module in a working directory, and a launcher elsewhere that runs remat the way
    the installed `remat` script does (its own directory first on sys.path, not the current one)."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "mymodels.py").write_text(FACTORIES)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    launcher = bin_dir / "remat"
    launcher.write_text("import sys\nfrom remat.cli import main\nsys.exit(main())\n")

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(launcher), *argv], cwd=work, env=remat_env(),
                              capture_output=True, text=True, timeout=300)

    return run


@pytest.mark.slow  # (3.5 s) the first mistake case below imports its factory module from the cwd too
def test_a_factory_in_the_current_directory_loads(factory_dir):
    done = factory_dir("flops", "mymodels:make", "--batch", "3")
    assert done.returncode == 0, done.stderr
    assert "mymodels:make  batch 3" in done.stdout and "aten.addmm" in done.stdout


# each case starts python and imports torch (~1.5 s): one runs by default, the rest with the slow tests
@pytest.mark.parametrize("spec, says", [
    ("mymodels:mkae", "has no attribute 'mkae' (did you mean make?)"),
    pytest.param("mymodels:no_batch", "has no 'batch' parameter", marks=pytest.mark.slow),
    pytest.param("mymodels:only_model", "returned only a model", marks=pytest.mark.slow),
    pytest.param("nomodule:make", "cannot import 'nomodule'", marks=pytest.mark.slow),
])
def test_factory_mistakes_are_one_line_naming_the_contract(factory_dir, spec, says):
    done = factory_dir("flops", spec)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert says in done.stderr and "factory(batch=N)" in done.stderr


@pytest.mark.slow
def test_flops_without_a_spec_counts_the_default_model(run_remat):
    done = run_remat("flops", "--batch", "1", "--top", "2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("mlp  batch 1") and "aten.addmm" in done.stdout


# --- the docs' links ---------------------------------------------------------------------------------
_MD_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
_REPO_PATH = re.compile(r"(?<![\w./-])((?:docs|benchmarks|src|tests)/[\w./-]*\w)")


def _tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / line for line in out.splitlines() if line]


def _links(path: Path) -> list[tuple[str, Path]]:
    text = path.read_text()
    found = [(m.group(1), path.parent / m.group(1)) for m in _MD_LINK.finditer(text)
             if path.suffix == ".md" and not m.group(1).startswith(("http://", "https://", "mailto:"))]
    found += [(m.group(1), ROOT / m.group(1)) for m in _REPO_PATH.finditer(text)]
    return found


def test_every_file_the_readme_docs_and_docstrings_name_exists():
    files = [ROOT / "README.md", *_tracked("docs/*.md"), *_tracked("src/remat/**.py", "src/remat/*.py")]
    assert len(files) > 40
    missing = [f"{f.relative_to(ROOT)}: {text}" for f in files for text, target in _links(f)
               if not target.exists() and not any(c in text for c in "*{<")]
    assert not missing, "\n".join(missing)


def test_nothing_refers_to_a_design_file_the_repository_lacks():
    name = "DESIGN" + ".md"
    offenders = [str(f.relative_to(ROOT)) for f in _tracked() if f.suffix in (".py", ".md", ".txt", ".toml")
                 and f.exists() and name in f.read_text(errors="ignore")]
    assert not offenders, f"{name} is docs/design.md: {offenders}"
    assert (ROOT / "docs" / "design.md").exists()


def _imports() -> dict[str, set[str]]:
    """remat's modules and the remat modules each imports (at the top or inside a function)."""
    import ast

    src = ROOT / "src"
    modules = {}
    for path in (src / "remat").rglob("*.py"):
        parts = path.relative_to(src).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not (node.level or (node.module or "").startswith("remat")):
                continue
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                found = f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target
                while found and found not in modules:
                    found = found.rpartition(".")[0]
                if found and found != name:
                    edges[name].add(found)
    return edges


def test_no_import_runs_in_a_circle():
    """docs/design.md's rule: imports point down the module map, so no module imports one that
    imports it back (directly or around a longer circle)."""
    edges = _imports()
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for nxt in sorted(edges[module]):
            assert state.get(nxt) != 1, "import circle: " + " -> ".join(path + [module, nxt])
            if nxt not in state:
                visit(nxt, path + [module])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [])


def test_the_module_map_names_every_module():
    text = (ROOT / "docs" / "design.md").read_text()
    top = sorted(p.stem if p.is_file() else p.name for p in (ROOT / "src" / "remat").iterdir()
                 if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").exists()))
    missing = [name for name in top if f"`{name}.py`" not in text and f"`{name}/" not in text]
    assert not missing, f"docs/design.md's module map lacks {missing}"


def test_nothing_in_remat_imports_the_command_line():
    """The CLI sits on top of the pipeline (docs/design.md): the library never needs it."""
    edges = _imports()
    users = sorted(m for m, targets in edges.items() if not m.startswith("remat.cli")
                   and any(t == "remat.cli" or t.startswith("remat.cli.") for t in targets))
    assert not users, f"{users} import remat.cli"


def test_profiling_needs_no_planner():
    """``remat.profile`` stops where planning starts (profiled.py): no search, solver or sharding
    module is imported to profile a model."""
    code = ("import sys, torch, remat\n"
            "remat.profile(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), torch.randn(2, 4))\n"
            "print(sorted(m for m in sys.modules if m.startswith(('remat.planner', 'remat.sharding', "
            "'remat.solvers.rotor', 'remat.solvers.chen', 'remat.api'))))\n")
    done = subprocess.run([sys.executable, "-c", code], env=remat_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_planning_enters_the_search_and_the_stage_model_once_each():
    """docs/design.md's layering, measured: while plan_problem runs (a budget, "min", an
    infeasible budget, a fixed solver), the code that holds the problem (the planner package, and
    what calls it) enters planner/search.py and solvers/model.py from one place each (verified_plan,
    evaluate), not from several places that each rebuild what the last one had.  The solvers are
    not counted: they see a coarse stage model, never the problem."""
    import os

    import torch

    import remat
    from remat.budget import parse_budget
    from remat.planner import plan_problem, prepare
    from remat.zoo import ResidualMLP

    torch.manual_seed(0)
    problem = prepare(ResidualMLP(width=32, depth=3, classes=1), (torch.randn(16, 64, 32),))
    watched = (str(Path("planner", "search.py")), str(Path("solvers", "model.py")))
    entries: dict[str, set[tuple[str, str]]] = {w: set() for w in watched}

    def hook(frame, event, arg):
        if event != "call" or frame.f_back is None:
            return
        callee, caller = frame.f_code.co_filename, frame.f_back.f_code.co_filename
        for w in watched:
            if callee.endswith(w) and not caller.endswith(w) and os.sep + "solvers" + os.sep not in caller:
                entries[w].add((f"{caller}:{frame.f_back.f_code.co_name}", frame.f_code.co_name))

    sys.setprofile(hook)
    try:
        for solver, budget in (("rotor", "0.6"), ("rotor", "min"), ("rotor", "0.02"), ("chen-greedy", "0.6"),
                               ("chen-sqrtn", None)):
            try:
                plan_problem(problem, solver, parse_budget(budget) if budget else None)
            except remat.InfeasibleBudget:
                assert budget == "0.02"
    finally:
        sys.setprofile(None)
    for w, found in entries.items():
        assert found, f"the walk never reached {w}: the measurement is broken"
        assert len(found) <= 2, f"{w} is entered from {len(found)} places: {sorted(found)}"


def _map_rows() -> list[list[str]]:
    """docs/design.md's module map: per row, the module paths it names ("profiler/model.py" for a
    bare "model.py" on a row that starts in profiler/; "profiler/formulas_*.py" stays a pattern)."""
    text = (ROOT / "docs" / "design.md").read_text()
    rows = []
    for line in text.split("## Module map")[1].split("\n## ")[0].splitlines():
        if not line.startswith("| `"):
            continue
        names = re.findall(r"`([^`]+)`", line.split("|")[1])
        folder = names[0].rpartition("/")[0]
        rows.append([n if "/" in n or not folder else f"{folder}/{n}" for n in names])
    return rows


def test_imports_point_down_the_module_map():
    """The rule docs/design.md states: a module imports only modules on its row or above."""
    from fnmatch import fnmatch

    rows = _map_rows()
    edges = _imports()

    def row(module: str) -> int | None:
        path = "/".join(module.split(".")[1:])
        found = [i for i, names in enumerate(rows) for n in names
                 if fnmatch(path + ".py", n) or (n.endswith("/") and (path + "/").startswith(n))]
        if found:
            return max(found) if path + ".py" not in sum(rows, []) else found[0]
        inside = [row(m) for m in edges if m.startswith(module + ".")]  # a package that only re-exports
        return max((i for i in inside if i is not None), default=None)

    unplaced = sorted(m for m in edges if m != "remat" and row(m) is None)
    assert not unplaced, f"the module map places no row for {unplaced}"
    upward = sorted(f"{m} (row {row(m)}) imports {t} (row {row(t)})" for m, targets in edges.items() if m != "remat"
                    for t in targets if not t.startswith(m + ".") and not m.startswith(t + ".") and row(t) > row(m))
    assert not upward, upward
