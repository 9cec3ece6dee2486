"""`lmqtt bench compare --lmqtt-src DIR` runs lmqtt from DIR, not from the installed package: for
the `lmqtt` namespace layout (through a directory of symlinks) and for an older tree with
top-level packages. An A/B comparison that silently ran the installed code twice would report
"no difference" whatever the change."""
import os
import subprocess
import sys

from lmqtt.loadtest.brokers import source_path


def _tree(root, namespaced):
    (root / "gateway").mkdir(parents=True)
    (root / "store").mkdir()
    (root / "gateway" / "__init__.py").write_text("")
    (root / "gateway" / "serve.py").write_text("")
    (root / "gateway" / "cli.py").write_text("print('cli from the tree:', __name__)\n")
    (root / "store" / "__init__.py").write_text("WHERE = 'tree'\n")
    if namespaced:
        (root / "pyproject.toml").write_text('[tool.setuptools.package-dir]\n"lmqtt.gateway" = "gateway"\n')


def _run(path, module, cwd):
    return subprocess.run([sys.executable, "-m", module], capture_output=True, text=True, cwd=cwd,
                          env=dict(os.environ, PYTHONPATH=path), timeout=30).stdout


def test_a_namespaced_tree_is_imported_from_the_tree(tmp_path):
    _tree(tmp_path / "src", namespaced=True)
    path, module = source_path(str(tmp_path / "src"), tmp_path / "work")
    assert module == "lmqtt.gateway.cli"
    assert _run(path, module, tmp_path) == "cli from the tree: __main__\n"
    out = subprocess.run([sys.executable, "-c", "import lmqtt.store as s; print(s.WHERE)"], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=path), timeout=30).stdout
    assert out == "tree\n"


def test_an_older_tree_with_top_level_packages_runs_as_gateway_cli(tmp_path):
    _tree(tmp_path / "old", namespaced=False)
    path, module = source_path(str(tmp_path / "old"), tmp_path / "work")
    assert module == "gateway.cli"
    assert _run(path, module, tmp_path) == "cli from the tree: __main__\n"


def test_a_tree_in_the_layout_by_role_is_imported_from_the_tree(tmp_path):
    """Since the layout by role `lmqtt serve` is gateway/app/serve_command.py (no gateway/serve.py),
    and the examples are a package of their own (examples/ -> lmqtt.examples)."""
    root = tmp_path / "src"
    (root / "gateway" / "app").mkdir(parents=True)
    (root / "examples").mkdir()
    (root / "gateway" / "__init__.py").write_text("")
    (root / "gateway" / "app" / "serve_command.py").write_text("")
    (root / "gateway" / "cli.py").write_text("print('cli from the tree:', __name__)\n")
    (root / "examples" / "__init__.py").write_text("WHERE = 'tree examples'\n")
    (root / "pyproject.toml").write_text('[tool.setuptools.package-dir]\n"lmqtt.gateway" = "gateway"\n')
    path, module = source_path(str(root), tmp_path / "work")
    assert module == "lmqtt.gateway.cli"
    assert _run(path, module, tmp_path) == "cli from the tree: __main__\n"
    out = subprocess.run([sys.executable, "-c", "import lmqtt.examples as e; print(e.WHERE)"], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=path), timeout=30).stdout
    assert out == "tree examples\n"
