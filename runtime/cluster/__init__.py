"""Multi-process mode: the controller, its worker processes, their protocol and heartbeats."""

__all__: list[str] = []
