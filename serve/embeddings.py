"""OpenAI's ``POST /v1/embeddings``: one pooled, normalized vector per input (``AsyncEngine.embed``).

Served by every api_server: each input is one forward pass over a KV cache of its own, run beside the
requests being generated and leaving them untouched (``Engine.get_hidden_states``), so a server started
with ``--task generate`` answers it too, as LMDeploy serves both from one server (a chat model's
embeddings are its last-token states, which only an embedder was trained to make useful). A server
started with ``--task embed`` serves this route alone (``Server.check_generating``).
"""
from __future__ import annotations

import base64
import sys

from lmd.async_engine import AsyncEngine
from lmd.errors import InputTooLongError

from .errors import APIError
from .openai_protocol import EmbeddingRequest
from .server import Server


async def answer_embeddings(server: Server, engine: AsyncEngine, body: EmbeddingRequest) -> dict:
    """OpenAI's body: ``{object: 'list', data: [{object: 'embedding', index, embedding}], model, usage}``."""
    try:
        engine.pooler_config.check_dimensions(body.dimensions, engine.model_info.hidden_size)
    except ValueError as e:
        raise APIError(400, str(e), param='dimensions') from e
    try:
        batch = engine.embedding_inputs(body.input)
    except ValueError as e:
        code = 'context_length_exceeded' if isinstance(e, InputTooLongError) else None
        raise APIError(400, str(e), param='input', code=code) from e
    async with server.slot():
        vectors = await engine.embed(batch, body.dimensions)
    data = [{'object': 'embedding', 'index': i, 'embedding': _encoded(v, body.encoding_format)}
            for i, v in enumerate(vectors)]
    num_tokens = sum(len(ids) for ids in batch)
    return {'object': 'list', 'data': data, 'model': server.config.model_name,
            'usage': {'prompt_tokens': num_tokens, 'total_tokens': num_tokens}}


def _encoded(vector, encoding_format: str) -> list[float] | str:
    """The vector as JSON floats, or as base64 of its little-endian float32 bytes (what OpenAI's client
    decodes with ``np.frombuffer(..., dtype='float32')``)."""
    if encoding_format == 'float':
        return vector.tolist()
    data = vector.float().contiguous().numpy()
    if sys.byteorder != 'little':
        data = data.byteswap()
    return base64.b64encode(data.tobytes()).decode('ascii')
