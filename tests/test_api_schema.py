"""schemathesis against the api_server's own OpenAPI schema: no generated request gets a 5xx.

A tiny random model over SmolLM2's tokenizer keeps each generated request cheap; the
server is real (a subprocess on 127.0.0.1) and so is every request.
"""
from __future__ import annotations

import pytest

schemathesis = pytest.importorskip('schemathesis', reason='schemathesis is in the test extra: pip install -e ".[test]"')
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import CHECKS  # noqa: E402

from server_utils import api_server, tiny_model_dir  # noqa: E402

NOT_A_SERVER_ERROR = CHECKS.get_by_names(['not_a_server_error'])


@pytest.fixture(scope='module')
def live_schema(smollm2_dir, tmp_path_factory):
    model = tiny_model_dir(str(tmp_path_factory.mktemp('tiny_serve')), smollm2_dir)
    with api_server(model, '--backend', 'pytorch', '--session-len', '96', '--model-name', 'tiny',
                    '--log-level', 'WARNING') as s:
        s.wait_ready()
        yield schemathesis.openapi.from_url(s.url + '/openapi.json')


schema = schemathesis.pytest.from_fixture('live_schema')


@schema.parametrize()
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_generated_request_gets_a_5xx(case):
    case.call_and_validate(checks=NOT_A_SERVER_ERROR, timeout=300)
