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


# ---- the scaling flags: --tp, --dp, --pp, --distributed-executor-backend, --ray-address on every command
# that builds an engine ------------------------------------------------------------------------------------

SCALING = ('tp', 'dp', 'pp', 'distributed_executor_backend', 'ray_address')


def _engine_commands():
    from lmd.chat import chat
    from lmd.cli import eval_ppl
    from lmd.serve.api_server import serve
    from lmd.serve.gradio_app import serve_gradio
    from lmd.serve.triton import serve_triton
    return dict(api_server=serve, chat=chat, gradio=serve_gradio, triton=serve_triton, eval_ppl=eval_ppl)


@pytest.mark.parametrize('name', ['api_server', 'chat', 'gradio', 'triton', 'eval_ppl'])
def test_every_engine_command_takes_the_scaling_flags(name):
    params = inspect.signature(_engine_commands()[name]).parameters
    assert all(p in params and params[p].kind is inspect.Parameter.KEYWORD_ONLY for p in SCALING), name


def test_command_engine_config_of_the_scaling_flags():
    from lmd.backend import command_engine_config
    from lmd.messages import EngineConfig, PytorchEngineConfig
    cfg = command_engine_config(dict(tp=1, dp=2, pp=1, distributed_executor_backend=None, ray_address=None), 'auto')
    assert type(cfg) is EngineConfig and cfg.dp == 2  # dp and tp are shared: either engine
    cfg = command_engine_config(dict(dp=2, pp=2, session_len=64), 'auto')
    assert type(cfg) is PytorchEngineConfig and (cfg.dp, cfg.pp, cfg.session_len) == (2, 2, 64)
    cfg = command_engine_config(dict(ray_address='10.0.0.1:6379'), 'pytorch')  # the address implies ray
    assert cfg.distributed_executor_backend == 'ray' and cfg.ray_address == '10.0.0.1:6379'
    cfg = command_engine_config(dict(distributed_executor_backend='mp'), 'auto')
    assert type(cfg) is PytorchEngineConfig and cfg.distributed_executor_backend == 'mp'
    for fields, flag in [(dict(pp=2), '--pp 2'), (dict(distributed_executor_backend='ray'),
                                                   '--distributed-executor-backend ray'),
                         (dict(ray_address='auto'), '--ray-address auto')]:
        with pytest.raises(ValueError, match=f'{flag} is a PyTorch engine setting .* --backend pytorch or auto'):
            command_engine_config(fields, 'turbomind')
    with pytest.raises(ValueError, match='--int8-activations is a TurboMind setting and --pp a PyTorch'):
        command_engine_config(dict(pp=2), 'auto', int8_activations=True)
    with pytest.raises(ValueError, match='distributed_executor_backend'):
        command_engine_config(dict(distributed_executor_backend='slurm'), 'auto')


def test_scaling_flags_reach_the_engine_config(monkeypatch, tmp_path):
    """Each command's flags, as it hands them to the engine (nothing loads)."""
    import json

    import uvicorn

    from lmd import api
    from lmd.messages import PytorchEngineConfig
    from lmd.serve import api_server, gradio_app

    seen = {}

    class Stop(Exception):
        pass

    def record(name):
        def fake(*args, backend=None, backend_config=None, **kwargs):
            seen[name] = (backend, backend_config)
            raise Stop()
        return fake

    monkeypatch.setattr(api_server, 'AsyncEngine', lambda *a, **kw: record('api_server')(*a, **kw))
    monkeypatch.setattr(uvicorn, 'run', lambda app, **kw: app.state.server.engine_factory())
    with pytest.raises(Stop):
        api_server.serve('smollm2', dp=2, pp=2, tp=1, ray_address='127.0.0.1:6379', num_threads=2)
    backend, cfg = seen['api_server']
    assert isinstance(cfg, PytorchEngineConfig) and (cfg.dp, cfg.pp, cfg.num_threads) == (2, 2, 2)
    assert (cfg.distributed_executor_backend, cfg.ray_address) == ('ray', '127.0.0.1:6379') and backend == 'auto'

    monkeypatch.setattr(api, 'pipeline', lambda *a, **kw: record('chat')(*a, **kw))
    from lmd.chat import chat
    with pytest.raises(Stop):
        chat('smollm2', dp=2)
    assert seen['chat'][1].dp == 2

    monkeypatch.setattr(gradio_app, 'run_gradio', lambda *a, **kw: record('gradio')(*a, **kw))
    with pytest.raises(Stop):
        gradio_app.serve_gradio('smollm2', dp=2, distributed_executor_backend='mp')
    assert isinstance(seen['gradio'][1], PytorchEngineConfig) and seen['gradio'][1].dp == 2
    with pytest.raises(Stop):  # given with a URL, they are an error open_chat_client names
        gradio_app.serve_gradio('http://127.0.0.1:1', dp=2)
    with pytest.raises(ValueError, match='engine options and chat_template apply to a local model'):
        gradio_app.open_chat_client('http://127.0.0.1:1', *seen['gradio'])

    from lmd.serve.triton import build_repository
    repo = build_repository('smollm2', str(tmp_path / 'repo'), models='engine', dp=2, pp=2)
    text = open(tmp_path / 'repo' / 'engine' / 'config.pbtxt').read()
    assert '\\"dp\\": 2' in text and '\\"pp\\": 2' in text and '"pytorch"' in text, text
    with pytest.raises(ValueError, match='--pp 2 is a PyTorch engine setting'):
        build_repository('smollm2', repo, backend='turbomind', models='engine', pp=2)

    import lmd.lite.eval_ppl as lite_eval_ppl
    monkeypatch.setattr(lite_eval_ppl, 'eval_ppl', lambda *a, **kw: record('eval_ppl')(*a, **kw))
    from lmd.cli import eval_ppl
    with pytest.raises(Stop):
        eval_ppl('smollm2', pp=2, dp=2)
    assert seen['eval_ppl'][0] == 'pytorch'  # a PyTorch engine setting picks that engine


def test_scaling_flags_the_engine_refuses_are_one_error_line():
    line = one_error_line(run(LMD + ['serve', 'api_server', 'smollm2', '--backend', 'turbomind', '--pp', '2']))
    assert '--pp 2 is a PyTorch engine setting' in line
    line = one_error_line(run(LMD + ['lite', 'eval_ppl', 'smollm2', '--backend', 'hf', '--dp', '2']))
    assert "backend 'hf'" in line
