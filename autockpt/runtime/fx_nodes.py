"""Which fx nodes are units: the one definition the capture, the trace and the rewriter share.

It lives with the runtime, the lowest of the three, so that the rewriter needs nothing of the measuring stage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import fx

COMPUTE_OPS = ("call_function", "call_method", "call_module")


def compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The fx nodes that are units, in execution order."""
    return [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
