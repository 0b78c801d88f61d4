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


def test_the_whole_engine_imports_without_prefect():
    """Prefect is the tasks' and flows' business: every engine module imports without it (its workers must not pay
    for Prefect's import; the modules that publish artifacts import Prefect inside those functions)."""
    import subprocess
    import sys

    code = ("import importlib, pkgutil, sys, finetune_flows\n"
            "for m in pkgutil.walk_packages(finetune_flows.__path__, 'finetune_flows.'):\n"
            "    importlib.import_module(m.name)\n"
            "    assert 'prefect' not in sys.modules, m.name + ' imported prefect'\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
