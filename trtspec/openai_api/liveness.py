"""The front's `/health/live`: whether the deployment behind it should be restarted (Kubernetes' liveness probe).

Readiness (`/health`) asks Triton whether the models are ready, and a `tensorrtllm` model whose executor fails every
call stays READY (trtspec.engine_health). Liveness adds what readiness cannot see: the run of engine-side failures
the BLS exports for its target on Triton's metrics, judged by a `LivenessRule`; and models that stay unready for
longer than loading them takes (the embedded backend's BLS reloads a dead engine model: past that time it will not).
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from trtspec.engine_health import LivenessRule, failing_from_scrape

log = logging.getLogger("trtspec.openai")


class Liveness:
    """`metrics_url`: Triton's metrics (None: the BLS's failures are not read). `unready_grace`: seconds models may
    stay unready (None: never a reason, as for a front beside a Triton it did not start, which a restart of the front
    would not mend)."""

    def __init__(self, metrics_url: str | None, rule: LivenessRule | None = None, unready_grace: float | None = None):
        self.metrics_url, self.rule, self.unready_grace = metrics_url, rule or LivenessRule(), unready_grace
        self._unready_since: float | None = None  # when a model was first seen unready (time.monotonic())

    def seen(self, serving: bool) -> None:
        """What a readiness check found: whether the BLS and its target are ready."""
        if serving:
            self._unready_since = None
        elif self._unready_since is None:
            self._unready_since = time.monotonic()

    async def why_dead(self, bls: str, target: str, down: list[str]) -> str | None:
        """Why the deployment should be restarted, or None. `down`: the models the readiness check just found
        unready."""
        unready = self._unready_since
        if self.unready_grace is not None and unready is not None and time.monotonic() - unready > self.unready_grace:
            return (
                f"{', '.join(down)} not ready for more than {self.unready_grace:g} s (the time loading them may take)"
            )
        if self.metrics_url is None:
            return None
        run = failing_from_scrape(await self._scrape(), bls).get(target)
        now = time.time()
        return self.rule.describe(target, run, now) if self.rule.dead(run, now) else None

    async def _scrape(self) -> str:
        """Triton's metrics; empty when they cannot be read (no signal is not a dead engine: Triton's own death ends
        `trtspec serve`, and with it the pod)."""
        try:
            async with aiohttp.ClientSession(trust_env=False) as session:
                async with session.get(self.metrics_url, timeout=aiohttp.ClientTimeout(total=5.0)) as resp:
                    return await resp.text() if resp.status == 200 else ""
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            log.warning("cannot read Triton's metrics for /health/live: %s: %s", type(exc).__name__, exc)
            return ""
