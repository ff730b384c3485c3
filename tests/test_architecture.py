"""The package boundaries ARCHITECTURE.md promises, read from the source: `sparse_formats` imports neither
of the other packages, `serving` does not import `leapctl`, and the serving contract that leapctl reads
imports no vLLM (so export and serve work where vLLM is not installed)."""

import ast
import re
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


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def leapctl_import_graph() -> dict[str, set[str]]:
    """Module -> the leapctl modules it imports (at any depth: a function-level import closes a circle as
    surely as a top-level one), each named as imported (`from leapctl.prune import wanda` names
    `leapctl.prune.wanda`)."""
    modules = {_module_name(path): path for path in (REPO / "leapctl").rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        graph[name] = {module for module in found if module in modules and module != name}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_no_import_circle_inside_leapctl():
    assert import_circles(leapctl_import_graph()) == []


def test_import_circles_are_found():
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_a_command_module_imports_no_other_command_module():
    graph = leapctl_import_graph()
    commands = {name for name in graph if name.startswith("leapctl.commands.")}
    for name in sorted(commands):
        assert not graph[name] & commands, f"{name} imports {graph[name] & commands}"
    assert not graph["leapctl.commands"], "leapctl.commands must import no command (cli.COMMANDS lists them)"



def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.mark.parametrize(("package", "other"), [("leapctl.learn", "leapctl.quantize"),
                                                ("leapctl.quantize", "leapctl.learn")])
def test_learn_and_quantize_do_not_import_each_other(package, other):
    """What both use (the distillation loss, the schedules, the 4-bit grid) lives below them in
    `leapctl.distill`, `leapctl.schedule` and `leapctl.grid`, so either changes without the other."""
    graph = leapctl_import_graph()
    for name in sorted(module for module in graph if _inside(module, package)):
        crossing = {module for module in graph[name] if _inside(module, other)}
        assert not crossing, f"{name} imports {crossing}"

def test_every_command_has_the_same_parts_and_is_listed_once():
    import dataclasses

    from leapctl import cli

    modules = sorted(p.stem for p in (REPO / "leapctl" / "commands").glob("*.py") if p.stem != "__init__")
    assert sorted(command.__name__.rsplit(".", 1)[1] for command in cli.COMMANDS) == modules
    for command in cli.COMMANDS:
        assert dataclasses.is_dataclass(command.Config), command.__name__
        assert callable(command.run) and callable(command.main) and command.NAME and command.HELP


def test_every_command_help_shows_every_option_with_its_default():
    import dataclasses
    import re

    from typer.testing import CliRunner

    from leapctl import cli
    from leapctl.settings import cli_fields

    runner = CliRunner()
    for command in cli.COMMANDS:
        done = runner.invoke(cli.app, [command.NAME, "--help"], terminal_width=400,
                             env={"COLUMNS": "400", "TERMINAL_WIDTH": "400"})
        assert done.exit_code == 0, done.output
        text = re.sub(r"\s+", " ", re.sub(r"[│╭╮╰╯─]", " ", done.output))
        assert "--config" in text, command.NAME
        for field in cli_fields(command.Config):
            if field.metadata.get("argument"):
                metavar = field.metadata.get("metavar") or field.name.upper()
                assert metavar in text, (command.NAME, field.name)
                continue
            flag = field.metadata.get("flag") or f"--{field.name.replace('_', '-')}"
            flag = flag if isinstance(flag, str) else flag[0]
            assert flag.split("/")[0] in text, (command.NAME, field.name)
            factory = field.default_factory
            default = field.default if factory is dataclasses.MISSING else factory()
            shows_default = default not in (None, False, "", [], dataclasses.MISSING)
            if shows_default and not field.metadata.get("required"):
                shown = default if not isinstance(default, bool) else field.name.replace("_", "-")
                assert f"[default: {shown}]" in text, (command.NAME, field.name, default)


# A function over this many lines is split into named steps (issue 18); serving/csrc is C++.
MAX_FUNCTION_LINES = 80


def test_no_function_over_80_lines():
    long = []
    for path in sorted(REPO.rglob("*.py")):
        relative = path.relative_to(REPO)
        if relative.parts[0].startswith(".") or "csrc" in relative.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{relative}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


# C++ (serving/csrc) under the same limit: each outermost function (a lambda counts with the function around
# it) found by matching braces once comments, literals and preprocessor lines are blanked out.
CPP_BLANKED = re.compile(r"""//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'|^[ \t]*#[^\n]*""",
                         re.S | re.M)
# A function's head ends (before `{`) with its parameters' `)`, then qualifiers or a trailing return type.
CPP_FUNCTION_HEAD = re.compile(r"\)\s*(?:(?:const|noexcept|override|final|mutable)\b\s*|->[^;{}()]*)*$")


def cpp_functions(text: str) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of each outermost function body in C++ source. A `{` opens a function where
    no function is open around it and the text since the previous `;`, `{` or `}` ends like a function's head
    (CPP_FUNCTION_HEAD); its lines run from that head's first line to the matching `}`."""
    code = CPP_BLANKED.sub(lambda match: re.sub(r"[^\n]", " ", match.group()), text)
    found, open_blocks, mark = [], [], 0
    for at, char in enumerate(code):
        if char == "{":
            head = code[mark:at]
            is_function = not any(block[0] for block in open_blocks) and bool(CPP_FUNCTION_HEAD.search(head))
            open_blocks.append((is_function, mark + len(head) - len(head.lstrip()), head))
        elif char == "}" and open_blocks:
            is_function, start, head = open_blocks.pop()
            if is_function:
                first, last = code.count("\n", 0, start) + 1, code.count("\n", 0, at) + 1
                found.append((cpp_function_name(head), first, last - first + 1))
        if char in ";{}":
            mark = at + 1
    return found


def cpp_function_name(head: str) -> str:
    """The name in a function's head: the word (or operator) before the `(` that opens its parameter list,
    the one matching the head's last `)` (a parameter such as `__m512 (&acc)[R][M]` has parentheses too)."""
    depth, opening = 1, head.rindex(")")
    while depth and opening > 0:
        opening -= 1
        depth += {")": 1, "(": -1}.get(head[opening], 0)
    name = re.search(r"(~?\w+|operator\s*\(\s*\))\s*(?:<[^<>()]*>)?\s*$", head[:opening])
    return name.group(1) if name else head.strip()


def test_cpp_function_scan_finds_functions_not_blocks():
    source = ('// f() {\nnamespace n {\nstruct S { int g(int a) const { return a; } };\n'
              'template <typename T>\nT h(T t) {\n  if (t) {\n    return "}";\n  }\n'
              '  auto k = [](int) { return 0; };\n  return t;\n}\nenum class E : int { A };\n'
              '}  // namespace n\n'
              'void f(const int (&a)[4], float (&b)[2][3]) {\n}\n'
              'struct P { int operator()(int b) const { return b; } };\n')
    assert cpp_functions(source) == [("g", 3, 1), ("h", 4, 8), ("f", 14, 2), ("operator()", 16, 1)]


def test_no_cpp_function_over_80_lines():
    csrc = REPO / "serving" / "csrc"
    long = []
    for path in sorted([*csrc.rglob("*.cpp"), *csrc.rglob("*.h")]):
        relative = path.relative_to(csrc).as_posix()
        for name, line, lines in cpp_functions(path.read_text()):
            if lines > MAX_FUNCTION_LINES:
                long.append(f"serving/csrc/{relative}:{line} {name} ({lines} lines)")
    assert not long, long


# A path that exists on one machine only (a home, a work tree, a temporary folder) breaks the code elsewhere.
ABSOLUTE_PATH = re.compile(r"""["'`](?:/(?:home|root|work|Users|tmp|mnt|opt|srv|data)/|[A-Za-z]:\\\\)""")
CODE_FOLDERS = ("leapctl", "serving", "sparse_formats", "bench", "tests")
CODE_SUFFIXES = (".py", ".cpp", ".h", ".sh", ".toml", ".cfg", ".ini")


def test_no_absolute_path_in_the_code():
    files = [REPO / "Makefile", REPO / "pyproject.toml"]
    for folder in CODE_FOLDERS:
        files += sorted(p for p in (REPO / folder).rglob("*") if p.suffix in CODE_SUFFIXES and p.is_file())
    found = [f"{path.relative_to(REPO)}:{number}: {line.strip()[:100]}"
             for path in files
             for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
             if ABSOLUTE_PATH.search(line)]
    assert not found, found
