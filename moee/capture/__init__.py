"""Router capture: find every MoE router of a model and record its dense routing with hooks."""

from moee.capture.architectures import ARCHITECTURES, ROUTER_CLASSES
from moee.capture.recorder import RoutingRecorder
from moee.capture.registry import (
    DEFAULT_SCORE,
    MODEL_TYPE_RULES,
    RULES,
    SCORES,
    SELECTION_FORMATS,
    RouterSpec,
    apply_score,
    find_routers,
    find_routers_by_pattern,
    read_selection,
    router_report,
    selection_scores,
    supported_architectures,
)

__all__ = [
    "ARCHITECTURES",
    "DEFAULT_SCORE",
    "MODEL_TYPE_RULES",
    "ROUTER_CLASSES",
    "RULES",
    "SCORES",
    "SELECTION_FORMATS",
    "RouterSpec",
    "RoutingRecorder",
    "apply_score",
    "find_routers",
    "find_routers_by_pattern",
    "read_selection",
    "router_report",
    "selection_scores",
    "supported_architectures",
]
