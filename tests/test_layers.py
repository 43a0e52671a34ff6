"""The layering holds: lower packages never import the layers above them (docs/architecture.md, "Layers")."""

from __future__ import annotations

import ast
from pathlib import Path

import meshllm

PACKAGE = Path(meshllm.__file__).parent

FORBIDDEN = {
    # the runtime and everything the node is built from sit below the HTTP layer
    "runtime": ("meshllm.api", "meshllm.cli", "meshllm.node"),
    "engine": ("meshllm.api", "meshllm.runtime", "meshllm.split", "meshllm.owner", "meshllm.cli", "meshllm.node"),
    "models": ("meshllm.api", "meshllm.runtime", "meshllm.split", "meshllm.owner", "meshllm.cli", "meshllm.node"),
    "split": ("meshllm.api", "meshllm.owner", "meshllm.cli", "meshllm.node"),
    "owner": ("meshllm.api", "meshllm.split", "meshllm.cli", "meshllm.node"),
    "discovery": ("meshllm.api", "meshllm.cli", "meshllm.node"),
    "mesh": ("meshllm.api", "meshllm.runtime", "meshllm.split", "meshllm.owner", "meshllm.engine", "meshllm.cli",
             "meshllm.node"),
    "net": ("meshllm.api", "meshllm.runtime", "meshllm.mesh", "meshllm.split", "meshllm.owner", "meshllm.cli",
            "meshllm.node"),
}


def imported(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports (at any depth: a function-local import counts too)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def test_no_package_imports_a_layer_above_it() -> None:
    wrong = []
    for package, above in FORBIDDEN.items():
        files = sorted((PACKAGE / package).rglob("*.py"))
        assert files, f"meshllm/{package} has modules"
        for path in files:
            for line, module in imported(path):
                if any(module == top or module.startswith(top + ".") for top in above):
                    wrong.append(f"{path.relative_to(PACKAGE)}:{line} imports {module}")
    assert not wrong, "\n".join(wrong)


def test_the_walk_sees_function_local_imports(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    from meshllm.api.errors import error_body\n    import meshllm.api.app\n")
    modules = [m for _, m in imported(sample)]
    assert modules == ["meshllm.api.errors", "meshllm.api.errors.error_body", "meshllm.api.app"]
