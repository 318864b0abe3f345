"""Router capture: find every MoE router of a model and record its dense routing with hooks."""

from moee.capture.recorder import RoutingRecorder
from moee.capture.registry import (
    MODEL_TYPE_RULES,
    RULES,
    RouterSpec,
    apply_score,
    find_routers,
    find_routers_by_pattern,
    router_report,
    supported_architectures,
)

__all__ = [
    "MODEL_TYPE_RULES",
    "RULES",
    "RouterSpec",
    "RoutingRecorder",
    "apply_score",
    "find_routers",
    "find_routers_by_pattern",
    "router_report",
    "supported_architectures",
]
