"""``remat plan --code FILE``: a generated module as a Python file that runs on its own.

The file holds the imports fx's code needs, the generated ``forward``, the plan's input contract,
the paths of what the forward reads from the model (submodules, parameters, buffers), what it reads
that the model does not have (torch.export's pytree specs and guard module, small constants), and
``load(model)``: a module sharing ``model``'s parameters and buffers whose forward is the generated
one (``remat.runtime.attach_forward``).  Nothing of the model's weights is written.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import fx

__all__ = ["module_source", "write_module"]

_MAX_CONSTANT = 4096  # elements of a tensor the model lacks that the file may spell out


def _targets(gm: fx.GraphModule) -> list[str]:
    return list(dict.fromkeys(str(n.target) for n in gm.graph.nodes if n.op in ("get_attr", "call_module")))


def _resolve(root: Any, path: str) -> Any:
    for name in path.split("."):
        root = getattr(root, name, None)
        if root is None:
            return None
    return root


def _tensor_source(t: torch.Tensor) -> str:
    values = t.detach().cpu().reshape(-1).tolist()
    return f"torch.tensor({values!r}, dtype={t.dtype}).reshape({tuple(t.shape)!r})"


def _extra_source(path: str, value: Any) -> str:
    """Python source that rebuilds ``value`` (something the generated module has and the model not)."""
    from torch.export._unlift import GuardsFn

    if isinstance(value, GuardsFn):
        # torch.export's shape guards are generated code kept in no file: the written module
        # calls a no-op instead, and the plan's own input check (check_inputs) still runs
        return "torch.export._unlift.GuardsFn()"
    if isinstance(value, torch.Tensor) and value.numel() <= _MAX_CONSTANT and value.device.type in ("cpu", "meta"):
        return _tensor_source(value)
    raise ValueError(f"cannot write a standalone module: its forward reads {path!r} (a {type(value).__name__}) "
                     "that the model does not have; save the module with torch.save(gm) instead")


def _spec_imports(serialized: str) -> set[str]:
    """Modules whose import registers the pytree node types a serialized spec names (Hugging Face
    output classes register themselves when their module is imported)."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            kind = node.get("type")
            if isinstance(kind, str) and "." in kind and not kind.startswith(("builtins.", "collections.")):
                found.add(kind.rsplit(".", 1)[0])
            for child in node.get("children_spec", []):
                walk(child)
        elif isinstance(node, list):
            for child in node:
                walk(child)

    walk(json.loads(serialized))
    return found


def module_source(gm: fx.GraphModule, model: torch.nn.Module, *, title: str = "", stem: str = "planned") -> str:
    """The text of a runnable module for ``gm``, a module generated for ``model``."""
    from torch.fx.graph_module import _format_import_block
    from torch.package import sys_importer
    from torch.utils._pytree import treespec_dumps

    python = gm._graph.python_code(root_module="self")
    imports = {"import torch", "import torch.export._unlift", "import torch.utils._pytree", "import remat.runtime",
               "from remat.runtime import InputContract"}
    shared, extras = [], {}
    for path in _targets(gm):
        value = _resolve(gm, path)
        if _resolve(model, path) is value:
            shared.append(path)
        else:
            extras[path] = _extra_source(path, value)
    for name in ("_in_spec", "_out_spec"):
        spec = getattr(gm, name, None)
        if spec is not None:
            text = treespec_dumps(spec)
            imports.update(f"import {m}" for m in _spec_imports(text))
            extras[name] = f"torch.utils._pytree.treespec_loads({text!r})"
    contract = getattr(gm, "remat_contract", None)
    plan = getattr(gm, "remat_plan", None)
    summary = "" if plan is None else plan.describe().split("\n", 1)[0]
    planned = "" if contract is None else contract.describe()
    lines = [
        f'"""{title or "A checkpointed forward"}, written by remat plan --code.',
        "",
        "Use it with the model it was planned for (the same architecture; its weights may differ):",
        "",
        f"    import {stem}",
        f"    ckpt = {stem}.load(model)  # shares model's parameters and buffers: nothing is copied",
        "    out = ckpt(*inputs)  # the same outputs as model(*inputs), computed under the plan",
        "    loss(out).backward()  # the same gradients, in model's parameters",
        "",
        f"Plan: {summary}." if summary else "",
        f"Planned inputs: {planned} (smaller batches and sequences run exactly; larger ones warn)." if planned else "",
        '"""',
        *sorted(imports),
        _format_import_block(python.globals, sys_importer),
        "",
        f"CONTRACT = {contract!r}" if contract is not None else "CONTRACT = None",
        "# what forward reads from the model (shared with it by load)",
        f"TARGETS = {tuple(shared)!r}",
        "",
        python.src.strip(),
        "",
        "",
        "def _extras() -> dict:",
        '    """What forward reads that the model does not have: pytree specs, constants, and in place of',
        "    torch.export's shape guards (generated code no file holds) a no-op: the plan's own input check",
        '    (remat.runtime.check_inputs) still runs."""',
        "    return {",
        *(f"        {k!r}: {v}," for k, v in extras.items()),
        "    }",
        "",
        "",
        "def load(model: torch.nn.Module) -> torch.nn.Module:",
        '    """A module whose forward is the planned one, sharing ``model``\'s submodules, parameters and',
        "    buffers (so training it trains ``model``); ``model`` must have the architecture this file was",
        '    planned for."""',
        "    attributes = {\"remat_contract\": CONTRACT, **_extras()}",
        "    return remat.runtime.attach_forward(model, forward, TARGETS, attributes)",
        "",
    ]
    return "\n".join(line for line in lines if line is not None)


def write_module(gm: fx.GraphModule, path: str | Path, model: torch.nn.Module, *, spec: str = "",
                 batch: int | None = None) -> None:
    """Write ``module_source(gm)`` to ``path``."""
    path = Path(path)
    title = f"Checkpointed forward of {spec}" + (f" at batch {batch}" if batch is not None else "") if spec else ""
    path.write_text(module_source(gm, model, title=title, stem=path.stem))
