"""The from-scratch trainable MoE: gates, balancing losses, Switch routing, layer, LM, trainer.

Only the light modules (gates, losses, switch: torch only) are imported here; the LM and trainer
(transformers) are imported from their own modules. To add exports, append an import line and
extend ``__all__`` below it.
"""

from moee.moe.gates import (
    BatchwiseBalancedGate,
    ExpertChoiceGate,
    GateOutput,
    HierarchicalGate,
    Hierarchy,
    LossFreeBalancedGate,
    NoisyTopKGate,
    SoftmaxGate,
    top_k_gating,
)
from moee.moe.losses import (
    cv_squared,
    importance_loss,
    keep_top_k,
    kth_excluding,
    load_loss,
    prob_in_top_k,
    router_z_loss,
    switch_aux_loss,
)
from moee.moe.switch import SwitchFFN, SwitchRouter, SwitchRouting, switch_capacity, switch_route

__all__ = [
    "BatchwiseBalancedGate",
    "ExpertChoiceGate",
    "GateOutput",
    "HierarchicalGate",
    "Hierarchy",
    "LossFreeBalancedGate",
    "NoisyTopKGate",
    "SoftmaxGate",
    "top_k_gating",
    "cv_squared",
    "importance_loss",
    "keep_top_k",
    "kth_excluding",
    "load_loss",
    "prob_in_top_k",
    "router_z_loss",
    "switch_aux_loss",
    "SwitchFFN",
    "SwitchRouter",
    "SwitchRouting",
    "switch_capacity",
    "switch_route",
]
