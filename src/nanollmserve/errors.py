"""Errors a user can fix by changing their input; the CLI prints them as one line."""

from __future__ import annotations


class UserError(Exception):
    """A problem with what the user asked for (bad path, bad flag value), not a bug."""
