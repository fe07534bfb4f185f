"""A test engine model: the embedded engine model (trtspec.triton.engine_model), paced by the test's reader. While the
file SEEN beside this file exists, a streamed call does not go on to its next step until SEEN holds at least the number
of tokens the call has chosen so far (or the call is stopped): the reader has received every token before the engine
chooses the next one, the reader that always keeps up; a reader that leaves holds the call where it was until its stop
comes. Without the file it runs as the embedded engine model does. Production code is not touched."""

from __future__ import annotations

import time
from pathlib import Path

from trtspec.triton.engine_model import TritonPythonModel as EmbeddedEngineModel

SEEN = Path(__file__).parent / "SEEN"
PATIENCE = 60.0  # seconds a step waits for the reader before it goes on anyway


def _seen() -> int | None:
    try:
        return int(SEEN.read_text() or 0)
    except (FileNotFoundError, ValueError):
        return None if not SEEN.exists() else 0


def _paced(on_token, stopped):
    def token(result):
        on_token(result)
        until = time.monotonic() + PATIENCE
        while time.monotonic() < until and not stopped():
            seen = _seen()
            if seen is None or seen >= len(result.new_tokens):
                return
            time.sleep(0.002)

    return token


class TritonPythonModel(EmbeddedEngineModel):
    def _submit_all(self, calls, request_id):
        scheduler = self.engine.scheduler

        def stopped() -> bool:  # a stop request for this call came (Scheduler.cancel marks its jobs)
            return any(job.stopped for job in scheduler._latest.get(request_id, ()))

        super()._submit_all([(c, done, on and _paced(on, stopped)) for c, done, on in calls], request_id)
