"""The context: its assembly from the API-family mixins and a backend's DeviceOps
(:mod:`~iris.context.assembly`), the host exchange between ranks (:mod:`~iris.context.bootstrap`),
the fail-stop guard of every call (:mod:`~iris.context.failstop`) and the nodes a world spans
(:mod:`~iris.context.nodes`)."""

from iris.context.assembly import Context, ContextBase, check_needs, context_class, create, iris

__all__ = ["Context", "ContextBase", "check_needs", "context_class", "create", "iris"]
