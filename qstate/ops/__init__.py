"""Op handlers of :class:`~qstate.QuantizedState`, one module per family.

Importing this package fills :data:`DISPATCH_TABLE`; ``registered_ops()`` lists it.
"""

from .._op_table import DISPATCH_TABLE, dispatch, register, registered_ops
from . import collectives, copy, foreach, layout, math  # noqa: F401  (registers handlers)

__all__ = ["DISPATCH_TABLE", "dispatch", "register", "registered_ops"]
