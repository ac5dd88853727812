"""Admission by sequences: what ``--max-inflight-requests`` bounds, and who may set priority.

Each HTTP generation request takes one unit when it arrives (before its body is read, so a
flood is refused cheaply), and once its body is parsed one more per further engine
request it makes: ``n``/``best_of`` choices times prompts, or embedding inputs. Counting
HTTP requests let two requests of 64 sequences each fill an engine's waiting queue while
the frontend thought it had room for hundreds more. A request that would pass the bound
gets 429 with Retry-After; one that asks for more sequences than the bound itself can never
be admitted and gets 400. The units go back when the request ends, whatever the ending.

``priority`` (vLLM's field) moves a request ahead in engines that schedule by priority;
a client may set it only when the operator allows: ``--allow-client-priority`` for every
caller, or the priority key (``PLANARIA_PRIORITY_KEY`` in the frontend's environment)
presented as the caller's bearer token. Others get 400 naming ``priority``.
"""

from __future__ import annotations

from typing import Callable

from aiohttp import web

from planaria.frontend.errors import RequestError, TooManyRequestsError

_Key = getattr(web, "RequestKey", lambda name, _type: name)  # typed request keys: aiohttp >= 3.12
ADMISSION = _Key("planaria.admission", object)  # request[ADMISSION]: the request's Ticket
MAY_SET_PRIORITY = _Key("planaria.may_set_priority", bool)
RETRY_AFTER_S = 1


class Admission:
    def __init__(self, limit: int, on_refused: Callable[[], None] = lambda: None) -> None:
        self.limit = limit
        self.in_flight = 0  # sequences
        self._on_refused = on_refused

    def ticket(self) -> "Ticket":
        return Ticket(self)


class Ticket:
    """One request's units; ``release`` returns them all (idempotent)."""

    def __init__(self, admission: Admission) -> None:
        self._adm = admission
        self.units = 0

    def take(self, n: int) -> None:
        adm = self._adm
        if n <= 0:
            return
        if self.units + n > adm.limit:
            raise RequestError(f"the request makes {self.units + n} sequences (prompts x n or best_of, or inputs); "
                               f"this frontend runs at most {adm.limit} at once (--max-inflight-requests)",
                               param="n")
        if adm.in_flight + n > adm.limit:
            adm._on_refused()
            raise TooManyRequestsError(
                f"this frontend has {adm.in_flight} of its maximum of {adm.limit} sequences in flight "
                "(--max-inflight-requests); retry later", retry_after_s=RETRY_AFTER_S)
        adm.in_flight += n
        self.units += n

    def release(self) -> None:
        self._adm.in_flight -= self.units
        self.units = 0


def take_sequences(request: web.Request, num_sequences: int) -> None:
    """The request's further sequences beyond the one it took on arrival (no-op for a
    request that did not come through the server's admission, e.g. in unit tests)."""
    ticket = request.get(ADMISSION) if hasattr(request, "get") else None
    if ticket is not None:
        ticket.take(num_sequences - ticket.units)


def check_priority(request: web.Request, priority: int | None) -> int:
    if not priority:
        return 0
    if hasattr(request, "get") and request.get(MAY_SET_PRIORITY, True) is False:
        raise RequestError("priority may be set only by callers the operator allows (--allow-client-priority, "
                           "or the priority key as the bearer token)", param="priority")
    return priority
