"""The layout's rules (README "Layout"): flows -> tasks -> engine, never back, and tasks/ holds only Prefect tasks."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from finetune_flows.orchestration.steps import Step

REPO = Path(__file__).resolve().parent.parent


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def test_the_engine_never_imports_the_tasks_or_the_flows():
    wrong = {str(p.relative_to(REPO)): sorted(m for m in imported_modules(p) if m.split(".")[0] in ("tasks", "flows"))
             for p in sorted((REPO / "finetune_flows").rglob("*.py"))}
    assert not {p: m for p, m in wrong.items() if m}


def test_every_module_in_tasks_declares_a_prefect_task():
    modules = [p.stem for p in sorted((REPO / "tasks").glob("*.py")) if p.stem != "__init__"]
    assert modules
    for name in modules:
        module = importlib.import_module(f"tasks.{name}")
        steps = [v for v in vars(module).values() if isinstance(v, Step) and v.fn.__module__ == module.__name__]
        assert steps, f"tasks/{name}.py declares no Prefect task"
        assert any(s.fn.__name__ == name for s in steps), f"tasks/{name}.py: no task named {name}"
