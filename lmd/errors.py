"""Errors lmd raises for bad input; the CLI prints them as one line, the servers as 4xx."""


class LmdError(Exception):
    """Base of lmd's user-facing errors."""


class ModelNotFoundError(LmdError, FileNotFoundError):
    """The model name or path resolves to nothing that exists here."""


class ModelFormatError(LmdError, ValueError):
    """A model file or directory exists but cannot be read as a model."""


class PromptTooLongError(LmdError, ValueError):
    """A prompt (with what its session already holds) leaves no room in ``session_len`` for a
    generated token. Raised by the engines' one admission check (``lmd.engine.SessionTable``);
    the servers answer it as 400 ``context_length_exceeded``."""

    def __init__(self, session_id: int, num_prompt_tokens: int, num_history_tokens: int, session_len: int):
        self.session_id = session_id
        self.num_prompt_tokens = num_prompt_tokens
        self.num_history_tokens = num_history_tokens
        self.session_len = session_len
        history = f' + {num_history_tokens} of the session\'s history' if num_history_tokens else ''
        # ``detail``: the message without the engine's session id, for callers that number no sessions
        self.detail = (f'the prompt ({num_prompt_tokens} tokens{history}) must be shorter than '
                       f'session_len={session_len} to leave room for at least one generated token')
        super().__init__(f'session {session_id}: {self.detail}')

    def __reduce__(self):  # pickles with its fields, not its message
        return type(self), (self.session_id, self.num_prompt_tokens, self.num_history_tokens, self.session_len)


class InputTooLongError(LmdError, ValueError):
    """An input to embed (``AsyncEngine.embedding_inputs``) has more tokens than ``session_len``; the
    servers answer it as 400 ``context_length_exceeded`` naming the input."""

    def __init__(self, index: int, num_tokens: int, session_len: int):
        self.index, self.num_tokens, self.session_len = index, num_tokens, session_len
        super().__init__(f'input[{index}] has {num_tokens} tokens, more than this model\'s context of '
                         f'{session_len} tokens (session_len): send a shorter input')

    def __reduce__(self):
        return type(self), (self.index, self.num_tokens, self.session_len)
