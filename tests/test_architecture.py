"""The package boundaries ARCHITECTURE.md promises, read from the source: `sparse_formats` imports neither
of the other packages, `serving` does not import `leapctl`, and the serving contract that leapctl reads
imports no vLLM (so export and serve work where vLLM is not installed)."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def top_level(modules: set[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


@pytest.mark.parametrize(("package", "forbidden"), [("sparse_formats", {"leapctl", "serving", "vllm"}),
                                                    ("serving", {"leapctl"})])
def test_one_way_dependencies(package, forbidden):
    for path in sorted((REPO / package).rglob("*.py")):
        crossing = top_level(imported_modules(path)) & forbidden
        assert not crossing, f"{path.relative_to(REPO)} imports {crossing}"


def test_the_serving_contract_needs_no_vllm():
    assert "vllm" not in top_level(imported_modules(REPO / "serving" / "contract.py"))


def test_masks_and_runs_import_no_circle():
    """runs.py owns run folders and uses the mask file module, never the other way round."""
    assert not any(m.startswith("leapctl.runs") for m in imported_modules(REPO / "leapctl" / "masks.py"))
