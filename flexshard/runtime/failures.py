"""The one converter of a backend failure (a collective torch ran itself timed out or
lost a peer) into flexshard's ``CollectiveError``, for code that runs torch's own
collectives (checkpoint I/O, the trainer's waits)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from .collectives import CollectiveError, backend_cause, is_backend_failure


@contextlib.contextmanager
def backend_failures_raise(
    error: Callable[[BaseException, str], CollectiveError], note: str | None = None
) -> Iterator[None]:
    """The one converter of a collective torch ran itself into flexshard's error: a
    backend failure (timeout, lost peer) raised inside becomes ``error(err, cause)``
    (``cause``: the backend's first line; the failure itself is its ``backend_error``);
    flexshard's own CollectiveErrors pass, with ``note`` added (where they struck)."""
    try:
        yield
    except CollectiveError as err:
        if note is not None:
            err.add_note(note)
        raise
    except Exception as err:
        if not is_backend_failure(err):
            raise
        named = error(err, backend_cause(err))
        named.backend_error = err
        raise named from None  # not chained: see CollectiveError
