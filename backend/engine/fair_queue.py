"""Weighted fair queuing between tenants, on prefill tokens (self-clocked: virtual finish times).

Each new sequence is stamped once: it starts at the later of the system's virtual time and its
tenant's previous virtual finish, and finishes its prompt tokens divided by the tenant's weight later.
The scheduler admits waiting sequences in order of (priority class, virtual finish, arrival), so a
tenant that floods the queue pushes only its own requests later, and over any backlogged stretch
tenants get prefill tokens in proportion to their weights.

The system's virtual time is the largest virtual finish admitted so far: every admission moves it
on, so a stream of newcomers cannot hold it still and starve a tenant with a request queued. A tenant
that comes back after being idle starts no earlier than it, so idling banks no credit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ctxgate.backend.engine.sequence import Sequence

# Tenants remembered before finish times at or behind the virtual time are dropped (they no longer
# change anyone's stamp); the bound doubles with the live count so pruning stays amortised O(1).
_PRUNE_FLOOR = 64


@dataclass
class FairQueue:
    """The virtual clock and each tenant's last virtual finish; disabled, every stamp is 0 (FCFS)."""

    enabled: bool = True
    virtual_time: float = 0.0
    _finish: dict[str | None, float] = field(default_factory=dict)
    _prune_at: int = _PRUNE_FLOOR

    def stamp(self, seq: Sequence) -> None:
        """Give a new sequence its virtual finish; one already stamped (preempted, forked) keeps its own."""
        if seq.virtual_finish is not None:
            return
        if not self.enabled:
            seq.virtual_finish = 0.0
            return
        start = max(self.virtual_time, self._finish.get(seq.tenant, 0.0))
        seq.virtual_finish = start + max(1, seq.num_prompt_tokens) / seq.weight
        self._finish[seq.tenant] = seq.virtual_finish
        if len(self._finish) > self._prune_at:
            self._prune()

    def admitted(self, seq: Sequence) -> None:
        """`seq` left the waiting queue for the running batch: virtual time reaches its finish."""
        if seq.virtual_finish is not None and seq.virtual_finish > self.virtual_time:
            self.virtual_time = seq.virtual_finish

    def drained(self) -> None:
        """Nothing waits: every tenant's past is settled, so all of them start afresh at one time
        (what each tenant's last admission already made true; this also frees the memory)."""
        if self._finish:
            self.virtual_time = max(self.virtual_time, *self._finish.values())
            self._finish.clear()
            self._prune_at = _PRUNE_FLOOR

    @property
    def num_tenants(self) -> int:
        """Tenants whose finish is still remembered (bounded: see `_prune`)."""
        return len(self._finish)

    def _prune(self) -> None:
        self._finish = {tenant: at for tenant, at in self._finish.items() if at > self.virtual_time}
        self._prune_at = max(_PRUNE_FLOOR, 2 * len(self._finish))
