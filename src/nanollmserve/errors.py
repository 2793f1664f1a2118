"""Errors a user can fix by changing their input; the CLI prints them as one line, the
server answers them with a 400 naming the parameter. No torch here: the API imports it."""

from __future__ import annotations


class UserError(Exception):
    """A problem with what the user asked for (bad path, bad flag value), not a bug."""


class ParamError(ValueError):
    """A request parameter with a bad value: `ParamError("top_p must be in (0, 1]",
    param="top_p")`. The server answers it with a 400 whose `param` is `param` (under its API
    name when the API calls the field differently); any other exception is a 500. `param`
    names the field as the raiser knows it (a SamplingParams field, "prompt", "messages").
    A ValueError, so code that catches ValueError (the offline API, gRPC) still does."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def __reduce__(self):
        return type(self), (self.message, self.param)
