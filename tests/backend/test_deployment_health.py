"""Passive ejection, backoff, the half-open retry and probe recovery of one deployment."""

from __future__ import annotations

from ctxgate.backend.routing.deployment_health import DeploymentHealth, HealthPolicy


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_failures_in_a_row_eject_and_successes_reset_the_count():
    clock = Clock()
    health = DeploymentHealth(HealthPolicy(failures_to_eject=3, eject_s=5), clock)
    assert not health.failure() and not health.failure()
    health.success()
    assert not health.failure() and not health.failure() and health.available()
    assert health.failure() and not health.available()
    clock.now += 5
    assert health.available() and health.total_ejections == 1


def test_a_failed_trial_after_ejection_ejects_again_for_longer():
    clock = Clock()
    health = DeploymentHealth(HealthPolicy(failures_to_eject=2, eject_s=5, max_eject_s=12), clock)
    health.failure()
    health.failure()
    clock.now += 5
    assert health.failure()  # the half-open trial failed: at once, 10 s this time
    clock.now += 9.9
    assert not health.available()
    clock.now += 0.1
    assert health.failure()  # capped at max_eject_s
    assert health.ejected_until == clock.now + 12
    clock.now += 12
    health.success()
    assert not health.failure() and health.available()  # recovered: back to failures_to_eject


def test_probes_eject_a_silent_deployment_and_restore_it_when_it_answers():
    clock = Clock()
    health = DeploymentHealth(HealthPolicy(eject_s=30), clock)
    assert not health.probe(True)
    assert health.probe(False) and not health.available()
    assert not health.probe(False)  # already out: not counted twice
    health.probe(True)
    assert health.available() and health.total_ejections == 1


def test_requests_cut_by_the_same_crash_eject_once():
    clock = Clock()
    health = DeploymentHealth(HealthPolicy(failures_to_eject=1, eject_s=30, max_eject_s=60), clock)
    assert health.failure()  # the first stream the crash cut ejects
    assert not health.failure() and not health.failure()  # the others were in flight: no more, no longer
    assert health.total_ejections == 1 and health.ejected_until == clock.now + 30
    clock.now += 30
    assert health.failure() and health.ejected_until == clock.now + 60  # the half-open trial still doubles
