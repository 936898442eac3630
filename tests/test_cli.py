"""The `lmd` command: help everywhere, one clear line for a user's mistake."""
import subprocess
import sys

import pytest


def lmd(*args, timeout=120, input=None):
    return subprocess.run([sys.executable, '-m', 'lmd.cli', *args], capture_output=True, text=True,
                          timeout=timeout, input=input)


@pytest.mark.parametrize('args', [['--help'], ['chat', '--help'], ['convert', '--help']])
def test_help_exits_zero(args):
    r = lmd(*args)
    assert r.returncode == 0, r.stderr
    text = r.stdout + r.stderr
    assert 'NAME' in text or 'Usage' in text or 'USAGE' in text
    if args[0] == 'chat':
        assert '/reset' in text and 'model_path' in text.replace('-', '_')


def test_console_script_is_installed():
    import shutil
    exe = shutil.which('lmd')
    assert exe, 'the lmd console script is not on PATH'
    r = subprocess.run([exe, '--help'], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0


def test_missing_model_is_one_line(tmp_path):
    r = lmd('convert', str(tmp_path / 'nope.gguf'), str(tmp_path / 'out'))
    assert r.returncode == 2
    assert r.stderr.startswith('lmd: error:') and 'nope.gguf' in r.stderr
    assert 'Traceback' not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_corrupt_gguf_is_one_line(tmp_path):
    bad = tmp_path / 'bad.gguf'
    bad.write_bytes(b'GGUF' + b'\x00' * 64)
    r = lmd('chat', str(bad), input='/exit\n')
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith('lmd: error:') and 'bad.gguf' in r.stderr
    assert 'Traceback' not in r.stderr


def test_bad_backend_is_one_line():
    r = lmd('chat', '--backend', 'vllm', input='/exit\n')
    assert r.returncode == 2
    assert r.stderr.startswith('lmd: error:') and 'turbomind' in r.stderr and 'Traceback' not in r.stderr


@pytest.mark.parametrize('backend', ['pytorch', 'turbomind'])
def test_chat_streams_keeps_conversation_and_resets(backend):
    # greedy (the CLI default): the second turn sees the first only through the kept session
    script = 'My favourite fruit is mango.\nWhat is my favourite fruit?\n/reset\nWhat is my favourite fruit?\n/exit\n'
    r = lmd('chat', '--backend', backend, '--max-new-tokens', '24', input=script, timeout=300)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.count('(new conversation)') == 1
    before, after = out.split('(new conversation)')
    answers = [a.strip() for a in before.split('>>>')[1:] if a.strip()]
    assert len(answers) == 2, out
    assert 'mango' in answers[1].lower(), out            # remembered across turns
    assert 'mango' not in after.lower(), out             # forgotten after /reset