"""The layering checker behind tests/test_layering.py: reads every import of lmd's sources with `ast`.

The house (ARCHITECTURE.md, DESIGN.md), arrows pointing down only:

    CLI (lmd/cli.py)  ->  serve (lmd.serve, lmd.triton_models) / lite (lmd.lite)
        ->  core (the rest of lmd)  ->  engines (lmd.turbomind, lmd.pytorch_backend)  ->  lmd.kernels

Every import counts, also those inside functions (a late import runs all the same, later); only the body of
`if TYPE_CHECKING:` is exempt, since it never runs. The checker works on a {module name: source path} map
so that tests can feed it a planted tree; `source_modules` builds that map from pyproject.toml's
[tool.scikit-build.wheel.packages] table, the same table the wheel is built from, so a new package folder
is checked as soon as it is installed.
"""
from __future__ import annotations

import ast
import tomllib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = 'lmd'
ENGINES = ('lmd.turbomind', 'lmd.pytorch_backend')
SERVE = ('lmd.serve', 'lmd.triton_models')
LITE = ('lmd.lite',)
KERNELS = ('lmd.kernels',)
CLI = 'lmd.cli'
# the modules that are the CLI, the only ones that may import it
CLI_MODULES = ('lmd.cli', 'lmd.__main__')
HTTP_LIBRARIES = ('fastapi', 'uvicorn', 'starlette', 'httpx', 'gradio', 'aiohttp', 'requests', 'tritonclient')
# The one place of the core that builds engines, and what it may import there, lazily (inside the function).
ENGINE_BUILDER = ('lmd.async_engine', 'build_engine')
ENGINE_BUILDER_IMPORTS = ('lmd.turbomind.engine', 'lmd.pytorch_backend')
# folders that are not installed as modules (wheel.exclude drops csrc; the rest are not in the wheel)
SKIPPED_DIRS = frozenset({'tests', 'benchmark', 'tools', 'csrc', 'build', '__pycache__'})


@dataclass(frozen=True)
class Import:
    """One imported name as Python resolves it."""
    importer: str           # module that imports
    path: Path              # its source file
    line: int
    imported: str           # absolute module name the layering rules judge (`from P import n`: P.n if a module)
    edges: tuple[str, ...]  # source modules this import executes, for the cycle graph
    scope: str              # qualified name of the enclosing function ('' at import time: module or class body)
    type_checking: bool     # inside `if TYPE_CHECKING:`, never runs


@dataclass(frozen=True)
class Violation:
    path: Path
    line: int
    importer: str
    imported: str
    rule: str

    def format(self, base: Path | None = None) -> str:
        return f'{_relative(self.path, base)}:{self.line} {self.importer} -> {self.imported}  [{self.rule}]'


@dataclass(frozen=True)
class Cycle:
    """A strongly connected component of the module graph: its modules and the imports between them."""
    modules: tuple[str, ...]
    edges: tuple[tuple[str, str, Path, int], ...]  # (importer, imported, path, line)

    def format(self, base: Path | None = None) -> str:
        lines = [f'cycle of {len(self.modules)} modules: {", ".join(self.modules)}']
        lines += [f'    {_relative(path, base)}:{line} {a} -> {b}' for a, b, path, line in self.edges]
        return '\n'.join(lines)


def _relative(path: Path, base: Path | None) -> str:
    if base is not None:
        try:
            return str(path.relative_to(base))
        except ValueError:
            pass
    return str(path)


# ---------------------------------------------------------------- the module map


def package_folders(repo: Path) -> dict[str, Path]:
    """{import name: source folder} from pyproject.toml's [tool.scikit-build.wheel.packages]."""
    with open(repo / 'pyproject.toml', 'rb') as f:
        table = tomllib.load(f)['tool']['scikit-build']['wheel']['packages']
    return {installed.replace('/', '.'): repo / folder for installed, folder in table.items()}


def source_modules(repo: Path) -> dict[str, Path]:
    """{module name: source path} for every Python file the wheel installs (a package is its __init__.py)."""
    folders = package_folders(repo)
    modules: dict[str, Path] = {}
    for package, folder in sorted(folders.items()):
        # a folder mapped on its own (turbomind/ under lmd/) belongs to its own entry, not to its parent's
        others = {f.resolve() for p, f in folders.items() if p != package}
        _walk(folder, package, others, modules)
    return modules


def _walk(folder: Path, package: str, others: set[Path], modules: dict[str, Path]) -> None:
    if not folder.is_dir():
        return
    for entry in sorted(folder.iterdir()):
        if entry.is_dir():
            if entry.name in SKIPPED_DIRS or entry.name.startswith('.') or entry.resolve() in others:
                continue
            _walk(entry, f'{package}.{entry.name}', others, modules)
        elif entry.suffix == '.py':
            modules[package if entry.name == '__init__.py' else f'{package}.{entry.stem}'] = entry


def _packages(modules: dict[str, Path]) -> set[str]:
    """Names that are packages: an __init__.py, or a folder that holds modules (namespace packages)."""
    packages = {name for name, path in modules.items() if path.name == '__init__.py'}
    for name in modules:
        parts = name.split('.')
        packages.update('.'.join(parts[:i]) for i in range(1, len(parts)))
    return packages


# ---------------------------------------------------------------- reading imports


def read_imports(modules: dict[str, Path], extra_packages: set[str] | frozenset[str] = frozenset()) -> list[Import]:
    """Every import of every module, in file order. `extra_packages`: packages with no Python source
    (an extension-only package the package map names) so `from lmd import kernels` resolves to it."""
    packages = _packages(modules) | set(extra_packages)
    known = set(modules) | packages
    found: list[Import] = []
    for name, path in sorted(modules.items()):
        try:
            tree = ast.parse(path.read_text(encoding='utf-8'), filename=str(path))
        except SyntaxError as e:
            raise ValueError(f'{path}:{e.lineno}: cannot parse: {e.msg}') from e
        own_package = name if path.name == '__init__.py' else name.rpartition('.')[0]
        visitor = _ImportVisitor(name, path, own_package, modules, known)
        visitor.visit(tree)
        found += visitor.imports
    return found


class _ImportVisitor(ast.NodeVisitor):

    def __init__(self, importer: str, path: Path, own_package: str, modules: dict[str, Path], known: set[str]):
        self.importer, self.path, self.own_package = importer, path, own_package
        self.modules, self.known = modules, known
        self.scope: list[str] = []       # enclosing classes and functions
        self.function_depth = 0
        self.type_checking = 0
        self.imports: list[Import] = []

    # scopes: an import in a function body runs when it is called; in a class body, at import time
    def visit_FunctionDef(self, node):
        self._visit_scope(node, function=True)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):
        self._visit_scope(node, function=False)

    def _visit_scope(self, node, function: bool):
        for field, value in ast.iter_fields(node):
            if field != 'body':  # decorators, defaults, bases run in the enclosing scope
                for child in value if isinstance(value, list) else [value]:
                    if isinstance(child, ast.AST):
                        self.visit(child)
        self.scope.append(node.name)
        self.function_depth += function
        for child in node.body:
            self.visit(child)
        self.function_depth -= function
        self.scope.pop()

    def visit_If(self, node):
        self.visit(node.test)
        exempt = _is_type_checking(node.test)
        self.type_checking += exempt
        for child in node.body:
            self.visit(child)
        self.type_checking -= exempt
        for child in node.orelse:
            self.visit(child)

    def visit_Import(self, node):
        for alias in node.names:
            self._absolute_import(alias.name, node.lineno)

    def visit_ImportFrom(self, node):
        base = self._resolve(node.module, node.level, node.lineno)
        names = [a.name for a in node.names]
        # `from P import n` runs P, then P.n if that is a module. A package enclosing the importer is
        # already running, so it is a real dependence only for the names read from its __init__.
        targets = dict.fromkeys(f'{base}.{n}' if f'{base}.{n}' in self.known else base for n in names)
        for target in targets:
            self._add(target, self._edges(target), node.lineno)

    def visit_Call(self, node):
        # importlib.import_module('lmd.x') and __import__('x') with a literal name are imports too
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ''
        if (called in ('import_module', '__import__') and node.args and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str) and not node.args[0].value.startswith('.')):
            self._absolute_import(node.args[0].value, node.lineno)
        self.generic_visit(node)

    def _absolute_import(self, name: str, line: int) -> None:
        self._add(name, self._edges(name), line)

    def _resolve(self, module: str | None, level: int, line: int) -> str:
        if level == 0:
            return module or ''
        parts = self.own_package.split('.') if self.own_package else []
        if level - 1 > len(parts) - 1:
            raise ValueError(f'{self.path}:{line}: relative import beyond the top-level package in {self.importer}')
        base = '.'.join(parts[:len(parts) - (level - 1)])
        return f'{base}.{module}' if module else base

    def _encloses(self, package: str) -> bool:
        return self.importer == package or self.importer.startswith(package + '.')

    def _edges(self, name: str) -> tuple[str, ...]:
        """The source modules importing `name` executes: it (or, for an extension, the package holding it)
        and every package on the way that does not enclose the importer (those already run)."""
        parts = name.split('.')
        edges = []
        for i in range(1, len(parts) + 1):
            prefix = '.'.join(parts[:i])
            if prefix in self.modules and not self._encloses(prefix):
                edges.append(prefix)
        if name in self.modules and name not in edges and name != self.importer:
            edges.append(name)  # an enclosing package named outright (`import lmd`, `from lmd import X`)
        return tuple(edges)

    def _add(self, imported: str, edges: tuple[str, ...], line: int) -> None:
        scope = '.'.join(self.scope) if self.function_depth else ''
        edges = tuple(e for e in edges if e != self.importer)
        self.imports.append(Import(self.importer, self.path, line, imported, edges, scope, self.type_checking > 0))


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == 'TYPE_CHECKING')
            or (isinstance(test, ast.Attribute) and test.attr == 'TYPE_CHECKING'))


# ---------------------------------------------------------------- the rules


def _under(name: str, packages: tuple[str, ...] | str) -> str | None:
    """The package of `packages` that `name` is or lies in."""
    for package in (packages,) if isinstance(packages, str) else packages:
        if name == package or name.startswith(package + '.'):
            return package
    return None


def layer(module: str) -> str:
    """'cli', 'engine', 'serve', 'lite', 'kernels', 'core' for lmd's modules; 'external' for the rest."""
    if _under(module, CLI_MODULES):
        return 'cli'
    for kind, packages in (('engine', ENGINES), ('serve', SERVE), ('lite', LITE), ('kernels', KERNELS)):
        if _under(module, packages):
            return kind
    return 'core' if _under(module, ROOT) else 'external'


def rule_broken(imp: Import) -> str | None:
    """Which layering rule `imp` breaks, in words, or None."""
    src, dst = layer(imp.importer), layer(imp.imported)
    if _under(imp.imported, CLI) and imp.importer not in CLI_MODULES:
        return 'nothing imports the CLI back'
    if src == 'engine':
        other = _under(imp.imported, ENGINES)
        if other and other != _under(imp.importer, ENGINES):
            return 'an engine imports the other engine'
        if dst in ('serve', 'lite'):
            return f'an engine imports {dst}'
    elif src == 'serve':
        if dst in ('engine', 'kernels'):
            what = 'an engine package' if dst == 'engine' else 'the kernel library'
            return f'serve imports {what} (talk to AsyncEngine)'
    elif src == 'lite':
        if dst in ('engine', 'serve'):
            return f'lite imports {"an engine package" if dst == "engine" else "serve"}'
    elif src == 'kernels':
        if dst not in ('kernels', 'external'):
            return 'the kernel library imports lmd above it'
    elif src == 'core':
        if dst in ('serve', 'lite'):
            return f'the core imports {dst}'
        if dst == 'external' and imp.imported.split('.')[0] in HTTP_LIBRARIES:
            return 'the core imports an HTTP library'
        if dst == 'engine' and not ((imp.importer, imp.scope) == ENGINE_BUILDER
                                    and imp.imported in ENGINE_BUILDER_IMPORTS):
            return (f'the core imports an engine package outside {".".join(ENGINE_BUILDER)}() '
                    f'(allowed there, lazily: {", ".join(ENGINE_BUILDER_IMPORTS)})')
    return None


def layering_violations(modules: dict[str, Path], extra_packages=frozenset()) -> list[Violation]:
    """Every import of `modules` that breaks a layering rule."""
    return check_layering(read_imports(modules, extra_packages))


def check_layering(imports: list[Import]) -> list[Violation]:
    found = []
    for imp in imports:
        rule = None if imp.type_checking else rule_broken(imp)
        if rule:
            found.append(Violation(imp.path, imp.line, imp.importer, imp.imported, rule))
    return found


# ---------------------------------------------------------------- cycles


def import_cycles(modules: dict[str, Path], extra_packages=frozenset()) -> list[Cycle]:
    """Each strongly connected component of more than one module, with the imports inside it."""
    return find_cycles(modules, read_imports(modules, extra_packages))


def import_graph(modules: dict[str, Path], imports: list[Import]) -> dict[str, dict[str, list[tuple[Path, int]]]]:
    """{importer: {imported: [(path, line), ...]}} over the source modules, late imports included."""
    graph: dict[str, dict[str, list[tuple[Path, int]]]] = {name: defaultdict(list) for name in modules}
    for imp in imports:
        if not imp.type_checking:
            for edge in imp.edges:
                if (imp.path, imp.line) not in graph[imp.importer][edge]:
                    graph[imp.importer][edge].append((imp.path, imp.line))
    return graph


def find_cycles(modules: dict[str, Path], imports: list[Import]) -> list[Cycle]:
    graph = import_graph(modules, imports)
    cycles = []
    for component in _strongly_connected(graph):
        if len(component) < 2:
            continue
        members = set(component)
        edges = sorted((a, b, path, line) for a in members for b in graph[a] if b in members
                       for path, line in graph[a][b])
        cycles.append(Cycle(tuple(sorted(members)), tuple(edges)))
    return sorted(cycles, key=lambda c: c.modules)


def _strongly_connected(graph: dict[str, dict[str, list]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (no recursion limit on deep chains)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(component)
    return components
