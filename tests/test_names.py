"""Every name our code reads is bound somewhere: a slow test (run only by CI's queue) or a rarely
taken branch that calls a helper an edit removed fails here, in the fast suite, not after an hour.

pyflakes finds the reads; a name bound anywhere in its file is left to pyflakes' flow analysis,
which reads ``del x`` followed by a later use in another branch or closure as undefined."""

import ast
from pathlib import Path

from pyflakes import api as pyflakes_api, messages, reporter  # a test dependency: never skipped

from conftest import ROOT

SOURCES = ("autotune", "tests", "bench", "examples", "profiles")


class _Kept(reporter.Reporter):
    def __init__(self):
        super().__init__(None, None)
        self.messages = []

    def flake(self, message):
        self.messages.append(message)

    def syntaxError(self, filename, msg, lineno, offset, text):
        self.messages.append(f"{filename}:{lineno}: {msg}")

    def unexpectedError(self, filename, msg):
        self.messages.append(f"{filename}: {msg}")


def _bound_names(tree: ast.AST) -> set[str]:
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return bound


def _unbound_reads(path: Path) -> list[str]:
    source = path.read_text()
    kept = _Kept()
    pyflakes_api.check(source, str(path), kept)
    bound = _bound_names(ast.parse(source))
    found = []
    for message in kept.messages:
        if isinstance(message, str):
            found.append(message)
        elif isinstance(message, messages.UndefinedName) and message.message_args[0] not in bound:
            found.append(str(message))
    return found


def _python_files() -> list[Path]:
    return sorted(p for top in SOURCES for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts)


def test_every_name_read_is_bound_somewhere():
    found = [line for path in _python_files() for line in _unbound_reads(path)]
    assert not found, "\n".join(found)


def test_a_helper_lost_in_an_edit_is_found(tmp_path):
    lost = tmp_path / "test_lost.py"
    lost.write_text("import os\n\n\ndef test_slow():\n    return _env(os.environ)\n\n"
                    "def later():\n    x = 1\n    del x\n    return x\n")
    found = _unbound_reads(lost)
    assert len(found) == 1 and "_env" in found[0], found
