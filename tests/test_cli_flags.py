"""Command lines that say no: every command checks its flags against the function it runs (lmd.runner),
and its help is that function's own docstring.

The real commands run in subprocesses: a misspelled flag must stop them before they load a model or
open a port (today's bug: ``lmd serve api_server smollm2 --no-such-flag 3`` served and ignored it).
"""
import inspect
import subprocess
import sys

import pytest

from lmd.runner import Group, Lazy, UsageError, check_arguments

LMD = [sys.executable, '-m', 'lmd.cli']


def run(cmd, timeout=60):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def one_error_line(r) -> str:
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('lmd: error: '), r.stderr
    assert 'Traceback' not in r.stdout + r.stderr
    return lines[0]


@pytest.mark.parametrize('cmd, bad, good', [
    (LMD + ['serve', 'api_server', 'smollm2', '--cache-max-entry-cout', '0.5'], '--cache-max-entry-cout',
     '--cache-max-entry-count'),
    (LMD + ['serve', 'api_server', 'smollm2', '--no-such-flag', '3'], '--no-such-flag', None),
    (LMD + ['chat', '--max-new-token', '8'], '--max-new-token', '--max-new-tokens'),
    (LMD + ['serve', 'gradio', 'smollm2', '--server-prot', '7000'], '--server-prot', '--server-port'),
    (LMD + ['serve', 'triton', 'smollm2', '--enable-prefix-cashing'], '--enable-prefix-cashing',
     '--enable-prefix-caching'),
    (LMD + ['serve', 'triton_client', '127.0.0.1:1', '--top-kk', '3'], '--top-kk', '--top-k'),
    (LMD + ['serve', 'proxy', '--nodez', 'http://127.0.0.1:1'], '--nodez', '--nodes'),
    (LMD + ['lite', 'auto_awq', 'smollm2', 'out', '--w-bit', '4'], '--w-bit', '--w-bits'),
    (LMD + ['convert', 'smollm2', 'out', '--overwite'], '--overwite', '--overwrite'),
    ([sys.executable, '-m', 'lmd.serve.api_server', 'smollm2', '--cache-max-entry-cout', '0.5'],
     '--cache-max-entry-cout', '--cache-max-entry-count'),
    ([sys.executable, '-m', 'lmd.serve.api_client', 'http://127.0.0.1:1', '--api-kye', 'k'], '--api-kye',
     '--api-key'),
    ([sys.executable, '-m', 'lmd.serve.triton_client', '127.0.0.1:1', '--modle', 'lmd_model'], '--modle',
     '--model'),
    ([sys.executable, '-m', 'lmd.serve.gradio_app', 'smollm2', '--sharre'], '--sharre', '--share'),
])
def test_unknown_flag_is_one_line_naming_it_and_the_nearest(cmd, bad, good):
    line = one_error_line(run(cmd))
    assert f'unknown flag {bad} ' in line
    if good:
        assert f'(did you mean {good}?)' in line
    else:
        assert 'did you mean' not in line


def test_unknown_command_and_missing_argument():
    line = one_error_line(run(LMD + ['serv', 'api_server']))
    assert "unknown command 'serv'" in line and 'did you mean serve?' in line
    line = one_error_line(run(LMD + ['serve', 'api-sever']))
    assert 'did you mean api_server?' in line
    line = one_error_line(run(LMD + ['convert', 'smollm2']))
    assert 'lmd convert needs OUT_DIR' in line
    line = one_error_line(run(LMD + ['lite', 'calibrate', 'smollm2', 'out', 'extra']))
    assert "unexpected argument 'extra'" in line


def test_help_of_a_lazy_command_is_its_functions_docstring():
    from lmd.serve.api_client import run_api_client
    r = run(LMD + ['serve', 'api_client', '--help'])
    assert r.returncode == 0, r.stderr
    summary = inspect.getdoc(run_api_client).splitlines()[0]
    assert f'lmd serve api_client - {summary}' in r.stdout
    assert 'the model name to ask for' in r.stdout  # an Args line
    r = run([sys.executable, '-m', 'lmd.serve.api_client', '--help'])
    assert r.returncode == 0 and summary in r.stdout
    # after fire's separator too, --help only shows the help: fire would start the server first
    r = run(LMD + ['serve', 'api_server', 'smollm2', '--', '--help'])
    assert r.returncode == 0 and 'lmd serve api_server - Serve a model' in r.stdout, r.stderr


def test_group_help_reads_docstrings_from_source_and_imports_no_server_library():
    code = ('import sys; from lmd.cli import main; rc = main(["serve", "--help"]); '
            'heavy = {"gradio", "uvicorn", "fastapi", "openai", "torch", "tritonclient", "transformers"}; '
            'print("IMPORTED", sorted(m for m in sys.modules if m.split(".")[0] in heavy)); sys.exit(rc)')
    r = run([sys.executable, '-c', code])
    assert r.returncode == 0, r.stderr
    assert 'IMPORTED []' in r.stdout
    assert 'api_server' in r.stdout and 'triton_client' in r.stdout


def test_every_commands_help_is_its_own_docstring():
    from lmd.cli import LMD as tree

    def walk(group, name):
        for key, command in group.commands.items():
            if isinstance(command, Group):
                yield from walk(command, f'{name} {key}')
            else:
                yield f'{name} {key}', command

    for name, command in walk(tree, 'lmd'):
        fn = command.load() if isinstance(command, Lazy) else command
        doc = inspect.getdoc(fn)
        assert doc and 'Args:' in doc, f'{name}: its function has no Args section'
        params = [p for p in inspect.signature(fn).parameters]
        assert all(f'{p}:' in doc for p in params), f'{name}: a parameter has no help line'
        if isinstance(command, Lazy):
            assert command.doc() == doc, f'{name}: the help read from source differs'


def f(model: str, work_dir: str = 'out', *, share: bool = False, top_k: int = 50, seed: int | None = None):
    """A function to check command lines against: as the commands, the words after ``*`` are flags only."""


@pytest.mark.parametrize('args', [
    ['m'], ['m', 'w'], ['--model', 'm'], ['m', '--share'], ['m', '--noshare'], ['m', '--share', '--top-k', '3'],
    ['m', '--top_k=3'], ['m', '-t', '3'], ['m', '--top-k', '-1'], ['m', '--seed', '3'], ['--help'],
    ['m', '--', '--help'],  # run_command shows the help and runs nothing
])
def test_check_arguments_accepts_what_fire_reads(args):
    check_arguments(f, args, 'cmd')


@pytest.mark.parametrize('args, message', [
    (['m', '--top-kk', '3'], 'unknown flag --top-kk for cmd (did you mean --top-k?)'),
    (['m', '--top-k=3', '--shar'], 'unknown flag --shar for cmd (did you mean --share?)'),
    (['m', '--noshare', 'x'], 'unknown flag --noshare'),  # with a value it is not the negation
    (['m', 'w', 'x'], "unexpected argument 'x'"),  # not taken as --share: that one is keyword-only
    (['m', '-s'], '-s is ambiguous for cmd: it could be any of --share, --seed'),  # as fire: seed counts too
    (['m', '--bogus', '--', '--help'], 'unknown flag --bogus'),  # fire would run f before reading --help
    (['--share'], 'cmd needs MODEL'),
    (['m', '-w', 'x', '-x'], 'unknown flag -x'),
])
def test_check_arguments_refuses_what_fire_would_ignore(args, message):
    with pytest.raises(UsageError, match=message.replace('(', r'\(').replace(')', r'\)').replace('?', r'\?')):
        check_arguments(f, args, 'cmd')


def test_ambiguous_short_flag():
    def g(top_k: int = 1, temperature: float = 1.0):
        """g."""
    with pytest.raises(UsageError, match='-t is ambiguous'):
        check_arguments(g, ['-t', '1'], 'cmd')
