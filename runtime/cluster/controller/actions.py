"""The supervisor's loop in the shell: feed it its inputs one at a time, arm a timer for its deadline, and carry
each action it answers out (start or kill processes, send messages, host a generation's coordination service and
send its ``Form``, publish events, end the run).
"""

from __future__ import annotations

import logging
import os
import subprocess
import time

import anyio

from elastic_runtime.cluster.config import LaunchConfig, Strategy
from elastic_runtime.cluster.controller.coordination import ENV_SIMULATED, host_service
from elastic_runtime.cluster.controller.runfolder import save_fences
from elastic_runtime.cluster.controller.state import ControllerState
from elastic_runtime.cluster.controller.supervision import (
    Action,
    EndRun,
    FillSeats,
    Finish,
    Input,
    Kill,
    Place,
    Publish,
    SaveFences,
    Send,
    SendForm,
    Spawn,
    Start,
    Tick,
    TopUpSpares,
    WarmSpares,
    Watch,
)
from elastic_runtime.cluster.controller.workers import spawn, top_up_spares, warm_spares
from elastic_runtime.cluster.protocol import Form, RestoreStep
from elastic_runtime.faults.process import worker_faults_text

__all__ = ["carry_out", "fill_seats", "save_fences_now", "send_form", "supervise", "tick_at"]

log = logging.getLogger(__name__)

# Supervisor inputs taken in a row without yielding to the event loop (see ``supervise``).
_INPUTS_IN_A_ROW = 256


async def supervise(controller: ControllerState) -> None:
    """Feed the supervisor its inputs, one at a time, and carry its actions out, until the run is over. A
    timer hands it a ``Tick`` at its deadline (a new one replaces the old: a stale tick changes nothing)."""
    async with anyio.create_task_group() as timers:
        timer = anyio.CancelScope()
        armed: float | None = None
        event: Input = Start()
        in_a_row = 0
        while True:
            await carry_out(controller, controller.supervisor.handle(event, time.monotonic()))
            if controller.supervisor.done:
                break
            deadline = controller.supervisor.deadline
            if deadline is not None and (deadline != armed or isinstance(event, Tick)):
                timer.cancel()
                timer = anyio.CancelScope()
                timers.start_soon(tick_at, controller, deadline, timer)
            armed = deadline
            # Inputs already waiting are taken without a trip through the event loop each: one heartbeat's
            # input is O(1), but a loop iteration per input let a large group's backlog grow without bound.
            in_a_row = in_a_row + 1 if in_a_row < _INPUTS_IN_A_ROW else 0
            try:
                event = controller.inputs.receive_nowait() if in_a_row else await controller.inputs.receive()
            except anyio.WouldBlock:
                event = await controller.inputs.receive()
        timers.cancel_scope.cancel()
    # The last durable step's parts came in before the members' Finished: its commit is part of the run.
    await controller.changes.until(lambda: not controller.commits_pending)


async def tick_at(controller: ControllerState, deadline: float, scope: anyio.CancelScope) -> None:
    with scope:
        await anyio.sleep(max(0.0, deadline - time.monotonic()) + 0.001)  # a timer may fire a little early
        controller.feed(Tick())


async def carry_out(controller: ControllerState, actions: list[Action]) -> None:
    # The monitor's switches and the workers' places first, as if made as the supervisor decided: no verdict or
    # message may come in between (a survivor judged hung for the steps it does not commit while its group
    # re-forms; a Joined of the old group's taken for the new one's).
    for action in actions:
        if isinstance(action, Watch):
            controller.monitor.watch(action.worker, action.how, action.from_step)
        elif isinstance(action, Place):
            controller.pool[action.worker].place(action.status)
    for action in actions:
        match action:
            case Spawn(count=count):
                for _ in range(count):
                    spawn(controller)
            case TopUpSpares():
                top_up_spares(controller)
            case Kill(worker=worker, reason=reason):
                controller.kill(worker, "KILL", reason)
            case Send(worker=worker, message=message):
                if isinstance(message, RestoreStep):  # its step from now, until its heartbeats say otherwise
                    controller.pool[worker].step = message.step
                await controller.server.send(controller.pool[worker], message)
            case SendForm():
                await send_form(controller, action)
            case FillSeats():
                fill_seats(controller, action)
            case SaveFences():
                save_fences_now(controller)
            case WarmSpares():
                await warm_spares(controller)
            case Publish(event=event):
                await controller.bus.publish(event)
            case EndRun(error=error):
                controller.end(error)
            case Watch() | Place():
                pass  # applied above
            case Finish():
                pass  # the supervisor is done: the loop ends


async def send_form(controller: ControllerState, form: SendForm) -> None:
    """Host the new generation's coordination service and tell every member to join it."""
    members, generation, strategy = form.members, form.generation, form.strategy
    if form.seats:  # spares take lost members' seats in this generation: its service is up
        coordinator = controller.supervisor.coordinator
    else:
        if controller.durable is not None:
            controller.durable.new_generation(generation)
        # Bound where the controller's own port is (a local address, or a wildcard), and named to the workers
        # by the address they reach it at (a Kubernetes Service's name is not an address one can bind).
        host = controller.config.listen_host
        port, service = host_service(host, len(members), generation, controller.config.coordinator_ports)
        controller.services.append(service)
        coordinator = f"{controller.config.coordinator_host or host}:{port}"
        controller.supervisor.hosted(generation, coordinator)
    for process_id, worker in enumerate(members):
        if form.seats and worker not in form.seats:
            continue
        message = Form(
            generation=generation,
            coordinator=coordinator,
            process_id=process_id,
            num_processes=len(members),
            # With a state sharded over a slice, a process's shards may be nowhere else: every member lists
            # its replica files too, so the group can roll back to a step the slice holds whole.
            read_files=strategy != Strategy.REFORM or controller.config.slice_size > 1,
            faults=worker_faults_text(controller.config.faults, process_id) if strategy == Strategy.START else "",
            at_step=form.at_step,
            run_id=controller.result.run_id,
            slice_size=controller.config.slice_size,
            durable_dir=controller.config.durable_dir or "",
            durable_every=controller.config.durable_every,
            file_every=file_cadence(controller.config, len(members)),
            file_after_s=controller.config.hang_timeout_s / 2,  # written before the hang verdict
            neighbour_replicas=controller.config.neighbour_replicas,
            fences=dict(controller.group.fences),
            programs=controller.programs,
            min_processes=controller.config.min_nprocs or len(members),
        )
        await controller.server.send(controller.pool[worker], message)


def fill_seats(controller: ControllerState, action: FillSeats) -> None:
    """Start the stand-ins for a given-up generation's lost seats (``standin.py``); they end by themselves."""
    if os.environ.get(ENV_SIMULATED) == "1":
        return  # simulated workers wait in no JAX start
    # Imported here: ``python -m`` runs the module, which must not be imported with this package before.
    from elastic_runtime.cluster.controller.standin import command as standin_command

    path = controller.pool.logs / f"standin-{action.generation}.log"
    log.info("generation %d: stand-ins fill seats %s (log %s)", action.generation, action.seats, path)
    with open(path, "ab") as out:
        command = standin_command(action.coordinator, action.seats)
        controller.standins.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT))


def file_cadence(config: LaunchConfig, members: int) -> int:
    """Steps between a member's replica files: ``config.replica_file_every`` where a lost member's state is in
    every survivor's memory (one process per slice, two or more, re-formed in place), else every step (its shards
    may be nowhere else, the recovery restarts every process, or a loss ends the run)."""
    in_memory = config.slice_size == 1 and members >= 2 and config.strategy == Strategy.REFORM
    # With no failure to survive, a loss ends the run, and a rerun resumes from the files.
    return config.replica_file_every if in_memory and config.max_failures > 0 else 1


def save_fences_now(controller: ControllerState) -> None:
    save_fences(controller.run_dir, controller.record.run_id, controller.group.generation, controller.group.fences)
