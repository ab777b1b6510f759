"""Write your own recovery handler: here, wait a little for a lost slice to come back before shrinking.

The built-in chain is failure -> remesh -> restore -> resume, each link a handler. This example replaces the
first link: on a lost slice it gives the slice ``GRACE_S`` seconds to return (think of a TPU slice being
replaced) and only shrinks the mesh if it does not. The built-in restore handler does the rest.

Run it:  .venv/bin/python examples/custom_handler.py
"""

from __future__ import annotations

import time

import anyio
import jax

jax.config.update("jax_num_cpu_devices", 8)

from elastic_runtime import (  # noqa: E402
    DeviceLost,
    ElasticRuntime,
    MeshChanged,
    MeshPolicy,
    RuntimeConfig,
    RuntimeContext,
    ScaleUpAvailable,
)
from elastic_runtime.handlers import restore_after_remesh, scale_up  # noqa: E402
from elastic_runtime.testing import FaultInjector  # noqa: E402
from elastic_runtime.testing.demo_model import demo_job  # noqa: E402

GRACE_S = 1.0


async def wait_then_remesh(event: DeviceLost, ctx: RuntimeContext) -> None:
    """On DeviceLost: poll for GRACE_S seconds for the full mesh, then take what the policy can build."""
    deadline = anyio.current_time() + GRACE_S
    while anyio.current_time() < deadline:
        healthy = await ctx.healthy_devices()
        if len(healthy) >= ctx.policy.target_size:
            break
        await anyio.sleep(0.1)
    mesh = ctx.policy.fit(await ctx.healthy_devices())
    print(f"  lost {list(event.devices)} at step {event.step}; continuing on {dict(mesh.shape)}")
    ctx.remesh(mesh, reason=f"{type(event).__name__} after a {GRACE_S} s grace period")


class SliceReplacement:
    """Stands in for the cloud replacing a failed slice: brings dead devices back ``after_s`` seconds later."""

    def __init__(self, injector: FaultInjector, after_s: float) -> None:
        self.injector = injector
        self.after_s = after_s

    async def run(self, ctx: RuntimeContext) -> None:
        while True:
            await anyio.sleep(0.05)
            if dead := self.injector.dead:
                await anyio.sleep(self.after_s)
                self.injector.repair_now(dead)


def main() -> None:
    policy = MeshPolicy({"data": 4, "model": 2}, global_batch=96, slice_size=2)
    injector = FaultInjector()
    injector.lose_slice(at_step=20, slice_index=1, slice_size=2)
    runtime = injector.attach(
        ElasticRuntime(
            demo_job(),
            config=RuntimeConfig(
                run_dir=time.strftime("runs/custom-handler-%Y%m%d-%H%M%S"), handler_timeout_s=GRACE_S + 10
            ),
            mesh_policy=policy,
            default_handlers=False,  # we subscribe the chain ourselves, with our own first link
        )
    )
    runtime.subscribe(DeviceLost, wait_then_remesh)
    runtime.subscribe(MeshChanged, restore_after_remesh)
    runtime.subscribe(ScaleUpAvailable, scale_up)

    runtime.add_component(SliceReplacement(injector, after_s=0.3))
    result = runtime.run(steps=40)
    print(f"mesh history: {result.mesh_history}; loss {result.loss:.5f}")


if __name__ == "__main__":
    main()
