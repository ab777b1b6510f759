"""The built-in parts, wired in one place: what a runtime (``elastic_runtime.defaults.elastic``) or a controller
(``elastic_runtime.defaults.controller``) gets unless told otherwise. The core (``runtime/core``) knows no handler,
tier or notice source by name; these modules subscribe the built-in ones through the calls a user makes.

Each name is imported on first use (``elastic_runtime.core.lazy``), so a controller never imports JAX.
"""

from typing import TYPE_CHECKING

from elastic_runtime.core.lazy import lazy_exports

__all__ = [
    "ElasticRuntime",
    "Maintenance",
    "attach_controller_maintenance",
    "attach_maintenance",
    "default_controller",
    "intake_from_config",
    "ray_controller",
    "under_launch",
    "watch_own_host",
]

if TYPE_CHECKING:
    from elastic_runtime.defaults.controller import attach_controller_maintenance, default_controller, ray_controller
    from elastic_runtime.defaults.elastic import (
        ElasticRuntime,
        Maintenance,
        attach_maintenance,
        intake_from_config,
        under_launch,
        watch_own_host,
    )

_HOMES = {
    "elastic_runtime.defaults.controller": ["attach_controller_maintenance", "default_controller", "ray_controller"],
    "elastic_runtime.defaults.elastic": [
        "ElasticRuntime",
        "Maintenance",
        "attach_maintenance",
        "intake_from_config",
        "under_launch",
        "watch_own_host",
    ],
}
__getattr__ = lazy_exports(__name__, _HOMES)
