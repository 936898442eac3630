"""The house checked: which part of lmd may import which (tests/layering.py reads every import with `ast`).

CLI -> serve / lite -> core -> engines -> kernel library, arrows pointing down only, and no import circles,
late imports inside functions included (`if TYPE_CHECKING:` aside). The first tests check the real tree;
the rest plant imports in a small fake tree laid out as pyproject.toml's package map says, so that each rule
is seen to fire (a checker that cannot fail checks nothing).
"""
import ast
import textwrap
from pathlib import Path

import pytest

from layering import (ENGINE_BUILDER, check_layering, find_cycles, import_cycles, layering_violations,
                      package_folders, read_imports, source_modules)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope='module')
def tree():
    modules = source_modules(REPO)
    return modules, read_imports(modules, set(package_folders(REPO)))


def test_every_import_respects_the_layers(tree):
    _, imports = tree
    violations = check_layering(imports)
    assert not violations, (f'{len(violations)} imports break the layering (ARCHITECTURE.md: CLI -> serve / lite -> '
                            f'core -> engines -> lmd.kernels):\n' + '\n'.join(v.format(REPO) for v in violations))


def test_no_import_cycles(tree):
    modules, imports = tree
    cycles = find_cycles(modules, imports)
    assert not cycles, (f'{len(cycles)} import cycles (late imports inside functions count):\n'
                        + '\n'.join(c.format(REPO) for c in cycles))


def test_the_package_map_is_read_and_the_engine_builder_exists(tree):
    modules, _ = tree
    for package in ('lmd', 'lmd.turbomind', 'lmd.pytorch_backend', 'lmd.serve', 'lmd.lite', 'lmd.triton_models'):
        assert package in modules, f'{package} missing from the modules read from pyproject.toml'
    assert not any(name.startswith(('lmd.tests', 'lmd.benchmark', 'lmd.tools')) for name in modules)
    # the one exemption names a function: if it moves, the exemption must follow it, not silently lapse
    module, function = ENGINE_BUILDER
    assert module in modules, f'{module} (home of the engine builder, tests/layering.py ENGINE_BUILDER) is gone'
    top_level = {n.name for n in ast.parse(modules[module].read_text()).body if isinstance(n, ast.FunctionDef)}
    assert function in top_level, f'{module} has no top-level {function}(): update ENGINE_BUILDER in tests/layering.py'


# ---------------------------------------------------------------- the test of the test

PYPROJECT = '''
[tool.scikit-build.wheel.packages]
"lmd" = "lmd"
"lmd/turbomind" = "turbomind"
"lmd/pytorch_backend" = "pytorch_backend"
"lmd/lite" = "lite"
"lmd/serve" = "serve"
"lmd/triton_models" = "triton_models"
"lmd/kernels" = "kernels"
'''

# A small tree that keeps every rule: the checker must find nothing in it.
CLEAN_TREE = {
    'lmd/__init__.py': 'from .messages import Config\n',
    'lmd/__main__.py': 'from .cli import main\n',
    'lmd/messages.py': '''
        import dataclasses
        import typing
        if typing.TYPE_CHECKING:
            from .async_engine import Session
            from lmd.serve.api_server import Server
    ''',
    'lmd/weights.py': 'import numpy\nfrom lmd.kernels import ops\n\ndef load(): pass\n',
    'lmd/async_engine.py': '''
        from .messages import Config

        def build_engine(backend):
            if backend == 'turbomind':
                from .turbomind.engine import TurbomindEngine
                return TurbomindEngine()
            from .pytorch_backend import PytorchEngine
            return PytorchEngine()
    ''',
    'lmd/cli.py': '''
        import lmd.serve.api_server
        from lmd.lite import awq
        from lmd.pytorch_backend import PytorchEngine

        def main():
            from .turbomind.engine import TurbomindEngine
    ''',
    'turbomind/__init__.py': '',
    'turbomind/engine.py': 'from lmd.messages import Config\nfrom lmd.kernels import ops\nfrom . import model\n',
    'turbomind/model.py': 'from ..weights import load\nfrom . import _turbomind\n',
    'pytorch_backend/__init__.py': 'from .engine import PytorchEngine\n',
    'pytorch_backend/engine.py': '''
        from lmd.messages import Config
        from ..kernels.ops import gemm
        from . import scheduler

        class PytorchEngine:
            pass
    ''',
    'pytorch_backend/scheduler.py': 'from .kernels import attention\n',
    'pytorch_backend/kernels/__init__.py': '',
    'pytorch_backend/kernels/attention.py': 'import torch\n',
    'kernels/__init__.py': 'from . import ops\n',
    'kernels/ops.py': 'import math\n\ndef gemm(): pass\n',
    'serve/__init__.py': '',
    'serve/api_server.py': '''
        import fastapi
        from typing import TYPE_CHECKING
        from lmd.async_engine import build_engine
        from .openai_protocol import Request
        if TYPE_CHECKING:
            from lmd.turbomind.engine import TurbomindEngine

        def main():
            from lmd import Config
    ''',
    'serve/openai_protocol.py': 'import pydantic\n',
    'lite/__init__.py': '',
    'lite/awq.py': 'from lmd.weights import load\nfrom lmd.kernels.ops import gemm\n',
    'triton_models/__init__.py': '',
    'triton_models/engine/1/model.py': 'from lmd.async_engine import build_engine\n',
}


def write_tree(root: Path, files: dict[str, str]) -> dict[str, Path]:
    (root / 'pyproject.toml').write_text(PYPROJECT)
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source).lstrip('\n'))
    (root / 'tests').mkdir(exist_ok=True)
    (root / 'tests' / 'test_x.py').write_text('import lmd.cli\n')  # tests are not part of the package
    return source_modules(root)


def violations_of(tmp_path, planted: dict[str, str]) -> set[tuple[str, int, str, str]]:
    modules = write_tree(tmp_path, {**CLEAN_TREE, **planted})
    return {(v.importer, v.line, v.imported, v.rule) for v in layering_violations(modules)}


def test_the_clean_tree_passes(tmp_path):
    modules = write_tree(tmp_path, CLEAN_TREE)
    assert 'lmd.kernels.ops' in modules and 'lmd.triton_models.engine.1.model' in modules
    assert 'lmd.pytorch_backend.kernels.attention' in modules  # an engine's own kernels/ is the engine's
    assert not any(name.startswith('lmd.tests') for name in modules)
    assert layering_violations(modules) == []
    assert import_cycles(modules) == []


PLANTED = {
    'engine imports the other engine (relative)': (
        {'turbomind/converter.py': 'from ..pytorch_backend.engine import PytorchEngine\n'},
        [('lmd.turbomind.converter', 1, 'lmd.pytorch_backend.engine', 'an engine imports the other engine')]),
    'engine imports the other engine (extension, late)': (
        {'pytorch_backend/native.py': 'def ops():\n    import lmd.turbomind._turbomind\n'},
        [('lmd.pytorch_backend.native', 2, 'lmd.turbomind._turbomind', 'an engine imports the other engine')]),
    'engine imports serve': (
        {'pytorch_backend/serving.py': 'def f():\n    from lmd.serve import api_server\n'},
        [('lmd.pytorch_backend.serving', 2, 'lmd.serve.api_server', 'an engine imports serve')]),
    'engine imports lite': (
        {'turbomind/quant.py': 'from lmd.lite.awq import load\n'},
        [('lmd.turbomind.quant', 1, 'lmd.lite.awq', 'an engine imports lite')]),
    'serve imports an engine': (
        {'serve/health.py': 'x = 1\nfrom lmd.turbomind.engine import TurbomindEngine\n'},
        [('lmd.serve.health', 2, 'lmd.turbomind.engine', 'serve imports an engine package (talk to AsyncEngine)')]),
    'triton_models imports an engine': (
        {'triton_models/lmd_model/1/model.py': 'import lmd.pytorch_backend\n'},
        [('lmd.triton_models.lmd_model.1.model', 1, 'lmd.pytorch_backend',
          'serve imports an engine package (talk to AsyncEngine)')]),
    'serve imports the kernel library': (
        {'serve/fast.py': 'from lmd import kernels\n'},
        [('lmd.serve.fast', 1, 'lmd.kernels', 'serve imports the kernel library (talk to AsyncEngine)')]),
    'core imports serve': (
        {'lmd/chat.py': 'from .serve.openai_protocol import Request\n'},
        [('lmd.chat', 1, 'lmd.serve.openai_protocol', 'the core imports serve')]),
    'core imports lite, late': (
        {'lmd/convert.py': 'def convert():\n    from lmd.lite import awq\n'},
        [('lmd.convert', 2, 'lmd.lite.awq', 'the core imports lite')]),
    'core imports serve through importlib': (
        {'lmd/api.py': 'import importlib\nm = importlib.import_module("lmd.serve.api_server")\n'},
        [('lmd.api', 2, 'lmd.serve.api_server', 'the core imports serve')]),
    'core imports an HTTP library': (
        {'lmd/hub.py': 'import fastapi.responses\ndef get():\n    from httpx import AsyncClient\n'},
        [('lmd.hub', 1, 'fastapi.responses', 'the core imports an HTTP library'),
         ('lmd.hub', 3, 'httpx', 'the core imports an HTTP library')]),
    'core imports an engine outside build_engine': (
        {'lmd/model_path.py': 'def resolve():\n    from lmd.turbomind.converter import convert\n'},
        [('lmd.model_path', 2, 'lmd.turbomind.converter', 'the core imports an engine package outside')]),
    'build_engine imports more than the two engine classes': (
        {'lmd/async_engine.py': '''
            from .pytorch_backend.engine import PytorchEngine

            def build_engine(backend):
                from .turbomind.model import Model
                from .pytorch_backend import PytorchEngine
        '''},
        [('lmd.async_engine', 1, 'lmd.pytorch_backend.engine', 'the core imports an engine package outside'),
         ('lmd.async_engine', 4, 'lmd.turbomind.model', 'the core imports an engine package outside')]),
    'anything imports the CLI': (
        {'serve/runner.py': 'def main():\n    from lmd.cli import main\n', 'lmd/pipeline.py': 'from . import cli\n'},
        [('lmd.serve.runner', 2, 'lmd.cli', 'nothing imports the CLI back'),
         ('lmd.pipeline', 1, 'lmd.cli', 'nothing imports the CLI back')]),
    'the kernel library imports the core or an engine': (
        {'kernels/bad.py': 'from lmd.messages import Config\nfrom ..turbomind import engine\nimport lmd\n'},
        [('lmd.kernels.bad', 1, 'lmd.messages', 'the kernel library imports lmd above it'),
         ('lmd.kernels.bad', 2, 'lmd.turbomind.engine', 'the kernel library imports lmd above it'),
         ('lmd.kernels.bad', 3, 'lmd', 'the kernel library imports lmd above it')]),
    'lite imports an engine or serve': (
        {'lite/calibrate.py': 'from lmd.pytorch_backend.engine import PytorchEngine\n'
                              'def f():\n    import lmd.serve.api_server as s\n'},
        [('lmd.lite.calibrate', 1, 'lmd.pytorch_backend.engine', 'lite imports an engine package'),
         ('lmd.lite.calibrate', 3, 'lmd.serve.api_server', 'lite imports serve')]),
    'TYPE_CHECKING imports are exempt, their else branch is not': (
        {'serve/routes.py': '''
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from lmd.turbomind.engine import TurbomindEngine
                from lmd.cli import main
            else:
                from lmd.cli import main
        '''},
        [('lmd.serve.routes', 6, 'lmd.cli', 'nothing imports the CLI back')]),
}


@pytest.mark.parametrize('case', PLANTED)
def test_a_planted_import_breaks_a_rule(tmp_path, case):
    planted, expected = PLANTED[case]
    found = violations_of(tmp_path, planted)
    assert len(found) == len(expected), found
    for importer, line, imported, rule in expected:
        assert any(f[:3] == (importer, line, imported) and f[3].startswith(rule) for f in found), (expected, found)


def cycles_of(tmp_path, planted: dict[str, str]) -> list[tuple[tuple[str, ...], set[tuple[str, str, int]]]]:
    modules = write_tree(tmp_path, {**CLEAN_TREE, **planted})
    return [(c.modules, {(a, b, line) for a, b, _, line in c.edges}) for c in import_cycles(modules)]


def test_a_late_import_closes_a_cycle(tmp_path):
    cycles = cycles_of(tmp_path, {'lmd/a.py': 'from .b import f\n', 'lmd/b.py': 'def f():\n    from .a import g\n'})
    assert cycles == [(('lmd.a', 'lmd.b'), {('lmd.a', 'lmd.b', 1), ('lmd.b', 'lmd.a', 2)})]


def test_a_type_checking_import_closes_no_cycle(tmp_path):
    planted = {'lmd/a.py': 'from .b import f\n',
               'lmd/b.py': 'import typing\nif typing.TYPE_CHECKING:\n    from lmd import a\n'}
    assert cycles_of(tmp_path, planted) == []


def test_a_submodule_that_imports_its_package_back_closes_a_cycle(tmp_path):
    # pytorch_backend/__init__ imports .engine, which imports .scheduler: normal, until the scheduler reads
    # a name from the package's __init__
    cycles = cycles_of(tmp_path, {'pytorch_backend/scheduler.py': 'from lmd.pytorch_backend import PytorchEngine\n'})
    assert [c[0] for c in cycles] == [('lmd.pytorch_backend', 'lmd.pytorch_backend.engine',
                                       'lmd.pytorch_backend.scheduler')]
    assert ('lmd.pytorch_backend.scheduler', 'lmd.pytorch_backend', 1) in cycles[0][1]


def test_reading_from_lmd_itself_is_an_edge_to_its_init(tmp_path):
    cycles = cycles_of(tmp_path, {'lmd/messages.py': 'def f():\n    from lmd import Config\n'})
    assert cycles == [(('lmd', 'lmd.messages'), {('lmd', 'lmd.messages', 1), ('lmd.messages', 'lmd', 2)})]


def test_importing_a_package_runs_its_init(tmp_path):
    # lmd.serve's __init__ reads the core's async_engine, which (late) imports a serve module: a cycle
    # through the package's __init__ although no module names lmd.serve outright
    planted = {'serve/__init__.py': 'from lmd.async_engine import build_engine\n',
               'lmd/async_engine.py': 'def build_engine():\n    from lmd.serve.api_server import x\n'}
    cycles = cycles_of(tmp_path, planted)
    assert cycles and ('lmd.async_engine', 'lmd.serve', 2) in cycles[0][1]
