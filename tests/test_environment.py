"""The environment is read in one module (tokenswift_trt/environment.py): kernel and fusion choices are
settings (kernels/config.py), and C++ reads nothing from the environment."""

from __future__ import annotations

import re
from pathlib import Path

from tokenswift_trt import environment

PACKAGE = Path(__file__).resolve().parents[1] / "tokenswift_trt"
SETTINGS_MODULE = PACKAGE / "environment.py"
READS = re.compile(r"\bgetenv\b|os\.environ|\benviron\[|secure_getenv")
SOURCES = (".py", ".cpp", ".cu", ".cuh", ".h", ".hpp", ".c")


def test_only_the_settings_module_reads_the_environment():
    readers = [
        f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*"))
        if path.suffix in SOURCES and path != SETTINGS_MODULE and "__pycache__" not in path.parts
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if READS.search(line)
    ]
    assert not readers, "read the environment through tokenswift_trt/environment.py: " + "; ".join(readers)


def test_the_settings_module_lists_every_variable_it_reads(monkeypatch, tmp_path):
    source = SETTINGS_MODULE.read_text()
    for name in environment.VARIABLES:
        assert f"`{name}`" in environment.__doc__, name
    assert set(re.findall(r'^[A-Z_]+ = "([A-Z_]+)"$', source, re.MULTILINE)) == set(environment.VARIABLES)
    monkeypatch.setenv(environment.HOME, str(tmp_path))
    monkeypatch.delenv(environment.TRT_PLUGINS, raising=False)
    assert environment.checkpoint_home() == tmp_path and environment.plugin_library() is None
    assert environment.child_environment()[environment.HOME] == str(tmp_path)
