"""Every ``python -m experiments...`` command that the README, the docs, the
results files and the experiments' docstrings give names a script that
exists, and its flags parse.

The commands are read from the Markdown files and from the module
docstrings of ``experiments/`` (configs included). Each command's module
must be a script of ``experiments/`` (a ``__main__`` block); a command
written as a file (``python experiments/x.py``) is an error, since the
scripts run as modules. The flags of every command without placeholders
(``...``, ``[...]``, ``<...>``, ``$VAR``, upper-case names such as ``DIR``)
are parsed by the script's own parser in a child process, one per script,
that stops right after parsing: argparse's for the scripts, absl's flags and
the config flag (file loaded, overrides applied) for the absl scripts
(the main job, the sweep). A command without arguments is a mention of the
script; it is only checked to exist. Nothing
is trained or measured.
"""

import ast
import collections
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

_COMMAND = re.compile(r"\bpython3? -m (experiments(?:\.\w+)+)([^`\n]*)")
_FILE_COMMAND = re.compile(r"\bpython3? (experiments/\S+\.py)")
# Markers of a command written with placeholders: it cannot be parsed.
_PLACEHOLDER = re.compile(r"\.\.\.|…|[\[\]<>{}$]|(?:^|[\s=/])[A-Z][A-Z_0-9]*"
                          r"(?=$|[\s/,:.])")


def _documents():
  """``(path, text)`` of the README, docs, results and docstrings."""
  yield REPO / "README.md", (REPO / "README.md").read_text()
  for path in sorted((REPO / "docs").glob("*.md")):
    yield path, path.read_text()
  for path in sorted((REPO / "experiments" / "results").rglob("*.md")):
    yield path, path.read_text()
  for path in sorted((REPO / "experiments").rglob("*.py")):
    doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
    if doc:
      yield path, doc


def _joined(text: str, markdown: bool) -> str:
  """Shell continuation lines joined (``\\`` or, in a non-raw docstring,
  the ``\\\\`` that reads as one); in Markdown, inline code spans that a
  paragraph wraps (outside fenced blocks) put on one line."""
  if markdown:
    parts = text.split("```")
    for i in range(0, len(parts), 2):
      parts[i] = re.sub(
          r"`[^`]+`", lambda m: m.group(0) if "\n\n" in m.group(0)
          else m.group(0).replace("\n", " "), parts[i])
    text = "```".join(parts)
  return re.sub(r"\\\\?\n\s*", " ", text)


def _commands():
  """``[(where, module, argument text)]`` of every command."""
  out = []
  for path, text in _documents():
    for m in _COMMAND.finditer(_joined(text, path.suffix == ".md")):
      args = re.split(r"\s(?:\||&&|;|#|2?>)", m.group(2))[0].strip()
      args = args.rstrip(").,:'\"")
      out.append((str(path.relative_to(REPO)), m.group(1), args))
  return out


COMMANDS = _commands()


def _scripts():
  return {".".join(p.relative_to(REPO).with_suffix("").parts)
          for p in (REPO / "experiments").rglob("*.py")
          if 'if __name__ == "__main__":' in p.read_text()}


def test_commands_are_found():
  modules = {module for _, module, _ in COMMANDS}
  assert {"experiments.main", "experiments.compare.losses",
          "experiments.bench.losses", "experiments.sweep",
          "experiments.figures.circle_loss"} <= modules
  assert len(COMMANDS) > 100


def test_every_command_names_a_script():
  scripts = _scripts()
  bad = [f"{where}: python -m {module}" for where, module, _ in COMMANDS
         if module not in scripts]
  assert not bad, "\n".join(bad)


def test_no_command_runs_a_script_as_a_file():
  bad = [f"{path.relative_to(REPO)}: {m.group(0)}"
         for path, text in _documents()
         for m in _FILE_COMMAND.finditer(text)]
  assert not bad, "\n".join(bad)


def _parseable():
  """``{module: [(where, argv)]}`` of the commands without placeholders."""
  out = collections.defaultdict(list)
  scripts = _scripts()
  for where, module, args in COMMANDS:
    if not args or _PLACEHOLDER.search(args):  # a mention, or a template
      continue
    if module not in scripts:  # test_every_command_names_a_script
      continue
    try:
      argv = shlex.split(args)
    except ValueError:
      continue
    if argv not in [a for _, a in out[module]]:
      out[module].append((where, argv))
  return dict(out)


PARSEABLE = _parseable()

# The child: imports what the script imports, then runs the script as
# ``__main__`` for each command in a forked copy of itself (fresh flag state,
# the imports already done), its parser patched to stop right after parsing;
# prints one JSON line per command: [where, argv, error or null].
_CHILD = r"""
import argparse, ast, importlib, json, os, runpy, sys
os.environ["CIRCLE_JAX_NO_HUGEPAGES"] = "1"
commands = json.load(sys.stdin)
for module in commands:
  tree = ast.parse(open(module.replace(".", "/") + ".py").read())
  for node in tree.body:
    if isinstance(node, ast.Import):
      for alias in node.names:
        importlib.import_module(alias.name)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      importlib.import_module(node.module)
for path in sorted(os.listdir("experiments/configs")):  # what configs import
  if path.endswith(".py") and path != "__init__.py":
    importlib.import_module("experiments.configs." + path[:-3])


class Parsed(BaseException):
  pass


def absl_run(main, argv=None, flags_parser=None):
  from absl import flags
  argv = sys.argv if argv is None else argv
  (flags_parser or flags.FLAGS)(argv)
  if "config" in flags.FLAGS:
    flags.FLAGS["config"].value  # the config file, loaded and overridden
  raise Parsed()


known = argparse.ArgumentParser.parse_known_args
depth = []


def parse_args(self, args=None, namespace=None):
  depth.append(1)
  try:
    ns, rest = known(self, args, namespace)
  finally:
    depth.pop()
  if rest:
    self.error("unrecognized arguments: " + " ".join(rest))
  raise Parsed()


def parse_known_args(self, args=None, namespace=None):
  out = known(self, args, namespace)
  if not depth:  # the script parses config overrides itself
    bad = [a for a in out[1] if not a.startswith("--config.")]
    if bad:
      self.error("unrecognized arguments: " + " ".join(bad))
    raise Parsed()
  return out


def parse(module, argv):
  from absl import app
  app.run = absl_run
  argparse.ArgumentParser.parse_args = parse_args
  argparse.ArgumentParser.parse_known_args = parse_known_args
  sys.argv = [module] + argv
  runpy.run_module(module, run_name="__main__", alter_sys=True)
  raise RuntimeError("the script ended without parsing its flags")


def forked(module, argv):
  read, write = os.pipe()
  pid = os.fork()
  if pid == 0:
    os.close(read)
    try:
      parse(module, argv)
      error = None
    except Parsed:
      error = None
    except SystemExit as e:  # --help exits 0
      error = None if e.code in (0, None) else f"exit {e.code}"
    except BaseException as e:  # noqa: BLE001
      error = f"{type(e).__name__}: {e}"
    os.write(write, json.dumps(error).encode())
    os._exit(0)
  os.close(write)
  data = b"".join(iter(lambda: os.read(read, 1 << 16), b""))
  os.close(read)
  os.waitpid(pid, 0)
  return json.loads(data) if data else "the parsing process died"


for module, runs in commands.items():
  for where, argv in runs:
    print(json.dumps([module, where, argv, forked(module, argv)]), flush=True)
"""


@pytest.fixture(scope="module")
def parsed():
  """``{module: [(where, argv, error)]}``: every parseable command, parsed
  in one child process."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", _CHILD],
                        input=json.dumps(PARSEABLE), cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=900,
                        check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = collections.defaultdict(list)
  for line in proc.stdout.splitlines():
    if line.startswith("["):
      module, where, argv, error = json.loads(line)
      out[module].append((where, argv, error))
  return out, proc.stderr


# Slow tier (CI): parses every documented command's flags.
@pytest.mark.slow
@pytest.mark.parametrize("module", sorted(PARSEABLE))
def test_command_flags_parse(module, parsed):
  results, stderr = parsed
  assert len(results[module]) == len(PARSEABLE[module]), stderr[-3000:]
  bad = [f"{where}: python -m {module} {shlex.join(argv)}\n  -> {error}"
         for where, argv, error in results[module] if error]
  assert not bad, "\n".join(bad) + "\n" + stderr[-3000:]
