"""A rack lost at once on simulated hosts (``elastic_runtime.testing.hosts``): 4 hosts, one worker x 2 CPU devices each,
the controller a service in the root namespace (``test_hosts.service_run``). Hosts 1 and 2 go together: both links down,
then every process on them killed, so only the missing heartbeats tell the controller, each worker one timeout after
its own last heartbeat (within the timeout plus a generous margin, asserted). Lost together or within the settling,
the two losses must be one re-forming of the two survivors (the settling waits for the rack's second worker,
``supervisor.py``), not a re-forming per loss, nor a forming that still names a dead worker; lost a timeout apart,
the second may be found while the group re-forms without the first, and that forming must then go on without it
(``forming.give_up``). In every case nobody else is replaced or restarted. No replacement is started: the
survivors finish the run on a data axis of 2, so the final state matches the 4-worker fault-free run within 1e-5
relative (float reassociation), not bitwise.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from launch_support import STEPS, fault_free_final
from test_hosts import _WAIT_S, events, service_run, wait_for
from test_launcher_recovery import assert_no_committed_step_lost, final_state

from elastic_runtime.cli.launch import DEFAULTS
from elastic_runtime.core.compare import compare_states
from elastic_runtime.core.events import (
    GroupFormed,
    GroupForming,
    RecoveryStarted,
    StepCompleted,
    WorkerHung,
    WorkerKilled,
    WorkerLost,
)
from elastic_runtime.testing.hosts import SimulatedHosts

pytestmark = pytest.mark.timeout(300)

HOSTS = 4
RACK = (1, 2)
HEARTBEAT_TIMEOUT_S = DEFAULTS["heartbeat_timeout_s"]  # the controller's default (--heartbeat-timeout)
# Detection was 1.86-2.06 s after the cut at load 7.6-21 (2 cores) with the earlier 2 s default: printed, not
# asserted (a loaded machine delays the monitor); that the silence, not something later, found them is asserted.


@pytest.fixture(scope="module")
def reference4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fault-free run of the same job on 4 workers (on loopback, launched)."""
    return fault_free_final(tmp_path_factory.mktemp("reference4"), processes=HOSTS)


@pytest.mark.heavy
@pytest.mark.parametrize("apart", [0.0, 0.25, 1.0], ids=["at-once", "within-the-settling", "a-timeout-apart"])
def test_a_rack_of_two_hosts_lost_leaves_the_survivors_with_none_restarted(
    tmp_path: Path, reference4: Path, apart: float
) -> None:
    # ``apart``: host 1's link goes down that many heartbeat timeouts before host 2's (a switch's ports failing
    # one after the other). At once, the two are found within about one heartbeat interval (0.2 s) of each other.
    # A quarter of a timeout apart (0.2 s at 0.8 s), four times the 50 ms that folds losses found together
    # (SETTLE_S): only the settling that waits while another worker is half a timeout silent makes it one
    # re-forming. A timeout apart, host 2 is found about when the group re-forms without host 1: in its forming
    # (before anyone took a seat: the rest re-form without it at once, ``forming.give_up``; after: it drops out),
    # or once it trained; which one, the race decides, but no survivor is restarted in any.
    apart_s = apart * HEARTBEAT_TIMEOUT_S
    with (
        SimulatedHosts(HOSTS) as hosts,
        service_run(hosts, tmp_path, step_delay_s=0.3, min_nprocs=HOSTS - len(RACK), nprocs=HOSTS) as run,
    ):
        controller, run_dir = run.controller, run.run_dir
        wait_for(
            "step 5", lambda: any(isinstance(e, StepCompleted) and e.step >= 5 for e in events(run_dir)), controller
        )
        cut_at = {RACK[0]: time.monotonic()}  # the events' mono_time is the same clock (one machine)
        if apart_s:
            hosts.partition(RACK[0])  # its link down; its processes are killed with the other host's
            time.sleep(apart_s)
        cut_at[RACK[1]] = time.monotonic()
        hosts.lose(*RACK)
        out, _ = controller.communicate(timeout=_WAIT_S)
    log_text = (tmp_path / "controller.log").read_text()
    assert controller.returncode == 0, log_text
    result = json.loads(out.decode().strip().splitlines()[-1])
    history = events(run_dir)

    assert result["ok"] and result["step"] == STEPS, result
    lost = [e for e in history if isinstance(e, WorkerLost)]
    assert sorted(e.worker for e in lost) == list(RACK), lost
    assert all(e.message.startswith("no heartbeat for ") for e in lost), lost  # silence, not a closed connection
    assert all(e.silent_s >= HEARTBEAT_TIMEOUT_S for e in lost), lost
    assert not [e for e in history if isinstance(e, WorkerHung | WorkerKilled)]  # no survivor judged or killed
    assert len([e for e in history if isinstance(e, RecoveryStarted)]) == len(RACK)  # the real losses, counted
    survivors = set(range(HOSTS)) - set(RACK)
    forming = [set(e.members) for e in history if isinstance(e, GroupForming)]
    formed = [set(e.members) for e in history if isinstance(e, GroupFormed)]
    assert result["survivor_restarts"] == 0 and "restart" not in result["strategies"], result
    if apart < 1:  # one re-forming, of the survivors alone: its forming never named a lost worker
        assert forming == [set(range(HOSTS)), survivors], forming
        assert formed == [set(range(HOSTS)), survivors]
        assert result["strategies"] == ["start", "reform"], result["strategies"]
        assert result["world_size_history"] == [HOSTS, HOSTS - len(RACK)]
    else:  # host 1's re-forming, then host 2's (or one, if the settling caught host 2 after all)
        assert forming[0] == set(range(HOSTS)) and formed[-1] == survivors and len(forming) <= 3, forming
        assert all(members - survivors <= {RACK[1]} for members in forming[1:]), forming  # host 1 never again
    assert_no_committed_step_lost(history)
    match = compare_states(final_state(tmp_path / "final"), final_state(reference4), bitwise=False)
    assert match["match"], match
    # How long after its cut each host was found lost: about the heartbeat timeout (a heartbeat sent just before
    # the cut may make it up to one interval less), more on a loaded machine.
    detected = {e.worker: e.mono_time - cut_at[e.worker] for e in lost}
    # Figures, printed (load decides them); `pytest -s` shows them.
    lost_at = cut_at[RACK[0]]
    before = max(e.step for e in history if isinstance(e, StepCompleted) and e.mono_time < lost_at)
    next_commit = min(e.mono_time for e in history if isinstance(e, StepCompleted) and e.step > before)
    reformed = next(e for e in history if isinstance(e, GroupForming) and e.generation == 2)
    figures = {
        "apart_s": apart_s,
        "formings": [sorted(members) for members in forming],
        "detected_after_cut_s": {k: round(v, 3) for k, v in detected.items()},
        "detection_spread_s": round(max(e.mono_time for e in lost) - min(e.mono_time for e in lost), 3),
        "forming_after_s": round(reformed.mono_time - lost_at, 3),
        "next_commit_after_s": round(next_commit - lost_at, 3),
        "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
        "max_rel_error": match["max_rel_error"],
        "load": [round(x, 1) for x in os.getloadavg()],
    }
    print(f"\nrack of {len(RACK)} hosts lost: {json.dumps(figures)}")
