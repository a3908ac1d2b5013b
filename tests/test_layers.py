"""The package's walls: model math -> kv -> transport -> engine -> cli / bench / server. Nothing imports
a layer above its own (checked on the source, imports inside functions included)."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "kvferry"
# what each package may import from kvferry (besides itself, kvferry.__init__ and config)
ALLOWED = {
    "kv": set(),
    "model": {"kv"},
    "transport": {"kv"},
    "engine": {"kv", "model", "transport"},
    "bench": {"kv", "model", "transport", "engine", "args"},
    "server": {"engine", "args"},
}


def _imports(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvferry."):
            out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("kvferry.")}
    return out


def test_no_package_imports_a_layer_above_its_own():
    bad = []
    for pkg, allowed in ALLOWED.items():
        for f in (ROOT / pkg).rglob("*.py"):
            for m in _imports(f) - allowed - {pkg, "config"}:
                bad.append(f"{f.relative_to(ROOT.parent)} imports kvferry.{m}")
    assert not bad, bad


def test_the_check_sees_an_upward_import(tmp_path):
    # negative control: a model file that imports the transport is reported
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from kvferry.transport.staging import StagedQueues\n")
    assert _imports(f) - ALLOWED["model"] == {"transport"}
