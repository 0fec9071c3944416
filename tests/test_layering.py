"""The package's layering (tools/check_layering.py): lower layers never import upper ones, and
there are no import cycles. The checker itself is shown to find both on a small tree."""

import importlib.util
import os
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _checker():
    spec = importlib.util.spec_from_file_location(
        "check_layering", os.path.join(ROOT, "tools", "check_layering.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_megatron_lora_has_no_upward_import_and_no_cycle():
    assert _checker().problems(ROOT) == []


def _tree(tmp_path, files):
    for name, text in files.items():
        path = tmp_path / "megatron_lora" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_an_upward_import_inside_a_function_is_found(tmp_path):
    _tree(tmp_path, {
        "__init__.py": "", "lora/__init__.py": "", "cli/__init__.py": "",
        "cli/main.py": "from megatron_lora.lora import adapter\n",
        "lora/adapter.py": "def f():\n    from megatron_lora.cli.main import g\n",
    })
    found = _checker().problems(str(tmp_path))
    assert "megatron_lora.lora.adapter imports megatron_lora.cli.main: layer 'lora' is below " \
           "'cli'" in found, found


def test_a_cycle_within_a_package_is_found(tmp_path):
    _tree(tmp_path, {
        "__init__.py": "", "lora/__init__.py": "",
        "lora/a.py": "from megatron_lora.lora.b import x\n",
        "lora/b.py": "import megatron_lora.lora.a\n",
    })
    assert _checker().problems(str(tmp_path)) == [
        "import cycle: megatron_lora.lora.a -> megatron_lora.lora.b"]


def test_an_unknown_package_is_named(tmp_path):
    _tree(tmp_path, {"__init__.py": "", "extras/__init__.py": "",
                     "extras/x.py": "from megatron_lora import jsonfile\n", "jsonfile.py": ""})
    found = _checker().problems(str(tmp_path))
    assert len(found) == 1 and "package not in the layer list" in found[0], found
