"""One error type for everything a user can get wrong in a spec or a model directory.

It carries the file and line so the CLI can print `file:line: message` and exit 2, never a
traceback.
"""
import difflib


class SpecError(Exception):
    def __init__(self, message: str, file: str | None = None, line: int | None = None):
        super().__init__(message)
        self.message = message
        self.file = file
        self.line = line

    def __str__(self) -> str:
        if self.file is None and self.line is None:
            return self.message
        where = self.file or "<spec>"
        if self.line is not None:
            where += f":{self.line}"
        return f"{where}: {self.message}"


class TemplateError(Exception):
    """A kernel template that does not render (compiler/codegen/render.py raises it); here so
    that the CLI catches it without importing jinja2 for commands that render nothing."""


def did_you_mean(name, choices) -> str:
    """"; did you mean 'x'?" for the closest of `choices`, or "" when none is close."""
    close = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


class ModelDirError(Exception):
    """A model directory that does not match what the plan needs (names the file or tensor)."""
