"""A user's own handler file, the same in both modes (``train.py`` beside it imports it as ``handlers``: the name
the library's own package had before it moved to ``elastic_runtime.handlers``).

Each handler writes what it saw as a JSON line into ``$USER_HANDLERS_OUT/<what>.jsonl`` (appended to by every
process that runs it), so the test can count who ran what.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from elastic_runtime import Failure, HandlerContext, MeshChanged, RunFinished


def record(what: str, **fields: Any) -> None:
    line = json.dumps(fields | {"pid": os.getpid()})
    with (Path(os.environ["USER_HANDLERS_OUT"]) / f"{what}.jsonl").open("a") as out:
        out.write(line + "\n")


def subscribe(runtime: Any) -> None:
    """The script's handlers, on its ``ElasticRuntime``."""

    @runtime.on(MeshChanged)
    async def follow_the_data_axis(event: MeshChanged, ctx: HandlerContext) -> None:
        """In every process: the learning rate follows the data-parallel size (kept in the state)."""
        ratio = event.new_shape["data"] / event.old_shape["data"]
        record("mesh", old=event.old_shape["data"], new=event.new_shape["data"], process=ctx.process_id)
        ctx.transform_state(lambda state: {**state, "lr": state["lr"] * ratio}, f"lr x {ratio:g}")

    @runtime.on(Failure, once=True)
    async def page_someone(event: Failure, ctx: HandlerContext) -> None:
        """Once per failure, whatever the number of processes."""
        record("page", failure=type(event).__name__, step=event.step, lead=ctx.lead)

    @runtime.on(RunFinished)
    async def finished(event: RunFinished, ctx: HandlerContext) -> None:
        record("finished", ok=event.ok, mode=ctx.mode)
