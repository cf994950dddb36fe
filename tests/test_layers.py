"""The layers of the package: the core is pure math, the engine is free of Lightning, nothing imports upwards."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_aesgd"
LIGHTNING = ("pytorch_lightning", "lightning", "lightning_fabric", "lightning_utilities")

# What each layer may import from the package itself.
ALLOWED = {
    "core": ("lightning_aesgd.core",),
    "engine": ("lightning_aesgd.core", "lightning_aesgd.engine"),
    # Emulation wraps the engine from outside (its step stretcher is a ComputeSpans listener, its clock reads the
    # engine's timelines); the engine and the core never import it.
    "emulation": ("lightning_aesgd.core", "lightning_aesgd.engine", "lightning_aesgd.emulation"),
}


def _package_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_a_layer_imports_only_the_layers_below_it(layer):
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for name in _package_imports(path):
            root = name.split(".")[0]
            assert root not in LIGHTNING, f"{path.name} imports {name}: the {layer} must stay free of Lightning"
            if root == "lightning_aesgd":
                assert name.startswith(ALLOWED[layer]), f"{path.name} imports {name}, above the {layer}"


def test_importing_the_core_and_the_engine_loads_no_lightning_module():
    # The package's own __init__ registers the strategy (and so imports Lightning); the layers below it are
    # imported here without it, as a program using only the engine would.
    script = f"""
import importlib, pkgutil, sys, types
package = types.ModuleType("lightning_aesgd")
package.__path__ = [{str(PACKAGE)!r}]
sys.modules["lightning_aesgd"] = package
for layer in ("core", "engine"):
    module = importlib.import_module(f"lightning_aesgd.{{layer}}")
    for info in pkgutil.walk_packages(module.__path__, f"lightning_aesgd.{{layer}}."):
        importlib.import_module(info.name)
loaded = sorted(name for name in sys.modules if name.split(".")[0] in {LIGHTNING!r})
print(loaded)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]", result.stdout


def test_the_engine_and_the_core_hold_no_emulation_code():
    emulation_names = ("SlowdownProfile", "ComputeClock", "StepStretcher", "stretch(", "CpuQuota", "slowdown")
    for layer in ("core", "engine"):
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            text = path.read_text()
            found = [name for name in emulation_names if name in text]
            assert not found, f"{layer}/{path.name} mentions {found}: emulation belongs in lightning_aesgd/emulation"


def test_the_architecture_page_names_every_module_of_the_layers_it_draws():
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    drawn = [PACKAGE, *(PACKAGE / layer for layer in ("core", "engine", "emulation"))]
    missing = [
        f"{folder.name}/{path.name}"
        for folder in drawn
        for path in sorted(folder.glob("*.py"))
        if path.name != "__init__.py" and path.name not in page
    ]
    assert not missing, f"docs/architecture.md does not name {missing}"
